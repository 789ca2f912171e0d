"""Host time of full-page eviction on a full prefix cache: a tree of 2,000 cached conversations of 16 pages (32,000
nodes, one window tail each), 32 of them mapped by running slots, 16 pages wanted (one new request's prompt), the
conversations' paths touched in random order first. CPU, one core:
python docs/results/cpu-evict-full/evict_full_bench.py"""
import time

import numpy as np

from v4jax.cache.pages import PageAllocator
from v4jax.cache.prefix import PrefixCache

P, chains, depth, mapped = 256, 2000, 16, 32
fa, sa = PageAllocator(chains * depth), PageAllocator(4096)
pc = PrefixCache(fa, sa, P)
paths = []
for c in range(chains):
    parent, pages, path = pc.roots[0], fa.alloc(depth), []
    tail = dict(zip((0, 1), sa.alloc(2)))
    for i in range(depth):
        parent = pc.insert(parent, (c, i) + (0,) * (P - 2), pages[i], tail if i == depth - 1 else None)
        path.append(parent)
    paths.append(path)
    if c >= mapped:  # the first 32 conversations stay mapped by their slots
        fa.decref(pages)
        sa.decref(tail.values())
for c in np.random.default_rng(0).permutation(chains):
    pc.touch(paths[c])
times = []
for _ in range(20):  # each call frees one conversation's 16 pages
    t0 = time.perf_counter()
    freed = pc.evict_full(fa.n_free + 16)
    times.append(time.perf_counter() - t0)
    assert freed == 16
print(f"nodes {pc.n_nodes()}, mapped paths {mapped}: 16 pages freed a call, median {1e3 * np.median(times):.3f} ms, "
      f"min {1e3 * min(times):.3f} ms")
