"""The one request check: what makes a request impossible for an engine, decided before it runs.

    check = RequestCheck.of(cfg, layout, max_model_len, paged=True)
    check(prompt_ids, params)        # ValueError (a RequestError) naming the numbers, or nothing

`EngineCore.add_request`, `LLM.generate` (for every prompt, before anything runs) and the server (a 400 with an
OpenAI error body, `param` = the error's field) all call it, so one impossible request gets one message
wherever it enters. The rules:
- the prompt is non-empty and every id is inside the vocabulary;
- prompt + max_tokens <= max_model_len;
- (paged) the pages of prompt + max_tokens fit the pages a request can use: those of its own data shard (a slot
  maps pages of its shard only, v4jax.cache.pages.PageTables), i.e. the pool's pages / the mesh's `data` size;
- the stop ids (stop_token_ids, plus EOS unless ignore_eos) fit the decode step's table of `steps.MAX_STOP`;
- the logit_bias ids are inside the vocabulary."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from v4jax.config import ModelConfig
from v4jax.engine.steps import MAX_STOP
from v4jax.engine.sampling import SamplingParams


class RequestError(ValueError):
    """A request that can never run. `param` is the field at fault ("prompt": empty, ids outside the vocabulary,
    or longer than the context alone; "max_tokens"; "stop_token_ids");
    `code` the OpenAI error code the server answers with."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def check_prompt_ids(ids: list[int], vocab_size: int, what: str = "prompt") -> None:
    """A non-empty list of ints inside [0, vocab_size) (the caller has made them ints)."""
    if not ids:
        raise RequestError(f"{what} is empty", "prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise RequestError(f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "prompt")


@dataclasses.dataclass(frozen=True)
class RequestCheck:
    vocab_size: int
    max_model_len: int
    model_max_len: int  # the config's own limit (what max_model_len may be raised to)
    eos_token_id: int | None
    page_size: int  # tokens per full page
    n_pages: int  # full pages of the whole pool; 0 = dense layout (every slot holds max_model_len: no page rule)
    data_shards: int = 1
    max_stop: int = MAX_STOP
    speculative: bool = False  # the engine drafts (speculative decoding): penalties are not applied there

    @classmethod
    def of(cls, cfg: ModelConfig, layout, max_model_len: int, paged: bool = True) -> "RequestCheck":
        """From an engine's config, pool layout (v4jax.cache.pools.PoolLayout) and context limit."""
        return cls(cfg.vocab_size, max_model_len, cfg.max_seq_len, cfg.eos_token_id, layout.page_size,
                   layout.n_pages if paged else 0, layout.data_shards, speculative=layout.draft_tokens > 0)

    @classmethod
    def for_options(cls, cfg: ModelConfig, options, dtype, max_model_len: int,
                    mesh_shape: dict | None = None) -> "RequestCheck":
        """The check of the engine these options would build (the same layout function), without building it."""
        from v4jax.cache.layout import kv_cache_dtype, pool_layout
        mesh_shape = mesh_shape or {}
        lay = pool_layout(cfg, options, kv_cache_dtype(options.kv_cache_dtype, dtype), max_model_len, mesh_shape.get("data", 1), mesh_shape.get("context", 1))
        return cls.of(cfg, lay, max_model_len, paged=options.kv_layout != "dense")

    @property
    def pages_per_request(self) -> int:
        """The most full pages one request can use: its data shard's."""
        return self.n_pages // self.data_shards

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError (a ValueError) for a request that could never run; thread-safe (reads only)."""
        ids = prompt_ids if isinstance(prompt_ids, list) else list(prompt_ids)
        check_prompt_ids(ids, self.vocab_size)
        outside = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise RequestError(f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {self.vocab_size})",
                               "logit_bias")
        if self.speculative and params.penalized:
            name = params.penalties[0]
            raise RequestError(f"{name}: penalties are not supported with speculative decoding (an engine without "
                               "speculative_config applies them)", name)
        self.check_size(len(ids), params)

    def check_size(self, n: int, params: SamplingParams) -> None:
        """The rules that depend on the prompt's length only (its ids already checked)."""
        mt, limit = params.max_tokens, self.max_model_len
        if n + mt > limit:
            room = f"lower max_tokens to at most {limit - n}, " if n < limit else ""
            raise RequestError(
                f"prompt_len={n} + max_tokens={mt} = {n + mt} tokens exceed the context limit max_model_len={limit}; "
                f"shorten the prompt, {room}or raise max_model_len (this model allows up to {self.model_max_len})",
                "prompt" if n >= limit else "max_tokens", "context_length_exceeded")
        if self.n_pages:
            need = -(-(n + mt) // self.page_size)
            have = self.pages_per_request
            if need > have:
                if self.data_shards == 1:
                    where = f"the pool holds {self.n_pages}"
                else:
                    where = (f"a request uses only its own data shard's pages: {have} per data shard (the pool holds "
                             f"{self.n_pages} over data={self.data_shards})")
                raise RequestError(
                    f"the request needs {need} pages of {self.page_size} tokens (prompt_len={n} + max_tokens={mt}); "
                    f"{where}; lower max_tokens or raise memory_budget_bytes", "max_tokens", "request_too_large")
        stops = len(params.stop_token_ids)
        eos = 0 if params.ignore_eos or self.eos_token_id is None else 1
        if stops + eos > self.max_stop:
            raise RequestError(f"stop_token_ids: at most {self.max_stop - eos} are supported"
                               f"{' besides EOS' if eos else ''}, got {stops}", "stop_token_ids")
