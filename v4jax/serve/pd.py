"""Moving a request's state (v4jax.cache.transfer.RequestState) between servers: the bytes by
`jax.experimental.transfer` (the receiver pulls them from the sender's transfer server), or over HTTP; what and
how much in a control message (the request, every array's shape and dtype, one checksum per transfer) that
travels over the servers' own HTTP.

    sender:    control = transport.offer(state)            # JSON: uuid, address, specs, checksum, meta
    receiver:  state = transport.pull(control, fetch)      # the arrays, checked against specs and checksum

Paths (`--pd-transport`): "jax" (default): the sender offers the arrays on its transfer server (started on the
host's CPU backend, bound to the server's host) under a random 62-bit uuid, the receiver connects and pulls them;
"http": the receiver GETs the bytes (v4jax.cache.transfer.to_bytes) from the sender's /v4jax/pd/state/{uuid},
which hands each offer out once.

An offer is withdrawn when nobody takes it within `offer_timeout_s` (its receiver died, or dropped the request):
its arrays leave the transfer server (the jax path offers them with that deadline, after which the server drops
them and a pull of them never arrives; measured on JAX 0.10: ten 100 MB offers left 95 MB held, 954 MB without
the deadline) or its bytes are dropped (http path), and the sender logs it and counts it
(`v4jax_pd_offers_withdrawn_total`). The request's pages came back when its state was exported; what an offer
holds is that state's copy in host memory (`v4jax_pd_offered_bytes`). The receiver says it took an offer
(`taken`: the http path's GET, the jax path's DELETE of /v4jax/pd/state/{uuid} after its pull), so that taken
offers are not counted as withdrawn."""
from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import secrets
import threading
import time
from typing import Callable

import jax
import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from v4jax.engine import transfer as T

log = logging.getLogger("v4jax.serve")

PATHS = ("jax", "http")
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


