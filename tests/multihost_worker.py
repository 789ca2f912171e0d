"""One of several local processes (4 fake CPU devices each, gloo collectives) standing in for hosts; run by
tests/test_multihost.py:

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT MESH CHECKPOINT

Joins the job, generates with one mesh over every process's devices; prints one JSON line."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from sharding import multihost  # noqa: E402


def spec_of(arr) -> list[str]:
    spec = tuple(arr.sharding.spec)
    return [str(x) for x in spec + (None,) * (arr.ndim - len(spec))]


def main():
    pid, n, port, mesh, checkpoint = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    assert multihost.initialize(f"127.0.0.1:{port}", n, pid, cpu_collectives="gloo")
    from v4jax import LLM, SamplingParams
    prompts = [[3, 4, 5] * 5, [7, 8] * 6, [11, 12, 13]]  # as in test_multihost.py
    options = dict(dtype="float32", max_num_seqs=4, max_model_len=64, prefill_chunk=16, decode_steps=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    sampled = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)  # a fresh seed, agreed on
    llm = LLM(checkpoint, mesh=mesh, **options)
    outs = llm.generate(prompts, greedy)
    drawn = llm.generate(prompts[:1], sampled)[0].token_ids
    print("RESULT " + json.dumps({
        "process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
        "local_devices": jax.local_device_count(), "tokens": [o.token_ids for o in outs],
        "logprobs": [o.logprobs for o in outs], "sampled": drawn,
        "state_spec": spec_of(llm.engine.pools.stacks[1].state_kv)}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
