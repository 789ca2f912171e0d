"""Weights kept in the checkpoint's storage (FP8 e4m3 linears with 128x128 ue8m0 scales, FP4 e2m1 routed experts
with 1x32 scales): the matmuls that read them equal the dequantized load under quant_sim (the release's numerics
simulated), and the bytes held, reported by stats() and by the memory report, are the stored ones."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_reference as H
from checkpoints import formats as F
from checkpoints import write_official_checkpoint
from v4jax import LLM, SamplingParams
from v4jax import memory as M
from v4jax.api import EngineOptions
from v4jax.config import preset
from v4jax.fields import FieldError
from v4jax.model import Transformer, quant
from v4jax.model import layers as L

OPTS = dict(dtype="float32", quant_sim=True, max_num_seqs=2, max_model_len=256, prefill_chunk=32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """cfg_small_ratios (window 8, CSA 4, HCA 8), quantised as the release stores it. No MTP: the simulated load's
    forward is then the program tests/test_model_parity.py's quant_sim test compiles (the compilation cache serves
    it)."""
    cfg = H.cfg_small_ratios()
    d = tmp_path_factory.mktemp("fp8_fp4")
    write_official_checkpoint(d, cfg, H.random_official_tensors(cfg, seed=5, include_mtp=False), fp8=True,
                              fp4_experts=True, bf16=False)
    return str(d)


@pytest.fixture(scope="module")
def stored(ckpt):
    return LLM(ckpt, **OPTS)


@pytest.fixture(scope="module")
def simulated(ckpt):
    return LLM(ckpt, quantization="none", **OPTS)


def test_quantize_is_the_checkpoint_format():
    """The in-graph quantiser and dequantiser are the checkpoint writer's and reader's, bit for bit (partial
    blocks included)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2, 200, 300)) * np.exp(rng.standard_normal((2, 200, 1)))).astype(np.float32)
    for storage, write, read in (("fp8", F.quant_fp8_blocks, F.dequant_fp8_blocks),
                                 ("fp4", F.quant_fp4, lambda v, s: F.unpack_fp4(v.view(np.int8), s))):
        q = quant.Quantized(*jax.jit(lambda w: quant.quantize(w, storage))(w), storage)
        assert q.shape == w.shape
        for e in range(2):
            values, scale = write(w[e])
            assert np.array_equal(np.asarray(q.values[e]).view(np.uint8), values.view(np.uint8)), storage
            assert np.array_equal(np.asarray(q.scale[e]).view(np.uint8), scale.view(np.uint8)), storage
            np.testing.assert_array_equal(np.asarray(q[e].astype(jnp.float32)), read(values, scale))


def _fp8_rows(a):
    """FP8 rounding per 1x128 block with ue8m0 scales, by the checkpoint formats (numpy)."""
    return F.dequant_fp8_blocks(*F.quant_fp8_blocks(a, (1, 128)), (1, 128))


def _release_experts(x, weights, experts, w1, w2, w3, limit):
    """The official Expert per (token, pair) in numpy: FP8-rounded input, clamped SwiGLU, the routing weight times
    it rounded to FP8 before w2, outputs summed."""
    r = _fp8_rows
    xq = r(x)
    out = np.zeros_like(x)
    for m in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = experts[m, k]
            g, u = xq[m] @ w1[e].T, xq[m] @ w3[e].T
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            h = weights[m, k] * g / (1 + np.exp(-g)) * u
            out[m] += r(h[None])[0] @ w2[e].T
    return out


def test_routed_experts_read_stored_weights():
    """Every XLA form of the routed experts reads FP4 (and FP8) expert stacks as the release computes them."""
    rng = np.random.default_rng(1)
    n_exp, d, i, m, k = 8, 64, 96, 6, 2
    x = rng.standard_normal((m, d)).astype(np.float32)
    experts = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(m)]).astype(np.int32)
    weights = rng.uniform(0.2, 1.5, (m, k)).astype(np.float32)
    xq = _fp8_rows(x)
    forms = jax.jit(lambda *a: [L.routed_experts(*a, 10.0, form, act_quant=True)
                                for form in ("gather", "dense", "grouped")])
    for storage in ("fp4", "fp8"):
        raw = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((n_exp, i, d), (n_exp, d, i), (n_exp, i, d))]
        write = F.quant_fp4 if storage == "fp4" else F.quant_fp8_blocks
        stored = [[write(w[e]) for e in range(n_exp)] for w in raw]  # as the checkpoint holds them
        ws = [quant.Quantized(jnp.asarray(np.stack([v.view(np.uint8) if storage == "fp4" else v for v, _ in st])),
                              jnp.asarray(np.stack([s for _, s in st])), storage) for st in stored]
        read = (lambda v, s: F.unpack_fp4(v, s)) if storage == "fp4" else F.dequant_fp8_blocks
        deq = [np.stack([read(v, s) for v, s in st]) for st in stored]
        ref = _release_experts(x, weights, experts, *deq, 10.0)
        for form, got in zip(("gather", "dense", "grouped"), forms(xq, weights, experts, *ws)):
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5, err_msg=f"{storage} {form}")
        plain = _release_experts(x, np.ones_like(weights), experts, *deq, 10.0)
        assert np.abs(plain - ref).max() > 1e-3  # the routing weights enter before w2's rounding


