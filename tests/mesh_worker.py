"""Run by tests/test_sharding.py in a subprocess with 8 fake CPU devices (the device count is fixed at JAX start):
a checkpoint loaded onto a mesh (its values and bytes per device), an orbax checkpoint restored onto it, and one
single-device reference run, then the same requests on each mesh given (with how the pools were split, the
prefix-cache hits and the data shards that held slots); context meshes run long prompts over small pages against
their own single-device reference; the steps exported for TPU and the experts kernel per shard on meshes; prints
one JSON line per check.

    python tests/mesh_worker.py --meshes data=2,tensor=2,expert=2 tensor=8:pallas [--checkpoint DIR [--memory-mesh M]]
    python tests/mesh_worker.py --context-meshes context=2,tensor=4 context=4:pallas
    python tests/mesh_worker.py --tpu-export data=2,tensor=4 --experts-meshes expert=4,tensor=2
    python tests/mesh_worker.py --pool-meshes data=2,context=2,tensor=2

`MESH:pallas` runs attention_impl="pallas" (kernels in interpret mode).
"""
import argparse
import contextlib
import dataclasses
import gc
import io
import json
import time

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from flax import nnx  # noqa: E402

from sharding.place import addressable_bytes_per_device  # noqa: E402
from v4jax import LLM, SamplingParams  # noqa: E402
from v4jax import memory as M  # noqa: E402

# Short prompts, one prefill chunk and one page each, so every run compiles one prefill and one decode program.
PROMPTS = [[3, 4, 5] * 5, [7, 8] * 6, [11, 12, 13]]
SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
OPTIONS = dict(dtype="float32", max_num_seqs=4, max_model_len=64, prefill_chunk=16, decode_steps=4)
# The mesh runs: pages of 16 tokens, and the second prompt shares the first's first page. It waits until the first
# has cached that page, then is admitted beside it (its data shard) with a hit; the others spread over the shards.
MESH_PROMPTS = [[3, 4, 5] * 6, [3, 4, 5] * 5 + [3, 9, 9, 9], [7, 8] * 6, [11, 12, 13]]
MESH_OPTIONS = dict(OPTIONS, max_num_seqs=8, page_size=16)
# Context parallelism: prompts over several pages of 16 tokens (C4 pools 4 rows a page, C16 one), prefilled in
# chunks of 32, so the pages of one request lie in several blocks of the pools' rows (low page ids go first).
CONTEXT_PROMPTS = [np.random.default_rng(0).integers(2, 500, n).tolist() for n in (90, 37)]
CONTEXT_SAMPLING = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
# the second prompt penalised (strong enough to change its greedy tokens): the program form with penalties reads
# each row's sequence from the token pool, split over the mesh's data x context shards
CONTEXT_PENALISED = [CONTEXT_SAMPLING, dataclasses.replace(CONTEXT_SAMPLING, presence_penalty=-2.0,
                                                           frequency_penalty=-2.0, repetition_penalty=0.5)]
CONTEXT_OPTIONS = dict(dtype="float32", max_num_seqs=2, max_model_len=128, prefill_chunk=32, decode_steps=4,
                       page_size=16)


def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def param_bytes(model) -> tuple[int, int]:
    """(most bytes on one device, total bytes) of the model's parameters."""
    state = nnx.state(model)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return max(addressable_bytes_per_device(state).values()), total


def pool_report(llm, mesh, admitted_shards) -> dict:
    """How the engine's pools were split: the row axis spec of a compressed pool, the token pool and the SWA pool,
    the largest share of the pool bytes (pools and boundary store) on one device, beside memory.engine_pools'
    per-device figure; the prefix-cache hit tokens and the data shards that admitted requests."""
    eng = llm.engine
    lp = eng.pools.stacks[1]  # a CSA stack: [layers, rows, K]
    spec = lambda a: [str(x) for x in tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))]  # noqa
    tree = (eng.pools, eng.store)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    most = max(addressable_bytes_per_device(tree).values())
    estimate = M.engine_pools(llm.config, llm.options, llm.max_model_len, llm.dtype).per_device
    return dict(kv_spec=spec(lp.kv), tokens_spec=spec(eng.pools.tokens), swa_spec=spec(lp.swa),
                pool_device_fraction=most / total, pool_device_bytes=most, pool_device_estimate=estimate,
                hit_tokens=llm.stats()["prefix_cache"]["hit_tokens"], data_shards=sorted(set(admitted_shards)))


