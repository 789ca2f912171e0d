"""A new user's first hour: corrupt or partial checkpoints, models too big for the device, and no warnings from
our own code."""
import json
import os
import warnings

import numpy as np
import pytest

import hf_reference as H
from checkpoints import CheckpointError, write_official_checkpoint
from checkpoints.reader import read_header
from v4jax import LLM, SamplingParams
from v4jax import memory as M
from v4jax.config import ConfigError, preset

OUR_PACKAGES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), p) + os.sep
                     for p in ("v4jax", "checkpoints", "sharding", "pallas_kernels"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small float32 checkpoint (no tokenizer, no MTP)."""
    cfg = H.cfg_small_ratios()
    d = tmp_path_factory.mktemp("small")
    write_official_checkpoint(d, cfg, H.random_official_tensors(cfg, seed=1, include_mtp=False), fp8=False,
                              fp4_experts=False, bf16=False)
    return d


def _copy(src, dst):
    dst.mkdir()
    for f in os.listdir(src):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


# ---- checkpoints ---------------------------------------------------------------------------------------------
def test_random_bytes_in_tensor_data_fail_at_load_naming_the_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "corrupt")
    path = str(d / "model.safetensors")
    tensors, _ = read_header(path)
    st = tensors["layers.2.attn.wkv.weight"]
    with open(path, "r+b") as f:  # what a bad download looks like: random bytes in the middle of a tensor
        f.seek(st.start + st.nbytes // 3)
        f.write(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError, match=r"'layers\.2\.attn\.wkv\.weight'.*non-finite value.*corrupt"):
        LLM(str(d))


def test_truncated_config_names_the_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "truncated")
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ConfigError, match=f"{d / 'config.json'} is not valid JSON"):
        LLM(str(d))
    with pytest.raises(CheckpointError, match="config.json of .* is not valid JSON"):
        from checkpoints import open_checkpoint
        open_checkpoint(str(d))


def test_directory_without_tokenizer_warns_once(ckpt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(ckpt), dtype="float32")
    msgs = [str(w.message) for w in caught if "tokenizer" in str(w.message)]
    assert msgs == [f"no tokenizer.json in {ckpt}: prompts must be token ids, outputs have text=None"]
    assert [w.filename for w in caught if "tokenizer" in str(w.message)] == [__file__]  # points at the caller
    assert llm.tokenizer is None


# ---- memory: what fits ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "flash-slice"])
def test_param_bytes_equal_the_abstract_model(name):
    cfg = preset(name)
    abstract = M.abstract_model(cfg, "bfloat16")
    assert M.param_bytes(cfg, 2)["total"] == M.model_weight_bytes(abstract)


@pytest.mark.parametrize("mesh", [None, "expert=2", "tensor=2", "expert=4,tensor=2", "data=2", "expert=3"])
def test_weight_bytes_on_mesh_equal_the_sharding_rules(mesh):
    cfg = H.cfg_small_ratios()
    abstract = M.abstract_model(cfg, "float32")
    assert M.weight_bytes_on_mesh(cfg, mesh, 4) == M.weight_bytes_per_device(abstract, mesh)
    if mesh == "expert=2":
        assert M.weight_bytes_on_mesh(cfg, mesh, 4) < M.weight_bytes_on_mesh(cfg, None, 4)


def test_too_big_preset_fails_before_allocating(monkeypatch):
    monkeypatch.setenv(M.MEMORY_ENV, str(100 << 30))
    with pytest.raises(M.DeviceMemoryError) as e:
        LLM("flash")
    msg = str(e.value)
    assert "the weights need 542.00 GiB" in msg and "100.00 GiB" in msg and M.MEMORY_ENV in msg
    assert "smaller preset ('flash-1gpu', 'flash-slice', 'tiny')" in msg and "mesh='expert=8' (80.00 GiB of weights per device" in msg
    monkeypatch.setenv(M.MEMORY_ENV, str(200 << 30))  # the release's formats fit (148.64 GiB)
    with pytest.raises(M.DeviceMemoryError, match=r"would fit: quantization='fp8' \(FP8 linears and FP4 experts as "
                                                   r"the release stores them: 148.64 GiB\)"):
        LLM("flash")
    monkeypatch.setenv(M.MEMORY_ENV, "500000")  # below tiny's 1.4 MB of bf16 weights and 0.87 MB as stored
    with pytest.raises(M.DeviceMemoryError, match="preset 'tiny'.*would fit: a device with more memory"):
        LLM("tiny")


def test_pools_that_do_not_fit_suggest_a_budget(monkeypatch):
    llm = LLM("tiny", dtype="float32", max_num_seqs=8, max_model_len=4096)
    weights = M.model_weight_bytes(llm.model)
    pools = M.engine_pools(llm.config, llm.options, 4096, "float32").total
    monkeypatch.setenv(M.MEMORY_ENV, str(weights + pools // 2))
    with pytest.raises(M.DeviceMemoryError, match=r"max_num_seqs=8 x max_model_len=4096 .*memory_budget_bytes=\d+"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert llm._engine is None


def _memory_json(capsys, argv) -> dict:
    from v4jax.cli import main
    capsys.readouterr()
    assert main(["memory", "--model", "tiny", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _engine_bytes(eng) -> int:
    """Bytes of the engine's pools and boundary store, from its arrays."""
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((eng.pools, eng.store)))


