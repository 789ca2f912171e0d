"""The FastAPI application and its uvicorn server: routes, API key, errors, health, metrics, clean shutdown.

    state = ServerState(llm, ServerOptions(port=8000)).start()
    Server(state).run()                      # blocks; SIGINT / SIGTERM drain and stop it
"""
from __future__ import annotations

import hmac
import logging
import os
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from v4jax.serve import jetstream, openai
from v4jax.serve.engine import LocalEngine, ServingEngine
from v4jax.serve.metrics import CONTENT_TYPE, ServerMetrics
from v4jax.serve.options import ServerOptions
from v4jax.serve.orchestrator import Orchestrator
from v4jax.serve.protocol import ApiError, Limits
from v4jax.serve.streams import ClientGone
from v4jax.serve.tokens import TextCodec

log = logging.getLogger("v4jax.serve")
DEFAULT_MODEL_ID = "v4jax-shakespeare"


def model_id_of(llm) -> str:
    """The directory's base name, the preset's name, or v4jax-shakespeare for the embedded model."""
    from v4jax.api import DEFAULT_MODEL_DIR
    src = llm.source
    if src.startswith("preset "):
        return src[len("preset "):]
    if os.path.realpath(src) == os.path.realpath(DEFAULT_MODEL_DIR):
        return DEFAULT_MODEL_ID
    return os.path.basename(os.path.normpath(src))


