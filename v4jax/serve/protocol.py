"""Request bodies checked field by field into what the orchestrator takes; errors in OpenAI's shape.

Every check names the field it rejects (`param`), so a client sees `{"error": {"message", "type", "param",
"code"}}` with a 4xx status, never a 500. Unknown fields of the OpenAI endpoints are ignored (clients send
extras such as `user`); JetStream's `/v1/generate` forbids them, as its own server does."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from typing import Any

from v4jax.fields import INT32_MAX, INT32_MIN, RULES, utf8_error
from v4jax.engine.sampling import SamplingParams
from v4jax.serve.reasoning import asked as thinking_asked
from v4jax.serve.tools import ToolsError, message_tool_calls, request_tools

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable_error"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- typed fields ----
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def get_int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    """An integer field, inside [lo, hi] (default: the rule table's bounds of that name, v4jax.fields) and always
    inside int32 (what the engine holds)."""
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"'{name}' must be an integer, got {_show(v)}", "invalid_type")
    rule = RULES.get(name)
    if rule is not None and rule.kind == "int":
        lo = rule.lo if lo is None else lo
        hi = rule.hi if hi is None else hi
    lo = INT32_MIN if lo is None else max(lo, INT32_MIN)
    hi = INT32_MAX if hi is None else min(hi, INT32_MAX)
    if not lo <= v <= hi:
        raise bad(name, f"'{name}' must be in [{lo}, {hi}], got {v}")
    return int(v)


def get_number(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or not math.isfinite(v):
        raise bad(name, f"'{name}' must be a finite number, got {_show(v)}", "invalid_type")
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be true or false, got {_show(v)}", "invalid_type")
    return v


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _token_ids(v) -> bool:
    # plain ints (what JSON gives) by one pass at C speed: the ABC check per id took ~40 ms of the event loop for
    # a 128K-token prompt
    return isinstance(v, list) and len(v) > 0 and (set(map(type, v)) <= {int} or all(_is_int(t) for t in v))


# ---- what the orchestrator takes ----
@dataclasses.dataclass
class Prepared:
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: off; else how many top alternatives were asked for
    return_token_ids: bool
    echo: bool = False  # /v1/completions: each choice starts with its prompt (and, with logprobs, the prompt's)
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    prompt_texts: list[str] | None = None  # with echo: each prompt as the client sent it (ids: decoded)
    tool_calls: bool = False  # chat with tools: the model's DSML tool-call blocks are read (v4jax.serve.tools)
    parallel_tool_calls: bool = True  # else only the first call is kept
    reasoning: bool = False  # chat in thinking mode: the text up to </think> is reasoning (v4jax.serve.reasoning)
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the text keeps the stop string that ended it
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage so far on every chunk


@dataclasses.dataclass
class Limits:
    max_model_len: int
    max_n: int
    capacity: int  # sequences the server admits at once


def _unsupported(body: dict) -> None:
    """OpenAI fields this server does not implement: refused when set to anything but their neutral value."""
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "'suffix' is not supported")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad("response_format", "only response_format {\"type\": \"text\"} is supported")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(v)}")
    return tuple(s for s in v if s)


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage): vLLM's `continuous_usage_stats` puts the usage so far on every
    chunk, with `include_usage` only."""
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    if so is None:
        return stream, False, False
    if not isinstance(so, dict):
        raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
    if not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    usage = get_bool(so, "include_usage", False)
    return stream, usage, usage and get_bool(so, "continuous_usage_stats", False)


def _sampling(body: dict, max_tokens: int, *, logprobs: int | None) -> SamplingParams:
    """logprobs: None (off), or how many top alternatives to return with each token's log-prob."""
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of token ids", "invalid_type")
    kw = dict(max_tokens=max_tokens, temperature=get_number(body, "temperature", 1.0),
              top_p=get_number(body, "top_p", 1.0), top_k=get_int(body, "top_k", 0),
              min_p=get_number(body, "min_p", 0.0), logit_bias=_logit_bias(body),
              seed=get_int(body, "seed", None), stop_token_ids=stop_ids or (), logprobs=logprobs is not None,
              top_logprobs=logprobs or 0, ignore_eos=get_bool(body, "ignore_eos", False),
              min_tokens=get_int(body, "min_tokens", 0),
              presence_penalty=get_number(body, "presence_penalty", 0.0),
              frequency_penalty=get_number(body, "frequency_penalty", 0.0),
              repetition_penalty=get_number(body, "repetition_penalty", 1.0))
    try:
        return SamplingParams(**kw)
    except ValueError as e:  # its messages start with the field's name
        name = str(e).split()[0]
        raise bad(name if name in kw else None, str(e)) from None


def _logit_bias(body: dict) -> dict:
    """OpenAI's `logit_bias`: an object of token ids (as strings, or ints) to biases -> {int: number}."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("logit_bias", "'logit_bias' must be an object of token ids to biases", "invalid_type")
    out = {}
    for k, b in v.items():
        t = k if _is_int(k) else (int(k) if isinstance(k, str) and re.fullmatch(r"\d{1,10}", k) else None)
        if t is None:
            raise bad("logit_bias", f"'logit_bias' keys must be token ids, got {k!r}"[:200])
        out[t] = b
    return out


def _max_tokens(body: dict, names=("max_tokens",), lo: int = 1):
    for name in names:
        v = get_int(body, name, None, lo=lo, hi=2**31 - 1)
        if v is not None:
            return v, name
    return None, names[0]


def _fit(prompts: list[list[int]], max_tokens: int | None, limits, default_tokens: int | None) -> list[int]:
    """max_tokens per prompt: the request's, else `default_tokens`, else (None) what the context leaves, as vLLM
    does for chat (at least 1: a prompt that fills the context is the request check's to refuse)."""
    if max_tokens is not None:
        return [max_tokens] * len(prompts)
    if default_tokens is not None:
        return [default_tokens] * len(prompts)
    return [max(1, limits.max_model_len - len(ids)) for ids in prompts]


def _checked(prompts, params, check, mt_name: str, prompt_name: str) -> None:
    """The engine's request check (v4jax.engine.checks: context, pages, stop ids): a 400 whose message is the
    engine's own, `param` the field at fault as the client named it."""
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        try:
            check(ids, sp)
        except ValueError as e:
            field = getattr(e, "param", None)
            param = {"max_tokens": mt_name, "prompt": prompt_name}.get(field, field)
            msg = str(e) if len(prompts) == 1 else f"{prompt_name}[{i}]: {e}"
            raise bad(param, msg, getattr(e, "code", "invalid_value")) from None


def _n(body: dict, limits, n_prompts: int) -> int:
    n = get_int(body, "n", 1, lo=1, hi=limits.max_n)
    if n * n_prompts > limits.capacity:
        raise bad("n", f"{n_prompts} prompt(s) x n={n} = {n * n_prompts} sequences exceed what the server "
                  f"admits at once ({limits.capacity})")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of", "'best_of' is not supported (only best_of == n)")
    return n


def parse_completion(body: dict, codec, limits, check) -> Prepared:
    _unsupported(body)
    if body.get("tools"):
        raise bad("tools", "'tools' is a /v1/chat/completions field")
    p = body.get("prompt")
    if isinstance(p, str) or _token_ids(p):
        raw = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _token_ids(x) for x in p):
        raw = p
    else:
        raise bad("prompt", "'prompt' must be a non-empty string, list of strings, list of token ids, or list of "
                  "token-id lists", "invalid_type")
    prompts = []
    for i, x in enumerate(raw):
        where = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(x, str) and not codec.has_tokenizer:
            raise bad("prompt", "this model has no tokenizer: send prompts as token ids")
        try:
            prompts.append(codec.encode(x, where))
        except (ValueError, TypeError) as e:
            raise bad("prompt", str(e)) from None
    stream, include_usage, continuous_usage = _stream(body)
    lp = body.get("logprobs")
    if lp is True or lp is False:  # some clients send chat's boolean form here
        lp = 0 if lp else None
    rule = RULES["completion_logprobs"]
    logprobs = get_int({"logprobs": lp}, "logprobs", None, lo=rule.lo, hi=rule.hi)
    n = _n(body, limits, len(prompts))
    stop = _stop(body)
    if stop and not codec.has_tokenizer:
        raise bad("stop", "this model has no tokenizer: stop strings cannot be matched (use stop_token_ids)")
    echo = get_bool(body, "echo", False)
    max_tokens, name = _max_tokens(body, lo=0)
    prompt_only = max_tokens == 0
    if prompt_only and not echo:
        raise bad(name, "'max_tokens' must be at least 1 (0 only with 'echo': true, which returns the prompt "
                  "alone, with its log-probs when 'logprobs' is set)")
    if echo and logprobs is not None and not codec.has_tokenizer:
        raise bad("echo", "this model has no tokenizer: 'echo' with 'logprobs' needs token texts")
    # with max_tokens 0 nothing is generated; the sampling fields are still checked (as one token would be)
    mts = _fit(prompts, 1 if prompt_only else max_tokens, limits, default_tokens=16)
    params = [_sampling(body, mt, logprobs=logprobs) for mt in mts]
    if prompt_only:
        for i, ids in enumerate(prompts):  # scored by one forward: the context is its only limit
            if len(ids) > limits.max_model_len:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise bad("prompt", f"{where}: prompt_len={len(ids)} exceeds the context limit max_model_len="
                          f"{limits.max_model_len}", "context_length_exceeded")
    else:
        _checked(prompts, params, check, name, "prompt")
    texts = None
    if echo:
        texts = [x if isinstance(x, str) else codec.decode(ids) for x, ids in zip(raw, prompts)]
    return Prepared(prompts, params, n, stop, stream, include_usage, logprobs,
                    get_bool(body, "return_token_ids", False), echo, prompt_only, texts,
                    include_stop=get_bool(body, "include_stop_str_in_output", False),
                    continuous_usage=continuous_usage)


def _message_text(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        if m.get("role") == "assistant":
            return ""
        raise bad(f"messages[{i}].content", f"messages[{i}] has no content", "invalid_type")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}]: only text parts "
                          "({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts",
              "invalid_type")


