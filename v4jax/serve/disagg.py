"""Prefill/decode disaggregation behind the orchestrator's engine seam (v4jax.serve.engine.ServingEngine).

    PrefillEngine   a prefill server's: requests from a decode server (`begin_prefill`) stop after their first
                    token; their state is exported and offered on the transport, and the decode server is answered
                    with its control message. Requests sent to its own OpenAI routes run as on a combined server.
    DecodeEngine    a decode server's: a request that names prefill servers (the router's choice, least loaded
                    first) is prefilled there (a worker thread calls the first, and once more the next if that
                    fails), its state pulled and imported; it then decodes here and streams from here. A request
                    that names none runs as on a combined server.
    LocalDisagg     both engines in one process (notebooks, tests): each step runs the prefill engine, moves every
                    finished prefill's state to the decode engine (through its bytes, as between servers), and
                    runs the decode engine.

Every request's pages come back on both sides: the prefill side frees its slot once the state is exported (the
prefix cache keeps its full pages), the decode side when the request ends or is aborted."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import uuid
from typing import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from v4jax.engine import transfer as T
from v4jax.engine.core import EngineCore, RequestDelta
from v4jax.engine.sampling import SamplingParams
from v4jax.serve.engine import LocalEngine
from v4jax.serve.orchestrator import Unavailable
from v4jax.serve.protocol import ApiError
from v4jax.serve.streams import read_json
from v4jax.serve.pd import StateTransport

log = logging.getLogger("v4jax.serve")
MODES = ("prefill", "decode")
SECRET_HEADER = "x-v4jax-pd-secret"
PREFILL_HEADER = "x-v4jax-prefill"  # the router's prefill servers for a request, comma-separated, best first
PREFILL_ROUTE = "/v4jax/pd/prefill"
STATE_ROUTE = "/v4jax/pd/state"


class PrefillEngine(LocalEngine):
    def __init__(self, core: EngineCore, transport: StateTransport, score_prompt=None):
        super().__init__(core, score_prompt)
        self.transport = transport
        self.format = core.transfer_format()  # at start (a pass over the weights), not at the first request
        self._pending: dict[str, concurrent.futures.Future] = {}

    def begin_prefill(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                      sample_index: int) -> concurrent.futures.Future:
        """(On the engine thread.) Prefill a request for a decode server; the future resolves, after the step that
        gives its first token, to {"transfer": control message} or, for a request that ended at its first token,
        {"finished": {token_ids, logprobs, top_logprobs, finish_reason}}. Raises ValueError for a request that
        could never run here."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.core.add_request(request_id, prompt_ids, params, sample_index=sample_index, prefill_only=True)
        self._pending[request_id] = fut
        return fut

    def step(self):
        out = []
        for d in self.core.step():
            fut = self._pending.pop(d.request_id, None)
            if fut is None:
                out.append(d)
            elif d.finish_reason is None:
                try:
                    fut.set_result({"transfer": self.transport.offer(self.core.export_request(d.request_id))})
                except Exception as e:  # this request fails, the engine goes on
                    log.exception("exporting request %s failed", d.request_id)
                    self.core.abort(d.request_id)
                    fut.set_exception(e)
            elif d.finish_reason == "abort":
                fut.set_exception(RuntimeError("the request was aborted on the prefill server"))
            else:
                fut.set_result({"finished": {"token_ids": d.new_token_ids, "logprobs": d.new_logprobs,
                                             "top_logprobs": d.new_top_logprobs, "finish_reason": d.finish_reason}})
        return out

    def abort(self, request_id):
        fut = self._pending.pop(request_id, None)
        if fut is not None:
            fut.set_exception(RuntimeError("the request was aborted on the prefill server"))
        return self.core.abort(request_id)

    def fail_step(self) -> None:
        for rid, fut in list(self._pending.items()):
            fut.set_exception(RuntimeError("the prefill server's engine step failed"))
            self.core.abort(rid)
        self._pending.clear()
        super().fail_step()


