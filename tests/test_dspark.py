"""The DSpark drafter of the 0731 / -DSpark releases: its config keys, its checkpoint layout (three draft layers
`mtp.N.*`, `mtp.0.main_proj`, `mtp.2.markov_head.markov_w1/w2`, `mtp.2.confidence_head.proj`) written here from a
tiny config in float32 and in the release's FP8 / FP4 formats, the errors of malformed ones and of options that
cannot run, the drafter's block attention; with -m slow, `speculative_config={"method": "dspark", ...}` through
LLM.generate: greedy tokens the plain greedy ones (teacher-forced forward, log-probs within 1e-5) with drafts forced
right or wrong and with the drafter's own, counters, and seeded sampling reproducible (the rejection rule itself is
tested in test_spec_decode.py: both methods share it)."""
import dataclasses
import json
import os
import warnings

import numpy as np
import pytest

import hf_reference as H
from checkpoints import CheckpointError, open_checkpoint, write_official_checkpoint
from test_spec_decode import GREEDY, OPTIONS, _assert_teacher_forced, _check_forced, _prompts
from v4jax import LLM, SamplingParams
from v4jax.config import ConfigError, ModelConfig, preset
from v4jax.fields import FieldError

DSPARK = dict(n_mtp_layers=3, dspark_block_size=4, dspark_noise_token_id=511, dspark_target_layer_ids=(1, 2, 3),
              dspark_markov_rank=8)


def _cfg() -> ModelConfig:
    return preset("tiny").replace(**DSPARK)


def _write(path, cfg=None, include_mtp=True, **kw) -> str:
    cfg = cfg or _cfg()
    opts = dict(fp8=False, fp4_experts=False, bf16=False)
    opts.update(kw)
    write_official_checkpoint(path, cfg, H.random_official_tensors(cfg, seed=0, include_mtp=include_mtp), **opts)
    return str(path)


def _rewrite(path, edit):
    """The float32 checkpoint at `path` with its tensors passed through edit(dict) (malformed on purpose)."""
    from safetensors.numpy import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)


def _quiet_llm(path, **kw) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, dtype="float32", **kw)


# ---- config ------------------------------------------------------------------------------------------------
def test_config_reads_the_dspark_keys():
    cfg = _cfg()
    raw = cfg.to_hf_dict()
    assert raw["compress_ratios"][cfg.n_layers:] == [0, 0, 0]
    assert ModelConfig.from_dict(raw) == cfg
    # as the 0731 config.json: num_nextn_predict_layers stays 1, the draft layers are compress_ratios' tail
    assert ModelConfig.from_dict(dict(raw, num_nextn_predict_layers=1)).n_mtp_layers == 3
    no = {k: v for k, v in raw.items() if not k.startswith("dspark_")}
    assert ModelConfig.from_dict(dict(no, compress_ratios=raw["compress_ratios"][:5])).dspark_block_size == 0
    with pytest.raises(ConfigError, match="dspark_n_routed_experts"):
        ModelConfig.from_dict(dict(raw, dspark_n_routed_experts=4))
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):
        ModelConfig.from_dict(dict(raw, dspark_target_layer_ids=[1, 9]))
    with pytest.raises(ConfigError, match="dspark_noise_token_id"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "dspark_noise_token_id"})
    with pytest.raises(ConfigError, match="sliding-window"):
        ModelConfig.from_dict(dict(raw, compress_ratios=raw["compress_ratios"][:4] + [4, 4, 4]))
    with pytest.raises(ConfigError, match="draft layers"):
        ModelConfig.from_dict(dict(raw, compress_ratios=raw["compress_ratios"][:4]))


# ---- checkpoints ---------------------------------------------------------------------------------------------
def test_0731_layout_loads(tmp_path):
    """A tiny 0731-layout checkpoint (float32) opens with every drafter tensor and loads into the draft layers."""
    cfg = _cfg()
    path = _write(tmp_path)
    ck = open_checkpoint(path)
    assert ck.has_mtp and ck.cfg == cfg
    for name in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.1.attn.wkv.weight", "mtp.2.norm.weight",
                 "mtp.2.hc_head_fn", "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight",
                 "mtp.2.confidence_head.proj.weight", "mtp.2.ffn.experts.7.w2.weight"):
        assert name in ck.names, name
    assert not any(n.endswith("e_proj.weight") for n in ck.names)
    llm = _quiet_llm(path)
    assert llm.model.drafter == "dspark" and len(llm.model.mtp) == 3
    head = llm.model.mtp[2]
    np.testing.assert_array_equal(np.asarray(head.markov_head.markov_w2.weight[...]),
                                  ck.read("mtp.2.markov_head.markov_w2.weight"))
    np.testing.assert_array_equal(np.asarray(head.confidence_head.proj.weight[...]),
                                  ck.read("mtp.2.confidence_head.proj.weight"))
    np.testing.assert_array_equal(np.asarray(llm.model.mtp[0].main_proj.weight[...]),
                                  ck.read("mtp.0.main_proj.weight"))


