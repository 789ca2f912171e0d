"""python -m v4jax.bench {decode,generate,kernels,memory} [options]"""
import sys

from v4jax.bench import decode_main, generate_main, kernels_main, memory_main

COMMANDS = {"decode": decode_main, "generate": generate_main, "kernels": kernels_main, "memory": memory_main}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m v4jax.bench {{{','.join(COMMANDS)}}} [options]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
