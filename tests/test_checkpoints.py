"""checkpoints/: storage formats, official schema, name mapping, the checked reader, the writer, and the HF
reference fixtures in tests/hf_reference.py."""
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import hf_reference as H
from checkpoints import (CheckpointError, map_name, official_shapes, official_specs, open_checkpoint,
                         storage_roundtrip, write_official_checkpoint)
from checkpoints import formats as F
from checkpoints.reader import _ST_DTYPES, read_header
from checkpoints.schema import scale_name
from v4jax.config import ConfigError, ModelConfig, preset

torch = pytest.importorskip("torch")


# ---- helpers -------------------------------------------------------------------------------------------
def _cfg_odd() -> ModelConfig:
    """Dims that leave partial FP8 blocks (160, 96, 320) and several FP4 blocks per row; no HF needed."""
    return H.cfg_small_ratios().replace(dim=160, moe_inter_dim=96, q_lora_rank=96, vocab_size=300, n_layers=3,
                                        layer_types=("sliding", "csa", "hca"), compress_ratios=(0, 4, 8),
                                        n_hash_layers=1)


def _load_raw(dir) -> dict[str, np.ndarray]:
    """Every stored tensor of a dir, exactly as stored (names and dtypes)."""
    out = {}
    for f in sorted(os.listdir(dir)):
        if f.endswith(".safetensors"):
            tensors, _ = read_header(os.path.join(dir, f))
            with open(os.path.join(dir, f), "rb") as fh:
                for name, st in tensors.items():
                    fh.seek(st.start)
                    out[name] = np.frombuffer(fh.read(st.nbytes), np.uint8).view(_ST_DTYPES[st.dtype]).reshape(
                        st.shape)
    return out


