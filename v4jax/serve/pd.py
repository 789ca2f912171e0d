"""Moving a request's state (v4jax.cache.transfer.RequestState) between servers: the bytes by
`jax.experimental.transfer` (the receiver pulls them from the sender's transfer server), or over HTTP; what and
how much in a control message (the request, every array's shape and dtype, one checksum per transfer) that
travels over the servers' own HTTP.

    sender:    control = transport.offer(state)            # JSON: uuid, address, specs, checksum, meta
    receiver:  state = transport.pull(control, fetch)      # the arrays, checked against specs and checksum

Paths (`--pd-transport`): "jax" (default): the sender offers the arrays on its transfer server (started on the
host's CPU backend, bound to the server's host) under a random 62-bit uuid, the receiver connects and pulls them;
"http": the receiver GETs the bytes (v4jax.cache.transfer.to_bytes) from the sender's /v4jax/pd/state/{uuid},
which hands each offer out once. A state that was offered and never taken (its receiver died) stays on the
sender: on the jax path the transfer server holds it until the process ends (its API has no withdrawal); on the
http path it is dropped after `offer_ttl_s`."""
from __future__ import annotations

import datetime
import secrets
import threading
import time
from typing import Callable

import jax
import numpy as np
from prometheus_client import Counter, Histogram

from v4jax.engine import transfer as T

PATHS = ("jax", "http")
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


# ---- jax.experimental.transfer, the same on JAX 0.10 and 0.11 ----
def start_transfer_server(host: str):
    """A transfer server on the host's CPU backend, listening on `host` (an ephemeral port)."""
    from jax.experimental import transfer
    client = jax.local_devices(backend="cpu")[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


def pull_arrays(connection, uuid: int, structs: list, timeout_s: float) -> list:
    """connection.pull with a deadline: JAX 0.10's pull takes an absolute `timeout`, later ones may not (then the
    pull waits as long as the sender lives; a sender that dies fails it)."""
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        return connection.pull(uuid, structs, timeout=deadline)
    except TypeError:
        return connection.pull(uuid, structs)


class TransferMetrics:
    """Prometheus series of state transfers, in the server's registry."""

    def __init__(self, registry):
        self.transfers = Counter("v4jax_pd_transfers", "Request states moved between servers", ["direction", "path"],
                                 registry=registry)
        self.failures = Counter("v4jax_pd_transfer_failures", "Request states that could not be moved or were "
                                "refused (corrupted, truncated, another format, the peer gone)", ["direction"],
                                registry=registry)
        self.bytes = Counter("v4jax_pd_transfer_bytes", "Bytes of request state moved, by pool", ["direction", "pool"],
                             registry=registry)
        self.seconds = Histogram("v4jax_pd_transfer_seconds", "Time to offer (sent) or pull and check (received) "
                                 "one request's state", ["direction"], buckets=_SECONDS_BUCKETS, registry=registry)

    def observe(self, direction: str, path: str, state: T.RequestState, seconds: float) -> None:
        self.transfers.labels(direction=direction, path=path).inc()
        for pool, n in state.bytes_by_pool().items():
            self.bytes.labels(direction=direction, pool=pool).inc(n)
        self.seconds.labels(direction=direction).observe(seconds)


class StateTransport:
    def __init__(self, host: str = "127.0.0.1", path: str = "jax", metrics: TransferMetrics | None = None,
                 timeout_s: float = 30.0, offer_ttl_s: float = 300.0):
        if path not in PATHS:
            raise ValueError(f"pd_transport must be one of {list(PATHS)}, got {path!r}")
        self.path, self.metrics, self.timeout_s, self.offer_ttl_s = path, metrics, timeout_s, offer_ttl_s
        self._server = start_transfer_server(host) if path == "jax" else None
        self._device = jax.local_devices(backend="cpu")[0]
        self._lock = threading.Lock()
        self._connections: dict[str, object] = {}
        self._offers: dict[int, tuple[float, bytes]] = {}  # http path: uuid -> (time, bytes)

    # ---- sender ----
    def offer(self, state: T.RequestState) -> dict:
        t = time.perf_counter()
        uid = secrets.randbits(62)
        names = sorted(state.arrays)
        control = {"uuid": uid, "path": self.path, "specs": state.specs(), "checksum": T.checksum(state.arrays),
                   "meta": state.meta}
        if self.path == "jax":
            # empty arrays (no entry of a ratio yet) are not sent: a pulled empty buffer never becomes ready
            arrays = [jax.device_put(np.ascontiguousarray(state.arrays[n]), self._device) for n in names
                      if state.arrays[n].size]
            self._server.await_pull(uid, arrays)
            control["address"] = self._server.address()
        else:
            now = time.monotonic()
            with self._lock:
                for k in [k for k, (t0, _) in self._offers.items() if now - t0 > self.offer_ttl_s]:
                    del self._offers[k]
                self._offers[uid] = (now, T.to_bytes(state))
        if self.metrics is not None:
            self.metrics.observe("sent", self.path, state, time.perf_counter() - t)
        return control

    def take_bytes(self, uid: int) -> bytes | None:
        """The http path's offer `uid`, once (None: unknown, expired or taken)."""
        with self._lock:
            got = self._offers.pop(uid, None)
        return None if got is None else got[1]

    # ---- receiver ----
    def pull(self, control: dict, fetch_bytes: Callable[[int], bytes] | None = None) -> T.RequestState:
        """The state a control message describes: pulled from the sender's transfer server (path "jax") or
        fetched by `fetch_bytes(uuid)` (path "http"); TransferError if it is truncated, corrupted or does not
        match its specs; the transport's error if the sender is gone."""
        t = time.perf_counter()
        try:
            state = self._pull(control, fetch_bytes)
        except Exception:
            if self.metrics is not None:
                self.metrics.failures.labels(direction="received").inc()
            raise
        if self.metrics is not None:
            self.metrics.observe("received", control["path"], state, time.perf_counter() - t)
        return state

    def _pull(self, control: dict, fetch_bytes) -> T.RequestState:
        specs = T.specs_to_dtypes(control["specs"])
        if control["path"] == "http":
            state = T.from_bytes(fetch_bytes(control["uuid"]))
            if state.specs() != control["specs"]:
                raise T.TransferError("the state fetched does not match its control message's specs")
            T.verify(state.arrays, control["checksum"])
            return T.RequestState(control["meta"], state.arrays)
        names = [n for n in sorted(specs) if np.prod(specs[n][0])]
        structs = [T.jax_struct(specs[n][0], specs[n][1], self._device) for n in names]
        got = pull_arrays(self._connect(control["address"]), int(control["uuid"]), structs, self.timeout_s)
        # a pull whose sender died before sending never becomes ready and never fails: wait with a deadline
        deadline = time.monotonic() + self.timeout_s
        while not all(a.is_ready() for a in got):
            if time.monotonic() > deadline:
                self.forget(control["address"])
                raise T.TransferError(f"the state from {control['address']} did not arrive within "
                                      f"{self.timeout_s:g} s (the sender died or stalled)")
            time.sleep(0.001)
        arrays = {n: np.zeros(shape, dt) for n, (shape, dt) in specs.items()}
        arrays.update({n: np.asarray(a) for n, a in zip(names, got)})
        T.verify(arrays, control["checksum"])
        return T.RequestState(control["meta"], arrays)

    def _connect(self, address: str):
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                if self._server is None:
                    self._server = start_transfer_server("127.0.0.1")
                conn = self._connections[address] = self._server.connect(address)
            return conn

    def forget(self, address: str) -> None:
        """Drop a cached connection (its server died)."""
        with self._lock:
            self._connections.pop(address, None)
