"""What a jitted call runs on the device, from a profiler trace: kernel launches per call, device time in kernels
and in device-to-device copies, and the heaviest kernels (`summarize(fn, args)`). Used by `v4jax bench decode
--profile` to count the launches of a decode step (per layer and token) before and after a change."""
from __future__ import annotations

import os
import re
import tempfile


def device_events(xplane_path: str) -> list[tuple[str, float, str]]:
    """(name, duration ns, HLO instruction) of every event on the GPU planes' stream lines, once each (a kernel can
    be listed on a per-stream line and on an aggregate line)."""
    from jax.profiler import ProfileData
    seen, out = set(), []
    for plane in ProfileData.from_file(xplane_path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                key = (ev.name, ev.start_ns, ev.duration_ns)
                if key in seen:
                    continue
                seen.add(key)
                out.append((ev.name, float(ev.duration_ns), str(dict(ev.stats).get("hlo_op", ""))))
    return out


def _family(name: str) -> str:
    """A kernel's name without its numbering (loop_add_fusion_12 -> loop_add_fusion)."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}")
_MODEL_FILES = ("v4jax/", "pallas_kernels/")


def _stack_frames(hlo_text: str) -> dict[int, tuple[str, int]]:
    """The module's stack-frame table: frame id -> (`file:line (function)`, parent frame id)."""
    tables, cur = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}, None
    for line in hlo_text.splitlines():
        if line in tables:
            cur = tables[line]
        elif not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
            cur = None
        elif cur is not None:
            key, _, val = line.partition(" ")
            cur[int(key)] = val.strip()
    num = lambda v, k: int(re.search(k + r"=(\d+)", v).group(1))
    locs = {}
    for i, v in tables["FileLocations"].items():
        path = tables["FileNames"].get(num(v, "file_name_id"), "?").strip('"')
        at = max(path.rfind(f) for f in _MODEL_FILES)   # v4jax/model/layers.py; else the last two parts
        short = path[at:] if at >= 0 else path[path.rfind("/", 0, path.rfind("/")) + 1:]
        fn = tables["FunctionNames"].get(num(v, "function_name_id"), "?").strip('"')
        locs[i] = (path, f"{short}:{num(v, 'line')} ({fn})")
    frames = {}
    for i, v in tables["StackFrames"].items():
        frames[i] = (locs.get(num(v, "file_location_id"), ("?", "?")), num(v, "parent_frame_id"))
    return frames


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """HLO instruction -> where in our code it comes from: the two innermost frames under v4jax/ or pallas_kernels/
    of the instruction's stack (`v4jax/model/layers.py:25 (rms_norm) < v4jax/model/transformer.py:412 (__call__)`), else the last
    part of its JAX name stack."""
    frames, out = _stack_frames(hlo_text), {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        meta, where = m.group(2), []
        fid = re.search(r"stack_frame_id=(\d+)", meta)
        fid, seen = (int(fid.group(1)) if fid else 0), set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            (path, label), parent = frames[fid]
            if any(f in path for f in _MODEL_FILES) and label not in where:
                where.append(label)
                if len(where) == 2:
                    break
            fid = parent
        if not where:
            name = re.search(r'op_name="([^"]+)"', meta)
            where = ["/".join(name.group(1).split("/")[-2:]) if name else "?"]
        out[m.group(1)] = " < ".join(where)
    return out


def summarize(call, repeats: int = 2, top: int = 20, hlo_text: str | None = None) -> dict:
    """Trace `repeats` runs of `call()` (which must block until its results are ready) after one untraced run.
    Returns per call: kernels (launches), kernel_ms, copies (device memcpy / memset events), copy_ms, and the
    `top` kernel families by time: [(family, launches per call, ms per call)]; with the compiled program's
    `hlo_text`, also `by_source`: the same per line of our code that each kernel's HLO instruction comes from."""
    import jax
    call()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(repeats):
                call()
        paths = [os.path.join(r, n) for r, _, ns in os.walk(d) for n in ns if n.endswith(".xplane.pb")]
        events = device_events(paths[0]) if paths else []
    if not events:
        return {"error": "no GPU events in the trace"}
    kern, copies, by_src = {}, {"n": 0, "ns": 0.0}, {}
    sources = hlo_sources(hlo_text) if hlo_text else {}
    # inside a command buffer (CUDA graph) an event's HLO op is the buffer; a fusion's kernel is named after it
    kernel_sources = {re.sub(r"[.\-]", "_", k): v for k, v in sources.items()}
    for name, ns, hlo_op in events:
        if sources:
            where = sources.get(hlo_op) if not hlo_op.startswith("command_buffer") else None
            b = by_src.setdefault(where or kernel_sources.get(name) or _family(name), [0, 0.0])
            b[0] += 1
            b[1] += ns
        low = name.lower()
        if "memcpy" in low or "memset" in low:
            copies["n"] += 1
            copies["ns"] += ns
            continue
        f = kern.setdefault(_family(name), [0, 0.0])
        f[0] += 1
        f[1] += ns
    fams = sorted(kern.items(), key=lambda kv: -kv[1][1])
    per_call = lambda items: [(name, v[0] / repeats, v[1] / repeats / 1e6) for name, v in items[:top]]
    return {"kernels": sum(v[0] for v in kern.values()) / repeats,
            "kernel_ms": sum(v[1] for v in kern.values()) / repeats / 1e6,
            "copies": copies["n"] / repeats, "copy_ms": copies["ns"] / repeats / 1e6,
            "top": per_call(fams),
            **({"by_source": per_call(sorted(by_src.items(), key=lambda kv: -kv[1][1]))} if sources else {})}


def time_call(fn, reps: int, per: int = 1, mb: float | None = None) -> dict:
    """The kernel benchmarks' measure of `fn()` (blocked until its results are ready): the median wall time of
    `reps` calls after a warm-up, in us per one of `per` units (layers) it runs; on a GPU also the kernel time and
    launches per unit from a profiler trace (`summarize`), with the GB/s of `mb` megabytes per unit and the
    heaviest kernels."""
    import statistics
    import time

    import jax
    call = lambda: jax.block_until_ready(fn())
    call()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    out = {"wall_us": statistics.median(ts) * 1e6 / per}
    if jax.default_backend() == "gpu":
        s = summarize(call, repeats=2, top=4)
        if "kernel_ms" in s:
            us = s["kernel_ms"] * 1e3 / per
            out.update(kernel_us=us, launches=s["kernels"] / per, top=s["top"],
                       **({"GBps": mb / us * 1e3} if mb else {}))
    return out


def said(name: str, m: dict) -> str:
    """One line of `time_call`'s result."""
    line = f"{name} wall {m['wall_us']:.1f} us"
    if "kernel_us" in m:
        line += f", kernels {m['kernel_us']:.1f} us in {m['launches']:.1f} launches"
        line += f" ({m['GBps']:.0f} GB/s)" if "GBps" in m else ""
    return line
