"""Speculative decoding with the DSpark drafter of the 0731 / -DSpark releases (`{"method": "dspark", ...}`).

What the drafter computes (v4jax.model.transformer: DSparkStage, Transformer.dspark_*):
  taps     after each main layer of `dspark_target_layer_ids`, the mean of its output streams over the N streams;
           concatenated, [.., n_targets * D]
  keys     main_x = main_norm(main_proj(taps)) (the first draft layer's); each draft layer s keeps a window ring of
           kv_norm_s(wkv_s(main_x)) with RoPE at the main positions (the draft layers' own sliding window)
  block    with the main model at position a (its last processed token) and the next token t (at a+1): the block
           [t, noise x (dspark_block_size - 1)] at positions a+1 .., embedded, through the draft layers in turn;
           each layer's attention: queries and keys of the block (its own projections), plus the ring's keys of
           positions a-W+1 .. a; no causal mask inside the block; then its MoE, with mHC around both
  head     y = the last layer's hc_head collapse; base logits = head(norm(y)), one row per block slot
  Markov   draft j = proposal(base_j + markov_w2 @ markov_w1[prev_j]), prev_0 = t, prev_{j+1} = draft j (greedy rows:
           the argmax; sampled rows: a draw from the steered logits filtered as their sampling filters them, whose
           distribution is the q of the rejection rule)
  confidence  proj([y_j, markov_w1[prev_j]]) per draft (a logit; sigmoid = the head's estimate that draft j survives
           given the ones before it)
The verify, acceptance (greedy match or the rejection rule), the commit of the compressor states and the outputs
are the MTP path's (v4jax.engine.steps `_spec_decode`, v4jax.engine.spec): the drafter only proposes, so the
tokens kept are the target's whatever it drafts. After the verify, the accepted positions' keys (from the verify's
own taps) go into the rings; after a prefill chunk, the chunk's. A ring row is a function of the main hidden states
at its position, so the rings sit in the SWA pages of their positions (a prefix hit maps pages whose rows the same
prefix wrote) and need no rollback: rows past the accepted end are never written.

Verified against public sources (read, not copied; deepseek-ai's DSpark checkpoints' `inference/model.py`
(`DSparkBlock`, `DSparkAttention`, `get_dspark_topk_idxs`) as quoted by the third-party ports that load them,
Blaizzy/mlx-vlm's DeepSeek-V4 DSpark port and its tests, vLLM / SGLang / TensorRT-LLM pull requests):
  - the tensor names and shapes (`mtp.0.main_proj` [D, n_targets * D] FP8, `mtp.0.main_norm`, `mtp.{last}.norm`,
    `hc_head_*`, `markov_head.markov_w1/w2` [V, rank], `confidence_head.proj` [1, D + rank], no bias), three
    sliding-window draft layers (the config's compress_ratios past the main layers), the config keys
  - taps after the target layers (output, not input, for V4 / 0731), the mean over the streams, main_x from the
    first layer, every layer's own ring of keys, the block of the next token and noise tokens at the following
    positions, the non-causal block attention over window + block, the Markov recurrence over the block, the
    confidence head's input (the collapsed output before the norm, with the previous token's Markov embedding)
Not verified (no reference run; a random tiny drafter accepts next to nothing, so nothing here measures it):
  - numerical agreement with the official drafter, and acceptance on the real weights
  - which window entries the official decode loop holds after a multi-token commit (here: every accepted position)
  - the confidence head's use: it is computed (`propose`) but does not shorten the verify (a verify of fixed
    width costs the same whatever it keeps; the public default, TensorRT-LLM's threshold 0, keeps the whole block)
Losslessness never depends on any of this: tests/test_dspark.py holds the outputs to plain decoding's.
The first draft of a decode call may miss its oldest window key: the SWA page of position a-W+1 can have been
released (the main model's window at a+1 starts one later); its row is then masked, not read (acceptance only).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from v4jax import cache as C
from v4jax.engine import spec as SP


def _write(ring, keys, meta):
    """ring [S, R, K] with keys [S, B, T, K] written at the step's SWA rows (out of range: dropped)."""
    rows = meta.swa_write.reshape(-1)
    vals = keys.reshape(keys.shape[0], -1, keys.shape[-1]).astype(ring.dtype)
    return ring.at[:, rows].set(vals, mode="drop")


