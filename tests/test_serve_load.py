"""`v4jax serve` as a user runs it (slow): the command in a subprocess, `v4jax bench serve` against it, and SIGTERM
while streams are running: every stream ends with a finish_reason and [DONE], and the process exits 0."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "v4jax.cli", "serve", "--port", str(port), "--max-model-len", "512",
           "--prefill-chunk", "32", "--no-access-log", "--shutdown-grace", "0.5", "--max-waiting", "512"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_bench_serve_command_many_clients(server_process, tmp_path):
    _, url, _ = server_process
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "v4jax.cli", "bench", "serve", "--url", url, "--rate", "inf",
                        "--num-requests", "256", "--prompt-len", "8:32", "--output-len", "4:24", "--vocab", "2048",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "serve_bench.json").read_text())
    assert (rep["summary"]["completed"], rep["summary"]["errors"]) == (256, 0)
    assert "| all at once" in (out / "serve_bench.md").read_text()


def test_bench_serve_replay_reuses_prefixes(server_process, tmp_path):
    _, url, _ = server_process
    r = subprocess.run([sys.executable, "-m", "v4jax.cli", "bench", "serve", "--url", url, "--replay", "multi_turn",
                        "--replay-scale", "0.25", "--step-s", "0.01", "--vocab", "2048", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "serve_bench.json").read_text())
    assert rep["summary"]["errors"] == 0 and rep["summary"]["completed"] == rep["summary"]["requests"]
    assert rep["prefix_cache"]["queried_tokens"] > 0


def test_sigterm_drains_running_streams_and_exits_0(server_process):
    proc, url, log = server_process
    body = {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    ends = []

    def one():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            last, done = None, False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    last = json.loads(line[6:])
            ends.append((done, last["choices"][0]["finish_reason"] if last else None))

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # streams running (and a few waiting for a slot)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert len(ends) == 12 and all(done and reason == "length" for done, reason in ends), ends
    assert "shutting down" in log.read_text()
