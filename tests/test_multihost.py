"""Two local processes of 4 fake CPU devices each (gloo collectives) run one 8-device mesh: both return the
single-device tokens, and the same sampled tokens (a fresh seed agreed on)."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from sharding import multihost
import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[3, 4, 5] * 5, [7, 8] * 6, [11, 12, 13]]  # as in multihost_worker.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_initialize_without_a_cluster_does_nothing(monkeypatch):
    for k in (multihost.ENV_COORDINATOR, "LWS_LEADER_ADDRESS", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(k, raising=False)
    assert multihost.initialize() is False
    assert multihost.agree(7) == 7


@pytest.mark.filterwarnings("ignore:no tokenizer.json")
@pytest.mark.slow  # ~50 s: two processes compiling one 8-device mesh
def test_two_processes_one_mesh_equal_single_device(tiny_checkpoint):
    port, n = _free_port(), 2
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "multihost_worker.py"), str(i), str(n),
                               str(port), "data=2,tensor=2,expert=2", tiny_checkpoint], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    rows = []
    try:
        from v4jax import LLM, SamplingParams  # the single-device reference, computed while they run
        ref = LLM(tiny_checkpoint, dtype="float32", max_num_seqs=4, max_model_len=64, prefill_chunk=16,
                  decode_steps=4).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                   logprobs=True))
        for p in procs:
            out, err = p.communicate(timeout=900)
            assert p.returncode == 0, err[-5000:]
            rows += [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(r["process"] for r in rows) == [0, 1]
    for r in rows:
        assert r["processes"] == 2 and r["devices"] == 8 and r["local_devices"] == 4, r
        assert r["state_spec"] == ["None", "data", "None", "None"], r  # as the rules table says, after the steps
        assert r["tokens"] == [o.token_ids for o in ref], r
        assert max(abs(a - b) for lps, o in zip(r["logprobs"], ref) for a, b in zip(lps, o.logprobs)) <= 1e-4
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[0]["sampled"] == rows[1]["sampled"]


@pytest.mark.filterwarnings("ignore:no tokenizer.json")
@pytest.mark.slow  # ~60 s: two processes compiling one 8-device mesh, then serving
def test_serve_on_two_processes(tiny_checkpoint):
    """`v4jax serve` as two processes of one 8-device mesh: process 0 answers HTTP (greedy tokens and log-probs
    equal the single-device run's; a seeded sampled request, streamed, n = 2), process 1 takes the same engine
    steps (on the same programs, covering ones included), and both exit cleanly when process 0 gets SIGTERM."""
    import signal
    import time

    import httpx
    coord, http_port, n = _free_port(), _free_port(), 2
    env = dict(os.environ, XLA_FLAGS=xla_flags.cpu(4), JAX_PLATFORMS="cpu",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_DEFAULT_MATMUL_PRECISION="highest",
               TF_CPP_MIN_LOG_LEVEL="2", V4JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{coord}",
               V4JAX_NUM_PROCESSES=str(n), V4JAX_COMPILATION_CACHE="off")
    cmd = [sys.executable, "-m", "v4jax.cli", "serve", tiny_checkpoint, "--port", str(http_port), "--dtype", "float32",
           "--max-num-seqs", "4", "--max-model-len", "64", "--prefill-chunk", "16", "--decode-steps", "4",
           "--mesh", "data=2,tensor=2,expert=2", "--no-access-log"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, V4JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    try:
        from v4jax import LLM, SamplingParams
        ref = LLM(tiny_checkpoint, dtype="float32", max_num_seqs=4, max_model_len=64, prefill_chunk=16,
                  decode_steps=4).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                   logprobs=True))
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 600
        while True:
            assert all(p.poll() is None for p in procs), [p.stdout.read()[-3000:] for p in procs if p.poll() is not None]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)
        with httpx.Client(base_url=url, timeout=300) as http:
            for prompt, want in zip(PROMPTS, ref):
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                                                       "ignore_eos": True, "logprobs": 1, "return_token_ids": True})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["token_ids"] == want.token_ids
                got = choice["logprobs"]["token_logprobs"]
                assert max(abs(a - b) for a, b in zip(got, want.logprobs)) <= 1e-4
            sampled = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2,
                       "ignore_eos": True, "stream": True, "return_token_ids": True}
            with http.stream("POST", "/v1/completions", json=sampled) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            per_seq = {0: [], 1: []}
            for line in lines[:-1]:
                for ch in json.loads(line[6:])["choices"]:
                    per_seq[ch["index"]] += ch.get("token_ids") or []
            assert [len(v) for v in per_seq.values()] == [6, 6]
            # the default warm-up compiled the cover (the sampling forms with the top-N alternatives): a greedy
            # request without log-probs ran its decode steps on the cover while its own compiled in the
            # background, until both processes agreed to it (processes on different programs would hang in a
            # collective)
            r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.0,
                                                   "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref[1].token_ids, r.text
            def metrics():
                return {line.split()[0]: float(line.split()[1]) for line in http.get("/metrics").text.splitlines()
                        if line.startswith("v4jax_")}

            substituted = metrics()["v4jax_steps_substituted_total"]
            assert substituted > 0
            # once compiled, the leader announces the programs with its next step; both processes run them
            while (m := metrics())["v4jax_programs_compiled_background_total"] == 0 or m["v4jax_programs_compiling"]:
                assert time.monotonic() < deadline + 300, "the background compile did not end"
                time.sleep(1)
            r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.0,
                                                   "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref[1].token_ids, r.text
            assert metrics()["v4jax_steps_substituted_total"] == substituted
            substituted = metrics()["v4jax_steps_substituted_total"]
        procs[0].send_signal(signal.SIGTERM)
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-5000:]
            outs.append(out)
        # the follower ran the same steps on the same programs: as many on covering ones
        followed = re.search(r"followed \d+ engine steps, (\d+) of them on covering programs", outs[1])
        assert followed and int(followed.group(1)) == substituted, outs[1][-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
