"""The sampler's filters (v4jax.engine.sampling.kept) against a reference written from their definition, and the
program form without the top-k / top-p sort against the one with it."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from v4jax.engine.sampling import (SEARCH_FROM_ROWS, apply_penalties, filtered_probs, greedy_and_normalizer, kept,
                                   sample, token_counts, top_alternatives)


def reference_kept(logits, temperature, top_p, top_k, min_p):
    """One row, in numpy: the vocabulary sorted (most likely first, ties: lower id first), min-p on the
    temperature-scaled values, the first top_k, then the smallest prefix whose mass (f32 cumsum) reaches top_p."""
    v = logits.shape[0]
    order = sorted(range(v), key=lambda i: (-logits[i], i))
    scaled = (logits / np.float32(max(temperature, 1e-6))).astype(np.float32)
    s = scaled[order]
    keep = s >= s[0] + np.log(np.float32(min_p)) if min_p > 0 else np.ones(v, bool)
    keep &= np.arange(v) < (top_k if top_k > 0 else v)
    if top_p < 1:
        probs = np.asarray(jax.nn.softmax(jnp.where(jnp.asarray(keep), jnp.asarray(s), -jnp.inf)))
        keep &= np.asarray(jnp.cumsum(jnp.asarray(probs)) - probs) < top_p
    out = np.zeros(v, bool)
    out[np.array(order)[keep]] = True
    return out


# logits drawn from few values, so that ties (the order's lower-id rule) are common; -inf as a banned id
values = st.sampled_from([-np.inf, -3.0, -1.0, 0.0, 0.5, 2.0, 2.0001])
WIDTH = 24  # every row padded to this many ids with -inf (banned: sorted last, no mass), so `kept` compiles once
kept_jit = jax.jit(kept, static_argnames="any_cut")


@settings(max_examples=80, deadline=None)
@given(st.lists(values, min_size=2, max_size=WIDTH), st.sampled_from([0.5, 1.0, 1.7]),
       st.sampled_from([0.05, 0.3, 0.8, 0.99, 1.0]), st.integers(0, 6), st.sampled_from([0.0, 0.1, 0.6]))
def test_kept_is_the_sorted_prefix(row, temperature, top_p, top_k, min_p):
    logits = np.full(WIDTH, -np.inf, np.float32)
    logits[:len(row)] = row
    if not np.isfinite(logits).any():
        logits[0] = 0.0
    lg = jnp.asarray(logits)[None]
    one = lambda x, dt=jnp.float32: jnp.array([x], dt)  # noqa: E731
    scaled = lg / temperature
    got = np.asarray(kept_jit(lg, scaled, one(top_p), one(top_k, jnp.int32), one(min_p)))[0]
    want = reference_kept(logits, temperature, top_p, top_k, min_p)
    # -inf ids are never drawn whether kept or not
    finite = np.isfinite(logits)
    np.testing.assert_array_equal(got & finite, want & finite)
    # as many rows as take the search instead of the sort: the same tokens
    rows = lambda x: jnp.tile(x, (SEARCH_FROM_ROWS,) + (1,) * (x.ndim - 1))  # noqa: E731
    searched = np.asarray(kept_jit(rows(lg), rows(scaled), rows(one(top_p)), rows(one(top_k, jnp.int32)),
                                   rows(one(min_p))))
    for row in searched:
        np.testing.assert_array_equal(row & finite, want & finite)
    if top_k == 0 and top_p >= 1:  # nothing to cut: the form without the sort keeps the same tokens
        plain = np.asarray(kept_jit(lg, scaled, one(top_p), one(top_k, jnp.int32), one(min_p), any_cut=False))[0]
        np.testing.assert_array_equal(plain & finite, want & finite)


def test_the_search_keeps_what_the_sort_keeps():
    """Many rows (the threshold search) against each row alone (the sort), on a 3,000-id vocabulary with rows of
    every kind of cut: each row's min-p, top-k, top-p and temperature drawn at random; logits rounded to 1/8 so
    that ties at the thresholds are common. The two sum the top-p mass in different orders: a row may differ only
    where a token's preceding mass (the sort's) lies within 1e-6 of top_p, and is then left out."""
    b, v = 48, 3000
    ks = jax.random.split(jax.random.key(5), 6)
    logits = jnp.round(8 * 1.5 * jax.random.normal(ks[0], (b, v))) / 8
    logits = logits.at[3, :7].set(jnp.max(logits[3]))  # a tie at the top
    logits = logits.at[4].set(0.0)  # a flat row
    temperature = jax.random.choice(ks[1], jnp.array([0.3, 1.0, 1.5]), (b,))
    top_p = jax.random.choice(ks[2], jnp.array([0.1, 0.5, 0.9, 0.95, 0.999, 1.0]), (b,))
    top_k = jax.random.choice(ks[3], jnp.array([0, 0, 1, 5, 50, 2999]), (b,)).astype(jnp.int32)
    min_p = jax.random.choice(ks[4], jnp.array([0.0, 0.0, 0.05]), (b,))
    scaled = logits / temperature[:, None]
    searched = np.asarray(kept(logits, scaled, top_p, top_k, min_p))
    compared = 0
    for i in range(b):
        one = lambda x: x[i:i + 1]  # noqa: E731
        want = reference_kept(np.asarray(logits[i]), float(temperature[i]), float(top_p[i]), int(top_k[i]),
                              float(min_p[i]))
        alone = np.asarray(kept(one(logits), one(scaled), one(top_p), one(top_k), one(min_p)))[0]
        np.testing.assert_array_equal(alone, want)
        if _near_the_top_p_boundary(np.asarray(logits[i]), float(temperature[i]), float(top_p[i]), int(top_k[i]),
                                    float(min_p[i])):
            continue
        np.testing.assert_array_equal(searched[i], want, err_msg=f"row {i}")
        compared += 1
    assert compared >= b - 4
    counts = searched.sum(-1)
    assert (counts < v).all() and (counts > 100).sum() >= 8 and (counts == 1).sum() >= 2  # cuts of every size


def _near_the_top_p_boundary(logits, temperature, top_p, top_k, min_p) -> bool:
    """Whether some token's preceding mass among the min-p and top-k survivors lies within 1e-6 of top_p."""
    if top_p >= 1:
        return False
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    scaled = logits[order].astype(np.float64) / temperature
    w = np.exp(scaled - scaled[0])
    pre = (w >= min_p) & (np.arange(len(w)) < (top_k if top_k > 0 else len(w)))
    w = np.where(pre, w, 0)
    before = (np.cumsum(w) - w) / w.sum()
    return bool(np.any(pre & (np.abs(before - top_p) < 1e-6)))


