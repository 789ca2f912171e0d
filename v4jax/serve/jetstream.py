"""JetStream's HTTP front: POST /v1/generate and GET /v1/health, in its shapes.

The request is JetStream's DecodeRequest (`max_tokens`, one of `text_content: {text}` /
`token_content: {token_ids}`, optional `metadata` and `num_samples`; other fields are refused). The response
streams (text/event-stream, as JetStream labels it) one JSON object per line, each a DecodeResponse as
protobuf's MessageToJson writes it: `{"streamContent": {"samples": [{"text": ..., "tokenIds": [...]}]}}`, one
sample per requested sample; a text prompt gets text and ids, a token prompt ids only (client-side
tokenization). The stream simply ends when every sample has; a failure or timeout ends it with an OpenAI-style
`{"error": ...}` line."""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from v4jax.serve import streams as S
from v4jax.serve.protocol import ApiError, parse_generate


def _line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def router(state) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/generate")
    async def generate(request: Request):
        body = await S.read_json(request, state.options.max_body_bytes)
        prep, text_prompt = parse_generate(body, state.codec, state.limits, state.orchestrator.check)
        stream = S.submit(state, prep)
        deadline = time.monotonic() + state.options.request_timeout_s
        return S.EventStream(_responses(stream, deadline, text_prompt, prep.n),
                             lambda: state.orchestrator.abort(stream))

    async def _responses(stream, deadline, text_prompt: bool, n: int):
        try:
            async for batch in S.batches(stream, deadline):  # one message per engine step, as JetStream's
                text, ids = [""] * n, [[] for _ in range(n)]
                for out in batch:
                    if out.error:
                        yield _line(ApiError(500, f"generation failed: {out.error}", code="engine_error").body())
                        continue
                    ids[out.index] += out.token_ids
                    text[out.index] += out.text if text_prompt else ""
                if any(ids) or any(text):
                    # proto3 JSON leaves out empty fields: a sample with nothing new is {}
                    samples = [{**({"text": t} if t else {}), **({"tokenIds": i} if i else {})}
                               for t, i in zip(text, ids)]
                    yield _line({"streamContent": {"samples": samples}})
        except S.RequestTimeout:
            state.orchestrator.abort(stream)
            yield _line(ApiError(408, f"the request did not finish within {state.options.request_timeout_s:g} s",
                                 code="request_timeout").body())

    @r.get("/v1/health")
    async def health():
        live = state.orchestrator.accepting
        return JSONResponse({"is_live": str(live)}, status_code=200 if live else 503)

    return r
