"""Does the event loop's thread keep the engine thread waiting for the GIL? The real server (orchestrator, routes,
uvicorn) over a fake engine whose step is PY ms of Python (the scheduler) then DEV ms of a GIL-free wait (the
device), 8 tokens for each running request, under N streams of `v4jax bench serve` (twice); prints how late the
waits return (time spent getting the GIL back) and the bench's row. SW: Python's thread switch interval in ms (5 is
CPython's default).

    DEV=25 PY=3 SW=5 N=64 python scripts/gil_probe.py
"""
import os
import subprocess
import sys
import threading
import time

from v4jax.engine.scheduler import RequestDelta

DEV, PY, K = float(os.environ.get("DEV", 25)) / 1e3, float(os.environ.get("PY", 3)) / 1e3, 8


class FakeEngine:
    """A ServingEngine whose steps cost fixed times and emit K tokens for each of up to 64 running requests."""
    max_model_len = 4096
    max_num_seqs = 64
    scores_prompts = False

    def __init__(self):
        self.reqs, self.steps, self.late = {}, 0, []

    def check(self, ids, params):
        pass

    def add_request(self, rid, ids, params, sample_index, route=None):
        self.reqs[rid] = [params.max_tokens, 0]

    def abort(self, rid):
        return self.reqs.pop(rid, None) is not None

    def step(self):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < PY:   # the scheduler's Python, holding the GIL
            pass
        t1 = time.perf_counter()
        time.sleep(DEV)                         # the device wait, the GIL released
        self.late.append(time.perf_counter() - t1 - DEV)
        out = []
        for rid, st in list(self.reqs.items())[:64]:
            n = min(K, st[0] - st[1])
            st[1] += n
            fin = "length" if st[1] >= st[0] else None
            out.append(RequestDelta(rid, list(range(5, 5 + n)), [], fin))
            if fin:
                del self.reqs[rid]
        self.steps += 1
        return out

    def fail_step(self):
        pass

    def request_ids(self):
        return set(self.reqs)

    def failed(self):
        return {}

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def stats(self):
        return {}

    def prompt_logprobs(self, prompt_ids, top_n):
        raise NotImplementedError


def main():
    sw = float(os.environ.get("SW", 5))
    sys.setswitchinterval(sw / 1e3)
    from v4jax.api import LLM
    from v4jax.serve.app import Server, ServerState
    from v4jax.serve.options import ServerOptions
    eng = FakeEngine()
    opts = ServerOptions(port=int(os.environ.get("PORT", 18601)), access_log=False, log_level="warning")
    state = ServerState(LLM(max_num_seqs=4, max_model_len=256), opts, engine=eng).start()  # the default model's codec
    server = Server(state)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    time.sleep(3)
    n = int(os.environ.get("N", 64))
    for rep in range(2):
        s0, l0 = eng.steps, len(eng.late)
        r = subprocess.run([sys.executable, "-m", "v4jax.cli", "bench", "serve", "--url", f"http://127.0.0.1:{opts.port}",
                            "--num-requests", str(n), "--rate", "inf", "--prompt-len", "16", "--output-len", "256",
                            "--vocab", "500"], capture_output=True, text=True)
        late = sorted(eng.late[l0:])
        mean, p90 = 1e3 * sum(late) / max(len(late), 1), 1e3 * late[int(0.9 * len(late))]
        row = [line for line in r.stdout.splitlines() if line.startswith("| all")]
        print(f"switch {sw} ms, {n} streams, run {rep}: {eng.steps - s0} steps; the device wait returned "
              f"{mean:.2f} ms late on average (p90 {p90:.2f})")
        print("   ", row[0] if row else r.stdout[-500:] + r.stderr[-800:])
    server.shutdown_now()
    th.join(30)


if __name__ == "__main__":
    main()
