"""A DSpark-style drafter for the embedded default model, trained against the frozen model.

    python -m v4jax.training.dspark --data data/shakespeare --steps 600 --out /tmp/default_dspark
    v4jax bench spec --model /tmp/default_dspark --method dspark --k 1,2,3

The drafter is the 0731 release's (v4jax.engine.dspark says what it computes): `--stages` sliding-window draft
layers over the mean streams of the target layers, a block of the next token and `--block - 1` noise tokens,
the Markov bias and the confidence head. The target (the default model, main layers and head) stays as it is;
only the draft layers (`mtp.N.*`) learn, through the same functions the speculative decode call runs
(`Transformer.dspark_keys`, `dspark_streams`, `dspark_head`), so what is trained is what drafts.

Objective, per window of tokens x [B, T] and A anchors a (positions the target has processed; the same for every
row of a batch, drawn at random): the block [x[a+1], noise, ...] at positions a+1 .., the window keys of positions
a-W+1 .. a; draft j (block row j, Markov bias of x[a+1+j], teacher-forced) is trained towards the target's
distribution at position a+1+j (cross-entropy against its softmax: greedy speculation accepts a draft when it is
the target's argmax there). Reported: that loss, and top-1 agreement with the target's argmax by draft position
(held out: the acceptance a draft would have after right drafts before it).
Not trained: the confidence head (the decode call computes it but keeps every draft) and the routed experts'
selection biases (no balance term: the draft layers are a small share of a step)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from v4jax.config import ModelConfig
from v4jax.model import RunOptions, Transformer
from v4jax.training.data import BOS_ID

F32 = jnp.float32


def drafter_config(cfg: ModelConfig, stages: int = 1, block: int = 4, rank: int = 64,
                   targets: tuple[int, ...] | None = None, noise: int = BOS_ID) -> ModelConfig:
    """`cfg` with a DSpark drafter of `stages` draft layers drafting blocks of `block` tokens from the mean streams
    of main layers `targets` (default: every other layer from the second, and the last). The noise token defaults
    to BOS, which never follows a token inside a document."""
    if targets is None:
        targets = tuple(sorted(set(range(1, cfg.n_layers, 2)) | {cfg.n_layers - 1}))
    return cfg.replace(n_mtp_layers=stages, dspark_block_size=block, dspark_noise_token_id=noise,
                       dspark_target_layer_ids=tuple(targets), dspark_markov_rank=rank)


def with_drafter(target: Transformer, cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model of `cfg` (target's config with dspark_* keys) holding target's main weights and a fresh drafter."""
    from v4jax.model.weights import load_tensors, model_to_official
    model = Transformer(cfg, rngs=nnx.Rngs(seed), dtype=F32, mtp=True)
    main = {k: v for k, v in model_to_official(target).items() if not k.startswith("mtp.")}
    fresh = {k: v for k, v in model_to_official(model).items() if k.startswith("mtp.")}
    return load_tensors(model, [*main.items(), *fresh.items()])


def _is_drafter(path, value) -> bool:
    return path[0] == "mtp" and isinstance(value, nnx.Param)


@functools.partial(jax.jit, static_argnums=0)
def _teacher(graphdef, drafter, rest, x):
    """The frozen target over windows x [B, T]: (taps [B, T, n_targets * D], its next-token distribution [B, T, V])."""
    model = nnx.merge(graphdef, drafter, rest)
    return model.taps_of(x), jax.nn.softmax(model(x, RunOptions()), axis=-1)