def record_admissions(llm) -> list:
    """The data shard of every admitted request's slot, appended as the scheduler admits them."""
    sch, shards = llm.engine.scheduler, []
    admit = sch.admit

    def recorded(*args):
        out = admit(*args)
        shards.extend(sch.kv.shard_of(r.slot) for r in out)
        return out
    sch.admit = recorded
    return shards


def release():
    """Drop the programs compiled so far: XLA:CPU maps each one's code into memory until the caches are cleared, and
    one process of many meshes runs past the kernel's map limit (tests/conftest.py says more)."""
    gc.collect()
    jax.clear_caches()


def full_spec(x) -> list[str]:
    return [str(s) for s in tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))]


def context_meshes(meshes):
    """`MESH` or `MESH:pallas` (attention_impl): greedy tokens and log-probs of long prompts against one
    single-device XLA run, and the specs of the compressed pools after the steps ran."""
    t0 = time.time()
    ref = LLM("tiny", **CONTEXT_OPTIONS)
    plain = ref.generate(CONTEXT_PROMPTS, CONTEXT_SAMPLING)
    base = ref.generate(CONTEXT_PROMPTS, CONTEXT_PENALISED)
    del ref
    emit(check="context_reference", seconds=round(time.time() - t0, 1),
         penalties_change_tokens=plain[1].token_ids != base[1].token_ids,
         unpenalised_equal=plain[0].token_ids == base[0].token_ids)
    for entry in meshes:
        mesh, _, impl = entry.partition(":")
        t0 = time.time()
        llm = LLM("tiny", mesh=mesh, attention_impl=impl or "xla", **CONTEXT_OPTIONS)
        outs = llm.generate(CONTEXT_PROMPTS, CONTEXT_PENALISED)
        err = max(float(np.max(np.abs(np.subtract(x.logprobs, y.logprobs)))) for x, y in zip(base, outs))
        stacks = llm.engine.pools.stacks
        csa = next(lp for lp in stacks if lp.idx is not None)
        hca = next(lp for lp in stacks if lp.kv is not None and lp.idx is None)
        emit(check="context", mesh=entry, tokens_equal=all(x.token_ids == y.token_ids for x, y in zip(base, outs)),
             n_tokens=[len(y.token_ids) for y in outs], logprob_err=err, c4_kv_spec=full_spec(csa.kv),
             c4_index_spec=full_spec(csa.idx), c128_kv_spec=full_spec(hca.kv), swa_spec=full_spec(csa.swa),
             n_pages=llm.engine.layout.n_pages, seconds=round(time.time() - t0, 1))
        del llm
        release()


