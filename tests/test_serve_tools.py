"""Tool calls: the DSML blocks of a model's text read as OpenAI tool calls, whole and streamed in any pieces, and the
request's tools checked (the server's end-to-end tests: tests/test_serve.py)."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v4jax.serve import tools as T

B = "\uff5c"


def block(*invokes, spelling="function_calls") -> str:
    body = "".join(f'<{B}DSML{B}invoke name="{name}">\n' + "".join(
        f'<{B}DSML{B}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else json.dumps(v)}</{B}DSML{B}parameter>\n' for k, v in args.items())
        + f"</{B}DSML{B}invoke>\n" for name, args in invokes)
    return f"<{B}DSML{B}{spelling}>\n{body}</{B}DSML{B}{spelling}>"


WEATHER = ("get_weather", {"city": "Paris", "days": 3, "units": {"temp": "C"}, "note": "a < b & \"c\""})
SEARCH = ("web.search", {"query": "DSML", "top": 5, "exact": True})
TEXTS = [
    "Let me check.\n\n" + block(WEATHER, SEARCH),
    block(WEATHER, spelling="tool_calls"),
    "No tools needed: 2 < 3 and <b>bold</b>.",
    "It ends on the start of a block: <" + B + "DS",
    "A block that never closes its invoke: " + f'<{B}DSML{B}function_calls>\n<{B}DSML{B}invoke name="x">',
    "  \n",
]


def _streamed(text: str, cuts: list[int], parallel: bool = True):
    p, content, calls, at = T.StreamParser(parallel), "", [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        c, k = p.feed(text[at:cut])
        content, calls, at = content + c, calls + k, cut
    return content + p.finish(), calls


def test_whole_message_calls_and_content():
    content, calls = T.parse(TEXTS[0])
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [WEATHER, SEARCH]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].openai(index=0) == {"index": 0, "id": calls[0].id, "type": "function",
                                        "function": {"name": "get_weather", "arguments": calls[0].arguments}}
    content, calls = T.parse(TEXTS[1])  # V4's spelling; only calls: no content
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert T.parse(TEXTS[0], parallel=False)[1][0].name == "get_weather" and len(T.parse(TEXTS[0], False)[1]) == 1
    for text in TEXTS[2:]:  # no block, or one that does not parse: the text as it is
        assert T.parse(text) == (text, [])
    # a value marked JSON that is not JSON stays as written
    bad = f'<{B}DSML{B}tool_calls><{B}DSML{B}invoke name="f"><{B}DSML{B}parameter name="n" string="false">1,2' \
          f'</{B}DSML{B}parameter></{B}DSML{B}invoke></{B}DSML{B}tool_calls>'
    assert json.loads(T.parse(bad)[1][0].arguments) == {"n": "1,2"}


@settings(max_examples=150, deadline=None)
@given(which=st.integers(0, len(TEXTS) - 1), cuts=st.lists(st.integers(0, 400), max_size=12),
       parallel=st.booleans())
def test_streamed_in_any_pieces_equals_the_whole(which, cuts, parallel):
    """However the text arrives, the streamed content and calls are the whole message's (content None: "")."""
    text = TEXTS[which]
    content, calls = _streamed(text, [c for c in cuts if c <= len(text)], parallel)
    want_content, want_calls = T.parse(text, parallel)
    assert content == (want_content or "")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


def test_a_call_is_sent_as_soon_as_its_invoke_closes():
    text = "Checking." + block(WEATHER, SEARCH)
    first_end = text.index(f"</{B}DSML{B}invoke>") + len(f"</{B}DSML{B}invoke>")
    p = T.StreamParser()
    content, calls = p.feed(text[:first_end])
    assert content == "Checking." and [c.name for c in calls] == ["get_weather"]
    content, calls = p.feed(text[first_end:])
    assert content == "" and [c.name for c in calls] == ["web.search"] and p.finish() == ""


def test_request_tools_are_checked():
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                             "parameters": {"type": "object", "properties": {}}}}
    assert T.request_tools({"tools": [tool]}) == ([tool], True, True)
    assert T.request_tools({"tools": [tool], "tool_choice": "none", "parallel_tool_calls": False}) == \
        ([tool], False, False)
    assert T.request_tools({}) == (None, False, True)
    for body, param in [({"tools": [tool], "tool_choice": "required"}, "tool_choice"),
                        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": {"a": 1}}, "tools"),
                        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
                        ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
                         "tools[0].function.name"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
                         "tools[0].function.parameters"),
                        ({"tools": [tool], "parallel_tool_calls": "yes"}, "parallel_tool_calls")]:
        with pytest.raises(T.ToolsError) as e:
            T.request_tools(body)
        assert e.value.param == param, body


def test_an_assistant_messages_calls_reach_the_template_as_objects():
    m = {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    assert T.message_tool_calls(m, 2) == [{"id": "call_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    for args, param in [("{not json", "messages[2].tool_calls[0].function.arguments"),
                        ("[1, 2]", "messages[2].tool_calls[0].function.arguments")]:
        with pytest.raises(T.ToolsError) as e:
            T.message_tool_calls({"tool_calls": [{"function": {"name": "f", "arguments": args}}]}, 2)
        assert e.value.param == param
    with pytest.raises(T.ToolsError):
        T.message_tool_calls({"tool_calls": [{"function": {}}]}, 0)


def test_templates_that_render_tools_are_told_apart():
    from v4jax.serve.chat import ChatTemplate
    reads = lambda src: ChatTemplate(src, {}).reads("tools")
    assert reads("{% for t in tools %}{{ t['function']['name'] }}{% break %}{% endfor %}{{ messages }}")
    assert reads("{% if tools is defined and tools %}x{% endif %}")
    assert not reads("{% for m in messages %}{{ m['content'] }}{% endfor %}")
