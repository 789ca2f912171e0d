"""Shared pytest setup: float32 numerics at full matmul precision for every JAX test."""
import os
import sys

import jax
import pytest

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_default_matmul_precision", "highest")

# `import hf_reference` from any test module, whatever the rootdir / import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def rng():
    import numpy as np
    return np.random.default_rng(0)