def paged_by_contract(meshes):
    """The model's cached steps (prefill in two chunks, then decode) on a 6-layer tiny (its CSA / HCA layers in a
    scan), with page tables built by hand as the layout contract places pages for D = `data` shards: slot s on
    data shard s // (slots / D), SWA pages from that shard's block, full pages from its blocks (the first slot of
    each shard interleaved over `context` as the allocator does, the second anywhere in them): the model's side
    of the contract alone, whatever the allocator. Logits against one device, each step."""
    import jax.numpy as jnp

    from sharding import MeshRules
    from sharding.place import state_shardings
    from v4jax import cache as C
    from v4jax.config import CSA, HCA, SLIDING, preset
    from v4jax.model import RunOptions, Transformer

    kinds = (SLIDING, SLIDING, CSA, HCA, CSA, HCA)
    cfg = preset("tiny").replace(n_layers=6, layer_types=kinds, compress_ratios=(0, 0, 4, 16, 4, 16))
    slots, per_seq, n_pages, ps = 4, 8, 32, 8
    lay = C.PoolLayout(page_size=16, swa_page_size=ps, n_pages=n_pages, n_swa_pages=slots * 16, max_slots=slots,
                       max_pages_per_seq=per_seq, max_swa_pages_per_seq=16)
    rng = np.random.default_rng(1)
    graphdef, weights = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, mtp=False))
    # (tokens, start, n_valid, fresh, slot): two prefill chunks of every slot, then decode steps (slot None)
    steps = [(32, [0] * 4, [32, 20, 32, 7], True, True), (32, [32, 20, 32, 7], [32, 0, 25, 0], False, True)]
    steps += [(1, [64 + i, 20 + i, 57 + i, 7 + i], [1] * 4, False, False) for i in range(5)]
    tokens = [rng.integers(2, 500, (slots, t)) for t, *_ in steps]

    def tables(d_shards, c_shards):
        block = n_pages // (d_shards * c_shards)
        full = np.full((slots, per_seq), -1, np.int32)
        for d in range(d_shards):
            mine = [s for s in range(slots) if s // (slots // d_shards) == d]
            pages = [g * block + i for g in range(d * c_shards, (d + 1) * c_shards) for i in range(block)]
            first = [(d * c_shards + j % c_shards) * block + j // c_shards for j in range(per_seq)]
            full[mine[0]] = first
            rest = rng.permutation([pg for pg in pages if pg not in first])
            for s in mine[1:]:
                full[s], rest = rest[:per_seq], rest[per_seq:]
        swa_block = lay.n_swa_pages // d_shards
        swa = np.stack([(s // (slots // d_shards)) * swa_block + (s % (slots // d_shards)) * 16 + np.arange(16)
                        for s in range(slots)]).astype(np.int32)
        return full, swa

    def run(mr, full, swa):
        state, pools = weights, C.init_pools(cfg, lay, jnp.float32)
        if mr is not None:
            state = jax.device_put(weights, state_shardings(weights, mr))
            pools = jax.device_put(pools, C.pool_shardings(pools, mr.sharding))
        opts = RunOptions(mesh_rules=mr)

        @jax.jit
        def step(state, pools, tokens, start, n_valid, fresh, slot, full, swa):
            meta = C.make_meta(cfg, lay, start, n_valid, fresh, slot, full, swa, tokens.shape[1])
            logits, pools = nnx.merge(graphdef, state).cached(tokens, meta, pools, opts)
            if mr is None:
                return logits, pools
            # the pools stay in their shardings (the next step then runs the same program)
            return mr.replicate(logits), jax.lax.with_sharding_constraint(pools, C.pool_shardings(pools, mr.sharding))

        out = []
        for (t, start, n_valid, fresh, prefill), tok in zip(steps, tokens):
            i32 = lambda v: np.asarray(v, np.int32)  # noqa: E731
            slot = i32(np.arange(slots)) if prefill else None
            logits, pools = step(state, pools, i32(tok), i32(start), i32(n_valid), np.full(slots, fresh), slot,
                                 full, swa)
            out.append(np.where(np.asarray(n_valid)[:, None] > 0, np.asarray(logits), 0.0))
        return out, pools

    for mesh in meshes:
        t0 = time.time()
        mr = MeshRules.make(mesh)
        full, swa = tables(mr.mesh.shape["data"], mr.mesh.shape["context"])
        want, _ = run(None, full, swa)
        got, pools = run(mr, full, swa)
        csa = next(lp for lp in pools.stacks if lp.idx is not None)
        emit(check="paged_by_contract", mesh=mesh, logits_err=max(float(np.max(np.abs(a - b))) for a, b in
                                                                   zip(want, got)),
             c4_kv_spec=full_spec(csa.kv), swa_spec=full_spec(csa.swa), seconds=round(time.time() - t0, 1))


def tpu_export(meshes, source="tiny"):
    """jax.export for TPU of the engine's decode and prefill steps on each mesh: the XLA form of the decode step,
    and both steps with the Pallas kernels as Mosaic calls, every one inside a shard_map (attention's, and those
    of the compressor and Sinkhorn: Mosaic cannot be partitioned automatically). The Mosaic kernels by name,
    per step. `source`: the tiny preset's checkpoint directory, or the preset itself (its weights created in their
    shards: one jit, ~13 s to compile on 2 CPU cores; reading the checkpoint into them takes a few)."""
    import collections
    import functools
    import re

    from jax._src.pallas.mosaic import tpu_info

    from pallas_kernels import _compat
    from v4jax.engine import steps as S

    def export(mesh, impl):
        options = dict(CONTEXT_OPTIONS, dtype="bfloat16", max_num_seqs=8)  # 8 slots: any data axis splits them
        eng = LLM(source, mesh=mesh, attention_impl=impl, **options).engine
        mr, s, b, t = eng.run_options.mesh_rules, eng.layout.max_slots, 2, CONTEXT_OPTIONS["prefill_chunk"]
        z = lambda n, dt=np.int32: np.zeros((n,), dt)  # noqa: E731
        state = S.DecodeState(z(s), z(s), z(s, bool), z(s), S.SamplingState.neutral(s))
        batch = S.PrefillBatch(np.zeros((b, t), np.int32), z(b), np.full((b,), t, np.int32), np.ones((b,), bool),
                               np.arange(b, dtype=np.int32))
        samp = S.SamplingState.neutral(b)
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", mr.replicated)), tree)
        common = (eng._leaves, eng.pools, eng.store)
        n_pages = eng.layout.max_pages_per_seq
        decode = jax.export.export(jax.jit(functools.partial(S._decode, eng.spec)), platforms=["tpu"])(
            *abstract(common + (state, *eng.kv.decode_tables(n_pages))))
        if impl == "xla":
            return decode, None
        prefill = jax.export.export(jax.jit(functools.partial(S._prefill, eng.spec)), platforms=["tpu"])(
            *abstract(common + (batch, *eng.kv.prefill_tables(list(range(b)), b, n_pages), samp)))
        return decode, prefill

    def kernels(exported):
        return dict(collections.Counter(re.findall(r'kernel_name = "(\w+)"', exported.mlir_module())))

    backend = _compat.backend
    for mesh in meshes:
        t0 = time.time()
        xla, _ = export(mesh, "xla")
        # On this CPU machine the kernels take their TPU (Mosaic) form, and Mosaic asks the chip (a v6e here).
        _compat.backend = lambda: "tpu"
        tpu_info.registry["cpu"] = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V6E, 1)
        try:
            decode, prefill = export(mesh, "pallas")
        finally:
            _compat.backend = backend
            tpu_info.registry.pop("cpu")
        emit(check="tpu_export", mesh=mesh, xla_devices=xla.nr_devices, pallas_devices=decode.nr_devices,
             prefill_devices=prefill.nr_devices, decode_kernels=kernels(decode), prefill_kernels=kernels(prefill),
             seconds=round(time.time() - t0, 1))
        release()


def experts_per_shard(meshes):
    """v4jax.model.moe.routed_experts with the Pallas table on each mesh, from a layer stack as a scanned layer reads
    it: the kernel runs per shard on the shard's experts (its calls counted at trace time, with the experts each
    saw), and the sum over the shards equals the single-device XLA forms. Six tokens of two experts of eight."""
    import jax.numpy as jnp

    from pallas_kernels import experts as pallas_experts
    from sharding import MeshRules
    from v4jax.model import moe as M
    from v4jax.model.ops import OPS

    rng = np.random.default_rng(0)
    n, e, i, d, m, k = 2, 8, 32, 64, 6, 2
    w1, w3 = (jnp.asarray(rng.normal(size=(n, e, i, d)) / 8, jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(n, e, d, i)) / 6, jnp.float32)
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(m)]), jnp.int32)
    weights = jnp.asarray(rng.random((m, k)) + 0.5, jnp.float32)
    layer = jnp.int32(1)
    want = np.asarray(M.routed_experts(x, weights, experts, w1, w2, w3, 7.0, 1))
    real, seen = pallas_experts.routed_experts, []

    def counted(x, weights, experts, w1, *args, **kwargs):
        seen.append(w1.shape[-3])
        return real(x, weights, experts, w1, *args, **kwargs)

    pallas_experts.routed_experts = counted
    try:
        for mesh in meshes:
            seen.clear()
            mr = MeshRules.make(mesh)
            up, down = (mr.sharding(("layers",) + axes, w.shape)
                        for axes, w in ((M.EXPERT_UP_AXES, w1), (M.EXPERT_DOWN_AXES, w2)))
            args = jax.device_put((w1, w2, w3), (up, down, up))
            got = jax.jit(lambda x, wt, ex, w1, w2, w3, li: M.routed_experts(
                x, wt, ex, w1, w2, w3, 7.0, li, ops=OPS["pallas"], mesh_rules=mr))(x, weights, experts, *args, layer)
            emit(check="experts", mesh=mesh, err=float(np.max(np.abs(np.asarray(got) - want))),
                 kernel_local_experts=list(seen))
    finally:
        pallas_experts.routed_experts = real


