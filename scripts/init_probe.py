"""How long building a random preset takes and how many programs it compiles: `python scripts/init_probe.py PRESET
[PRESET ...]` prints, per preset, the seconds to `LLM(preset)` with its weights on the device and the programs JAX
compiled meanwhile, by function name (the random init runs eagerly: each new shape of an eager op is a compile)."""
from __future__ import annotations

import collections
import sys
import time

import jax


def main(presets: list[str]) -> int:
    compiles, seconds = collections.Counter(), collections.Counter()

    def listen(event: str, secs: float, *, fun_name: str = "?", **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[fun_name] += 1
            seconds[fun_name] += secs

    jax.monitoring.register_event_duration_secs_listener(listen)
    from v4jax import LLM
    for name in presets:
        compiles.clear()
        seconds.clear()
        t = time.perf_counter()
        llm = LLM(name, max_num_seqs=1, max_model_len=1024)
        jax.block_until_ready(jax.tree.leaves(llm._state))
        took = time.perf_counter() - t
        print(f"{name}: {took:.1f} s, {sum(compiles.values())} programs compiled in {sum(seconds.values()):.1f} s "
              f"({jax.devices()[0].device_kind})", flush=True)
        for fun, n in compiles.most_common(8):
            print(f"  {fun}: {n} ({seconds[fun]:.2f} s)")
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["flash-slice"]))
