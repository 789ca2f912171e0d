"""Page allocators split into data (x context) shards, host only: a slot's pages come from its shard's blocks and
go back there, admission and preemption look at the slot's own shard, and a prefix is shared only within the
shard that holds it. With one shard the allocator hands out the same ids as a single free list."""
import numpy as np
import pytest

from v4jax.cache import PageAllocator, PageTables, PoolLayout
from v4jax.cache.manager import KVCacheManager
from v4jax.cache.prefix import PrefixCache
from v4jax.config import preset
from v4jax.engine.scheduler import RUNNING, Scheduler
from v4jax.engine.sampling import SamplingParams

CFG = preset("tiny")  # window 8, ratios 4 and 16
P = 16


def _tables(n_pages=16, n_swa=16, slots=4, data=2, context=1, max_pages=8, dense=False):
    lay = PoolLayout(page_size=P, swa_page_size=P, n_pages=n_pages, n_swa_pages=n_swa, max_slots=slots,
                     max_pages_per_seq=max_pages, max_swa_pages_per_seq=max_pages, data_shards=data,
                     context_shards=context)
    return PageTables(CFG, lay, dense)


def _scheduler(tables, caching=True, chunk=64):
    """A scheduler over a KV-cache manager whose page tables are `tables` (so the tests can look at them)."""
    lay = tables.layout
    kv = KVCacheManager(CFG, lay, dense=tables.dense, caching=caching)
    kv._tables = tables
    kv._prefix = PrefixCache(tables.full_alloc, tables.swa_alloc, P, lay.data_shards) if caching else None
    sch = Scheduler(kv, max_num_seqs=lay.max_slots, prefill_chunk=chunk, decode_steps=2,
                    max_model_len=lay.max_pages_per_seq * P)
    sch.prefix = kv._prefix
    return sch


def _add(sch, rid, prompt, max_tokens=2):
    return sch.add(rid, prompt, SamplingParams(max_tokens=max_tokens), 0, 0, ())


def _prefill(sch):
    """What EngineCore does with a prefill step's plans, without the device: the chunks count as computed and
    their full pages go into the prefix tree; a finished prompt starts decoding (its first token: 1)."""
    chunks = sch.next_chunks()
    sch.advance_prefill(chunks)
    sch.finish_prefill(chunks, np.ones(len(chunks), np.int32), np.zeros(len(chunks), np.float32))


def test_one_block_hands_out_the_ids_of_one_free_list():
    a = PageAllocator(6)
    assert a.alloc(3) == [0, 1, 2]
    a.decref([1])
    assert a.alloc(2) == [1, 3] and a.alloc(2) == [4, 5]  # a freed page is the next one handed out


def test_blocks_alloc_and_free_in_their_own_range():
    a = PageAllocator(8, 2)
    assert a.block_size == 4 and a.alloc(2, 1) == [4, 5] and a.alloc(1, 0) == [0]
    assert a.free_per_block.tolist() == [3, 2]
    with pytest.raises(MemoryError):
        a.alloc(3, 1)  # block 1 has 2 left, though block 0 has 3
    a.decref([4, 0])
    assert a.free_per_block.tolist() == [4, 3] and a.alloc(1, 1) == [4]  # back to its own block's list
    assert a.n_free == 6 and a.n_used == 2
    with pytest.raises(ValueError, match="equal blocks"):
        PageAllocator(7, 2)