def test_linear_reads_stored_weight():
    lin = L.Linear(200, 160, ("embed", "mlp"), rngs=nnx.Rngs(0), dtype=jnp.float32, fp8=True)
    w = np.asarray(lin.weight[...])
    lin.store("fp8")
    assert lin.weight.dtype == jnp.float8_e4m3fn and lin.scale.shape == (2, 2)
    x = np.random.default_rng(2).standard_normal((3, 200)).astype(np.float32)
    ref = _fp8_rows(x) @ F.dequant_fp8_blocks(*F.quant_fp8_blocks(w)).T
    got = nnx.jit(lambda lin, x: lin(x))(lin, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


def test_stored_logits_equal_simulated(stored, simulated):
    """A teacher-forced forward over 60 tokens (every window and compression boundary of the config many times)."""
    assert stored.model.weight_format == quant.RELEASE
    assert simulated.model.weight_format == quant.DEQUANTIZED
    ids = np.random.default_rng(3).integers(2, stored.config.vocab_size, 60).tolist()
    np.testing.assert_allclose(stored.logits(ids), simulated.logits(ids), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_orbax_keeps_stored_weights(ckpt, stored, tmp_path):
    """`v4jax convert` writes the weights as held; the restored model is the same program on the same values."""
    from v4jax.api import convert
    out = convert(ckpt, str(tmp_path / "orbax"), dtype="float32", progress=False)
    restored = LLM(out, **OPTS)
    assert restored.model.weight_format == quant.RELEASE
    ids = np.random.default_rng(4).integers(2, stored.config.vocab_size, 60).tolist()  # the compiled bucket
    np.testing.assert_array_equal(restored.logits(ids), stored.logits(ids))


@pytest.mark.slow
def test_fp8_experts_load_as_stored(tmp_path):
    """The first Flash release's layout (routed experts in FP8 128x128 blocks too) loads as stored: every stored
    weight dequantizes to the dequantized load's value."""
    from v4jax.api import load_model
    cfg = H.cfg_small_ratios().replace(moe_inter_dim=160)  # two 128-blocks, one partial
    write_official_checkpoint(tmp_path, cfg, H.random_official_tensors(cfg, seed=6), fp8=True, fp4_experts=False,
                              bf16=False)
    _, kept, _, _ = load_model(str(tmp_path), jnp.float32)
    _, deq, _, _ = load_model(str(tmp_path), jnp.float32, quantization="none")
    assert kept.weight_format == quant.WeightFormat("fp8", "fp8") and len(kept.mtp) == 1
    want = {tuple(map(str, p)): np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(deq))}
    held = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(kept))}
    n = 0
    for path, v in held.items():
        if v.dtype != jnp.float8_e4m3fn:
            continue
        scale = path[:-1] + ("scale",) if path[-1] == "weight" else path[:-1] + (path[-1] + "_scale",)
        got = quant.Quantized(v[...], held[scale][...], "fp8").astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), want[path], err_msg=".".join(path))
        n += 1
    assert n > 20


def test_stored_bytes(stored):
    """Weight bytes held: FP8 parts at most 0.6x, FP4 experts at most 0.3x of the bf16 load; stats() and the memory
    report count the same bytes."""
    cfg = stored.config
    held = M.weight_stats(stored.model)
    assert held["bytes"] == sum(held["by_format"].values())
    assert held["bytes"] == M.param_bytes(cfg, 4, mtp=False, weights=quant.RELEASE)["total"]  # float32 for the rest
    bf16 = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, mtp=False))
    bf16_bytes = {tuple(map(str, p)): math.prod(v.shape) * 2 for p, v in nnx.to_flat_state(nnx.state(bf16))}
    for storage, dtype, most in (("fp8", jnp.float8_e4m3fn, 0.6), ("fp4", jnp.uint8, 0.3)):
        paths = [tuple(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(stored.model)) if v.dtype == dtype]
        assert paths, storage
        assert held["by_format"][storage] <= most * sum(bf16_bytes[p] for p in paths), storage


