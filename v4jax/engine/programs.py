"""Which step programs are compiled, which one a step runs, and the missing ones compiled in the background.

A step's exact program is fixed by its shape: prefill rows x chunk length x page-table width, decode slots x
page-table width, and its form (greedy-only, or sampling with or without the top-k / top-p cut's sort; with or
without top-N alternatives). A program at least as large in every dimension runs the step correctly: rows past
the step's are empty, tokens past a row's `n_valid` and page-table columns past a request's pages are masked, a
sampling program's greedy rows take the argmax, and the cut's form draws for rows that ask for no cut what the
form without it draws. So do other requests sharing a step already: a request's tokens do not depend on the
bucket it ran in.

Once warm-up has compiled a cover (for each prefill row count, the longest chunk at the widest table; the decode
call over every slot at the widest table, in the sampling form with the top-N alternatives, without the top-k /
top-p cut and greedy-only: 7 programs for flash-slice with 16 slots, against well over 200 in all), a step
whose exact program is not compiled runs on the cheapest compiled one that covers it, while the exact program
compiles on a background thread and takes over from the next step on. On an H200 a flash-slice
program took ~15 s to compile (a step, milliseconds): a new shape after `/health` said ready stalled every
stream for that long; now it costs a few steps on a larger program.

Without covers (no warm-up: `LLM.generate` in a notebook), each step compiles its own program in its call; a
prompt of several chunks then names the programs its later chunks and its first decode call will run (`ahead`),
which compile on the background threads meanwhile, and a step whose program is compiling there waits for it.

On several processes every process must run the same program each step (the followers replay the leader's
steps), which a background compile's timing would not guarantee: there a program compiled in the background may
run steps only once the leader has announced it (`agreed`: the leader takes what it compiled with `take_compiled`
at the start of a step, which agrees to it there, and publishes it with the step; the other processes `agree`
before taking the step)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import weakref
from typing import Any, Callable

log = logging.getLogger("v4jax.engine")

# Background compile threads. Tracing holds the GIL (~3 s of a flash-slice program's ~15 s on the H200's host),
# which the engine thread needs to dispatch its steps: two keep a burst of new shapes moving without starving it.
BACKGROUND_THREADS = 2


def form_parts(spec) -> tuple[bool, bool, bool, bool]:
    """A step form's parts, each True where it does more: the top-N alternatives, the penalties, sampling, the
    top-k / top-p cut (only where it samples). In this order a program's cost ranks them (Program.cost)."""
    return spec.top_logprobs > 0, spec.any_penalty, spec.any_sampled, spec.any_sampled and spec.any_cut


