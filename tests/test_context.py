"""Context parallelism's merges (sharding/context.py) and the model's per-shard attention
(v4jax.model.attention.attention_core) equal the single-device computation. The shards are emulated on one device:
jax.vmap with a named axis runs the same collectives as jax.shard_map does on a mesh (tests/mesh_worker.py runs the
real meshes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding import context
from v4jax.model import layers as L
from v4jax.model import attention_core
from v4jax.model.ops import ops_for

AXIS = "context"


def _by_rule(scores, k):
    """Reference top-k: higher score first, then lower index (a stable sort of -score); -inf is none."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    vals = np.take_along_axis(scores, order, axis=-1)
    return np.where(np.isfinite(vals), vals, -np.inf), np.where(np.isfinite(vals), order, -1)


def _owners(rng, shape, n, how):
    """Which of n shards holds each entry: contiguous blocks, or anywhere (correctness may not depend on it)."""
    if how == "blocks":
        return np.broadcast_to(np.arange(shape[-1]) * n // shape[-1], shape)
    return rng.integers(0, n, shape)


@pytest.mark.parametrize("how", ["blocks", "anywhere"])
@pytest.mark.parametrize("k", [1, 5, 12, 40, 64])
def test_merge_topk_equals_one_topk_with_ties(rng, how, k):
    b, t, s, n = 2, 3, 40, 4
    scores = rng.integers(-2, 3, (b, t, s)).astype(np.float32)  # few values: ties everywhere, also at the cut
    scores[scores == 0] = np.where(rng.random((scores == 0).sum()) < 0.5, -0.0, 0.0)  # -0.0 ties with 0.0
    scores[0, 0, ::3] = -np.inf  # entries a query may not see
    scores[1, 2, :] = -np.inf  # nothing valid
    owner = _owners(rng, (b, t, s) if how == "anywhere" else (s,), n, how)
    kk = min(k, s)

    def shard(own):
        mine = jnp.where(own, scores, -jnp.inf)
        vals, at = jax.lax.top_k(mine, kk)
        at = jnp.where(vals > -jnp.inf, at, -1)
        return context.merge_topk(vals, at, k, (AXIS,))

    owns = np.stack([np.broadcast_to(owner == c, scores.shape) for c in range(n)])
    vals, at = jax.vmap(shard, axis_name=AXIS)(owns)
    canonical = np.where(scores == 0, 0.0, scores)  # -0.0 is the score 0 (lax.top_k orders floats totally)
    want_vals, want_at = _by_rule(canonical, kk)
    one_vals, one_at = jax.lax.top_k(jnp.asarray(canonical), kk)  # the single-device selection
    one_at = np.where(np.isfinite(one_vals), one_at, -1)
    np.testing.assert_array_equal(one_at, want_at)  # lax.top_k keeps the tie rule
    for c in range(n):  # every shard ends with the same selection
        np.testing.assert_array_equal(at[c], want_at)
        np.testing.assert_array_equal(vals[c], want_vals)


@pytest.mark.parametrize("how", ["blocks", "anywhere"])
def test_merge_softmax_equals_one_softmax(rng, how):
    b, t, h, k, s, n = 2, 3, 4, 16, 30, 3
    q = jnp.asarray(rng.normal(size=(b, t, h, k)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(b, s, k)) * 2, jnp.float32)
    valid = rng.random((b, t, s)) < 0.7
    valid[1, 1] = False  # one query sees nothing but the sink
    sink = jnp.asarray(rng.normal(size=h), jnp.float32)
    owner = _owners(rng, (b, t, s) if how == "anywhere" else (s,), n, how)
    owner = np.where(owner == 2, 1, owner) if how == "blocks" else owner  # shard 2 holds nothing at all
    want, want_lse = L.attend(q, keys, jnp.asarray(valid), None, None, sink, 0.3)

    def shard(c, own):
        here = jnp.where(c == 0, sink, -jnp.inf)  # the sink enters once
        o, lse = L.attend(q, keys, jnp.asarray(valid) & own, None, None, here, 0.3)
        return context.merge_softmax(o, lse, (AXIS,))

    owns = jnp.asarray(np.stack([np.broadcast_to(owner == c, valid.shape) for c in range(n)]))
    got = jax.vmap(shard, axis_name=AXIS)(jnp.arange(n), owns)
    for c in range(n):
        np.testing.assert_allclose(got[c], want, rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(want_lse))


def _layer_inputs(rng, kind, b=2, t=3, h=4, kd=16, ki=8, r_swa=24, r=64, n_layers=2, d_shards=1, s=12):
    """Random pools of a 2-layer stack, the step's writes and reads: rows anywhere in the pools, or with d_shards
    the rows of batch rows [i B/d, (i+1) B/d) in the i-th of d blocks of every pool."""
    w = 4
    f32 = jnp.float32

    def draw(n_rows, per_row, replace=False):  # [b, per_row] pool rows, no two batch rows sharing one
        per_shard = b // d_shards
        out = [rng.choice(n_rows // d_shards, (per_shard, per_row), replace=replace) + i * (n_rows // d_shards)
               for i in range(d_shards)]
        return np.concatenate(out)

    pools = {"swa": rng.normal(size=(n_layers, r_swa, kd))}
    writes = {"swa": (draw(r_swa, t), rng.normal(size=(b, t, kd)))}
    u = w - 1 + t
    reads = {"win_rows": draw(r_swa, u, replace=True), "win_pos": np.broadcast_to(np.arange(u) + 2, (b, u)),
             "pos": np.broadcast_to(np.arange(t) + 2 + w - 1, (b, t))}
    reads["win_rows"][0, :2] = -1
    if kind != "sliding":
        rows = draw(r, s)
        rows[1, -3:] = -1  # no page there
        pools["kv"] = rng.normal(size=(n_layers, r, kd))
        writes["kv"] = (np.where(rng.random((b, 2)) < 0.7, rows[:, :2], -1), rng.normal(size=(b, 2, kd)))
        reads.update(rows=rows, n_ready=np.arange(b)[:, None] * 3 + np.arange(t) + 6)
    if kind == "csa":
        pools["idx"] = rng.normal(size=(n_layers, r, ki))
        writes["idx"] = (writes["kv"][0], rng.normal(size=(b, 2, ki)))
        iq = rng.normal(size=(b, t, 3, ki))
        iq[..., :4] = np.round(iq[..., :4])  # coarse scores: ties among the indexer's candidates
        reads.update(iq=iq, w=np.abs(rng.normal(size=(b, t, 3))))
    q = rng.normal(size=(b, t, h, kd))
    sink = rng.normal(size=h)
    cast = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, f32 if np.asarray(a).dtype.kind == "f" else jnp.int32),
                                     tree)
    return cast(q), cast(sink), cast(pools), cast(writes), cast(reads)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa", "csa in blocks"])
