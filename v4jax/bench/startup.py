"""v4jax bench startup: `v4jax serve` from launch to its first load, once per `--warmup` mode.

For each mode a server is started (`v4jax serve MODEL --warmup MODE SERVE_ARGS`, by default with the persistent
compilation cache off, so every mode compiles from nothing), timed until `/health` answers, then driven by one
`v4jax bench serve` run whose prompt lengths vary (so its steps meet shapes no warm-up request made), with no
unmeasured requests first. Per mode: seconds to ready, programs compiled before it, the load's TTFT, TPOT and
ITL, the longest wait of a stream between two chunks (a compile after ready stalls every stream), and the
programs compiled while measured: those every stream waited for, those compiled in the background while
`substituted_steps` steps ran on covering programs.

    v4jax bench startup --modes none cover all --serve-args "--max-model-len 1024" \\
        --bench-args "--rate 4 --num-requests 48 --prompt-len 8:900 --output-len 16:64 --vocab 2048"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Sequence


def _metrics(url: str) -> dict:
    import httpx
    from v4jax.bench.serve import _COUNTERS, _counter
    text = httpx.get(url + "/metrics", timeout=10).text
    return {k: v for k, name in _COUNTERS.items() if (v := _counter(text, name)) is not None}


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float | None:
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return None
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return None


def run_mode(a, mode: str) -> dict:
    url = f"http://127.0.0.1:{a.port}"
    env = dict(os.environ)
    if a.cache == "off":
        env["V4JAX_COMPILATION_CACHE"] = "off"
    cmd = [sys.executable, "-W", "ignore", "-m", "v4jax.cli", "serve", *([a.model] if a.model else []),
           "--port", str(a.port), "--no-access-log", "--warmup", mode, *shlex.split(a.serve_args)]
    out_dir = os.path.join(a.out, mode) if a.out else None
    log_path = os.path.join(out_dir, "server.log") if out_dir else os.devnull
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    row = {"mode": mode, "server": " ".join(cmd[3:])}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = _wait_ready(url, proc, a.ready_timeout)
            row["launch_s"] = time.monotonic() - t0
            if ready is None:
                row["error"] = "the server did not answer /health"
                return row
            row["ready_s"] = ready
            row["compiled_before_ready"] = _metrics(url).get("programs_compiled")
            bench = [sys.executable, "-W", "ignore", "-m", "v4jax.cli", "bench", "serve", "--url", url,
                     *shlex.split(a.bench_args)]
            with_out = bench + (["--out", out_dir] if out_dir else [])
            try:
                r = subprocess.run(with_out, capture_output=True, text=True, timeout=a.load_timeout)
            except subprocess.TimeoutExpired:  # a row that says so, and the next mode still runs
                row["error"] = f"the load did not finish in {a.load_timeout:.0f} s"
                row["compiled_at_timeout"] = _metrics(url).get("programs_compiled")
                return row
            if out_dir and os.path.exists(os.path.join(out_dir, "serve_bench.json")):
                with open(os.path.join(out_dir, "serve_bench.json")) as f:
                    rep = json.load(f)
                row.update(summary=rep["summary"], compiled_while_measured=rep["compiled_while_measured"])
            elif r.returncode:
                row["error"] = r.stderr[-2000:]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if out_dir:  # the engine's slow steps (v4jax.engine logs each with the programs it ran)
                with open(log_path) as f:
                    row["slow_steps"] = [line.strip() for line in f if "an engine step took" in line]
    return row


def markdown(rows: Sequence[dict]) -> str:
    ms = lambda d, k: "-" if not d or d.get(k) is None else f"{d[k] * 1e3:.0f}"
    head = ("| --warmup | ready s | compiled before ready | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 ms | "
            "longest gap ms | compiled while measured: waited for / background (still compiling at the end) | "
            "steps on a covering program |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "summary" not in r:
            err = r.get("error", "no results")[:80]
            if r.get("compiled_at_timeout") is not None:
                err += f" ({r['compiled_at_timeout']:.0f} programs compiled by then)"
            ready = "-" if r.get("ready_s") is None else f"{r['ready_s']:.1f}"
            lines.append(f"| {r['mode']} | {ready} | - | {err} |")
            continue
        s, cw = r["summary"], r["compiled_while_measured"] or {}
        n, bg = cw.get("programs_compiled", 0), cw.get("background", 0)
        gap = "-" if s.get("max_gap_s") is None else f"{s['max_gap_s'] * 1e3:.0f}"
        lines.append(f"| {r['mode']} | {r['ready_s']:.1f} | {r['compiled_before_ready']:.0f} | "
                     f"{ms(s['ttft_s'], 'p50')} / {ms(s['ttft_s'], 'p99')} | "
                     f"{ms(s['tpot_s'], 'p50')} / {ms(s['tpot_s'], 'p99')} | {ms(s['itl_s'], 'p99')} | {gap} | "
                     f"{n - bg:.0f} / {bg:.0f} ({cw.get('still_compiling', 0):.0f}) | "
                     f"{cw.get('substituted_steps', 0):.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="v4jax bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="what `v4jax serve` loads (default: the default model)")
    p.add_argument("--modes", nargs="+", default=["none", "cover"], choices=["none", "cover", "all"],
                   help="the `--warmup` modes, one server each, in this order")
    p.add_argument("--serve-args", default="", help="more `v4jax serve` options, one string")
    p.add_argument("--bench-args", default="--rate 4 --num-requests 48 --prompt-len 8:900 --output-len 16:64 "
                   "--vocab 2048", help="the `v4jax bench serve` load, one string (no warm-up requests: the first "
                   "load after ready is what is measured)")
    p.add_argument("--cache", default="off", choices=["off", "on"], help="the servers' persistent compilation "
                   "cache (off: every mode compiles from nothing)")
    p.add_argument("--port", type=int, default=8140)
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to answer")
    p.add_argument("--load-timeout", type=float, default=1800.0, help="seconds the load may take")
    p.add_argument("--out", default=None, help="directory: startup.json, startup.md and each mode's server log "
                   "and serve_bench.json")
    a = p.parse_args(argv)
    rows = []
    for mode in a.modes:
        rows.append(run_mode(a, mode))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("summary", "slow_steps")}), flush=True)
        slow = rows[-1].get("slow_steps") or []
        for line in slow[:10]:
            print("  ", line, flush=True)
        if len(slow) > 10:
            print(f"   ... {len(slow) - 10} more slow steps in {mode}/server.log", flush=True)
    table = markdown(rows)
    print(table)
    if a.out:
        with open(os.path.join(a.out, "startup.json"), "w") as f:
            json.dump({"rows": rows, "command": "v4jax bench startup " + shlex.join(argv or sys.argv[1:])}, f,
                      indent=1)
        with open(os.path.join(a.out, "startup.md"), "w") as f:
            f.write(table + "\n")
    return 0 if all("summary" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
