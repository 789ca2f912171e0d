"""`v4jax memory`: KV pool bytes per kind, per token and per request (v4jax.memory), on the command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from v4jax import memory as M
from v4jax.config import ModelConfig, preset


def _parse_ints(s: str) -> tuple[int, ...]:
    from v4jax.bench.decode import _parse_ints as parse
    return parse(s)


def memory_main(argv=None) -> int:
    """`v4jax memory --model flash --context 1048576 [--requests N] [--format bf16,fp8,fp4] [--budget-gib G]`"""
    ap = argparse.ArgumentParser(prog="v4jax memory", description="KV pool bytes per kind, per token and per "
                                 "request, in bf16 and in the FP8 / FP4 layouts")
    ap.add_argument("--model", default="flash", help="preset name or HF config directory")
    ap.add_argument("--context", type=str, default="1048576", help="tokens per request (e.g. 1048576, 64K, 1M)")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--format", default="bf16,fp8,fp4", help="comma list of bf16, f32, fp8, fp4 (fp4 = FP8 KV + "
                    "FP4 indexer keys)")
    ap.add_argument("--budget-gib", type=float, default=None, help="also: pages / tokens that fit in this pool "
                    "budget with the engine's layout (bf16)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    cfg = preset(a.model) if not os.path.isdir(a.model) else ModelConfig.from_hf(a.model)
    ctx = _parse_ints(a.context)[0]
    reps = [M.report(cfg, ctx, a.requests, f.strip()) for f in a.format.split(",") if f.strip()]
    if a.json:
        out = {"model": a.model, "reports": [dataclasses.asdict(r) for r in reps]}
        if a.budget_gib:
            out["budget"] = dataclasses.asdict(M.pool_budget(cfg, int(a.budget_gib * M.GiB),
                                                             max_num_seqs=a.max_num_seqs))
        print(json.dumps(out, indent=1))
        return 0
    print(M.format_report(reps, title=f"## {a.model}: {a.requests} request(s) x {ctx} tokens"))
    if a.budget_gib:
        pb = M.pool_budget(cfg, int(a.budget_gib * M.GiB), max_num_seqs=a.max_num_seqs)
        print(f"\nEngine pools in {a.budget_gib} GiB (bf16, {a.max_num_seqs} slots): {pb.n_pages} full pages of "
              f"{pb.page_size} tokens = {pb.tokens} tokens; {pb.per_page_bytes} B per page; fixed "
              f"{pb.fixed_bytes / M.MiB:.1f} MiB (SWA pages + compressor state)")
    return 0
