"""`v4jax bench kernels` on CPU (interpret mode, --small shapes): the table, a --tune sweep and a --sweep run end to
end and write their files; the kernels package imports nothing of the benchmarks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from v4jax.bench import kernels_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernel_table_small(tmp_path):
    assert kernels_main(["--small", "--only", "topk", "--iters", "1", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_kernels.json").read_text())["results"]
    assert [r["kernel"] for r in rows] == ["topk", "topk"] and all(r["ok"] for r in rows)
    assert "| topk |" in (tmp_path / "bench_kernels.md").read_text()


def test_tune_and_sweep_small(tmp_path):
    assert kernels_main(["--tune", "--small", "--only", "hc_weights", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "tune_kernels.json").read_text())["rows"]
    assert rows and {r["kernel"] for r in rows} == {"hc_weights"}
    assert kernels_main(["--sweep", "fused_projections", "--small", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "bench_fused_projections.json").read_text())["rows"][0]
    assert row["max_abs_diff"] < 0.5 and {"separate", "fused", "multi"} <= set(row)


def test_hc_post_sweep_small(tmp_path):
    """--sweep hc_post end to end: every form runs and is timed."""
    assert kernels_main(["--sweep", "hc_post", "--small", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_hc_post.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 5] and all(r["xla"]["wall_us"] > 0 for r in rows)


def test_streaming_sweep_small(tmp_path):
    """--sweep streaming end to end on CPU: the projection kernel and XLA's matmul run at 1 and 32 tokens, each row
    written (on CPU a row says there were no GPU events to time)."""
    assert kernels_main(["--sweep", "streaming", "--small", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "streaming.json").read_text())["rows"]
    assert [(r["tokens"], r["form"]) for r in rows] == [(1, "kernel"), (1, "xla"), (32, "kernel"), (32, "xla")]
    assert all("us" in r or "error" in r for r in rows)


@pytest.mark.slow   # three forms compiled in interpret mode
def test_kv_formats_sweep_small(tmp_path):
    """--sweep kv_formats end to end: every form of every case runs, is checked against the reference and timed."""
    assert kernels_main(["--sweep", "kv_formats", "--small", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kv_formats.json").read_text())["rows"]
    assert [(r["case"], r["form"]) for r in rows] == [
        (c, f) for c, forms in (("attention csa", _ATTENTION_FORMS), ("attention hca", _ATTENTION_FORMS),
                                ("indexer scores", _INDEXER_FORMS)) for f in forms]
    assert all(r["same_inf"] and r["max_rel_err"] < 1e-2 and r["us_per_layer"] > 0 for r in rows)


_ATTENTION_FORMS = ("bf16 pool (Triton)", "fp8 entries (XLA reference)")
_INDEXER_FORMS = ("bf16 keys (Triton)", "fp4 keys (Triton)", "fp4 keys (XLA reference)")


def test_kernels_import_nothing_but_the_config():
    """DESIGN §2: pallas_kernels imports nothing from v4jax but v4jax.config (the benchmark sits above it)."""
    code = ("import importlib, pkgutil, sys, pallas_kernels\n"
            "for m in pkgutil.iter_modules(pallas_kernels.__path__):\n"
            "    importlib.import_module('pallas_kernels.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('v4jax') and m != 'v4jax.config'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] in ("[]", "['v4jax']"), r.stdout
