#!/usr/bin/env python
"""Evaluate the default model (or any checkpoint of its kind) on the held-out Shakespeare plays.

    python scripts/eval_default_model.py                      # v4jax/default_model, data/shakespeare
    python scripts/eval_default_model.py --ckpt DIR --out eval.json --max-windows 128 --no-generate
    python scripts/eval_default_model.py --samples-only --markdown samples.md   # the continuations alone

Measures, over non-overlapping held-out windows of seq_len + 1 tokens (the training length):
  * held-out loss / perplexity of the main head;
  * loss by position bucket (0-31, 32-63, ...), with all entries and with the compressed entries masked out
    (RunOptions(drop_compressed=True): window only) -- the gap beyond the window is what CSA/HCA earn;
  * the Lightning Indexer's recall: the share of the dense attention mass over compressed entries that its
    top-k covers, per CSA layer;
  * the MTP head's top-1 accuracy (position i predicts token i+2) and loss;
  * three greedy and three sampled continuations of held-out prompts (a plain full-forward loop), written in
    BENCHMARKS.md's layout: each prompt shown from its last speech, the continuation between ⟦ ⟧.
The checkpoint is read with checkpoints.open_checkpoint and assigned with v4jax.model.weights.load_tensors (the
loader every checkpoint goes through). Runs on CPU (a few minutes) or GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=os.path.join(ROOT, "v4jax", "default_model"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "shakespeare"))
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--markdown", default=None, help="write a markdown summary here")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8"],
                   help="round the keys as an engine's pools of this kv_cache_dtype store them (fp8: the release's "
                        "FP8 entries and FP4 indexer keys)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-windows", type=int, default=None, help="held-out windows to use (default: all)")
    p.add_argument("--bucket", type=int, default=32)
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--samples-only", action="store_true", help="only the continuations (no held-out evaluation)")
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_model(ckpt_dir: str, dtype):
    import jax.numpy as jnp
    from flax import nnx

    from checkpoints import open_checkpoint
    from v4jax.model import Transformer
    from v4jax.model.weights import load_tensors

    ckpt = open_checkpoint(ckpt_dir)
    cfg = ckpt.cfg
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype),
                                                  mtp=ckpt.has_mtp))
    return cfg, load_tensors(abstract, ckpt.iter_tensors())


SPEAKER = re.compile(r"\n\n([A-Z][A-Z' ]+[A-Z]\.)\n")  # a speaker heading, e.g. "\n\nSIR TOBY.\n"
_SMALL_WORDS = {"a", "an", "and", "as", "at", "for", "in", "of", "on", "or", "the", "to"}


def play_title(doc: str) -> str:
    """'TWELFTH NIGHT; OR, WHAT YOU WILL' -> 'Twelfth Night' (the first line, before a ';', in title case)."""
    words = doc.split("\n", 1)[0].split(";")[0].strip().lower().split()
    return " ".join(w if i and w in _SMALL_WORDS else w.capitalize() for i, w in enumerate(words))


def heldout_prompts(held_text: str, n: int = 3, chars: int = 400, titles: bool = False):
    """n prompts from the held-out plays' modern editions: the text up to and including the first speaker
    heading (a line like 'ANGELO.') after one third of the play, starting at a line boundary ~`chars` before.
    With titles=True: [(prompt, play title)]."""
    from v4jax.training.data import split_documents
    docs = [d for d in split_documents(held_text) if "by William Shakespeare" in d[:200]] or \
        split_documents(held_text)
    out = []
    for d in docs[:n]:
        m = SPEAKER.search(d, len(d) // 3)
        end = m.end()
        start = d.rfind("\n\n", 0, max(0, end - chars)) + 2
        out.append((d[start:end], play_title(d)) if titles else d[start:end])
    return out


def last_speech(prompt: str) -> str:
    """The prompt from its last paragraph before the final speaker heading: the speech the continuation answers
    (from its heading, or from a stage direction inside it). A fixed number of trailing characters (the earlier
    layout showed the last 240) can start mid-speech, and for a long speech hold no paragraph start at all: prompt
    2's last speech (Maria's, Twelfth Night) is 330 characters, and its samples were lost that way."""
    heads = list(SPEAKER.finditer(prompt))
    body = prompt[: heads[-1].start()] if heads else prompt
    start = body.rstrip("\n").rfind("\n\n")
    return prompt[start + 2:] if start >= 0 else prompt


def oracle_recall(target, k):
    """The best any top-k can do: the k largest target masses per row (rows with target mass), averaged."""
    import jax
    import jax.numpy as jnp
    has = jnp.sum(target, -1) > 0.5
    best = jnp.sum(jax.lax.top_k(target, min(k, target.shape[-1]))[0], -1)
    return jnp.sum(jnp.where(has, best, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def random_recall(seq_len: int, ratio: int, k: int) -> float:
    """Expected share a uniformly random choice of k causal entries covers, averaged over rows with entries
    (each entry's expected share is 1/n of the row's mass)."""
    n = (np.arange(seq_len) + 1) // ratio
    n = n[n > 0]
    return float(np.mean(np.minimum(1.0, k / n)))


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from v4jax.training import data as D
    from v4jax.model import RunOptions
    from v4jax.training.train import cross_entropy, forward_with_aux, indexer_terms

    t0 = time.time()
    cfg, model = load_model(args.ckpt, args.dtype)
    graphdef, state = nnx.split(model)
    t_load = time.time() - t0
    tok = D.load_tokenizer(args.ckpt if os.path.exists(os.path.join(args.ckpt, "tokenizer.json")) else None)
    _, held_text = D.load_split(args.data)
    if args.samples_only:
        res = dict(checkpoint=args.ckpt, compute_dtype=args.dtype,
                   samples=generate_samples(graphdef, state, cfg, tok, held_text, args))
        print("\n".join(samples_markdown(res["samples"])), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write("\n".join(samples_markdown(res["samples"])) + "\n")
        return res
    held = D.encode_corpus(tok, held_text)
    T = args.seq_len
    windows = np.concatenate(list(D.eval_batches(held, T + 1, 1 << 30)))
    if args.max_windows:
        windows = windows[: args.max_windows]
    dev = jax.devices()[0]
    print(f"[eval] {args.ckpt} on {dev.platform}:{dev.device_kind} ({args.dtype}); {len(windows)} held-out "
          f"windows of {T + 1}", flush=True)

    kvd = args.kv_cache_dtype
    cache = kvd if kvd == "fp8" or (kvd == "bfloat16" and args.dtype != "bfloat16") else None

    @jax.jit
    def full(state, tokens):
        m = nnx.merge(graphdef, state)
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits, mtp_logits, aux, _ = forward_with_aux(m, x, RunOptions(indexer_aux=True, cache_dtype=cache))
        _, nll = cross_entropy(logits, y)
        _, mtp_nll = cross_entropy(mtp_logits, y[:, 1:])
        hit = jnp.argmax(mtp_logits, -1) == y[:, 1:]
        main_hit = jnp.argmax(logits, -1) == y
        recall = jnp.stack([indexer_terms(lp, tg, cfg.index_topk)[1] for lp, tg in aux]) if aux else jnp.zeros(0)
        oracle = jnp.stack([oracle_recall(tg, cfg.index_topk) for _, tg in aux]) if aux else jnp.zeros(0)
        return nll, mtp_nll, hit, main_hit, jnp.stack([recall, oracle], -1)

    @jax.jit
    def window_only(state, tokens):
        m = nnx.merge(graphdef, state)
        x, y = tokens[:, :-1], tokens[:, 1:]
        _, nll = cross_entropy(m(x, RunOptions(drop_compressed=True, cache_dtype=cache)), y)
        return nll

    B = args.batch_size
    nll_sum = np.zeros(T, np.float64)
    drop_sum = np.zeros(T, np.float64)
    mtp_nll_sum = mtp_hits = main_hits = 0.0
    recall_sum = None
    count = 0
    t1 = time.time()
    for i in range(0, len(windows), B):
        w = windows[i: i + B]
        nb = len(w)
        if nb < B:  # keep one compiled shape
            w = np.concatenate([w, np.repeat(w[-1:], B - nb, axis=0)])
        nll, mtp_nll, hit, main_hit, recall = jax.device_get(full(state, jnp.asarray(w)))
        dnll = jax.device_get(window_only(state, jnp.asarray(w)))
        nll_sum += nll[:nb].sum(0)
        drop_sum += dnll[:nb].sum(0)
        mtp_nll_sum += float(mtp_nll[:nb].sum())
        mtp_hits += float(hit[:nb].sum())
        main_hits += float(main_hit[:nb].sum())
        r = np.asarray(recall, np.float64) * nb  # batch mean over rows; weight by windows (approximately)
        recall_sum = r if recall_sum is None else recall_sum + r
        count += nb
        if (i // B) % 10 == 0:
            print(f"[eval] {count}/{len(windows)} windows, {time.time() - t1:.0f}s", flush=True)
    t_eval = time.time() - t1

    per_pos = nll_sum / count
    per_pos_drop = drop_sum / count
    bk = args.bucket
    buckets = []
    for s in range(0, T, bk):
        a, b = per_pos[s: s + bk].mean(), per_pos_drop[s: s + bk].mean()
        buckets.append(dict(positions=f"{s}-{min(s + bk, T) - 1}", loss=float(a), loss_window_only=float(b),
                            delta=float(b - a)))
    W = cfg.window_size
    res = dict(
        checkpoint=os.path.relpath(args.ckpt, ROOT) if args.ckpt.startswith(ROOT) else args.ckpt,
        device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__, compute_dtype=args.dtype,
        kv_cache_dtype=kvd,
        windows=int(count), seq_len=T, tokens=int(count * T),
        heldout_loss=float(per_pos.mean()), heldout_ppl=float(np.exp(per_pos.mean())),
        heldout_loss_window_only=float(per_pos_drop.mean()),
        heldout_ppl_window_only=float(np.exp(per_pos_drop.mean())),
        loss_beyond_window=float(per_pos[W:].mean()), loss_beyond_window_window_only=float(per_pos_drop[W:].mean()),
        main_top1=main_hits / (count * T),
        mtp_top1=mtp_hits / (count * (T - 1)), mtp_loss=mtp_nll_sum / (count * (T - 1)),
        indexer_recall={f"layer {i}": float(v[0] / count) for i, v in
                        zip([j for j, k in enumerate(cfg.layer_types) if k == "csa"], recall_sum)},
        indexer_recall_oracle={f"layer {i}": float(v[1] / count) for i, v in
                               zip([j for j, k in enumerate(cfg.layer_types) if k == "csa"], recall_sum)},
        indexer_recall_random=random_recall(T, min(cfg.ratios_in_use), cfg.index_topk),
        index_topk=cfg.index_topk, window_size=W, compress_ratios=list(cfg.compress_ratios),
        position_buckets=buckets, load_s=t_load, eval_s=t_eval,
    )
    print(f"[eval] held-out loss {res['heldout_loss']:.4f} ppl {res['heldout_ppl']:.2f}; window only "
          f"{res['heldout_loss_window_only']:.4f} ppl {res['heldout_ppl_window_only']:.2f}; MTP top-1 "
          f"{res['mtp_top1']:.3f}; indexer recall {res['indexer_recall']} oracle {res['indexer_recall_oracle']} "
          f"random {res['indexer_recall_random']:.3f} ({t_eval:.0f}s)", flush=True)
    for b in buckets:
        print(f"[eval]   {b['positions']:>9}: {b['loss']:.4f}  window-only {b['loss_window_only']:.4f}  "
              f"delta {b['delta']:+.4f}", flush=True)

    if not args.no_generate:
        t2 = time.time()
        res["samples"] = generate_samples(graphdef, state, cfg, tok, held_text, args)
        res["generate_s"] = time.time() - t2
        print("\n".join(samples_markdown(res["samples"])), flush=True)

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown(res))
    return res


def generate_samples(graphdef, state, cfg, tok, held_text, args) -> list[dict]:
    """Greedy and temperature-sampled continuations of each prompt, batched in one fixed-shape loop: row r's
    next token is read at its own position of a full causal forward over a padded buffer."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    prompts, titles = zip(*heldout_prompts(held_text, titles=True))
    ids = [[cfg.bos_token_id] + tok.encode(p, add_special_tokens=False).ids for p in prompts]
    rows = [(i, "greedy") for i in range(len(ids))] + [(i, "sampled") for i in range(len(ids))]
    L = max(len(x) for x in ids) + args.new_tokens
    buf = np.full((len(rows), L), cfg.eos_token_id, np.int32)
    pos = np.zeros(len(rows), np.int32)
    for r, (i, _) in enumerate(rows):
        buf[r, : len(ids[i])] = ids[i]
        pos[r] = len(ids[i])
    temp = np.array([0.0 if mode == "greedy" else args.temperature for _, mode in rows], np.float32)
    base = jax.random.key(args.seed)

    @jax.jit
    def next_tokens(state, buf, pos, temp, step):
        m = nnx.merge(graphdef, state)
        logits = m(buf)  # [R, L, V]
        lg = jnp.take_along_axis(logits, (pos - 1)[:, None, None], axis=1)[:, 0]
        greedy = jnp.argmax(lg, -1)
        keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(jnp.arange(lg.shape[0]))
        sampled = jax.vmap(jax.random.categorical)(keys, lg / jnp.maximum(temp, 1e-6)[:, None])
        return jnp.where(temp > 0, sampled, greedy).astype(jnp.int32)

    done = np.zeros(len(rows), bool)
    for step in range(args.new_tokens):
        nxt = np.asarray(jax.device_get(next_tokens(state, jnp.asarray(buf), jnp.asarray(pos),
                                                     jnp.asarray(temp), step)))
        for r in range(len(rows)):
            if not done[r]:
                buf[r, pos[r]] = nxt[r]
                pos[r] += 1
                done[r] = nxt[r] == cfg.eos_token_id
    out = []
    for r, (i, mode) in enumerate(rows):
        new = buf[r, len(ids[i]): pos[r]].tolist()
        out.append(dict(prompt_index=i, mode=mode, temperature=float(temp[r]), seed=args.seed, play=titles[i],
                        prompt=prompts[i], continuation=tok.decode(new, skip_special_tokens=False),
                        new_tokens=len(new), ended_with_eos=bool(new) and new[-1] == cfg.eos_token_id))
    return out


