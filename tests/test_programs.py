"""The program book (v4jax.engine.programs): which compiled program runs a step whose own is missing, and its own
compiled in the background. The engine's use of it: tests/test_engine_slots.py::test_cover_warmup_no_step_waits."""
import threading

from v4jax.engine.programs import BACKGROUND_THREADS, Program, ProgramBook, in_background


class Form:
    """A stand-in for a StepSpec (hashed by identity, as StepSpec is)."""
    def __init__(self, any_sampled: bool, top_logprobs: int = 0, any_cut: bool = True, any_penalty: bool = False):
        self.any_sampled, self.top_logprobs, self.any_cut = any_sampled, top_logprobs, any_cut
        self.any_penalty = any_penalty


SAMPLED, GREEDY, TOP = Form(True), Form(False), Form(True, 20)


def _book():
    compiled, release = [], threading.Event()

    def compile_program(p):
        release.wait(5)
        compiled.append((p, in_background()))

    return ProgramBook(compile_program, {GREEDY: (GREEDY, SAMPLED)}), compiled, release


def test_exact_program_without_substitution():
    """Before warm-up turns substitution on, a step runs its own program (its call compiles it)."""
    book, compiled, _ = _book()
    book.ran(Program("decode", SAMPLED, 4, 0, 8))
    exact = Program("decode", SAMPLED, 1, 0, 1)
    assert book.choose(exact) == exact and not compiled


def test_cheapest_cover_runs_while_the_exact_program_compiles(caplog):
    caplog.set_level("INFO", logger="v4jax.engine")
    book, compiled, release = _book()
    covers = [Program("decode", SAMPLED, 4, 0, 8), Program("decode", SAMPLED, 2, 0, 8),
              Program("decode", SAMPLED, 2, 0, 4), Program("prefill", SAMPLED, 2, 64, 8)]
    for p in covers:
        book.ran(p)
    book.substitute = True
    exact = Program("decode", GREEDY, 1, 0, 2)
    assert book.choose(exact) == Program("decode", SAMPLED, 2, 0, 4)  # fewest rows, then the narrowest table
    assert book.choose(exact) == Program("decode", SAMPLED, 2, 0, 4)  # submitted once
    assert book.counts() == {"ready": 4, "ran": 4, "compiling": 1, "substituted_steps": 2}
    release.set()
    book.wait()
    assert compiled == [(exact, True)]  # on a background thread
    assert book.choose(exact) == exact and book.counts()["substituted_steps"] == 2
    # the server's log names each shape compiled in the background
    assert [r.getMessage().split(",")[0] for r in caplog.records if "background" in r.getMessage()] == [
        "compiled in the background: decode rows 1"]


def test_without_background_compiles_the_covers_run_every_step():
    """A benchmark of fixed shapes (background off): a covered step runs on its cover and nothing compiles."""
    book, compiled, release = _book()
    book.ran(Program("decode", SAMPLED, 4, 0, 8))
    book.substitute, book.background = True, False
    exact = Program("decode", GREEDY, 1, 0, 2)
    assert book.choose(exact) == Program("decode", SAMPLED, 4, 0, 8)
    release.set()
    book.wait()
    assert not compiled and book.counts() == {"ready": 1, "ran": 1, "compiling": 0, "substituted_steps": 1}