def write_keys(model, cfg, layout, ring, taps, start, n_valid, page_table, swa_table, opts):
    """The ring with the keys of n_valid [B] positions from start [B] (taps [B, T, n_targets * D] of them)."""
    t = taps.shape[1]
    b = start.shape[0]
    meta = C.make_meta(cfg, layout, start, n_valid, jnp.zeros((b,), bool), None, page_table, swa_table, t, {})
    return _write(ring, model.dspark_keys(taps, meta.positions, opts), meta)


@dataclasses.dataclass(frozen=True)
class DSparkDrafter:
    """The DSpark drafter's hooks into the speculative decode call (v4jax.engine.steps)."""
    taps = True  # the verify step returns the target layers' taps

    @staticmethod
    def cut(d, s):
        return d

    @staticmethod
    def put(whole, part):
        return part

    @staticmethod
    def prefill(model, cfg, layout, pools, streams, taps, batch, sampled, page_table, swa_table, opts):
        ring = write_keys(model, cfg, layout, pools.draft.swa, taps, batch.start, batch.n_valid, page_table,
                          swa_table, opts)
        return dataclasses.replace(pools, draft=C.DraftState(swa=ring))

    @staticmethod
    def propose(model, cfg, layout, d, tokens, pos, live, k, page_table, swa_table, rows, opts, sm, sampled,
                table=None, cut=True):
        """k drafts [B, k] per row whose next token `tokens` [B] sits at position pos [B] (the rings hold the keys
        up to pos-1), their distributions [B, k, V] (None unless `sampled`), and the drafter state after it."""
        drafts, qs, _ = propose(model, cfg, layout, d.swa, tokens, pos, live, k, swa_table, opts, sm, sampled, table,
                                cut)
        return drafts, qs, d

    @staticmethod
    def advance(model, cfg, layout, d, streams, taps, pos, n, live, target, page_table, swa_table, opts):
        """The rings with the keys of the n [B] accepted positions from pos (the verify's taps)."""
        ring = write_keys(model, cfg, layout, d.swa, taps, pos, jnp.where(live, n, 0), page_table, swa_table, opts)
        return C.DraftState(swa=ring)


DSPARK = DSparkDrafter()


def propose(model, cfg, layout, ring, tokens, pos, live, k: int, swa_table, opts, sm, sampled: bool, table=None,
            cut: bool = True):
    """The DSpark block drafted after `tokens` [B] at positions pos [B]: (drafts [B, k], q [B, k, V] or None,
    confidence logits [B, k]). k <= dspark_block_size: the whole block runs (its slots attend to each other), the
    Markov recurrence stops after k drafts. table: tests only, as spec.draft's; cut: as spec.proposal's."""
    b = tokens.shape[0]
    blk = cfg.dspark_block_size
    anchor = pos - 1
    meta = C.make_meta(cfg, layout, anchor, live.astype(jnp.int32), jnp.zeros((b,), bool), None,
                       jnp.zeros((b, 1), jnp.int32), swa_table, 1, {})
    win_rows, win_pos = meta.win_rows, meta.win_pos  # [B, W]: positions anchor-W+1 .. anchor
    ctx_valid = live[:, None] & (win_rows >= 0) & (win_pos >= 0)
    context = ring[:, jnp.maximum(win_rows, 0)]  # [S, B, W, K]
    ids = jnp.concatenate([tokens[:, None], jnp.full((b, blk - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    positions = pos[:, None] + jnp.arange(blk)[None, :]
    streams = model.dspark_streams(ids, positions, context, ctx_valid, opts)
    y, base = model.dspark_head(streams[:, :k])
    head = model.mtp[-1]
    keys = SP.purpose(SP.token_keys(sm, k), 1) if sampled else jnp.zeros((b, k), jnp.uint32)
    prev, drafts, qs, conf = tokens, [], [], []
    for j in range(k):
        e = head.markov_head.embed(prev)
        conf.append(head.confidence_head(y[:, j], e))
        prev, q = SP.proposal(base[:, j] + head.markov_head.bias(e), sm, keys[:, j], sampled, j, cut)
        drafts.append(prev)
        qs.append(q)
    drafts = jnp.stack(drafts, axis=1)
    q = jnp.stack(qs, axis=1) if sampled else None
    if table is not None:
        at = jnp.clip(pos[:, None] + 1 + jnp.arange(k)[None, :], 0, table.shape[1] - 1)
        drafts = jnp.take_along_axis(table, at, axis=1)
        if sampled:  # forced drafts count as drawn from a point mass: the rule stays lossless
            q = jax.nn.one_hot(drafts, q.shape[-1], dtype=q.dtype)
    return drafts, q, jnp.stack(conf, axis=1)
