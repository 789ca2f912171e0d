"""A stream's outputs that waited together reach the client as one event per sequence, losing nothing."""
import asyncio
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from v4jax.serve import streams as S
from v4jax.serve.orchestrator import RequestStream, SeqOutput

REASONS = [None, None, None, "stop", "length"]


@st.composite
def step_outputs(draw):
    """Outputs of up to 3 sequences over some steps, each sequence ending at most once (errors end it too)."""
    n = draw(st.integers(1, 3))
    outs, ended = [], set()
    for _ in range(draw(st.integers(0, 12))):
        i = draw(st.integers(0, n - 1))
        if i in ended:
            continue
        if draw(st.integers(0, 9)) == 0:
            outs.append(SeqOutput(i, "", [], [], "error", error="boom"))
            ended.add(i)
            continue
        k = draw(st.integers(0, 3))
        ids = draw(st.lists(st.integers(0, 99), min_size=k, max_size=k))
        reason = draw(st.sampled_from(REASONS))
        outs.append(SeqOutput(i, "".join(f"<{t}>" for t in ids), ids, [-t / 10 for t in ids], reason,
                              top_logprobs=[[(t, -1.0)] for t in ids]))
        if reason is not None:
            ended.add(i)
    return outs


def _per_sequence(outs):
    seqs = {}
    for o in outs:
        s = seqs.setdefault(o.index, {"text": "", "ids": [], "lps": [], "tops": [], "ends": [], "errors": []})
        s["text"] += o.text
        s["ids"] += o.token_ids
        s["lps"] += o.logprobs
        s["tops"] += o.top_logprobs
        s["ends"].append(o.finish_reason)
        s["errors"].append(o.error)
    for s in seqs.values():  # where it ended and why, not how many outputs said "not yet"
        s["ends"] = [e for e in s["ends"] if e is not None]
        s["errors"] = [e for e in s["errors"] if e is not None]
    return seqs


@settings(max_examples=300, deadline=None)
@given(step_outputs())
def test_merged_keeps_every_sequences_text_tokens_and_ending(outs):
    got = S.merged(outs)
    assert _per_sequence(got) == _per_sequence(outs)
    # two outputs of a sequence stand apart only where an error or the end lies between them
    for i in {o.index for o in outs}:
        mine = [o for o in got if o.index == i]
        for a, b in zip(mine, mine[1:]):
            assert a.error or b.error or a.finish_reason is not None

def test_merged_leaves_errors_apart():
    outs = [SeqOutput(0, "a", [1], [-0.1], None), SeqOutput(0, "", [], [], "error", error="boom"),
            SeqOutput(1, "b", [2], [-0.2], None), SeqOutput(1, "c", [3], [-0.3], "stop")]
    got = S.merged(outs)
    assert [(o.index, o.text, o.token_ids, o.finish_reason, o.error) for o in got] == [
        (0, "a", [1], None, None), (0, "", [], "error", "boom"), (1, "bc", [2, 3], "stop", None)]


def test_a_lagging_stream_gets_one_output_per_sequence():
    async def run():
        stream = RequestStream("r", 2, asyncio.get_running_loop())
        for step in range(5):   # five engine steps' outputs arrived while the client was busy
            for i in range(2):
                stream.queue.put_nowait(SeqOutput(i, f"{step}", [step], [-1.0], "length" if step == 4 else None))
        return [batch async for batch in S.batches(stream, time.monotonic() + 5)]

    batches = asyncio.run(run())
    assert len(batches) == 1
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in batches[0]] == [
        (0, "01234", [0, 1, 2, 3, 4], "length"), (1, "01234", [0, 1, 2, 3, 4], "length")]