def _chat_prompt(body: dict, codec) -> tuple[list[int], bool, bool, dict]:
    """A chat's messages (and tools) through the template: (the prompt's ids, whether the model's tool calls are
    read, parallel_tool_calls, the template's kwargs)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of messages", "invalid_type")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content'", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}; got "
                      f"{_show(role)}")
        calls = role == "assistant" and m.get("tool_calls") not in (None, [])
        msg = {"role": role, "content": "" if calls and m.get("content") is None else _message_text(m, i)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        try:
            if calls:
                msg["tool_calls"] = message_tool_calls(m, i)
        except ToolsError as e:
            raise bad(e.param, str(e)) from None
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        clean.append(msg)
    if codec.template is None or not codec.has_tokenizer:
        raise bad("messages", "this model has no chat template (tokenizer_config.json 'chat_template'): use "
                  "/v1/completions")
    try:
        tools, read_calls, parallel = request_tools(body)
    except ToolsError as e:
        raise bad(e.param, str(e)) from None
    if tools is not None and not codec.template.reads("tools"):
        raise bad("tools", "this model's chat template does not render tools (it never reads 'tools'): they would "
                  "not reach the prompt")
    add_gen = get_bool(body, "add_generation_prompt", True)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type")
    taken = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools"})
    if taken:
        raise bad("chat_template_kwargs", f"'chat_template_kwargs' cannot set {taken[0]!r} (a field of the request)")
    for k, v in kwargs.items():
        if (k.endswith("_token") or k in codec.template.special_tokens) and not isinstance(v, str):
            raise bad(f"chat_template_kwargs.{k}", f"chat_template_kwargs.{k} is text the template writes: it must "
                      f"be a string, got {_show(v)}", "invalid_type")
    from v4jax.serve.chat import TemplateError
    try:
        rendered = codec.template.render(clean, add_generation_prompt=add_gen,
                                         **({"tools": tools} if tools is not None else {}), **kwargs)
    except TemplateError as e:
        raise bad("chat_template_kwargs" if kwargs else "messages", str(e)) from None
    except Exception as e:  # the template's own code failed on these values (e.g. a number where it adds text)
        raise bad("chat_template_kwargs" if kwargs else "messages",
                  f"the chat template failed: {type(e).__name__}: {e}") from None
    if not isinstance(rendered, str) or utf8_error(rendered):
        raise bad("chat_template_kwargs" if kwargs else "messages", "the chat template did not render text")
    try:
        ids = codec.encode_rendered(rendered)
    except ValueError as e:
        raise bad("messages", str(e)) from None
    return ids, read_calls, parallel, kwargs


def parse_chat(body: dict, codec, limits, check) -> Prepared:
    _unsupported(body)
    if body.get("echo"):
        raise bad("echo", "'echo' is a /v1/completions field")
    ids, read_calls, parallel, kwargs = _chat_prompt(body, codec)
    stream, include_usage, continuous_usage = _stream(body)
    want_lp = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None)  # bounds: the rule table's
    if top is not None and not want_lp:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    n = _n(body, limits, 1)
    stop = _stop(body)
    max_tokens, name = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    mts = _fit([ids], max_tokens, limits, default_tokens=None)
    params = [_sampling(body, mts[0], logprobs=(top or 0) if want_lp else None)]
    _checked([ids], params, check, name, "messages")
    return Prepared([ids], params, n, stop, stream, include_usage, (top or 0) if want_lp else None,
                    get_bool(body, "return_token_ids", False), tool_calls=read_calls, parallel_tool_calls=parallel,
                    reasoning=thinking_asked(kwargs, codec.template),
                    include_stop=get_bool(body, "include_stop_str_in_output", False),
                    continuous_usage=continuous_usage)


def parse_tokenize(body: dict, codec) -> list[int]:
    """vLLM's /tokenize: `prompt` text (BOS added as the tokenizer's config asks unless `add_special_tokens` is
    false), or chat `messages` (and `tools`, `chat_template_kwargs`) rendered by the template, as a chat request's
    prompt is."""
    if body.get("messages") is not None:
        return _chat_prompt(body, codec)[0]
    p = body.get("prompt")
    if not isinstance(p, str) or not p:
        raise bad("prompt", "'prompt' must be a non-empty string (or send 'messages')", "invalid_type")
    if not codec.has_tokenizer:
        raise bad("prompt", "this model has no tokenizer")
    try:
        return codec.encode(p, "prompt") if get_bool(body, "add_special_tokens", True) else \
            codec.encode_rendered(p, "prompt")
    except ValueError as e:
        raise bad("prompt", str(e)) from None


def parse_detokenize(body: dict, codec) -> str:
    """vLLM's /detokenize: `tokens` (ids of the vocabulary) -> their text, special tokens skipped."""
    toks = body.get("tokens")
    if not _token_ids(toks):
        raise bad("tokens", "'tokens' must be a non-empty list of token ids", "invalid_type")
    if not codec.has_tokenizer:
        raise bad("tokens", "this model has no tokenizer")
    try:
        return codec.decode(codec.encode(toks, "tokens"))
    except ValueError as e:
        raise bad("tokens", str(e)) from None


