"""What the host pool's write and fetch cost per step, by the pool's size: a jitted call of 8 steps over a host
pool [2, R, 512] (two CSA layers of R rows, bf16, donated), each step writing one row per layer, a prefill chunk's
2,048 rows per layer (consecutive, or on pages apart; offload's blocks against blocks of 32 rows) or gathering 512
rows per layer to the device, in several forms (and: a while loop that moves nothing, offload's fetch at a full hit and
at a full miss, with one transfer size and with the earlier ladder of sizes, its bookkeeping alone, offload's whole
read of 65,536 rows a layer, a decode step's 8 row writes by the loop and unrolled): a scatter and a gather as host computations (compute_on), one
dynamic update a row (v4jax.model.offload's write), a row-at-a-time dynamic slice, and a raw gather with host
operands (offload's fetch). A time that grows with R means the step copies the pool rather than updating it in
place.

    python scripts/offload_probe.py --rows 16384 65536 262144
"""
import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[16384, 65536, 262144])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--what", nargs="*", default=None, help="only these forms (default: every one)")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    from jax import lax

    from jax.experimental.compute_on import compute_on

    from v4jax.model import offload

    n, k = 2, 512
    scatter_dims = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                               scatter_dims_to_operand_dims=(0,))
    gather_dims = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))

    def on_host(fn):  # JAX 0.11 names the result's memory space; 0.10 takes the kind alone
        try:
            return compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(jax.jit(fn))
        except TypeError:
            return compute_on("device_host")(jax.jit(fn))

    def raw_scatter(pool, rows, values):
        flat = pool.reshape(-1, pool.shape[-1])
        out = lax.scatter(flat, rows[:, None], values, scatter_dims, mode=lax.GatherScatterMode.FILL_OR_DROP)
        return out.reshape(pool.shape)

    def raw_gather(pool, rows):
        flat = pool.reshape(-1, pool.shape[-1])
        return lax.gather(flat, rows[:, None], gather_dims, (1, flat.shape[1]), mode=lax.GatherScatterMode.CLIP)

    host_scatter, host_gather = on_host(raw_scatter), on_host(raw_gather)

    def write_call(host, rows):
        def body(i, host):
            for li in range(n):
                vals = jnp.full((1, k), i, host.dtype)
                flat = offload.to_host(lax.dynamic_slice(rows, (i,), (1,)) + li * host.shape[1])
                host = host_scatter(host, flat, offload.to_host(vals))
            return host
        return lax.fori_loop(0, a.steps, body, host)

    def dus_call(host, rows):
        def body(i, host):
            for li in range(n):
                vals = jnp.full((1, k), i, host.dtype)
                host = offload._write_rows(host, jnp.int32(li), lax.dynamic_slice(rows, (i,), (1,)), vals)
            return host
        return lax.fori_loop(0, a.steps, body, host)

    def decode_write(unrolled):
        # a decode step's writes at batch 8: 8 rows a layer (one C4 entry a row), by offload's while loop (a
        # condition the host reads per row and one more) or by 8 dynamic updates unrolled (no loop: what a scratch
        # row for the rows without an entry would allow)
        def call(host, rows):
            def body(i, host):
                for li in range(n):
                    at = (rows[i] + jnp.arange(8, dtype=jnp.int32) * 97) % host.shape[1]
                    vals = jnp.full((8, k), i, host.dtype)
                    if not unrolled:
                        host = offload._write_rows(host, jnp.int32(li), at, vals)
                        continue
                    for j in range(8):
                        block = offload.to_host(vals[j][None, None])
                        host = lax.dynamic_update_slice(host, block, (jnp.int32(li), at[j], jnp.int32(0)))
                return host
            return lax.fori_loop(0, a.steps, body, host)
        return call

    def chunk_write(largest, pages):
        # a prefill chunk's writes: 2,048 rows a layer (8,192 tokens' C4 entries), a step each, on consecutive pages
        # or on 32 pages of 64 rows apart; `largest`: offload's largest block (32: the form before larger blocks)
        def call(host, sel):
            def body(i, host):
                for li in range(n):
                    if pages:
                        first = (sel[i, :32] // 64) * 64
                        rows = (first[:, None] + jnp.arange(64, dtype=jnp.int32)).reshape(-1)
                    else:
                        rows = (sel[i, 0] // 4096) * 2048 + jnp.arange(2048, dtype=jnp.int32)
                    host = offload._write_rows(host, jnp.int32(li), rows, jnp.full((2048, k), i, host.dtype),
                                               largest)
                return host
            return lax.fori_loop(0, a.steps, body, host)
        return call

    def gather_call(host, sel):
        def body(i, acc):
            for li in range(n):
                got = offload.to_device(host_gather(host, offload.to_host(sel[i] + li * host.shape[1])))
                acc = acc + got.astype(jnp.float32).sum()
            return acc
        return host, lax.fori_loop(0, a.steps, body, jnp.float32(0))

    def gather_ds_call(host, sel):
        # rows one at a time: a host dynamic-slice moved to the device (XLA's offloading form), 512 per layer
        def body(i, acc):
            for li in range(n):
                def row(j, acc):
                    got = offload.to_device(lax.dynamic_slice(host, (jnp.int32(li), sel[i, j], jnp.int32(0)),
                                                              (1, 1, k)))
                    return acc + got.astype(jnp.float32).sum()
                acc = lax.fori_loop(0, sel.shape[1], row, acc)
            return acc
        return host, lax.fori_loop(0, a.steps, body, jnp.float32(0))

    def passthrough_call(host, rows):
        # the donated pool carried through the call untouched: what the call costs beside the pool's work
        def body(i, host):
            return host
        return lax.fori_loop(0, a.steps, body, host)

    def gather_take_call(host, sel):
        # a device gather with the host pool as its operand (no host computation)
        def body(i, acc):
            for li in range(n):
                got = offload._gather_rows(host, sel[i] + li * host.shape[1])
                acc = acc + got.astype(jnp.float32).sum()
            return acc
        return host, lax.fori_loop(0, a.steps, body, jnp.float32(0))

    def while_empty_call(host, sel):
        # a while loop per layer a step whose condition is false at once: what a loop costs when it moves nothing
        # (on a GPU the host reads every condition)
        def body(i, acc):
            for _ in range(n):
                acc = lax.while_loop(lambda c: c < sel[i, 0] - sel[i, 0] - 1, lambda c: c + 1, acc)
            return acc
        return host, lax.fori_loop(0, a.steps, body, jnp.int32(0))

    def ladder(cap):  # the transfer sizes before one size: cap / 4^j down to 16, a while loop each
        sizes, s = {cap}, cap
        while s // 4 >= 16:
            s //= 4
            sizes.add(s)
        return (0,) + tuple(sorted(sizes))

    def no_pull(host, missing, n_miss, li, cap):  # the fetch's bookkeeping alone: nothing moves, no loop
        return jnp.zeros((cap, host.shape[-1]), host.dtype), jnp.int32(0)

    def fetch_call(sizes, pull=None):
        # offload.fetch of 512 rows a layer a step: with a buffer of 8 steps' rows every one is resident after the
        # first call (the bookkeeping and loops a step pays at a full hit); with a buffer of 512 rows every one
        # misses (evicted by the other steps'). `sizes`: the transfer sizes (offload's, or the ladder)
        def call(state, sel):
            host, hot = state
            own = offload.transfer_sizes, offload._pull
            offload.transfer_sizes, offload._pull = sizes or own[0], pull or own[1]
            try:
                def body(i, hot):
                    for li in range(n):
                        hot, _ = offload.fetch(hot, host, jnp.int32(li), sel[i][None])
                    return hot
                return host, lax.fori_loop(0, a.steps, body, hot)
            finally:
                offload.transfer_sizes, offload._pull = own
        return call

    def read_whole_call(host, sel):
        # offload.read_whole of 65,536 consecutive rows a layer (a request's C4 KV at 256K tokens) to the device
        hot = {"counts": jnp.zeros((n, 2, len(offload.COUNTERS)), jnp.int32)}

        def body(i, acc):
            # rows that move with the step, so that XLA cannot hoist the gather out of the loop
            rows = ((jnp.arange(65536, dtype=jnp.int32) + i * 64) % host.shape[1])[None]
            for li in range(n):
                _, got = offload.read_whole(hot, host, jnp.int32(li), rows, jnp.int32(0))
                acc = acc + got[i].astype(jnp.float32).sum()
            return acc
        return host, lax.fori_loop(0, a.steps, body, jnp.float32(0))

    def hot_state(r, h=8 * 512):
        from v4jax.cache.pools import HOT_COUNTERS
        return {"hot": jnp.zeros((n, h, k), jnp.bfloat16), "table": jnp.full((n, r), -1, jnp.int32),
                "owner": jnp.full((n, h), -1, jnp.int32), "used": jnp.full((n, h), -1, jnp.int32),
                "clock": jnp.zeros((n,), jnp.int32), "counts": jnp.zeros((n, 2, len(HOT_COUNTERS)), jnp.int32)}

    results = []
    for r in a.rows:
        key = jax.random.key(0)
        rows = jax.random.randint(key, (a.steps,), 0, r, jnp.int32)
        sel = jax.random.randint(key, (a.steps, 512), 0, r, jnp.int32)
        for name, fn in (("passthrough", passthrough_call), ("write_scatter", write_call), ("write_dus", dus_call),
                         ("write_chunk_2048", chunk_write(None, False)),
                         ("write_chunk_2048_blocks_32", chunk_write(32, False)),
                         ("write_chunk_2048_pages", chunk_write(None, True)),
                         ("write_chunk_2048_pages_blocks_32", chunk_write(32, True)), ("gather_512", gather_call),
                         ("gather_ds_512", gather_ds_call),
                         ("gather_take_512", gather_take_call), ("while_empty", while_empty_call),
                         ("decode_write_8", decode_write(False)), ("decode_write_8_unrolled", decode_write(True)),
                         ("fetch_hit_512", fetch_call(None)), ("fetch_hit_512_ladder", fetch_call(ladder)),
                         ("fetch_hit_512_bookkeeping", fetch_call(None, no_pull)),
                         ("fetch_miss_512", fetch_call(None)), ("fetch_miss_512_ladder", fetch_call(ladder)),
                         ("read_whole_65536", read_whole_call)):
            if a.what and name not in a.what:
                continue
            host = offload.to_host(jnp.zeros((n, r, k), jnp.bfloat16))
            if name.startswith("fetch"):
                host = (host, hot_state(r, 512 if "miss" in name else 8 * 512))
            f = jax.jit(fn, donate_argnums=0)
            try:
                out = f(host, rows if name.startswith(("write_s", "write_d", "pass", "decode")) else sel)
                jax.block_until_ready(out)
                host = out[0] if name.startswith(("gather", "while", "read")) else out
                times = []
                for _ in range(a.iters):
                    t0 = time.perf_counter()
                    out = f(host, rows if name.startswith(("write_s", "write_d", "pass", "decode")) else sel)
                    jax.block_until_ready(out)
                    host = out[0] if name.startswith(("gather", "while", "read")) else out
                    times.append(time.perf_counter() - t0)
                row = {"what": name, "rows": r, "pool_mib": n * r * k * 2 / 2**20,
                       "ms_per_step": 1e3 * min(times) / a.steps}
            except Exception as e:  # noqa: BLE001 - a form that does not compile here is a result too
                row = {"what": name, "rows": r, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps(row), flush=True)
            results.append(row)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
