"""`v4jax bench spec`: speculative decoding (the MTP block, or DSpark draft layers) against plain decoding, through
`LLM.generate`.

For the plain engine and each k of `--k`: two untimed pairs of `generate` calls (they compile and put the prompts'
full pages in the prefix cache), then a timed pair of the same prompts, greedy, 1 and `--new` + 1 tokens each at
batch `--batch`; their difference is decode with the batch together. Reports ms per
generated token, the speed against plain decoding, acceptance by draft position and the mean tokens a step
(1 + accepted / steps); the drafter's outputs must equal plain decoding's in float32 (greedy speculation is
lossless), else it fails. A forced acceptance rate keeps each of the drafter's drafts with that probability,
right or not (StepSpec.forced_acceptance): its outputs are not plain decoding's, its cost is that of a drafter
that good. (Drafts forced from a table of plain decoding's tokens measured nothing on bf16 random weights:
flash-1gpu's first verify chose otherwise than plain decoding, and every later draft was rejected.)
Default model: the embedded one (its trained MTP head), prompts from the openings of plays."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import time

import numpy as np

PROMPTS = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "MACBETH:\nIs this a dagger which I see before me,",
    "PORTIA:\nThe quality of mercy is not strain'd,",
    "JAQUES:\nAll the world's a stage,\nAnd all the men and women merely players:",
    "ANTONY:\nFriends, Romans, countrymen, lend me your ears;",
    "PROSPERO:\nOur revels now are ended. These our actors,",
    "LEAR:\nBlow, winds, and crack your cheeks! rage! blow!",
    "HENRY V:\nOnce more unto the breach, dear friends, once more;",
    "OTHELLO:\nIt is the cause, it is the cause, my soul,",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "VIOLA:\nMake me a willow cabin at your gate,",
    "PUCK:\nIf we shadows have offended,",
    "BRUTUS:\nThere is a tide in the affairs of men,",
    "CLAUDIO:\nAy, but to die, and go we know not where;",
]


def _prompts(llm, context: int, batch: int, seed: int = 0):
    """`batch` prompts: the play openings (context 0, a model with a tokenizer), else random token ids of
    `context` tokens (presets have no tokenizer)."""
    if not context:
        if 2 * batch > len(PROMPTS):
            raise ValueError(f"--batch at most {len(PROMPTS) // 2} with the play openings; give --context")
        return PROMPTS[batch:2 * batch]
    rng = np.random.default_rng(seed)
    return [rng.integers(1, llm.config.vocab_size, context).tolist() for _ in range(batch)]


def _same_prefix(outs, plain) -> float:
    """The share of generated tokens before each request's first difference from plain decoding. In float32 it
    must be 1 (speculation is lossless); in bfloat16 the verify step's k+1-token shapes round differently from a
    1-token step, and random weights leave near-ties that flip."""
    agree = total = 0
    for o, p in zip(outs, plain, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(o.token_ids, p.token_ids)) if a != b), len(p.token_ids))
        agree, total = agree + n, total + len(p.token_ids)
    return agree / total


def run(model, ks, new: int, batches, dtype: str, max_model_len: int, context: int = 0,
        accepts=(None,), profile: bool = False, method: str = "mtp") -> list[dict]:
    """Rows for plain decoding and each (k, acceptance) pair at each batch; acceptance None is the drafter's own, a
    number forces it (each of the MTP block's drafts kept with that probability: what a drafter of that acceptance
    costs and gains). One engine of max(batches) slots per k; a batch of b runs the
    first b prompts. Decode time per token = (time of new + 1 tokens - time of 1 token) / new, the same prompts
    each time, after two untimed pairs that compile and put the prompts' full pages in the prefix cache: in the
    timed pair both calls prefill only each prompt's last page, so the difference is decode with the whole batch
    decoding together (with the cache off, the first requests of a large batch decoded alone between the others'
    prefill chunks: plain flash-slice at batch 32 took 20.9 ms a token position on the H200, its decode step 2.5).
    profile: each row also gets the device kernels per generated token position, by kernel family (`decode_profile`)."""
    from v4jax import LLM, SamplingParams

    long_sp = SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True)
    short_sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows, plain = [], {}
    for k in [0] + list(ks):
        spec = {"method": method, "num_speculative_tokens": k} if k else None
        # one engine per k, its rates run in turn: a rate recompiles the decode call only (flash-1gpu: its
        # prefill programs and 50 GB of weights once per k, not per rate)
        llm = LLM(model, dtype=dtype, max_num_seqs=max(batches), max_model_len=max_model_len,
                  speculative_config=spec)
        prompts = _prompts(llm, context, max(batches))
        drafter = llm.engine.greedy_spec
        for accept, b in [(a, b) for a in (accepts if k else [None]) for b in batches]:
            llm.engine.greedy_spec = dataclasses.replace(drafter, forced_acceptance=accept)
            # two untimed pairs: the first compiles and caches the prompts' pages, but its long call can resume some
            # prompts at an earlier boundary than later calls do (the window tails its own prefill saved were over
            # the prefix cache's tail budget), so the second pair's short call prefilled a shape never compiled
            # (flash-slice, batch 32 on the H200: 17 s inside the timed call)
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(prompts[:b], short_sp)
                t_short = time.perf_counter() - t0
                st = llm.stats()
                before, hits = st["spec_decode"], st["prefix_cache"]
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:b], long_sp)
                t_long = time.perf_counter() - t0
            st = llm.stats()
            after, hits_after = st["spec_decode"], st["prefix_cache"]
            if not k:
                plain[b] = outs
            same = _same_prefix(outs, plain[b])
            if same < 1.0 and dtype == "float32" and accept is None:
                raise AssertionError(f"k={k}, batch {b}: greedy outputs differ from plain decoding")
            steps = after["num_drafts"] - before["num_drafts"]
            acc = [x - y for x, y in zip(after["accepted_by_position"], before["accepted_by_position"])]
            ms = 1e3 * (t_long - t_short) / new
            row = {"k": k, "accept": "drafter" if accept is None else accept, "batch": b, "new": new,
                   "context": context, "seconds": t_long, "prefill_seconds": t_short, "ms_per_token": ms,
                   "tokens_per_s": 1e3 * b / ms, "steps": steps,
                   "accepted_by_position": [x / steps for x in acc] if steps else [],
                   "tokens_per_step": 1 + sum(acc) / steps if steps else 1.0, "same_as_plain": same,
                   # the share of the timed long call's prompt tokens the prefix cache held (each prompt's last
                   # page is always computed: a prompt of n full pages resumes at n - 1)
                   "hit_share": (hits_after["hit_tokens"] - hits["hit_tokens"])
                   / max(1, hits_after["queried_tokens"] - hits["queried_tokens"])}
            row["speedup"] = row["tokens_per_s"] / next(
                r["tokens_per_s"] for r in rows + [row] if r["k"] == 0 and r["batch"] == b)
            if profile:
                row["profile"] = decode_profile(lambda sp, g=llm.generate, p=prompts[:b]: g(p, sp), short_sp, long_sp,
                                                new)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
        gc.collect()  # the next engine loads its own weights: this one's must be gone (flash-1gpu: 50 GB each)
    return rows


def decode_profile(generate, short_sp, long_sp, new: int, top: int = 25) -> list:
    """The device kernels of `new` decoded tokens: profiler traces (v4jax.bench.profile.summarize) of
    generate(long_sp) and generate(short_sp), the second (the prefill and the first token) taken from the first
    per kernel family. Returns "(all kernels)" and "(copies)" (device memcpy / memset events), then the `top`
    families by time: [(family, launches, ms) per generated token position]; the first two against the step's wall
    time say how long the device waited."""
    from v4jax.bench.profile import summarize
    short, long = (summarize(lambda sp=sp: generate(sp), repeats=1, top=10_000) for sp in (short_sp, long_sp))
    if "error" in short or "error" in long:
        return [(f"(no profile: {short.get('error') or long.get('error')})", 0, 0.0)]
    per = lambda n, ms, n0, ms0: ((n - n0) / new, (ms - ms0) / new)
    totals = [("(all kernels)", *per(long.get("kernels", 0), long.get("kernel_ms", 0.0), short.get("kernels", 0),
                                     short.get("kernel_ms", 0.0))),
              ("(copies)", *per(long.get("copies", 0), long.get("copy_ms", 0.0), short.get("copies", 0),
                                short.get("copy_ms", 0.0)))]
    base = {name: (n, ms) for name, n, ms in short["top"]}
    diff = [(name, *per(n, ms, *base.get(name, (0, 0.0)))) for name, n, ms in long["top"]]
    return totals + sorted(diff, key=lambda d: -d[2])[:top]


def markdown(rows: list[dict]) -> str:
    lines = ["| k | drafts | batch | context | decode ms / token | tokens/s | vs plain | tokens / step | "
             "accepted by position | same as plain | prompt hits |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " / ".join(f"{100 * a:.0f} %" for a in r["accepted_by_position"]) or "-"
        drafts = "-" if not r["k"] else ("own drafts" if r["accept"] == "drafter" else f"forced {r['accept']:g}")
        lines.append(f"| {r['k'] or 'plain'} | {drafts} | {r['batch']} | {r['context'] or 'play openings'} | "
                     f"{r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['tokens_per_step']:.2f} | {acc} | {100 * r['same_as_plain']:.0f} % | "
                     f"{100 * r.get('hit_share', 0):.0f} % |")
    return "\n".join(lines)


def spec_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="v4jax bench spec", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory or preset (default: the embedded model)")
    p.add_argument("--k", default="1,2,3", help="comma list of num_speculative_tokens")
    p.add_argument("--method", default="mtp", choices=("mtp", "dspark"), help="the drafter: the MTP block, or the "
                   "DSpark draft layers of a checkpoint that has them (v4jax.training.dspark trains one for the "
                   "default model)")
    p.add_argument("--new", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--batch", default="1", help="comma list: prompts at once (one engine of the largest)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=0, help="prompts of this many random token ids (a preset has no "
                   "tokenizer); 0: the play openings")
    p.add_argument("--accept", default="drafter", help="comma list: 'drafter' (the drafter's own drafts) and "
                   "forced acceptance rates in (0, 1] (each draft kept with that probability, right or not; the outputs "
                   "then differ from plain decoding's): what a drafter that good costs and gains")
    p.add_argument("--max-model-len", type=int, default=0, help="default: context + new + 16 (512 with the play openings)")
    p.add_argument("--profile", action="store_true", help="trace each row's generate calls (a GPU): the device "
                   "kernels per generated token position, by kernel family, in the row's JSON and printed")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    batches = [int(x) for x in a.batch.split(",") if x]
    if not a.context and 2 * max(batches) > len(PROMPTS):
        p.error(f"--batch at most {len(PROMPTS) // 2} with the play openings; give --context")
    try:
        accepts = [None if x == "drafter" else float(x) for x in a.accept.split(",") if x]
    except ValueError:
        p.error(f"--accept: 'drafter' or rates, got {a.accept!r}")
    if any(x is not None and not 0 < x <= 1 for x in accepts):
        p.error("--accept: rates in (0, 1]")
    max_len = a.max_model_len or (a.context + a.new + 16 if a.context else 512)
    # the engine's slow steps (over 2 s: a compile inside a step) named on stderr with the time since the start, so a
    # device call cut short says which program it was compiling
    logging.basicConfig(format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    logging.getLogger("v4jax.engine").setLevel(logging.INFO)
    rows = run(a.model, [int(x) for x in a.k.split(",") if x], a.new, batches, a.dtype, max_len, a.context, accepts,
               a.profile, a.method)
    print(markdown(rows))
    for r in rows:
        if r.get("profile"):
            print(f"\nk {r['k']}, drafts {r['accept']}, batch {r['batch']}: device kernels per token position")
            for name, n, ms in r["profile"]:
                print(f"  {name[:60]:60s} {n:7.2f} launches {1e3 * ms:9.1f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
