"""`v4jax router`: one OpenAI endpoint in front of prefill and decode servers (prefill/decode disaggregation).

    v4jax router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

Each request goes to the least loaded decode server (requests in flight through this router), naming the prefill
servers least loaded first (header x-v4jax-prefill): the decode server has the first prefill it (the second if
that fails), pulls the request's state and streams the tokens back through here. A decode server that cannot be
reached, or answers 503 (no prefill server could take the request) before any token, is retried once on the next
decode server with the prefill servers rotated; then the client gets 503 with what failed. The router holds no
model: tokenizing, detokenizing and every OpenAI field are the decode server's."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from v4jax.serve.disagg import PREFILL_HEADER, SECRET_HEADER
from v4jax.serve.metrics import CONTENT_TYPE
from v4jax.serve.protocol import ApiError

log = logging.getLogger("v4jax.router")
ROUTES = ("/v1/completions", "/v1/chat/completions")
_FORWARDED = ("authorization", "content-type", "accept")


@dataclasses.dataclass
class RouterOptions:
    prefill: list[str]
    decode: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    pd_secret: str | None = None
    request_timeout_s: float = 600.0
    log_level: str = "info"

    def __post_init__(self):
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode server URL")
        for u in self.prefill + self.decode:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"server URL {u!r} must start with http:// or https://")
        self.prefill = [u.rstrip("/") for u in self.prefill]
        self.decode = [u.rstrip("/") for u in self.decode]


class Router:
    def __init__(self, options: RouterOptions):
        self.options = options
        self.load = {u: 0 for u in options.prefill + options.decode}  # requests in flight, per server
        r = self.registry = CollectorRegistry()
        self.requests = Counter("v4jax_router_requests", "Requests forwarded, by decode server and outcome",
                                ["server", "outcome"], registry=r)
        self.retries = Counter("v4jax_router_retries", "Requests retried on another decode server", registry=r)
        self.in_flight = Gauge("v4jax_router_in_flight", "Requests in flight, per server", ["server"], registry=r)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(options.request_timeout_s, connect=10.0))

    def _ordered(self, urls: list[str], shift: int = 0) -> list[str]:
        """Least loaded first (ties: the order given), rotated by `shift` (a retry tries others first)."""
        order = sorted(range(len(urls)), key=lambda i: (self.load[urls[i]], i))
        order = order[shift % len(order):] + order[:shift % len(order)]
        return [urls[i] for i in order]

    def _hold(self, urls: list[str], n: int) -> None:
        for u in urls:
            self.load[u] += n
            self.in_flight.labels(server=u).set(self.load[u])

    async def forward(self, request: Request, path: str):
        body = await request.body()
        try:
            streaming = bool(json.loads(body).get("stream", False))
        except (ValueError, AttributeError):
            streaming = False  # the decode server answers the malformed body
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        if self.options.pd_secret:
            headers[SECRET_HEADER] = self.options.pd_secret
        errors = []
        for attempt in range(2):
            if attempt:
                self.retries.inc()
            decode = self._ordered(self.options.decode, attempt)[0]
            prefill = self._ordered(self.options.prefill, attempt)
            held = [decode, prefill[0]]
            self._hold(held, 1)
            relayed, resp = False, None

            def release(held=held):
                self._hold(held, -1)
            try:
                resp = await self.client.send(self.client.build_request(
                    "POST", decode + path, content=body, headers={**headers, PREFILL_HEADER: ",".join(prefill)}),
                    stream=True)
                if resp.status_code == 503:
                    errors.append(f"{decode}: {(await resp.aread()).decode(errors='replace')[:500]}")
                    self.requests.labels(server=decode, outcome="unavailable").inc()
                    continue
                if not streaming:
                    content = await resp.aread()
                    self.requests.labels(server=decode, outcome=str(resp.status_code)).inc()
                    return Response(content, status_code=resp.status_code,
                                    media_type=resp.headers.get("content-type"))
                chunks = resp.aiter_raw()
                first = await anext(chunks, b"")
                if first.startswith(b'data: {"error"') and b'"unavailable"' in first:
                    errors.append(f"{decode}: {first.decode(errors='replace')[6:500]}")
                    self.requests.labels(server=decode, outcome="unavailable").inc()
                    continue
                self.requests.labels(server=decode, outcome=str(resp.status_code)).inc()
                relayed = True
                return StreamingResponse(self._relay(first, chunks, resp, release), status_code=resp.status_code,
                                         media_type=resp.headers.get("content-type"),
                                         headers={"Cache-Control": "no-cache"})
            except httpx.HTTPError as e:  # unreachable, or died before its first token: another server
                errors.append(f"{decode}: {type(e).__name__}: {e}")
                self.requests.labels(server=decode, outcome="failed").inc()
            finally:
                if not relayed:  # the relay releases its own when the stream ends
                    release()
                    if resp is not None:
                        await resp.aclose()
        err = ApiError(503, "no server could take the request: " + " | ".join(errors), code="unavailable",
                       headers={"Retry-After": "1"})
        return JSONResponse(err.body(), status_code=503, headers=err.headers)

    async def _relay(self, first: bytes, chunks, resp, release):
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:  # the decode server died mid-stream: the stream ends with an error
            yield ("data: " + json.dumps(ApiError(502, f"the decode server failed mid-stream: {e}",
                                                  code="upstream_failed").body()) + "\n\ndata: [DONE]\n\n").encode()
        finally:
            release()
            await resp.aclose()

    async def models(self):
        for url in self._ordered(self.options.decode):
            try:
                r = await self.client.get(url + "/v1/models", headers={SECRET_HEADER: self.options.pd_secret}
                                          if self.options.pd_secret else {})
                return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
            except httpx.HTTPError:
                continue
        err = ApiError(503, "no decode server answers", code="unavailable")
        return JSONResponse(err.body(), status_code=503)

    async def health(self):
        async def up(url):
            try:
                return (await self.client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False
        ok = await asyncio.gather(*(up(u) for u in self.options.prefill + self.options.decode))
        n_p = sum(ok[:len(self.options.prefill)])
        n_d = sum(ok[len(self.options.prefill):])
        good = n_p > 0 and n_d > 0
        return JSONResponse({"status": "ok" if good else "unavailable", "prefill_up": n_p, "decode_up": n_d},
                            status_code=200 if good else 503)


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="v4jax router", docs_url=None, redoc_url=None, openapi_url=None)
    def forwarding(path):
        async def handler(request: Request):
            return await router.forward(request, path)
        return handler

    for path in ROUTES:
        app.add_api_route(path, forwarding(path), methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/health", router.health, methods=["GET"])
    app.add_api_route("/metrics", lambda: Response(generate_latest(router.registry), media_type=CONTENT_TYPE),
                      methods=["GET"])
    return app


def run_router(options: RouterOptions) -> int:
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s: %(message)s")
    router = Router(options)
    uvicorn.run(build_router_app(router), host=options.host, port=options.port, log_level=options.log_level)
    return 0