def test_a_row_draws_the_same_token_whatever_its_step_cuts():
    """A row without top-k / top-p draws the same tokens in a step where another row cuts (the sorting form) as in
    one where none does (the form without the sort): the draw is in vocabulary order by the row's own key."""
    b, v = 16, 1000
    logits = 3.0 * jax.random.normal(jax.random.key(1), (b, v))
    temperature = jnp.full((b,), 1.0)
    top_k = jnp.zeros((b,), jnp.int32)
    min_p = jnp.zeros((b,))
    seeds = jnp.arange(b, dtype=jnp.int32) + 7
    zeros = jnp.zeros((b,), jnp.int32)
    for token_index in range(4):
        ti = jnp.full((b,), token_index, jnp.int32)
        plain = sample(logits, logits, temperature, jnp.ones((b,)), top_k, min_p, seeds, zeros, ti, True,
                       any_cut=False)[0]
        cut_p = jnp.ones((b,)).at[0].set(0.5)  # row 0 cuts by top-p: the step sorts
        sorted_form = sample(logits, logits, temperature, cut_p, top_k, min_p, seeds, zeros, ti, True)[0]
        np.testing.assert_array_equal(np.asarray(plain)[1:], np.asarray(sorted_form)[1:])
        assert len(set(np.asarray(plain).tolist())) > 1  # the rows do sample


def test_filtered_probs_without_the_cut():
    logits = 2.0 * jax.random.normal(jax.random.key(2), (4, 300))
    one = lambda x, dt=jnp.float32: jnp.full((4,), x, dt)  # noqa: E731
    args = (logits, one(0.8), one(1.0), one(0, jnp.int32), one(0.05))
    np.testing.assert_allclose(np.asarray(filtered_probs(*args, any_cut=False)), np.asarray(filtered_probs(*args)),
                               rtol=1e-6, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 45), st.integers(6, 11), st.data())
