"""Thinking mode: the reasoning up to </think> split from the answer, whole and streamed in any pieces (the
server's end-to-end test: tests/test_serve.py)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from v4jax.serve import reasoning as R
from v4jax.serve.chat import ChatTemplate

TEXTS = ["<think>Two and two.</think>It is 4.", "Two and two.</think>\n\nIt is 4.", "Still thinking, cut short <",
         "<think>", "<thi", "a </thin b </think>", "</think>", ""]


def test_whole_message():
    assert R.split(TEXTS[0]) == ("Two and two.", "It is 4.")
    assert R.split(TEXTS[1]) == ("Two and two.", "\n\nIt is 4.")
    assert R.split(TEXTS[2]) == (TEXTS[2], None)  # no </think>: all of it is reasoning
    assert R.split(TEXTS[5]) == ("a </thin b ", "")


@settings(max_examples=150, deadline=None)
@given(which=st.integers(0, len(TEXTS) - 1), cuts=st.lists(st.integers(0, 60), max_size=10))
def test_streamed_in_any_pieces_equals_the_whole(which, cuts):
    text = TEXTS[which]
    s, thought, answer, at = R.StreamSplitter(), "", "", 0
    for cut in sorted({c for c in cuts if c <= len(text)}) + [len(text)]:
        t, a = s.feed(text[at:cut])
        thought, answer, at = thought + t, answer + a, cut
    thought += s.finish()
    want_thought, want_answer = R.split(text)
    assert (thought, answer) == (want_thought, want_answer or "")


def test_asked_only_through_a_switch_the_template_reads():
    reads = ChatTemplate("{% if thinking %}<think>{% endif %}{{ messages }}", {})
    ignores = ChatTemplate("{{ messages }}", {})
    assert R.asked({"thinking": True}, reads) and R.asked({"enable_thinking": True},
                                                          ChatTemplate("{{ enable_thinking }}", {}))
    assert not R.asked({"thinking": False}, reads) and not R.asked({}, reads)
    assert not R.asked({"thinking": True}, ignores)
