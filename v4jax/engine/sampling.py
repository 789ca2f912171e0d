"""Sampling parameters (vLLM's defaults) and the on-device sampler.

Sampling parameters enter jitted code as arrays, never as static arguments, so changing them does not
recompile. Keys are fold_in(fold_in(key(seed), request_index), token_index): a seeded request draws the
same tokens whatever else shares its batch."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from v4jax.fields import INT32_MAX, MAX_LOGIT_BIAS, FieldError, check_field, is_int

F32 = jnp.float32


def _token_ids(name: str, ids) -> tuple[int, ...]:
    """A list / tuple (or 1-D integer array) of token ids in [0, 2**31) -> a tuple of ints."""
    if ids is None:
        return ()
    if isinstance(ids, np.ndarray) and ids.ndim == 1:
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple, range)):
        raise ValueError(f"{name} must be a list of token ids (integers in [0, 2**31)), got {ids!r}")
    bad = [t for t in ids if not (is_int(t) and 0 <= t <= INT32_MAX)]
    if bad:
        raise ValueError(f"{name} must be a list of token ids (integers in [0, 2**31)); invalid entries: "
                         f"{bad[:5]!r}")
    return tuple(int(t) for t in ids)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping (or (id, bias) pairs) -> its pairs sorted by id: ids in [0, 2**31), biases
    finite in [-100, 100] (OpenAI's range), at most MAX_LOGIT_BIAS of them."""
    if bias is None:
        return ()
    pairs = list(bias.items()) if isinstance(bias, dict) else bias
    if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise FieldError("logit_bias", f"logit_bias must map token ids to biases, got {bias!r}"[:200])
    if len(pairs) > MAX_LOGIT_BIAS:
        raise FieldError("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
    ids = _token_ids("logit_bias", [t for t, _ in pairs])
    if len(set(ids)) != len(ids):
        raise FieldError("logit_bias", "logit_bias names a token id twice")
    vals = [check_field("logit_bias[]", v, field="logit_bias") for _, v in pairs]
    return tuple(sorted(zip(ids, vals)))


# each penalty's value that changes nothing
NEUTRAL_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


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
    # with logprobs: the N most likely tokens at each generated position and their log-probs (0..MAX_TOP_LOGPROBS;
    # vLLM's `logprobs=N`, OpenAI's `top_logprobs`), log-softmax of the raw logits like the chosen token's
    top_logprobs: int = 0
    # vLLM's min-p: tokens whose probability (after temperature) is below min_p times the most likely one's are
    # never drawn; applied before top-k and top-p, as vLLM does (0 = off)
    min_p: float = 0.0
    # OpenAI's / vLLM's logit_bias: {token id: bias in [-100, 100]} added to the logits the token is chosen from
    # (greedy included); the reported log-probs stay those of the raw logits. Held as sorted (id, bias) pairs.
    logit_bias: dict | tuple = ()
    # vLLM's min_tokens: the stop ids (EOS unless ignore_eos, and stop_token_ids) are never drawn before this many
    # tokens, and the server's stop strings count only from then on
    min_tokens: int = 0
    # OpenAI's / vLLM's penalties on the tokens chosen so far (`apply_penalties`): presence subtracts its value from the
    # logit of every token the output holds, frequency its value times the token's count there; repetition (vLLM's)
    # divides the positive logits of every token the prompt or the output holds by it and multiplies the negative
    # ones. The reported log-probs stay those of the raw logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        # Every check runs here, at construction, by the rule table (v4jax.fields: int32 bounds, finite floats,
        # real bools): a bad value never reaches the engine (where it would fail late, e.g. as an int32 overflow
        # on its thread) or gets silently coerced (a string of digits, a float token id).
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "ignore_eos", "top_logprobs",
                     "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, check_field(name, getattr(self, name)))
        if self.min_tokens > self.max_tokens:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                                           f"({self.max_tokens})")
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=True")
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def penalties(self) -> tuple[str, ...]:
        """The penalties that apply (not at their neutral value, NEUTRAL_PENALTIES)."""
        return tuple(n for n, off in NEUTRAL_PENALTIES.items() if getattr(self, n) != off)

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies (the steps of such requests run the program form with penalties)."""
        return bool(self.penalties)

    def resolved_seed(self) -> int:
        """The request's seed; a fresh random one when unset."""
        if self.seed is not None:
            return self.seed
        return int(np.random.default_rng().integers(0, 2**31 - 1))


