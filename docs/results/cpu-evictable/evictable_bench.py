"""Host time of "could eviction make room?" on a full prefix cache: a tree of 2,000 cached conversations of 16
pages (32,000 nodes, one window tail each), 32 of them mapped by running slots, and a waiting request whose need
the tree cannot meet (so the count cannot stop early). CPU, one core:
python docs/results/cpu-evictable/evictable_bench.py"""
import inspect
import time

import numpy as np

from v4jax.cache.pages import PageAllocator
from v4jax.cache.prefix import PrefixCache

P, chains, depth, mapped = 256, 2000, 16, 32
fa, sa = PageAllocator(chains * depth + 64), PageAllocator(4096)
pc = PrefixCache(fa, sa, P)
for c in range(chains):
    parent, pages = pc.roots[0], fa.alloc(depth)
    tail = dict(zip((0, 1), sa.alloc(2)))
    for i in range(depth):
        parent = pc.insert(parent, (c, i) + (0,) * (P - 2), pages[i], tail if i == depth - 1 else None)
    if c >= mapped:  # the first 32 conversations stay mapped by their slots
        fa.decref(pages)
        sa.decref(tail.values())
need = (np.array([fa.n_free + chains * depth]), np.array([0]))  # more than the whole tree: no early stop
early_stop = "enough" in inspect.signature(pc.evictable).parameters
times = []
for _ in range(20):
    t0 = time.perf_counter()
    counts = pc.evictable(need) if early_stop else pc.evictable()
    times.append(time.perf_counter() - t0)
print(f"nodes {pc.n_nodes()}, mapped paths {mapped}: evictable {[c.tolist() for c in counts]}, "
      f"median {1e3 * np.median(times):.2f} ms, min {1e3 * min(times):.2f} ms")
