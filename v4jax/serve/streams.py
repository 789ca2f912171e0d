"""What every generating endpoint does around the orchestrator: read a bounded body, admit the request, and
read its outputs until every sequence has ended, the deadline passes, or the client goes away."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from starlette.responses import StreamingResponse

from v4jax.serve.orchestrator import Overloaded, RequestStream, SeqOutput, ShuttingDown, Unavailable
from v4jax.serve.protocol import ApiError, Prepared, json_object


class RequestTimeout(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_json(request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (Content-Length or counted as it arrives)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {limit}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return json_object(b"".join(chunks))


def submit(state, prep: Prepared, route: dict | None = None) -> RequestStream:
    try:
        return state.orchestrator.submit(prep.prompts, prep.params, n=prep.n, stop=prep.stop,
                                         include_stop=prep.include_stop, route=route)
    except Overloaded:
        state.metrics.rejected.labels(reason="queue_full").inc()
        raise ApiError(429, f"the server is at capacity ({state.orchestrator.capacity} sequences running or "
                       "waiting); retry later", code="queue_full", headers={"Retry-After": "1"}) from None
    except ShuttingDown:
        state.metrics.rejected.labels(reason="shutting_down").inc()
        raise ApiError(503, "the server is shutting down", code="shutting_down") from None


async def batches(stream: RequestStream, deadline: float) -> AsyncIterator[list[SeqOutput]]:
    """Outputs as they arrive, everything already there taken at once, until every sequence has a
    finish_reason; RequestTimeout past the deadline (time.monotonic)."""
    left = stream.n_seqs
    loop = asyncio.get_running_loop()
    # a timeout scope per wait, not a wait_for (a task each): 9.0 against 17.9 us a get on the CPU, paid by the
    # event loop's thread (which shares the GIL with the engine thread) for every stream's every step
    at = loop.time() + (deadline - time.monotonic())
    while left:
        if loop.time() >= at:
            raise RequestTimeout()
        try:
            async with asyncio.timeout_at(at):
                batch = [await stream.get()]
        except TimeoutError:
            raise RequestTimeout() from None
        while (more := stream.get_nowait()) is not None:
            batch.append(more)
        left -= sum(out.finish_reason is not None for out in batch)
        if not left:
            stream.closed = True  # nothing more will come: closing it later aborts nothing
        yield merged(batch)


def merged(batch: list[SeqOutput]) -> list[SeqOutput]:
    """A sequence's outputs that waited together as one (vLLM merges a lagging stream's deltas too): a client the
    event loop fell behind on gets one event for them, not one per engine step, so the loop catches up instead of
    spending the GIL on a send per step. Errors stay outputs of their own."""
    out: list[SeqOutput] = []
    last: dict[int, int] = {}  # sequence index -> its latest output's position in out
    for o in batch:
        i = last.get(o.index)
        prev = None if i is None else out[i]
        if prev is None or prev.error or o.error or prev.finish_reason is not None:
            last[o.index] = len(out)
            out.append(o)
            continue
        out[i] = SeqOutput(o.index, prev.text + o.text, prev.token_ids + o.token_ids, prev.logprobs + o.logprobs,
                           o.finish_reason, top_logprobs=prev.top_logprobs + o.top_logprobs)
    return out


async def outputs(stream: RequestStream, deadline: float) -> AsyncIterator[SeqOutput]:
    async for batch in batches(stream, deadline):
        for out in batch:
            yield out


@dataclasses.dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    top_logprobs: list = dataclasses.field(default_factory=list)


async def _until_disconnected(request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def collect(request, state, stream: RequestStream, deadline: float) -> list[Choice]:
    """Every sequence's whole output (non-streaming requests). A client that disconnects aborts them at once."""
    choices = [Choice(i) for i in range(stream.n_seqs)]

    async def gather():
        async for out in outputs(stream, deadline):
            c = choices[out.index]
            c.text += out.text
            c.token_ids += out.token_ids
            c.logprobs += out.logprobs
            c.top_logprobs += out.top_logprobs
            c.finish_reason, c.error = out.finish_reason, out.error

    work = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientGone()
        work.result()  # RequestTimeout propagates
    except RequestTimeout:
        raise ApiError(408, f"the request did not finish within {state.options.request_timeout_s:g} s",
                       code="request_timeout") from None
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        if any(c.finish_reason is None for c in choices):
            state.orchestrator.abort(stream)
    failed = [c.error for c in choices if c.error]
    if failed:
        raise error_of(failed[0])
    return choices


def error_of(message: str) -> ApiError:
    """A failed sequence's error: 503 when no server could take it (Unavailable), else 500."""
    if isinstance(message, Unavailable):
        return ApiError(503, str(message), code="unavailable", headers={"Retry-After": "1"})
    return ApiError(500, f"generation failed: {message}", code="engine_error")


class EventStream(StreamingResponse):
    """A text/event-stream response whose request is aborted however the response ends (disconnect, cancellation)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj) -> str:
    import json
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