def request_key(seed, request_index, token_index):
    """The key for one sampled token: fold_in(fold_in(key(seed), request_index), token_index)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), request_index), token_index)


def biased(logits, bias_ids, bias):
    """logits [..., V] with bias [..., N] f32 added at bias_ids [..., N] int32 (ids outside [0, V), e.g. the -1
    padding, add nothing)."""
    v = logits.shape[-1]
    onto = jnp.where((bias_ids >= 0) & (bias_ids < v), bias_ids, v)  # out of bounds: dropped by the scatter
    flat, ids, vals = logits.reshape(-1, v), onto.reshape(-1, onto.shape[-1]), bias.reshape(-1, bias.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    return flat.at[rows, ids].add(vals, mode="drop").reshape(logits.shape)


def steered(logits, sm, ahead=0):
    """What a row's token is chosen from: logits [B, V] (or [B, P, V] for P positions, `ahead` [1, P] their
    offsets from sm.token_index) with the row's logit bias added and, while its token index is below its
    min_tokens, its stop ids masked. sm: the rows' sampling state (v4jax.engine.steps.SamplingState: bias_ids /
    bias [B, N], stop_ids [B, S], min_tokens and token_index [B])."""
    extra = logits.ndim - 2  # position axes between the row and the vocabulary
    row = lambda a: a.reshape(a.shape[:1] + (1,) * extra + a.shape[1:])  # noqa: E731 - [B, ...] -> every position
    every = lambda a: jnp.broadcast_to(row(a), logits.shape[:-1] + a.shape[1:])  # noqa: E731
    held = row(sm.token_index) + ahead < row(sm.min_tokens)              # [B, (P)]
    stops = jnp.where(held[..., None], every(sm.stop_ids), -1)           # -1: adds nothing
    # one scatter for both (as the bias alone was): the stop ids' -inf after the bias columns
    ids = jnp.concatenate([every(sm.bias_ids), stops], axis=-1)
    vals = jnp.concatenate([every(sm.bias), jnp.full(stops.shape, -jnp.inf, F32)], axis=-1)
    return biased(logits.astype(F32), ids, vals)


def token_counts(v: int, tokens, seen, produced):
    """What the penalties read of each row's sequence: (held [B, V] bool: the ids its prompt or output holds,
    counts [B, V] f32: each id's count in the output). tokens [B, T] int32: the row's sequence so far (any order);
    seen [B, T] bool: the positions that hold it; produced [B, T] bool: those of them in the output."""
    b = tokens.shape[0]
    rows = jnp.arange(b)[:, None]
    ids = jnp.where(seen, tokens, v)  # out of range: dropped
    held = jnp.zeros((b, v), jnp.bool_).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((b, v), F32).at[rows, jnp.where(produced, ids, v)].add(1.0, mode="drop")
    return held, counts


def count_token(held, counts, token, seen, produced):
    """token_counts' (held, counts) with one more token a row: token [B] where seen [B], counted where produced
    [B]."""
    b, v = held.shape
    rows = jnp.arange(b)
    held = held.at[rows, jnp.where(seen, token, v)].set(True, mode="drop")
    return held, counts.at[rows, jnp.where(seen & produced, token, v)].add(1.0, mode="drop")


def apply_penalties(logits, sm, held, counts):
    """logits [B, V] f32 with each row's penalties applied (vLLM's, after the logit bias), from token_counts' (held,
    counts): the positive logits of the ids held divided by the row's repetition penalty and the negative ones
    multiplied; then its frequency penalty times each id's count in the output and its presence penalty for each id
    the output holds subtracted. sm: the rows' SamplingState (presence, frequency, repetition [B]). Neutral values
    (0, 0, 1) leave a row's logits as they are, bit for bit."""
    rep = sm.repetition[:, None]
    logits = jnp.where(held, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - (sm.frequency[:, None] * counts + sm.presence[:, None] * (counts > 0))


def sample(logits, chosen, temperature, top_p, top_k, min_p, seeds, request_index, token_index,
           any_sampled: bool, n_top: int = 0, any_cut: bool = True):
    """One token per row. logits [B, V] f32 (raw: the log-probs are theirs); chosen [B, V] what the token is chosen
    from (`steered`: the logit bias added, stop ids held back before min_tokens); temperature/top_p/min_p [B] f32,
    top_k [B] int32 (0 = off), seeds/request_index/token_index [B] int32. Returns (tokens [B] int32, logprobs [B]
    f32, top_ids [B, n_top] int32, top_logprobs [B, n_top] f32), logprobs being log-softmax of the raw logits at
    the chosen token and the top pair the n_top most likely tokens by the same log-softmax (ties: lower index
    first). temperature == 0 is greedy (ties: lower index); a sampled row draws from `kept` tokens, by its key,
    in vocabulary order (so a row draws the same token whatever the other rows of its step ask for).
    any_sampled: whether some row has temperature > 0; any_cut: whether some sampled row cuts by top_k or top_p
    (False: no full-vocabulary sort, see `kept`). The caller knows both: a device-side branch (`lax.cond`) would
    copy its predicate to the host and wait there on GPU. n_top is static for the same reason: 0 in the programs
    most steps run, MAX_TOP_LOGPROBS in those of steps where a request asked for alternatives."""
    raw = logits.astype(F32)
    logits = chosen.astype(F32)
    greedy, raw_max, raw_sum = greedy_and_normalizer(logits, raw)

    def sampled():
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        masked = jnp.where(kept(logits, scaled, top_p, top_k, min_p, any_cut), scaled, -jnp.inf)
        keys = jax.vmap(request_key)(seeds, request_index, token_index)
        return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)

    tokens = jnp.where(temperature > 0, sampled(), greedy) if any_sampled else greedy
    # log-softmax's own form, (x - max) - log(sum(exp(x - max))), from the one pass's max and sum
    log_sum = jnp.log(raw_sum)
    logprobs = (jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - raw_max) - log_sum
    top_logprobs, top_ids = top_alternatives((raw - raw_max[:, None]) - log_sum[:, None], n_top)
    return tokens, logprobs, top_ids, top_logprobs


