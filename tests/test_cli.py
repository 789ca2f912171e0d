"""The command line, run in-process: exit codes, help with defaults, --version, one-line errors that come before
any model is loaded."""
import json

import pytest

from v4jax import api, cli
from v4jax.engine.sampling import SamplingParams


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(api, "load_model", refuse)


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_no_arguments_prints_help_and_exits_0(capsys):
    rc, out, _ = _run(capsys)
    assert rc == 0 and "usage: v4jax" in out and "generate" in out and "memory" in out and "bench" in out


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["generate", "--help"], ["memory", "--help"], ["bench"],
                                  ["bench", "--help"]])
def test_help_exits_0(capsys, argv):
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0 and out.startswith("usage: v4jax")


def test_generate_help_shows_sampling_defaults(capsys):
    _, out, _ = _run(capsys, "generate", "--help")
    text = " ".join(out.split())
    sp = SamplingParams()
    for flag, default in (("--max-tokens", sp.max_tokens), ("--temperature", sp.temperature),
                          ("--top-p", sp.top_p), ("--top-k", sp.top_k)):
        i = text.index(f"{flag} {flag[2:].upper().replace('-', '_')} ")
        assert f"(default: {default})" in text[i:i + 200], flag
    assert "fresh random seed" in text and "--stop-token-ids" in text and "--ignore-eos" in text
    assert "(default: bfloat16)" in text and "(default: pallas on a GPU, else xla)" in text


def test_bench_subcommands_get_their_own_help(capsys):
    rc, out, _ = _run(capsys, "bench", "decode", "--help")
    assert rc == 0 and "usage: v4jax bench decode" in out and "--small" in out
    rc, out, _ = _run(capsys, "bench", "kernels", "-h")
    assert rc == 0 and "--harness" in out
    rc, out, _ = _run(capsys, "bench", "generate", "--help")
    assert rc == 0 and "usage: v4jax bench generate" in out and "--prefill-chunk" in out
    rc, out, _ = _run(capsys, "bench", "table", "--help")
    assert rc == 0 and "usage: v4jax bench table" in out and "--out" in out


def test_version(capsys):
    from importlib import metadata
    rc, out, _ = _run(capsys, "--version")
    assert rc == 0 and out.strip() == f"v4jax {metadata.version('v4jax')}"


@pytest.mark.parametrize("argv", [["frobnicate"], ["generate", "--temperature", "warm"], ["generate", "--bogus"],
                                  ["memory", "--context", "lots"], ["generate", "--max-model-len", "0"],
                                  ["generate", "--max-tokens", "-5"], ["generate", "--max-tokens", "0"]])
def test_argument_errors_exit_2(capsys, no_model_load, argv):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and "usage:" in err and "error:" in err


@pytest.mark.parametrize("argv,match", [
    (["generate", "--max-tokens", str(2**31)], "max_tokens must be an integer in [1, 2147483647]"),
    (["generate", "--top-p", "0"], "top_p must be a finite number in (0, 1]"),
    (["generate", "--seed", str(2**40)], "seed must be an integer in"),
    (["generate", "--stop-token-ids", "-3"], "stop_token_ids"),
    (["generate", "--min-tokens", "20"], "min_tokens (20) must be at most max_tokens (16)"),
    (["generate", ""], "a prompt is empty"),
    (["generate", "--model", "no/such/dir", "hi"], "'no/such/dir' is neither a checkpoint directory nor a preset"),
    (["memory", "--model", "no/such/dir"], "neither a preset"),
    (["memory", "--model", "tiny", "--mesh", "gpus=4"], "unknown mesh axes"),
])
def test_user_errors_are_one_line_before_the_model_loads(capsys, no_model_load, argv, match):
    rc, out, err = _run(capsys, *argv)
    assert rc == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(no_model_load):
    with pytest.raises(ValueError, match="top_p"):
        cli.main(["--debug", "generate", "--top-p", "0"])
    with pytest.raises(ValueError, match="top_p"):
        cli.main(["generate", "--top-p", "0", "--debug"])


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_names_every_preset(capsys, command):
    from v4jax.config import PRESETS
    rc, out, _ = _run(capsys, command, "--help")
    assert rc == 0 and all(name in "".join(out.split()) for name in PRESETS)  # however the help wraps


