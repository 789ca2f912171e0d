"""Token ids to text as they arrive, and stop strings matched across token boundaries.

`SequenceText.push(ids, logprobs, final)` returns the text that is safe to send now, the token ids (and their
log-probabilities) that count, and whether a stop string ended the sequence. Text that could still be the start
of a stop string is held back until it cannot be, so a stop string is never sent in part; the text is cut
before the stop string, and tokens after the one that completed it are dropped."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Decodes a growing id list in O(new tokens): each token's text is the decode of a short window minus the
    decode of the window without it. A token that ends inside a UTF-8 sequence yields nothing until the sequence
    is complete (byte-level BPE splits multi-byte characters across tokens)."""

    def __init__(self, decode: Decode):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start: context that keeps the decode of the window's first token right
        self.read = 0  # tokens whose text has been returned

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back (an unfinished UTF-8 sequence becomes U+FFFD, as a full decode gives)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


@dataclasses.dataclass
class Pushed:
    text: str  # text safe to send now
    token_ids: list[int]  # ids that count (those after a stop string's end are dropped)
    logprobs: list[float]
    stopped: bool  # a stop string ended the sequence


class SequenceText:
    """min_tokens: stop strings count only in text decoded from this many tokens on (vLLM's rule: a stop string
    whose last character came earlier is not looked for again). include_stop: the text ends after the stop string
    that ended it instead of before (vLLM's include_stop_str_in_output)."""

    def __init__(self, decode: Decode | None, stop: Sequence[str] = (), min_tokens: int = 0,
                 include_stop: bool = False):
        self.detok = IncrementalDetokenizer(decode) if decode is not None else None
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens = min_tokens
        self.n_tokens = 0  # tokens pushed so far
        self.text = ""  # everything decoded so far (cut at a stop string)
        self.sent = 0  # characters of self.text already returned

    def push(self, token_ids: Sequence[int], logprobs: Sequence[float] = (), final: bool = False) -> Pushed:
        ids, lps = list(token_ids), list(logprobs)
        if self.detok is None:
            return Pushed("", ids, lps, False)
        for i, t in enumerate(ids):
            self.n_tokens += 1
            if self._extend(self.detok.push(t)):
                return self._release(ids[:i + 1], lps[:i + 1], stopped=True)
        if final and self._extend(self.detok.flush()):
            return self._release(ids, lps, stopped=True)
        return self._release(ids, lps, stopped=False, final=final)

    def _extend(self, piece: str) -> bool:
        """Append decoded text; True when a stop string is now complete (the text is cut before it)."""
        if not piece:
            return False
        start = max(self.sent, len(self.text) - self.hold)  # an earlier start would have been found before
        self.text += piece
        if self.n_tokens < self.min_tokens:
            return False
        hits = [(p, len(s)) for p, s in ((self.text.find(s, start), s) for s in self.stop) if p >= 0]
        if hits:
            at, length = min(hits, key=lambda h: h[0])  # the earliest; at one place, the first listed
            self.text = self.text[:at + length if self.include_stop else at]
            return True
        return False

    def _release(self, ids, lps, stopped: bool, final: bool = False) -> Pushed:
        # Running: hold back the last (longest stop - 1) characters, the only ones a stop string could start in.
        end = len(self.text) if stopped or final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return Pushed(out, ids, lps, stopped)
