"""One rule table for the bounds of every field a user sets: `SamplingParams`, the `LLM` options
(`v4jax.api.EngineOptions`) and the server's request parsing (`v4jax.serve.protocol`) all read it.

Every integer is bounded to what the engine holds (int32 on device; int64 for byte counts, which stay on the
host), every float is finite, bools are bools (not 1 / "yes"), ints are ints (not 2.0 / "3"), strings are valid
UTF-8 (no lone surrogate). A violation is a `FieldError` (a ValueError) whose message starts with the field's
name, and whose `field` names it.

    check_field("top_k", 2**31)      # FieldError: top_k must be an integer in [-1, 2147483647], got 2147483648
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)  # floats the engine holds are float32
# Tokens one request may bias (`logit_bias`): the engine holds each row's as a fixed [MAX_LOGIT_BIAS] table
MAX_LOGIT_BIAS = 128
# Most likely alternatives returned per token (vLLM's default max_logprobs, OpenAI's chat limit): the engine's
# top-N program computes this many on device and each request takes its own N of them.
MAX_TOP_LOGPROBS = 20


class FieldError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class Rule:
    kind: str  # "int" | "float" | "bool" | "str" | "choice"
    lo: float | None = None  # inclusive bounds (int, float)
    hi: float | None = None
    lo_open: bool = False  # float: lo excluded
    optional: bool = False  # None allowed
    choices: tuple = ()
    note: str = ""  # appended to the message, e.g. "(0 or -1 = off)"


def Int(lo=0, hi=INT32_MAX, **kw) -> Rule:
    return Rule("int", lo, hi, **kw)


def Float(lo=None, hi=None, **kw) -> Rule:
    return Rule("float", lo, hi, **kw)


BOOL = Rule("bool")

# The table. Sampling fields are per-request values the engine holds in int32 / float32 arrays.
RULES: dict[str, Rule] = {
    # SamplingParams (and the server's fields of the same names)
    "max_tokens": Int(1),
    "min_tokens": Int(0),
    "temperature": Float(0, FLOAT32_MAX),
    "top_p": Float(0, 1, lo_open=True),
    "top_k": Int(-1, note="(0 or -1 = off)"),
    "min_p": Float(0, 1, note="(0 = off)"),
    "presence_penalty": Float(-2, 2, note="(0 = off)"),  # OpenAI's and vLLM's range
    "frequency_penalty": Float(-2, 2, note="(0 = off)"),
    "repetition_penalty": Float(0, 2, lo_open=True, note="(1 = off)"),
    "logit_bias[]": Float(-100, 100),  # OpenAI's range; the ids: "stop_token_ids[]"'s rule
    "seed": Int(INT32_MIN, optional=True, note="(seeds are int32 on device)"),
    "stop_token_ids[]": Int(0),
    "logprobs": BOOL,
    "top_logprobs": Int(0, MAX_TOP_LOGPROBS),  # also chat's field of that name
    "ignore_eos": BOOL,
    # LLM(...) options (v4jax.api.EngineOptions)
    "quant_sim": BOOL,
    "kv_cache_dtype": Rule("choice", choices=("auto", "bfloat16", "fp8")),
    "attention_impl": Rule("choice", optional=True, choices=("xla", "pallas")),
    "quantization": Rule("choice", optional=True, choices=("none", "fp8"),
                         note="(default: the checkpoint's own storage)"),
    "weights_seed": Int(INT32_MIN),
    "max_model_len": Int(1, optional=True, note="(default: the model's)"),
    "max_num_seqs": Int(1),
    "kv_layout": Rule("choice", choices=("paged", "dense")),
    "page_size": Int(1, optional=True),
    "decode_steps": Int(1),
    "prefill_chunk": Int(1),
    "memory_budget_bytes": Int(1, INT64_MAX, optional=True),
    "gpu_memory_utilization": Float(0, 1, lo_open=True, optional=True),
    "enable_prefix_caching": BOOL,
    "mesh": Rule("str", optional=True),
    "enable_hisparse": BOOL,
    "hisparse_device_pages": Int(1, optional=True, note="(default: four decode steps' selections)"),
    # the server's own request fields
    "n": Int(1),
    "num_samples": Int(0),
    "completion_logprobs": Int(0, MAX_TOP_LOGPROBS),  # /v1/completions' `logprobs: N` (OpenAI stops at 5)
}


def is_int(x) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _range(rule: Rule) -> str:
    lo, hi = rule.lo, rule.hi
    if lo is not None and hi is not None:
        return f"in {'(' if rule.lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if rule.lo_open else '>='} {lo}"
    return f"<= {hi}" if hi is not None else ""


def utf8_error(s: str) -> str | None:
    """None for a string that is valid UTF-8 text, else why not (a lone surrogate)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid UTF-8 text (a lone surrogate at character {e.start})"
    return None


def check_field(name: str, value, rule: Rule | None = None, *, field: str | None = None, lo=None, hi=None):
    """`value` checked against the rule of `name` (or `rule`), with bounds narrowed by lo / hi; returns it as a
    plain Python int / float / bool / str (or None where optional). `field` is the name the message uses."""
    rule = rule or RULES[name]
    field = field or name
    if lo is not None or hi is not None:
        rule = dataclasses.replace(rule, lo=rule.lo if lo is None else lo, hi=rule.hi if hi is None else hi)
    if value is None:
        if rule.optional:
            return None
        raise FieldError(field, f"{field} is required")
    note = f" {rule.note}" if rule.note else ""
    if rule.kind == "int":
        ok = is_int(value) and (rule.lo is None or value >= rule.lo) and (rule.hi is None or value <= rule.hi)
        if not ok:
            raise FieldError(field, f"{field} must be an integer {_range(rule)}{note}, got {_show(value)}")
        return int(value)
    if rule.kind == "float":
        ok = is_real(value) and math.isfinite(value) and (rule.lo is None or (
            value > rule.lo if rule.lo_open else value >= rule.lo)) and (rule.hi is None or value <= rule.hi)
        if not ok:
            raise FieldError(field, f"{field} must be a finite number {_range(rule)}{note}".rstrip()
                             + f", got {_show(value)}")
        return float(value)
    if rule.kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise FieldError(field, f"{field} must be True or False, got {_show(value)}")
        return bool(value)
    if rule.kind == "choice":
        if not isinstance(value, str) or value not in rule.choices:
            raise FieldError(field, f"{field} must be one of {', '.join(map(repr, rule.choices))}, got "
                             f"{_show(value)}")
        return value
    if rule.kind == "str":
        if not isinstance(value, str):
            raise FieldError(field, f"{field} must be a string, got {_show(value)}")
        why = utf8_error(value)
        if why:
            raise FieldError(field, f"{field} {why}")
        return value
    raise AssertionError(rule.kind)