def test_attention_core_per_shard_equals_one_device(rng, monkeypatch, kind, impl):
    """The pools' rows split in n contiguous blocks over the context axis (the SWA pool whole), each shard storing
    and reading its own: the same output and pool contents as one device; "csa in blocks": the shards' selections
    in blocks of one query token (attention.SELECT_SCORES_BYTES), merged across shards per token."""
    n, t = 4, 3
    if kind == "csa in blocks":
        from v4jax.model import attention
        monkeypatch.setattr(attention, "SELECT_SCORES_BYTES", 4)
        kind, t = "csa", 4
    q, sink, pools, writes, reads = _layer_inputs(rng, kind, t=t)
    static = dict(ops=ops_for(impl), scale=0.25, window=4, topk=5)
    li = jnp.int32(1)
    whole = {name: context.RowBlock((), a.shape[1]) for name, a in pools.items()}
    # jitted, both sides (as the model's steps run it): run op by op, each case took seconds more on CPU
    want, want_pools = jax.jit(lambda p: attention_core(whole, q, sink, p, writes, reads, li, **static))(pools)
    split = {name: context.RowBlock(() if name == "swa" else (AXIS,), a.shape[1] // (1 if name == "swa" else n))
             for name, a in pools.items()}

    def blocks_of(name, a):  # [layers, R, K] -> [n, layers, R / n, K] (the SWA pool: a copy per shard)
        if name == "swa":
            return jnp.broadcast_to(a, (n,) + a.shape)
        return jnp.moveaxis(a.reshape(a.shape[0], n, -1, a.shape[-1]), 1, 0)

    sharded = {name: blocks_of(name, a) for name, a in pools.items()}
    got, got_pools = jax.jit(jax.vmap(lambda p: attention_core(split, q, sink, p, writes, reads, li, **static),
                                      axis_name=AXIS))(sharded)
    for c in range(n):
        np.testing.assert_allclose(got[c], want, rtol=1e-5, atol=1e-6)
    for name, a in want_pools.items():
        np.testing.assert_array_equal(got_pools[name], blocks_of(name, a))


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_attention_core_rows_split_over_data(rng, kind):
    """Decode on a data x context mesh: the batch rows split over `data` with their pages in their data shard's
    blocks (the layout contract), the compressed pools in data x context blocks, the SWA pool in data blocks;
    nothing is merged over `data`. The same outputs and pools as one device."""
    d, c, b = 2, 2, 4
    q, sink, pools, writes, reads = _layer_inputs(rng, kind, b=b, d_shards=d)
    static = dict(ops=ops_for("xla"), scale=0.25, window=4, topk=5)
    li = jnp.int32(0)
    whole = {name: context.RowBlock((), a.shape[1]) for name, a in pools.items()}
    want, want_pools = jax.jit(lambda p: attention_core(whole, q, sink, p, writes, reads, li, **static))(pools)
    axes = {name: ("data",) if name == "swa" else ("data", "context") for name in pools}
    n_blocks = {name: d if name == "swa" else d * c for name in pools}
    split = {name: context.RowBlock(axes[name], a.shape[1] // n_blocks[name]) for name, a in pools.items()}

    def blocks_of(name, a):  # [layers, R, K] -> [d, c, layers, R / blocks, K] (the SWA pool: a copy per c)
        x = jnp.moveaxis(a.reshape(a.shape[0], n_blocks[name], -1, a.shape[-1]), 1, 0)
        x = x.reshape(d, -1, *x.shape[1:])
        return jnp.broadcast_to(x, (d, c) + x.shape[2:]) if name == "swa" else x

    by_shard = lambda tree: jax.tree.map(lambda a: a.reshape(d, b // d, *a.shape[1:]), tree)  # noqa: E731
    core = lambda q, p, w, r: attention_core(split, q, sink, p, w, r, li, row_axes=("data",), **static)  # noqa
    per_shard = jax.jit(jax.vmap(jax.vmap(core, in_axes=(None, 0, None, None), axis_name="context"),
                                 axis_name="data"))
    got, got_pools = per_shard(by_shard(q), {n: blocks_of(n, a) for n, a in pools.items()}, by_shard(writes),
                               by_shard(reads))
    for j in range(c):
        np.testing.assert_allclose(got[:, j].reshape(want.shape), want, rtol=1e-5, atol=1e-6)
    for name, a in want_pools.items():
        np.testing.assert_array_equal(got_pools[name], blocks_of(name, a))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_indexer_selection_in_blocks_of_queries(rng, monkeypatch, impl):
    """A CSA step whose indexer scores would pass SELECT_SCORES_BYTES selects in blocks of query tokens: the same
    output and pools as in one block, and a smaller step temporary."""
    from v4jax.model import attention
    q, sink, pools, writes, reads = _layer_inputs(rng, "csa", t=8, s=12)
    static = dict(ops=ops_for(impl), scale=0.25, window=4, topk=5)
    blocks = {name: context.RowBlock((), a.shape[1]) for name, a in pools.items()}
    call = lambda: jax.jit(lambda p: attention_core(blocks, q, sink, p, writes, reads, jnp.int32(1), **static))
    want, want_pools = call()(pools)
    monkeypatch.setattr(attention, "SELECT_SCORES_BYTES", 2 * 2 * 12 * 4)  # blocks of 2 of the 8 tokens
    got, got_pools = call()(pools)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    for name, a in got_pools.items():
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want_pools[name]))
    if impl == "xla":  # 2 x 64 tokens over 4,096 entries: 2 MiB of scores at once, then 64 KiB
        q, sink, pools, writes, reads = _layer_inputs(rng, "csa", b=2, t=64, s=4096, r=8192, r_swa=256)
        temp = lambda: call().lower(pools).compile().memory_analysis().temp_size_in_bytes
        monkeypatch.setattr(attention, "SELECT_SCORES_BYTES", 1 << 16)
        small = temp()
        monkeypatch.setattr(attention, "SELECT_SCORES_BYTES", 1 << 30)
        assert temp() - small >= (2 << 20) - (1 << 16)