def _rewrite(src, dst, drop=(), put=None):
    """Copy a single-file checkpoint dir, dropping / replacing stored tensors."""
    from safetensors.numpy import save_file
    shutil.copytree(src, dst)
    raw = _load_raw(src)
    for k in drop:
        del raw[k]
    raw.update(put or {})
    os.remove(os.path.join(dst, "model.safetensors"))
    save_file({k: np.ascontiguousarray(v) for k, v in raw.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def _read_all(ckpt):
    return dict(ckpt.iter_tensors(progress=False))


@pytest.fixture(scope="module")
def small():
    cfg = H.cfg_small_ratios()
    return cfg, H.build_hf_model(cfg, seed=0)


@pytest.fixture(scope="module")
def small_official(small):
    """HF weights + random MTP, in official names."""
    cfg, model = small
    t = H.hf_state_as_official(model)
    t.update({k: v for k, v in H.random_official_tensors(cfg, 0, include_mtp=True).items() if k.startswith("mtp.")})
    return t


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory, small, small_official):
    d = tmp_path_factory.mktemp("official_fp8")
    write_official_checkpoint(d, small[0], small_official, fp8=True, fp4_experts=True)
    return str(d)


# ---- formats ---------------------------------------------------------------------------------------------
def test_pow2_scale_exponent_is_exact():
    k = np.arange(-20, 21)
    amax = np.ldexp(448.0, k)
    assert (F.pow2_scale_exponent(amax, 448.0) == k).all()
    assert (F.pow2_scale_exponent(np.nextafter(amax, np.inf), 448.0) == k + 1).all()
    assert (F.pow2_scale_exponent(np.nextafter(amax, 0), 448.0) == k).all()
    assert F.pow2_scale_exponent(np.array([0.0]), 6.0)[0] == -127


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (5, 7)])
def test_fp8_exact_round_trip_on_representable_values(shape, rng):
    gr, gc = -(-shape[0] // 128), -(-shape[1] // 128)
    codes = rng.integers(0, 256, shape).astype(np.uint8).view(F.E4M3)
    codes = np.where(np.isnan(codes.astype(np.float32)), np.zeros_like(codes), codes)  # drop the NaN codes
    c32 = codes.astype(np.float32)
    # each block's amax must be in (224, 448] so that its scale is recovered exactly: plant +-448 per block
    for i in range(gr):
        for j in range(gc):
            c32[i * 128, j * 128] = 448.0 if (i + j) % 2 else -448.0
    codes = c32.astype(F.E4M3)
    scale = F.e8m0_from_exponent(rng.integers(-30, 10, (gr, gc)))
    w = F.dequant_fp8_blocks(codes, scale)
    q, s = F.quant_fp8_blocks(w)
    assert q.dtype == F.E4M3 and s.dtype == F.E8M0 and s.shape == (gr, gc)
    assert np.array_equal(s.view(np.uint8), scale.view(np.uint8))
    assert np.array_equal(q.view(np.uint8), codes.view(np.uint8))
    assert np.array_equal(F.dequant_fp8_blocks(q, s), w)


def test_fp8_error_within_format_bound(rng):
    w = rng.standard_normal((300, 260)).astype(np.float32) * np.float32(0.02)
    w[:128, :128] *= 1e4  # blocks of very different magnitudes
    w[128:256, 128:256] = 0.0  # an all-zero block
    w[256:, :5] = 1e-30
    q, s = F.quant_fp8_blocks(w)
    assert s.shape == (3, 3)
    back = F.dequant_fp8_blocks(q, s)
    full = F._expand_blocks(F.e8m0_to_float(s).astype(np.float64), 300, 260, 128, 128)
    assert (np.abs(back - w) <= F.fp8_error_bound(w, full) * (1 + 1e-6)).all()
    assert (np.abs(w) <= 448 * full).all() and (np.abs(w) > 224 * full)[:128, :128].any()
    assert (back[128:256, 128:256] == 0).all()


def test_fp4_codes_round_to_nearest_ties_to_even(rng):
    pos = F.FP4_VALUES[:8].astype(np.float64)
    x = np.concatenate([rng.uniform(-7, 7, 5000), (pos[1:] + pos[:-1]) / 2, -(pos[1:] + pos[:-1]) / 2, [0, -0.0]])
    codes = F.fp4_codes(x)
    # brute force: nearest value, ties to the even code (mantissa bit 0), saturating at 6
    mag = np.clip(np.abs(x), 0, 6)
    d = np.abs(mag[:, None] - pos[None, :])
    best = d.min(1, keepdims=True)
    cand = d == best
    pick = np.where(cand.sum(1) > 1, np.argmax(cand & (np.arange(8) % 2 == 0)[None], 1), np.argmax(cand, 1))
    want = pick + 8 * np.signbit(x)
    assert np.array_equal(codes, want.astype(np.uint8))
    assert np.array_equal(F.FP4_VALUES[F.fp4_codes(np.array([0.25, 0.75, 1.25, 2.5, 3.5, 5.0]))],
                          np.array([0, 1, 1, 2, 4, 4], np.float32))


def test_fp4_nibble_order():
    packed = F.pack_fp4(np.array([[2, 7, 9, 0]], np.uint8))  # values 1, 6, -0.5, 0
    assert packed.dtype == np.int8 and packed.view(np.uint8).tolist() == [[0x72, 0x09]]
    out = F.unpack_fp4(packed, F.e8m0_from_exponent(np.array([[1]])), block=32)
    assert out.tolist() == [[2.0, 12.0, -1.0, 0.0]]


@pytest.mark.parametrize("shape", [(6, 96), (3, 80)])
def test_fp4_exact_round_trip_on_representable_values(shape, rng):
    rows, cols = shape
    nb = -(-cols // 32)
    codes = rng.integers(0, 16, shape).astype(np.uint8)
    codes[:, ::32] = rng.choice(np.array([7, 15], np.uint8), (rows, nb))  # a +-6 in every block
    scale = F.e8m0_from_exponent(rng.integers(-20, 20, (rows, nb)))
    packed = F.pack_fp4(codes)
    w = F.unpack_fp4(packed, scale)
    assert w.shape == shape
    q, s = F.quant_fp4(w)
    assert np.array_equal(s.view(np.uint8), scale.view(np.uint8))
    assert np.array_equal(q, packed)
    assert np.array_equal(F.unpack_fp4(q, s), w)


def test_fp4_error_within_format_bound(rng):
    w = (rng.standard_normal((16, 128)) * np.repeat(10.0 ** rng.integers(-3, 3, (16, 4)), 32, 1)).astype(np.float32)
    q, s = F.quant_fp4(w)
    assert q.shape == (16, 64) and s.shape == (16, 4)
    back = F.unpack_fp4(q, s)
    full = np.repeat(F.e8m0_to_float(s).astype(np.float64), 32, 1)
    assert (np.abs(back - w) <= F.fp4_error_bound(w, full) * (1 + 1e-6)).all()
    assert (np.abs(w) <= 6 * full).all()


def test_dequant_matches_hf_fine_grained_fp8(rng):
    """Our FP8 / FP4 decoding equals transformers' own (integrations.finegrained_fp8), on whole blocks."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    def as_torch(a, dt):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy()).view(dt)

    dq = Fp8Dequantize(None)
    q, s = F.quant_fp8_blocks(rng.standard_normal((256, 384)).astype(np.float32) * 0.05)
    hf = dq._dequantize_one(as_torch(q, torch.float8_e4m3fn), as_torch(s, torch.float8_e8m0fnu),
                            output_dtype=torch.float32).numpy()
    assert np.array_equal(hf, F.dequant_fp8_blocks(q, s))
    q, s = F.quant_fp4(rng.standard_normal((64, 256)).astype(np.float32) * 0.05)
    hf = dq._dequantize_one(torch.from_numpy(q.copy()), as_torch(s, torch.float8_e8m0fnu),
                            output_dtype=torch.float32).numpy()
    assert np.array_equal(hf, F.unpack_fp4(q, s))


# ---- schema and names ------------------------------------------------------------------------------------
def test_official_shapes_flash_and_pro_counts():
    """The Flash dump has 69,187 tensors and the Pro index 145,116 entries (reference §8.2 / §8.3)."""
    for name, total in (("flash", 69187), ("pro", 145116)):
        specs = official_specs(preset(name), include_mtp=True)
        assert len(specs) + sum(s.kind in ("fp8", "fp4") for s in specs.values()) == total, name
    s = official_shapes(preset("flash"), include_mtp=True)
    assert s["layers.0.ffn.experts.5.w1.weight"] == (2048, 4096)  # logical, stored packed [2048, 2048]
    assert s["layers.0.ffn.experts.5.w2.weight"] == (4096, 2048)
    assert s["layers.2.attn.compressor.ape"] == (4, 1024) and s["layers.3.attn.compressor.ape"] == (128, 512)
    assert s["layers.2.attn.indexer.compressor.ape"] == (4, 256)
    assert s["layers.0.attn.wo_a.weight"] == (8192, 4096) and s["layers.0.attn.wq_b.weight"] == (32768, 1024)
    assert s["layers.5.hc_attn_fn"] == (24, 16384) and s["hc_head_fn"] == (4, 16384)
    assert "layers.2.ffn.gate.tid2eid" in s and "layers.2.ffn.gate.bias" not in s
    assert "layers.3.ffn.gate.bias" in s and "layers.3.ffn.gate.tid2eid" not in s
    assert "layers.0.attn.compressor.wkv.weight" not in s  # sliding layers have no compressor
    assert s["mtp.0.e_proj.weight"] == (4096, 4096) and "mtp.0.ffn.gate.bias" in s
    assert "mtp.0.attn.compressor.ape" not in s and "mtp.0.ffn.gate.tid2eid" not in s
    assert not any(k.startswith("mtp.") for k in official_shapes(preset("flash"), include_mtp=False))
    p = official_shapes(preset("pro"), include_mtp=False)
    assert p["layers.0.attn.compressor.ape"] == (128, 512) and p["layers.0.ffn.experts.0.w1.weight"] == (3072, 7168)


def test_name_mapping():
    cfg = H.cfg_small_ratios()
    specs = official_specs(cfg, include_mtp=True)
    for k, s in specs.items():  # official names (and scales) pass through
        assert map_name(k).official == k
        if s.kind in ("fp8", "fp4"):
            assert map_name(scale_name(k)).official == scale_name(k)
    cases = {
        "model.embed_tokens.weight": "embed.weight", "head.weight": "head.weight", "lm_head.weight": "head.weight",
        "model.hc_head.hc_fn": "hc_head_fn", "model.norm.weight": "norm.weight",
        "model.layers.1.attn.norm.weight": "layers.1.attn.kv_norm.weight",
        "model.layers.1.attn.compressor.norm.weight": "layers.1.attn.compressor.norm.weight",
        "model.layers.1.self_attn.kv_norm.weight": "layers.1.attn.kv_norm.weight",
        "model.layers.1.self_attn.compressor.kv_norm.weight": "layers.1.attn.compressor.norm.weight",
        "model.layers.1.self_attn.compressor.indexer.kv_norm.weight": "layers.1.attn.indexer.compressor.norm.weight",
        "model.layers.1.self_attn.compressor.indexer.position_bias": "layers.1.attn.indexer.compressor.ape",
        "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight":
            "layers.1.attn.indexer.weights_proj.weight",
        "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight": "layers.1.attn.indexer.wq_b.weight",
        "model.layers.0.self_attn.q_a_proj.weight": "layers.0.attn.wq_a.weight",
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": "layers.0.attn.wq_a.scale",
        "model.layers.0.self_attn.sinks": "layers.0.attn.attn_sink",
        "model.layers.0.attn_hc.scale": "layers.0.hc_attn_scale",
        "model.layers.0.input_layernorm.weight": "layers.0.attn_norm.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
        "model.layers.3.mlp.shared_experts.up_proj.weight": "layers.3.ffn.shared_experts.w3.weight",
    }
    for stored, off in cases.items():
        assert map_name(stored).official == off, stored
    gu = map_name("model.layers.2.mlp.experts.gate_up_proj")
    assert gu.expand(2) == ["layers.2.ffn.experts.0.w1.weight", "layers.2.ffn.experts.0.w3.weight",
                            "layers.2.ffn.experts.1.w1.weight", "layers.2.ffn.experts.1.w3.weight"]
    assert map_name("model.layers.2.mlp.experts.down_proj").expand(1) == ["layers.2.ffn.experts.0.w2.weight"]
    assert map_name("mtp.0.head.weight").ignored


# ---- the HF reference fixtures -----------------------------------------------------------------------------
def test_hf_model_fully_randomised_and_clamp_active(small):
    cfg, model = small
    for n, p in model.named_parameters():
        a = p.detach().numpy()
        assert np.unique(a).size > min(a.size, 1) or a.size == 1, n  # nothing left constant (0 or 1)
        if a.size == 1:
            assert a.item() not in (0.0, 1.0), n
    bufs = dict(model.named_buffers())
    tid = bufs["model.layers.0.mlp.gate.tid2eid"].numpy()
    assert all(len(set(r)) == r.size for r in tid) and tid.min() >= 0 and tid.max() < cfg.n_routed_experts
    assert len({tuple(r) for r in tid}) > 10
    assert np.abs(bufs["model.layers.2.mlp.gate.e_score_correction_bias"].numpy()).min() > 0
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 48)
    stats = H.swiglu_clamp_stats(model, ids)
    assert 0.02 < stats["routed"] < 0.9 and stats["shared"] > 0, stats
    again = H.build_hf_model(cfg, seed=0)
    assert np.array_equal(H.hf_logits(again, ids), H.hf_logits(model, ids))
    lg = H.hf_logits(model, ids)
    assert lg.shape == (48, cfg.vocab_size) and lg.dtype == np.float32 and np.isfinite(lg).all()


def test_hf_state_matches_random_official_tensors(small):
    cfg, model = small
    st = H.hf_state_as_official(model)
    ref = H.random_official_tensors(cfg, 0, include_mtp=False)
    assert set(st) == set(official_shapes(cfg, False)) == set(ref)
    for k in st:
        assert np.array_equal(st[k], ref[k]), k


# ---- reading ------------------------------------------------------------------------------------------------
def test_save_pretrained_dir_loads(tmp_path, small):
    cfg, model = small
    d = H.save_hf(model, tmp_path / "sp")
    stored = set(_load_raw(d))
    assert "model.layers.1.attn.norm.weight" in stored and "head.weight" in stored  # the save quirk
    for c in (cfg, None):  # explicit cfg, or the dir's own config.json
        ckpt = open_checkpoint(d, c)
        assert not ckpt.has_mtp and ckpt.layout == "save_pretrained"
        assert set(ckpt.names) == set(official_shapes(cfg, include_mtp=False))
    want = H.hf_state_as_official(model)
    got = _read_all(ckpt)
    assert list(got) == ckpt.names
    for k, v in want.items():
        assert got[k].dtype == (np.int32 if k.endswith("tid2eid") else np.float32)
        assert np.array_equal(got[k], v), k


def test_sharded_save_pretrained_and_hf_module_names(tmp_path, small):
    from safetensors.torch import save_file
    cfg, model = small
    d = H.save_hf(model, tmp_path / "sp_sharded", max_shard_size="100KB")
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1
    want = H.hf_state_as_official(model)
    got = _read_all(open_checkpoint(d, cfg))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)

    m = tmp_path / "modules"
    m.mkdir()
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if ".rotary_emb." not in k}
    save_file(sd, str(m / "model.safetensors"))
    ckpt = open_checkpoint(m, cfg)
    assert ckpt.layout == "hf_modules" and ckpt.stored_name("layers.2.ffn.experts.3.w3.weight") == \
        "model.layers.2.mlp.experts.gate_up_proj"
    got = _read_all(ckpt)
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_official_quantized_dir_loads(quant_dir, small, small_official):
    cfg, _ = small
    conf = json.load(open(os.path.join(quant_dir, "config.json")))
    assert conf["quantization_config"]["weight_block_size"] == [128, 128] and conf["expert_dtype"] == "fp4"
    assert ModelConfig.from_hf(quant_dir) == cfg
    ckpt = open_checkpoint(quant_dir, cfg)
    assert ckpt.has_mtp and ckpt.layout == "official"
    assert set(ckpt.names) == set(official_shapes(cfg, include_mtp=True))
    dt = {"layers.1.attn.wq_a.weight": "F8_E4M3", "layers.1.ffn.experts.0.w2.weight": "I8",
          "layers.1.attn_norm.weight": "BF16", "layers.1.hc_ffn_fn": "F32", "layers.0.ffn.gate.tid2eid": "I64",
          "layers.1.attn.compressor.wkv.weight": "BF16", "mtp.0.e_proj.weight": "F8_E4M3",
          "layers.1.attn.indexer.wq_b.weight": "F8_E4M3", "layers.3.ffn.gate.bias": "F32"}
    for k, v in dt.items():
        assert ckpt.stored_dtype(k) == v, k
    raw = _load_raw(quant_dir)
    assert raw["layers.1.ffn.experts.0.w1.scale"].shape == (32, 2) and raw["layers.1.ffn.experts.0.w1.weight"].shape \
        == (32, 32) and raw["layers.1.attn.wq_b.scale"].shape == (4, 1)
    for k, v in ckpt.iter_tensors(progress=True):
        want = storage_roundtrip(cfg, k, small_official[k])
        assert v.shape == official_shapes(cfg, True)[k] and np.array_equal(v, want), k
        if v.dtype == np.float32:  # and close to the original (FP4 worst case: half of step 2 at scale amax/3)
            assert np.abs(v - small_official[k]).max() <= np.abs(small_official[k]).max() / 3 + 1e-7, k


def test_official_odd_shapes_and_sharding(tmp_path):
    cfg = _cfg_odd()
    t = H.random_official_tensors(cfg, seed=3, include_mtp=True)
    one = tmp_path / "one"
    write_official_checkpoint(one, cfg, t)
    sharded = tmp_path / "sharded"
    files = write_official_checkpoint(sharded, cfg, t, shard_max_bytes=60_000)
    idx = json.load(open(sharded / "model.safetensors.index.json"))
    shards = set(idx["weight_map"].values())
    assert len(shards) > 3 and all(idx["weight_map"][scale_name(k)] == idx["weight_map"][k]
                                   for k, s in official_specs(cfg, True).items() if s.kind in ("fp8", "fp4"))
    assert len(files) == len(shards) + 2
    a, b = open_checkpoint(one, cfg), open_checkpoint(sharded, cfg)
    assert a.has_mtp and b.has_mtp and set(a.names) == set(b.names)
    got_a, got_b = _read_all(a), _read_all(b)
    assert _load_raw(one)["layers.0.attn.wq_a.scale"].shape == (1, 2)  # partial 128-blocks: [96, 160]
    for k in got_a:
        assert np.array_equal(got_a[k], got_b[k]), k
        assert np.array_equal(got_a[k], storage_roundtrip(cfg, k, t[k])), k
    # mtp=False drops the MTP block; it then loads with has_mtp False
    nomtp = tmp_path / "nomtp"
    write_official_checkpoint(nomtp, cfg, t, mtp=False, fp8=False, bf16=False)
    c = open_checkpoint(nomtp, cfg)
    assert not c.has_mtp and c.stored_dtype("layers.1.ffn.experts.0.w1.weight") == "I8"
    assert c.stored_dtype("layers.1.attn.wq_a.weight") == "F32"
    assert np.array_equal(c.read("layers.1.attn.wq_b.weight"), t["layers.1.attn.wq_b.weight"])


def test_hf_loads_our_official_float_dir(tmp_path, small, small_official):
    """Our official names are the ones HF's own conversion mapping expects (MTP is ignored by HF)."""
    from transformers import DeepseekV4ForCausalLM
    cfg, model = small
    d = tmp_path / "f32"
    write_official_checkpoint(d, cfg, small_official, fp8=False, fp4_experts=False, bf16=False)
    H._quiet_transformers()
    loaded = DeepseekV4ForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ref = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref[k]), k


# ---- errors ------------------------------------------------------------------------------------------------
def _err(path, cfg=None) -> str:
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path, cfg)
    return str(e.value)