_GENERATE_FIELDS = {"max_tokens", "text_content", "token_content", "metadata", "num_samples"}


def parse_generate(body: dict, codec, limits, check) -> tuple[Prepared, bool]:
    """JetStream's DecodeRequest: max_tokens, one of text_content {text} / token_content {token_ids}, optional
    metadata and num_samples; nothing else. Greedy (its request carries no sampling fields) unless
    num_samples > 1, which samples at temperature 1. Returns (request, whether the prompt was text)."""
    extra = sorted(set(body) - _GENERATE_FIELDS)
    if extra:
        raise bad(extra[0], f"unknown field(s) {extra}; /v1/generate takes {sorted(_GENERATE_FIELDS)}",
                  "extra_forbidden")
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "'max_tokens' is required", "missing")
    max_tokens = get_int(body, "max_tokens", None, lo=1, hi=2**31 - 1)
    text, toks = body.get("text_content"), body.get("token_content")
    if (text is None) == (toks is None):
        raise bad("text_content", "exactly one of 'text_content' and 'token_content' is required")
    if text is not None:
        if not isinstance(text, dict) or not isinstance(text.get("text"), str) or set(text) - {"text"}:
            raise bad("text_content", "'text_content' must be {\"text\": string}", "invalid_type")
        if not codec.has_tokenizer:
            raise bad("text_content", "this model has no tokenizer: use token_content")
        try:
            ids = codec.encode(text["text"].strip(), "text_content.text")
        except (ValueError, TypeError) as e:
            raise bad("text_content", str(e)) from None
    else:
        if not isinstance(toks, dict) or not _token_ids(toks.get("token_ids")) or set(toks) - {"token_ids"}:
            raise bad("token_content", "'token_content' must be {\"token_ids\": [int, ...]} (non-empty)",
                      "invalid_type")
        try:
            ids = codec.encode(toks["token_ids"], "token_content.token_ids")
        except (ValueError, TypeError) as e:
            raise bad("token_content", str(e)) from None
    md = body.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise bad("metadata", "'metadata' must be an object", "invalid_type")
    n = get_int(body, "num_samples", 0, lo=0, hi=limits.max_n) or 1
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0 if n == 1 else 1.0)
    _checked([ids], [sp], check, "max_tokens", "text_content" if text is not None else "token_content")
    return Prepared([ids], [sp], n, (), True, False, None, False), text is not None