def test_memory_report_in_stored_bytes():
    """The release's files: Flash 148.66 GiB (the size listed in binary units: 159.6 GB), Pro 864.7 GB; the
    analytical count equals the abstract model's, split over a mesh too."""
    assert M.param_bytes(preset("flash"), weights=quant.RELEASE)["total"] / 2 ** 30 == pytest.approx(148.66,
                                                                                                   rel=5e-4)
    assert M.param_bytes(preset("pro"), weights=quant.RELEASE)["total"] / 1e9 == pytest.approx(864.7, rel=5e-4)
    cfg = preset("tiny")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, weights=quant.RELEASE))
    for mesh in (None, "expert=2,tensor=2"):
        assert M.weight_bytes_per_device(model, mesh) == M.weight_bytes_on_mesh(cfg, mesh, 2, quant.RELEASE)
    assert M.weight_stats(model)["bytes"] == M.param_bytes(cfg, 2, weights=quant.RELEASE)["total"]


def test_quantization_option_is_checked(tiny_checkpoint):
    with pytest.raises(FieldError, match="quantization"):
        EngineOptions(quantization="int4")
    with pytest.raises(FieldError, match="quantization='fp8'"):  # a float checkpoint has no FP8 storage to keep
        LLM(tiny_checkpoint, quantization="fp8")


@pytest.mark.slow
def test_stored_engine_equals_simulated(stored, simulated):
    """Greedy decoding through the engine (chunked prefill, decode calls) over prompts of 5 and 37 tokens and 40
    new tokens each: the same tokens and log-probs within 1e-4."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, stored.config.vocab_size, n).tolist() for n in (5, 37)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True)
    for a, b in zip(stored.generate(prompts, sp), simulated.generate(prompts, sp)):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert stored.stats()["weights"] == M.weight_stats(stored.model)


def _swapped_kernels_case(tmp_path, monkeypatch):
    """A config whose projections are whole 128-blocks, stored as the release does, and the XLA ops table with its
    `linear` and `experts` swapped for the Pallas ones (interpreted), their calls counted."""
    import dataclasses

    from pallas_kernels import experts as pallas_experts
    from pallas_kernels import layer_linear as pallas_linear
    from v4jax.model import ops
    cfg = dataclasses.replace(H.cfg_small_ratios(), dim=128, q_lora_rank=128, o_lora_rank=128, moe_inter_dim=128,
                              n_layers=3, layer_types=H.cfg_small_ratios().layer_types[:3],
                              compress_ratios=(0, 4, 8))
    write_official_checkpoint(tmp_path, cfg, H.random_official_tensors(cfg, seed=6, include_mtp=False), fp8=True,
                              fp4_experts=True, bf16=False)
    ids = np.random.default_rng(4).integers(2, cfg.vocab_size, 12).tolist()
    calls = {"scaled": [], "fp4": [], "act_quant": [], "grouped": []}

    def swap():
        real = pallas_linear.layer_linear
        monkeypatch.setattr(pallas_linear, "layer_linear", lambda x, w, *a, **kw: calls["scaled"].append(
            kw.get("scale") is not None and kw["scale"].ndim == 3) or calls["act_quant"].append(
            (a[1] > 1, kw.get("act_quant"))) or real(x, w, *a, **kw))
        real_fp4 = pallas_experts.routed_experts_fp4
        monkeypatch.setattr(pallas_experts, "routed_experts_fp4", lambda x, *a, **kw: calls["fp4"].append(
            x.shape[0]) or real_fp4(x, *a, **kw))
        real_many = pallas_linear.layer_linears
        monkeypatch.setattr(pallas_linear, "layer_linears", lambda x, ws, *a, **kw: calls["grouped"].append(
            (len(ws), kw.get("scales") is not None, kw.get("act_quant"))) or real_many(x, ws, *a, **kw))
        monkeypatch.setitem(ops.OPS, "xla", dataclasses.replace(ops.XLA, linear=ops._linear_pallas,
                                                               experts=ops._experts_pallas,
                                                               project=ops._project_pallas))
    return str(tmp_path), ids, calls, swap


def test_fp8_linear_kernel_reads_the_stacks_as_stored(tmp_path, monkeypatch):
    """The few-token projection kernel on e4m3 stacks with block scales (pallas_kernels.layer_linear) inside the
    layer loop gives the jnp reference's logits."""
    path, ids, calls, swap = _swapped_kernels_case(tmp_path, monkeypatch)
    ref = LLM(path, **OPTS).logits(ids)
    swap()
    got = LLM(path, **OPTS).logits(ids)
    # every stacked projection through the kernel, as stored, its scales read from their stack in place; every one
    # but the grouped wo_a rounds its input in the kernel
    assert calls["scaled"] and all(calls["scaled"])
    assert {q for _, q in calls["act_quant"]} == {True, False}
    assert all(grouped != q for grouped, q in calls["act_quant"])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.slow  # two minutes: interpreted kernels in an engine