class ServerState:
    """Everything the routes share: the model's text codec, the orchestrator over the engine, metrics, limits."""

    def __init__(self, llm, options: ServerOptions | None = None, engine: ServingEngine | None = None):
        self.llm = llm
        self.options = options or ServerOptions()
        self.model_id = self.options.served_model_name or model_id_of(llm)
        self.created = int(time.time())
        self.codec = TextCodec(llm)
        # building the engine checks that its pools fit
        mode = self.options.disaggregation_mode
        self.metrics = ServerMetrics(lambda: self.orchestrator.stats())
        self.transport = None
        if engine is None and mode is not None:
            from v4jax.serve.disagg import DecodeEngine, PrefillEngine
            from v4jax.serve.pd import StateTransport, TransferMetrics
            self.transport = StateTransport(self.options.host, self.options.pd_transport,
                                            TransferMetrics(self.metrics.registry),
                                            offer_timeout_s=self.options.pd_offer_timeout_s)
            engine = (PrefillEngine(llm.engine, self.transport, score_prompt=llm.prompt_logprobs) if mode == "prefill"
                      else DecodeEngine(llm.engine, self.transport, self.options.pd_secret))
        self.engine = engine or LocalEngine(llm.engine, score_prompt=llm.prompt_logprobs)
        self.orchestrator = Orchestrator(self.engine, self.codec.decoder, max_waiting=self.options.max_waiting)
        self.orchestrator.metrics = self.metrics
        self.limits = Limits(self.engine.max_model_len, self.options.max_n, self.orchestrator.capacity)

    def start(self) -> "ServerState":
        self.orchestrator.start()
        return self

    def route_of(self, request) -> dict | None:
        """A decode server's route for a request: the prefill servers the router named (header), best first."""
        if self.options.disaggregation_mode != "decode":
            return None
        from v4jax.serve.disagg import PREFILL_HEADER
        urls = [u.strip() for u in request.headers.get(PREFILL_HEADER, "").split(",") if u.strip()]
        return {"prefill": urls} if urls else None

    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and m != self.model_id:
            raise ApiError(404, f"model {m!r} is not served here; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


def _text_safe(body: dict) -> dict:
    """An error body that encodes as UTF-8 whatever it quotes (a lone surrogate would fail the response itself,
    and the connection with it)."""
    err = body["error"]
    return {"error": {k: v.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(v, str) else v
                      for k, v in err.items()}}


class _ApiKey:
    """ASGI middleware: /v1/* (but /v1/health) needs "Authorization: Bearer <key>", compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["path"] != "/v1/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = ApiError(401, "a valid API key is required: 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class _PDSecret:
    """ASGI middleware of a PD server: everything but /health and /metrics needs the shared secret."""

    def __init__(self, app, secret: str):
        from v4jax.serve.disagg import SECRET_HEADER
        self.app, self.secret, self.header = app, secret.encode(), SECRET_HEADER.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in ("/health", "/metrics"):
            if not hmac.compare_digest(dict(scope["headers"]).get(self.header, b""), self.secret):
                err = ApiError(403, "this server takes requests from its router only (x-v4jax-pd-secret)",
                               code="pd_secret")
                await JSONResponse(err.body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="v4jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(openai.router(state))
    app.include_router(jetstream.router(state))
    if state.options.disaggregation_mode == "prefill":
        from v4jax.serve.disagg import pd_router
        app.include_router(pd_router(state))

    @app.get("/health")
    async def health():
        orch = state.orchestrator
        ok = orch.accepting
        body = {"status": "ok" if ok else "unavailable"}
        if not orch.engine_alive:
            body["engine"] = "dead" + (f": {type(orch.error).__name__}: {orch.error}" if orch.error else "")
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        if e.status < 500 and e.status not in (429,):
            state.metrics.rejected.labels(reason=str(e.status)).inc()
        return JSONResponse(_text_safe(e.body()), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it: the client closed the connection

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        err = ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}").body(), status_code=500)

    if state.options.api_key:
        app.add_middleware(_ApiKey, key=state.options.api_key)
    if state.options.pd_secret and state.options.disaggregation_mode:
        app.add_middleware(_PDSecret, secret=state.options.pd_secret)
    return app


class Server(uvicorn.Server):
    """uvicorn's server, with SIGINT / SIGTERM draining the orchestrator first: new requests get 503, running
    ones get `shutdown_grace_s` to finish, then are aborted, so every stream ends with a last chunk and
    [DONE] before the connections close."""

    def __init__(self, state: ServerState, *, app=None, **config):
        o = state.options
        cfg = dict(host=o.host, port=o.port, log_level=o.log_level, access_log=o.access_log, lifespan="off",
                   timeout_graceful_shutdown=o.shutdown_grace_s + 10.0)
        cfg.update(config)
        super().__init__(uvicorn.Config(app or build_app(state), **cfg))
        self.state = state

    def handle_exit(self, sig, frame):
        if not self.should_exit:
            log.info("shutting down: %d sequence(s) in flight get %g s to finish",
                     self.state.orchestrator.stats()["server"]["in_flight"], self.state.options.shutdown_grace_s)
        self.state.orchestrator.begin_shutdown(self.state.options.shutdown_grace_s)
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has shut down; the drain above is the clean exit
        self._captured_signals.clear()

    def shutdown_now(self) -> None:
        """What a signal does, from any thread (tests, embedding)."""
        self.handle_exit(None, None)


def serve(llm, options: ServerOptions, *, warmup: str = "none") -> int:
    """Run `v4jax serve` until SIGINT / SIGTERM; the engine is stopped after the last stream has ended.
    `warmup`: "cover", "all" or "none" (`--warmup`: which programs compile before the server answers).
    One process of several (jax.distributed): process 0 answers HTTP and schedules, the others take the same
    engine steps (`v4jax.serve.engine.follow`) until process 0 stops."""
    import jax
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s: %(message)s")
    if jax.process_count() > 1:  # the leader's steps announce the programs compiled in the background
        llm.engine.programs.agreed = True
    if warmup != "none":
        from tqdm import tqdm
        t = time.perf_counter()
        with tqdm(desc="warm-up: compiling the engine's programs", unit="program", file=sys.stderr,
                  mininterval=2.0) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            n = llm.warmup(progress, cover_only=warmup == "cover")  # DeviceMemoryError: a step would not fit
        log.info("warm-up: %d programs ready in %.1f s", n, time.perf_counter() - t)
    leader = None
    if jax.process_count() > 1:
        from sharding.multihost import Channel
        from v4jax.serve.engine import LeaderEngine, follow
        channel = Channel("v4jax/serve/steps")
        if jax.process_index() != 0:
            log.info("process %d of %d: following process 0's engine steps", jax.process_index(),
                     jax.process_count())
            steps = follow(llm.engine, channel)
            log.info("process %d: followed %d engine steps, %d of them on covering programs", jax.process_index(),
                     steps, llm.engine.programs.substituted_steps)
            return 0
        leader = LeaderEngine(llm.engine, channel)
    state = ServerState(llm, options, engine=leader)
    state.start()
    server = Server(state)
    try:
        server.run()
    finally:
        state.orchestrator.stop()
        if leader is not None:
            leader.close()
    return 0