def greedy_and_normalizer(chosen, raw):
    """(argmax of chosen [..., V] -> [...] int32, ties: the lower id; the max m [...] of raw [..., V]; the sum of
    exp(raw - m)). The argmax and the max are one reduction (a pass over (chosen, id, raw) together): as
    jnp.argmax and log-softmax's max they were two, each a two-pass reduction over a Flash row's 129,280 ids on a
    GPU. The sum stays XLA's own reduction: kept online in the same pass (a part's sum rescaled by exp(its max -
    the new max) as parts merge) it left log-softmax by up to 2e-4 on the CPU, whose reduction runs in order."""
    ids = jax.lax.broadcasted_iota(jnp.int32, chosen.shape, chosen.ndim - 1)

    def merge(a, b):
        a_val, a_id, a_max = a
        b_val, b_id, b_max = b
        take_b = (b_val > a_val) | ((b_val == a_val) & (b_id < a_id))
        return jnp.where(take_b, b_val, a_val), jnp.where(take_b, b_id, a_id), jnp.maximum(a_max, b_max)

    init = (jnp.array(-jnp.inf, F32), jnp.array(INT32_MAX, jnp.int32), jnp.array(-jnp.inf, F32))
    _, best, m = jax.lax.reduce((chosen, ids, raw), init, merge, (chosen.ndim - 1,))
    return best, m, jnp.sum(jnp.exp(raw - m[..., None]), axis=-1)


def kept(logits, scaled, top_p, top_k, min_p, any_cut: bool = True):
    """[B, V] bool in vocabulary order: the tokens a sampled row may draw. logits [B, V] f32 set the order (most
    likely first, ties: the lower id first), scaled [B, V] are them over the temperature. vLLM's order of filters:
    min-p (a token whose probability is below min_p times the most likely one's goes), then the top_k most likely
    (0: all), then the smallest prefix of those whose mass reaches top_p (top_p >= 1: all). Each keeps a prefix of
    the order, so the result is a prefix too.
    any_cut False (no row cuts by top_k or top_p): min-p alone, which needs neither a sort nor a search. With a cut,
    fewer than SEARCH_FROM_ROWS rows sort the vocabulary (`_cut_by_sort`), more search its thresholds
    (`_cut_by_search`). The two sum the top-p mass in different orders, so where a token's preceding mass lies
    within float rounding of top_p they may differ on it."""
    # p / p_max = exp(s - s_max), so compared in logits (min_p 0: log 0 = -inf keeps every token)
    s_max = jnp.max(scaled, axis=-1, keepdims=True)
    keep = scaled >= s_max + jnp.log(min_p)[:, None]
    if not any_cut:
        return keep
    cut = _cut_by_sort if logits.shape[0] < SEARCH_FROM_ROWS else _cut_by_search
    return cut(logits, scaled, s_max, keep, top_p, top_k)


# A sort of the vocabulary is a kernel of its own over [B, V] (129,280 ids a row for Flash). GPU time of the cut at
# top-p 0.9 on an H100, the sort / the search (`scripts/sampling_probe.py --forms top_p --search-from 1 | 100000`):
# 80 / 190 us at batch 1, 213 / 273 at 4, 339 / 376 at 8, 493 / 282 at 12, 627 / 340 at 16, 1,616 / 558 at 32.
# From this many rows, the search (the decode call's rows are powers of two: from 16 there).
SEARCH_FROM_ROWS = 12


