"""What the orchestrator needs from an engine, and the one engine that exists: prefill and decode in one `EngineCore`.

The orchestrator drives a `ServingEngine` from one thread and knows nothing else of it. Separate prefill and
decode engines (JetStream's prefill / transfer / generate slices) would sit behind the same interface: a
composite whose `step()` runs prefill chunks on one engine, moves finished prefills' state to the other, and
decodes there, returning the same per-request deltas."""
from __future__ import annotations

import dataclasses
import json
from typing import Protocol, Sequence

from v4jax.engine.core import EngineCore, RequestDelta
from v4jax.engine.steps import MAX_STOP
from v4jax.sampling import SamplingParams


class ServingEngine(Protocol):
    """Called from the orchestrator's engine thread only (except `check`, which reads immutable limits)."""
    max_model_len: int
    max_num_seqs: int

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise ValueError for a request that could never run, its message starting with the field at fault
        (max_tokens, stop_token_ids); thread-safe."""

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    sample_index: int) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestDelta]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict: ...


class LocalEngine:
    """One `EngineCore` that interleaves prefill chunks with decodes (JetStream's interleaved mode)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.max_model_len = core.max_model_len
        self.max_num_seqs = core.layout.max_slots

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        # The limits EngineCore.add_request enforces, checked before the request reaches the engine thread so
        # that the client gets a 400 instead of a failed stream. The layout never changes after construction.
        mt = params.max_tokens
        if prompt_len + mt > self.max_model_len:
            raise ValueError(f"max_tokens: prompt of {prompt_len} tokens + max_tokens={mt} exceeds max_model_len="
                             f"{self.max_model_len}")
        lay = self.core.layout
        if not self.core.tables.dense:
            need = -(-(prompt_len + mt) // lay.page_size)
            if need > lay.n_pages:
                raise ValueError(f"max_tokens: the request needs {need} pages of {lay.page_size} tokens "
                                 f"({prompt_len} prompt + {mt} max_tokens); the pool holds {lay.n_pages}")
        eos = 0 if params.ignore_eos or self.core.cfg.eos_token_id is None else 1
        if len(params.stop_token_ids) + eos > MAX_STOP:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP - eos} are supported, got "
                             f"{len(params.stop_token_ids)}")

    def add_request(self, request_id, prompt_ids, params, sample_index):
        self.core.add_request(request_id, prompt_ids, params, sample_index=sample_index)

    def abort(self, request_id):
        return self.core.abort(request_id)

    def step(self):
        return self.core.step()

    def has_unfinished_requests(self):
        return self.core.has_unfinished_requests()

    def stats(self):
        return self.core.stats()


class LeaderEngine:
    """Process 0 of several (one process per host, one mesh over all of them): the orchestrator drives it as it
    drives a `LocalEngine`, and each step it first publishes what changed since the last one (the requests added
    and aborted, fresh seeds already drawn) to the other processes, which replay it into their own `EngineCore`
    (`follow`) and take the same step: the scheduler is deterministic, so every process then calls the same
    jitted steps on the same batch. HTTP, tokenizing and detokenizing stay on process 0."""

    def __init__(self, core: EngineCore, channel):
        self.core, self.local = core, LocalEngine(core)
        self.max_model_len, self.max_num_seqs = self.local.max_model_len, self.local.max_num_seqs
        self.channel = channel
        self._pending: list = []

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        self.local.check(prompt_len, params)

    def add_request(self, request_id, prompt_ids, params, sample_index):
        # A fresh seed is drawn here, so every process samples with it (no collective on the engine thread).
        params = dataclasses.replace(params, seed=params.resolved_seed())
        self.local.add_request(request_id, prompt_ids, params, sample_index)  # a refused one is not published
        self._pending.append(["add", request_id, list(map(int, prompt_ids)), dataclasses.asdict(params),
                              sample_index])

    def abort(self, request_id):
        self._pending.append(["abort", request_id])
        return self.local.abort(request_id)

    def step(self):
        self.channel.publish(json.dumps({"commands": self._pending}))
        self._pending = []
        return self.local.step()

    def has_unfinished_requests(self):
        return self.local.has_unfinished_requests()

    def stats(self):
        return self.local.stats()

    def close(self) -> None:
        """The other processes leave `follow` (call it once the engine thread has stopped)."""
        self.channel.publish(json.dumps({"stop": True}))


def follow(core: EngineCore, channel) -> int:
    """Processes other than 0: replay process 0's engine commands and take the same steps until it stops.
    Returns the number of steps taken."""
    steps = 0
    while True:
        message = json.loads(channel.receive())
        if message.get("stop"):
            return steps
        for command in message["commands"]:
            if command[0] == "add":
                _, request_id, prompt, params, sample_index = command
                core.add_request(request_id, prompt, SamplingParams(**params), sample_index=sample_index)
            else:
                core.abort(command[1])
        core.step()
        steps += 1
