"""Every byte of per-request state: the pool pytree (device, `pools`) and its bookkeeping (host, `pages`)."""
from v4jax.cache.pages import PageAllocator, PageTables, SlotPages
from v4jax.cache.pools import (LOGICAL_AXES, SLOT_FIELDS, DraftState, KVPools, LayerPool, PoolLayout, StepMeta,
                               HOT_COUNTERS, entry_rows, first_slots, hot_counts, init_pools, make_meta,
                               pin_host, pool_bytes, pool_shardings, put_first_slots)

__all__ = ["PageAllocator", "PageTables", "SlotPages", "LOGICAL_AXES", "DraftState", "KVPools", "LayerPool",
           "PoolLayout", "StepMeta", "entry_rows", "init_pools", "make_meta", "pool_bytes", "pool_shardings",
           "SLOT_FIELDS", "first_slots", "put_first_slots", "HOT_COUNTERS", "hot_counts", "pin_host"]
