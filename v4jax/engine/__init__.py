"""The engine: `EngineCore` (add_request / abort / step), its scheduler, and the jitted steps."""
from v4jax.engine.core import EngineCore, RequestDelta, _snapshot
from v4jax.engine.scheduler import Request, Scheduler

__all__ = ["EngineCore", "RequestDelta", "Request", "Scheduler", "_snapshot"]
