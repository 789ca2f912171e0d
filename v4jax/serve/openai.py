"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (streamed as SSE or not), /v1/models.

Beyond OpenAI's fields, as vLLM has them: `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids` (each
choice, and each streamed chunk, carries the ids of its tokens). Log-probabilities are those of the chosen
tokens (log-softmax of the raw logits); the engine does not compute alternatives, so `top_logprobs` lists the
chosen token alone."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from v4jax.serve import streams as S
from v4jax.serve.protocol import ApiError, Prepared, parse_chat, parse_completion


class _Logprobs:
    """OpenAI's log-probability objects for one choice, built as its tokens arrive."""

    def __init__(self, codec, top: int):
        self.codec, self.top = codec, top
        self.offset = 0  # completions' text_offset: where the next token's text starts

    def completion(self, ids, lps) -> dict:
        toks = [self.codec.token_text(t) for t in ids]
        offsets = []
        for t in toks:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": toks, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [{t: lp} for t, lp in zip(toks, lps)] if self.top else None}

    def chat(self, ids, lps) -> list:
        out = []
        for t, lp in zip(ids, lps):
            s = self.codec.token_text(t)
            entry = {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            out.append({**entry, "top_logprobs": [entry] if self.top else []})
        return out


# OpenAI's finish_reason takes "stop", "length", "content_filter", "tool_calls" or "function_call"; typed clients
# (SDKs that decode it as an enum) refuse anything else. The engine's "abort" (the server shut down before the
# sequence ended) is sent as "length": its text was cut short by a limit of the server, not ended by the model,
# and "length" is the value that tells a client the output is truncated ("stop" would claim a natural end).
# vLLM sends its internal "abort" as it is; the metrics keep the engine's own reasons.
OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length"}


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish_reason as an OpenAI value (None while the sequence runs)."""
    return None if reason is None else OPENAI_FINISH_REASONS.get(reason, "stop")


def _usage(prep: Prepared, completion_tokens: int) -> dict:
    prompt = sum(len(p) for p in prep.prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def router(state) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "v4jax", "root": state.llm.source,
                                            "max_model_len": state.limits.max_model_len}]}

    @r.post("/v1/completions")
    async def completions(request: Request):
        body = await S.read_json(request, state.options.max_body_bytes)
        state.check_model(body)
        prep = parse_completion(body, state.codec, state.limits, state.orchestrator.check)
        return await _serve(request, prep, chat=False)

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await S.read_json(request, state.options.max_body_bytes)
        state.check_model(body)
        prep = parse_chat(body, state.codec, state.limits, state.orchestrator.check)
        return await _serve(request, prep, chat=True)

    async def _serve(request, prep: Prepared, chat: bool):
        stream = S.submit(state, prep)
        deadline = time.monotonic() + state.options.request_timeout_s
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if prep.stream:
            events = (_chat_events if chat else _completion_events)(rid, prep, stream, deadline)
            return S.EventStream(events, lambda: state.orchestrator.abort(stream))
        choices = await S.collect(request, state, stream, deadline)
        return JSONResponse(_chat_body(rid, prep, choices) if chat else _completion_body(rid, prep, choices))

    def _head(rid, obj):
        return {"id": rid, "object": obj, "created": int(time.time()), "model": state.model_id}

    def _prompt_of(prep: Prepared, index: int) -> list[int]:
        return prep.prompts[index // prep.n]

    def _completion_body(rid, prep, choices) -> dict:
        out = []
        for c in choices:
            lp = _Logprobs(state.codec, prep.logprobs).completion(c.token_ids, c.logprobs) \
                if prep.logprobs is not None else None
            ch = {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": finish_reason(c.finish_reason)}
            if prep.return_token_ids:
                ch["prompt_token_ids"], ch["token_ids"] = _prompt_of(prep, c.index), c.token_ids
            out.append(ch)
        return {**_head(rid, "text_completion"), "choices": out,
                "usage": _usage(prep, sum(len(c.token_ids) for c in choices))}

    def _chat_body(rid, prep, choices) -> dict:
        out = []
        for c in choices:
            lp = {"content": _Logprobs(state.codec, prep.logprobs).chat(c.token_ids, c.logprobs), "refusal": None} \
                if prep.logprobs is not None else None
            ch = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                  "finish_reason": finish_reason(c.finish_reason)}
            if prep.return_token_ids:
                ch["prompt_token_ids"], ch["token_ids"] = _prompt_of(prep, c.index), c.token_ids
            out.append(ch)
        return {**_head(rid, "chat.completion"), "choices": out,
                "usage": _usage(prep, sum(len(c.token_ids) for c in choices))}

    async def _events(rid, prep, stream, deadline, obj, choice_of):
        """SSE chunks, one per sequence output; the usage chunk (if asked for), then [DONE]. A timeout or a
        failed sequence ends the stream with an error event."""
        head = _head(rid, obj)
        n_tokens = 0
        try:
            async for out in S.outputs(stream, deadline):
                if out.error:
                    yield S.sse(ApiError(500, f"generation failed: {out.error}", code="engine_error").body())
                    continue
                n_tokens += len(out.token_ids)
                choice = choice_of(out)
                if choice is None:
                    continue
                if prep.return_token_ids:
                    choice["token_ids"] = out.token_ids
                chunk = {**head, "choices": [choice]}
                if prep.include_usage:
                    chunk["usage"] = None
                yield S.sse(chunk)
            if prep.include_usage:
                yield S.sse({**head, "choices": [], "usage": _usage(prep, n_tokens)})
        except S.RequestTimeout:
            state.orchestrator.abort(stream)
            yield S.sse(ApiError(408, f"the request did not finish within {state.options.request_timeout_s:g} s",
                                 code="request_timeout").body())
        yield S.SSE_DONE

    def _completion_events(rid, prep, stream, deadline):
        lps = [_Logprobs(state.codec, prep.logprobs or 0) for _ in range(stream.n_seqs)]

        def choice_of(out):
            if not (out.text or out.token_ids or out.finish_reason):
                return None
            lp = lps[out.index].completion(out.token_ids, out.logprobs) if prep.logprobs is not None else None
            return {"index": out.index, "text": out.text, "logprobs": lp,
                    "finish_reason": finish_reason(out.finish_reason)}
        return _events(rid, prep, stream, deadline, "text_completion", choice_of)

    def _chat_events(rid, prep, stream, deadline):
        lps = [_Logprobs(state.codec, prep.logprobs or 0) for _ in range(stream.n_seqs)]
        started = [False] * stream.n_seqs

        def choice_of(out):
            delta = {}
            if not started[out.index]:
                started[out.index] = True
                delta["role"] = "assistant"
            if out.text or "role" in delta:
                delta["content"] = out.text
            if not delta and not out.token_ids and out.finish_reason is None:
                return None
            lp = {"content": lps[out.index].chat(out.token_ids, out.logprobs), "refusal": None} \
                if prep.logprobs is not None else None
            return {"index": out.index, "delta": delta, "logprobs": lp,
                    "finish_reason": finish_reason(out.finish_reason)}
        return _events(rid, prep, stream, deadline, "chat.completion.chunk", choice_of)

    return r
