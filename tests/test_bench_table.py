"""v4jax.bench.table merges decode.json / generate.json (in the shape decode.py and generate.py write them) into one
markdown table: the derived numbers, '-' for what was not measured, and the CLI."""
from __future__ import annotations

import json

import pytest

from v4jax.bench import table


def decode_json(model="flash-slice"):
    def row(batch, context, ms, engine_ms, roofline_ms):
        return {"batch": batch, "context": context, "held_tokens": context - 16, "k": 8,
                "positions": [context - 16, context - 9], "page_bucket": context // 256,
                "c4_entries_scanned_per_seq": context // 4, "call_ms_median": ms * 8, "call_ms_all": [ms * 8] * 7,
                "ms_per_step": ms, "tokens_per_s": batch * 1000 / ms, "generate_step_ms_per_step": engine_ms,
                "compile_s": 12.0, "peak_device_bytes": None, "profile": None, "pool_bytes": 1 << 30,
                "roofline": {"weights": 1e9, "kv": 1e8, "total": 1.1e9}, "roofline_ms": roofline_ms,
                "roofline_pct": 100 * roofline_ms / ms, "achieved_GBps": 500.0, "wall_s": 30.0}

    return {"command": f"v4jax bench decode --model {model}", "device": "gpu: NVIDIA H200", "jax": "0.7.0",
            "python": "3.12.3", "config_name": model, "config": {}, "weights_gb": 9.5, "k": 8, "dtype": "bfloat16",
            "bandwidth": {"copy_GBps": 4000.0, "read_GBps": 4300.0, "bytes": 4 << 30}, "model_init_s": 3.0,
            "rows": [row(1, 4096, 2.0, 2.5, 1.5), row(32, 4096, 4.0, None, 3.0),
                     {"batch": 1, "context": 1 << 20, "error": "MemoryError: pools", "wall_s": 0.1}],
            "hf": [{"batch": 1, "context": 4096, "chunk": 1024, "cache_kwarg": "past_key_values", "prefill_s": 3.0,
                    "ms_per_step": 50.0, "ms_all": [50.0] * 10, "info": "transformers 5.0"},
                   {"batch": 32, "context": 4096, "chunk": 256, "cache_kwarg": "past_key_values", "prefill_s": 12.0,
                    "ms_per_step": 100.0, "ms_all": [100.0] * 10, "info": "transformers 5.0"}],
            "notes": [], "total_s": 300.0}


def generate_json(model="flash-slice"):
    def row(batch, context, prefill_s, ms, **extra):
        return dict({"batch": batch, "context": context, "new_tokens": 48, "first_pass_s": 9.0,
                     "prefill_s": prefill_s, "wall_s": prefill_s + ms * 48 / 1e3, "decode_steps_timed": 48,
                     "ms_per_step": ms, "tok_per_s": batch * 1000 / ms, "tokens": batch * 49}, **extra)

    return {"command": f"v4jax bench generate --model {model}", "device": "gpu: NVIDIA H200", "jax": "0.7.0",
            "model": model, "k": 8, "prefill_chunk": 256, "attention_impl": "xla", "init_s": 3.0,
            "matmul_tflops": 800.0,
            "first_call": {"first_s": 20.0, "second_s": 0.5, "compile_s": 19.5},
            "rows": [row(1, 4096, 0.5, 3.0, steady_ms_per_step=2.75, prefill_tflop=200.0),
                     row(32, 4096, 4.0, 6.0, prefill_tflop=320.0),
                     row(1, 131072, 20.0, 2.2),   # (a file from before the FLOP count: no prefill_tflop)
                     {"batch": 1, "context": 1 << 20, "error": "skipped: past --deadline-s"}],
            "total_s": 100.0}


ROW_1_4K = "| flash-slice | 1 | 4K | 2.00 | 2.50 | 3.00 | 2.75 | 500 | 1.50 | 75 | 1.33x | 1.67x | 50.00 | 20.0x |"
ROW_32_4K = "| flash-slice | 32 | 4K | 4.00 | - | 6.00 | - | 8000 | 3.00 | 75 | 1.33x | - | 100.00 | - |"
ROW_1_128K = "| flash-slice | 1 | 128K | - | - | 2.20 | - | - | - | - | - | - | - | - |"
PREFILL = ["| flash-slice | 1 | 4K | 0.50 | 8192 | 200.0 | 400 | 50 | 3.00 |",
           "| flash-slice | 32 | 4K | 4.00 | 32768 | 320.0 | 80 | 10 | 12.00 |",
           "| flash-slice | 1 | 128K | 20.00 | 6554 | - | - | - | - |"]


def test_rows_merge_and_derive():
    rows = table.build_rows([decode_json()], [generate_json()])
    assert [(r["model"], r["batch"], r["context"]) for r in rows] == [
        ("flash-slice", 1, "4K"), ("flash-slice", 1, "128K"), ("flash-slice", 32, "4K")]  # the error rows left out
    r = rows[0]
    assert r["jit_ms"] == 2.0 and r["engine_ms"] == 2.5 and r["generate_ms"] == 3.0 and r["steady_ms"] == 2.75
    assert r["tok_s"] == pytest.approx(500.0) and r["roofline_pct"] == pytest.approx(75.0)
    assert r["x_roofline_jit"] == pytest.approx(4 / 3) and r["x_roofline_engine"] == pytest.approx(5 / 3)
    assert r["hf_ms"] == 50.0 and r["hf_speedup"] == pytest.approx(20.0)
    assert rows[2]["hf_speedup"] is None and rows[2]["steady_ms"] is None  # no engine time, no steady key
    assert rows[2]["tok_s"] == pytest.approx(8000.0)
    p = table.prefill_rows([generate_json()], [decode_json()])
    assert [(r["batch"], r["context"], r["prefill_s"], r["hf_prefill_s"]) for r in p] == [
        (1, "4K", 0.5, 3.0), (1, "128K", 20.0, None), (32, "4K", 4.0, 12.0)]
    assert p[1]["tok_s"] == pytest.approx(131072 / 20.0)
    assert table.prefill_rows([generate_json()])[0]["hf_prefill_s"] is None


