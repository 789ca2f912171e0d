"""The orchestrator: JetStream's shape (threads and queues all the way down) over one `ServingEngine`.

    HTTP handlers (asyncio) --commands--> engine thread --step results--> detokenize thread --outputs--> streams

* The engine thread is the only one that touches the engine. It takes commands (add, abort, call, stop) from a
  queue, blocking on it while the engine is idle (no spinning, no GIL churn), and steps the engine while it has
  work, putting each step's deltas on a bounded queue: when the detokenizer falls behind, the engine waits
  (back-pressure) instead of piling up results. A step that raises ends the requests of that step with an error
  (their pages return: `ServingEngine.fail_step`) and the loop goes on; only an error outside a step stops the
  thread, and /health then reports the engine dead.
* The detokenize thread turns token ids into text, matches stop strings (and has the engine abort a sequence a
  stop string ended), keeps the latency metrics and hands each sequence's output to its request's asyncio queue
  through the event loop (`call_soon_threadsafe`).
* Admission is bounded: at most max_num_seqs running + `max_waiting` waiting sequences; beyond that `submit`
  raises `Overloaded` (the HTTP layer answers 429). A sequence's capacity returns when the engine reports its
  last delta, that is when its pages are free again.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from v4jax.engine.sampling import SamplingParams
from v4jax.detokenize import Decode, SequenceText
from v4jax.serve.engine import ServingEngine

log = logging.getLogger("v4jax.serve")


class Overloaded(Exception):
    """The waiting queue is full."""


class ShuttingDown(Exception):
    """The server is draining: no new requests."""


class Unavailable(str):
    """A sequence's error message meaning: no server could take it now (HTTP 503; a router may retry it
    elsewhere)."""


@dataclasses.dataclass
class SeqOutput:
    """What one sequence gained since its last output, as the HTTP layer sees it."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    error: str | None = None
    top_logprobs: list = dataclasses.field(default_factory=list)  # per token: [(token id, log-prob)], if asked