def _say_taken(url: str, uid: int, headers: dict) -> None:
    import httpx
    try:
        httpx.delete(f"{url}{STATE_ROUTE}/{uid}", headers=headers, timeout=10.0)
    except httpx.HTTPError as e:  # the sender withdraws it at its deadline anyway
        log.info("could not tell %s that state %d was taken: %s", url, uid, e)


class DecodeEngine(LocalEngine):
    def __init__(self, core: EngineCore, transport: StateTransport, secret: str | None = None,
                 timeout_s: float = 600.0, workers: int = 8):
        super().__init__(core)
        self.transport, self.secret, self.timeout_s = transport, secret, timeout_s
        self.format = core.transfer_format()  # sent with each prefill: a prefill server of another model refuses
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="v4jax-pd-pull")
        self._remote: dict[str, concurrent.futures.Future] = {}
        self._done: queue.Queue = queue.Queue()  # request ids whose remote prefill finished
        self._failed: dict[str, str] = {}
        self._aborted: list[str] = []
        self.retries = 0  # prefills retried on another server

    def add_request(self, request_id, prompt_ids, params, sample_index, route=None):
        urls = (route or {}).get("prefill")
        if not urls:
            return super().add_request(request_id, prompt_ids, params, sample_index)
        self.core.request_check(prompt_ids, params)
        fut = self._pool.submit(self._prefill_remote, list(urls), request_id, list(map(int, prompt_ids)), params,
                                sample_index)
        self._remote[request_id] = fut
        fut.add_done_callback(lambda _f, rid=request_id: self._done.put(rid))

    def _prefill_remote(self, urls: list[str], request_id: str, prompt: list[int], params: SamplingParams,
                        sample_index: int):
        """(A worker thread.) Prefill on the first server, once more on the next if it fails; the state pulled
        (or the request's end, when it ended at its first token). ValueError: refused as a request; Unavailable
        (as the message) when no server could do it."""
        import httpx
        headers = {SECRET_HEADER: self.secret} if self.secret else {}
        body = {"request_id": request_id, "prompt_ids": prompt, "params": dataclasses.asdict(params),
                "sample_index": sample_index, "format": self.format}
        errors = []
        for i, url in enumerate(urls[:2]):
            if i:
                self.retries += 1
            url = url.rstrip("/")
            try:
                r = httpx.post(url + PREFILL_ROUTE, json=body, headers=headers, timeout=self.timeout_s)
                if r.status_code == 409:  # another model there: this server cannot, another may
                    raise T.TransferError(r.json().get("error", {}).get("message", r.text))
                if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                    raise ValueError(r.json().get("error", {}).get("message", r.text))
                r.raise_for_status()
                got = r.json()
                if "finished" in got:
                    return got
                control = got["transfer"]

                def fetch(uid, url=url):
                    resp = httpx.get(f"{url}{STATE_ROUTE}/{uid}", headers=headers, timeout=self.timeout_s)
                    resp.raise_for_status()
                    return resp.content
                try:
                    return {"state": self.transport.pull(control, fetch)}
                finally:
                    if control["path"] == "jax":  # taken (or given up): the sender stops counting it as offered
                        _say_taken(url, control["uuid"], headers)
            except ValueError as e:
                if not isinstance(e, T.TransferError):
                    raise
                errors.append(f"{url}: {e}")
            except Exception as e:  # the server or the transfer failed: the next server
                errors.append(f"{url}: {type(e).__name__}: {e}")
            log.warning("prefill of %s failed on %s", request_id, errors[-1])
        raise RuntimeError(Unavailable("no prefill server could prefill the request: " + "; ".join(errors)))

    def step(self):
        deltas = []
        for rid in self._aborted:
            deltas.append(RequestDelta(rid, [], [], "abort"))
        self._aborted = []
        if not self.core.has_unfinished_requests() and self._remote and not deltas:
            try:  # only remote prefills in flight: wait for one rather than spin
                self._done.put(self._done.get(timeout=0.05))
            except queue.Empty:
                pass
        while True:
            try:
                rid = self._done.get_nowait()
            except queue.Empty:
                break
            fut = self._remote.pop(rid, None)
            if fut is None or fut.cancelled():
                continue
            try:
                got = fut.result()
            except ValueError as e:
                self._failed[rid] = str(e)
                continue
            except Exception as e:
                msg = e.args[0] if e.args and isinstance(e.args[0], Unavailable) else Unavailable(
                    f"prefill failed: {type(e).__name__}: {e}")
                self._failed[rid] = msg
                continue
            if "finished" in got:
                f = got["finished"]
                tops = [[tuple(p) for p in t] for t in f.get("top_logprobs", [])]
                deltas.append(RequestDelta(rid, f["token_ids"], f["logprobs"], f["finish_reason"], tops))
                continue
            try:
                self.core.import_request(got["state"], request_id=rid)
            except ValueError as e:  # another format, truncated: this request fails
                self.transport.metrics and self.transport.metrics.failures.labels(direction="received").inc()
                self._failed[rid] = Unavailable(f"the request's state was refused: {e}")
        if self.core.has_unfinished_requests():
            deltas += self.core.step()
        return deltas

    def abort(self, request_id):
        fut = self._remote.pop(request_id, None)
        if fut is not None:
            fut.cancel()
            self._aborted.append(request_id)
            return True
        return self.core.abort(request_id)

    def failed(self) -> dict[str, str]:
        out, self._failed = self._failed, {}
        return out

    def request_ids(self) -> set[str]:
        return super().request_ids() | set(self._remote) | set(self._aborted)

    def has_unfinished_requests(self):
        return self.core.has_unfinished_requests() or bool(self._remote) or bool(self._aborted) \
            or not self._done.empty()

    def stats(self):
        out = self.core.stats()
        out["requests"] = dict(out["requests"], remote_prefills=len(self._remote), prefill_retries=self.retries)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class LocalDisagg(LocalEngine):
    """A prefill engine and a decode engine in one process, as one ServingEngine (the decode engine's limits and
    slots). `via_bytes`: each state goes through its byte form and checksum, as between servers."""

    def __init__(self, prefill: EngineCore, decode: EngineCore, via_bytes: bool = True):
        super().__init__(decode)
        self.prefill, self.decode, self.via_bytes = prefill, decode, via_bytes
        self.max_num_seqs = decode.layout.max_slots + prefill.layout.max_slots
        self.transfers = 0
        self.bytes_by_pool: dict[str, int] = {}
        self._lock = threading.Lock()
        self._failed: dict[str, str] = {}

    def check(self, prompt_ids, params):
        self.prefill.request_check(prompt_ids, params)
        self.decode.request_check(prompt_ids, params)

    def add_request(self, request_id, prompt_ids, params, sample_index, route=None):
        self.prefill.add_request(request_id, prompt_ids, params, sample_index=sample_index, prefill_only=True)

    def abort(self, request_id):
        return self.prefill.abort(request_id) or self.decode.abort(request_id)

    def step(self):
        out = []
        for d in self.prefill.step() if self.prefill.has_unfinished_requests() else []:
            if d.finish_reason is not None:
                out.append(d)  # ended at its first token (or aborted) on the prefill side
                continue
            state = self.prefill.export_request(d.request_id)
            if self.via_bytes:
                state = T.from_bytes(T.to_bytes(state))
            for pool, n in state.bytes_by_pool().items():
                self.bytes_by_pool[pool] = self.bytes_by_pool.get(pool, 0) + n
            self.transfers += 1
            try:
                self.decode.import_request(state, request_id=d.request_id)
            except ValueError as e:  # another model or format, or a request the decode engine cannot hold
                log.warning("request %s failed: its state was refused: %s", d.request_id, e)
                self._failed[d.request_id] = f"the request's state was refused: {e}"
        if self.decode.has_unfinished_requests():
            out += self.decode.step()
        return out

    def fail_step(self) -> None:
        for core in (self.prefill, self.decode):
            for r in [r.request_id for r in core.scheduler.slots if r is not None]:
                core.abort(r)

    def failed(self) -> dict[str, str]:
        out, self._failed = self._failed, {}
        return out

    def request_ids(self):
        return set(self.prefill.scheduler.requests) | set(self.decode.scheduler.requests) | set(self.decode._imports)

    def has_unfinished_requests(self):
        return self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()

    def stats(self):
        out = self.decode.stats()
        out["prefill"] = self.prefill.stats()
        out["transfers"] = {"count": self.transfers, "bytes_by_pool": dict(self.bytes_by_pool)}
        return out

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]):
        """Token ids and log-probs of each prompt, run to the end (notebooks, tests). A request whose state the
        decode engine refused raises TransferError once every other has ended."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"disagg-{i}" for i in range(len(prompts))]
        out = {rid: ([], []) for rid in ids}
        failed = {}
        for rid, p, sp in zip(ids, prompts, params):
            self.add_request(rid, p, sp, 0)
        while self.has_unfinished_requests():
            for d in self.step():
                if d.request_id in out:
                    out[d.request_id][0].extend(d.new_token_ids)
                    out[d.request_id][1].extend(d.new_logprobs)
            failed.update(self.failed())
        if failed:
            raise T.TransferError("; ".join(f"prompt {ids.index(rid)}: {msg}" for rid, msg in sorted(failed.items())))
        return [out[rid] for rid in ids]


def pd_router(state):
    """A prefill server's routes for decode servers: POST /v4jax/pd/prefill ({request_id, prompt_ids, params,
    sample_index} -> {"transfer": control message} or {"finished": ...}), GET /v4jax/pd/state/{uuid} (the http
    transport's bytes, once), DELETE /v4jax/pd/state/{uuid} (the jax transport's offer was pulled)."""
    r = APIRouter()

    @r.post(PREFILL_ROUTE)
    async def prefill(request: Request):
        body = await read_json(request, state.options.max_body_bytes)
        try:
            rid = f"pd-{body['request_id']}-{uuid.uuid4().hex[:8]}"
            prompt = [int(t) for t in body["prompt_ids"]]
            params = SamplingParams(**body["params"])
            sample_index = int(body.get("sample_index", 0))
            state.orchestrator.check(prompt, params)
        except (KeyError, TypeError, ValueError) as e:
            raise ApiError(400, f"prefill request refused: {e}", code="invalid_value") from None
        try:  # the decode server's model and KV format, before any work: a state it would refuse is never made
            T.check_format(body.get("format") or {}, state.engine.format)
        except T.TransferError as e:
            raise ApiError(409, f"this prefill server cannot serve that decode server: {e}",
                           code="pd_format_mismatch") from None
        if not state.orchestrator.accepting:
            raise ApiError(503, "the prefill server is not accepting requests", code="unavailable")
        orch = state.orchestrator
        try:
            inner = await asyncio.wrap_future(orch.run_on_engine(
                lambda eng: eng.begin_prefill(rid, prompt, params, sample_index)))
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(inner), state.options.request_timeout_s)
        except TimeoutError:
            orch.run_on_engine(lambda eng: eng.abort(rid))
            raise ApiError(408, "the prefill did not finish in time", code="request_timeout") from None
        except Exception as e:
            raise ApiError(503, f"prefill failed: {e}", code="unavailable") from None
        return JSONResponse(result)

    @r.delete(STATE_ROUTE + "/{uid}")
    async def taken(uid: int):
        """A decode server pulled the state (jax path): it leaves the offers."""
        return JSONResponse({"taken": state.transport.taken(uid) is not None})

    @r.get(STATE_ROUTE + "/{uid}")
    async def take(uid: int):
        data = state.transport.take_bytes(uid)
        if data is None:
            raise ApiError(404, f"no state {uid} is offered here (taken, expired or never offered)",
                           code="not_found")
        return Response(data, media_type="application/octet-stream")

    return r
