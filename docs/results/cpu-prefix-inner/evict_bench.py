import time, numpy as np
from v4jax.cache.pages import PageAllocator
from v4jax.cache.prefix import PrefixCache
P = 256
n_full, n_swa = 32768, 4096
fa, sa = PageAllocator(n_full), PageAllocator(n_swa)
pc = PrefixCache(fa, sa, P)
rng = np.random.default_rng(0)
chains, depth = 2000, 16
for c in range(chains):
    parent = pc.roots[0]
    pages = fa.alloc(depth)
    for i in range(depth):
        tail = None
        if i == depth - 1 and sa.n_free >= 2:
            tail = dict(zip((0, 1), sa.alloc(2)))
        node = pc.insert(parent, (c, i) + (0,) * (P - 2), pages[i], tail)
        parent = node
    fa.decref(pages)  # the slot lets go: only the tree holds them
    if tail: sa.decref(tail.values())
print("nodes", pc.n_nodes(), "free full", fa.n_free)
for f in (pc.evictable,):
    t0 = time.perf_counter(); f(); print("evictable", f"{1e3*(time.perf_counter()-t0):.1f} ms")
t0 = time.perf_counter(); pc.evict_full(np.array([5])); print("evict_full 5", f"{1e3*(time.perf_counter()-t0):.1f} ms")
t0 = time.perf_counter(); pc.evict_swa(np.array([sa.n_free + 4])); print("evict_swa", f"{1e3*(time.perf_counter()-t0):.1f} ms")
t0 = time.perf_counter(); pc.evict_full(np.array([fa.n_free + 16])); print("evict_full +16", f"{1e3*(time.perf_counter()-t0):.1f} ms")
t0 = time.perf_counter(); pc.evictable(); print("evictable again", f"{1e3*(time.perf_counter()-t0):.1f} ms")
