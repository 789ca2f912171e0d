"""Tool calls (OpenAI's `tools`): the request's tools checked for the chat template, and the model's
DSML tool-call blocks read back out of its text as OpenAI `tool_calls`.

DeepSeek V3.2 and V4 write a call as DSML markup (DeepSeek's markup language; `｜` is the fullwidth bar U+FF5C):

    <｜DSML｜function_calls>                      (V4 also writes <｜DSML｜tool_calls>)
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

`string="true"`: the value is the text as written; `"false"`: it is JSON (numbers, booleans, objects), kept as
written where it does not parse. The text before the block is the message's content; a block whose invokes do not
parse stays in the content as text (nothing the model wrote is lost). As vLLM does with a tool parser: the calls
are read only when the request has tools and `tool_choice` is "auto" (the default), `finish_reason` is
"tool_calls" when a call was read, and an assistant message's `tool_calls` arguments (a JSON string from the
client) reach the template as an object. `tool_choice` "required" or a named function would need constrained
decoding, which this server does not have: refused."""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

BAR = "\uff5c"
PREFIX = f"<{BAR}DSML{BAR}"
_OPENERS = (f"{PREFIX}function_calls>", f"{PREFIX}tool_calls>")
_INVOKE = re.compile(rf'{re.escape(PREFIX)}invoke name="([^"]*)">(.*?)</{BAR}DSML{BAR}invoke>', re.S)
_PARAM = re.compile(rf'{re.escape(PREFIX)}parameter name="([^"]*)"(?: string="(true|false)")?>(.*?)'
                    rf'</{BAR}DSML{BAR}parameter>', re.S)
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class ToolsError(ValueError):
    """A request's tools, tool_choice or tool messages are malformed; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def request_tools(body: dict) -> tuple[list[dict] | None, bool, bool]:
    """(the tools for the template or None, whether the model's calls are read, parallel_tool_calls)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolsError("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolsError("tool_choice", "'tool_choice' needs 'tools'")
        return None, False, parallel
    if not isinstance(tools, list):
        raise ToolsError("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    clean = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolsError(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolsError(f"tools[{i}].function.name", f"tools[{i}].function.name must be 1-64 letters, digits, "
                             f"'_', '.', ':' or '-', got {name!r}"[:200])
        desc, params = fn.get("description"), fn.get("parameters")
        if desc is not None and not isinstance(desc, str):
            raise ToolsError(f"tools[{i}].function.description", f"tools[{i}].function.description must be a string")
        if params is not None and not isinstance(params, dict):
            raise ToolsError(f"tools[{i}].function.parameters",
                             f"tools[{i}].function.parameters must be a JSON Schema object")
        clean.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    if choice not in (None, "auto", "none"):
        raise ToolsError("tool_choice", "only 'tool_choice' \"auto\" and \"none\" are supported (\"required\" and a "
                         "named function need constrained decoding)")
    return clean, choice != "none", parallel


def message_tool_calls(m: dict, i: int) -> list[dict]:
    """An assistant message's `tool_calls`, for the template: each call's arguments as an object."""
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise ToolsError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolsError(where, f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             "\"arguments\"}}}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ToolsError(f"{where}.function.arguments", f"{where}.function.arguments is not JSON") from None
        if not isinstance(args, dict):
            raise ToolsError(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object")
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _value(raw: str, as_string: str | None):
    if as_string != "false":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _calls(block: str, start: int = 0) -> tuple[list[ToolCall], int]:
    """The invokes closed in block from `start` on, and where the last one ends."""
    calls = []
    for m in _INVOKE.finditer(block, start):
        args = {k: _value(v, s) for k, s, v in _PARAM.findall(m.group(2))}
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", m.group(1), json.dumps(args, ensure_ascii=False)))
        start = m.end()
    return calls, start


def _opener_at(text: str) -> int:
    """Where the first tool-call block opens in text, or -1."""
    found = [i for i in (text.find(o) for o in _OPENERS) if i >= 0]
    return min(found) if found else -1


def parse(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole message: (its content, or None when it is only calls; its calls)."""
    at = _opener_at(text)
    calls = _calls(text, at)[0] if at >= 0 else []
    if not calls:
        return text, []
    content = text[:at].rstrip()
    return (content or None), (calls if parallel else calls[:1])


class StreamParser:
    """One streamed choice: `feed(text)` -> (content to send now, calls complete now). Text that may start a
    tool-call block is held until it does or cannot; once a block opens, each invoke is sent as it closes.
    `finish()` at the end returns what is left: held text that never became a call goes out as content."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.held = ""  # after the sent content: a possible opener's start, or the open block
        self.in_block = False
        self.calls: list[ToolCall] = []
        self.read_to = 0  # in held: where the last invoke read ends (each one is parsed once)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.held += text
        if not self.in_block:
            at = _opener_at(self.held)
            if at < 0:
                keep = _partial_opener(self.held)
                out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return out, []
            out = self.held[:at].rstrip()  # the whitespace before the block stays held: content if it never parses
            self.held, self.in_block = self.held[len(out):], True
            return out, self._closed()
        return "", self._closed()

    def _closed(self) -> list[ToolCall]:
        new, self.read_to = _calls(self.held, self.read_to)
        if not self.parallel:
            new = new[:max(0, 1 - len(self.calls))]
        self.calls += new
        return new

    def finish(self) -> str:
        """What is still held, as content: all of it when no call was read (a block that never parsed is text)."""
        held, self.held = self.held, ""
        return "" if self.calls else held


def _partial_opener(text: str) -> int:
    """How many characters at the end of text to hold: the start of a block's opener, and the whitespace before it
    (a message's content ends before the whitespace that precedes its calls)."""
    n = next((n for n in range(min(len(text), max(map(len, _OPENERS)) - 1), 0, -1)
              if any(o.startswith(text[-n:]) for o in _OPENERS)), 0)
    return len(text) - len(text[:len(text) - n].rstrip())
