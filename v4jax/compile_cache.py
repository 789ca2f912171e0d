"""JAX's persistent compilation cache, on by default (CONVENTIONS "Start-up and compilation").

Compiled programs are kept in `$XDG_CACHE_HOME/v4jax/jax` (else `~/.cache/v4jax/jax`), so a second process that
runs the same shapes loads them instead of compiling. `V4JAX_COMPILATION_CACHE=off` turns it off, any other
value is the directory to use. `enable()` is called by `LLM.__init__` before anything compiles; it is idempotent
and never overrides a cache directory the user configured in JAX directly.

Before an engine is built and its first steps compile programs that are not in the cache yet, one line on stderr
says that it is happening and where it is cached (`FirstCompile`): once per process, never on a run whose programs
come from the cache. It is decided before compiling, not by JAX's monitoring events (JAX 0.10 reports a cache miss
only once the compile is over).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading

ENV = "V4JAX_COMPILATION_CACHE"
MIN_COMPILE_SECS = 0.0  # every program: loading a checkpoint compiles ~100 tiny ones (30 ms each on CPU, 3 s in all)
MARKERS = "v4jax-compiled"  # beside JAX's entries: one empty-ish file per engine signature a run has compiled
_state = {"dir": None, "announced": False}
_lock = threading.Lock()


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "v4jax", "jax")


def cache_dir() -> str | None:
    """The directory the cache uses under the current environment, or None when it is off."""
    val = os.environ.get(ENV, "").strip()
    if val.lower() in ("off", "0", "false", "no", "none"):
        return None
    return os.path.abspath(os.path.expanduser(val)) if val else default_dir()


def enable() -> str | None:
    """Turn the persistent cache on (or leave it off, per V4JAX_COMPILATION_CACHE). Returns the directory in use,
    or None. Programs that compile in MIN_COMPILE_SECS or more are cached: all of them, since the many small
    programs of loading a model add up to seconds and an entry loads in about a millisecond."""
    import jax

    with _lock:
        path = cache_dir()
        configured = jax.config.jax_compilation_cache_dir
        if path is None:
            if configured and configured == _state["dir"]:  # we turned it on earlier in this process
                jax.config.update("jax_compilation_cache_dir", None)
            _state["dir"] = None
            return None
        if configured and configured != _state["dir"]:
            return configured  # the user chose a directory for JAX itself: keep it
        os.makedirs(path, exist_ok=True)
        if configured != path:
            jax.config.update("jax_compilation_cache_dir", path)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
            _reset_jax_cache()
        _state["dir"] = path
        return path


def _reset_jax_cache() -> None:
    """JAX initialises its cache object once, at the first compile; a directory set after that is only seen
    once the object is reset (private API, guarded: a JAX without it just keeps the earlier state)."""
    try:
        from jax._src import compilation_cache as cc
        cc.reset_cache()
    except Exception:  # noqa: BLE001
        pass


def in_use() -> str | None:
    """The directory JAX's persistent cache writes to now (ours or the user's), or None when it is off."""
    import jax
    return jax.config.jax_compilation_cache_dir or None


def announce_first_compile(what: str = "the model") -> None:
    """Print, once per process, that a first compile is running and where its result is cached."""
    with _lock:
        if _state["announced"]:
            return
        _state["announced"] = True
    d = in_use()
    where = f"cached in {d}" if d else "compilation cache off"
    print(f"v4jax: compiling {what} for this shape (first run only; {where})", file=sys.stderr, flush=True)


class FirstCompile:
    """The one-line notice, before an engine is built and its first steps (or warm-up) compile programs that the
    cache does not hold yet. `signature` is everything that decides the engine's programs (JAX version, backend
    and devices, model config, dtype, options); a run whose steps have compiled writes a marker for it in the cache
    directory (`MARKERS/<hash>`), so a later run with the same signature and cache says nothing. With the cache off
    every run compiles, and says so. `LLM.engine` calls `before` as it builds the engine, the engine `after` once it
    has first run its steps to the end (`EngineCore.compile_hooks`)."""

    def __init__(self, signature: str, what: str = "the model"):
        self.key = hashlib.sha256(signature.encode("utf-8")).hexdigest()[:32]
        self.what = what
        self._checked = False

    def marker(self, directory: str) -> str:
        return os.path.join(directory, MARKERS, self.key)

    def before(self) -> None:
        if self._checked:
            return
        self._checked = True
        d = in_use()
        if d is None or not os.path.exists(self.marker(d)):
            announce_first_compile(self.what)

    def after(self) -> None:
        d = in_use()
        if d is None:
            return
        try:
            os.makedirs(os.path.join(d, MARKERS), exist_ok=True)
            with open(self.marker(d), "w", encoding="utf-8") as f:
                f.write("compiled\n")
        except OSError:  # a read-only cache: the next run says it again
            pass

    def hooks(self):
        return self.before, self.after
