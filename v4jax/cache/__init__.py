"""Every byte of per-request state: the pool pytree (device, `pools`) and its bookkeeping (host, `pages`)."""
from v4jax.cache.pages import PageAllocator, PageTables, SlotPages
from v4jax.cache.pools import (LOGICAL_AXES, KVPools, LayerPool, PoolLayout, StepMeta, entry_rows, init_pools,
                               make_meta, pool_bytes, pool_shardings)

__all__ = ["PageAllocator", "PageTables", "SlotPages", "LOGICAL_AXES", "KVPools", "LayerPool", "PoolLayout", "StepMeta",
           "entry_rows", "init_pools", "make_meta", "pool_bytes", "pool_shardings"]