MAX_JSON_DEPTH = 32  # nesting of objects and arrays in a request body
MAX_NUMBER_CHARS = 64  # digits in one number literal (int32 fields need 10; a float's 17 significant digits)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _bounded(raw: bytes) -> None:
    """Nesting depth and number sizes, checked on the raw bytes before any parsing (the parser recurses per level,
    and converting a 5,000-digit integer is refused by Python itself): a 400 instead of a crash. One vectorised
    pass, linear in the body whatever it holds: brackets and digits inside strings do not count."""
    import numpy as np
    b = np.frombuffer(raw, np.uint8)
    n = b.size
    if n == 0:
        return
    idx = np.arange(n, dtype=np.int32)
    last_plain = np.maximum.accumulate(np.where(b == ord("\\"), np.int32(-1), idx))
    backslashes_before = np.empty(n, np.int32)  # consecutive backslashes just before each byte
    backslashes_before[0] = 0
    backslashes_before[1:] = idx[:-1] - last_plain[:-1]
    quote = (b == ord('"')) & (backslashes_before % 2 == 0)  # a quote that opens or closes a string
    outside = (np.cumsum(quote, dtype=np.int32) % 2 == 0) & ~quote
    digit = outside & (b >= ord("0")) & (b <= ord("9"))
    breaks = np.flatnonzero(~digit)
    longest = int(np.diff(np.concatenate(([-1], breaks, [n]))).max()) - 1
    if longest > MAX_NUMBER_CHARS:
        raise ApiError(400, f"the body holds a number longer than {MAX_NUMBER_CHARS} digits", code="invalid_json")
    step = (outside & ((b == ord("[")) | (b == ord("{")))).astype(np.int32) - \
        (outside & ((b == ord("]")) | (b == ord("}"))))
    if int(np.cumsum(step, dtype=np.int32).max()) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body nests objects / arrays deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json")


