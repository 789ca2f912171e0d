"""Thinking mode (chat): the model's reasoning, up to `</think>`, returned apart from its answer as
`reasoning_content` (DeepSeek's API field), as vLLM's DeepSeek reasoning parsers do.

DeepSeek V3.1 / V3.2 / V4 think when the chat template is asked to (`chat_template_kwargs: {"thinking": true}`; also
`enable_thinking`): the template opens `<think>` in the prompt, the model writes its reasoning, `</think>`, then its
answer (and any tool calls, v4jax.serve.tools). Without a `</think>` (cut by max_tokens) the whole text is
reasoning. The split is made only when the request asks for thinking and the template reads that switch (else the
text was not written in thinking mode)."""
from __future__ import annotations

START, END = "<think>", "</think>"
SWITCHES = ("thinking", "enable_thinking")


def asked(kwargs: dict, template) -> bool:
    """Whether a chat request asks for thinking through a switch its template reads."""
    return any(kwargs.get(k) is True and template.reads(k) for k in SWITCHES)


def split(text: str) -> tuple[str, str | None]:
    """A whole message: (its reasoning, its answer or None when the reasoning never ended)."""
    at = text.find(END)
    if at < 0:
        return _unopened(text), None
    return _unopened(text[:at]), text[at + len(END):]


def _unopened(reasoning: str) -> str:
    return reasoning[len(START):] if reasoning.startswith(START) else reasoning


class StreamSplitter:
    """One streamed choice: `feed(text)` -> (reasoning to send now, answer to send now); text that may start
    `</think>` is held until it does or cannot. `finish()`: what is still held, as reasoning."""

    def __init__(self):
        self.held = ""
        self.answering = False
        self.started = False  # a leading "<think>" is dropped once it is known to be there or not

    def feed(self, text: str) -> tuple[str, str]:
        if self.answering:
            return "", text
        self.held += text
        if not self.started:
            if START.startswith(self.held):
                return "", ""  # maybe "<think>": wait for more
            self.started = True
            self.held = _unopened(self.held)
        at = self.held.find(END)
        if at >= 0:
            reasoning, answer = self.held[:at], self.held[at + len(END):]
            self.held, self.answering = "", True
            return reasoning, answer
        keep = next((n for n in range(min(len(self.held), len(END) - 1), 0, -1)
                     if END.startswith(self.held[-n:])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, ""

    def finish(self) -> str:
        held, self.held = self.held, ""
        return held if self.started or self.answering else _unopened(held)
