"""`v4jax bench decode` (decode_main): decode step time against the roofline and the HF peer.

The decode benchmark. A Flash-shaped slice (`flash-slice` preset: Flash attention and indexer
sizes, layers [CSA, HCA, CSA, HCA], 16 routed experts) with random weights in bf16, decode step time and tokens/s at
batch 1 and 32 and contexts 4K, 64K, 256K (1M at batch 1).

* Pools are filled synthetically: every pool array (SWA, C4 KV, C4 indexer keys, C128 KV, compressor state) is created
  with pseudo-random values (a hash of each element's coordinates) and each slot's page tables are set (by the
  engine's own allocator) so that it holds `context - 2k` tokens; nothing is prefilled. One jitted decode call then
  runs k steps, at positions context-2k .. context-k-1, so the page bucket (a power of two of full pages) is exactly
  context / P pages and every slot stays active for all k steps (checked).
* The time is the engine's jitted decode call (`engine.steps.decode_step`, k steps in one `lax.fori_loop`,
  sampling included) with the arguments `EngineCore.step` passes it, median over calls after warm-up, with
  `block_until_ready`; per-step time = call time / k. `EngineCore.step()` (the loop `LLM.generate` runs: host
  bookkeeping, the pipelined dispatch and the transfers included) is timed too, on the same synthetic slots.
* Roofline: bytes a step must read / measured HBM bandwidth (a large device copy, bytes read + written / time).
  Bytes = weights the step touches (all attention / router / shared-expert / head weights, the batch's embedding
  rows, and only the routed experts the batch activates: E (1 - (1 - k/E)^B) per layer for random routing) + per
  sequence the pool bytes of reference serving_systems.md §1.2 in bf16 (all C4 indexer keys, top-k selected C4
  entries, all C128 entries, the window), see v4jax.memory.
* HF peer (v4jax.bench.hf_peer, the only module that imports torch): transformers' `DeepseekV4ForCausalLM` with
  the same config and the same weights (copied from the JAX model), bf16, eager attention, on the same GPU: one
  cached decode step after a chunked prefill of `context` random tokens.

Results are written (JSON + markdown) after every row to --out (default $OUT, else ./bench_out), so a run that is
killed still leaves what it measured. `--small` runs the whole thing on a tiny config on CPU in well under a minute.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import traceback

from v4jax import memory as M
from v4jax.bench.hf_peer import (build_hf_model, free_device_cache, have_transformers, hf_check, hf_decode,
                                 hf_probe)
from v4jax.config import CSA, HCA, ModelConfig, preset

DEFAULT_CONTEXTS = (4096, 65536, 262144)


def small_config() -> ModelConfig:
    """The --small config (CPU, seconds): one CSA (ratio 4) and one HCA (ratio 32) layer at toy width."""
    return ModelConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32,
        o_groups=2, o_lora_rank=32, window_size=16, layer_types=(CSA, HCA), compress_ratios=(4, 32),
        index_n_heads=4, index_head_dim=32, index_topk=8, n_routed_experts=4, n_shared_experts=1,
        n_activated_experts=2, moe_inter_dim=32, n_hash_layers=0, route_scale=1.5, original_seq_len=64,
        max_seq_len=1 << 16)


# ---- roofline ----------------------------------------------------------------------------------------
def roofline_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 2, weights=None,
                   kv_cache_dtype: str = "auto") -> dict:
    """Bytes one decode step of `batch` sequences at `context` tokens must read (see the module doc); `weights`
    (quant.WeightFormat): the weights' storage (default: the model dtype); kv_cache_dtype "fp8": the pools' FP8
    entries and FP4 indexer keys."""
    w = M.decode_weight_bytes(cfg, batch, dtype_bytes, **({} if weights is None else {"weights": weights}))
    kv = M.decode_read_bytes(cfg, context, "fp4" if kv_cache_dtype == "fp8" else {2: "bf16", 4: "f32"}[dtype_bytes])
    return {"weights": w["total"], "kv": batch * kv["total"], "total": w["total"] + batch * kv["total"],
            "active_experts_per_layer": w["active_experts_per_layer"],
            "kv_per_seq": kv, "weights_detail": {k: v for k, v in w.items() if k != "total"}}


# ---- output ------------------------------------------------------------------------------------------
class Results:
    def __init__(self, out_dir: str, meta: dict):
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.data = dict(meta, rows=[], hf=[], notes=[])

    def add_row(self, row: dict):
        self.data["rows"].append(row)
        self.write()

    def add_hf(self, row: dict):
        self.data["hf"].append(row)
        self.write()

    def note(self, text: str):
        print("note:", text, flush=True)
        self.data["notes"].append(text)
        self.write()

    def write(self):
        with open(os.path.join(self.out_dir, "decode.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(os.path.join(self.out_dir, "decode.md"), "w") as f:
            f.write(markdown(self.data))


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _ctx(c: int) -> str:
    if c >= 1 << 20 and c % (1 << 20) == 0:
        return f"{c >> 20}M"
    return f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c)


def _mb(b: float) -> str:
    return f"{b / 1e6:.0f}" if b >= 1e7 else f"{b / 1e6:.3g}"


def markdown(data: dict) -> str:
    bw = data.get("bandwidth", {})
    hf = {(h["batch"], h["context"]): h for h in data.get("hf", [])}
    stored = ("" if data.get("quantization", "none") == "none"
              else " in bf16, kept as the release stores them (FP8 linears, FP4 experts)")
    entries = "" if data.get("kv_cache_dtype", "auto") == "auto" else f", {data['kv_cache_dtype']} cache entries"
    lines = [
        f"Device: {data.get('device')}; JAX {data.get('jax')}; config `{data.get('config_name')}` "
        f"({data.get('weights_gb', 0):.2f} GB of weights{stored or ', bf16'}{entries}, random, no MTP); "
        f"k = {data.get('k')} steps per call.",
        f"HBM bandwidth (device copy, read + write): {_f(bw.get('copy_GBps'), '{:.0f}')} GB/s "
        f"(read-only reduction: {_f(bw.get('read_GBps'), '{:.0f}')} GB/s).",
        "Pools synthetically filled (random entries written into the pool arrays, page tables set to hold the "
        "context); no prefill. Roofline = (weights touched + pool bytes read) / copy bandwidth.",
        "",
        "| batch | context | ms/step (jit) | tok/s | ms/step (generate_step) | roofline MB/step (weights + KV) | "
        "roofline ms | % of roofline | HF ms/step | speed-up vs HF | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data.get("rows", []):
        ctx = _ctx(r["context"])
        if r.get("error"):
            lines.append(f"| {r['batch']} | {ctx} | not run: {r['error']} |  |  |  |  |  |  |  |  |")
            continue
        h = hf.get((r["batch"], r["context"]))
        hf_ms = h.get("ms_per_step") if h else None
        rl = r["roofline"]
        lines.append(
            f"| {r['batch']} | {ctx} | {_f(r['ms_per_step'], '{:.3f}')} | {_f(r['tokens_per_s'], '{:.0f}')} | "
            f"{_f(r.get('generate_step_ms_per_step'), '{:.3f}')} | "
            f"{_mb(rl['total'])} ({_mb(rl['weights'])} + {_mb(rl['kv'])}) | "
            f"{_f(r.get('roofline_ms'), '{:.3f}')} | {_f(r.get('roofline_pct'), '{:.0f}')} | "
            f"{_f(hf_ms, '{:.2f}')} | {_f(hf_ms / r['ms_per_step'] if hf_ms else None, '{:.1f}x')} | "
            f"{_f(r.get('compile_s'), '{:.1f}')} |")
    if data.get("hf"):
        lines += ["", "HF `DeepseekV4ForCausalLM` (same config and weights, bf16, eager attention):", "",
                  "| batch | context | ms/step | tok/s | prefill s (chunk) | note |", "|---|---|---|---|---|---|"]
        for h in data["hf"]:
            lines.append(f"| {h['batch']} | {_ctx(h['context'])} | {_f(h.get('ms_per_step'))} | "
                         f"{_f(h['batch'] / h['ms_per_step'] * 1e3 if h.get('ms_per_step') else None, '{:.0f}')} | "
                         f"{_f(h.get('prefill_s'), '{:.1f}')} ({h.get('chunk')}) | {h.get('error') or h.get('info', '')} |")
    chk = data.get("hf_check")
    if chk and "error" not in chk:
        lines += ["", f"Same weights in both: HF vs JAX uncached logits of {chk['tokens']} random tokens (bf16): "
                  f"argmax agreement {chk['argmax_agree']:.2f}, correlation {chk['corr']:.4f}, max |diff| / std "
                  f"{chk['max_abs_diff_over_std']:.3f} (median {chk['median_over_std']:.3f})."]
    elif chk:
        lines += ["", f"HF/JAX logits check failed: {chk['error']}"]
    if data.get("notes"):
        lines += [""] + [f"- {n}" for n in data["notes"]]
    return "\n".join(lines) + "\n"


# ---- JAX side ----------------------------------------------------------------------------------------
def measure_bandwidth(nbytes: int, reps: int = 10) -> dict:
    """HBM bandwidth from a large device copy (x -> x * a + b: every byte read once and written once), the fastest
    of `reps` calls: the median moved with the GPU's state (3390 against 3590-3750 GB/s in calls of one session on
    the H200, whose decode steps took the same time), and the roofline is a capacity."""
    import jax
    import jax.numpy as jnp
    n = nbytes // 4
    x = jax.random.uniform(jax.random.key(1), (n,), jnp.float32)
    copy = jax.jit(lambda x: x * 1.0001 + 0.5)
    red = jax.jit(lambda x: jnp.sum(x))
    out = {}
    for name, fn, moved in (("copy", copy, 2 * n * 4), ("read", red, n * 4)):
        jax.block_until_ready(fn(x))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            ts.append(time.perf_counter() - t0)
        out[f"{name}_GBps"] = moved / min(ts) / 1e9
    del x
    out["bytes"] = nbytes
    return out


def _random_like(shape, dtype, vocab: int, seed: int, entry: tuple[int, int, int] | None = None):
    """Pseudo-random values of one pool array, a hash of each element's coordinates (floats uniform in [-2, 2],
    token ids uniform in [0, vocab)): elementwise from iotas, so the program's only buffer is its output, and no
    flat index (flash-1gpu's largest pool array has 11G elements, past int32). Bytes (kv_cache_dtype="fp8") as
    the entries `entry` = (codes, bf16 values, scales) bytes of a row lays them out (FP8 entries: e4m3 codes, the
    RoPE dims in bf16, ue8m0 scales; FP4 keys: code pairs, no bf16, scales; padding zero), decoding to values of a
    few units: random bytes everywhere decoded to bf16 RoPE dims up to 2^112 and scales down to 2^-127, the
    attention's softmax underflowed, and later layers' hidden states (so their indexer scores) came out zero."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def mix(h):  # a 32-bit finaliser (xorshift-multiply): neighbouring coordinates land far apart
        h = (h ^ (h >> 16)) * np.uint32(0x7FEB352D)
        h = (h ^ (h >> 15)) * np.uint32(0x846CA68B)
        return h ^ (h >> 16)

    h = jnp.full(shape, np.uint32(seed * 0x9E3779B9 & 0xFFFFFFFF), jnp.uint32)
    for d in range(len(shape)):
        h = mix(h + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(0x85EBCA6B + 2 * d))
    if dtype == np.uint8:
        codes, values, scales = entry
        at = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
        code = h % np.uint32(0x78 if values else 0x100)  # e4m3 below 0x78: at most 240; e2m1 pairs: any byte
        v = at - np.uint32(codes)
        high = np.uint32(0x3E) + (h & np.uint32(1)) | (h & np.uint32(0x80))  # a bf16 of [0.25, 1), either sign
        value = jnp.where(v % 2 == 0, h & np.uint32(0xFF), high)
        scale = np.uint32(127 - 6 if values else 127 - 3)  # 2^-6 x 240 or 2^-3 x 6: a few units
        return jnp.where(at < codes, code, jnp.where(at < codes + 2 * values, value,
                                                     jnp.where(at < codes + 2 * values + scales, scale, 0))).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        return (h % np.uint32(vocab)).astype(dtype)
    return ((h >> 8).astype(jnp.float32) * (4.0 / (1 << 24)) - 2.0).astype(dtype)


def _byte_layout(cfg, nbytes: int) -> tuple[int, int, int]:
    """(code bytes, bf16 values, scale bytes) of a pool row of `nbytes` under kv_cache_dtype="fp8": the FP8 entry's
    or the FP4 indexer key's (pallas_kernels.kv_format)."""
    from pallas_kernels import kv_format as F
    entry = F.Fp8Entry(cfg.head_dim, cfg.rope_head_dim)
    if nbytes == entry.nbytes:
        return entry.nope, entry.rope, entry.n_scales
    key = F.Fp4Key(cfg.index_head_dim)
    assert nbytes == key.nbytes, (nbytes, entry.nbytes, key.nbytes)
    return key.dim // 2, 0, key.dim // F.FP4_BLOCK


@contextlib.contextmanager
def _random_pools(vocab: int, seed: int):
    """Engines built inside this create their pools with pseudo-random contents instead of zeros (one program per
    array, its output the array: no zeros first). On the H200 every fill of the engine's zero pools asked for a
    second copy of the largest array (21 GiB for flash-1gpu at batch 32) and ran out of memory: a hash over a
    donated array, one program looping over a donated array's blocks (run K), one program per block (run L), and a
    broadcast into a freed array's place (the memory the engine had just allocated)."""
    import jax
    import numpy as np

    from v4jax import cache as C

    zeros = C.init_pools

    def init_pools(cfg, layout, dtype):
        shapes = jax.eval_shape(lambda: zeros(cfg, layout, dtype))
        fill = jax.jit(_random_like, static_argnums=(0, 1, 2, 3, 4))
        return jax.tree.map(lambda a: fill(a.shape, np.dtype(a.dtype), vocab, seed,
                                           _byte_layout(cfg, a.shape[-1]) if a.dtype == np.uint8 else None), shapes)

    C.init_pools = init_pools
    try:
        yield
    finally:
        C.init_pools = zeros


def _device_free_bytes():
    import jax
    try:
        st = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    if not st or "bytes_limit" not in st:
        return None
    return st["bytes_limit"] - st.get("bytes_in_use", 0)


def _peak_bytes():
    import jax
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        return None
    return st.get("peak_bytes_in_use")


def _decode_temp_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """A generous estimate of one decode step's temporaries (the indexer's gathered keys and f32 scores per CSA
    layer, the HCA gather), for the memory guard."""
    t = 0
    for kind, m in zip(cfg.layer_types, cfg.compress_ratios):
        s = context // m if m else 0  # sliding layers keep no compressed entries
        if kind == CSA:
            t = max(t, batch * s * (cfg.index_head_dim * 2 + cfg.index_n_heads * 4 * 3))
        elif kind == HCA:
            t = max(t, batch * s * (cfg.head_dim * 2 + cfg.n_heads * 4 * 3))
    return 3 * t


class JaxDecodeBench:
    """One engine per batch size (max_num_seqs = batch, max_model_len = the largest context of that batch; no
    prefix cache), its pools filled with random values and every slot holding a request that is decoding."""

    @staticmethod
    def options(batch: int, max_context: int, k: int, kv_cache_dtype: str = "auto"):
        from v4jax.api import EngineOptions
        return EngineOptions(max_num_seqs=batch, decode_steps=k, max_model_len=max_context,
                             enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)

    def __init__(self, cfg, model, run_options, batch: int, max_context: int, k: int, seed: int = 0,
                 kv_cache_dtype: str = "auto", frequency_penalty: float = 0.0):
        from v4jax.engine import EngineCore
        self.cfg, self.batch, self.k = cfg, batch, k
        self.frequency_penalty = frequency_penalty  # nonzero: every row penalised, the program form with penalties
        opts = self.options(batch, max_context, k, kv_cache_dtype)
        t0 = time.perf_counter()
        with _random_pools(cfg.vocab_size, seed):
            self.engine = EngineCore(cfg, model, opts, run_options, max_context)
        self.setup_s = time.perf_counter() - t0

    def pool_bytes(self) -> int:
        from v4jax import cache as C
        return sum(C.pool_bytes(self.engine.pools).values())

    def _occupy(self, held: int, rng):
        """Every slot: a running request whose first `held` tokens are in the (synthetic) pools."""
        from v4jax.engine.scheduler import RUNNING
        from v4jax.engine.sampling import SamplingParams
        eng = self.engine
        sch = eng.scheduler
        for r in list(sch.requests.values()):
            sch.remove(r)
        eng._flight = None
        sp = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True,
                            frequency_penalty=self.frequency_penalty)
        for s in range(self.batch):
            req = sch.add(f"bench-{s}", rng.integers(2, self.cfg.vocab_size, held).tolist(), sp, s, s, ())
            sch.waiting.remove(req)
            req.status, req.slot, req.computed = RUNNING, s, held
            req.output.append(int(rng.integers(2, self.cfg.vocab_size)))
            sch.slots[s] = req
            if not eng.kv.allocate(s, held, held):  # full pages for [0, held), SWA pages of the window
                raise MemoryError(f"slot {s}: {held} tokens do not fit in the pools")

    def decode_args(self, held: int, rng):
        """Every slot decoding at position `held` with its next k positions reserved: the decode step's arguments
        (what EngineCore.step passes)."""
        import numpy as np

        from v4jax.engine import steps as S
        self._occupy(held, rng)
        for slot in range(self.batch):
            if not self.engine.kv.allocate(slot, held, held + self.k):
                raise MemoryError(f"slot {slot}: {held + self.k} tokens do not fit in the pools")
        eng, s = self.engine, self.engine.layout.max_slots
        z = lambda dt=np.int32: np.zeros(s, dt)
        state = S.DecodeState(z(), np.full(s, held, np.int32), np.ones(s, bool), np.full(s, 1 << 20, np.int32),
                              dataclasses.replace(S.SamplingState.neutral(s), seed=np.arange(s, dtype=np.int32),
                                                  sample_index=np.arange(s, dtype=np.int32),
                                                  frequency=np.full(s, self.frequency_penalty, np.float32)))
        state = eng.steps.carry(state, state, z(bool))
        return (state, *eng.kv.decode_tables(eng._page_bucket(held + self.k)))

    def run(self, context: int, n_iter: int, n_gen: int, rng, profile: bool = False) -> dict:
        import jax

        k, eng = self.k, self.engine
        spec = eng.penalty_specs[eng.greedy_spec] if self.frequency_penalty else eng.greedy_spec
        held = context - 2 * k
        state, pt, swa = self.decode_args(held, rng)
        t0 = time.perf_counter()
        out = eng.steps.decode(spec, eng._leaves, eng.pools, eng.store, state, pt, swa)  # compiles this variant
        jax.block_until_ready(out)
        compile_s = time.perf_counter() - t0
        eng.pools, eng.store, res, _ = out
        n_out = jax.device_get(res.n_out)
        if sorted(set(n_out.tolist())) != [k]:
            raise RuntimeError(f"decode call ran {sorted(set(n_out.tolist()))} steps, expected {k} for every slot")
        entries_scanned = pt.shape[1] * (eng.layout.page_size // min(self.cfg.ratios_in_use))
        # the raw jitted call, same positions every time (the context stays put)
        times = []
        for i in range(n_iter + 1):
            t0 = time.perf_counter()
            out = eng.steps.decode(spec, eng._leaves, eng.pools, eng.store, state, pt, swa)
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            eng.pools, eng.store = out[0], out[1]
            if i:  # the first is a warm-up
                times.append(dt)
        call_s = statistics.median(times)
        prof = None
        if profile:
            from v4jax.bench.profile import summarize

            def call():
                out = eng.steps.decode(spec, eng._leaves, eng.pools, eng.store, state, pt, swa)
                jax.block_until_ready(out)
                eng.pools, eng.store = out[0], out[1]

            # the compiled program's text maps each kernel to the line of the model it comes from (a second compile)
            hlo = eng.steps.decode.lower(spec, eng._leaves, eng.pools, eng.store, state, pt,
                                         swa).compile().as_text()
            prof = summarize(call, top=40, hlo_text=hlo)
            if "kernels" in prof:
                prof["kernels_per_layer_step"] = prof["kernels"] / (self.cfg.n_layers * k)
        # the engine loop (what LLM.generate drives): dispatch call n+1, then read call n
        gen = []
        if n_gen:
            # from a little earlier, so that the n_gen + 1 calls stay inside this context's page bucket
            self._occupy(context - (n_gen + 3) * k, rng)
            eng.step()  # the first dispatch (nothing to read yet)
            compiled = eng.compiled_variants()
            for _ in range(n_gen):
                t0 = time.perf_counter()
                deltas = eng.step()
                gen.append(time.perf_counter() - t0)
                if len(deltas) != self.batch or any(len(d.new_token_ids) != k for d in deltas):
                    raise RuntimeError(f"an engine step advanced {[len(d.new_token_ids) for d in deltas]}")
            if eng.compiled_variants() != compiled:
                raise RuntimeError("the timed engine loop compiled a new decode variant: its times include a compile")
        return {
            "batch": self.batch, "context": context, "held_tokens": held, "k": k,
            "positions": [held, held + k - 1], "page_bucket": int(pt.shape[1]),
            "c4_entries_scanned_per_seq": int(entries_scanned),
            "call_ms_median": call_s * 1e3, "call_ms_all": [t * 1e3 for t in times],
            "ms_per_step": call_s * 1e3 / k, "tokens_per_s": self.batch * k / call_s,
            "generate_step_ms_per_step": statistics.median(gen) * 1e3 / k if gen else None,
            "compile_s": compile_s, "peak_device_bytes": _peak_bytes(), "profile": prof,
            "penalties_form": spec.any_penalty,
        }


def _parse_ints(s: str) -> tuple[int, ...]:
    out = []
    for part in s.split(","):
        part = part.strip().upper()
        if not part:
            continue
        mult = 1
        if part.endswith("K"):
            mult, part = 1024, part[:-1]
        elif part.endswith("M"):
            mult, part = 1 << 20, part[:-1]
        out.append(int(part) * mult)
    return tuple(out)


def _plan(batches, contexts, long_b1) -> list[tuple[int, int]]:
    """Rows in the order they run: the shortest context of each batch first (so the HF comparison has its JAX
    rows early), then the rest by increasing context."""
    rows = [(b, c) for b in batches for c in contexts]
    rows += [(1, c) for c in long_b1 if 1 in batches]
    first = [(b, min(contexts)) for b in batches]
    rest = sorted((r for r in rows if r not in first), key=lambda r: (r[1], r[0]))
    return first + rest


def memory_plan(cfg, name: str, batches, contexts, k: int, attention_impl: str) -> int:
    """The decode call's device memory as XLA plans it: arguments, outputs, how much of the donated pools the
    outputs alias, and temporaries, against the largest pool array (a donated pool that is not aliased, or a
    temporary the size of a pool array, doubles that array's memory inside the call). One JSON line per batch and
    context, an engine sized for it, freed before the next."""
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from v4jax import cache as C
    from v4jax.model import RunOptions, Transformer

    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, mtp=False)
    for batch in batches:
        for ctx in contexts:
            bench = JaxDecodeBench(cfg, model, RunOptions(attention_impl=attention_impl), batch, ctx, k)
            eng = bench.engine
            state, pt, swa = bench.decode_args(ctx - 2 * k, np.random.default_rng(0))
            compiled = eng.steps.decode.lower(eng.greedy_spec, eng._leaves, eng.pools, eng.store, state, pt,
                                              swa).compile()
            m = compiled.memory_analysis()
            largest = max(jax.tree.leaves(eng.pools), key=lambda x: x.nbytes)
            out = {"model": name, "batch": batch, "context": ctx, "device": jax.devices()[0].device_kind,
                   "pool_bytes": sum(C.pool_bytes(eng.pools).values()),
                   "largest_pool_array": [largest.nbytes, list(largest.shape), str(largest.dtype)]}
            for f in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes"):
                out[f] = getattr(m, f, None)
            print(json.dumps(out), flush=True)
            del bench, eng, compiled
            gc.collect()
    return 0


