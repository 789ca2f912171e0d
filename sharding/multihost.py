"""One process per host: the JAX multi-controller runtime (jax.distributed).

Every process runs the same program: the same LLM on the same requests, so the same deterministic scheduler takes
the same decisions everywhere and every process calls the same jitted steps in the same order, on one mesh over
all processes' devices. The host-side values that are not deterministic (a request's random seed) are agreed on
by broadcasting process 0's; what the host reads back from a step is replicated, so each process holds all of it.

`initialize` starts the runtime from, in order: its arguments; V4JAX_COORDINATOR_ADDRESS / V4JAX_NUM_PROCESSES /
V4JAX_PROCESS_ID; a Kubernetes LeaderWorkerSet (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX); the
clusters jax.distributed detects itself (Cloud TPU pods, SLURM, ...). With none of them it does nothing."""
from __future__ import annotations

import os

import jax
import numpy as np

ENV_COORDINATOR = "V4JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "V4JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "V4JAX_PROCESS_ID"
DEFAULT_PORT = 8476


def _lws() -> tuple[str, int, int] | None:
    """A LeaderWorkerSet group: the leader (worker 0) coordinates."""
    leader, size, index = (os.environ.get(k) for k in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"))
    if not (leader and size and index) or int(size) < 2:
        return None
    return f"{leader}:{DEFAULT_PORT}", int(size), int(index)


def _auto_detected() -> bool:
    """A cluster jax.distributed.initialize() configures by itself, with more than one process."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu_collectives: str | None = None) -> bool:
    """Start jax.distributed (before anything touches a device). Returns True when this is one process of
    several. `cpu_collectives` ("gloo") for CPU processes standing in for hosts."""
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if coordinator_address is None and (lws := _lws()) is not None:
        coordinator_address, num_processes, process_id = lws
    if coordinator_address is None and not _auto_detected():
        return False
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return jax.process_count() > 1


def agree(value: int) -> int:
    """Process 0's value of a host-side integer, on every process (identity with one process)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils
    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int64)))


class Channel:
    """Process 0's messages to every other process, in order: message n is key `name/n` of the jax.distributed
    coordination service's key-value store. Host memory only, no device collective, so a process may wait for
    the next message for as long as process 0 has nothing to say (an idle server). Processes step the same
    programs in lockstep, so none lags by more than a few messages: process 0 deletes message n - KEEP when it
    publishes message n."""

    KEEP = 256

    def __init__(self, name: str):
        from jax._src import distributed  # the runtime's client; jax has no public handle on its store
        self.name = name
        self._client = distributed.global_state.client
        if self._client is None:
            raise RuntimeError("a Channel needs jax.distributed (sharding.multihost.initialize)")
        self._n = 0

    def publish(self, message: str) -> None:
        self._client.key_value_set(f"{self.name}/{self._n}", message)
        if self._n >= self.KEEP:
            self._client.key_value_delete(f"{self.name}/{self._n - self.KEEP}")
        self._n += 1

    def receive(self, poll_s: float = 5.0) -> str:
        """The next message; waits for it however long it takes."""
        while True:
            try:
                message = self._client.blocking_key_value_get(f"{self.name}/{self._n}", int(poll_s * 1000))
            except Exception as e:  # the store says DEADLINE_EXCEEDED when the wait times out: wait again
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                continue
            self._n += 1
            return message
