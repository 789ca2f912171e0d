"""JAX's persistent compilation cache, on by default (CONVENTIONS "Start-up and compilation").

Compiled programs are kept in `$XDG_CACHE_HOME/v4jax/jax` (else `~/.cache/v4jax/jax`), so a second process that
runs the same shapes loads them instead of compiling. `V4JAX_COMPILATION_CACHE=off` turns it off, any other
value is the directory to use. `enable()` is called by `LLM.__init__` before anything compiles; it is idempotent
and never overrides a cache directory the user configured in JAX directly.

While the first slow compile after `watch_first_compile()` runs (one that misses the cache and takes longer than
a second), one line on stderr says that it is happening and where it is cached; printed once per process, never
on a run whose programs all come from the cache. It listens to JAX's monitoring events (a cache miss, or with
the cache off the end of lowering, starts a timer; the end of the backend compile stops it).
"""
from __future__ import annotations

import os
import sys
import threading

ENV = "V4JAX_COMPILATION_CACHE"
MIN_COMPILE_SECS = 0.0  # every program: loading a checkpoint compiles ~100 tiny ones (30 ms each on CPU, 3 s in all)
ANNOUNCE_AFTER_SECS = 1.0  # a compile that runs this long gets the one-line message
_state = {"dir": None, "announced": False, "watching": False, "timer": None}
_lock = threading.Lock()
_MISS = "/jax/compilation_cache/cache_misses"
_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILED = "/jax/core/compile/backend_compile_duration"


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


def announce_first_compile(what: str = "the model") -> None:
    """Print, once per process, that a first compile is running and where its result is cached."""
    with _lock:
        if _state["announced"]:
            return
        _state["announced"] = True
    where = f"cached in {_state['dir']}" if _state["dir"] else "compilation cache off"
    print(f"v4jax: compiling {what} for this shape (first run only; {where})", file=sys.stderr, flush=True)


def watch_first_compile() -> None:
    """From now on, announce the first compile that misses the cache and runs longer than ANNOUNCE_AFTER_SECS."""
    import jax

    with _lock:
        if _state["watching"] or _state["announced"]:
            return
        _state["watching"] = True

    def start():
        with _lock:
            if _state["announced"] or _state["timer"] is not None:
                return
            t = threading.Timer(ANNOUNCE_AFTER_SECS, announce_first_compile)
            t.daemon = True
            _state["timer"] = t
        t.start()

    def stop():
        with _lock:
            t, _state["timer"] = _state["timer"], None
        if t is not None:
            t.cancel()

    def on_event(name, *args, **kwargs):
        if name == _MISS and not _state["announced"]:
            start()

    def on_duration(name, secs, *args, **kwargs):
        if _state["announced"]:
            return
        if name == _LOWERED and _state["dir"] is None:
            start()
        elif name == _COMPILED:
            stop()

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
