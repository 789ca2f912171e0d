"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (streamed as SSE or not), /v1/models.

Beyond OpenAI's fields, as vLLM has them: `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids` (each
choice, and each streamed chunk, carries the ids of its tokens). Log-probabilities are log-softmax of the raw
logits (before temperature / top-p / top-k): of each chosen token, and of the N most likely alternatives at its
position (`logprobs: N` for completions, `top_logprobs: N` for chat; up to v4jax.fields.MAX_TOP_LOGPROBS).
`echo: true` (completions) starts each choice with its prompt; with `logprobs`, the prompt's tokens are scored by
one teacher-forced forward on the engine thread (the first token has none: nothing predicts it), and
`max_tokens: 0` returns the prompt alone: what evaluation harnesses (lm-eval's `loglikelihood`) send. Chat with
`tools`: the model's DSML tool-call blocks come back as `tool_calls` (v4jax.serve.tools); in thinking mode its
reasoning as `reasoning_content` (v4jax.serve.reasoning)."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from v4jax.serve import reasoning as R
from v4jax.serve import streams as S
from v4jax.serve import tools as T
from v4jax.serve.orchestrator import ShuttingDown
from v4jax.serve.protocol import (ApiError, Prepared, get_bool, parse_chat, parse_completion, parse_detokenize,
                                  parse_tokenize)


class _Logprobs:
    """OpenAI's log-probability objects for one choice, built as its tokens arrive (the echoed prompt's first)."""

    def __init__(self, codec, top: int):
        self.codec, self.top = codec, top
        self.offset = 0  # completions' text_offset: where the next token's text starts

    def _texts_and_offsets(self, ids) -> tuple[list[str], list[int]]:
        toks = [self.codec.token_text(t) for t in ids]
        offsets = []
        for t in toks:
            offsets.append(self.offset)
            self.offset += len(t)
        return toks, offsets

    def _top_dict(self, token: str, logprob: float, alternatives) -> dict:
        # the N most likely and the chosen token, as OpenAI's legacy completions give (up to N + 1 entries); of
        # tokens with the same text (parts of one UTF-8 character) the most likely one's log-prob stays
        d = {}
        for i, lp in alternatives:
            d.setdefault(self.codec.token_text(i), lp)
        d.setdefault(token, logprob)
        return d

    def completion(self, ids, lps, tops) -> dict:
        toks, offsets = self._texts_and_offsets(ids)
        tops = tops or [()] * len(ids)
        return {"tokens": toks, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [self._top_dict(t, lp, alts) for t, lp, alts in zip(toks, lps, tops)]
                if self.top else None}

    def prompt(self, ids, scored, text: str) -> dict:
        """The echoed prompt's part (scored: v4jax.api.PromptLogprobs); the first token's entries are null."""
        toks, offsets = self._texts_and_offsets(ids)
        self.offset = len(text)  # the generated text starts where the echoed prompt, as returned, ends
        top = None
        if self.top:
            top = [None if alts is None else self._top_dict(t, lp, alts)
                   for t, lp, alts in zip(toks, scored.logprobs, scored.top_logprobs)]
        return {"tokens": toks, "token_logprobs": list(scored.logprobs), "text_offset": offsets, "top_logprobs": top}

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        s = self.codec.token_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def chat(self, ids, lps, tops) -> list:
        tops = tops or [()] * len(ids)
        return [{**self._chat_entry(t, lp), "top_logprobs": [self._chat_entry(i, a) for i, a in alts[:self.top]]}
                for t, lp, alts in zip(ids, lps, tops)]


def _joined(first: dict, then: dict) -> dict:
    """Two parts of a completion's logprobs object (echoed prompt, generated text) as one."""
    out = {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "text_offset")}
    out["top_logprobs"] = None if first["top_logprobs"] is None else first["top_logprobs"] + then["top_logprobs"]
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
        if prep.echo and prep.logprobs is not None and not state.engine.scores_prompts:
            raise ApiError(501, "'echo' with 'logprobs' (the prompt's log-probs) is not supported by this server's "
                           "engine (a multi-process server); use 'echo' without 'logprobs', or one process",
                           param="echo", code="unsupported")
        return await _serve(request, prep, chat=False)

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await S.read_json(request, state.options.max_body_bytes)
        state.check_model(body)
        prep = parse_chat(body, state.codec, state.limits, state.orchestrator.check)
        return await _serve(request, prep, chat=True)

    @r.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a prompt's (or a chat's) token ids as the server would run them, and the context limit."""
        body = await S.read_json(request, state.options.max_body_bytes)
        state.check_model(body)
        ids = parse_tokenize(body, state.codec)
        strs = get_bool(body, "return_token_strs", False)
        return {"count": len(ids), "max_model_len": state.limits.max_model_len, "tokens": ids,
                "token_strs": [state.codec.token_text(t) for t in ids] if strs else None}

    @r.post("/detokenize")
    async def detokenize(request: Request):
        body = await S.read_json(request, state.options.max_body_bytes)
        state.check_model(body)
        return {"prompt": parse_detokenize(body, state.codec)}

    async def _serve(request, prep: Prepared, chat: bool):
        deadline = time.monotonic() + state.options.request_timeout_s
        scores = await _prompt_scores(prep, deadline)
        if prep.prompt_only:  # nothing generated: the prompt tokens scored are all it processes
            state.metrics.prompt_tokens.inc(prep.n * sum(len(p) for p in prep.prompts))
        stream = None if prep.prompt_only else S.submit(state, prep, state.route_of(request))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if prep.stream:
            events = _chat_events(rid, prep, stream, deadline) if chat else \
                _completion_events(rid, prep, stream, deadline, scores)
            return S.EventStream(events, lambda: stream is not None and state.orchestrator.abort(stream))
        if stream is None:  # the prompt alone: every choice is its echo
            choices = [S.Choice(i, finish_reason="length") for i in range(len(prep.prompts) * prep.n)]
        else:
            choices = await S.collect(request, state, stream, deadline)
        return JSONResponse(_chat_body(rid, prep, choices) if chat else _completion_body(rid, prep, choices, scores))

    async def _prompt_scores(prep: Prepared, deadline: float) -> list | None:
        """With echo and logprobs: each prompt's log-probs (v4jax.api.PromptLogprobs), from the engine thread."""
        if not (prep.echo and prep.logprobs is not None):
            return None
        try:
            futures = [asyncio.wrap_future(state.orchestrator.score_prompt(ids, prep.logprobs))
                       for ids in prep.prompts]
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", code="shutting_down") from None
        try:
            return await asyncio.wait_for(asyncio.gather(*futures), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise ApiError(408, f"the request did not finish within {state.options.request_timeout_s:g} s",
                           code="request_timeout") from None
        except NotImplementedError as e:
            raise ApiError(501, f"'echo' with 'logprobs': {e}", param="echo", code="unsupported") from None
        except ValueError as e:  # the forward's own checks (the parse step checked the same): a 400, not a 500
            raise ApiError(400, str(e), param="prompt", code="invalid_value") from None

    def _head(rid, obj):
        return {"id": rid, "object": obj, "created": int(time.time()), "model": state.model_id}

    def _prompt_of(prep: Prepared, index: int) -> list[int]:
        return prep.prompts[index // prep.n]

    def _echo_part(prep: Prepared, scores, index: int, lp: _Logprobs) -> tuple[str, dict | None]:
        """The echoed prompt of choice `index`: its text, and its logprobs part (None without logprobs)."""
        p = index // prep.n
        part = lp.prompt(prep.prompts[p], scores[p], prep.prompt_texts[p]) if scores is not None else None
        return prep.prompt_texts[p], part

    def _completion_body(rid, prep, choices, scores) -> dict:
        out = []
        for c in choices:
            lpb = _Logprobs(state.codec, prep.logprobs or 0)
            text, lp = "", None
            if prep.echo:
                text, lp = _echo_part(prep, scores, c.index, lpb)
            if prep.logprobs is not None:
                gen = lpb.completion(c.token_ids, c.logprobs, c.top_logprobs)
                lp = gen if lp is None else _joined(lp, gen)
            ch = {"index": c.index, "text": text + c.text, "logprobs": lp,
                  "finish_reason": finish_reason(c.finish_reason)}
            if prep.return_token_ids:
                ch["prompt_token_ids"], ch["token_ids"] = _prompt_of(prep, c.index), c.token_ids
            out.append(ch)
        return {**_head(rid, "text_completion"), "choices": out,
                "usage": _usage(prep, sum(len(c.token_ids) for c in choices))}

    def _chat_body(rid, prep, choices) -> dict:
        out = []
        for c in choices:
            lp = {"content": _Logprobs(state.codec, prep.logprobs).chat(c.token_ids, c.logprobs, c.top_logprobs),
                  "refusal": None} if prep.logprobs is not None else None
            reasoning, text = R.split(c.text) if prep.reasoning else (None, c.text)
            content, calls = T.parse(text, prep.parallel_tool_calls) if prep.tool_calls and text is not None \
                else (text, [])
            message = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            ch = {"index": c.index, "message": message, "logprobs": lp,
                  "finish_reason": "tool_calls" if calls else finish_reason(c.finish_reason)}
            if prep.return_token_ids:
                ch["prompt_token_ids"], ch["token_ids"] = _prompt_of(prep, c.index), c.token_ids
            out.append(ch)
        return {**_head(rid, "chat.completion"), "choices": out,
                "usage": _usage(prep, sum(len(c.token_ids) for c in choices))}

    async def _events(rid, prep, stream, deadline, obj, choice_of, first=()):
        """SSE chunks: `first` (choices sent before any output: the echoed prompts), one per sequence output, the
        usage chunk (if asked for), then [DONE]. A timeout or a failed sequence ends the stream with an error
        event. stream None: nothing is generated."""
        head = _head(rid, obj)
        n_tokens = 0

        def chunk(choice):
            c = {**head, "choices": [choice]}
            if prep.include_usage:
                c["usage"] = _usage(prep, n_tokens) if prep.continuous_usage else None
            return S.sse(c)

        try:
            for choice in first:
                yield chunk(choice)
            if stream is not None:
                async for out in S.outputs(stream, deadline):
                    if out.error:
                        yield S.sse(S.error_of(out.error).body())
                        continue
                    n_tokens += len(out.token_ids)
                    choice = choice_of(out)
                    if choice is None:
                        continue
                    if prep.return_token_ids:
                        choice["token_ids"] = out.token_ids
                    yield chunk(choice)
            if prep.include_usage:
                yield S.sse({**head, "choices": [], "usage": _usage(prep, n_tokens)})
        except S.RequestTimeout:
            state.orchestrator.abort(stream)
            yield S.sse(ApiError(408, f"the request did not finish within {state.options.request_timeout_s:g} s",
                                 code="request_timeout").body())
        yield S.SSE_DONE

    def _completion_events(rid, prep, stream, deadline, scores):
        n_seqs = len(prep.prompts) * prep.n
        lps = [_Logprobs(state.codec, prep.logprobs or 0) for _ in range(n_seqs)]
        first = []
        if prep.echo:  # each choice's first chunk is its prompt
            for i in range(n_seqs):
                text, lp = _echo_part(prep, scores, i, lps[i])
                first.append({"index": i, "text": text, "logprobs": lp,
                              "finish_reason": "length" if prep.prompt_only else None})

        def choice_of(out):
            if not (out.text or out.token_ids or out.finish_reason):
                return None
            lp = lps[out.index].completion(out.token_ids, out.logprobs, out.top_logprobs) \
                if prep.logprobs is not None else None
            return {"index": out.index, "text": out.text, "logprobs": lp,
                    "finish_reason": finish_reason(out.finish_reason)}
        return _events(rid, prep, stream, deadline, "text_completion", choice_of, first)

    def _chat_events(rid, prep, stream, deadline):
        lps = [_Logprobs(state.codec, prep.logprobs or 0) for _ in range(stream.n_seqs)]
        started = [False] * stream.n_seqs
        parsers = [T.StreamParser(prep.parallel_tool_calls) for _ in range(stream.n_seqs)] if prep.tool_calls else None
        splitters = [R.StreamSplitter() for _ in range(stream.n_seqs)] if prep.reasoning else None

        def choice_of(out):
            delta = {}
            if not started[out.index]:
                started[out.index] = True
                delta["role"] = "assistant"
            text, calls, called = out.text, [], False
            if splitters is not None:  # the reasoning first, up to </think>
                thought, text = splitters[out.index].feed(text)
                if out.finish_reason is not None:
                    thought += splitters[out.index].finish()
                if thought:
                    delta["reasoning_content"] = thought
            if parsers is not None:  # text that may open a tool-call block waits until it does or cannot
                p = parsers[out.index]
                before = len(p.calls)
                text, calls = p.feed(text)
                if out.finish_reason is not None:
                    text += p.finish()
                calls = [c.openai(index=before + k) for k, c in enumerate(calls)]
                called = bool(p.calls)
            if text or "role" in delta:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            if not delta and not out.token_ids and out.finish_reason is None:
                return None
            lp = {"content": lps[out.index].chat(out.token_ids, out.logprobs, out.top_logprobs), "refusal": None} \
                if prep.logprobs is not None else None
            reason = finish_reason(out.finish_reason)
            return {"index": out.index, "delta": delta, "logprobs": lp,
                    "finish_reason": "tool_calls" if called and reason is not None else reason}
        return _events(rid, prep, stream, deadline, "chat.completion.chunk", choice_of)

    return r
