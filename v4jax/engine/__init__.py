"""The engine: `EngineCore` (add_request / abort / step), its scheduler, and the jitted steps."""
from v4jax.engine.core import EngineCore, StepMemoryError
from v4jax.engine.scheduler import Request, RequestDelta, Scheduler

__all__ = ["EngineCore", "StepMemoryError", "RequestDelta", "Request", "Scheduler"]