def _bad_text(v, path: str) -> str | None:
    """The path of the first string (value or key) in v that is not valid UTF-8 text, or None."""
    if isinstance(v, str):
        return path if utf8_error(v) else None
    if isinstance(v, dict):
        for k, x in v.items():
            where = f"{path}.{k}" if path else str(k)
            if utf8_error(k):
                return f"a key of {path or 'the body'}"
            found = _bad_text(x, where)
            if found:
                return found
    elif isinstance(v, list) and not set(map(type, v)) <= {int, float}:
        for i, x in enumerate(v):
            found = _bad_text(x, f"{path}[{i}]")
            if found:
                return found
    return None


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: UTF-8 (RFC 8259; a UTF-8 BOM is ignored), bounded before parsing (depth, number
    sizes), every string valid UTF-8 text (a lone surrogate escape such as "\\ud800" is refused, naming where it
    is), else a 400. Only UTF-8 is read: json.loads would also take UTF-16 and UTF-32 bodies, whose bytes these
    checks do not read as they read UTF-8 (a lone surrogate escape in UTF-16 passed them, and failed later in the
    tokenizer)."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 text: {e}", code="invalid_json") from None
    _bounded(raw)
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON: {type(e).__name__}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can put a lone surrogate in a parsed string
        where = _bad_text(body, "")
        if where is not None:
            param = None if where.startswith("a key of") else where
            raise ApiError(400, f"{where} is not valid UTF-8 text (a lone UTF-16 surrogate)", param=param,
                           code="invalid_text")
    return body
