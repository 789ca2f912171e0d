"""The replay benchmark (v4jax.bench.replay): prefix reuse on a multi-turn and an agentic trace, the same tokens on every
layout, the report's columns. CPU, the tiny preset in float32.

One module fixture replays both traces on the three layouts (one engine per layout). Compilation dominates on CPU
(about 8 s a variant), so the traces are shaped to need 2-3 variants per engine: every prompt is 576-960 tokens
(pages of 64, a 1024-token context: one page bucket, 16), is prefilled in one chunk (prefill_chunk 1024: one
chunk bucket) and every turn adds one page (32 generated + 32 new tokens: a prefix hit leaves a 64-token chunk)."""
import json

import pytest

from v4jax import LLM
from v4jax.bench import replay as R

PAGE = 64
SLOTS = 4
MAX_LEN = 1024


@pytest.fixture(scope="module")
def replayed():
    llm = LLM("tiny", dtype="float32", page_size=PAGE, prefill_chunk=MAX_LEN, max_model_len=MAX_LEN,
              max_num_seqs=SLOTS, decode_steps=8)
    vocab = llm.config.vocab_size
    # 5 conversations on 4 slots (one waits), 7 turns: each turn adds 32 generated + 32 user tokens (one page)
    chat = R.multi_turn(vocab, 0, conversations=5, turns=7, first_tokens=(576, 576), user_tokens=(32, 32),
                        max_tokens=32, gap=2, think=1)
    agent = R.agentic(vocab, 0, task_tokens=576, steps=7, tool_tokens=(32, 32), max_tokens=32)
    # The memory budget is 4x the multi-turn working set (the larger of the two traces'): the working set is the
    # full pages of the largest contexts live at once. A conversation runs one turn at a time and its last
    # turn's context (prompt + max_tokens) holds every earlier turn's pages: 16 pages (960 + 32 tokens). All 5
    # conversations are open from the start to the end (a waiting one must keep its pages to hit on its next
    # turn): 80 pages. The paged layouts get memory_budget_bytes = their fixed pools (window, compressor
    # states, boundary store) + 4 x 80 full pages.
    assert chat.working_set_pages(PAGE, SLOTS) == 5 * 16 > agent.working_set_pages(PAGE, SLOTS)
    rep = R.run_replay(llm, [chat, agent], warmup="none", budget_ws=4.0, log=lambda msg: None)
    return rep, chat, agent


def _row(rep, trace, layout):
    (row,) = [r for r in rep["rows"] if r["trace"] == trace and r["layout"] == layout]
    return row


@pytest.mark.slow  # minutes on CPU; -m slow
def test_multi_turn_reuses_the_reusable_prefix(replayed):
    rep, chat, _ = replayed
    assert rep["engines"]["paged+prefix"]["n_pages"] >= 4 * chat.working_set_pages(PAGE, SLOTS)
    row = _row(rep, "multi_turn", "paged+prefix")
    # turn t's prompt is 576 + 64 t tokens; turn t-1 wrote the KV of 576 + 64 (t - 1) + 31: 8 + t full pages
    assert row["reusable_tokens"] == 5 * PAGE * sum(8 + t for t in range(1, 7))
    assert row["preempted"] == 0
    assert row["reused_tokens"] >= 0.9 * row["reusable_tokens"], (row["reused_tokens"], row["reusable_tokens"],
                                                                 row["tombstoned_tails"], row["evicted_pages"])
    assert row["queried_tokens"] == row["prompt_tokens"]
    for layout in ("dense", "paged"):
        assert _row(rep, "multi_turn", layout)["reused_tokens"] == 0


@pytest.mark.slow  # minutes on CPU; -m slow
def test_agentic_keeps_hitting_as_the_context_grows(replayed):
    rep, _, agent = replayed
    row = _row(rep, "agentic", "paged+prefix")
    steps = [r for r in row["per_request"] if r["id"].startswith("s0step")]
    assert [r["id"] for r in steps] == [f"s0step{i}" for i in range(7)]
    hits = [r["hit_tokens"] for r in steps]
    assert all(b > a for a, b in zip(hits, hits[1:])), hits
    assert hits == [r["reusable_tokens"] for r in steps] == [0] + [PAGE * (8 + i) for i in range(1, 7)]
    assert sum(hits) == row["reused_tokens"]


@pytest.mark.slow  # minutes on CPU; -m slow
def test_outputs_identical_between_layouts(replayed):
    rep, chat, agent = replayed
    for trace in (chat, agent):
        assert [_row(rep, trace.name, lay)["same_tokens"] for lay in R.LAYOUTS] == ["yes", "ref", "yes"]
        for lay in R.LAYOUTS:
            row = _row(rep, trace.name, lay)
            assert row["generated_tokens"] == sum(r.max_tokens for r in trace.requests)
            assert all(r["finish"] == "length" for r in row["per_request"])


