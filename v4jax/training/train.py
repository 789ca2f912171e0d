"""Training the embedded default model: a small DeepSeek-V4 with every architectural feature switched on.

    from v4jax.training.train import Trainer, default_model_config, default_train_config
    trainer = Trainer(default_model_config(), default_train_config(steps=1800))
    for step, batch in ...: metrics = trainer.step(batch)

Objective (per batch of windows of seq_len + 1 tokens; x = window[:-1]):
  * next-token cross-entropy of the main head;
  * `mtp_weight` x the MTP head's cross-entropy: position i (main streams at i + embedding of token i+1)
    predicts token i+2 (reference §7);
  * `indexer_weight` x KL(target || indexer) per CSA layer, averaged: the target is each query's attention mass
    over the causal compressed entries under dense attention (summed over heads, normalised, stop-gradient),
    the indexer side is the log-softmax of the Lightning Indexer's scores over the same entries; rows that have
    no compressed entry yet (t < ratio - 1) are masked out. The indexer's parameters get gradients only from
    this term (its top-k is not differentiable); Adam makes their step size independent of the weight, so the
    weight only sets how much the distillation pulls on the shared trunk (qr, x).
MoE load balance: auxiliary-loss-free, as in DeepSeek-V3/V4: after each step every top-k-routed gate's
selection bias moves by `bias_update_rate * sign(mean load - load_e)` (the bias gets no gradient: it only
affects selection). Hash-routed layers use their fixed token -> experts table.
Mixed precision: float32 master weights and AdamW state; the forward runs with the parameters cast to the
dtypes of a `compute_dtype` model (bfloat16 on GPU: norms, mHC, router, compressor stay float32 as in the
model), gradients arrive in float32.
Deterministic given the seed: init from `nnx.Rngs(seed)`, batches from `v4jax.training.data.batches(seed)`, no dropout;
on GPU set XLA_FLAGS=--xla_gpu_deterministic_ops=true before importing jax (scripts/train_default_model.py
does).
Checkpoints: one `.npz` holding the float32 parameters (official-ish dotted model paths), the optimizer
state leaves and the step; `Trainer.restore` checks shapes and resumes the data stream at that step.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from v4jax.config import CSA, HCA, SLIDING, ModelConfig, layer_stacks
from v4jax.model import IndexerAux, RoutingAux, RunOptions, Transformer

F32 = jnp.float32


# ---- configs ---------------------------------------------------------------------------------------
def default_model_config() -> ModelConfig:
    """The shipped default model (16.2M parameters, 33 MB in bf16; about 8M active per token).

    Six layers: a sliding layer (hash-routed MoE), then CSA (ratio 4, indexer top-16 of up to 128 entries at
    T=512) and HCA (ratio 16, up to 32 entries) alternating, all with a 32-token window, so at T=512 most of
    the context is reachable only through compressed entries. mHC with 4 streams, 8 routed experts (2 active)
    + 1 shared, one sliding MTP layer. YaRN on the compressed layers with factor 4 over an original length of
    512 (nominal context 2048)."""
    return ModelConfig(
        vocab_size=2048, dim=256, n_layers=6, n_heads=8, head_dim=64, rope_head_dim=16, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, window_size=32,
        layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA), compress_ratios=(0, 4, 16, 4, 16, 4),
        index_n_heads=16, index_head_dim=32, index_topk=16,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=256,
        n_hash_layers=1, route_scale=1.5, hc_mult=4,
        rope_factor=4.0, original_seq_len=512, max_seq_len=4096,
        n_mtp_layers=1, bos_token_id=0, eos_token_id=1)


def smoke_model_config(vocab_size: int = 2048) -> ModelConfig:
    """A tiny config with the same features (sliding, CSA + indexer with 16 heads, HCA, hash + top-k MoE, mHC,
    MTP) for the CPU smoke run."""
    return ModelConfig(
        vocab_size=vocab_size, dim=64, n_layers=3, n_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=32,
        o_groups=2, o_lora_rank=32, window_size=8, layer_types=(SLIDING, CSA, HCA),
        compress_ratios=(0, 4, 16), index_n_heads=16, index_head_dim=16, index_topk=4,
        n_routed_experts=4, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=64, n_hash_layers=1,
        route_scale=1.5, rope_factor=4.0, original_seq_len=64, max_seq_len=1024)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 512  # model input length T (windows of T + 1 tokens)
    batch_size: int = 32
    steps: int = 2000
    peak_lr: float = 2e-3
    warmup_steps: int = 100
    end_lr_frac: float = 0.1  # cosine decays to peak_lr * end_lr_frac at `steps`
    weight_decay: float = 0.1  # on matrices only (ndim >= 2)
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    indexer_weight: float = 0.01
    bias_update_rate: float = 1e-3
    seed: int = 0
    compute_dtype: str = "bfloat16"  # "float32" | "bfloat16"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_train_config(**kw) -> TrainConfig:
    """The shipped model's run: batches of 32 x 512 tokens, AdamW (0.9, 0.95, wd 0.1), peak 1.5e-3 after 100
    warmup steps, cosine to 10%; the step count is the run's (scripts/train_default_model.py --steps)."""
    return TrainConfig(**{**dict(peak_lr=1.5e-3, steps=1800, bias_update_rate=1e-2), **kw})