def test_ahead_compiles_before_a_step_needs_them():
    """An engine without covers compiles the programs a long prompt will need ahead, in the background; a step whose
    program is compiling there waits for it (no second compile), and one whose compile has not started yet takes
    it back and compiles it in its own call. Nothing is compiled ahead with covers, without background compiles or
    where processes must agree."""
    book, compiled, release = _book()
    first, second, third = (Program("prefill", SAMPLED, 1, 32, n) for n in (2, 4, 8))
    book.ahead([first, second, third])
    assert book.counts()["compiling"] == 3 and BACKGROUND_THREADS == 2  # the third one queued behind two
    assert book.choose(third) == third and book.counts()["compiling"] == 2  # taken back: the call compiles it
    waited = []
    t = threading.Thread(target=lambda: waited.append(book.choose(second)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waiting for the background compile, not compiling
    release.set()
    t.join(5)
    book.wait()
    assert waited == [second] and sorted(p.pages for p, bg in compiled if bg) == [2, 4]
    for off in ("substitute", "background", "agreed"):
        book, compiled, release = _book()
        setattr(book, off, off != "background")
        book.ahead([first])
        assert book.counts()["compiling"] == 0, off
    book, compiled, release = _book()
    book.ran(first)
    book.ahead([first])
    assert book.counts()["compiling"] == 0   # compiled already


def test_what_may_not_cover():
    """A cover must be at least as large in every dimension, of the same kind, of a form that may run the step
    (a greedy-only program never runs a sampling step) and fit the step's own limits; without one the step runs
    its own program (its call compiles it)."""
    book, compiled, release = _book()
    for p in (Program("decode", GREEDY, 8, 0, 8), Program("decode", SAMPLED, 1, 0, 8),
              Program("decode", SAMPLED, 8, 0, 1), Program("prefill", SAMPLED, 8, 64, 8)):
        book.ran(p)
    book.substitute = True
    exact = Program("decode", SAMPLED, 2, 0, 2)
    assert book.choose(exact) == exact
    prefill = Program("prefill", SAMPLED, 1, 16, 2)
    assert book.choose(prefill, fits=lambda p: p.pages >= 16) == prefill
    assert book.choose(prefill, fits=lambda p: p.pages >= 8) == Program("prefill", SAMPLED, 8, 64, 8)
    assert book.counts()["substituted_steps"] == 1 and not compiled
    release.set()
    book.wait()


def test_several_processes_wait_for_the_leaders_word():
    """Agreed (several processes): a program compiled in the background runs no step before the leader has taken
    it (`take_compiled`, published with a step) and every process has agreed to it; it is not compiled again
    meanwhile."""
    book, compiled, release = _book()
    book.agreed = book.substitute = True
    cover = Program("decode", SAMPLED, 4, 0, 8)
    book.ran(cover)
    exact = Program("decode", SAMPLED, 1, 0, 1)
    assert book.choose(exact) == cover
    release.set()
    book.wait()
    assert book.choose(exact) == cover and compiled == [(exact, True)]  # compiled, not yet agreed
    assert book.take_compiled() == [exact] and book.take_compiled() == []
    follower, _, _ = _book()
    for b in (book, follower):
        b.agree([exact])
        assert b.choose(exact) == exact


def test_the_top_n_form_covers_every_form_and_costs_most():
    """The cover's form (sampling, with the top-N alternatives) may run a step of any form; where a program of the
    same shape without them is compiled, that one runs the step."""
    release = threading.Event()
    book = ProgramBook(lambda p: release.wait(5), {GREEDY: (GREEDY, SAMPLED, TOP), SAMPLED: (SAMPLED, TOP)})
    book.substitute = True
    top = Program("decode", TOP, 4, 0, 8)
    book.ran(top)
    for form in (GREEDY, SAMPLED):
        assert book.choose(Program("decode", form, 2, 0, 4)) == top
    assert not Program("decode", SAMPLED, 4, 0, 8).covers(Program("decode", TOP, 2, 0, 4), {})
    plain = Program("decode", SAMPLED, 4, 0, 8)
    book.ran(plain)
    assert book.choose(Program("decode", GREEDY, 2, 0, 4)) == plain
    release.set()
    book.wait()


EXIT_SCRIPT = """
import sys, time
from v4jax.engine.programs import Program, ProgramBook
class Form:
    any_sampled, top_logprobs, any_cut, any_penalty = True, 0, True, False
form, log = Form(), sys.argv[1]
def compile_program(p):
    time.sleep(0.5)
    with open(log, "a") as f:
        f.write(f"{p.rows}\\n")
book = ProgramBook(compile_program, {})
book.substitute = True
book.ran(Program("decode", form, 64, 0, 64))
for rows in range(1, 11):
    book.choose(Program("decode", form, rows, 0, 1))
"""


def test_exit_drops_the_queued_background_compiles(tmp_path):
    """A process that exits with background compiles queued finishes only those already running (not the whole
    queue, which on an H200 could be minutes of compiling between SIGTERM and exit)."""
    import subprocess
    import sys
    log = tmp_path / "compiled"
    subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(log)], check=True, timeout=120)
    ran = log.read_text().split() if log.exists() else []
    assert len(ran) <= BACKGROUND_THREADS, ran


def test_a_dropped_book_is_freed():
    """The exit hook holds the book weakly: an engine dropped after background compiles (its pools with it) is
    freed before exit."""
    import gc
    import weakref

    book = ProgramBook(lambda p: None, {})
    book.substitute = True
    book.ran(Program("decode", SAMPLED, 4, 0, 8))
    book.choose(Program("decode", SAMPLED, 1, 0, 1))
    book.wait()
    ref = weakref.ref(book)
    del book
    gc.collect()
    assert ref() is None
