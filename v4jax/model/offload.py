"""A row pool held in host memory with a hot buffer of its rows on the device (the C4 KV of CSA layers under
`enable_hisparse`). The model sees rows only: which rows a step selects is the indexer's top-k.

Per layer of the stack (arrays [n, ...], the stack's n layers):
  host   [n, R, K]   every row (JAX memory kind `pinned_host`): the authority, every write lands here
  hot    [n, H, K]   device copies of H of them
  table  [n, R]      host row -> its hot row (-1: not resident)
  owner  [n, H]      hot row -> the host row it holds (-1: none)
  used   [n, H]      the layer step that last read the hot row (LRU)
  clock  [n]         the layer's step counter
  counts [n, 2, F]   counters (COUNTERS), as low 24 bits / the rest, so that int32 never wraps

A step writes its new rows to the host and, where resident, to the hot copy. After the top-k, the selected rows
missing from the hot buffer are gathered on the host (compacted, distinct) and brought to the device in transfers of
one size (`_pull`, `transfer_sizes`), installed over the least recently used hot rows, and the
attention reads every selected row from the hot buffer. So every answer reads the host's values: residency
changes what moves, never what is read. The one condition: a step's distinct selected rows of a layer fit the
hot buffer (H >= rows x tokens x top-k of the step), which the engine checks when it is built.

A step of many query tokens (a prefill chunk) instead reads its rows' whole C4 KV of the layer at once (the
columns in use), a group of rows that fits a few hot buffers at a time (`whole_read_rows`, `read_whole`), where
that moves fewer rows than its selections could."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

COUNTERS = ("selected", "hits", "fetched_rows", "transferred_rows", "overflow")
_LOW = 24
# the smallest block of consecutive rows written as one update: a full page holds a multiple of this many C4
# entries (pages are multiples of 128 tokens)
_BLOCK = 32


def to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


_GATHER = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))


def _write_rows(host, li, rows, values, largest: int | None = None):
    """values [N, K] into layer li's rows [N] (-1: none) of the host pool [n, R, K] by dynamic updates, which XLA
    keeps in place: aligned blocks of consecutive rows in one update each, the largest first (down to _BLOCK rows),
    every other row alone, valid rows first, in while loops. The rows come in runs of `largest` (N a multiple: a
    step's entries of each batch row; default one run of N), blocks never span two runs, and a run is padded to a
    multiple of its largest block: a prefill chunk's run is T / m + 2 windows
    (2,050 for 8,192 tokens), which no block size divided, so its 2,048 entries went one row an iteration (an H100
    prefill chunk of flash-slice: 30,417 kernels against 891 with the pool on the device, ~50 ms a CSA layer).
    Measured on an H100 (scripts/offload_probe.py): a host-computation scatter copied the whole pool per call (10 /
    42 / 190 ms a step at 32 / 128 / 512 MiB) where these updates take 0.12 ms a step at every size. On the CPU a
    prefill chunk's 2,048 rows on consecutive pages went to the host 6.6x faster in one block than in blocks of 32
    (scripts/offload_probe.py, write_chunk rows)."""
    n_rows, k = values.shape
    largest = min(n_rows, largest or n_rows)
    if largest >= _BLOCK:
        size = 1 << (largest.bit_length() - 1)  # the largest block: a power of two, at most a run
        pad = -largest % size
        if pad:  # each run padded with none-rows up to a multiple of it
            rows = jnp.pad(rows.reshape(-1, largest), ((0, 0), (0, pad)), constant_values=-1).reshape(-1)
            values = jnp.pad(values.reshape(-1, largest, k), ((0, 0), (0, pad), (0, 0))).reshape(-1, k)
        while size >= _BLOCK:
            blocks = rows.reshape(-1, size)
            whole = (blocks[:, 0] >= 0) & jnp.all(blocks == blocks[:, :1] + jnp.arange(size, dtype=rows.dtype), axis=1)
            host = _updates(host, li, blocks[:, 0], whole, values.reshape(-1, size, k))
            rows = jnp.where(jnp.repeat(whole, size), -1, rows)
            size //= 2
    return _updates(host, li, rows, rows >= 0, values[:, None])


def _updates(host, li, starts, valid, values):
    """values [M, B, K]: block i at rows starts[i] .. + B of layer li where valid[i], one dynamic update each (an
    iteration of a while loop). Not several an iteration, the last repeating the last valid block (the H100 probe:
    a decode step's 8 row writes a layer took 0.23 ms in this loop, 0.03 ms as 8 updates): where the valid count was
    a constant of 1, XLA (CPU, JAX 0.10) compiled two such updates of the same row into no write at all."""
    order = jnp.argsort(~valid, stable=True)
    n_valid = jnp.sum(valid)

    def put(c):
        j, host = c
        i = order[j]
        block = to_host(lax.dynamic_index_in_dim(values, i, keepdims=True).astype(host.dtype))
        return j + 1, lax.dynamic_update_slice(host, block, (li, starts[i], jnp.int32(0)))

    _, host = lax.while_loop(lambda c: c[0] < n_valid, put, (jnp.int32(0), host))
    return host


def _gather_rows(host, flat_rows):
    """Rows [N] of the host pool's flat view (row + layer x R; clipped) brought to the device: a raw gather (jnp
    indexing would add device-side constants to a host operand); XLA runs it on the host. Faster than a host
    computation's gather on an H100 (0.11 against 0.32 ms a step for 2 x 512 rows), flat in the pool's size."""
    flat = host.reshape(-1, host.shape[-1])
    out = lax.gather(flat, to_host(flat_rows)[:, None], _GATHER, (1, flat.shape[1]),
                     mode=lax.GatherScatterMode.CLIP)
    return to_device(out)


# the fewest rows one transfer of a fetch moves (~0.5 MB of bf16 entries)
PULL_ROWS = 512


def transfer_sizes(cap: int) -> tuple[int, ...]:
    """The rows one fetch may move: 0, and one transfer size (PULL_ROWS, or cap / 16 for large steps; at most cap).
    On a GPU the host reads every while loop's condition, a stream synchronisation each: an H100 decode step at a
    full hit paid 0.24 ms a CSA layer (flash-1gpu, 128K) with a loop per size of cap / 4^j down to 16, so a fetch
    now reads one condition when nothing misses and one more per transfer."""
    return (0, min(cap, max(PULL_ROWS, cap // 16)))


def add_counts(counts, li, values):
    """counts [n, 2, F] += values [F] at layer li (low 24 bits, carry into the second row)."""
    lo = counts[li, 0] + values.astype(jnp.int32)
    hi = counts[li, 1] + (lo >> _LOW)
    return counts.at[li].set(jnp.stack([lo & ((1 << _LOW) - 1), hi]))


def total_counts(counts) -> dict:
    """Host side: the counters summed over layers, as Python ints."""
    import numpy as np
    c = np.asarray(counts).astype(np.int64)
    tot = (c[:, 0] + (c[:, 1] << _LOW)).sum(axis=0)
    return {name: int(v) for name, v in zip(COUNTERS, tot)}


def write(hot: dict, host, li, rows, values, largest: int | None = None):
    """Write values [N, K] (the pool's dtype) at layer li's rows [N] (-1: none) to the host pool and, where the row
    is resident, to its hot copy; the rows in runs of `largest` (each batch row's entries of the step, consecutive
    where its pages are). Returns (hot, host)."""
    n, r, _ = host.shape
    h = hot["hot"].shape[1]
    host = _write_rows(host, jnp.asarray(li, jnp.int32), rows.astype(jnp.int32), values, largest)
    at = hot["table"][li][jnp.clip(rows, 0, r - 1)]
    dst = jnp.where((rows >= 0) & (at >= 0), at + li * h, n * h)
    buf = hot["hot"].reshape(-1, values.shape[-1]).at[dst].set(values, mode="drop")
    return dict(hot, hot=buf.reshape(hot["hot"].shape)), host


def _pull(host, missing, n_miss, li, cap: int):
    """The first n_miss rows of `missing` [cap] (layer li's rows, ascending, padded with R) brought from the host
    pool to the device: (rows [cap, K] on the device, rows moved). Blocks of `transfer_sizes`, largest first, each
    size in a while loop that runs while the rest fills it (the smallest: while any is left), so a step moves at
    most n_miss + (the smallest size - 1) rows. Loops, not a switch over the sizes: XLA:GPU accepts host computations
    in a while body but not in a conditional's branch (JAX 0.11.2 on the H200: "expected computation ... to be
    called only by one caller and that caller to be a While")."""
    n, r, k = host.shape
    sizes = transfer_sizes(cap)[:0:-1]  # descending, without 0
    pad = jnp.full((sizes[-1],), r, missing.dtype)
    missing = jnp.concatenate([missing, pad])
    got = jnp.zeros((cap + sizes[-1], k), host.dtype)
    done = jnp.int32(0)
    for j, s in enumerate(sizes):
        def more(c, s=s, last=j == len(sizes) - 1):
            return n_miss - c[0] > 0 if last else n_miss - c[0] >= s

        def move(c, s=s):
            done, got = c
            rows = jnp.minimum(lax.dynamic_slice(missing, (done,), (s,)), r - 1) + li * r
            part = _gather_rows(host, rows)
            return done + s, lax.dynamic_update_slice(got, part.astype(got.dtype), (done, jnp.int32(0)))

        done, got = lax.while_loop(more, move, (done, got))
    return got[:cap], done


# a step reads a group of its rows' whole C4 KV at once when that is at most this many hot buffers of rows (device
# memory for one layer and one group at a time)
WHOLE_READ_BUFFERS = 8


def whole_read_rows(b: int, s: int, t: int, k: int, h: int) -> int:
    """How many of a step's b rows (t query tokens each, selecting k of the row's s entries) read their whole C4 KV
    of a layer at once (b x s rows, read_whole a group): the most rows, dividing b, whose entries fit
    WHOLE_READ_BUFFERS hot buffers of h rows; 0 where the step rather fetches each block of tokens' missing
    selections into the hot buffer (a decode step, or s > t x k: more entries than its selections). The fetch by
    blocks moved up to t x k rows a row and layer, in (t / block) fetches: an H100 prefill of 2 x 512K tokens
    (flash-slice, chunks of 8,192) took 71 s against 19 s with the pool on the device, ~200 ms more a CSA layer a
    chunk (BENCHMARKS, Host offload); with whole reads, 1.58x the device pool's time on an H200."""
    if t <= 1 or s > t * k or s > WHOLE_READ_BUFFERS * h:
        return 0
    return max(g for g in range(1, b + 1) if b % g == 0 and g * s <= WHOLE_READ_BUFFERS * h)


# the columns of a whole read moved per transfer (rows of a group a transfer: this x the group's rows)
WHOLE_READ_COLUMNS = 8192


def read_whole(hot: dict, host, li, rows, selected):
    """Layer li's rows [B, S] (-1: none) of the host pool brought to the device as one array [B * S, K] (row j of
    batch row b at b * S + j), for `selected` selections (counted: none of them hits). Only the columns up to the
    last one in use move, WHOLE_READ_COLUMNS a transfer in a while loop (the rest stay zeros, as does a none):
    the page table is as wide as the program's page bucket, and on a GPU the covering programs' buckets span the
    whole context (an H100 1M prefill of flash-1gpu moved 728.6 GB for 370.3 GB of rows in use; a short prompt on a
    long-context engine moved its whole width each chunk). Returns (hot with the counters added, the array)."""
    n, r, k = host.shape
    b, s = rows.shape
    cols = min(s, WHOLE_READ_COLUMNS)
    flat_rows = jnp.where(rows >= 0, rows, 0) + li * r
    used = jnp.max(jnp.where(rows >= 0, jnp.arange(1, s + 1), 0))  # columns [0, used) hold every row in use

    def move(c):
        done, got = c
        start = jnp.minimum(done, s - cols)  # the last transfer ends at S (it may move some columns again)
        part = _gather_rows(host, lax.dynamic_slice_in_dim(flat_rows, start, cols, axis=1).reshape(-1))
        return done + cols, lax.dynamic_update_slice_in_dim(got, part.reshape(b, cols, k).astype(got.dtype), start, 1)

    moved, got = lax.while_loop(lambda c: c[0] < used, move, (jnp.int32(0), jnp.zeros((b, s, k), host.dtype)))
    valid = jnp.sum(rows >= 0)
    counts = add_counts(hot["counts"], li, jnp.stack([selected, jnp.int32(0), valid, moved * b,
                                                      jnp.int32(0)]))
    return dict(hot, counts=counts), got.reshape(b * s, k)


def fetch(hot: dict, host, li, sel):
    """Make every selected row of layer li resident: sel [...] layer rows (-1: none). Returns (hot, rows of the hot
    buffer's flat view [n * H, K] for each selection, -1 where none)."""
    n, r, k = host.shape
    h = hot["hot"].shape[1]
    flat_sel = sel.reshape(-1)
    cap = min(flat_sel.shape[0], h)
    table, owner, used = hot["table"][li], hot["owner"][li], hot["used"][li]
    valid = flat_sel >= 0
    at = table[jnp.clip(flat_sel, 0, r - 1)]
    hit, miss = valid & (at >= 0), valid & (at < 0)
    now = hot["clock"][li] + 1
    used = used.at[jnp.where(hit, at, h)].set(now, mode="drop")
    # the distinct missing rows, ascending, padded with r
    missing = jnp.unique(jnp.where(miss, flat_sel, r), size=cap, fill_value=r)
    n_miss = jnp.sum(missing < r)
    _, victims = lax.top_k(-used, cap)  # least recently used first (ties: lower row)
    overflow = (n_miss > 0) & (used[victims[jnp.maximum(n_miss - 1, 0)]] == now)

    got, moved = _pull(host, missing, n_miss, li, cap)
    ok = jnp.arange(cap) < n_miss
    put = jnp.where(ok, victims, h)
    old = owner[jnp.minimum(victims, h - 1)]
    table = table.at[jnp.where(ok & (old >= 0), old, r)].set(-1, mode="drop")
    table = table.at[jnp.where(ok, missing, r)].set(victims, mode="drop")
    owner = owner.at[put].set(missing, mode="drop")
    used = used.at[put].set(now, mode="drop")
    buf = hot["hot"].reshape(-1, k).at[jnp.where(ok, victims + li * h, n * h)].set(got, mode="drop")
    out = table[jnp.clip(sel, 0, r - 1)]
    out = jnp.where(sel >= 0, out + li * h, -1)
    counts = add_counts(hot["counts"], li, jnp.stack([
        jnp.sum(valid), jnp.sum(hit), n_miss, moved, overflow]))
    hot = dict(hot=buf.reshape(hot["hot"].shape), table=hot["table"].at[li].set(table),
               owner=hot["owner"].at[li].set(owner), used=hot["used"].at[li].set(used),
               clock=hot["clock"].at[li].set(now), counts=counts)
    return hot, out