@pytest.mark.parametrize("opts", [
    dict(max_num_seqs=2, max_model_len=200, prefill_chunk=32, decode_steps=4),
    dict(max_num_seqs=2, max_model_len=200, enable_prefix_caching=False),
    dict(max_num_seqs=3, max_model_len=100, kv_layout="dense", page_size=16),
    dict(max_num_seqs=3, max_model_len=100, kv_layout="dense", page_size=16, enable_prefix_caching=False),
    dict(max_num_seqs=2, max_model_len=256, memory_budget_bytes=3 << 20, enable_prefix_caching=False),
    dict(max_num_seqs=2, max_model_len=256, memory_budget_bytes=3 << 20)])
def test_memory_command_reports_the_engines_bytes(capsys, opts):
    """`v4jax memory --json` with an LLM's options reports exactly the bytes of the engine that LLM builds: its
    pools and boundary store (paged and dense, prefix cache on and off, sized by max_model_len or a budget); the
    fit check reads the same figure. Over meshes: tests/test_sharding.py (test_memory_command_per_device)."""
    llm = LLM("tiny", dtype="float32", **opts)
    flags = ["--dtype", "float32"]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        flags += [flag, str(v)] if not isinstance(v, bool) else [flag if v else "--no-" + flag[2:]]
    got = _memory_json(capsys, flags)["engine_pools"]
    eng = llm.engine
    assert got["total"] == got["per_device"] == _engine_bytes(eng), opts
    assert (got["n_pages"], got["n_swa_pages"], got["page_size"]) == (
        eng.layout.n_pages, eng.layout.n_swa_pages, eng.layout.page_size)
    assert got["max_model_len"] == llm.max_model_len
    pools = M.engine_pools(llm.config, llm.options, llm.max_model_len, llm.dtype)
    assert pools.total == got["total"] and pools.layout == eng.layout
    if opts.get("memory_budget_bytes"):  # the pages that fit, in whole TPU tiles
        from v4jax.cache.layout import page_multiple
        mult = page_multiple(llm.config, got["page_size"], "float32")
        assert got["total"] <= opts["memory_budget_bytes"] < got["total"] + mult * got["per_page_bytes"]


def test_device_memory_bytes_override_and_host(monkeypatch):
    monkeypatch.setenv(M.MEMORY_ENV, "12345")
    assert M.device_memory_bytes() == (12345, f"${M.MEMORY_ENV}")
    monkeypatch.delenv(M.MEMORY_ENV)
    limit, source = M.device_memory_bytes()
    assert limit is None or limit > 0
    monkeypatch.setenv(M.MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match="not a number of bytes"):
        M.device_memory_bytes()


# ---- warnings ------------------------------------------------------------------------------------------------
def test_no_warnings_from_our_code(ckpt, tmp_path):
    """Load a checkpoint, run a forward, export the weights, make a memory report: no warning (deprecations above
    all) may come from a file of our packages."""
    d = _copy(ckpt, tmp_path / "with_tok")
    (d / "tokenizer.json").write_bytes(open(os.path.join(os.path.dirname(M.__file__), "default_model",
                                                         "tokenizer.json"), "rb").read())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(d), dtype="float32", max_model_len=64, max_num_seqs=2)
        llm.logits([1, 2, 3])
        SamplingParams(max_tokens=3, temperature=0.5, stop_token_ids=[1])
        from v4jax.model.weights import model_to_official
        model_to_official(llm.model)
        M.format_report(M.report(llm.config, 256))
    # Flax attributes some deprecations of its API to its own files (the `.value` setter warns from
    # flax/nnx/variablelib.py): those come from our calls as well.
    ours = [f"{w.filename}:{w.lineno}: {w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught
            if w.filename.startswith(OUR_PACKAGES) or (issubclass(w.category, DeprecationWarning)
                                                        and f"{os.sep}flax{os.sep}" in w.filename)]
    assert not ours, "\n".join(ours)
    assert json.loads((d / "config.json").read_text())  # the copy is intact