def to_markdown(res: dict) -> str:
    lines = [
        f"Held-out: {res['windows']} windows x {res['seq_len']} tokens ({res['tokens']} tokens), "
        f"{res['device']}, compute {res['compute_dtype']}.",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| held-out loss / perplexity | {res['heldout_loss']:.4f} / {res['heldout_ppl']:.2f} |",
        f"| same, compressed entries masked (window {res['window_size']} only) | "
        f"{res['heldout_loss_window_only']:.4f} / {res['heldout_ppl_window_only']:.2f} |",
        f"| loss at positions >= {res['window_size']}: all entries / window only | "
        f"{res['loss_beyond_window']:.4f} / {res['loss_beyond_window_window_only']:.4f} |",
        f"| main head top-1 | {res['main_top1']:.3f} |",
        f"| MTP head top-1 (token i+2) / loss | {res['mtp_top1']:.3f} / {res['mtp_loss']:.4f} |",
        "| indexer recall: share of the dense attention mass over compressed entries that its top-%d covers | %s |"
        % (res["index_topk"], ", ".join(f"{k}: {v:.3f}" for k, v in res["indexer_recall"].items())),
        "| same for the best possible top-%d (oracle) / a random top-%d | %s / %.3f |" % (
            res["index_topk"], res["index_topk"],
            ", ".join(f"{k}: {v:.3f}" for k, v in res["indexer_recall_oracle"].items()),
            res["indexer_recall_random"]),
        "",
        "| positions | loss | loss, window only | window only - all |",
        "| --- | --- | --- | --- |",
    ]
    for b in res["position_buckets"]:
        lines.append(f"| {b['positions']} | {b['loss']:.4f} | {b['loss_window_only']:.4f} | {b['delta']:+.4f} |")
    lines.append("")
    lines += samples_markdown(res.get("samples", []))
    return "\n".join(lines) + "\n"


def samples_markdown(samples: list[dict]) -> list[str]:
    """The continuations as BENCHMARKS.md shows them: a label, then the prompt from its last speech and the
    continuation between ⟦ ⟧."""
    lines = []
    for s in samples:
        mode = "greedy" if s["mode"] == "greedy" else f"sampled (T = {s['temperature']:g})"
        play = f" ({s['play']})" if s.get("play") else ""
        lines += [f"{mode}, prompt {s['prompt_index']}{play}:", "```",
                  last_speech(s["prompt"]) + "⟦" + s["continuation"] + "⟧", "```"]
    return lines


if __name__ == "__main__":
    main()
