"""What the orchestrator needs from an engine, and the one engine that exists: prefill and decode in one `EngineCore`.

The orchestrator drives a `ServingEngine` from one thread and knows nothing else of it. Separate prefill and
decode engines (JetStream's prefill / transfer / generate slices) would sit behind the same interface: a
composite whose `step()` runs prefill chunks on one engine, moves finished prefills' state to the other, and
decodes there, returning the same per-request deltas."""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Protocol, Sequence

from v4jax.engine.core import EngineCore, RequestDelta
from v4jax.engine.sampling import SamplingParams
from v4jax.engine.steps import pin_trace_context


class ServingEngine(Protocol):
    """Called from the orchestrator's engine thread only (except `check`, which reads immutable limits)."""
    max_model_len: int
    max_num_seqs: int
    scores_prompts: bool  # whether prompt_logprobs works here (the HTTP layer answers 501 where it does not)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that could never run (v4jax.engine.checks.RequestError: its `param`
        names the field at fault, its message the numbers); thread-safe."""

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    sample_index: int, route: dict | None = None) -> None:
        """`route`: where a disaggregated engine sends the request ({"prefill": [URL, ...]}, the router's choice);
        engines that run everything themselves ignore it."""

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestDelta]: ...

    def fail_step(self) -> None:
        """After step() raised: end the requests of that step (those holding a decode slot); their pages return.
        The engine can step again afterwards."""

    def request_ids(self) -> set[str]:
        """The requests the engine holds (running, prefilling or waiting)."""

    def failed(self) -> dict[str, str]:
        """Requests that failed outside a step since the last call (request id -> message; they are gone)."""

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict: ...

    def prompt_logprobs(self, prompt_ids: Sequence[int], top_n: int):
        """The prompt scored by one teacher-forced forward (v4jax.api.PromptLogprobs: each token's log-prob given
        those before it, and the top_n alternatives at each position), run between steps; NotImplementedError
        where `scores_prompts` is False."""


class LocalEngine:
    """One `EngineCore` that interleaves prefill chunks with decodes (JetStream's interleaved mode).
    `score_prompt(ids, top_n)`: the model's teacher-forced scoring (`LLM.prompt_logprobs`), or None."""

    def __init__(self, core: EngineCore, score_prompt: Callable | None = None):
        self.core = core
        self.max_model_len = core.max_model_len
        self.max_num_seqs = core.layout.max_slots
        self.request_check = core.request_check
        self.score_prompt = score_prompt
        self.scores_prompts = score_prompt is not None

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        # The engine's own check (EngineCore.add_request runs it too), before the request reaches the engine
        # thread, so that the client gets a 400 instead of a failed stream. The layout never changes.
        self.request_check(prompt_ids, params)

    def add_request(self, request_id, prompt_ids, params, sample_index, route=None):
        self.core.add_request(request_id, prompt_ids, params, sample_index=sample_index)

    def abort(self, request_id):
        return self.core.abort(request_id)

    def step(self):
        return self.core.step()

    def fail_step(self) -> None:
        for rid in self._in_slots():
            self.core.abort(rid)

    def _in_slots(self) -> list[str]:
        return [r.request_id for r in self.core.scheduler.slots if r is not None]

    def request_ids(self) -> set[str]:
        return set(self.core.scheduler.requests)

    def failed(self) -> dict[str, str]:
        return {}

    def has_unfinished_requests(self):
        return self.core.has_unfinished_requests()

    def stats(self):
        return self.core.stats()

    def prompt_logprobs(self, prompt_ids, top_n):
        # On the engine thread between steps: the forward takes no pools (the steps' donated buffers are never
        # its arguments), and running it here keeps its activations from sharing the device with a step's.
        if self.score_prompt is None:
            raise NotImplementedError("this engine was built without a scoring forward")
        pin_trace_context()  # as before a step: the forward's programs then compile once, whichever call is first
        return self.score_prompt(prompt_ids, top_n)


class LeaderEngine:
    """Process 0 of several (one process per host, one mesh over all of them): the orchestrator drives it as it
    drives a `LocalEngine`, and each step it first publishes what changed since the last one (the requests added
    and aborted, fresh seeds already drawn) to the other processes, which replay it into their own `EngineCore`
    (`follow`) and take the same step: the scheduler is deterministic, so every process then calls the same
    jitted steps on the same batch. HTTP, tokenizing and detokenizing stay on process 0.

    Prompt scoring (`echo` with `logprobs`) is not offered: its forward is a program over every process's devices,
    which the other processes would have to run in step, and `follow` replays engine steps only."""
    scores_prompts = False

    def __init__(self, core: EngineCore, channel):
        self.core, self.local = core, LocalEngine(core)
        self.max_model_len, self.max_num_seqs = self.local.max_model_len, self.local.max_num_seqs
        self.channel = channel
        self._pending: list = []

    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.local.check(prompt_ids, params)

    def add_request(self, request_id, prompt_ids, params, sample_index, route=None):
        # A fresh seed is drawn here, so every process samples with it (no collective on the engine thread).
        params = dataclasses.replace(params, seed=params.resolved_seed())
        self.local.add_request(request_id, prompt_ids, params, sample_index)  # a refused one is not published
        self._pending.append(["add", request_id, list(map(int, prompt_ids)), dataclasses.asdict(params),
                              sample_index])

    def abort(self, request_id):
        self._pending.append(["abort", request_id])
        return self.local.abort(request_id)

    def step(self):
        # with the programs compiled in the background since the last step: every process may run steps on them
        # from this one on (v4jax.engine.programs)
        self.channel.publish(json.dumps({"commands": self._pending, "programs": self.core.take_compiled_programs()}))
        self._pending = []
        return self.local.step()

    def fail_step(self) -> None:
        for rid in self.local._in_slots():
            self.abort(rid)  # published: the other processes end them too

    def request_ids(self) -> set[str]:
        return self.local.request_ids()

    def failed(self) -> dict[str, str]:
        return {}

    def has_unfinished_requests(self):
        return self.local.has_unfinished_requests()

    def stats(self):
        return self.local.stats()

    def prompt_logprobs(self, prompt_ids, top_n):
        raise NotImplementedError("prompt log-probs are not supported on a multi-process server")

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
        core.agree_programs(message.get("programs", []))
        core.step()
        steps += 1