def test_error_missing_unexpected_misshaped(tmp_path, quant_dir, small):
    cfg, _ = small
    m = _err(_rewrite(quant_dir, tmp_path / "missing", drop=["layers.1.attn.wq_a.weight",
                                                             "layers.1.attn.wq_a.scale"]), cfg)
    assert "missing tensor 'layers.1.attn.wq_a.weight'" in m
    m = _err(_rewrite(quant_dir, tmp_path / "extra", put={"layers.0.attn.foo.weight": np.zeros(3, np.float32)}), cfg)
    assert "unexpected tensor 'layers.0.attn.foo.weight'" in m
    m = _err(_rewrite(quant_dir, tmp_path / "shape", put={"layers.2.attn.compressor.ape": np.zeros((4, 128),
                                                                                                   np.float32)}), cfg)
    assert "'layers.2.attn.compressor.ape'" in m and "[4, 128], expected [8, 128]" in m
    m = _err(_rewrite(quant_dir, tmp_path / "fp4shape", put={"layers.1.ffn.experts.2.w1.weight": np.zeros(
        (32, 64), np.int8)}), cfg)
    assert "'layers.1.ffn.experts.2.w1.weight'" in m and "expected [32, 32] (packed FP4" in m


def test_error_scales_and_dtypes(tmp_path, quant_dir, small):
    cfg, _ = small
    m = _err(_rewrite(quant_dir, tmp_path / "noscale", drop=["layers.0.attn.wkv.scale"]), cfg)
    assert "missing tensor 'layers.0.attn.wkv.scale'" in m
    m = _err(_rewrite(quant_dir, tmp_path / "badscale", put={
        "layers.0.attn.wkv.scale": np.ones((2, 1), np.float32)}), cfg)
    assert "'layers.0.attn.wkv.scale'" in m and "expected [1, 1]" in m
    m = _err(_rewrite(quant_dir, tmp_path / "baddtype", put={
        "layers.0.attn_norm.weight": np.ones(64, ml_dtypes.float8_e4m3fn)}), cfg)
    assert "'layers.0.attn_norm.weight'" in m and "dtype F8_E4M3" in m
    m = _err(_rewrite(quant_dir, tmp_path / "strayscale", put={"layers.0.attn_norm.scale": np.ones((1, 1),
                                                                                                ml_dtypes.float8_e8m0fnu)}), cfg)
    assert "'layers.0.attn_norm.scale'" in m
    m = _err(_rewrite(quant_dir, tmp_path / "mtp_partial", drop=["mtp.0.e_proj.weight", "mtp.0.e_proj.scale"]), cfg)
    assert "missing tensor 'mtp.0.e_proj.weight'" in m and "mtp.* tensors are present" in m
    bad = _rewrite(quant_dir, tmp_path / "tid", put={"layers.0.ffn.gate.tid2eid": np.full((512, 2), 8, np.int64)})
    ckpt = open_checkpoint(bad, cfg)  # values are checked when read
    with pytest.raises(CheckpointError, match="layers.0.ffn.gate.tid2eid"):
        ckpt.read("layers.0.ffn.gate.tid2eid")


