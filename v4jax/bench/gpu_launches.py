"""The launches of the engine's decode step on an H100, counted from XLA:GPU's optimized program, without a GPU.

`v4jax bench gpu-launches`: compiles a preset's decode call (abstract weights and pools, nothing allocated) for an
H100 through the CUDA PJRT plugin's compile-only devices (a GpuTargetConfig of the H100's facts, below), then
counts what each step would launch: XLA's fusions by family, the Pallas kernels by name, cuBLAS calls and device
copies, the layer loop's body times its trip count. The GPU's profile of a step is a time per launch; this is its
count, where small kernels of a few microseconds each are a step's largest remaining cost (BENCHMARKS.md, "Where
the time goes"). A count, not a time: XLA autotunes its GEMMs only on a device, so each matmul's launches here are
its untuned form (a split-K GEMM may be one launch more or less on the GPU).

  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate && pip install -e . && \
      pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"  # the CUDA plugin, ptxas; ~5.5 GB
  JAX_PLATFORMS=cpu v4jax bench gpu-launches --model flash-slice --slots 16 --context 4096 [--form greedy]
      [--quantization fp8 --kv-cache-dtype fp8] [--hlo FILE] [--json FILE]

Prints one line per family (launches per step), the total and how many of them lie on the step's longest chain of
launches that wait for each other (`chain`); --json writes them.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys

# The facts of an H100 SXM (80 GB HBM3) that XLA:GPU's compiler reads: its cost model and tiling choose by them.
H100_TARGET = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 registers_per_core_limit: 65536 registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# instructions that launch nothing
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "after-all",
         "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "copy-done", "call"}
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def h100_device():
    """A compile-only H100 (the CUDA plugin needs JAX_PLATFORMS=cpu on a machine without a GPU)."""
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", topology_name="h100", target_config=H100_TARGET,
                                        topology="1x1x1")
    return topo.devices[0]


def computations(hlo: str) -> tuple[dict, str]:
    """Optimized HLO text -> ({computation: [(instruction, opcode, rest of the line)]}, the entry's name)."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        if cur is None:
            m = _COMP.match(line)
            if m and not line.startswith("HloModule"):
                cur = comps.setdefault(m.group(1), [])
                entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INST.match(line)
        if m:
            cur.append((m.group(1), m.group(3), m.group(4)))
    return comps, entry


def _family(inst: str, op: str, rest: str) -> str:
    if op == "fusion":
        return re.sub(r"[.\d]+$", "", inst)
    if op == "custom-call":
        m = re.search(r'name\s*=\s*\\*"(v4_[a-z_0-9]+)', rest)
        if m:
            return m.group(1)
        m = re.search(r'custom_call_target="([^"]+)"', rest)
        return m.group(1) if m else "custom-call"
    return op


def launches(hlo: str, unknown_trips: int = 1) -> collections.Counter:
    """Launches per execution of the entry computation: every instruction that runs a kernel, a library call or a
    copy, through while bodies times their trip counts (`unknown_trips` where XLA knows none: the decode call's
    loop over its k steps, which may stop early) and every branch of a conditional (an upper bound)."""
    comps, entry = computations(hlo)
    total = collections.Counter()

    def walk(name: str, times: int):
        for inst, op, rest in comps.get(name, []):
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                n = int(trip.group(1)) if trip else unknown_trips
                walk(body, times * n)
                walk(re.search(r"condition=%?([\w.\-]+)", rest).group(1), times * (n + 1))
            elif op == "conditional":
                for branch in re.findall(r"%?([\w.\-]+)", (re.search(r"branch_computations=\{([^}]*)\}", rest)
                                                           or re.search(r"()", "")).group(1)):
                    walk(branch, times)
            elif op == "call":
                walk(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1), times)
            elif op not in _FREE:
                total[_family(inst, op, rest)] += times
    walk(entry, 1)
    return total


def chain(hlo: str, unknown_trips: int = 1) -> int:
    """The longest chain of launches one execution of the entry computation must run one after another: each
    launch waits for the launches its operands come from (and its control predecessors); a while loop is its
    trips' body and condition chains end to end, a conditional its longest branch. Launches off that chain may
    run beside it where XLA's command buffers let them (the scheduling mode), those on it cannot."""
    comps, entry = computations(hlo)
    memo: dict[str, int] = {}
    names = re.compile(r"%([\w.\-]+)")

    def longest(name: str) -> int:
        if name in memo:
            return memo[name]
        depth: dict[str, int] = {}
        for inst, op, rest in comps.get(name, []):
            # operands and attributes alike: a computation's name (calls=, body=) is no instruction here (0)
            start = max((depth.get(a, 0) for a in names.findall(rest)), default=0)
            if op == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                n = int(trip.group(1)) if trip else unknown_trips
                body = longest(re.search(r"body=%?([\w.\-]+)", rest).group(1))
                depth[inst] = start + n * body + (n + 1) * longest(re.search(r"condition=%?([\w.\-]+)", rest).group(1))
            elif op == "conditional":
                branches = re.findall(r"%?([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", rest).group(1))
                depth[inst] = start + max(longest(b) for b in branches)
            elif op == "call":
                depth[inst] = start + longest(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1))
            else:
                depth[inst] = start + (op not in _FREE)
        memo[name] = max(depth.values(), default=0)
        return memo[name]

    return longest(entry)


