"""Two local processes of 4 fake CPU devices each (gloo collectives) run one 8-device mesh: both return the
single-device tokens, and the same sampled tokens (a fresh seed agreed on)."""
import json
import os
import socket
import subprocess
import sys

import pytest

from sharding import multihost

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
