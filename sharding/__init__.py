"""Meshes, the one table that maps logical axis names to mesh axes, and arrays placed by it."""
from sharding.rules import (LOGICAL_RULES, MESH_AXES, POOL_AXES, STORE_AXES, MeshRules, make_mesh, parse_mesh_spec,
                            spec_for)

__all__ = ["LOGICAL_RULES", "MESH_AXES", "POOL_AXES", "STORE_AXES", "MeshRules", "make_mesh", "parse_mesh_spec",
           "spec_for"]
