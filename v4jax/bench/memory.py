"""`python -m v4jax.bench memory ...`: the `v4jax memory` command (v4jax.cli; its own flags: `v4jax memory -h`)."""
from __future__ import annotations


def memory_main(argv=None) -> int:
    """`v4jax memory --model flash --context 1M [--requests N] [--format bf16,fp8,fp4] [--mesh M] [LLM options]
    [--json]`: the per-token report, and the pools an engine with those options allocates."""
    from v4jax.cli import main
    return main(["memory", *(argv or [])])