# The memory command against engines on meshes: LLM options as `v4jax memory` flags, and the variants built
POOL_OPTIONS = dict(dtype="float32", max_num_seqs=8, max_model_len=256, page_size=16, prefill_chunk=32,
                    decode_steps=4)
POOL_VARIANTS = {"paged+prefix": {}, "paged": dict(enable_prefix_caching=False), "dense": dict(kv_layout="dense"),
                 "budget+prefix": dict(memory_budget_bytes=3_300_000)}


def memory_flags(options: dict) -> list[str]:
    out = []
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        out += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
    return out


def pool_bytes(meshes):
    """`v4jax memory --json` with each variant's options on each mesh, against the engine built with them (an
    EngineCore over the same LLM's model, as LLM.engine builds it): the bytes of its pools and boundary store in
    all, and the most on one device (its arrays' shards)."""
    from v4jax.cli import main as cli
    from v4jax.engine import EngineCore
    for mesh in meshes:
        t0 = time.time()
        llm = LLM("tiny", mesh=mesh, **POOL_OPTIONS)
        rows = {}
        for name, variant in POOL_VARIANTS.items():
            eng = EngineCore(llm.config, llm.model, dataclasses.replace(llm.options, **variant), llm.run_options,
                             llm.max_model_len)
            tree = (eng.pools, eng.store)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = cli(["memory", "--model", "tiny", "--json", "--mesh", mesh,
                          *memory_flags(dict(POOL_OPTIONS, **variant))])
            got = json.loads(out.getvalue())["engine_pools"] if rc == 0 else {}
            rows[name] = dict(rc=rc, total=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)),
                              per_device=max(addressable_bytes_per_device(tree).values()),
                              reported_total=got.get("total"), reported_per_device=got.get("per_device"),
                              n_pages=eng.layout.n_pages, reported_n_pages=got.get("n_pages"))
            del eng, tree
        emit(check="pool_bytes", mesh=mesh, variants=rows, seconds=round(time.time() - t0, 1))
        del llm
        release()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meshes", nargs="*", default=[])
    ap.add_argument("--context-meshes", nargs="*", default=[])
    ap.add_argument("--paged-meshes", nargs="*", default=[], help="meshes for paged_by_contract")
    ap.add_argument("--tpu-export", nargs="*", default=[], help="meshes to export the decode and prefill steps on "
                    "for TPU")
    ap.add_argument("--experts-meshes", nargs="*", default=[], help="meshes for experts_per_shard")
    ap.add_argument("--pool-meshes", nargs="*", default=[], help="meshes for pool_bytes")
    ap.add_argument("--checkpoint", default=None, help="an HF-format directory of the tiny preset's weights: the "
                    "mesh runs and the TPU export load it (else they create the preset's weights in their shards)")
    ap.add_argument("--orbax", default=None, help="an orbax checkpoint of the same weights to restore onto "
                    "--memory-mesh")
    ap.add_argument("--memory-mesh", default=None, help="load the checkpoint onto this mesh and report its bytes")
    a = ap.parse_args()
    assert jax.device_count() == 8, jax.devices()
    if a.memory_mesh:
        # Loaded straight into the shards of a mesh: the preset's values, spread over the devices.
        t0 = time.time()
        llm = LLM(a.checkpoint, mesh=a.memory_mesh, **OPTIONS)
        one = LLM("tiny", **OPTIONS)  # on one device
        want = dict(nnx.to_flat_state(nnx.state(one.model)))
        same = all(np.array_equal(np.asarray(v.get_value()), np.asarray(want[p].get_value()))
                   for p, v in nnx.to_flat_state(nnx.state(llm.model)))
        most, total = param_bytes(llm.model)
        w1 = llm.model.stacks[1].ffn.experts.w1[...]
        emit(check="checkpoint", mesh=a.memory_mesh, same_values=bool(same), max_device_fraction=most / total,
             w1_spec=[str(s) for s in w1.sharding.spec], seconds=round(time.time() - t0, 1))
        if a.orbax:
            # An orbax checkpoint written elsewhere, restored onto this mesh: the same values and logits.
            t0 = time.time()
            restored = LLM(a.orbax, mesh=a.memory_mesh, **OPTIONS)
            same = all(np.array_equal(np.asarray(v.get_value()), np.asarray(want[p].get_value()))
                       for p, v in nnx.to_flat_state(nnx.state(restored.model)))
            err = float(np.max(np.abs(restored.logits(PROMPTS[0]) - one.logits(PROMPTS[0]))))
            w1 = restored.model.stacks[1].ffn.experts.w1[...]
            emit(check="orbax", mesh=a.memory_mesh, same_values=bool(same), logits_err=err,
                 w1_spec=[str(s) for s in w1.sharding.spec], seconds=round(time.time() - t0, 1))
    if a.context_meshes:
        context_meshes(a.context_meshes)
    if a.paged_meshes:
        paged_by_contract(a.paged_meshes)
    if a.tpu_export:
        tpu_export(a.tpu_export, a.checkpoint or "tiny")
    if a.experts_meshes:
        experts_per_shard(a.experts_meshes)
    if a.pool_meshes:
        pool_bytes(a.pool_meshes)
    if not a.meshes:
        return
    t0 = time.time()
    ref = LLM("tiny", **MESH_OPTIONS)
    base = ref.generate(MESH_PROMPTS, SAMPLING)  # one reference for every mesh
    emit(check="reference", hit_tokens=ref.stats()["prefix_cache"]["hit_tokens"], seconds=round(time.time() - t0, 1))
    from pallas_kernels import experts as pallas_experts
    real, experts_calls = pallas_experts.routed_experts, []
    # the routed-experts kernel's calls, at trace time (attention_impl="pallas" runs it per shard)
    pallas_experts.routed_experts = lambda x, *args, **kw: experts_calls.append(x.shape[0]) or real(x, *args, **kw)
    for entry in a.meshes:
        mesh, _, impl = entry.partition(":")
        t0 = time.time()
        experts_calls.clear()
        llm = LLM(a.checkpoint or "tiny", mesh=mesh, attention_impl=impl or "xla", **MESH_OPTIONS)
        shards = record_admissions(llm)
        outs = llm.generate(MESH_PROMPTS, SAMPLING)
        most, total = param_bytes(llm.model)
        err = max(float(np.max(np.abs(np.subtract(x.logprobs, y.logprobs)))) for x, y in zip(base, outs))
        st = llm.engine.pools.stacks[1].state_kv  # [layers of the stack, slots, ...] after the steps ran
        emit(check="mesh", mesh=entry, tokens_equal=all(x.token_ids == y.token_ids for x, y in zip(base, outs)),
             logprob_err=err, max_device_fraction=most / total,
             state_spec=[str(s) for s in tuple(st.sharding.spec) + (None,) * (st.ndim - len(st.sharding.spec))],
             experts_kernel_calls=len(experts_calls), **pool_report(llm, mesh, shards),
             seconds=round(time.time() - t0, 1))
        del llm, st
        release()

if __name__ == "__main__":
    main()
