"""LLM.generate with several callers on one engine: interleaved and nested streams each get exactly their own
events, a stream dropped early ends its requests and their pages return, threads share the engine, and Ctrl-C in
`v4jax generate` (a real process) aborts and exits 130 without a crash."""
import itertools
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from v4jax import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
A = [[5, 6, 7, 8, 9], [40, 41]]
B = [[20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]


@pytest.fixture(scope="module")
def llm():
    # tests/test_engine.py's tiny engine options: in one run its programs come from the compilation cache
    return LLM("tiny", dtype="float32", max_num_seqs=4, max_model_len=256, prefill_chunk=16, decode_steps=4)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt list's greedy tokens, run alone."""
    return {name: [o.token_ids for o in llm.generate(p, GREEDY)] for name, p in (("A", A), ("B", B))}


def _take(stream, n, into):
    """Read n events (all with None) of a stream into per-prompt token lists; the number read."""
    k = 0
    for i, toks, _ in itertools.islice(stream, n):
        into[i] += toks
        k += 1
    return k


def _idle(llm):
    """No request left in the engine, and every page free once the prefix cache lets go of its own."""
    core = llm.engine
    core.kv.reset_prefix_cache()
    return not core.scheduler.requests and all(s is None for s in core.scheduler.slots) and core.kv.all_free()


def test_interleaved_streams_get_their_own_events(llm, alone):
    got_a, got_b = [[], []], [[], []]
    sa, sb = llm.generate(A, GREEDY, stream=True), llm.generate(B, GREEDY, stream=True)
    assert _take(sa, 2, got_a) == 2 and _take(sb, 1, got_b) == 1
    assert [o.token_ids for o in llm.generate(A, GREEDY)] == alone["A"]  # a whole call in between
    assert _take(sa, 1, got_a) == 1
    got_c = [[], []]
    _take(llm.generate(B, GREEDY, stream=True), None, got_c)  # a whole stream in between
    _take(sb, None, got_b)
    _take(sa, None, got_a)
    assert got_a == alone["A"] and got_b == alone["B"] and got_c == alone["B"]
    assert _idle(llm)


def test_generate_inside_a_stream_loop(llm, alone):
    got, inner = [[], []], []
    for n, (i, toks, _) in enumerate(llm.generate(A, GREEDY, stream=True)):
        got[i] += toks
        if n in (0, 3):  # the outer stream's events keep arriving while the inner calls step the engine
            inner.append([o.token_ids for o in llm.generate(B, GREEDY)])
    assert got == alone["A"] and inner == [alone["B"], alone["B"]]
    assert _idle(llm)


def test_dropped_stream_ends_its_requests(llm, alone):
    aborted = llm.stats()["requests"]["aborted"]
    started = llm.generate(A, LONG, stream=True)
    next(started)
    assert llm.engine.scheduler.requests
    del started  # garbage: aborted at once
    assert _idle(llm)
    never_started = llm.generate(B, LONG, stream=True)
    assert len(llm.engine.scheduler.requests) == 2
    del never_started
    assert _idle(llm)
    for _ in llm.generate(A, LONG, stream=True):
        break  # the loop's iterator is garbage after the break
    assert _idle(llm)
    closed = llm.generate(B, LONG, stream=True)
    next(closed)
    closed.close()
    assert _idle(llm)
    assert llm.stats()["requests"]["aborted"] == aborted + 8
    assert [o.token_ids for o in llm.generate(A, GREEDY)] == alone["A"]  # a later call unaffected


def test_a_stream_dropped_inside_another_calls_step_is_aborted_after_it(llm, alone):
    # a finalizer can run inside a step (a garbage collection there): it only marks the call, and the step's end
    # aborts it
    dropped = llm.generate(B, LONG, stream=True)
    next(dropped)
    step = llm.engine.step

    def step_then_drop():
        nonlocal dropped
        out = step()
        dropped = None  # garbage now, inside "the step"
        return out

    llm.engine.step = step_then_drop
    try:
        assert [o.token_ids for o in llm.generate(A, GREEDY)] == alone["A"]
    finally:
        del llm.engine.step
    assert _idle(llm)


def test_ctrl_c_during_a_step_is_raised_after_it(llm, alone):
    # a KeyboardInterrupt inside a step would leave the engine half-updated; held to the step's end, the call's
    # requests are aborted and the engine serves the next call
    step, ended = llm.engine.step, []

    def step_with_ctrl_c():
        signal.raise_signal(signal.SIGINT)  # its handler runs here, in the middle of "the step"
        out = step()
        ended.append(True)
        return out

    llm.engine.step = step_with_ctrl_c
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(A, LONG)
    finally:
        del llm.engine.step
    assert ended == [True] and _idle(llm)
    assert [o.token_ids for o in llm.generate(A, GREEDY)] == alone["A"]


def test_threads_share_the_engine(llm, alone):
    jobs = [("A", False), ("B", True), ("A", True), ("B", False)]
    results, errors = {}, []
    start = threading.Barrier(len(jobs))

    def run(k, name, stream):
        try:
            start.wait()
            prompts = A if name == "A" else B
            if stream:
                got = [[] for _ in prompts]
                _take(llm.generate(prompts, GREEDY, stream=True), None, got)
            else:
                got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            results[k] = got
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(k, *job)) for k, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results == {k: alone[name] for k, (name, _) in enumerate(jobs)}
    assert _idle(llm)


def test_ctrl_c_in_generate_exits_130():
    """Ctrl-C while the prompt prefills (just after its echo) and while tokens stream: the requests are aborted,
    one line says so, and the process exits 130 with no traceback and no crash at exit."""
    # `python -m v4jax.cli generate ...`, with Python's own SIGINT handler installed first: a job started in the
    # background by a shell ignores SIGINT, and Python keeps a disposition it inherits as ignored
    run_cli = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from v4jax.cli import main; sys.exit(main())")
    cmd = [sys.executable, "-c", run_cli, "generate", "--max-tokens", "3000", "--temperature", "0", "--ignore-eos",
           "To be"]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1")
    for trial, wait_for in enumerate((len("To be"), len("To be") + 40)):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out = b""
        try:
            while len(out) < wait_for:
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"trial {trial}: the process ended before printing {wait_for} bytes"
                out += chunk
            time.sleep(0.05 * trial)
            proc.send_signal(signal.SIGINT)
            err = proc.communicate(timeout=120)[1]  # the step running when Ctrl-C came ends first
        finally:
            proc.kill()
        err = err.decode()
        assert proc.returncode == 130, f"trial {trial}: exit {proc.returncode}\n{err[-3000:]}"
        assert err.strip().splitlines()[-1] == "interrupted", err[-3000:]
        assert "Traceback" not in err and "Fatal Python error" not in err and "Exception ignored" not in err, err
