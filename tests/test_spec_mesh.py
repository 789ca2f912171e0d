"""Speculative decoding on meshes: draft and verify run on the shards of the step (the drafter's per-slot state
over the data axis, the MTP block's weights as a layer's), and drafts forced right or partly wrong give the plain
greedy tokens with log-probs within 1e-5 of the teacher-forced forward on the same mesh, over prefix hits and a
resume at a page boundary crossed while speculating (test_spec_decode's check). A slow test: two engines
compile in a subprocess of 8 fake CPU devices (the device count is fixed when JAX starts)."""
import os
import subprocess
import sys

import pytest
import xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
MESHES = ("data=2,tensor=2", "tensor=2,expert=2")


@pytest.mark.slow
def test_forced_drafts_on_meshes_equal_plain_greedy():
    env = dict(os.environ, XLA_FLAGS=xla_flags.cpu(8),
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, *MESHES], env=env, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == [f"ok:{m}" for m in MESHES], proc.stdout


def main(meshes) -> int:
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import test_spec_decode as T
    from v4jax import LLM

    assert jax.device_count() == 8, jax.devices()
    for mesh in meshes:
        llm = LLM("tiny", mesh=mesh, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                  **T.OPTIONS)
        T._check_forced(llm)
        print(f"ok:{mesh}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