def runs_form(wide, form) -> bool:
    """Whether the program form `wide` gives a step of form `form` its own results: at least as wide in every part
    (a greedy row samples nothing in a sampling form, a row that does not cut is not cut, neutral penalties leave
    the logits as they are, the alternatives are read only where asked for)."""
    return all(w >= f for w, f in zip(form_parts(wide), form_parts(form)))


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step: its kind, form (the StepSpec, hashed by identity) and shape."""
    kind: str  # "prefill" | "decode"
    spec: Any  # v4jax.engine.steps.StepSpec
    rows: int  # prefill rows, or the decode call's slots
    chunk: int  # a prefill row's compiled length (decode: 0)
    pages: int  # page-table width

    def __str__(self) -> str:
        form = ("greedy" if not self.spec.any_sampled else "sampling" if self.spec.any_cut else "sampling, no cut") \
            + (", penalties" if self.spec.any_penalty else "") + (", top-N" if self.spec.top_logprobs else "")
        return (f"{self.kind} rows {self.rows}" + (f" x {self.chunk}" if self.chunk else "")
                + f", {self.pages} pages ({form})")

    def covers(self, other: "Program", wider_specs: dict) -> bool:
        return (self.kind == other.kind and self.spec in wider_specs.get(other.spec, (other.spec,))
                and self.rows >= other.rows and self.chunk >= other.chunk and self.pages >= other.pages)

    def cost(self) -> tuple:
        # the tokens a step computes, then the table it reads; the greedy-only form before the sampling ones (the
        # one without the cut first), each before its twin with penalties, and those before their twins with the
        # top-N alternatives
        return (self.rows * max(self.chunk, 1), self.pages, *form_parts(self.spec))


_worker = threading.local()


def in_background() -> bool:
    """Whether this thread is one of the background compile threads (compiles there keep no request waiting)."""
    return getattr(_worker, "background", False)


def _mark_background() -> None:
    _worker.background = True


def _close_if_alive(ref: "weakref.ref[ProgramBook]") -> None:
    book = ref()
    if book is not None:
        book.close()


class ProgramBook:
    """The engine's record of its compiled step programs, and the choice of the program a step runs.

    `compile_program(program)` compiles one ahead of time (the engine's `lower(...).compile()` on arguments of
    that shape, which fills the caches the step's own call looks in). `wider_specs[spec]`: the forms that may run a
    step of form `spec`, itself first (a greedy-only step may run on the sampling program, any step on the
    sampling one with the top-N alternatives)."""

    def __init__(self, compile_program: Callable[[Program], None], wider_specs: dict):
        self._compile = compile_program
        self._wider = wider_specs
        self._ready: set[Program] = set()
        self._executed: set[Program] = set()
        self._pending: dict[Program, concurrent.futures.Future] = {}
        self._lock = threading.RLock()  # a done callback may run inside _submit, which holds it
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.substitute = False  # cover steps whose program is missing (set by warm-up)
        # compile a covered step's own program in the background (False: a benchmark of fixed shapes runs its steps
        # on the covers and compiles nothing more)
        self.background = True
        self.substituted_steps = 0  # steps that ran on a covering program
        # several processes: background compiles wait in _compiled until every process has agreed to them
        self.agreed = False
        self._compiled: set[Program] = set()

    def choose(self, exact: Program, fits: Callable[[Program], bool] = lambda p: True) -> Program:
        """The program a step of shape `exact` runs: itself once compiled (or when nothing may stand in for it:
        its call then compiles it, or waits for its compile ahead), else the cheapest compiled one that covers it
        and `fits` (the step's own limits), `exact` then compiling in the background."""
        with self._lock:
            if exact in self._ready:
                return exact
            if not self.substitute:
                ahead = self._pending.get(exact)
                if ahead is None or ahead.cancel():  # not started yet: the step's own call compiles it now
                    return exact
            else:
                cover = [p for p in self._ready if p.covers(exact, self._wider) and fits(p)]
                if not cover:
                    return exact
                if self.background:
                    self._submit(exact)
                self.substituted_steps += 1
                return min(cover, key=Program.cost)
        # compiling ahead on a background thread: wait for it there rather than compile it twice (outside the lock,
        # which the compile's done callback takes)
        concurrent.futures.wait([ahead])
        return exact

    @property
    def compiles_ahead(self) -> bool:
        """Whether `ahead` compiles anything: no covers, background compiles on, one process."""
        return not self.substitute and self.background and not self.agreed

    def ahead(self, programs: list[Program]) -> None:
        """Compile `programs` in the background now, before a step needs them: on an engine without covers, the
        programs a long prompt's later chunks and its first decode call will run, which its steps would otherwise
        compile one after another as they reach them (a 128K prompt at chunks of 8,192: five prefill page buckets,
        13-19 s each for flash-slice on an H100). Not with covers (those run such steps), nor without background
        compiles, nor where processes must agree on what is compiled."""
        with self._lock:
            if not self.compiles_ahead:
                return
            for p in programs:
                if p not in self._ready:
                    self._submit(p)

    def ran(self, program: Program) -> bool:
        """A step's call returned: its program is compiled (its call compiled it if it was not). Returns whether
        this was the program's first run."""
        with self._lock:
            self._ready.add(program)
            first = program not in self._executed
            self._executed.add(program)
            return first

    def compile_now(self, programs: list[Program], threads: int, progress=None) -> None:
        """Compile `programs` on `threads` threads (XLA's compiler releases the GIL, and one program compiles on
        few cores), calling `progress(done, total)` after each."""
        def one(p):
            self._compile(p)
            return p

        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(programs), threads))) as pool:
            for done, f in enumerate(concurrent.futures.as_completed([pool.submit(one, p) for p in programs]), 1):
                p = f.result()
                with self._lock:
                    self._ready.add(p)
                if progress is not None:
                    progress(done, len(programs))

    def _submit(self, program: Program) -> None:
        if program in self._pending or program in self._compiled or self._closed:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(BACKGROUND_THREADS, "v4jax-compile",
                                                                   initializer=_mark_background)
            # At interpreter exit concurrent.futures joins its threads, which first run every queued compile (a
            # burst of new shapes on an H200 left 27 of ~15 s each: minutes between SIGTERM and exit). Hooks of
            # this list run last-registered first, so this one drops the queue before that join. (Through a weak
            # reference: the book holds its engine, pools included, which must not live until exit.)
            threading._register_atexit(_close_if_alive, weakref.ref(self))
        self._pending[program] = f = self._executor.submit(self._compile, program)
        f.add_done_callback(lambda _, asked=time.monotonic(): self._done(program, asked))

    def close(self) -> None:
        """Drop the background compiles still queued (those running end); no more are started."""
        with self._lock:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    def _done(self, program: Program, asked: float) -> None:
        with self._lock:
            f = self._pending.pop(program)
            if f.cancelled():
                return
            if f.exception() is None:
                (self._compiled if self.agreed else self._ready).add(program)
                # which shapes a server meets after its warm-up, and how long covers ran their steps
                log.info("compiled in the background: %s, ready %.1f s after a step asked for it", program,
                         time.monotonic() - asked)
            else:  # the step's own call compiles it then, and raises there if it must
                log.warning("background compile of %s failed: %s", program, f.exception())

    def take_compiled(self) -> list[Program]:
        """The leader of several processes, at the start of a step: the programs compiled in the background since
        the last call, agreed to here, to publish with the step (the others `agree` to them before it)."""
        with self._lock:
            out, self._compiled = list(self._compiled), set()
            self._ready.update(out)
            return out

    def agree(self, programs: list[Program]) -> None:
        """Programs every process may now run steps on (a process that has not compiled one yet compiles it in
        the step's own call)."""
        with self._lock:
            self._ready.update(programs)
            self._compiled.difference_update(programs)

    def wait(self) -> None:
        """Until every background compile has ended."""
        while True:
            with self._lock:
                pending = list(self._pending.values())
            if not pending:
                return
            concurrent.futures.wait(pending)

    def counts(self) -> dict:
        with self._lock:
            return {"ready": len(self._ready), "ran": len(self._executed), "compiling": len(self._pending),
                    "substituted_steps": self.substituted_steps}
