"""Sampling parameters (vLLM's defaults) and the on-device sampler.

Sampling parameters enter jitted code as arrays, never as static arguments, so changing them does not
recompile. Keys are fold_in(fold_in(key(seed), request_index), token_index): a seeded request draws the
same tokens whatever else shares its batch."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
INT32_LIMIT = 2**31


def _is_int(x) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _int(name: str, x, lo: int | None = None, hi: int | None = None, what: str = "") -> int:
    if not _is_int(x) or (lo is not None and x < lo) or (hi is not None and x >= hi):
        raise ValueError(f"{name} must be an integer {what}".rstrip() + f", got {x!r}")
    return int(x)


def _token_ids(name: str, ids) -> tuple[int, ...]:
    """A list / tuple (or 1-D integer array) of token ids in [0, 2**31) -> a tuple of ints."""
    if ids is None:
        return ()
    if isinstance(ids, np.ndarray) and ids.ndim == 1:
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple, range)):
        raise ValueError(f"{name} must be a list of token ids (integers in [0, 2**31)), got {ids!r}")
    bad = [t for t in ids if not (_is_int(t) and 0 <= t < INT32_LIMIT)]
    if bad:
        raise ValueError(f"{name} must be a list of token ids (integers in [0, 2**31)); invalid entries: "
                         f"{bad[:5]!r}")
    return tuple(int(t) for t in ids)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    logprobs: bool = False
    ignore_eos: bool = False

    def __post_init__(self):
        # Every check runs here, at construction: a bad value never reaches the engine (where it would fail
        # late, e.g. as an int32 overflow) or gets silently coerced (a string of digits, a float token id).
        object.__setattr__(self, "max_tokens", _int("max_tokens", self.max_tokens, lo=1, what=">= 1"))
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_k", _int("top_k", self.top_k, lo=-1, what=">= 0 (0 or -1 = off)"))
        if self.seed is not None:
            object.__setattr__(self, "seed", _int("seed", self.seed, lo=-INT32_LIMIT, hi=INT32_LIMIT,
                                                  what="in [-2**31, 2**31) (seeds are int32 on device)"))
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        for name in ("logprobs", "ignore_eos"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {v!r}")
            object.__setattr__(self, name, bool(v))

    def resolved_seed(self) -> int:
        """The request's seed; a fresh random one when unset."""
        if self.seed is not None:
            return self.seed
        return int(np.random.default_rng().integers(0, 2**31 - 1))


def request_key(seed, request_index, token_index):
    """The key for one sampled token: fold_in(fold_in(key(seed), request_index), token_index)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), request_index), token_index)


def sample(logits, temperature, top_p, top_k, seeds, request_index, token_index, any_sampled: bool):
    """One token per row. logits [B, V] f32; temperature/top_p [B] f32, top_k [B] int32 (0 = off),
    seeds/request_index/token_index [B] int32. Returns (tokens [B] int32, logprobs [B] f32), logprobs being
    log-softmax of the raw logits at the chosen token. temperature == 0 is greedy (ties: lower index).
    any_sampled: whether some row has temperature > 0 (False: no full-vocabulary sort). The caller knows: a
    device-side branch (`lax.cond`) would copy its predicate to the host and wait there on GPU."""
    logits = logits.astype(F32)
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        order = jnp.argsort(-logits, axis=-1, stable=True)  # descending; ties keep the lower index first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        scaled = sorted_logits / jnp.maximum(temperature, 1e-6)[:, None]
        rank = jnp.arange(v)[None, :]
        k = jnp.where(top_k > 0, top_k, v)[:, None]
        keep = rank < k
        probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
        cum_before = jnp.cumsum(probs, axis=-1) - probs
        keep = keep & (cum_before < top_p[:, None])  # the smallest prefix whose mass reaches top_p
        masked = jnp.where(keep, scaled, -jnp.inf)
        keys = jax.vmap(request_key)(seeds, request_index, token_index)
        choice = jax.vmap(jax.random.categorical)(keys, masked)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

    tokens = jnp.where(temperature > 0, sampled(), greedy) if any_sampled else greedy
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