def decode_program(model: str, slots: int, context: int, k: int, form: str, quantization: str,
                   kv_cache_dtype: str, device):
    """The engine's decode call of `model` (flash presets: abstract weights, nothing allocated) and its abstract
    arguments on `device`, through the Pallas ops table as a GPU runs it; form: the sampling program form."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from v4jax import cache as C
    from v4jax.api import EngineOptions
    from v4jax.cache.boundary import BoundaryStore
    from v4jax.cache.layout import pool_layout
    from v4jax.config import preset
    from v4jax.engine import steps as S
    from v4jax.model import RunOptions, Transformer, quant

    sh = SingleDeviceSharding(device)
    A = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    cfg, dtype = preset(model), jnp.bfloat16
    weights = quant.RELEASE if quantization == "fp8" else quant.DEQUANTIZED
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, mtp=False, weights=weights))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree.flatten(state)
    leaves = [A(x.shape, x.dtype) for x in leaves]
    options = EngineOptions(max_num_seqs=slots, decode_steps=k, enable_prefix_caching=False,
                            kv_cache_dtype=kv_cache_dtype)
    layout = pool_layout(cfg, options, dtype, context, 1, 1)
    pools = jax.tree.map(lambda x: A(x.shape, x.dtype), jax.eval_shape(lambda: C.init_pools(cfg, layout, dtype)))
    store = BoundaryStore(layers=tuple(None for _ in pools.stacks))  # prefix cache off
    spec = S.StepSpec(graphdef, treedef, cfg, layout, RunOptions(attention_impl="pallas"), k, context, False,
                      any_sampled=form not in ("greedy", "penalty"), any_cut=form == "cut",
                      any_penalty=form == "penalty")
    i32 = jnp.int32
    samp = jax.tree.map(lambda x: A(x.shape, x.dtype), S.SamplingState.neutral(slots))
    st = S.DecodeState(A((slots,), i32), A((slots,), i32), A((slots,), jnp.bool_), A((slots,), i32), samp)
    args = (leaves, pools, store, st, A((slots, layout.max_pages_per_seq), i32),
            A((slots, layout.max_swa_pages_per_seq), i32))
    return functools.partial(S._decode, spec), args


def _as_on_gpu():
    """The ops table and the kernels as a GPU runs them (Triton kernels, not the interpreter): every module that
    asks pallas_kernels._compat.backend, by attribute or by its own imported name, hears "gpu"."""
    import importlib
    import pkgutil

    import pallas_kernels
    from pallas_kernels import _compat
    asked = _compat.backend
    gpu = lambda: "gpu"  # noqa: E731
    names = [f"pallas_kernels.{m.name}" for m in pkgutil.iter_modules(pallas_kernels.__path__)] + ["v4jax.model.ops"]
    for name in names:
        module = importlib.import_module(name)
        if getattr(module, "backend", None) is asked:
            module.backend = gpu
    _compat.backend = gpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench gpu-launches", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--slots", type=int, default=16, help="rows of the decode call")
    ap.add_argument("--context", type=int, default=4096, help="max_model_len")
    ap.add_argument("--decode-steps", type=int, default=8, help="k")
    ap.add_argument("--form", choices=("greedy", "plain", "cut", "penalty"), default="greedy",
                    help="the sampling program form: greedy, sampled without top-k / top-p, with a cut, greedy with "
                         "presence / frequency / repetition penalties")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--hlo", default=None, help="write the optimized HLO here")
    ap.add_argument("--json", default=None, help="write the counts here")
    a = ap.parse_args(argv)
    import jax
    if jax.config.jax_platforms != "cpu" and os.environ.get("JAX_PLATFORMS") != "cpu":
        print("set JAX_PLATFORMS=cpu: the CUDA plugin compiles for the H100 without initialising a GPU",
              file=sys.stderr)
        return 2
    _as_on_gpu()
    fn, args = decode_program(a.model, a.slots, a.context, a.decode_steps, a.form, a.quantization,
                              a.kv_cache_dtype, h100_device())
    hlo = jax.jit(fn, donate_argnums=(1, 2)).trace(*args).lower().compile().as_text()
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write(hlo)
    per_call = launches(hlo, unknown_trips=a.decode_steps)
    per_step = {name: n / a.decode_steps for name, n in per_call.most_common()}
    for name, n in per_step.items():
        print(f"{n:8.2f}  {name}")
    total = sum(per_step.values())
    on_chain = chain(hlo, unknown_trips=a.decode_steps) / a.decode_steps
    print(f"{total:8.2f}  launches per step ({a.model}, {a.slots} rows, {a.form}, k = {a.decode_steps})")
    print(f"{on_chain:8.2f}  of them on the longest chain of launches that wait for each other")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(vars(a), per_step=per_step, total_per_step=total, chain_per_step=on_chain), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