class RequestStream:
    """One HTTP request's sequences; their outputs arrive on an asyncio queue of the server's event loop."""

    def __init__(self, request_id: str, n_seqs: int, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.n_seqs = n_seqs
        self.loop = loop
        self.queue: asyncio.Queue[SeqOutput] = asyncio.Queue()
        self.closed = False  # the client is gone or gave up: outputs are dropped
        self.seq_ids: list[str] = []

    async def get(self) -> SeqOutput:
        return await self.queue.get()

    def get_nowait(self) -> SeqOutput | None:
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None


def deliver(outputs: list[tuple[RequestStream, SeqOutput]]) -> None:
    """Hand outputs to their streams' event loops (from the detokenize thread): one wake-up of a loop for all of
    a step's outputs, not one per stream (64 streams: 0.42 against 0.76 ms of CPU a step on this CPU, the event
    loop's thread sharing the GIL with the engine thread)."""
    by_loop: dict = {}
    for stream, out in outputs:
        by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody is listening
            for stream, _ in items:
                stream.closed = True


def _put_all(items) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


@dataclasses.dataclass(eq=False)
class _Seq:
    rid: str
    stream: RequestStream
    index: int
    prompt_len: int
    text: SequenceText
    arrival: float
    first: float | None = None
    last: float | None = None
    n_tokens: int = 0
    client_reason: str | None = None  # why the client's stream of it ended (None: still open)


@dataclasses.dataclass
class _StepResult:
    time: float
    deltas: list
    errors: dict  # request id -> message, for requests the engine refused


class Orchestrator:
    def __init__(self, engine: ServingEngine, decode: Decode | None, *, max_waiting: int, metrics=None,
                 detokenize_backlog: int = 64, stats_interval_s: float = 0.1):
        self.engine = engine
        self.decode = decode
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.stats_interval_s = stats_interval_s
        self._commands: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue(maxsize=detokenize_backlog)
        self._lock = threading.Lock()  # guards _seqs and _in_flight
        self._seqs: dict[str, _Seq] = {}
        self._in_flight = 0
        self._ids = itertools.count()
        self._stats: dict = {}
        self._stats_time = 0.0
        self._accepting = True
        self._abort_all_at: float | None = None
        self.error: BaseException | None = None  # what stopped the engine thread, if it died
        self._engine_thread = threading.Thread(target=self._engine_loop, name="v4jax-engine", daemon=True)
        self._detok_thread = threading.Thread(target=self._detok_loop, name="v4jax-detokenize", daemon=True)
        self._outbox: list = []  # the detokenize thread's outputs of the step at hand (deliver)

    # ---- lifecycle ----
    def start(self) -> "Orchestrator":
        self._stats = self.engine.stats()
        self._engine_thread.start()
        self._detok_thread.start()
        return self

    @property
    def capacity(self) -> int:
        """Sequences admitted at once: every decode slot plus the waiting queue."""
        return self.engine.max_num_seqs + self.max_waiting

    @property
    def live(self) -> bool:
        return self._engine_thread.is_alive() and self._detok_thread.is_alive() and self.error is None

    @property
    def engine_alive(self) -> bool:
        """Whether the engine thread runs (False once it has died: /health says so)."""
        return self._engine_thread.is_alive() and self.error is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.live

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; abort what is still running after `grace_s` (its streams end, finish_reason
        "abort")."""
        self._accepting = False
        self._commands.put(("shutdown", time.monotonic() + grace_s))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything, end every stream, and join both threads."""
        self._accepting = False
        if self._engine_thread.is_alive():
            self._commands.put(("stop",))
            self._engine_thread.join(timeout)
        if self._detok_thread.is_alive():
            self._results.put(None)
            self._detok_thread.join(timeout)

    # ---- from the HTTP layer ----
    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The engine's request check (ValueError for a request that could never run); any thread."""
        self.engine.check(prompt_ids, params)

    def submit(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], *, n: int = 1,
               stop: Sequence[str] = (), include_stop: bool = False, route: dict | None = None) -> RequestStream:
        """Queue n sequences per prompt (sequence i * n + j samples prompt i with sample index j). Must be called
        from the event loop that will read the stream. `stop` / `include_stop`: the stop strings and whether the
        text keeps the one that ended it (SequenceText). `route`: the engine's add_request's (disaggregation)."""
        if not self.accepting:
            raise ShuttingDown()
        count = len(prompts) * n
        rid = f"{next(self._ids)}"
        stream = RequestStream(rid, count, asyncio.get_running_loop())
        now = time.monotonic()
        with self._lock:
            if self._in_flight + count > self.capacity:
                raise Overloaded()
            self._in_flight += count
            for i, (p, sp) in enumerate(zip(prompts, params)):
                for j in range(n):
                    seq_id = f"{rid}-{i * n + j}"
                    text = SequenceText(self.decode, stop, sp.min_tokens, include_stop)
                    seq = _Seq(seq_id, stream, i * n + j, len(p), text, now)
                    self._seqs[seq_id] = seq
                    stream.seq_ids.append(seq_id)
                    self._commands.put(("add", seq_id, list(p), sp, j, route))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(n * sum(len(p) for p in prompts))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """The client is gone (or timed out): stop its sequences now; their pages return after the engine's
        next step. Idempotent."""
        if stream.closed:
            return
        stream.closed = True
        for seq_id in stream.seq_ids:
            self._commands.put(("abort", seq_id))

    def run_on_engine(self, fn: Callable) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (inspection, tests)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return fut

    def score_prompt(self, prompt_ids: Sequence[int], top_n: int) -> concurrent.futures.Future:
        """The prompt's log-probs (`ServingEngine.prompt_logprobs`), computed on the engine thread between steps:
        the only thread that runs device work, so the forward never contends with a step for the device."""
        if not self.accepting:
            raise ShuttingDown()
        ids = list(prompt_ids)
        return self.run_on_engine(lambda engine: engine.prompt_logprobs(ids, top_n))

    def stats(self) -> dict:
        """The engine's stats() as of its last step (at most stats_interval_s old while busy)."""
        out = dict(self._stats)
        with self._lock:
            out["server"] = {"in_flight": self._in_flight, "capacity": self.capacity, "accepting": self.accepting}
        return out

    # ---- the engine thread ----
    def _engine_loop(self) -> None:
        eng = self.engine
        stopping = False
        added: set[str] = set()  # sequences the engine holds (added, no last delta yet)
        try:
            while True:
                busy = eng.has_unfinished_requests()
                cmds, errors = [], {}
                try:  # idle: block for the next command; busy: take what is there and step
                    cmds.append(self._commands.get(block=not busy, timeout=0.5))
                    while True:
                        cmds.append(self._commands.get_nowait())
                except queue.Empty:
                    pass
                for cmd in cmds:
                    stopping |= self._apply(cmd, errors)
                    if cmd[0] == "add" and cmd[1] not in errors:
                        added.add(cmd[1])
                if stopping or (self._abort_all_at is not None and time.monotonic() >= self._abort_all_at):
                    self._abort_everything()
                try:
                    deltas = eng.step() if eng.has_unfinished_requests() else []
                except Exception as e:  # one step failed: its requests end with an error, the loop goes on
                    log.exception("engine step failed; the requests of that step end with an error")
                    deltas = []
                    eng.fail_step()
                    held = eng.request_ids()
                    for rid in added - held:  # the step's, and any whose last delta the failed step took
                        errors[rid] = f"the engine step failed: {type(e).__name__}: {e}"
                    added &= held
                gone = eng.failed()  # failed outside a step (a disaggregated engine's remote prefill)
                errors.update(gone)
                added.difference_update(gone)
                added.difference_update(d.request_id for d in deltas if d.finish_reason is not None)
                if deltas or errors:
                    self._results.put(_StepResult(time.monotonic(), deltas, errors))  # blocks: back-pressure
                self._publish_stats()
                if stopping and not eng.has_unfinished_requests():
                    return
        except BaseException as e:  # the engine failed: every open stream ends with an error
            log.exception("engine thread failed")
            self.error = e
            self._accepting = False
            with self._lock:
                rids = list(self._seqs)
            self._results.put(_StepResult(time.monotonic(), [], {r: f"engine failed: {e}" for r in rids}))

    def _apply(self, cmd, errors: dict) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, seq_id, prompt, sp, sample_index, route = cmd
            try:
                self.engine.add_request(seq_id, prompt, sp, sample_index, route)
            except ValueError as e:
                errors[seq_id] = str(e)
            except Exception as e:  # a bug on the way in fails this request, not the engine thread
                log.exception("adding request %s failed", seq_id)
                errors[seq_id] = f"{type(e).__name__}: {e}"
        elif kind == "abort":
            self.engine.abort(cmd[1])
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)
        elif kind == "shutdown":
            self._abort_all_at = cmd[1]
        elif kind == "stop":
            return True
        return False

    def _abort_everything(self) -> None:
        with self._lock:
            rids = list(self._seqs)
        for rid in rids:
            self.engine.abort(rid)

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_time >= self.stats_interval_s or not self.engine.has_unfinished_requests():
            self._stats, self._stats_time = self.engine.stats(), now

    # ---- the detokenize thread ----
    def _detok_loop(self) -> None:
        while True:
            res = self._results.get()
            if res is None:
                return
            self._outbox = []  # the step's outputs, delivered together
            try:
                for rid, msg in res.errors.items():
                    self._refused(rid, msg)
                for d in res.deltas:
                    self._advance(d, res.time)
            except Exception:  # a bug here must not leave every stream hanging
                log.exception("detokenize thread: a step's results could not be processed")
            finally:
                self._flush()

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        deliver(outbox)

    def _refused(self, rid: str, msg: str) -> None:
        with self._lock:
            seq = self._seqs.get(rid)
        if seq is None:
            return
        if seq.client_reason is None:
            seq.client_reason = "error"
            self._outbox.append((seq.stream, SeqOutput(seq.index, "", [], [], "error", error=msg)))
        if self.metrics is not None:  # counted before in_flight drops (see _advance)
            self.metrics.finished.labels(finish_reason="error").inc()
        self._flush()
        with self._lock:
            if self._seqs.pop(rid, None) is not None:
                self._in_flight -= 1

    def _advance(self, d, t: float) -> None:
        with self._lock:
            seq = self._seqs.get(d.request_id)
        if seq is None:
            return
        m = self.metrics
        if d.new_token_ids and seq.first is None:
            seq.first = t
            if m is not None:
                m.ttft.observe(t - seq.arrival)
        if seq.client_reason is None and not seq.stream.closed:
            final = d.finish_reason is not None
            pushed = seq.text.push(d.new_token_ids, d.new_logprobs, final=final)
            reason = "stop" if pushed.stopped else d.finish_reason
            seq.n_tokens += len(pushed.token_ids)
            if pushed.token_ids:
                seq.last = t
            if m is not None:
                m.generation_tokens.inc(len(pushed.token_ids))
            if reason is not None:
                seq.client_reason = reason
                self._observe_finished(seq, t)
                if not final:  # a stop string ended it; the engine still runs it
                    self._commands.put(("abort", seq.rid))
            tops = d.new_top_logprobs[:len(pushed.token_ids)]  # those of the tokens that count
            self._outbox.append((seq.stream, SeqOutput(seq.index, pushed.text, pushed.token_ids, pushed.logprobs,
                                                       reason, top_logprobs=tops)))
        if d.finish_reason is not None:  # the engine has let go: its pages are free
            # Counted before in_flight drops, so whoever sees in_flight == 0 also sees every finish counted.
            if m is not None:
                m.finished.labels(finish_reason=seq.client_reason or "abort").inc()
            self._flush()  # its last output on its way before in_flight drops
            with self._lock:
                self._seqs.pop(seq.rid, None)
                self._in_flight -= 1

    def _observe_finished(self, seq: _Seq, t: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.e2e.observe(t - seq.arrival)
        if seq.n_tokens >= 2 and seq.first is not None and seq.last is not None:
            m.tpot.observe((seq.last - seq.first) / (seq.n_tokens - 1))