def _cut_by_sort(logits, scaled, s_max, keep, top_p, top_k):
    """`kept` with a cut, by a sort of each row."""
    v = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1, stable=True)  # descending; ties keep the lower id first
    in_order = jnp.take_along_axis(keep, order, axis=-1)
    in_order &= jnp.arange(v)[None, :] < jnp.where(top_k > 0, top_k, v)[:, None]
    probs = jax.nn.softmax(jnp.where(in_order, jnp.take_along_axis(scaled, order, axis=-1), -jnp.inf), axis=-1)
    in_order &= (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) | (top_p >= 1)[:, None]
    last = jnp.take_along_axis(order, jnp.maximum(jnp.sum(in_order, axis=-1) - 1, 0)[:, None], axis=-1)  # [B, 1]
    at = jnp.take_along_axis(logits, last, axis=-1)
    return (logits > at) | ((logits == at) & (jnp.arange(v)[None, :] <= last))


def _cut_by_search(logits, scaled, s_max, keep, top_p, top_k):
    """`kept` with a cut, without a sort: the kept tokens are those from the most likely down to a threshold
    logit and, of the tokens at the threshold, the first r by id. Each filter's threshold is found by
    `_threshold`'s radix search over the logits' keys, top-k's by counts and top-p's by masses."""
    v = logits.shape[-1]
    keys = _order_keys(logits)
    weight = jnp.exp(scaled - s_max)  # each token's probability times the softmax's sum
    # top-k among the min-p survivors (a prefix of the order): the m-th key from the top, and how many of the
    # tokens at it are in (the first by id). Counts as f32 (exact below 2**24): a pass summing int32 took 30 us
    # of an H100 at batch 32, f32 22 us
    m = jnp.minimum(jnp.where(top_k > 0, top_k, v), jnp.sum(keep, axis=-1, dtype=jnp.int32))
    t_k, above_k = _threshold(keys, jnp.ones_like(weight), m.astype(F32))
    r_k = m - above_k.astype(jnp.int32)
    # top-p over those: with M(t) the mass of the kept tokens at keys >= t, the last token kept is the first by
    # which the mass before it reaches top_p of the whole: at the largest t with M(t) >= top_p * Z
    inside = jnp.where(keys > t_k[:, None], weight, 0.0)
    z, _, at_k = _sum_and_tie(inside, keys, weight, t_k)
    z = z + r_k * at_k
    t_p, above_p = _threshold(keys, inside, top_p * z, base=(t_k, r_k * at_k))
    _, n_tied, at_p = _sum_and_tie(None, keys, weight, t_p)
    # ties at t_p share one weight: the j-th of them (j from 0) is in while the mass before it is below top_p * Z
    room = jnp.ceil((top_p * z - above_p) / at_p)  # at_p 0 (underflow): inf, all of them
    r_p = jnp.clip(jnp.nan_to_num(room, posinf=v), 1, v).astype(jnp.int32)
    r_p = jnp.minimum(r_p, jnp.where(t_p == t_k, r_k, n_tied))
    # t_p < t_k only by rounding (the mass of all the kept is Z): then top-p cuts nothing
    cut_p = (top_p < 1) & (t_p >= t_k)
    t = jnp.where(cut_p, t_p, t_k)
    r = jnp.where(cut_p, r_p, r_k)
    at = keys == t[:, None]
    rank = jnp.cumsum(at, axis=-1, dtype=jnp.int32) - 1  # among the tokens at the threshold, by id
    return (keys > t[:, None]) | (at & (rank < r[:, None]))


def _sum_and_tie(x, keys, weight, t):
    """In one pass over a row: the sum of x [B, V] (None: 0), and of the tokens whose key is t [B] how many there
    are and their weight (one weight: their logits are equal)."""
    at = keys == t[:, None]
    zero = jnp.zeros((), F32)
    parts = [jnp.zeros_like(weight) if x is None else x, at.astype(jnp.int32), jnp.where(at, weight, zero)]
    return jax.lax.reduce(parts, [zero, jnp.zeros((), jnp.int32), zero],
                          lambda a, b: [a[0] + b[0], a[1] + b[1], jnp.maximum(a[2], b[2])], (1,))


# bits of the key a pass of `_threshold` decides: 15 thresholds a pass, 8 passes for a 32-bit key
RADIX_BITS = 4