def smoke_train_config(**kw) -> TrainConfig:
    """The CPU smoke run: float32, short sequences, a high learning rate."""
    return TrainConfig(**{**dict(seq_len=64, batch_size=8, steps=40, peak_lr=3e-3, warmup_steps=5,
                                 compute_dtype="float32", indexer_weight=0.05, bias_update_rate=1e-2), **kw})


# ---- helpers ---------------------------------------------------------------------------------------
def path_key(path) -> str:
    return ".".join(str(p) for p in path)


def routed_bias_keys(cfg: ModelConfig, mtp: bool = True) -> list[str]:
    """Parameter keys of the top-k gates' selection biases ([n_topk, E] per layer stack with top-k layers, then [E]
    of the MTP block), in the order of the loads `forward_with_aux` returns."""
    keys = [f"stacks.{g}.ffn.gate.bias" for g, st in enumerate(layer_stacks(cfg).stacks) if st.n_topk]
    if mtp and cfg.n_mtp_layers and not cfg.is_hash_layer(cfg.n_layers):
        keys.append("mtp.0.block.ffn.gate.bias")
    return keys


def _capture(fn, *types):
    """nnx.capture where this Flax has it (0.12+); else call and pop the sown values from the model."""
    if hasattr(nnx, "capture"):
        return nnx.capture(fn, *types)

    def run(model, *args):
        out = fn(model, *args)
        return (out, *(nnx.pop(model, t) for t in types))
    return run


def _values(state, name: str) -> list:
    """The values sown under `name` at the top of a captured State (a tuple of sow calls)."""
    for path, var in nnx.to_flat_state(state):
        if tuple(path) == (name,):
            return list(var.get_value())
    return []


def forward_with_aux(model: Transformer, x, opts: RunOptions, mtp: bool = True):
    """Full forward (and the MTP head when `mtp`) with the auxiliary outputs: returns (logits, mtp logits or
    None, indexer aux: a list of (logp, target) [B, T, S] per CSA layer, routing: a list of expert choices
    [n_topk, B*T, k] per routed_bias_keys entry)."""

    def run(m, x):
        logits, streams = m(x, opts, return_streams=True)
        return logits, (m.mtp_logits(streams, x, opts) if mtp else None)

    (logits, mtp_logits), iaux, raux = _capture(run, IndexerAux, RoutingAux)(model, x)
    indexer = [(lp[i], tg[i]) for lp, tg in _values(iaux, "indexer_aux") for i in range(lp.shape[0])]
    routing = [r for stacked in _values(raux, "routing") for r in stacked] + _values(raux, "mtp_routing")
    return logits, mtp_logits, indexer, routing


