"""v4jax: a JAX/XLA inference stack for DeepSeek-V4-class models."""
from v4jax.api import LLM, RequestOutput
from v4jax.config import ModelConfig, preset
from v4jax.engine.sampling import SamplingParams

__all__ = ["LLM", "ModelConfig", "RequestOutput", "SamplingParams", "preset"]