def test_fp4_experts_kernel_in_the_engine(tmp_path, monkeypatch):
    """The engine with the FP4 experts kernels (and the FP8 projection kernel) gives the XLA forms' greedy tokens
    and log-probs, prompt chunk and decode steps."""
    path, ids, calls, swap = _swapped_kernels_case(tmp_path, monkeypatch)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    ref = LLM(path, **OPTS).generate([ids], sp)[0]
    swap()
    out = LLM(path, **OPTS).generate([ids], sp)[0]
    assert 1 in calls["fp4"] and max(calls["fp4"]) > 1  # a decode step's routed experts and the prompt chunk's
    # the FP8 pairs of one input in one launch each (wq_a and wkv, the shared expert's w1 and w3), x rounded there
    assert (2, True, True) in calls["grouped"] and all(q == sc for _, sc, q in calls["grouped"])
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)


@pytest.mark.slow  # a minute: interpreted kernels in an engine
def test_tpu_kernels_in_the_model(tmp_path, monkeypatch):
    """The TPU table's own entries (TPU_OWN: pallas_kernels.fp8_linear_tpu for e4m3 stacks with block scales and
    pallas_kernels.fp4_experts_tpu for FP4 experts, interpreted here) inside the layer loop give the jnp
    reference's logits, and the engine's greedy tokens and log-probs over a prompt chunk and decode steps."""
    import dataclasses

    from pallas_kernels import fp4_experts_tpu, fp8_linear_tpu
    from v4jax.model import ops
    path, ids, _, _ = _swapped_kernels_case(tmp_path, monkeypatch)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    ref = LLM(path, **OPTS)
    ref_logits, ref_out = ref.logits(ids), ref.generate([ids], sp)[0]
    calls = {"linear": [], "experts": []}
    for name, mod, fn in (("linear", fp8_linear_tpu, "fp8_linear"), ("experts", fp4_experts_tpu, "routed_experts_fp4")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda x, *a, real=real, name=name, **kw: calls[name].append(x.shape[0])
                            or real(x, *a, **kw))
    monkeypatch.setitem(ops.OPS, "xla", dataclasses.replace(ops.XLA, **ops.TPU_OWN))
    llm = LLM(path, **OPTS)
    np.testing.assert_allclose(llm.logits(ids), ref_logits, atol=1e-4, rtol=0)
    assert len(calls["linear"]) >= 3 * 4  # every layer's stored projections (the full forward's experts are XLA's)
    out = llm.generate([ids], sp)[0]
    assert 1 in calls["experts"] and max(calls["experts"]) > 1  # a decode step's routed experts and the prompt's
    assert out.token_ids == ref_out.token_ids
    np.testing.assert_allclose(out.logprobs, ref_out.logprobs, atol=1e-4)


@pytest.mark.parametrize("storage", [None, "fp4", "fp8"])
def test_random_experts_drawn_a_few_at_a_time(storage):
    """An eager random init draws (and quantizes) the routed experts a few at a time: the program's temporaries do
    not grow with the number of experts (a whole layer's f32 draw beside its bf16 copy ran flash-h200's init out of
    an H200's memory), and a traced init (the sharded one) draws the same values all at once."""
    from v4jax.model import moe

    key = jax.random.key(7)
    temps = [moe._draw_experts_in_chunks.lower(key, n, (256, 512), 0.1, jnp.dtype(jnp.bfloat16), storage).compile()
             .memory_analysis().temp_size_in_bytes for n in (64, 256)]
    assert temps[1] <= temps[0] * 1.01 and temps[1] < 256 * 256 * 512 * 4 / 4, temps  # a quarter of the f32 draw
    eager = moe.draw_experts(key, 20, (64, 128), 0.1, jnp.bfloat16, storage)
    traced = jax.jit(lambda k: moe.draw_experts(k, 20, (64, 128), 0.1, jnp.bfloat16, storage))(key)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(traced), strict=True):
        assert a.shape[0] == 20 and jnp.array_equal(a, b)
    if storage is not None:  # as the release's converter quantizes the drawn weights
        w = moe.draw_experts(key, 20, (64, 128), 0.1, jnp.bfloat16, None)
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(quant.quantize(w, storage)), strict=True):
            assert jnp.array_equal(a, b)