# ---- jax.experimental.transfer, the same on JAX 0.10 and 0.11 ----
def start_transfer_server(host: str):
    """A transfer server on the host's CPU backend, listening on `host` (an ephemeral port)."""
    from jax.experimental import transfer
    client = jax.local_devices(backend="cpu")[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


def await_pull(server, uuid: int, arrays: list, deadline: datetime.datetime) -> bool:
    """server.await_pull until `deadline` (the server then drops the arrays); False where this JAX's await_pull
    takes no deadline (the arrays then stay until the process ends)."""
    try:
        server.await_pull(uuid, arrays, timeout=deadline)
        return True
    except TypeError:
        server.await_pull(uuid, arrays)
        return False


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
        self.withdrawn = Counter("v4jax_pd_offers_withdrawn", "Offered request states nobody took within the "
                                 "offer timeout, dropped by the sender", registry=registry)
        self.offered = Gauge("v4jax_pd_offers", "Request states offered and not yet taken nor withdrawn",
                             registry=registry)
        self.offered_bytes = Gauge("v4jax_pd_offered_bytes", "Bytes of the request states offered and not yet taken "
                                   "nor withdrawn (host memory)", registry=registry)

    def observe(self, direction: str, path: str, state: T.RequestState, seconds: float) -> None:
        self.transfers.labels(direction=direction, path=path).inc()
        for pool, n in state.bytes_by_pool().items():
            self.bytes.labels(direction=direction, pool=pool).inc(n)
        self.seconds.labels(direction=direction).observe(seconds)


@dataclasses.dataclass
class _Offer:
    request_id: str
    nbytes: int
    deadline: float  # time.monotonic()
    data: bytes | None  # the http path's bytes


class StateTransport:
    def __init__(self, host: str = "127.0.0.1", path: str = "jax", metrics: TransferMetrics | None = None,
                 timeout_s: float = 30.0, offer_timeout_s: float = 60.0):
        if path not in PATHS:
            raise ValueError(f"pd_transport must be one of {list(PATHS)}, got {path!r}")
        if not offer_timeout_s > 0:
            raise ValueError(f"the offer timeout must be > 0 seconds, got {offer_timeout_s!r}")
        self.path, self.metrics, self.timeout_s, self.offer_timeout_s = path, metrics, timeout_s, offer_timeout_s
        self._server = start_transfer_server(host) if path == "jax" else None
        self._device = jax.local_devices(backend="cpu")[0]
        self._lock = threading.Lock()
        self._connections: dict[str, object] = {}
        self._offers: dict[int, _Offer] = {}  # offered, neither taken nor withdrawn
        self._sweeper: threading.Thread | None = None
        self._closed = threading.Event()
        self._warned = False  # that offers on the jax path cannot be withdrawn (said once)
        self.withdrawn = 0

    # ---- sender ----
    def offer(self, state: T.RequestState) -> dict:
        t = time.perf_counter()
        uid = secrets.randbits(62)
        names = sorted(state.arrays)
        # The deadline on a whole second: the transfer server drops the fraction of one (measured on JAX 0.10: an
        # offer 0.5 s ahead made at .1 s past a second was gone at once), so both drop it at the same moment.
        wall = time.time()
        deadline = float(math.ceil(wall + self.offer_timeout_s))
        control = {"uuid": uid, "path": self.path, "specs": state.specs(), "checksum": T.checksum(state.arrays),
                   "meta": state.meta, "timeout_s": deadline - wall}
        offer = _Offer(state.request_id, state.nbytes(), time.monotonic() + deadline - wall, None)
        if self.path == "jax":
            # empty arrays (no entry of a ratio yet) are not sent: a pulled empty buffer never becomes ready
            arrays = [jax.device_put(np.ascontiguousarray(state.arrays[n]), self._device) for n in names
                      if state.arrays[n].size]
            if not await_pull(self._server, uid, arrays, datetime.datetime.fromtimestamp(deadline)) \
                    and not self._warned:
                self._warned = True
                log.warning("this JAX's transfer server takes no deadline: an offered state nobody pulls stays in "
                            "host memory until the process ends (use --pd-transport http to have it dropped)")
            control["address"] = self._server.address()
        else:
            offer.data = T.to_bytes(state)
        with self._lock:
            self._offers[uid] = offer
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep_loop, name="v4jax-pd-offers", daemon=True)
                self._sweeper.start()
        self._gauge()
        if self.metrics is not None:
            self.metrics.observe("sent", self.path, state, time.perf_counter() - t)
        return control

    def take_bytes(self, uid: int) -> bytes | None:
        """The http path's offer `uid`, once (None: unknown, withdrawn or taken)."""
        offer = self.taken(uid)
        return None if offer is None else offer.data

    def taken(self, uid: int) -> _Offer | None:
        """The receiver took offer `uid` (or gave up on it): it leaves the books. None if it was not there."""
        with self._lock:
            offer = self._offers.pop(uid, None)
        self._gauge()
        return offer

    def withdraw_expired(self, now: float | None = None) -> list[str]:
        """Drop the offers past their deadline; the ids of their requests (each logged and counted)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = {k: o for k, o in self._offers.items() if o.deadline <= now}
            for k in gone:
                del self._offers[k]
        for uid, o in gone.items():
            self.withdrawn += 1
            if self.metrics is not None:
                self.metrics.withdrawn.inc()
            log.warning("withdrew the state of request %s (%d bytes, offer %d): nobody pulled it within %g s",
                        o.request_id, o.nbytes, uid, self.offer_timeout_s)
        if gone:
            self._gauge()
        return [o.request_id for o in gone.values()]

    def offered(self) -> tuple[int, int]:
        """(offers, bytes) offered and neither taken nor withdrawn."""
        with self._lock:
            return len(self._offers), sum(o.nbytes for o in self._offers.values())

    def _gauge(self) -> None:
        if self.metrics is not None:
            n, b = self.offered()
            self.metrics.offered.set(n)
            self.metrics.offered_bytes.set(b)

    def _sweep_loop(self) -> None:
        # a tenth of the timeout (at most a second): an offer is withdrawn within that of its deadline
        period = min(1.0, self.offer_timeout_s / 10)
        while not self._closed.wait(period):
            self.withdraw_expired()

    def close(self) -> None:
        self._closed.set()

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
        # no longer than the offer lives on the sender (then it is withdrawn: it will never arrive)
        wait_s = min(self.timeout_s, float(control.get("timeout_s", self.timeout_s)) + 1.0)
        got = pull_arrays(self._connect(control["address"]), int(control["uuid"]), structs, wait_s)
        # a pull whose sender died (or withdrew the offer) never becomes ready and never fails: wait with a deadline
        deadline = time.monotonic() + wait_s
        while not all(a.is_ready() for a in got):
            if time.monotonic() > deadline:
                self.forget(control["address"])
                raise T.TransferError(f"the state from {control['address']} did not arrive within "
                                      f"{wait_s:g} s (the sender died, stalled or withdrew it)")
            time.sleep(0.001)
        arrays = {n: np.zeros(shape, dt) for n, (shape, dt) in specs.items() if n not in names}  # the empty ones
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