def cross_entropy(logits, targets):
    """Mean and per-token cross-entropy; logits [..., V] f32, targets [...] int."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = logz - tgt
    return jnp.mean(nll), nll


def indexer_terms(logp, target, topk: int):
    """KL(target || indexer) per row and the fraction of the target mass the indexer's top-k covers.
    logp, target [B, T, S]. Returns (kl mean over rows with target mass, recall mean over those rows)."""
    has = jnp.sum(target, axis=-1) > 0.5  # rows with at least one causal compressed entry
    kl_rows = jnp.sum(jax.scipy.special.xlogy(target, target) - target * logp, axis=-1)
    n = jnp.maximum(jnp.sum(has), 1)
    kl = jnp.sum(jnp.where(has, kl_rows, 0.0)) / n
    k = min(topk, logp.shape[-1])
    _, idx = jax.lax.top_k(logp, k)  # masked entries sit at ~-1e30, so they come last
    covered = jnp.sum(jnp.take_along_axis(target, idx, axis=-1), axis=-1)
    recall = jnp.sum(jnp.where(has, covered, 0.0)) / n
    return kl, recall


# ---- the trainer -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the jitted step depends on besides arrays (hashable: one compile per distinct run setup)."""
    graphdef: Any
    cfg: ModelConfig
    tc: TrainConfig
    paths: tuple

    def state(self, params: dict, dtype=None) -> nnx.State:
        dtypes = compute_dtypes(self.cfg, dtype) if dtype is not None else None
        items = []
        for p in self.paths:
            v = params[path_key(p)]
            if dtypes is not None:
                v = v.astype(dtypes[path_key(p)])
            items.append((p, nnx.Param(v)))
        return nnx.from_flat_state(items)

    def optimizer(self, params: dict):
        """AdamW without its learning rate (the step scales the update by the host-computed `lr_at`), so the
        total step count is not compiled in and can be fixed after the first steps (--auto-steps)."""
        tc = self.tc
        decay_mask = {k: v.ndim >= 2 for k, v in params.items()}
        return optax.chain(
            optax.clip_by_global_norm(tc.grad_clip),
            optax.scale_by_adam(b1=tc.b1, b2=tc.b2),
            optax.add_decayed_weights(tc.weight_decay, mask=decay_mask))


def lr_at(tc: TrainConfig, step: int) -> float:
    """Linear warmup from 0 over warmup_steps, then cosine to peak_lr * end_lr_frac at tc.steps (float64 on the
    host). Before warmup ends the value does not depend on tc.steps."""
    peak, w, n = tc.peak_lr, tc.warmup_steps, max(tc.steps, tc.warmup_steps + 1)
    if step < w:
        return peak * step / w
    frac = min(max((step - w) / (n - w), 0.0), 1.0)
    end = peak * tc.end_lr_frac
    return end + (peak - end) * 0.5 * (1.0 + np.cos(np.pi * frac))


