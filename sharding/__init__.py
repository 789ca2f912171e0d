"""Meshes and the one table that maps logical axis names to mesh axes."""
from sharding.rules import LOGICAL_RULES, make_mesh, param_logical_axes, shard_params, shard_pools, spec_for

__all__ = ["LOGICAL_RULES", "make_mesh", "param_logical_axes", "shard_params", "shard_pools", "spec_for"]
