#!/usr/bin/env python
"""Train the embedded default model (a small DeepSeek-V4 with every feature on) on Shakespeare.

Full run (one H200 call, ~3.5 min; the token cache made by scripts/prepare_shakespeare.py + one CPU run, carried
with the call; the shipped model, see BENCHMARKS.md "Default model" for the carried files):
    python3 scripts/train_default_model.py --data data/gpu_cache --work /tmp/w900 --export /tmp/export900 \
        --steps 900 --max-minutes 5.6 --log-every 100 --eval-every 200 --eval-windows 512 --no-resume

CPU smoke run (tiny config, a few steps; synthetic tokens if no prepared data):
    python scripts/train_default_model.py --smoke

Resumes from <work>/train_state.npz when it exists (same TrainConfig required), so a run can span calls;
--max-minutes saves the state and stops before the budget is crossed (the export then waits for a later call).
At the end (also after an early stop) it writes the official-name checkpoint (config.json + model.safetensors, bf16 weights; tokenizer
files copied) to --export and a summary JSON (step time, tokens/s, losses, held-out curve) to <work>.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

T_START = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Determinism on GPU: set before jax is imported.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_gpu_deterministic_ops" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_gpu_deterministic_ops=true").strip()

import numpy as np  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "shakespeare"))
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "default"), help="train state, logs, summary")
    p.add_argument("--export", default=None, help="write config.json + model.safetensors (+ tokenizer) here")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--mtp-weight", type=float, default=None)
    p.add_argument("--indexer-weight", type=float, default=None)
    p.add_argument("--bias-update-rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock budget from process start: save and stop before crossing it")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=250, help="held-out loss every N steps (0: never)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows for the periodic eval")
    p.add_argument("--auto-steps", action="store_true",
                   help="--steps is a maximum: after --auto-steps-at steps (inside the warmup) fix the step count "
                        "that fits --max-minutes (deterministic: same as rerunning with --steps <chosen>)")
    p.add_argument("--auto-steps-at", type=int, default=40)
    p.add_argument("--end-reserve", type=float, default=25.0, help="seconds kept for the export at the end")
    p.add_argument("--ckpt-every", type=int, default=0, help="save the train state every N steps (0: at stop)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny config, few steps, CPU-sized")
    p.add_argument("--summary", default=None, help="summary JSON path (default <work>/summary.json)")
    return p.parse_args(argv)


def load_tokens(data_dir: str, smoke: bool):
    """(train, heldout) int32 token streams; cached in the data dir keyed by the tokenizer's sha256."""
    from v4jax.training import data as D
    tok_path = os.path.join(D.DEFAULT_MODEL_DIR, "tokenizer.json")
    have = os.path.exists(os.path.join(data_dir, "train.txt"))
    if not have:
        if not smoke:
            raise SystemExit(f"no {data_dir}/train.txt: run scripts/prepare_shakespeare.py first")
        from v4jax.training.train import synthetic_tokens
        toks = synthetic_tokens(60_000, 2048, seed=0)
        return toks[:50_000], toks[50_000:], "synthetic"
    sha = hashlib.sha256(open(tok_path, "rb").read()).hexdigest()[:16]
    cache = os.path.join(data_dir, f"tokens_{sha}.npz")
    if os.path.exists(cache):
        z = np.load(cache)
        return z["train"], z["heldout"], cache
    tok = D.load_tokenizer(tok_path)
    train_text, held_text = D.load_split(data_dir)
    train = D.encode_corpus(tok, train_text)
    held = D.encode_corpus(tok, held_text)
    try:
        np.savez(cache + ".tmp.npz", train=train, heldout=held)
        os.replace(cache + ".tmp.npz", cache)
    except OSError:
        pass
    return train, held, "encoded"