def test_markdown_cells():
    md = table.markdown(table.build_rows([decode_json()], [generate_json()]),
                        table.prefill_rows([generate_json()], [decode_json()]))
    lines = md.splitlines()
    assert lines[0].startswith("| model | batch | context | jit ms/step | engine ms/step | generate ms/step |")
    assert lines[2:5] == [ROW_1_4K, ROW_1_128K, ROW_32_4K]
    assert lines[5] == "" and lines[6].startswith("| model | batch | prompt | prefill s")
    assert lines[8:] == [PREFILL[0], PREFILL[2], PREFILL[1]]


def test_cli_finds_files_and_labels(tmp_path, capsys):
    from v4jax.cli import main as cli_main
    for sub, name, data in (("a/decode", "decode.json", decode_json()), ("a/gen/x", "generate.json", generate_json()),
                            ("b", "generate.json", generate_json("flash"))):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / name).write_text(json.dumps(data))
    out = tmp_path / "table.md"
    assert table.main([str(tmp_path / "a"), f"{tmp_path / 'b'}=flash (pallas)", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == out.read_text()
    assert ROW_1_4K in text and ROW_32_4K in text and PREFILL[1] in text
    assert "| flash (pallas) | 32 | 4K | - | - | 6.00 | - | - | - | - | - | - | - | - |" in text
    assert cli_main(["bench", "table", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert ROW_1_4K in text and "flash (pallas)" not in text
    assert table.main([str(tmp_path / "empty")]) == 1


def test_steady_step_ms_from_streamed_events():
    from v4jax.bench.generate import steady_step_ms
    # two requests, max_tokens 9, k = 4: request 0 starts at t=0, request 1 gets its first token at t=10 (the
    # window opens), then 4 tokens per call every 2 ms; request 0 reaches 9 at t=12 (the window closes there)
    ev = [(0.000, 0, 1), (0.002, 0, 4), (0.010, 1, 1), (0.010, 0, 2), (0.012, 1, 4), (0.012, 0, 2),
          (0.014, 1, 4), (0.014, 0, 0)]
    ms, steps = steady_step_ms(ev, 2, 9)
    assert steps == 4 and abs(ms - 0.5) < 1e-9   # request 1: 1 -> 5 tokens over 2 ms
    # request 0 finishes before request 1 decodes a step: no window
    ev = [(0.0, 0, 1), (0.002, 0, 8), (0.010, 1, 1), (0.012, 1, 8)]
    assert steady_step_ms(ev, 2, 9) == (None, 0)
    # batch 1: from the first token to the last
    ms, steps = steady_step_ms([(1.0, 0, 1), (1.008, 0, 4), (1.016, 0, 4)], 1, 9)
    assert steps == 8 and abs(ms - 2.0) < 1e-9


@pytest.mark.slow  # a tiny engine's programs compile (about a minute on CPU)
def test_decode_row_over_cached_prompts_decodes_together():
    # four prompts of 600 tokens on a prefill chunk of 512, sent again with their two full pages (of 256) cached:
    # only their tails are computed and all four decode together (fresh, whether they start together depends on
    # how the scheduler packs their chunks)
    import numpy as np

    from v4jax import LLM
    from v4jax.bench.generate import decode_row
    llm = LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=1024, prefill_chunk=512, decode_steps=4)
    row = decode_row(llm, 4, 600, 16, np.random.default_rng(0))
    assert row["cached_steady_steps"] >= 4 and row["cached_steady_ms_per_step"] > 0
    # the timed call's engine steps: wall and device-wait ms a step (LLM.stats()["steps"])
    assert row["engine_step_ms"] >= row["engine_device_wait_ms"] > 0
    # and what they dispatched: the 4 prompts of 600 tokens in two chunks each (512 and 88), at most a step each
    # (a step's budget is 512 tokens), then decode calls of up to all 4 (decode_steps=4: 4 tokens a call)
    es = row["engine_steps"]
    assert es["prefill_rows"] == 8 and 4 <= es["prefill_steps"] <= 8, es
    assert es["decode_calls"] >= 16 // 4 and 1 <= es["decode_rows"] / es["decode_calls"] <= 4, es


@pytest.mark.parametrize("run,doc_name", [("h200-594c918", "BENCHMARKS.md"),
                                          ("h200-c74b007", "docs/results/history.md"),
                                          ("h200-0b05ef5", "docs/results/history.md")])
def test_benchmarks_tables_are_the_stored_results(run, doc_name, capsys):
    # the current tables (BENCHMARKS.md: run M) and the history's (runs L and K) are what `v4jax bench table`
    # prints from the results stored in docs/results
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = os.path.join(root, "docs", "results", run)
    assert table.main([os.path.join(res, "flash-slice"), os.path.join(res, "flash-1gpu")]) == 0
    tables = [t.splitlines() for t in capsys.readouterr().out.strip().split("\n\n")]
    with open(os.path.join(root, doc_name)) as fh:
        doc = fh.read().splitlines()
    assert len(tables) == 2
    for t in tables:  # the decode table and the prefill table, each as printed (the runs share the header)
        assert any(doc[at:at + len(t)] == t for at, line in enumerate(doc) if line == t[0]), t[2]
