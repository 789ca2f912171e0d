"""Text in and out for the server: prompts to token ids, chat messages through the template, ids to text."""
from __future__ import annotations

import os
from typing import Sequence

from v4jax.serve.chat import ChatTemplate


class TextCodec:
    def __init__(self, llm):
        from v4jax.api import DEFAULT_MODEL_DIR
        self.llm = llm
        self.tokenizer = llm.tokenizer
        src = llm.source
        is_dir = os.path.isdir(src)
        is_default = is_dir and os.path.realpath(src) == os.path.realpath(DEFAULT_MODEL_DIR)
        self.template = ChatTemplate.from_model_dir(src, default=is_default) if is_dir else None

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def encode(self, prompt: str | Sequence[int], what: str = "prompt") -> list[int]:
        """LLM.encode: BOS as the tokenizer's config asks; ids checked against the vocabulary (ValueError)."""
        return self.llm.encode(prompt, what)

    def encode_rendered(self, text: str, what: str = "messages") -> list[int]:
        """A rendered chat: the template wrote the special tokens, so none are added."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise ValueError(f"{what}: the chat template rendered an empty prompt")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    def token_text(self, token_id: int) -> str:
        """One token's text (U+FFFD for part of a multi-byte character; "" for a special token)."""
        return self.decode([token_id])

    @property
    def decoder(self):
        """The decode function of the detokenizer, or None without a tokenizer (outputs are ids only)."""
        return self.decode if self.tokenizer is not None else None