@pytest.mark.parametrize("data,context", [(2, 1), (2, 2), (4, 1)])
def test_a_slot_takes_pages_of_its_shard_blocks_and_frees_them_there(data, context):
    t = _tables(n_pages=16, n_swa=16, slots=4, data=data, context=context)
    blocks = data * context
    for slot in range(4):
        d = slot // (4 // data)
        t.reserve(slot, 0, 3 * P)  # pages 0, 1, 2 of the sequence
        full = t.held[slot].full
        assert [pg // (16 // blocks) for pg in full] == [d * context + j % context for j in range(3)], (slot, full)
        assert all(pg // (16 // data) == d for pg in t.held[slot].swa.values())
        assert t.full[slot, :3].tolist() == full
    free_before = t.full_alloc.free_per_block.copy()
    t.release(1)
    d1 = 1 // (4 // data)
    freed = t.full_alloc.free_per_block - free_before
    assert freed.sum() == 3 and set(np.flatnonzero(freed) // context) == {d1}
    assert (t.full[1] == -1).all() and (t.swa[1] == -1).all()


def test_shard_usage_counts_each_shards_own_pages():
    t = _tables(n_pages=16, n_swa=16, slots=4, data=2, context=2)  # 4 full pages per block, 8 SWA per shard
    t.reserve(3, 0, 3 * P)  # slot 3 is in shard 1: pages 0, 2 from block 2 (context 0), page 1 from block 3
    use = t.shard_usage([3])
    assert use[0] == {"data": 0, "slots": {"used": 0, "total": 2},
                      "full_pages": [{"used": 0, "total": 4}, {"used": 0, "total": 4}],
                      "swa_pages": {"used": 0, "total": 8}}
    assert use[1]["slots"]["used"] == 1 and [b["used"] for b in use[1]["full_pages"]] == [2, 1]
    assert use[1]["swa_pages"]["used"] == len(t.held[3].swa) > 0
    assert "full_pages" not in _tables(dense=True).shard_usage([0])[0]


def test_reserve_refuses_when_the_slots_shard_is_full():
    t = _tables(n_pages=8, n_swa=16, slots=4, data=2)  # 4 full pages per shard
    t.reserve(0, 0, 4 * P)  # slot 0 (shard 0) takes all of shard 0's pages
    assert t.needs(2, 0, P)[0].tolist() == [0, 1]  # slot 2 is in shard 1
    with pytest.raises(MemoryError, match="data shard 0"):
        t.reserve(1, 0, P)
    t.reserve(2, 0, P)  # shard 1 still has room
    assert t.full_alloc.free_per_block.tolist() == [0, 3]


def test_adopt_refuses_pages_of_another_shard():
    t = _tables(n_pages=8, n_swa=16, slots=4, data=2)
    t.reserve(0, 0, 2 * P)
    pages = list(t.held[0].full)
    with pytest.raises(ValueError, match="another shard"):
        t.adopt(2, pages, {})
    t.adopt(1, pages, {})  # slot 1 is in shard 0 too
    assert t.full_alloc.refs[pages].tolist() == [2, 2]


@pytest.mark.parametrize("context", [1, 2])
def test_dense_spans_follow_the_blocks(context):
    t = _tables(n_pages=2 * context * 2 * -(-4 // context), n_swa=16, slots=4, data=2, context=context, max_pages=4,
                dense=True)
    bs = t.full_alloc.block_size
    for slot in range(4):
        assert [pg // bs for pg in t.full[slot]] == [(slot // 2) * context + j % context for j in range(4)]
    assert len(set(t.full.ravel().tolist())) == t.full.size  # every page of one slot only


def test_one_shard_dense_is_the_identity_span():
    t = _tables(n_pages=12, n_swa=12, slots=3, data=1, max_pages=4, dense=True)
    assert t.full.tolist() == np.arange(12).reshape(3, 4).tolist()


def test_admission_counts_the_pages_of_a_free_slots_shard_only():
    t = _tables(n_pages=8, n_swa=32, slots=4, data=2)  # 4 full pages per shard, 2 slots per shard
    sch = _scheduler(t, caching=False)
    big = _add(sch, "big", list(range(2, 2 + 3 * P)))  # 3 pages + 1 for its decode steps: a whole shard
    assert sch.admit() == [big] and t.shard_of(big.slot) == 0
    small = [_add(sch, f"s{i}", [5] * 4) for i in range(2)]
    assert sch.admit() == small and {t.shard_of(r.slot) for r in small} == {1}  # shard 0 has no page left
    late = _add(sch, "late", [6] * 4)
    # a free slot in shard 0 but no page for it there; shard 1 has pages but no free slot
    assert sch.admit() == [] and late.status == "waiting"
    sch.remove(big)
    assert sch.admit() == [late] and t.shard_of(late.slot) == 0


def test_a_dry_shard_preempts_within_itself():
    t = _tables(n_pages=8, n_swa=32, slots=4, data=2)
    sch = _scheduler(t, caching=False, chunk=16)
    a = _add(sch, "a", [3] * (2 * P), max_tokens=2 * P)
    b = _add(sch, "b", [4] * (2 * P), max_tokens=2 * P)  # shard 1 (the emptier one)
    c = _add(sch, "c", [5] * (P - 4))  # shard 0, beside a: its one page is the last of shard 0's four
    assert sch.admit() == [a, b, c]
    assert [t.shard_of(r.slot) for r in (a, b, c)] == [0, 1, 0]
    for _ in range(5):  # one 16-token row per step
        _prefill(sch)
    assert all(r.status == RUNNING for r in (a, b, c))
    # a grows past its shard's pages: c (newer, same shard) is preempted, not b (newest overall, other shard)
    assert sch.reserve(a, a.fed, 4 * P)
    assert c.status == "waiting" and c in sch.waiting and b.status == RUNNING and sch.n_preempted == 1


def test_a_prefix_is_shared_only_within_its_shard():
    t = _tables(n_pages=16, n_swa=32, slots=4, data=2)
    sch = _scheduler(t, chunk=64)
    shared = list(range(2, 2 + 2 * P))
    first = _add(sch, "first", shared + [7, 7])
    assert sch.admit() == [first]
    d0 = t.shard_of(first.slot)
    _prefill(sch)  # its two full pages (and the tail of the second) are cached in d0's tree
    assert sch.prefix.lookup(shared + [9], 2, d0) and not sch.prefix.lookup(shared + [9], 2, 1 - d0)
    _prefill(sch)  # the rest of its prompt (a request sharing its first page waits until then)
    # the second request goes to the shard that holds its prefix, though the other has more free slots
    second = _add(sch, "second", shared + [8, 8])
    assert sch.admit() == [second] and t.shard_of(second.slot) == d0
    assert t.held[second.slot].full == t.held[first.slot].full[:2] and second.computed == 2 * P
    _prefill(sch)
    # the hit's shard is now full: the third runs cold in the other shard (no page of d0 there)
    third = _add(sch, "third", shared + [9, 9])
    assert sch.admit() == [third] and t.shard_of(third.slot) == 1 - d0
    assert third.computed == 0 and t.held[third.slot].full == []
    _prefill(sch)
    d1_pages = t.held[third.slot].full
    assert all(pg // t.full_alloc.block_size == 1 - d0 for pg in d1_pages)
    # each shard now caches the prefix on its own pages
    for d in (0, 1):
        path = sch.prefix.lookup(shared + [9], 2, d)
        assert len(path) == 2 and all(n.page // t.full_alloc.block_size == d for n in path)


def test_eviction_frees_pages_of_the_short_shard():
    t = _tables(n_pages=8, n_swa=32, slots=4, data=2)
    sch = _scheduler(t, chunk=64)
    rs = []
    for i in range(2):
        rs.append(_add(sch, f"r{i}", [10 + i] * (2 * P) + [1]))
        sch.admit()
    assert [t.shard_of(r.slot) for r in rs] == [0, 1]
    _prefill(sch)
    for r in rs:
        sch.remove(r)  # its pages stay in its shard's tree
    assert sch.prefix.n_nodes() == 4 and t.full_alloc.free_per_block.tolist() == [2, 2]
    sch.prefix.evict_full(np.array([4, 0]))
    assert t.full_alloc.free_per_block.tolist() == [4, 2] and sch.prefix.n_nodes() == 2
    assert len(sch.prefix.lookup([11] * (2 * P) + [1], 2, 1)) == 2  # shard 1's prefix untouched


def test_a_long_cached_prefix_is_counted_evicted_and_cleared():
    # a 128K-token prompt in 64-token pages is a chain of 2048 nodes: deeper than Python's recursion limit (a
    # recursive walk of the tree raised RecursionError when the next long request needed room)
    n = 3000
    full, swa = PageAllocator(n + 10), PageAllocator(4)
    cache = PrefixCache(full, swa, 1)
    pages = full.alloc(n)
    node = cache.root
    for i, pg in enumerate(pages):
        node = cache.insert(node, (i,), pg, None)
    side = cache.insert(cache.root.children[(0,)], (-1,), full.alloc(1)[0], None)  # a branch off the first node
    full.decref(pages[:-1] + [side.page])  # the slots let go of all but the chain's last page
    assert cache.evictable()[0].tolist() == [1]  # only the side branch: every chain node is above a mapped page
    full.decref(pages[-1:])
    assert cache.evictable()[0].tolist() == [n + 1]
    assert cache.evict_full(full.n_free + 5) == 5 and cache.n_nodes() == n - 4  # least recently used first
    cache.check()
    assert len(cache.lookup(list(range(n - 5)), n - 5)) == 0  # (no node keeps a tail: nothing resumable)
    cache.clear()
    assert cache.n_nodes() == 0 and full.n_free == n + 10


def test_a_requests_token_slices_equal_slices_of_its_tokens():
    t = _tables(n_pages=16, n_swa=32, slots=4)
    req = _add(_scheduler(t), "r", list(range(10)))
    req.output.extend([100, 101, 102])
    whole = req.tokens
    assert req.n_tokens == len(whole) == 13
    for a in range(0, 14):
        for b in range(a, 15):
            assert req.token_slice(a, b) == whole[a:b], (a, b)


# ---- the KV-cache manager: the scheduler's only door to pages ----------------------------------------------------
def _manager(n_pages=8, n_swa=16, slots=2, data=1, caching=True):
    lay = PoolLayout(page_size=P, swa_page_size=P, n_pages=n_pages, n_swa_pages=n_swa, max_slots=slots,
                     max_pages_per_seq=8, max_swa_pages_per_seq=8, data_shards=data, context_shards=1)
    return KVCacheManager(CFG, lay, dense=False, caching=caching, dtype="float32")


def test_manager_commits_finds_maps_and_frees_a_prefix():
    kv = _manager()
    toks = list(range(2, 2 + 2 * P + 5))
    cut = lambda a, b: toks[a:b]  # noqa: E731
    assert kv.allocate(0, 0, len(toks))
    kv.commit(0, cut, len(toks), saved=[2 * P])  # the state was saved at the second boundary only
    hit = kv.find_prefix(toks, len(toks), 0)
    assert (hit.n_pages, hit.cached_pages) == (2, 2)
    # the first boundary keeps no tail (no state saved there): a match ending there cannot be resumed
    short = kv.find_prefix(toks[:P + 3], P + 3, 0)
    assert (short.n_pages, short.cached_pages) == (0, 1)
    t = kv._tables
    row = kv.map_prefix(1, hit, len(toks))
    assert row == t.held[0].swa[(2 * P - 1) // P]  # the SWA page holding position b-1 carries the state
    assert t.held[1].full == t.held[0].full[:2] and t.full_alloc.refs[t.held[0].full[:2]].tolist() == [3, 3]
    st = kv.prefix_stats()
    assert st["reused_pages"] == 2 and st["hit_tokens"] == 2 * P and st["queried_tokens"] == len(toks)
    assert st["cached_pages"] == 2 and st["tombstoned_tails"] == 0
    kv.check()
    u = kv.usage([0, 1])
    assert u["c4_kv"]["used"] == 3 and u["compressor_state"]["used"] == 2 and u["swa"]["used"] == t.swa_alloc.n_used
    kv.free(0)
    kv.free(1)
    kv.check()
    assert not kv.all_free()  # the tree still holds its two pages and a tail
    kv.reset_prefix_cache()
    assert kv.all_free() and kv.prefix_stats()["cached_pages"] == 0


def test_manager_allocate_evicts_then_refuses_without_allocating():
    kv = _manager(n_pages=4, n_swa=16, slots=2)
    toks = list(range(2, 2 + 3 * P))
    assert kv.allocate(0, 0, 3 * P)
    kv.commit(0, lambda a, b: toks[a:b], 3 * P, saved=[P, 2 * P, 3 * P])
    kv.free(0)  # its three pages stay in the tree
    assert kv.usage([])["tokens"]["used"] == 3
    assert kv.allocate(1, 0, 2 * P)  # one page free: the tree gives back the least recently used leaves
    assert kv.prefix_stats()["evicted_pages"] == 1 and kv.prefix_stats()["cached_pages"] == 2
    held = list(kv._tables.held[1].full)
    assert not kv.allocate(1, 2 * P, 5 * P)  # 3 more pages: only the tree's 2 could be freed
    assert kv._tables.held[1].full == held  # nothing allocated
    kv.check()
    kv.free(1)
    kv.reset_prefix_cache()
    assert kv.all_free()


def test_manager_admissible_counts_pending_growth_and_evictable_pages():
    kv = _manager(n_pages=4, n_swa=16, slots=2)
    assert kv.allocate(0, 0, P)
    empty = kv.find_prefix([5] * 10, 10, 0)
    assert kv.admissible(empty, 3 * P, 8)  # 3 of the 4 pages
    assert not kv.admissible(empty, 3 * P, 8, pending=[(0, 2 * P)])  # slot 0 still grows by a page
    assert kv.admissible(empty, 2 * P, 8, pending=[(0, 2 * P)])


def test_manager_usage_bytes_are_the_layouts():
    from v4jax.cache.layout import pool_sizes
    kv = _manager()
    assert kv.allocate(0, 0, 2 * P)
    sizes = pool_sizes(CFG, kv.layout, "float32", True)
    u = kv.usage([0])
    assert set(u) == set(sizes) == {"swa", "c4_kv", "c4_index", "c128_kv", "tokens", "compressor_state"}
    for name, s in sizes.items():
        assert u[name]["total"] == s.units and u[name]["bytes_total"] == s.bytes and u[name]["unit"] == s.unit
        assert u[name]["bytes_used"] == u[name]["used"] * s.unit_bytes
    assert u["tokens"]["used"] == 2 and u["compressor_state"]["used"] == 1


def test_scheduler_counts_recomputed_tokens_after_preemption():
    t = _tables(n_pages=8, n_swa=32, slots=2, data=1)
    sch = _scheduler(t, caching=False, chunk=64)
    a = _add(sch, "a", [3] * (2 * P), max_tokens=4 * P)
    b = _add(sch, "b", [4] * (P + 4), max_tokens=2)
    assert sch.admit() == [a, b]
    _prefill(sch)
    _prefill(sch)  # b's chunks end at its page boundary first
    assert a.status == b.status == RUNNING and sch.recomputed_tokens == 0
    fed = b.fed
    sch.preempt(b)
    assert sch.admit() == [b]
    _prefill(sch)
    _prefill(sch)
    assert b.status == RUNNING and sch.recomputed_tokens == fed  # what it had computed, computed again


def test_recorded_boundaries_host_and_device_agree():
    """The host's list of a prefill chunk's inner page boundaries (the prefix tree keeps tails there) and the
    step's (it saves the compressor states there) are the same, for chunks starting on and off a boundary."""
    import jax.numpy as jnp

    from v4jax.cache.boundary import inner_page_ends, recorded_boundaries
    p = 256
    for t in (16, 256, 512, 1024, 2048):
        rng = np.random.default_rng(t)
        starts = np.concatenate([np.arange(0, 3 * p + 1, p), rng.integers(0, 4 * p, 12)])
        n_valid = np.array([min(int(rng.integers(1, t + 1)), t) for _ in starts])
        n_valid[: 4] = t
        dev = np.asarray(inner_page_ends(jnp.asarray(starts, jnp.int32), jnp.asarray(n_valid, jnp.int32), p, t))
        for s, n, row in zip(starts, n_valid, dev):
            host = list(recorded_boundaries(int(s), int(s + n), p))
            assert row[row >= 0].tolist() == host, (t, s, n)
            if s % p == 0:  # a chunk from a boundary records every boundary strictly inside it
                assert host == [b for b in range(s + 1, s + n) if b % p == 0]


def test_a_burst_sharing_a_cached_prefix_starts_together():
    """Requests that share with the ones prefilling only what is already cached are admitted together (their
    rows prefill in one step); a request whose next full page one of them is still computing waits for it, then
    maps it."""
    t = _tables(n_pages=32, n_swa=64, slots=4, data=1)
    sch = _scheduler(t, chunk=64)
    system = list(range(2, 2 + 2 * P))  # two full pages
    first = _add(sch, "first", system + [7, 7])
    assert sch.admit() == [first]
    _prefill(sch)  # the system prompt's pages are cached (resumable at 2P); its last two tokens still to come
    burst = [_add(sch, f"u{i}", system + [8 + i] * 3) for i in range(3)]
    assert sch.admit() == burst  # all at once: past the cached pages nobody shares a full page
    assert [r.computed for r in burst] == [2 * P] * 3
    assert len(sch.next_chunks()) == 4  # one prefill step: first's last chunk and the three
    # a long prompt prefilling its third page holds back a request sharing that page, not one that does not
    sch2 = _scheduler(_tables(n_pages=32, n_swa=64, slots=4, data=1), chunk=P)
    doc = list(range(2, 2 + 3 * P))
    reader = _add(sch2, "reader", doc + [5])
    assert sch2.admit() == [reader]
    _prefill(sch2)  # page 0 computed and cached; pages 1 and 2 to come
    same_doc = _add(sch2, "same_doc", doc + [6])
    other = _add(sch2, "other", list(range(5000, 5000 + P + 3)))  # behind it, sharing nothing: not held back
    assert sch2.admit() == [other] and same_doc.status == "waiting" and other.computed == 0
    for _ in range(3):
        _prefill(sch2)
    assert sch2.admit() == [same_doc] and same_doc.computed == 3 * P
    # admission looks past at most MAX_SHARING_SKIPPED of them (each look walks the tree)
    from v4jax.engine import scheduler as scheduler_module
    sch3 = _scheduler(_tables(n_pages=32, n_swa=64, slots=4, data=1), chunk=P)
    reader = _add(sch3, "reader", doc + [5])
    assert sch3.admit() == [reader]
    _prefill(sch3)
    sharers = [_add(sch3, f"s{i}", doc + [6 + i]) for i in range(scheduler_module.MAX_SHARING_SKIPPED)]
    late = _add(sch3, "late", list(range(7000, 7000 + P + 3)))
    assert sch3.admit() == [] and late.status == "waiting" and all(r.status == "waiting" for r in sharers)


def test_evictable_counts_agree_with_a_brute_force_count():
    """Random trees (pages mapped by "slots" or not, tails, a kept path): the counts are the brute-force ones (a
    node's page is freeable when no page of its subtree is mapped and it is not kept; a tail when its pages are
    unmapped and it is not the kept path's last)."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        full, swa = PageAllocator(200, 2), PageAllocator(200, 2)
        cache = PrefixCache(full, swa, 1)
        nodes = []
        for i in range(int(rng.integers(1, 60))):
            parent = cache.root if not nodes or rng.random() < 0.2 else nodes[int(rng.integers(len(nodes)))]
            tail = dict(enumerate(swa.alloc(2, int(rng.integers(2))))) if rng.random() < 0.5 else None
            tailed = [n for n in nodes if n.tail is not None]
            shared = tail is None and tailed and rng.random() < 0.3
            if shared:  # a page of an earlier tail (consecutive boundaries' windows can overlap)
                tail = {0: next(iter(tailed[int(rng.integers(len(tailed)))].tail.values()))}
            nodes.append(cache.insert(parent, (i,), full.alloc(1, int(rng.integers(2)))[0], tail))
            if tail and not shared and rng.random() < 0.6:
                swa.decref(tail.values())  # the slot let go of the tail; else it still maps it
        for n in nodes:
            if rng.random() < 0.7:
                full.decref([n.page])  # the slot let go; else it still maps the page
        keep = []
        if nodes and rng.random() < 0.5:
            n = nodes[int(rng.integers(len(nodes)))]
            while n.page >= 0:
                keep.insert(0, n)
                n = n.parent

        def subtree_mapped(n):
            return full.refs[n.page] > 1 or any(subtree_mapped(c) for c in n.children.values())

        want_full, want_swa = np.zeros(2, np.int64), np.zeros(2, np.int64)
        for n in nodes:
            if n not in keep and not subtree_mapped(n):
                want_full[full.block_of(n.page)] += 1
            if n.tail is not None and (not keep or n is not keep[-1]) and all(swa.refs[p] == 1 for p in n.tail.values()):
                for p in n.tail.values():
                    want_swa[swa.block_of(p)] += 1
        got = cache.evictable(keep=keep)
        assert got[0].tolist() == want_full.tolist() and got[1].tolist() == want_swa.tolist(), trial
        # evictions keep the tail and leaf indexes true to the tree (and the tails in LRU order)
        cache.touch(keep)
        cache.check()
        cache.evict_swa(swa.free_per_block + rng.integers(0, 3, 2))
        cache.check()
        cache.evict_full(full.free_per_block + rng.integers(0, 4, 2))
        cache.check()
        cache.clear()
        cache.check()


def _evict_full_reference(cache: PrefixCache, n_pages) -> list[int]:
    """Full-page eviction as a scan over every leaf at each removal: the least recently used removable leaf (no slot
    maps it) of the shards that are short, the short blocks' leaves first, ties by page. Returns the pages removed."""
    alloc, removed = cache.full_alloc, []
    per_shard = alloc.n_blocks // len(cache.roots)
    while (need := alloc.free_per_block < n_pages).any():
        shards = set((np.flatnonzero(need) // per_shard).tolist())
        leaves = [n for n in cache._nodes() if not n.children and alloc.refs[n.page] == 1
                  and alloc.block_of(n.page) // per_shard in shards]
        if not leaves:
            break
        n = min(leaves, key=lambda n: (not need[alloc.block_of(n.page)], n.stamp, n.page))
        removed.append(n.page)
        cache._remove(n)
    return removed


@pytest.mark.parametrize("shards", [1, 2])
def test_full_page_eviction_removes_the_least_recently_used_leaves(shards):
    """Random trees, paths touched in random order, pages mapped or not, over two blocks (one shard or two):
    evict_full removes the pages a scan of every leaf at each removal would, in that order."""
    import copy
    rng = np.random.default_rng(1)
    for trial in range(60):
        full, swa = PageAllocator(120, 2), PageAllocator(120, 2)
        cache = PrefixCache(full, swa, 1, n_shards=shards)
        nodes = []
        for i in range(int(rng.integers(1, 50))):
            shard = int(rng.integers(shards))
            mine = [n for n in nodes if full.block_of(n.page) // (2 // shards) == shard]
            parent = cache.roots[shard] if not mine or rng.random() < 0.2 else mine[int(rng.integers(len(mine)))]
            block = shard if shards == 2 else int(rng.integers(2))
            nodes.append(cache.insert(parent, (i,), full.alloc(1, block)[0], None))
            if rng.random() < 0.3:  # a request resumes somewhere: its path is touched
                n = nodes[int(rng.integers(len(nodes)))]
                path = []
                while n.page >= 0:
                    path.insert(0, n)
                    n = n.parent
                cache.touch(path)
        for n in nodes:
            if rng.random() < 0.8:
                full.decref([n.page])
        for _ in range(3):  # several evictions in a row: the heaps carry over
            want = full.free_per_block + rng.integers(0, 6, 2)
            ref = copy.deepcopy(cache)
            expected = _evict_full_reference(ref, want)
            before = {n.page for n in cache._nodes()}
            freed = cache.evict_full(want)
            removed = before - {n.page for n in cache._nodes()}
            assert freed == len(expected) and removed == set(expected), trial
            assert cache.evicted_pages == ref.evicted_pages
            cache.check()


def test_tail_eviction_keeps_each_prompts_two_deepest_tails_and_the_ones_resumed_from():
    # a prefill saves a window tail at every page boundary, many more than the SWA pool keeps: the shallow tails a
    # prompt passed go first, so an identical prompt (resuming one page before its end) or a longer one (at its
    # end) still resumes deep. Plain LRU dropped the first prompt's tails, its two deepest included.
    kv = _manager(n_pages=24, n_swa=19, slots=2)
    prompts = [[100 * (i + 1) + j for j in range(5 * P)] for i in range(3)]
    for toks in prompts:  # each prompt's prefill saves its state at all 5 boundaries: 5 tails of 1 SWA page
        assert kv.allocate(0, 0, 5 * P)
        kv.commit(0, lambda a, b, toks=toks: toks[a:b], 5 * P, saved=range(P, 5 * P + 1, P))
        kv.free(0)
    kv.check()
    assert kv._tables.swa_alloc.n_free == 4 and kv.prefix_stats()["tombstoned_tails"] == 0

    def resumes(toks):
        return kv.find_prefix(toks, len(toks), 0).n_pages

    assert [resumes(t) for t in prompts] == [4, 4, 4] and [resumes(t + [7]) for t in prompts] == [5, 5, 5]
    # a prompt sharing the second prompt's first two pages resumes from its shadowed tail there: no longer shadowed
    other = prompts[1][:2 * P] + [9] * 3
    hit = kv.find_prefix(other, len(other), 0)
    assert hit.n_pages == 2
    kv.map_prefix(1, hit, len(other))
    kv.free(1)
    assert kv.allocate(0, 0, 8 * P)  # 8 SWA pages: 4 free, 4 tails dropped, the least recently used shadowed ones
    assert kv.prefix_stats()["tombstoned_tails"] == 4
    assert [resumes(t) for t in prompts] == [4, 4, 4] and [resumes(t + [7]) for t in prompts] == [5, 5, 5]
    assert resumes(other) == 2
    # dropped: the first prompt's three shadowed tails and the second's first one
    assert [resumes(t[:3 * P + 1]) for t in prompts] == [0, 3, 3]
    assert [resumes(t[:P + 1]) for t in prompts] == [0, 0, 1]
    kv.check()
    kv.free(0)


def test_a_chunked_prefill_drops_its_own_passed_tails_before_another_prompts_deepest():
    # A long prompt's chunks pass boundaries whose tails share the slot's SWA pages until the next chunk moves the
    # window on. Those pages are released before the prefix cache evicts for the next chunk, so the tails this
    # prompt passed (shadowed) go first. Evicting while the slot still mapped them dropped an earlier prompt's
    # every tail instead: two requests of 128K then never resumed side by side.
    kv = _manager(n_pages=24, n_swa=6, slots=2)
    a = [500 + j for j in range(2 * P)]
    assert kv.allocate(0, 0, 2 * P)
    kv.commit(0, lambda i, j: a[i:j], 2 * P, saved=(P, 2 * P))
    kv.free(0)
    b = [900 + j for j in range(6 * P)]
    for lo, hi in ((0, 3 * P), (3 * P, 6 * P)):  # two chunks of three pages, a tail saved at every boundary
        assert kv.allocate(0, lo, hi)
        kv.commit(0, lambda i, j: b[i:j], hi, saved=range(lo + P, hi + 1, P))
        kv.check()
    kv.free(0)

    def resumes(toks):
        return kv.find_prefix(toks, len(toks), 0).n_pages

    assert resumes(a + [7]) == 2 and resumes(b + [7]) == 6
    kv.check()


def test_shadowed_tails_stay_in_the_order_of_their_last_use():
    # a prompt prefilled over another's cached pages (not resumed: computed again) passes that prompt's tails and
    # shadows them anew, after tails shadowed since: the index keeps them least recently used first
    kv = _manager(n_pages=24, n_swa=16, slots=2)
    a, c = [500 + j for j in range(3 * P)], [700 + j for j in range(3 * P)]
    for toks in (a, c):
        assert kv.allocate(0, 0, 3 * P)
        kv.commit(0, lambda i, j, toks=toks: toks[i:j], 3 * P, saved=(P, 2 * P, 3 * P))
        kv.free(0)
    b = a + [900 + j for j in range(P)]
    assert kv.allocate(0, 0, 4 * P)
    kv.commit(0, lambda i, j: b[i:j], 4 * P, saved=(P, 2 * P, 3 * P, 4 * P))
    kv.check()
    kv.free(0)


def test_a_prefix_hit_is_admitted_for_the_window_its_remainder_needs():
    # beside a long prompt prefilling, the SWA pages left hold a hit's few remaining tokens and its window, not a
    # whole chunk's: admission asks for what the first chunk after the hit needs (it asked for a whole chunk)
    t = _tables(n_pages=32, n_swa=8, slots=2, data=1, max_pages=16)
    sch = _scheduler(t, chunk=4 * P)
    cached = list(range(2, 2 + 2 * P))
    c = _add(sch, "c", cached + [5])
    assert sch.admit() == [c]
    _prefill(sch)
    sch.abort("c")  # its pages stay cached
    x = _add(sch, "x", list(range(1000, 1000 + 10 * P)))
    assert sch.admit() == [x]
    _prefill(sch)
    h = _add(sch, "h", cached + [9, 9, 9])
    assert sch.admit() == [h] and h.computed == 2 * P
    for _ in range(2):  # x's next chunk, then its last with h's three tokens: both decode, nobody preempted
        _prefill(sch)
    assert h.status == x.status == RUNNING and sch.n_preempted == 0