def _drafter_loss(model: Transformer, x, taps, probs, anchors):
    """Mean cross-entropy of the drafts of blocks at `anchors` [A] against the target's distributions, and the
    drafts' top-1 agreement with the target's argmax [block]."""
    cfg = model.cfg
    b, t = x.shape
    bs, w, n = cfg.dspark_block_size, cfg.window_size, anchors.shape[0]
    keys = model.dspark_keys(taps, jnp.broadcast_to(jnp.arange(t), (b, t)))  # [S, B, T, K]
    ctx_pos = anchors[:, None] - w + 1 + jnp.arange(w)[None, :]  # [A, W]
    ctx = keys[:, :, jnp.clip(ctx_pos, 0, t - 1)].reshape(keys.shape[0], b * n, w, keys.shape[-1])
    valid = jnp.broadcast_to(ctx_pos >= 0, (b, n, w)).reshape(b * n, w)
    rows = anchors[:, None] + 1 + jnp.arange(bs)[None, :]  # [A, bs]: block positions; draft j predicts rows[j] + 1
    block = jnp.concatenate([x[:, rows[:, :1]], jnp.full((b, n, bs - 1), cfg.dspark_noise_token_id, x.dtype)], -1)
    streams = model.dspark_streams(block.reshape(b * n, bs), jnp.broadcast_to(rows, (b, n, bs)).reshape(b * n, bs),
                                   ctx, valid)
    _, base = model.dspark_head(streams)  # [B*A, bs, V]
    markov = model.mtp[-1].markov_head
    logits = base + markov.bias(markov.embed(x[:, rows].reshape(b * n, bs)))
    want = probs[:, rows].reshape(b * n, bs, -1)
    ce = -jnp.sum(want * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    top1 = jnp.argmax(logits, -1) == jnp.argmax(want, -1)
    return jnp.mean(ce), jnp.mean(top1, axis=0)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _step(graphdef, tx, drafter, opt_state, rest, x, taps, probs, anchors):
    def loss(d):
        ce, top1 = _drafter_loss(nnx.merge(graphdef, d, rest), x, taps, probs, anchors)
        return ce, top1

    (ce, top1), grads = jax.value_and_grad(loss, has_aux=True)(drafter)
    updates, opt_state = tx.update(grads, opt_state, drafter)
    return optax.apply_updates(drafter, updates), opt_state, ce, top1


@functools.partial(jax.jit, static_argnums=0)
def _eval(graphdef, drafter, rest, x, taps, probs, anchors):
    return _drafter_loss(nnx.merge(graphdef, drafter, rest), x, taps, probs, anchors)


@dataclasses.dataclass
class DrafterTrainer:
    """The drafter's parameters and Adam state; the target's parameters are held fixed beside them."""
    model: Transformer
    lr: float = 2e-3
    warmup: int = 50
    steps: int = 600
    anchors: int = 64
    seed: int = 0

    def __post_init__(self):
        self.graphdef, self.drafter, self.rest = nnx.split(self.model, _is_drafter, ...)
        schedule = optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup, max(self.steps, self.warmup + 1),
                                                      self.lr * 0.1)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
        self.opt_state = self.tx.init(self.drafter)
        self.rng = np.random.default_rng(self.seed)
        self.step_count = 0

    def _anchors(self, t: int, rng) -> jax.Array:
        hi = t - self.model.cfg.dspark_block_size - 1  # the last block's last row is position t - 1
        return jnp.asarray(np.sort(rng.choice(hi + 1, min(self.anchors, hi + 1), replace=False)), jnp.int32)

    def step(self, x: np.ndarray) -> tuple[float, np.ndarray]:
        x = jnp.asarray(x)
        taps, probs = _teacher(self.graphdef, self.drafter, self.rest, x)
        self.drafter, self.opt_state, ce, top1 = _step(self.graphdef, self.tx, self.drafter, self.opt_state,
                                                       self.rest, x, taps, probs, self._anchors(x.shape[1], self.rng))
        self.step_count += 1
        return float(ce), np.asarray(top1)

    def evaluate(self, windows) -> dict:
        """Held-out loss and top-1 agreement by draft position over every anchor of each window."""
        ces, tops = [], []
        for x in windows:
            x = jnp.asarray(x)
            taps, probs = _teacher(self.graphdef, self.drafter, self.rest, x)
            ce, top1 = _eval(self.graphdef, self.drafter, self.rest, x, taps, probs,
                             jnp.arange(x.shape[1] - self.model.cfg.dspark_block_size, dtype=jnp.int32))
            ces.append(float(ce))
            tops.append(np.asarray(top1))
        return {"loss": float(np.mean(ces)), "top1_by_position": np.mean(tops, axis=0).round(4).tolist()}

    def trained(self) -> Transformer:
        return nnx.merge(self.graphdef, self.drafter, self.rest)


def write(model: Transformer, out: str, tokenizer_dir: str | None = None) -> None:
    """The target with its trained drafter as a checkpoint directory in the 0731 layout (float32; the tokenizer
    files copied beside it)."""
    from checkpoints import write_official_checkpoint
    from v4jax.model.weights import model_to_official
    write_official_checkpoint(out, model.cfg, model_to_official(model), fp8=False, fp4_experts=False, bf16=False,
                              mtp=True, overwrite=True)
    if tokenizer_dir:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if os.path.exists(os.path.join(tokenizer_dir, f)):
                shutil.copy(os.path.join(tokenizer_dir, f), out)


def main(argv=None) -> int:
    from v4jax import LLM
    from v4jax.training import data as D
    p = argparse.ArgumentParser(prog="python -m v4jax.training.dspark", description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="a directory made by scripts/prepare_shakespeare.py (train.txt, "
                   "heldout.txt); default: a synthetic corpus (a smoke run)")
    p.add_argument("--model", default=None, help="the target checkpoint (default: the embedded default model)")
    p.add_argument("--out", required=True, help="write the target with its drafter here")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=64, help="blocks drafted per window in a training step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--stages", type=int, default=1, help="draft layers")
    p.add_argument("--block", type=int, default=4, help="dspark_block_size (speculative k up to this)")
    p.add_argument("--rank", type=int, default=64, help="the Markov head's rank")
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows evaluated at the end")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from v4jax.api import DEFAULT_MODEL_DIR
    llm = LLM(a.model, dtype="float32")
    target, path = llm.model, a.model or DEFAULT_MODEL_DIR
    model = with_drafter(target, drafter_config(target.cfg, a.stages, a.block, a.rank), a.seed)
    del llm
    if a.data:
        train, heldout = D.load_split(a.data)
        tok = D.load_tokenizer(path)
        train_ids, held_ids = D.encode_corpus(tok, train), D.encode_corpus(tok, heldout)
    else:
        from v4jax.training.train import synthetic_tokens
        ids = synthetic_tokens(200_000, target.cfg.vocab_size, a.seed)
        train_ids, held_ids = ids[:180_000], ids[180_000:]
    trainer = DrafterTrainer(model, lr=a.lr, steps=a.steps, anchors=a.anchors, seed=a.seed)
    t0 = time.time()
    for i, x in enumerate(D.batches(train_ids, a.seq_len, a.batch, a.seed)):
        if i == a.steps:
            break
        ce, top1 = trainer.step(x)
        if i % 50 == 0 or i == a.steps - 1:
            print(f"step {i:5d}  loss {ce:.3f}  top-1 by draft {np.round(top1, 3).tolist()}  "
                  f"{time.time() - t0:.0f} s", flush=True)
    windows = list(D.eval_batches(held_ids, a.seq_len, 1))[:a.eval_windows]
    result = dict(trainer.evaluate(windows), steps=a.steps, seconds=round(time.time() - t0, 1),
                  config={k: v for k, v in vars(a).items() if k != "out"})
    print(json.dumps(result), flush=True)
    write(trainer.trained(), a.out, path)
    with open(os.path.join(a.out, "drafter_training.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
