"""Time jax.experimental.transfer between two transfer servers of one process, per backend: a state of N arrays
(a 32K flash-slice request is 23 MB in 20 arrays) offered on one server and pulled through the other into the
backend's device, median of the repeats. Tells whether a backend's transfer server runs at all (its error is
printed) and what a pull into device memory costs against one through host memory (the CPU backend).

    python scripts/transfer_probe.py [--mb 23] [--arrays 20] [--repeats 5] [--backends gpu cpu]
    python scripts/transfer_probe.py --state     # the servers' StateTransport: checksum, offer, pull
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def probe(backend: str, mb: float, n: int, repeats: int) -> dict:
    from jax.experimental import transfer
    dev = jax.local_devices(backend=backend)[0]
    sender = transfer.start_transfer_server(dev.client, "127.0.0.1:0", ["127.0.0.1:0"])
    receiver = transfer.start_transfer_server(dev.client, "127.0.0.1:0", ["127.0.0.1:0"])
    conn = receiver.connect(sender.address())
    per = int(mb * 1e6 / n / 2)
    arrays = [jax.device_put(jnp.arange(per, dtype=jnp.bfloat16) + i, dev) for i in range(n)]
    jax.block_until_ready(arrays)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(dev)) for a in arrays]
    times = []
    for uid in range(1, repeats + 2):
        t = time.perf_counter()
        sender.await_pull(uid, arrays)
        got = conn.pull(uid, structs)
        jax.block_until_ready(got)
        times.append(time.perf_counter() - t)
    ok = all(bool(jnp.array_equal(a, b)) for a, b in zip(arrays, got))
    ms = statistics.median(times[1:]) * 1e3
    return {"backend": backend, "device": str(dev), "bytes": per * 2 * n, "ms": ms,
            "GB/s": per * 2 * n / ms / 1e6, "equal": ok, "first_ms": times[0] * 1e3}


def probe_state(mb: float, n: int, repeats: int) -> dict:
    """The servers' own path (v4jax.serve.pd.StateTransport, transport jax): the checksum, an offer, a pull (the
    arrays checked against the checksum on arrival) of a state of N bf16 arrays; medians of the repeats."""
    import ml_dtypes
    from v4jax.engine import transfer as T
    from v4jax.serve.pd import StateTransport
    rng = np.random.default_rng(0)
    per = int(mb * 1e6 / n / 2)
    arrays = {f"pool{i}/group/field": rng.standard_normal(per).astype(ml_dtypes.bfloat16) for i in range(n)}
    state = T.RequestState({"request": {"request_id": "probe"}}, arrays)
    sender, receiver = StateTransport(path="jax"), StateTransport(path="jax")
    times = {"checksum": [], "offer": [], "pull": []}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        T.checksum(arrays)
        t1 = time.perf_counter()
        control = sender.offer(state)
        t2 = time.perf_counter()
        got = receiver.pull(control)
        t3 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[k].append(v)
    assert all(np.array_equal(got.arrays[k].view(np.uint16), v.view(np.uint16)) for k, v in arrays.items())
    return {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()} | {"bytes": state.nbytes()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=23.0)
    p.add_argument("--arrays", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["gpu", "cpu"])
    p.add_argument("--state", action="store_true", help="time the servers' own path instead (StateTransport: "
                   "checksum, offer, pull)")
    a = p.parse_args()
    if a.state:
        r = probe_state(a.mb, a.arrays, a.repeats)
        print(f"StateTransport (jax), {r['bytes']:,} bytes in {a.arrays} arrays, median of {a.repeats}: checksum "
              f"{r['checksum']:.1f} ms, offer {r['offer']:.1f} ms, pull {r['pull']:.1f} ms")
        return
    print("| backend | device | bytes | pull ms (median) | GB/s | first ms | equal | error |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for b in a.backends:
        try:
            r = probe(b, a.mb, a.arrays, a.repeats)
            print(f"| {b} | {r['device']} | {r['bytes']:,} | {r['ms']:.2f} | {r['GB/s']:.2f} | {r['first_ms']:.1f} | "
                  f"{r['equal']} | |", flush=True)
        except Exception as e:  # a backend whose transfer server cannot run: say so
            print(f"| {b} | - | - | - | - | - | - | {type(e).__name__}: {str(e)[:200]} |", flush=True)


if __name__ == "__main__":
    main()