@pytest.mark.slow  # minutes on CPU; -m slow
def test_report_has_every_column(replayed, tmp_path):
    rep, _, _ = replayed
    md = R.markdown(rep).splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    assert header == list(R.COLUMNS)
    assert len(md) == 2 + 2 * len(R.LAYOUTS)
    for line in md[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(R.COLUMNS) and all(cells), line
    for row in rep["rows"]:
        for key in ("peak_pool_bytes", "peak_mapped_bytes", "pool_alloc_bytes", "gen_tok_s", "total_tok_s",
                    "reused_tokens", "queried_tokens", "reusable_tokens", "same_tokens"):
            assert row[key] is not None, key
        assert set(row["ttft_ms"]) == set(row["tpot_ms"]) == {"p50", "p90", "p99"}
        assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["p50"] > 0
        assert row["peak_mapped_bytes"] <= row["peak_pool_bytes"] <= row["pool_alloc_bytes"]
    dense, paged = _row(rep, "multi_turn", "dense"), _row(rep, "multi_turn", "paged")
    assert paged["peak_pool_bytes"] < dense["peak_pool_bytes"]
    json.loads(json.dumps(rep, default=str))


def test_reusable_tokens_by_hand():
    p = 4
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prompts = {"a": a, "b": a[:8] + [0, 0], "c": a[:8], "d": [9] * 5}
    outputs = {"a": [10, 11, 12], "b": [0], "c": [1], "d": [1, 2]}
    got = R.reusable_tokens(["a", "b", "c", "d"], prompts, outputs, p)
    # b shares 8 tokens (2 pages) with a; c shares 8 but a match is capped at prompt_len - 1 = 7: one page
    assert got == {"a": 0, "b": 8, "c": 4, "d": 0}
    # a's prompt + output[:-1] = 11 tokens: a later prompt can reuse its pages 0-1 (page 2 is not full)
    got = R.reusable_tokens(["a", "e"], {"a": a, "e": a + [10, 11, 12, 13]}, {"a": [10, 11, 12], "e": [0]}, p)
    assert got["e"] == 8


def test_traces_are_seeded_and_sized():
    t1, t2 = R.shared_system(512, 3), R.shared_system(512, 3)
    assert [r.new_tokens for r in t1.requests] == [r.new_tokens for r in t2.requests]
    assert all(len(r.new_tokens) % R.GRANULE == 0 for r in t1.requests)
    chat = R.multi_turn(512, 0, conversations=2, turns=3, first_tokens=(64, 64), user_tokens=(32, 32),
                        max_tokens=32)
    assert chat.prompt_len("c1t2") == 64 + 2 * (32 + 32)
    assert chat.max_context() == 64 + 2 * 64 + 32
    # both conversations count whatever the slots (224 tokens: 4 pages of 64 each); single requests: the 2
    # largest of 8 (192 tokens: 3 pages)
    assert chat.working_set_pages(64, 1) == 2 * 4
    shared = R.shared_system(512, 0, system_tokens=128, users=8, question_tokens=(32, 32), max_tokens=32)
    assert shared.working_set_pages(64, 2) == 2 * 3
    assert R.make_traces(["agentic"], 512, opts=["agentic.steps=3"])[0].params["steps"] == 3
    assert R.main(["--trace", "nope"]) == 2
    assert "default: 1.0" in R._parser().format_help()


@pytest.mark.slow
def test_command_line_end_to_end(tmp_path):
    out = tmp_path / "out"
    rc = R.main(["--model", "tiny", "--page-size", "64", "--prefill-chunk", "64", "--max-num-seqs", "4",
                 "--trace", "shared_system,long_docs", "--scale", "0.25", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "replay.json").read_text())
    assert len(rep["rows"]) == 2 * len(R.LAYOUTS)
    assert (out / "replay.md").read_text().startswith("| trace |")


@pytest.mark.slow
def test_many_waiting_conversations_keep_their_tails():
    llm = LLM("tiny", dtype="float32", page_size=PAGE, prefill_chunk=MAX_LEN, max_model_len=MAX_LEN,
              max_num_seqs=2, decode_steps=8)
    # 12 conversations on 2 slots; 4x the working set (all 12 conversations' last contexts) in full pages, so no
    # full page is evicted; the SWA pool holds 4 tails per slot beyond the running windows (16 pages here, room
    # for the 12 tails the waiting conversations resume from)
    chat = R.multi_turn(llm.config.vocab_size, 0, conversations=12, turns=5, first_tokens=(576, 576),
                        user_tokens=(32, 32), max_tokens=32, gap=1, think=1)
    rep = R.run_replay(llm, [chat], ["paged+prefix"], warmup="none", budget_ws=4.0, log=lambda msg: None)
    (row,) = rep["rows"]
    assert row["evicted_pages"] == 0
    assert row["reused_tokens"] >= 0.9 * row["reusable_tokens"], (row["reused_tokens"], row["reusable_tokens"])