def test_0731_layout_in_the_release_formats_loads(tmp_path):
    """FP8 linears (main_proj among them) and FP4 routed experts of the draft layers load as stored, as the main
    layers' do; quantization="none" dequantizes them to the same values."""
    path = _write(tmp_path, fp8=True, fp4_experts=True, bf16=True)
    ck = open_checkpoint(path)
    assert ck.stored_dtype("mtp.0.main_proj.weight") == "F8_E4M3"
    assert ck.stored_dtype("mtp.1.ffn.experts.0.w1.weight") == "I8"
    assert ck.weight_format() == ("fp8", "fp4")
    stored = _quiet_llm(path).model
    assert stored.mtp[0].main_proj.scale is not None
    assert stored.mtp[1].block.ffn.experts.storage == "fp4"
    plain = _quiet_llm(path, quantization="none").model
    np.testing.assert_array_equal(np.asarray(plain.mtp[0].main_proj.weight[...]), ck.read("mtp.0.main_proj.weight"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("mtp.2.markov_head.markov_w2.weight"), "missing tensor 'mtp.2.markov_head.markov_w2.weight'"),
    (lambda t: t.pop("mtp.2.confidence_head.proj.weight"), "missing tensor 'mtp.2.confidence_head.proj.weight'"),
    (lambda t: t.update({"mtp.2.confidence_head.proj.weight": np.zeros((1, 64), np.float32)}),
     r"'mtp.2.confidence_head.proj.weight' \(in model.safetensors\) has shape \[1, 64\], expected \[1, 72\]"),
    (lambda t: t.update({"mtp.0.main_proj.weight": np.zeros((64, 64), np.float32)}),
     r"'mtp.0.main_proj.weight' \(in model.safetensors\) has shape \[64, 64\], expected \[64, 192\]"),
    (lambda t: t.update({"mtp.0.e_proj.weight": np.zeros((64, 64), np.float32)}),
     "unexpected tensor 'mtp.0.e_proj.weight' in model.safetensors .the config's dspark_. keys"),
])
def test_malformed_0731_checkpoints_name_the_tensor(tmp_path, edit, message):
    path = _write(tmp_path)
    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)


def test_older_mtp_layout_still_loads(tmp_path):
    """A checkpoint of the single `mtp.0.*` MTP block (no dspark_* keys) loads its MTP block as before; DSpark
    tensors in it are unexpected, named with a hint."""
    cfg = preset("tiny")
    path = _write(tmp_path, cfg)
    assert _quiet_llm(path).model.drafter == "mtp"
    _rewrite(path, lambda t: t.update({"mtp.0.markov_head.markov_w1.weight": np.zeros((512, 8), np.float32)}))
    with pytest.raises(CheckpointError, match="a DSpark drafter's tensor: the config has no dspark_. keys"):
        open_checkpoint(path)