def main(argv=None):
    args = parse_args(argv)
    import jax
    from v4jax.training import data as D
    from v4jax.training.train import (Trainer, count_params, default_model_config, default_train_config,
                             smoke_model_config, smoke_train_config)

    os.makedirs(args.work, exist_ok=True)
    train_tokens, held_tokens, source = load_tokens(args.data, args.smoke)
    if args.smoke:
        cfg = smoke_model_config(2048)
        base = smoke_train_config()
        if args.eval_windows == 256:
            args.eval_windows = 16
    else:
        cfg = default_model_config()
        base = default_train_config()
    over = dict(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, peak_lr=args.lr,
                warmup_steps=args.warmup, mtp_weight=args.mtp_weight, indexer_weight=args.indexer_weight,
                bias_update_rate=args.bias_update_rate, compute_dtype=args.compute_dtype)
    tc = base.__class__(**{**base.to_dict(), **{k: v for k, v in over.items() if v is not None},
                           "seed": args.seed})

    dev = jax.devices()[0]
    print(f"[train] jax {jax.__version__} on {dev.platform}:{dev.device_kind}; data {source}: "
          f"{len(train_tokens)} train / {len(held_tokens)} held-out tokens", flush=True)
    counts = count_params(cfg)
    print(f"[train] params {counts}; {tc}", flush=True)

    t0 = time.time()
    trainer = Trainer(cfg, tc)
    state_path = os.path.join(args.work, "train_state.npz")
    if os.path.exists(state_path) and not args.no_resume:
        trainer.restore(state_path)
        print(f"[train] resumed from {state_path} at step {trainer.step_count} of {trainer.tc.steps}", flush=True)
    t_init = time.time() - t0

    T = tc.seq_len
    per_epoch = D.batches_per_epoch(len(train_tokens), T + 1, tc.batch_size)
    stream = D.batches(train_tokens, T + 1, tc.batch_size, seed=tc.seed, start_step=trainer.step_count)

    def held_windows():
        n = 0
        for w in D.eval_batches(held_tokens, T + 1, tc.batch_size):
            w = w[: max(0, args.eval_windows - n)]
            if len(w) == 0:
                return
            n += len(w)
            if len(w) < tc.batch_size:  # keep one compiled shape: pad with repeats, counted out below
                return
            yield w

    log_path = os.path.join(args.work, "log.jsonl")
    log = open(log_path, "a")
    budget = None if args.max_minutes is None else args.max_minutes * 60.0
    auto_at = None
    if args.auto_steps:
        if budget is None:
            raise SystemExit("--auto-steps needs --max-minutes")
        auto_at = args.auto_steps_at
        if trainer.step_count >= auto_at:
            auto_at = None  # resumed past the decision: keep the run's own step count
        elif auto_at >= tc.warmup_steps:
            raise SystemExit("--auto-steps-at must fall inside the warmup (the schedule must not depend on it)")
    compile_s = None
    timed_steps, timed_s = 0, 0.0
    stopped_early = False
    last = None
    evals = []
    auto = None
    t_mark = time.time()
    steps_since_mark = 0

    def run_eval(s):
        t_e = time.time()
        ev = trainer.evaluate(held_windows())
        ev.update(step=s, seconds=time.time() - t_e)
        print(f"[eval] step {s} held-out loss {ev['loss']:.4f} ppl {np.exp(ev['loss']):.2f} "
              f"mtp top1 {ev['mtp_top1']:.3f} ({ev['tokens']} tokens, {ev['seconds']:.1f}s)", flush=True)
        return ev

    while trainer.step_count < trainer.tc.steps:
        if budget is not None and compile_s is not None:
            per_step = timed_s / timed_steps if timed_steps else 1.0
            reserve = args.end_reserve + args.log_every * per_step
            if time.time() - T_START + reserve > budget:
                stopped_early = True
                break
        batch = next(stream)
        t_step = time.time()
        m = trainer.step(batch)
        s = trainer.step_count
        if compile_s is None:
            jax.block_until_ready(m)
            compile_s = time.time() - t_step
            t_mark, steps_since_mark = time.time(), 0
            print(f"[train] first step (compile + run) {compile_s:.1f}s", flush=True)
        else:
            steps_since_mark += 1
        if s % args.log_every == 0 or s == trainer.tc.steps or s == 1 or s == auto_at:
            m = jax.device_get(m)
            now = time.time()
            if steps_since_mark:
                timed_steps += steps_since_mark
                timed_s += now - t_mark
            t_mark, steps_since_mark = now, 0
            rec = {k: (float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()) for k, v in m.items()}
            rec.update(step=s, epoch=s / per_epoch, elapsed=now - T_START)
            last = rec
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"[train] step {s} ep {s / per_epoch:.2f} loss {rec['loss']:.4f} ce {rec['ce']:.4f} "
                  f"mtp {rec['mtp_ce']:.4f} idx_kl {rec['idx_kl']:.4f} recall {rec['idx_recall']:.3f} "
                  f"maxload {rec['max_load']:.2f} gnorm {rec['grad_norm']:.2f} lr {rec['lr']:.2e} "
                  f"t {now - T_START:.0f}s", flush=True)
            if not np.isfinite(rec["loss"]):
                raise SystemExit("loss is not finite")
        if s == auto_at:
            # Fix the step count from the measured step and eval times; still inside the warmup, so the run is
            # identical to one started with --steps <chosen> (the summary records it).
            per_step = timed_s / timed_steps
            ev = run_eval(s)  # compiles the eval
            evals.append(ev)
            t_ev = time.time()
            run_eval(s)  # steady-state eval cost
            eval_s = time.time() - t_ev
            remaining = budget - (time.time() - T_START) - args.end_reserve
            per = per_step + (eval_s / args.eval_every if args.eval_every else 0.0)
            fit = s + int((0.95 * remaining - eval_s) / per)
            chosen = max(s + 1, min(trainer.tc.steps, fit // 10 * 10))
            auto = dict(at_step=s, step_s=per_step, eval_s=eval_s, remaining_s=remaining, fit=fit,
                        max_steps=trainer.tc.steps, chosen=chosen)
            trainer.set_total_steps(chosen)
            print(f"[train] auto steps: {per_step * 1e3:.1f} ms/step, eval {eval_s:.1f}s, {remaining:.0f}s left "
                  f"-> {fit} fit, running {chosen} steps (reproduce with --steps {chosen})", flush=True)
            log.write(json.dumps({"auto_steps": auto}) + "\n")
            t_mark, steps_since_mark = time.time(), 0
            continue
        if args.eval_every and (s % args.eval_every == 0 or s == trainer.tc.steps):
            ev = run_eval(s)
            evals.append(ev)
            log.write(json.dumps({"eval": ev}) + "\n")
            log.flush()
            t_mark, steps_since_mark = time.time(), 0  # keep eval time out of the step timing
        if args.ckpt_every and s % args.ckpt_every == 0:
            trainer.save(state_path)
    log.close()

    step_s = timed_s / max(timed_steps, 1) if timed_steps else None
    summary = dict(
        device=f"{dev.platform}:{dev.device_kind}", jax=jax.__version__, data=source,
        cfg=cfg.to_hf_dict(), train=trainer.tc.to_dict(), params=counts, auto_steps=auto,
        train_tokens=int(len(train_tokens)), heldout_tokens=int(len(held_tokens)),
        steps_done=trainer.step_count, epochs_done=trainer.step_count / per_epoch, stopped_early=stopped_early,
        init_s=t_init, first_step_s=compile_s, step_s=step_s,
        tokens_per_s=(tc.batch_size * T / step_s) if step_s else None, tokens_per_step=tc.batch_size * T,
        last=last, evals=evals,
    )
    if stopped_early or args.ckpt_every:
        t_s = time.time()
        trainer.save(state_path)
        summary["save_s"] = time.time() - t_s
        print(f"[train] saved train state at step {trainer.step_count} -> {state_path}", flush=True)
    try:
        summary["peak_device_bytes"] = int(dev.memory_stats().get("peak_bytes_in_use", 0))
    except Exception:  # CPU backends may have no memory stats
        pass
    if args.export:  # also after an early stop (a later call resumes and exports again)
        t_x = time.time()
        export(trainer, args.export)
        summary["export_s"] = time.time() - t_x
        print(f"[train] exported -> {args.export}", flush=True)
    summary["total_s"] = time.time() - T_START
    out = args.summary or os.path.join(args.work, "summary.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    timing = f"step {step_s * 1e3:.1f} ms, {summary['tokens_per_s']:.0f} tok/s" if step_s else "no timed steps"
    print(f"[train] done: {trainer.step_count} steps, {timing}, total {summary['total_s']:.0f}s; "
          f"summary -> {out}", flush=True)
    return summary


def export(trainer, out_dir: str) -> None:
    """config.json + model.safetensors in official names (bf16 weights, f32 where the release keeps f32)."""
    from v4jax.training import data as D
    tensors = trainer.official_tensors()
    try:
        from checkpoints import write_official_checkpoint
        write_official_checkpoint(out_dir, trainer.cfg, tensors, fp8=False, fp4_experts=False, bf16=True,
                                  mtp=True, overwrite=True)
    except ImportError:  # the writer not there: plain safetensors in official names
        import ml_dtypes
        from safetensors.numpy import save_file
        os.makedirs(out_dir, exist_ok=True)
        out = {}
        for k, v in tensors.items():
            if v.dtype == np.int32:
                out[k] = v.astype(np.int64)
            elif v.ndim >= 2 and not k.split(".")[-1].startswith("hc_"):
                out[k] = v.astype(ml_dtypes.bfloat16)
            else:
                out[k] = v.astype(np.float32)
        save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        conf = trainer.cfg.to_hf_dict()
        conf["dtype"] = "bfloat16"
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(conf, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(D.DEFAULT_MODEL_DIR, name)
        dst = os.path.join(out_dir, name)
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)


if __name__ == "__main__":
    main()
