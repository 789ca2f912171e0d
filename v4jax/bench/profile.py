"""What a jitted call runs on the device, from a profiler trace: kernel launches per call, device time in kernels
and in device-to-device copies, and the heaviest kernels (`summarize(fn, args)`). Used by `v4jax bench decode
--profile` to count the launches of a decode step (per layer and token) before and after a change."""
from __future__ import annotations

import os
import re
import tempfile


def device_events(xplane_path: str) -> list[tuple[str, float]]:
    """(name, duration ns) of every event on the GPU planes' stream lines, once each (a kernel can be listed on a
    per-stream line and on an aggregate line)."""
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
                out.append((ev.name, float(ev.duration_ns)))
    return out


def _family(name: str) -> str:
    """A kernel's name without its numbering (loop_add_fusion_12 -> loop_add_fusion)."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))


def summarize(call, repeats: int = 2, top: int = 20) -> dict:
    """Trace `repeats` runs of `call()` (which must block until its results are ready) after one untraced run.
    Returns per call: kernels (launches), kernel_ms, copies (device memcpy / memset events), copy_ms, and the
    `top` kernel families by time: [(family, launches per call, ms per call)]."""
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
    kern, copies = {}, {"n": 0, "ns": 0.0}
    for name, ns in events:
        low = name.lower()
        if "memcpy" in low or "memset" in low:
            copies["n"] += 1
            copies["ns"] += ns
            continue
        f = kern.setdefault(_family(name), [0, 0.0])
        f[0] += 1
        f[1] += ns
    fams = sorted(kern.items(), key=lambda kv: -kv[1][1])
    return {"kernels": sum(v[0] for v in kern.values()) / repeats,
            "kernel_ms": sum(v[1] for v in kern.values()) / repeats / 1e6,
            "copies": copies["n"] / repeats, "copy_ms": copies["ns"] / repeats / 1e6,
            "top": [(name, v[0] / repeats, v[1] / repeats / 1e6) for name, v in fams[:top]]}