def test_error_index_names_missing_shard(tmp_path):
    cfg = _cfg_odd()
    t = H.random_official_tensors(cfg, 1, include_mtp=False)
    d = tmp_path / "sharded"
    write_official_checkpoint(d, cfg, t, shard_max_bytes=60_000)
    idx = json.load(open(d / "model.safetensors.index.json"))
    victim = sorted(set(idx["weight_map"].values()))[1]
    os.remove(d / victim)
    m = _err(d, cfg)
    assert f"names shard '{victim}'" in m and "does not exist" in m
    # an index that puts a tensor in the wrong (existing) shard
    write_official_checkpoint(d, cfg, t, shard_max_bytes=60_000, overwrite=True)
    wrong = idx["weight_map"]["embed.weight"]
    assert idx["weight_map"]["layers.0.attn.wq_a.weight"] != wrong
    idx["weight_map"]["layers.0.attn.wq_a.weight"] = wrong
    json.dump(idx, open(d / "model.safetensors.index.json", "w"))
    m = _err(d, cfg)
    assert f"puts tensor 'layers.0.attn.wq_a.weight' in '{wrong}', which does not hold it" in m


def test_error_wrong_config_and_unsupported_config(tmp_path, small):
    cfg, model = small
    d = H.save_hf(model, tmp_path / "sp")
    m = _err(d, cfg.replace(n_routed_experts=16))
    assert "missing tensor 'layers.0.ffn.experts.8.w1.weight'" in m and "expected [16, 64]" in m
    conf = json.load(open(os.path.join(d, "config.json")))
    conf["num_key_value_heads"] = 2
    json.dump(conf, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelConfig.from_hf(d)
    assert "num_key_value_heads" in _err(d)
    # HF module names with a mis-shaped stacked expert tensor name both spellings
    from safetensors.torch import save_file
    mdir = tmp_path / "modules"
    mdir.mkdir()
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if ".rotary_emb." not in k}
    sd["model.layers.2.mlp.experts.down_proj"] = sd["model.layers.2.mlp.experts.down_proj"][:, :, :16].contiguous()
    save_file(sd, str(mdir / "model.safetensors"))
    m = _err(mdir, cfg)
    assert "model.layers.2.mlp.experts.down_proj" in m and "layers.2.ffn.experts.*.w2.weight" in m