def decode_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench decode", description=__doc__.split("\n\n")[1])
    ap.add_argument("--model", default="flash-slice", help="preset name or HF config directory")
    ap.add_argument("--small", action="store_true", help="tiny config, CPU-sized contexts (a smoke test)")
    ap.add_argument("--batches", default=None, help="comma list, default 1,32 (small: 1,2)")
    ap.add_argument("--contexts", default=None, help="comma list, default 4K,64K,256K (small: 256)")
    ap.add_argument("--long-b1", default=None, help="extra contexts at batch 1 only, default 1M (small: 512)")
    ap.add_argument("--k", type=int, default=None, help="decode steps per jitted call (default 8; small 4)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per row (default 7; small 3)")
    ap.add_argument("--gen-iters", type=int, default=3, help="timed generate_step calls per row")
    ap.add_argument("--hf", default="auto", choices=("auto", "on", "off"), help="run the HF comparison")
    ap.add_argument("--hf-contexts", default=None, help="default 4K (small: 256)")
    ap.add_argument("--hf-chunk", type=int, default=None, help="HF prefill chunk (default 1024 at batch 1, "
                    "256 above)")
    ap.add_argument("--hf-iters", type=int, default=None, help="timed HF steps (default 10; small 3)")
    ap.add_argument("--deadline-s", type=float, default=None, help="stop starting new rows after this many "
                    "seconds (default: none; small: none)")
    ap.add_argument("--bw-bytes", type=float, default=None, help="bytes of the bandwidth probe (default 4 GiB; "
                    "small 64 MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"), help="the weights as bf16 (none) or "
                    "as the release stores them (fp8: FP8 linears, FP4 experts; the roofline counts those bytes; no "
                    "HF comparison)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="the pools' entries: the "
                    "model dtype (auto) or the release's FP8 entries and FP4 indexer keys (fp8; the roofline counts "
                    "those bytes; no HF comparison)")
    ap.add_argument("--attention-impl", default="xla", choices=("xla", "pallas"),
                    help="the engine's attention path (pallas: pallas_kernels)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./bench_out)")
    ap.add_argument("--sinkhorn-unroll", action="store_true", help="unroll the mHC Sinkhorn loop (to compare "
                    "launches)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="every row's frequency penalty: nonzero runs "
                    "the program form with penalties (a tiny one, e.g. 1e-9, its cost on the greedy rows' tokens)")
    ap.add_argument("--profile", action="store_true", help="trace each row's decode call: kernels per call and "
                    "per layer, device copies, the heaviest kernels (GPU)")
    ap.add_argument("--memory-plan", action="store_true", help="instead of timing: the decode call's device "
                    "memory as XLA plans it (arguments, outputs, aliased pools, temporaries), one JSON line per "
                    "batch and context (--batches, --contexts, --k, --attention-impl)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + (a.deadline_s if a.deadline_s else 1e9)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch (the HF peer)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from v4jax.model import RunOptions, Transformer, quant

    if a.small:
        cfg, name = small_config(), "small"
        batches, contexts, long_b1 = (1, 2), (256,), (512,)
        k, iters, hf_ctx, bw_bytes = a.k or 4, a.iters or 3, (256,), int(a.bw_bytes or (64 << 20))
        hf_iters = a.hf_iters or 3
    else:
        name = a.model
        cfg = preset(a.model) if not os.path.isdir(a.model) else ModelConfig.from_hf(a.model)
        batches, contexts, long_b1 = (1, 32), DEFAULT_CONTEXTS, (1 << 20,)
        k, iters, hf_ctx, bw_bytes = a.k or 8, a.iters or 7, (4096,), int(a.bw_bytes or (4 << 30))
        hf_iters = a.hf_iters or 10
    batches = _parse_ints(a.batches) if a.batches else batches
    contexts = _parse_ints(a.contexts) if a.contexts else contexts
    long_b1 = _parse_ints(a.long_b1) if a.long_b1 is not None else long_b1
    hf_ctx = _parse_ints(a.hf_contexts) if a.hf_contexts else hf_ctx
    if a.memory_plan:
        return memory_plan(cfg, name, batches, contexts, k, a.attention_impl)
    out_dir = a.out or os.environ.get("OUT") or "bench_out"
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    pb = M.param_bytes(cfg, 2, mtp=False)
    res = Results(out_dir, {
        "command": "v4jax bench decode " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": f"{dev.platform}: {getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
        "python": platform.python_version(), "config_name": name, "config": dataclasses.asdict(cfg),
        "weights_gb": pb["total"] / 1e9, "k": k, "dtype": "bfloat16"})
    print(f"[{time.perf_counter() - t_start:6.1f}s] {res.data['device']} jax {jax.__version__}; {name}: "
          f"{pb['total'] / 1e9:.2f} GB of weights", flush=True)

    bw = measure_bandwidth(bw_bytes)
    res.data["bandwidth"] = bw
    print(f"[{time.perf_counter() - t_start:6.1f}s] bandwidth {bw}", flush=True)

    t0 = time.perf_counter()
    weight_format = quant.RELEASE if a.quantization == "fp8" else quant.DEQUANTIZED
    model = Transformer(cfg, rngs=nnx.Rngs(a.seed), dtype=jnp.bfloat16, mtp=False, weights=weight_format)
    jax.block_until_ready(nnx.state(model))
    res.data["quantization"] = a.quantization
    res.data["kv_cache_dtype"] = a.kv_cache_dtype
    res.data["model_init_s"] = time.perf_counter() - t0
    print(f"[{time.perf_counter() - t_start:6.1f}s] model initialised", flush=True)
    run_opts = RunOptions(attention_impl=a.attention_impl)
    if a.sinkhorn_unroll:
        from v4jax.model import layers
        layers.SINKHORN_UNROLL = True
        res.data["sinkhorn"] = "unrolled"
    rng = np.random.default_rng(a.seed)

    plan = _plan(batches, contexts, long_b1)
    max_ctx = {b: max(c for bb, c in plan if bb == b) for b in batches}
    benches: dict[int, JaxDecodeBench] = {}
    hf_done = False
    bw_Bps = bw["copy_GBps"] * 1e9

    def run_hf():
        stored = a.quantization != "none" or a.kv_cache_dtype != "auto"
        if a.hf == "off" or (a.hf == "auto" and not have_transformers()) or stored:
            res.note("HF comparison not run: " + ("--hf off" if a.hf == "off" else "weights or entries as stored"
                                                  if stored else "transformers is not installed"))
            return None
        device = "cuda" if on_gpu else "cpu"
        try:
            t0 = time.perf_counter()
            hf, info = build_hf_model(cfg, model, device)
            try:
                hf_probe(hf, device)
            except RuntimeError as e:  # transformers 5.17 feeds fp32 norm outputs to bf16 linears
                if "dtype" not in str(e):
                    raise
                del hf
                res.note(f"HF with fp32-kept modules failed ({str(e)[:120]}); HF runs all-bf16 (rotary in fp32)")
                hf, info = build_hf_model(cfg, model, device, keep_fp32=False)
                hf_probe(hf, device)
            res.data["hf_info"] = dict(info, build_s=time.perf_counter() - t0)
            print(f"[{time.perf_counter() - t_start:6.1f}s] HF model built {res.data['hf_info']}", flush=True)
        except Exception as e:  # noqa: BLE001
            res.note(f"HF model could not be built: {type(e).__name__}: {e}")
            traceback.print_exc()
            return None
        for c in hf_ctx:
            for b in batches:
                chunk = a.hf_chunk or (1024 if b == 1 else 256)
                chunk = min(chunk, c)
                if time.perf_counter() > deadline - 20:
                    res.add_hf({"batch": b, "context": c, "chunk": chunk, "error": "skipped: past --deadline-s"})
                    continue
                try:
                    row = hf_decode(hf, b, c, chunk, 2 if a.small else 3, hf_iters, device, deadline - 10, a.seed)
                except Exception as e:  # noqa: BLE001 - OOM and friends are results too
                    row = {"batch": b, "context": c, "chunk": chunk, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    traceback.print_exc()
                row["info"] = f"transformers {info['transformers']}, experts {info['experts_implementation']}"
                res.add_hf(row)
                print(f"[{time.perf_counter() - t_start:6.1f}s] HF {row}", flush=True)
                if device == "cuda":
                    free_device_cache()
        return hf

    def check_hf(hf):
        if hf is None:
            return
        if time.perf_counter() > deadline - 40:
            res.note("HF/JAX logits check skipped: past --deadline-s")
            return
        try:
            res.data["hf_check"] = hf_check(cfg, model, hf, "cuda" if on_gpu else "cpu", seed=a.seed)
        except Exception as e:  # noqa: BLE001
            res.data["hf_check"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res.write()
        print(f"[{time.perf_counter() - t_start:6.1f}s] HF/JAX logits check {res.data['hf_check']}", flush=True)

    hf_model = None
    last_row_s = 0.0
    for b, c in plan:
        if not hf_done and c > min(contexts):
            hf_model = run_hf()
            hf_done = True
            if a.small:
                check_hf(hf_model)
        row_base = {"batch": b, "context": c}
        if time.perf_counter() + max(30.0, 1.2 * last_row_s) > deadline:
            res.add_row(dict(row_base, error="skipped: past --deadline-s"))
            continue
        t_row = time.perf_counter()
        try:
            if b not in benches:
                need = M.engine_pools(cfg, JaxDecodeBench.options(b, max_ctx[b], k), max_ctx[b], model.dtype).total
                free = _device_free_bytes()
                temp = _decode_temp_bytes(cfg, b, max_ctx[b])
                if free is not None and need + temp + (1 << 30) > free:
                    raise MemoryError(f"pools {need / 1e9:.1f} GB + temporaries {temp / 1e9:.1f} GB > "
                                      f"{free / 1e9:.1f} GB free")
                benches[b] = JaxDecodeBench(cfg, model, run_opts, b, max_ctx[b], k, a.seed, a.kv_cache_dtype,
                                            a.frequency_penalty)
            bench = benches[b]
            free = _device_free_bytes()
            temp = _decode_temp_bytes(cfg, b, c)
            if free is not None and temp + (1 << 30) > free:
                raise MemoryError(f"decode temporaries {temp / 1e9:.1f} GB > {free / 1e9:.1f} GB free")
            row = bench.run(c, iters, a.gen_iters, rng, profile=a.profile)
            row["pool_bytes"] = bench.pool_bytes()
            rl = roofline_bytes(cfg, b, c, weights=weight_format, kv_cache_dtype=a.kv_cache_dtype)
            row["roofline"] = rl
            row["roofline_ms"] = rl["total"] / bw_Bps * 1e3
            row["roofline_pct"] = 100.0 * row["roofline_ms"] / row["ms_per_step"]
            row["achieved_GBps"] = rl["total"] / (row["ms_per_step"] / 1e3) / 1e9
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = dict(row_base, error=f"{type(e).__name__}: {str(e)[:300]}")
        row["wall_s"] = last_row_s = time.perf_counter() - t_row
        res.add_row(row)
        print(f"[{time.perf_counter() - t_start:6.1f}s] row b={b} ctx={c}: "
              f"{ {k_: v for k_, v in row.items() if k_ not in ('roofline', 'call_ms_all')} }", flush=True)
    if not hf_done:
        hf_model = run_hf()
        if a.small:
            check_hf(hf_model)
    if not a.small:
        check_hf(hf_model)
    res.data["total_s"] = time.perf_counter() - t_start
    res.write()
    print(markdown(res.data), flush=True)
    return 0
