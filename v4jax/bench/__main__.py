"""python -m v4jax.bench {decode,generate,kernels,mesh,replay,serve,table,tpu-aot,tpu-plan,gpu-launches,memory}
[options]: the same as `v4jax bench NAME` (and `v4jax memory` for memory)."""
import importlib
import sys

from v4jax.cli import BENCHMARKS

COMMANDS = {**BENCHMARKS, "memory": ("v4jax.bench.memory", "memory_main")}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m v4jax.bench {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    module, func = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