def _order_keys(logits):
    """[B, V] uint32 in the order of the float logits (a larger logit, a larger key; -0.0 as +0.0)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(logits == 0, 0.0, logits).astype(F32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _threshold(keys, weight, target, base=None):
    """The largest t [B] uint32 with F(t) >= target [B], F(t) = sum of `weight` [B, V] (>= 0) over
    the keys >= t (plus base[1] [B] where t <= base[0]: the part of a tie outside `weight`), and F(t + 1). F falls
    as t rises, so t is found digit by digit from the top: a pass sums F at the 15 thresholds of the next 4 bits in
    one reduction (a variadic reduce: each key read once, every sum beside it) and keeps the largest with
    F >= target."""
    b = keys.shape[0]
    low = jnp.zeros((b,), jnp.uint32)
    above = jnp.zeros((b,), weight.dtype)  # F just past the range still searched
    zero = jnp.zeros((), weight.dtype)
    digits = jnp.arange(1, 1 << RADIX_BITS, dtype=jnp.uint32)
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        grid = low[:, None] + (digits << shift)[None, :]  # one array: XLA made 15 launches of 15 scalars
        ts = [grid[:, d] for d in range(digits.size)]
        sums = jax.lax.reduce([jnp.where(keys >= t[:, None], weight, zero) for t in ts], [zero] * len(ts),
                              lambda xs, ys: [x + y for x, y in zip(xs, ys)], (1,))
        if base is not None:
            sums = [s + jnp.where(t <= base[0], base[1], zero) for s, t in zip(sums, ts)]
        # F falls with the digit: the digit is how many of the thresholds keep F >= target; F at the next one up
        # bounds the range from above
        ok = [s >= target for s in sums]
        digit = sum(o.astype(jnp.uint32) for o in ok)
        for s, o in zip(sums, ok):
            above = jnp.where(o, above, jnp.maximum(above, s))  # the first failing threshold's F is the largest
        low = low + (digit << shift)
    return low, above


def filtered_probs(logits, temperature, top_p, top_k, min_p, any_cut: bool = True):
    """The distribution `sample` draws a row's token from: logits [B, V] f32 scaled by temperature, cut by min-p,
    top-k and top-p (`kept`). Returns [B, V] f32 in vocabulary order. Rows with temperature 0 get a near one-hot of
    the argmax (unused: they are greedy)."""
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    return jax.nn.softmax(jnp.where(kept(logits, scaled, top_p, top_k, min_p, any_cut), scaled, -jnp.inf), axis=-1)


# XLA:GPU runs a top-k of k <= 16 as a selection kernel and lowers a wider one to a sort of every row (its TopK
# specializer's limit): the 129,280 ids of a Flash row took 1.6 ms to sort at batch 32 on an H100
TOP_K_SELECTION = 16
# ...but the selection kernel's time hardly grows with the rows, a sort's does: the top 20 of 129,280 in selections
# took 335 us of GPU time at batch 1 and 369 at 32 on an H100, a sort of the rows 80 us at 1 and 1.62 ms at 32
# (`scripts/sampling_probe.py`). Fewer rows than this: one top-k (the sort).
SELECTIONS_FROM_ROWS = 8


def top_alternatives(all_logprobs, n: int):
    """(log-probs [..., n] f32, token ids [..., n] int32) of the n most likely tokens, most likely first; ties:
    the lower id first (lax.top_k's order). From SELECTIONS_FROM_ROWS rows, selections of at most TOP_K_SELECTION
    at a time, each after the ones before are masked to -inf: the same tokens as one lax.top_k of n for finite
    log-probs (log-softmax of finite logits), without the sort a wide top-k is on a GPU."""
    if n == 0:
        shape = all_logprobs.shape[:-1] + (0,)
        return jnp.zeros(shape, F32), jnp.zeros(shape, jnp.int32)
    if all_logprobs.size // all_logprobs.shape[-1] < SELECTIONS_FROM_ROWS:
        vals, ids = jax.lax.top_k(all_logprobs, n)
        return vals, ids.astype(jnp.int32)
    vals, ids, rest = [], [], all_logprobs
    for start in range(0, n, TOP_K_SELECTION):
        v, i = jax.lax.top_k(rest, min(TOP_K_SELECTION, n - start))
        vals.append(v)
        ids.append(i.astype(jnp.int32))
        if start + TOP_K_SELECTION < n:
            rest = jnp.put_along_axis(rest, i, -jnp.inf, axis=-1, inplace=False)
    return jnp.concatenate(vals, axis=-1), jnp.concatenate(ids, axis=-1)