def test_top_alternatives_in_selections_equal_one_top_k(n, batch, data):
    """The top-N alternatives taken TOP_K_SELECTION at a time (XLA:GPU's top-k kernel's limit; wider is a sort;
    from SELECTIONS_FROM_ROWS rows, one top-k below) equal one lax.top_k of n: the same ids and values, ties to the
    lower id, over rows with many equal values."""
    v = 64
    rows = np.array(data.draw(st.lists(st.sampled_from([-7.0, -3.5, -3.0, -1.25, 0.0]), min_size=(batch + 1) * v,
                                       max_size=(batch + 1) * v)), np.float32).reshape(batch + 1, v)
    x = jnp.asarray(rows)
    vals, ids = top_alternatives(x, n)
    want_vals, want_ids = jax.lax.top_k(x, n)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))


def test_top_alternatives_ask_for_no_top_k_wider_than_the_selection_kernel():
    """From SELECTIONS_FROM_ROWS rows, selections of at most 16; below, one top-k (measured faster at few rows)."""
    import re
    from v4jax.engine.sampling import SELECTIONS_FROM_ROWS as R

    def widths(rows):
        text = jax.jit(lambda x: top_alternatives(x, 20)).lower(jnp.zeros((rows, 2048))).as_text()
        return sorted(int(k) for k in re.findall(r"top_k\([^)]*k = (\d+)\)", text))
    assert widths(R) == widths(4 * R) == [4, 16]
    assert widths(1) == widths(R - 1) == [20]


def reference_penalized(logits, prompt, output, presence, frequency, repetition):
    """One row, in numpy, vLLM's order: repetition over the prompt's and the output's tokens (positive logits
    divided, negative multiplied), then frequency x each token's count in the output and presence for each token in
    it subtracted."""
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


def test_penalized_against_the_reference():
    """Rows of every kind of penalty (neutral ones included) over sequences read in a scrambled order with unused
    positions: the penalized logits against the reference; a neutral row comes back bit for bit."""
    rng = np.random.default_rng(0)
    b, v, t = 6, 50, 40
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    logits[1, 7] = -np.inf  # a banned id stays banned
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    seen = rng.random((b, t)) < 0.8
    produced = seen & (rng.random((b, t)) < 0.5)
    pres = np.array([0.0, 0.5, -1.0, 2.0, 0.0, 0.3], np.float32)
    freq = np.array([0.0, 0.2, 0.7, -2.0, 0.0, 1.5], np.float32)
    rep = np.array([1.0, 1.3, 0.6, 2.0, 1.0, 1.0], np.float32)

    class Sm:  # the rows' SamplingState fields apply_penalties reads
        presence, frequency, repetition = jnp.asarray(pres), jnp.asarray(freq), jnp.asarray(rep)

    got = np.asarray(apply_penalties(jnp.asarray(logits), Sm, *token_counts(v, jnp.asarray(tokens), jnp.asarray(seen),
                                                                            jnp.asarray(produced))))
    for i in range(b):
        prompt = tokens[i][seen[i] & ~produced[i]].tolist()
        output = tokens[i][produced[i]].tolist()
        want = reference_penalized(logits[i], prompt, output, pres[i], freq[i], rep[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])  # neutral
    np.testing.assert_array_equal(got[4], logits[4])
    assert got[1, 7] == -np.inf
    assert not np.array_equal(got[5], logits[5])  # a presence / frequency penalty alone changes the row


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(2, 300), st.data())
def test_greedy_and_normalizer_equal_argmax_and_log_softmax(batch, v, data):
    """The one pass's argmax (of the steered logits, ties: the lower id, every id banned: 0) and max, with the
    sum after it, give jnp.argmax's ids and jax.nn.log_softmax's values bit for bit."""
    draw = lambda: np.array(data.draw(st.lists(values, min_size=batch * v, max_size=batch * v)),  # noqa: E731
                            np.float32).reshape(batch, v)
    raw = draw()
    raw[np.isinf(raw)] = -5.0  # raw logits are finite
    chosen = draw()
    chosen[0] = -np.inf if data.draw(st.booleans()) else chosen[0]
    best, m, total = jax.jit(greedy_and_normalizer)(jnp.asarray(chosen), jnp.asarray(raw))
    np.testing.assert_array_equal(np.asarray(best), np.argmax(chosen, axis=-1))
    got = (jnp.asarray(raw) - m[:, None]) - jnp.log(total)[:, None]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(jax.nn.log_softmax)(jnp.asarray(raw))))