def test_corrupt_model_dir_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 512, "hidden_')
    for cmd in ("generate", "memory"):
        rc, _, err = _run(capsys, cmd, "--model", str(tmp_path))
        assert rc == 1 and err.count("\n") == 1
        assert err.startswith(f"error: {tmp_path / 'config.json'} is not valid JSON"), err


def test_too_big_preset_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("V4JAX_DEVICE_MEMORY_BYTES", str(64 << 30))
    rc, _, err = _run(capsys, "generate", "--model", "flash", "hi")
    assert rc == 1 and err.count("\n") == 1
    assert "the weights need 542.00 GiB" in err and "64.00 GiB" in err and "mesh='expert=" in err


def test_memory_reports_weights_and_pools_per_device(capsys):
    rc, out, _ = _run(capsys, "memory", "--model", "flash", "--context", "64K", "--mesh", "expert=8")
    assert rc == 0
    assert "| **KV per context token (B)** | **6880** |" in out  # the pool report (bf16 column)
    # the weights as the release stores them (FP8 linears, FP4 routed experts: its 148.66 GiB), or in bf16
    assert "## Per device (expert=8: 8 device(s), weights as the release stores them" in out
    assert "| weights | | | 148.64 GiB | 25.92 GiB |" in out
    # the engine's pools for LLM's options (max_model_len: the model's 1M), every pool a row
    assert "8 slots x max_model_len=1048576; 32768 full pages of 256 tokens" in out
    assert "| pool c4_index | 32768 pages of 256 tokens | 344064 | 10.50 GiB | 10.50 GiB |" in out
    rc, out, _ = _run(capsys, "memory", "--model", "flash", "--mesh", "expert=8", "--quantization", "none")
    assert "| weights | | | 542.00 GiB | 80.00 GiB |" in out
    rc, out, _ = _run(capsys, "memory", "--model", "tiny", "--context", "1K", "--json", "--mesh", "tensor=2")
    d = json.loads(out)
    assert rc == 0 and d["mesh"] == {"tensor": 2} and 0 < d["weights"]["per_device"] < d["weights"]["total"]
    assert d["engine_pools"]["total"] == d["engine_pools"]["per_device"] > 0  # tensor holds copies of the pools
    assert d["reports"][0]["context_tokens"] == 1024
    # --budget-gib is memory_budget_bytes in GiB
    rc, out, _ = _run(capsys, "memory", "--model", "tiny", "--json", "--budget-gib", "0.01", "--dtype", "float32")
    pools = json.loads(out)["engine_pools"]
    assert rc == 0 and pools["total"] <= 0.01 * (1 << 30) < pools["total"] + pools["per_page_bytes"]


def test_generate_prints_streamed_and_batched(capsys, monkeypatch):
    """A real model load (the tiny preset), a stand-in for the engine: what `generate` prints, prompt bytes as token
    ids for a model without a tokenizer, the sampling flags handed over as SamplingParams."""
    seen = {}

    def fake_generate(self, prompts, sp, stream=False):
        seen["prompts"], seen["sp"] = prompts, sp
        if stream:
            return (ev for ev in [(0, [5, 6], None), (0, [7], None)])  # a generator, as LLM's
        return [api.RequestOutput(p, [5, 6, 7], None, None, "length") for p in prompts]

    monkeypatch.setattr(api.LLM, "generate", fake_generate)
    rc, out, err = _run(capsys, "generate", "--model", "tiny", "--max-tokens", "3", "--temperature", "0",
                        "--seed", "4", "--stop-token-ids", "9,10", "ab")
    assert rc == 0 and out == "ab 5 6 7\n" and "no tokenizer" in err
    assert seen["prompts"] == [[97, 98]]
    assert seen["sp"] == SamplingParams(max_tokens=3, temperature=0.0, seed=4, stop_token_ids=[9, 10])
    rc, out, _ = _run(capsys, "generate", "--model", "tiny", "a", "b")
    assert rc == 0 and out.count("[length, 3 tokens]") == 2 and seen["sp"] == SamplingParams()