def test_dspark_option_errors_at_load(tmp_path):
    dspark = {"method": "dspark", "num_speculative_tokens": 3}
    mtp_path = _write(tmp_path / "mtp", preset("tiny"))
    with pytest.raises(FieldError, match="speculative_config .* no DSpark drafter .no dspark_. keys in its config.: "
                                         "use method 'mtp'"):
        _quiet_llm(mtp_path, speculative_config=dspark)
    bare = _write(tmp_path / "bare", include_mtp=False)
    with pytest.raises(FieldError, match="speculative_config .* no DSpark drafter weights"):
        _quiet_llm(bare, speculative_config=dspark)
    full = _write(tmp_path / "full")
    with pytest.raises(FieldError, match="speculative_config .* DSpark drafter .*use method 'dspark'"):
        _quiet_llm(full, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    with pytest.raises(FieldError, match="num_speculative_tokens=5 exceeds the DSpark drafter's block of 4"):
        _quiet_llm(full, speculative_config={"method": "dspark", "num_speculative_tokens": 5}, decode_steps=8)
    with pytest.raises(FieldError, match="speculative_config: method must be one of"):
        _quiet_llm(full, speculative_config={"method": "eagle", "num_speculative_tokens": 3})


def test_flag_takes_the_dspark_method():
    from v4jax import cli
    from v4jax.serve.options import llm_kwargs
    flag = '{"method": "dspark", "num_speculative_tokens": 4}'
    args = cli.build_parser().parse_args(["serve", "x", "--speculative-config", flag])
    assert llm_kwargs(args)["speculative_config"] == json.loads(flag)
    args = cli.build_parser().parse_args(["generate", "x", "--speculative-config", flag])
    assert args.speculative_config == json.loads(flag)


# ---- the drafter's maths --------------------------------------------------------------------------------------
def test_block_attention_sees_the_window_and_the_whole_block():
    """Every block slot attends to the valid window keys and to every slot of the block (no causal mask): a later
    slot's token moves slot 0's output; window keys marked invalid are not read."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from v4jax.model import Transformer

    cfg = _cfg()
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32))
    block = jax.jit(lambda *a: nnx.merge(graphdef, state).dspark_streams(*a))
    b, w, s = 1, cfg.window_size, cfg.dspark_block_size
    ids = jnp.array([[5, 511, 511, 511]], jnp.int32)
    pos = jnp.arange(9, 9 + s)[None]
    ctx = jax.random.normal(jax.random.key(1), (3, b, w, cfg.head_dim))
    valid = jnp.arange(w)[None] < 5
    out = block(ids, pos, ctx, valid)
    assert out.shape == (b, s, cfg.hc_mult, cfg.dim)
    garbage = jnp.where(valid[None, :, :, None], ctx, 1e3)
    np.testing.assert_allclose(block(ids, pos, garbage, valid), out, atol=1e-5)
    later = block(ids.at[0, 3].set(7), pos, ctx, valid)
    assert float(jnp.max(jnp.abs(later[:, 0] - out[:, 0]))) > 1e-4


@pytest.mark.slow
def test_taps_are_the_mean_streams_after_the_target_layers():
    """The taps of the full forward are the mean over the streams after each target layer (the last one: the final
    streams)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from v4jax.model import Transformer

    cfg = _cfg()
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32))
    full = jax.jit(lambda t: (nnx.merge(graphdef, state)(t, return_streams=True)[1],
                              nnx.merge(graphdef, state).taps_of(t)))
    tokens = jnp.arange(2, 14, dtype=jnp.int32)[None]
    streams, taps = full(tokens)
    assert taps.shape == (1, 12, 3 * cfg.dim)
    np.testing.assert_allclose(taps[..., -cfg.dim:], streams.mean(axis=-2), atol=1e-6)


# ---- through LLM.generate (minutes on CPU) ----------------------------------------------------------------------
def _dspark_llm(tmp_path, k: int, **kw) -> LLM:
    path = _write(tmp_path / "ck", **kw)
    return _quiet_llm(path, speculative_config={"method": "dspark", "num_speculative_tokens": k},
                      **{o: v for o, v in OPTIONS.items() if o != "dtype"})


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_dspark_drafts_equals_plain_greedy(tmp_path, k):
    """The drafter's own drafts (a random tiny drafter accepts next to none) and drafts forced right or partly
    wrong per slot (every acceptance length, prefix hits, a resume at a page boundary crossed while speculating):
    the plain greedy tokens, log-probs within 1e-5; the counters add up."""
    llm = _dspark_llm(tmp_path, k)
    prompts = _prompts((19, 45), llm.config.vocab_size, seed=2)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == GREEDY.max_tokens
        _assert_teacher_forced(llm, p, o)
    st = llm.stats()["spec_decode"]
    assert st["num_drafts"] > 0 and st["num_draft_tokens"] == k * st["num_drafts"]
    assert st["num_accepted_tokens"] == sum(st["accepted_by_position"]) and len(st["accepted_by_position"]) == k
    _check_forced(llm)


@pytest.mark.slow
def test_dspark_sampled_seeded_reproducible(tmp_path):
    """A seeded sampled request (the rejection rule with the drafter's filtered distributions) gives the same tokens
    again, beside a greedy one whose tokens stay the teacher-forced ones."""
    llm = _dspark_llm(tmp_path, 3)
    prompts = _prompts((6, 21), llm.config.vocab_size, seed=3)
    sp = [SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True), GREEDY]
    a = llm.generate(prompts, sp)
    b = llm.generate(prompts, sp)
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 12
    _assert_teacher_forced(llm, prompts[1], a[1])


@pytest.mark.slow
def test_dspark_on_the_release_formats(tmp_path):
    """FP8 / FP4 stored weights (draft layers too): greedy speculation gives the tokens of the same model's
    teacher-forced forward."""
    llm = _dspark_llm(tmp_path, 3, fp8=True, fp4_experts=True, bf16=True)
    prompts = _prompts((19,), llm.config.vocab_size, seed=5)
    (o,) = llm.generate(prompts, dataclasses.replace(GREEDY, max_tokens=16))
    _assert_teacher_forced(llm, prompts[0], o)