@functools.lru_cache(maxsize=None)
def compute_dtypes(cfg: ModelConfig, dtype) -> dict:
    """Parameter dtypes of the model built in `dtype` (bf16 matrices; norms, mHC, router biases, ape f32)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), mtp=True))
    return {path_key(p): v.get_value().dtype for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}


def _loss(st: _Static, params, buffers, tokens):
    cfg, tc = st.cfg, st.tc
    x, y = tokens[:, :-1], tokens[:, 1:]
    model = nnx.merge(st.graphdef, st.state(params, tc.compute_dtype), buffers)
    logits, mtp_logits, aux, routed = forward_with_aux(model, x, RunOptions(indexer_aux=True, routing_aux=True))
    ce, _ = cross_entropy(logits, y)
    mtp_ce, _ = cross_entropy(mtp_logits, y[:, 1:])
    if aux:
        terms = [indexer_terms(lp, tg, cfg.index_topk) for lp, tg in aux]
        idx_kl = sum(t[0] for t in terms) / len(terms)
        idx_recall = sum(t[1] for t in terms) / len(terms)
    else:
        idx_kl = idx_recall = jnp.zeros((), F32)
    loss = ce + tc.mtp_weight * mtp_ce + tc.indexer_weight * idx_kl
    e = cfg.n_routed_experts

    def load(idx):  # [..., M, k] -> [..., E]: each expert's share of the routed tokens, x E (1 = balanced)
        flat = idx.reshape(*idx.shape[:-2], -1)
        return jax.vmap(lambda i: jnp.bincount(i, length=e))(flat.reshape(-1, flat.shape[-1])).reshape(
            *flat.shape[:-1], e).astype(F32) * e / flat.shape[-1]

    loads = [load(r) for r in routed]  # one per routed_bias_keys entry: [n_topk, E] per stack, [E] for MTP
    return loss, dict(loss=loss, ce=ce, mtp_ce=mtp_ce, idx_kl=idx_kl, idx_recall=idx_recall, loads=loads)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def _train_step(st: _Static, params, opt_state, buffers, tokens, lr):
    (_, m), grads = jax.value_and_grad(_loss, argnums=1, has_aux=True)(st, params, buffers, tokens)
    updates, opt_state = st.optimizer(params).update(grads, opt_state, params)
    params = dict(optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates)))
    loads = m.pop("loads")
    # auxiliary-loss-free balance: nudge each top-k gate's selection bias toward equal expert loads
    for k, ld in zip(routed_bias_keys(st.cfg), loads):
        params[k] = params[k] + st.tc.bias_update_rate * jnp.sign(1.0 - ld)
    m["grad_norm"] = optax.tree.norm(grads)
    m["max_load"] = jnp.max(jnp.stack([jnp.max(ld) for ld in loads])) if loads else jnp.zeros((), F32)
    return params, opt_state, m


@functools.partial(jax.jit, static_argnums=(0, 4))
def _eval_step(st: _Static, params, buffers, tokens, drop_compressed: bool = False):
    x, y = tokens[:, :-1], tokens[:, 1:]
    model = nnx.merge(st.graphdef, st.state(params, st.tc.compute_dtype), buffers)
    logits, streams = model(x, RunOptions(drop_compressed=drop_compressed), return_streams=True)
    _, nll = cross_entropy(logits, y)
    mtp_logits = model.mtp_logits(streams, x)
    _, mtp_nll = cross_entropy(mtp_logits, y[:, 1:])
    return nll, mtp_nll, jnp.argmax(mtp_logits, -1) == y[:, 1:]


class Trainer:
    """Float32 master parameters (a dict keyed by dotted model path), the optimizer state, the step count."""

    def __init__(self, cfg: ModelConfig, tc: TrainConfig):
        self.cfg, self.tc = cfg, tc
        model = Transformer(cfg, rngs=nnx.Rngs(tc.seed), dtype=F32, mtp=True)
        graphdef, params, self.buffers = nnx.split(model, nnx.Param, ...)
        flat = list(nnx.to_flat_state(params))
        # the step count is not part of the compiled step (the learning rate is an argument)
        self.static = _Static(graphdef, cfg, dataclasses.replace(tc, steps=0), tuple(tuple(p) for p, _ in flat))
        self.params = {path_key(p): v.get_value() for p, v in flat}
        self.opt_state = self.static.optimizer(self.params).init(self.params)
        self.step_count = 0

    def n_params(self) -> int:
        return int(sum(np.prod(v.shape) for v in self.params.values()))

    def model(self, dtype=F32):
        """A concrete Transformer from the master parameters (cast to a `dtype` model's parameter dtypes)."""
        dt = None if jnp.dtype(dtype) == F32 else dtype
        return nnx.merge(self.static.graphdef, self.static.state(self.params, dt), self.buffers)

    def set_total_steps(self, steps: int) -> None:
        """Fix the schedule's length; identical to having started with `steps` while still in warmup."""
        if self.step_count > self.tc.warmup_steps and steps != self.tc.steps:
            raise ValueError("the total step count can only change during warmup")
        self.tc = dataclasses.replace(self.tc, steps=int(steps))

    def step(self, tokens: np.ndarray) -> dict:
        """One optimizer step on a batch [B, seq_len + 1]; returns device metrics (not synced)."""
        lr = lr_at(self.tc, self.step_count)
        self.params, self.opt_state, m = _train_step(self.static, self.params, self.opt_state, self.buffers,
                                                     jnp.asarray(tokens), jnp.float32(lr))
        self.step_count += 1
        m["lr"] = lr
        return m

    def evaluate(self, windows: Iterator[np.ndarray], drop_compressed: bool = False) -> dict:
        """Mean held-out loss (and MTP loss / top-1) over windows [b, seq_len + 1]."""
        tot = mtot = hits = 0.0
        n = mn = 0
        for w in windows:
            nll, mtp_nll, hit = jax.device_get(_eval_step(self.static, self.params, self.buffers,
                                                          jnp.asarray(w), drop_compressed))
            tot += float(np.sum(nll, dtype=np.float64))
            n += nll.size
            mtot += float(np.sum(mtp_nll, dtype=np.float64))
            hits += float(np.sum(hit))
            mn += hit.size
        return dict(loss=tot / max(n, 1), mtp_loss=mtot / max(mn, 1), mtp_top1=hits / max(mn, 1), tokens=n)

    # -- checkpoint / resume --
    def save(self, path: str, extra: dict | None = None) -> None:
        arrays = {f"param/{k}": np.asarray(jax.device_get(v)) for k, v in self.params.items()}
        for i, leaf in enumerate(jax.tree.leaves(self.opt_state)):
            arrays[f"opt/{i:05d}"] = np.asarray(jax.device_get(leaf))
        meta = dict(step=self.step_count, cfg=self.cfg.to_hf_dict(), train=self.tc.to_dict(), **(extra or {}))
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        tmp = path + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)

    def restore(self, path: str) -> dict:
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            diff = {k: (meta["train"].get(k), v) for k, v in self.tc.to_dict().items()
                    if meta["train"].get(k) != v and k != "steps"}
            if diff:
                raise ValueError(f"checkpoint {path} was made with another TrainConfig: {diff}")
            params = {}
            for k, v in self.params.items():
                a = z[f"param/{k}"]
                if a.shape != v.shape:
                    raise ValueError(f"{k}: checkpoint shape {a.shape} != model {v.shape}")
                params[k] = jnp.asarray(a, v.dtype)
            leaves, treedef = jax.tree.flatten(self.opt_state)
            new = []
            for i, leaf in enumerate(leaves):
                a = z[f"opt/{i:05d}"]
                if a.shape != np.shape(leaf):
                    raise ValueError(f"optimizer leaf {i}: checkpoint shape {a.shape} != {np.shape(leaf)}")
                new.append(jnp.asarray(a, jnp.asarray(leaf).dtype))
        self.params = params
        self.opt_state = jax.tree.unflatten(treedef, new)
        self.step_count = int(meta["step"])
        self.tc = dataclasses.replace(self.tc, steps=int(meta["train"]["steps"]))  # the run's own schedule
        return meta

    def official_tensors(self) -> dict[str, np.ndarray]:
        """Every tensor under its official checkpoint name (float32; tid2eid int32)."""
        from v4jax.model.weights import model_to_official
        return model_to_official(self.model())


def count_params(cfg: ModelConfig, mtp: bool = True) -> dict:
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=F32, mtp=mtp))
    total = experts = mtp_n = 0
    for p, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        n = int(np.prod(v.get_value().shape))
        total += n
        if "experts" in p and "shared_experts" not in p:
            experts += n
        if p[0] == "mtp":
            mtp_n += n
    return dict(total=total, routed_experts=experts, mtp=mtp_n)


def synthetic_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """A learnable stand-in corpus for the smoke run when no prepared data is around: a fixed random
    second-order Markov chain over a small alphabet, with BOS/EOS-delimited documents."""
    rng = np.random.default_rng(seed)
    alpha = min(vocab - 2, 64)
    nxt = rng.integers(0, alpha, size=(alpha, alpha, 3))
    out = np.empty(n, np.int32)
    a, b = 0, 1
    i = 0
    while i < n:
        if i % 700 == 0:
            out[i] = 0  # BOS
            i += 1
            continue
        c = int(nxt[a, b, rng.integers(0, 3)])
        out[i] = c + 2
        a, b = b, c
        i += 1
    return out
