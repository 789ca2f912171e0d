"""The memory report against the published figures, and against what the engine really allocates.

Sources of the expected numbers:
  [A43]  ../shared/reference/deepseek_v4_architecture.md §4.3 (bf16 entries; FP8 layout; constant per request)
  [S11]  ../shared/reference/serving_systems.md §1.1 (FP8 / FP4 layouts per token and per request)
  [S12]  ../shared/reference/serving_systems.md §1.2 (decode bytes read per sequence per step)
The references print rounded values (3850, 5511, 6.72 GiB, 3.2 MB ...); the exact values are asserted here with the
arithmetic that gives them, and the rounding is checked against the printed figure.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from v4jax.api import EngineOptions
from v4jax.cache.layout import engine_layout, full_page_size, page_multiple, pool_sizes
from v4jax import cache as C
from v4jax import memory as M
from v4jax.config import preset
from v4jax.engine.sampling import SamplingParams
from v4jax.model import Transformer

GiB, MiB = 1 << 30, 1 << 20
T1M = 1 << 20


@pytest.fixture(scope="module")
def flash():
    return preset("flash")


@pytest.fixture(scope="module")
def pro():
    return preset("pro")


def test_entry_formats(flash):
    # [S11] / [A43]: 584 B per main entry = 448 e4m3 + 64 bf16 rope (128 B) + 7 ue8m0 scales + 1 pad byte;
    # indexer key 128 + 4 = 132 B (fp8), 64 + 4 = 68 B (fp4); bf16 entries 512 x 2 and 128 x 2.
    assert M.main_entry_bytes(flash, "bf16") == 1024
    assert M.main_entry_bytes(flash, "fp8") == 448 + 128 + 8 == 584
    assert M.main_entry_bytes(flash, "fp4") == 584
    assert M.index_key_bytes(flash, "bf16") == 256
    assert M.index_key_bytes(flash, "fp8") == 132
    assert M.index_key_bytes(flash, "fp4") == 68


def test_flash_bf16(flash):
    # [A43] Flash (21 CSA, 20 HCA): 21 * (256 + 64) + 20 * 8 = 6880 B/token, 6.72 GiB at 2^20 tokens.
    r = M.report(flash, T1M, 1, "bf16")
    assert (r.n_sliding, r.n_csa, r.n_hca) == (2, 21, 20)
    assert r.per_token == {"csa_kv": 21 * 256, "csa_index": 21 * 64, "hca_kv": 20 * 8}
    assert r.per_token_kv == 21 * (256 + 64) + 20 * 8 == 6880
    assert round(r.per_token_kv * T1M / GiB, 2) == 6.72
    assert r.per_token_total == 6880 + 4  # + int32 token id


def test_pro_bf16(pro):
    # [A43] Pro (30 CSA, 31 HCA): 30 * 320 + 31 * 8 = 9848 B/token, 9.62 GiB at 2^20 tokens.
    r = M.report(pro, T1M, 1, "bf16")
    assert (r.n_sliding, r.n_csa, r.n_hca) == (0, 30, 31)
    assert r.per_token_kv == 30 * 320 + 31 * 8 == 9848
    assert round(r.per_token_kv * T1M / GiB, 2) == 9.62


def test_fp8_layouts(flash, pro):
    # [A43] / [S11]: 21 * (584/4 + 132/4) + 20 * 584/128 = 21 * (146 + 33) + 20 * 4.5625 = 3850.25 (printed "3850",
    # 3.76 GiB); Pro 30 * 179 + 31 * 4.5625 = 5511.4375 (printed "5511", 5.38 GiB).
    f, p = M.report(flash, T1M, 1, "fp8"), M.report(pro, T1M, 1, "fp8")
    assert f.per_token == {"csa_kv": 21 * 146, "csa_index": 21 * 33, "hca_kv": 20 * 4.5625}
    assert f.per_token["csa_kv"] == 3066 and f.per_token["csa_index"] == 693  # [S11] rows: 3066 B, 693 B
    assert round(f.per_token["hca_kv"]) == 91  # [S11] C128 row: 91 B
    assert f.per_token_kv == 3850.25 and round(f.per_token_kv) == 3850
    assert round(f.per_token_kv * T1M / GiB, 2) == 3.76
    assert p.per_token["csa_kv"] == 4380 and p.per_token["csa_index"] == 990 and round(p.per_token["hca_kv"]) == 141
    assert p.per_token_kv == 5511.4375 and round(p.per_token_kv) == 5511
    assert round(p.per_token_kv * T1M / GiB, 2) == 5.38


def test_fp4_indexer(flash, pro):
    # [S11]: FP4 indexer keys (68/4 = 17 B per CSA layer): Flash 3514 B (3.43 GiB), Pro 5031 B (4.91 GiB).
    f, p = M.report(flash, T1M, 1, "fp4"), M.report(pro, T1M, 1, "fp4")
    assert f.per_token["csa_index"] == 21 * 17 == 357 and p.per_token["csa_index"] == 30 * 17 == 510
    assert f.per_token_kv == 3514.25 and round(f.per_token_kv * T1M / GiB, 2) == 3.43
    assert p.per_token_kv == 5031.4375 and round(p.per_token_kv * T1M / GiB, 2) == 4.91


def test_constant_per_request(flash, pro):
    # [A43]: window ring 128 x 1 KiB per layer (Flash 43 layers = 5.375 MiB "5.4", Pro 61 = 7.625 MiB "7.6");
    # compressor fp32 state CSA 64 KiB + indexer 16 KiB, HCA 512 KiB per layer
    # (Flash 21 * 80 + 20 * 512 = 11920 KiB "11.6 MiB", Pro 30 * 80 + 31 * 512 = 18272 KiB "17.8 MiB").
    f, p = M.report(flash, T1M, 1, "bf16"), M.report(pro, T1M, 1, "bf16")
    assert f.per_request["swa"] == 43 * 128 * 1024 and round(f.per_request["swa"] / MiB, 1) == 5.4
    assert p.per_request["swa"] == 61 * 128 * 1024 and round(p.per_request["swa"] / MiB, 1) == 7.6
    assert M.compressor_state_bytes(flash, "csa", 4) == {"csa": 64 * 1024, "csa_index": 16 * 1024}
    assert M.compressor_state_bytes(flash, "hca", 128) == {"hca": 512 * 1024}
    state = lambda r: r.per_request["state_csa"] + r.per_request["state_csa_index"] + r.per_request["state_hca"]
    assert state(f) == (21 * 80 + 20 * 512) * 1024 and round(state(f) / MiB, 1) == 11.6
    assert state(p) == (30 * 80 + 31 * 512) * 1024 and round(state(p) / MiB, 1) == 17.8
    # [S11] in decimal MB: SWA per request all layers x 128 x 584 B = 3.2 / 4.6 MB; fp32 state 12.2 / 18.7 MB.
    f8, p8 = M.report(flash, T1M, 1, "fp8"), M.report(pro, T1M, 1, "fp8")
    assert f8.per_request["swa"] == 43 * 128 * 584 and round(f8.per_request["swa"] / 1e6, 1) == 3.2
    assert p8.per_request["swa"] == 61 * 128 * 584 and round(p8.per_request["swa"] / 1e6, 1) == 4.6
    assert round(state(f8) / 1e6, 1) == 12.2 and round(state(p8) / 1e6, 1) == 18.7
    # The MTP layer (sliding) is counted apart: one more window ring, no per-token growth.
    assert f.mtp_per_request == 128 * 1024 and f8.mtp_per_request == 128 * 584 and f.mtp_per_token == 0


def test_pools_scale_with_requests(flash):
    r = M.report(flash, 4096, 3, "bf16")
    assert r.pools["csa_kv"] == 3 * 21 * 1024 * 1024  # 1024 entries of 1 KiB per CSA layer
    assert r.pools["csa_index"] == 3 * 21 * 1024 * 256
    assert r.pools["hca_kv"] == 3 * 20 * 32 * 1024
    assert r.pools["tokens"] == 3 * 4096 * 4
    assert r.pools["swa"] == 3 * r.per_request["swa"] and r.pools["mtp"] == 3 * 128 * 1024
    assert r.total == sum(r.pools.values())
    assert r.per_request_bytes == 4096 * 6884 + r.per_request_const + r.mtp_per_request
    text = M.format_report([M.report(flash, T1M, 1, f) for f in ("bf16", "fp8", "fp4")])
    assert "6880" in text and "3850.25" in text and "3514.25" in text


def test_decode_read_bytes(flash, pro):
    # [S12], Flash fp8-idx at 1M: indexer 727 MB (21 * 2^18 * 132), C128 96 MB (20 * 8192 * 584),
    # sparse 6.3 MB (21 * 512 * 584), SWA 3.2 MB (43 * 128 * 584), total 832 MB.
    d = M.decode_read_bytes(flash, T1M, "fp8")
    assert d["indexer"] == 21 * (T1M // 4) * 132 and round(d["indexer"] / 1e6) == 727
    assert d["hca"] == 20 * 8192 * 584 and round(d["hca"] / 1e6) == 96
    assert d["sparse"] == 21 * 512 * 584 and round(d["sparse"] / 1e6, 1) == 6.3
    assert d["swa"] == 43 * 128 * 584 and round(d["swa"] / 1e6, 1) == 3.2
    assert round(d["total"] / 1e6) == 832
    # the other cells of the [S12] table
    mb = lambda cfg, t, f: round(M.decode_read_bytes(cfg, t, f)["total"] / 1e6)
    assert mb(flash, 32 << 10, "fp8") == 35
    assert round(M.decode_read_bytes(flash, 32 << 10, "fp8")["indexer"] / 1e6) == 23
    assert mb(flash, 32 << 10, "fp4") == 24
    assert mb(flash, 128 << 10, "fp8") == 112 and mb(flash, 128 << 10, "fp4") == 68
    assert mb(flash, T1M, "fp4") == 480
    assert mb(pro, 32 << 10, "fp8") == 60 and mb(pro, 32 << 10, "fp4") == 44
    assert mb(pro, 128 << 10, "fp8") == 171 and mb(pro, 128 << 10, "fp4") == 108
    assert round(M.decode_read_bytes(pro, T1M, "fp8")["total"] / 1e9, 2) == 1.21 and mb(pro, T1M, "fp4") == 706


@pytest.mark.parametrize("name", ["tiny", "flash-slice"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_param_bytes_match_model(name, dtype):
    cfg = preset(name)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    total = mtp = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        a = var.get_value()
        total += a.size * a.dtype.itemsize
        mtp += a.size * a.dtype.itemsize if path[0] == "mtp" else 0
    pb = M.param_bytes(cfg, jnp.dtype(dtype).itemsize)
    assert pb["total"] == total and pb["mtp"] == mtp


def test_expected_active_experts():
    cfg = preset("flash-slice")  # 16 experts, 6 active
    assert M.expected_active_experts(cfg, 1) == pytest.approx(6.0)
    assert M.expected_active_experts(cfg, 2) == pytest.approx(16 * (1 - (10 / 16) ** 2))
    assert M.expected_active_experts(cfg, 32) == pytest.approx(16, abs=1e-4)


# ---- against the engine's real allocation ---------------------------------------------------------------
@pytest.mark.parametrize("dtype,fmt", [(jnp.bfloat16, "bf16"), (jnp.float32, "f32")])
def test_per_token_equals_init_pools(dtype, fmt):
    """The report's per-token figure = what init_pools allocates per full page / P for the compressed pools."""
    cfg = preset("tiny")  # sliding, CSA(4), HCA(16), CSA(4); P = 256
    p = full_page_size(cfg)

    def nbytes(n_pages):
        lay = C.PoolLayout(page_size=p, swa_page_size=64, n_pages=n_pages, n_swa_pages=2, max_slots=2,
                           max_pages_per_seq=4, max_swa_pages_per_seq=4)
        return C.pool_bytes(jax.eval_shape(lambda: C.init_pools(cfg, lay, dtype)))

    one, three = nbytes(1), nbytes(3)
    per_page = {k: (three[k] - one[k]) // 2 for k in one}
    r = M.report(cfg, p, 1, fmt)
    assert (per_page["kv"] + per_page["idx"]) / p == r.per_token_kv
    assert per_page["tokens"] / p == 4 and sum(per_page.values()) / p == r.per_token_total
    # tiny in bf16 by hand: CSA 2 * (64 * 2 / 4 + 32 * 2 / 4) + HCA 64 * 2 / 16 = 2 * 48 + 8 = 104 B/token
    if fmt == "bf16":
        assert r.per_token_kv == 104
    # compressor state per slot = the report's constant
    state = sum(one[k] for k in ("state_kv", "state_score", "idx_state_kv", "idx_state_score")) // 2
    pr = r.per_request
    assert state == pr["state_csa"] + pr["state_csa_index"] + pr["state_hca"]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("name", ["tiny", "flash"])
@pytest.mark.parametrize("dtype,fmt", [("bfloat16", "bf16"), ("float32", "f32")])
def test_report_agrees_with_pool_sizes(name, dtype, fmt, caching):
    """Where both apply (bf16 / f32 entries, the main layers: the engine allocates no MTP pool), the analytical
    report and the engine's layout (pool_sizes, off the pools' own shapes) give the same bytes: a full page of P
    tokens holds P x the per-token figure of each compressed pool and of the token ids; a SWA page of Ps tokens Ps
    window entries of every layer (plus, with the prefix cache, half of every CSA compressor's state: the
    boundary row of that page); a slot the report's compressor state per request."""
    cfg = preset(name)
    p, ps, n_swa = engine_layout(cfg, None, 2)
    lay = C.PoolLayout(page_size=p, swa_page_size=ps, n_pages=3, n_swa_pages=n_swa, max_slots=2,
                       max_pages_per_seq=2, max_swa_pages_per_seq=2)
    sizes = pool_sizes(cfg, lay, dtype, caching)
    r = M.report(cfg, p, 1, fmt)
    assert sizes["c4_kv"].unit_bytes == p * r.per_token["csa_kv"]
    assert sizes["c4_index"].unit_bytes == p * r.per_token["csa_index"]
    assert sizes["c128_kv"].unit_bytes == p * r.per_token["hca_kv"]
    assert sizes["tokens"].unit_bytes == p * M.TOKEN_ID_BYTES
    assert sum(sizes[k].unit_bytes for k in ("c4_kv", "c4_index", "c128_kv", "tokens")) == p * r.per_token_total
    pr = r.per_request
    assert sizes["compressor_state"].unit_bytes == pr["state_csa"] + pr["state_csa_index"] + pr["state_hca"]
    boundary = r.n_csa * sum(M.compressor_state_bytes(cfg, "csa", 4).values()) // 2 if caching else 0
    assert sizes["swa"].unit_bytes == pr["swa"] // cfg.window_size * ps + boundary
    assert sizes["swa"].units == n_swa and sizes["c4_kv"].units == 3 and sizes["compressor_state"].units == 2
    # one device: all of it
    assert all(s.device_bytes == s.bytes for s in sizes.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_pools_match_the_engine_under_a_budget(dtype):
    from v4jax.api import LLM
    budget = 3_000_000
    llm = LLM("tiny", dtype=dtype, memory_budget_bytes=budget, max_num_seqs=3, enable_prefix_caching=False)
    eng = llm.engine
    pools = M.engine_pools(llm.config, llm.options, llm.max_model_len, dtype)
    assert pools.layout == eng.layout
    assert pools.total == sum(C.pool_bytes(eng.pools).values()) <= budget
    # one more page would not fit
    assert pools.total + pools.per_page_bytes > budget
    assert pools.fixed_bytes + eng.layout.n_pages * pools.per_page_bytes == pools.total


def test_engine_pools_flash_numbers():
    # Flash bf16 engine defaults (8 slots, P = 256, chunk 2048, k = 8): per page = 256 * (6880 + 4) B.
    cfg = preset("flash")
    pools = M.engine_pools(cfg, EngineOptions(memory_budget_bytes=100 * GiB, enable_prefix_caching=False), T1M)
    lay = pools.layout
    assert lay.page_size == 256 and pools.per_page_bytes == 256 * 6884
    # SWA: 8 decoding slots x (ceil((128 + 8) / 64) + 1) pages, plus ceil(2048 / 64) + 1 for the prefill step's
    # chunk = 65 pages of 64 tokens x 1 KiB x 43 layers.
    swa = (8 * 4 + 33) * 64 * 1024 * 43
    assert lay.n_swa_pages == 65 and pools.sizes["swa"].bytes == swa
    assert pools.fixed_bytes == swa + 8 * (21 * 80 + 20 * 512) * 1024
    # in multiples of 8 pages (the HCA pool's 2 rows per page -> whole 16-row bf16 TPU tiles)
    assert lay.n_pages == (100 * GiB - pools.fixed_bytes) // pools.per_page_bytes // 8 * 8
    # without a budget: every slot's whole context
    assert M.engine_pools(cfg, EngineOptions(), T1M).layout.n_pages == 8 * T1M // 256


@pytest.mark.parametrize("budget", [pytest.param(b, marks=pytest.mark.slow) for b in (None, 3_000_000)])  # -m slow
def test_pools_hold_whole_tpu_tiles(budget):
    """Pages come in multiples of page_multiple, so every compressed pool is whole TPU tiles of rows (16 bf16
    rows) and the TPU kernels never pad (copy) a pool; the budget arithmetic is the engine's."""
    from v4jax.api import LLM
    cfg = preset("tiny")
    assert page_multiple(cfg, 256, "bf16") == 1                      # CSA 64, HCA 16 rows per page
    assert page_multiple(cfg, 16, "bf16") == 16 and page_multiple(cfg, 16, "f32") == 8   # HCA: 1 row
    assert page_multiple(preset("flash"), 256, "bf16") == 8         # HCA 128: 2 rows per page
    llm = LLM("tiny", page_size=16, max_num_seqs=3, max_model_len=120, memory_budget_bytes=budget,
              enable_prefix_caching=False)
    eng = llm.engine
    assert eng.layout.n_pages % 16 == 0 and eng.layout.n_pages >= 3 * 8
    for lp in eng.pools.stacks:  # [layers of the stack, rows, K]
        for pool in (lp.kv, lp.idx):
            if pool is not None:
                assert pool.shape[1] % 16 == 0
    if budget:
        pools = M.engine_pools(cfg, llm.options, llm.max_model_len, "bfloat16")
        assert pools.layout == eng.layout and pools.total == sum(C.pool_bytes(eng.pools).values()) <= budget
    # 15 prompt tokens (one prefill chunk on one page) and 4 decoded ones, across the first 16-token page's end
    out = llm.generate([[3, 4, 5] * 5], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) == 4


def test_pools_per_device_divide_over_data_and_context():
    """Over a mesh the engine's pools are split: SWA pages, boundary rows and compressor state over `data`, full
    pages over `data` x `context` (whose counts are rounded up to equal blocks); `tensor` and `expert` hold
    copies. tests/test_sharding.py checks the figures against the arrays of real engines on meshes."""
    cfg = preset("tiny")
    opts = EngineOptions(max_num_seqs=8, prefill_chunk=64, decode_steps=4)

    def pools(mesh, **kw):
        return M.engine_pools(cfg, dataclasses.replace(opts, mesh=mesh, **kw), 1024, "float32")

    one = pools(None)
    assert one.per_device == one.total == pools("tensor=4,expert=2").total == pools("tensor=4,expert=2").per_device
    for mesh, data, blocks in (("data=2,tensor=2", 2, 2), ("data=4", 4, 4), ("data=2,context=2", 2, 4)):
        for caching in (True, False):
            got = pools(mesh, enable_prefix_caching=caching)
            lay = got.layout
            assert lay.n_pages % blocks == 0 and (lay.data_shards, lay.context_shards) == (data, blocks // data)
            fixed = got.sizes["swa"].bytes + got.sizes["compressor_state"].bytes
            assert got.per_device == fixed // data + (got.total - fixed) // blocks, mesh
            assert got.per_device < pools(None, enable_prefix_caching=caching).per_device / data * 1.5, mesh
    # with data shards every shard has its own SWA pages for its slots and one prefill chunk
    p, ps, n_swa = engine_layout(cfg, None, 8, 64, 4)
    assert engine_layout(cfg, None, 8, 64, 4, 2)[2] == 2 * engine_layout(cfg, None, 4, 64, 4)[2] > n_swa
    budget = pools("data=2,context=3", memory_budget_bytes=3_000_000, enable_prefix_caching=False)
    assert budget.layout.n_pages % 6 == 0 and budget.total <= 3_000_000
    with pytest.raises(ValueError, match="does not split over the mesh's data=3"):
        pools("data=3")


def test_pool_figures_import_no_model():
    """memory.py reads the pools' bytes from v4jax.cache (the model only for weights, inside those functions);
    neither the cache nor the engine imports memory (DESIGN §2)."""
    import ast
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def imports(path, top_level_only=False):
        tree = ast.parse(open(os.path.join(root, path)).read())
        nodes = tree.body if top_level_only else ast.walk(tree)
        out = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        return out

    top = imports("v4jax/memory.py", top_level_only=True)
    assert {m.split(".")[1] for m in top if m.startswith("v4jax.")} == {"cache", "config"}, top
    for package in ("v4jax/cache", "v4jax/engine"):
        for name in os.listdir(os.path.join(root, package)):
            if name.endswith(".py"):
                assert not {m for m in imports(f"{package}/{name}") if m.startswith("v4jax.memory")}, name


def test_flash_h200_is_the_most_experts_one_h200_holds():
    """The `flash-h200` preset in the release's formats passes the weights' fit check on one H200 (139.7 GiB, 90 %
    usable), with room left for pools; 8 experts more would not leave it, and whole Flash does not fit."""
    h200 = int(139.7 * GiB)
    fmt = M.report_weight_format(preset("flash"), None, "fp8")
    stored = lambda cfg: M.param_bytes(cfg, 2, weights=fmt)["total"]
    cfg = preset("flash-h200")
    assert cfg.n_routed_experts == 192 and cfg.replace(n_routed_experts=256) == preset("flash")
    M.check_weights_fit(cfg, stored(cfg), "bfloat16", limit=h200, weights=fmt)
    assert 0.9 * h200 - stored(cfg) > 10 * GiB   # pools and the step's temporaries
    assert 0.9 * h200 - stored(cfg.replace(n_routed_experts=200)) < 8 * GiB
    with pytest.raises(M.DeviceMemoryError, match="would fit"):
        M.check_weights_fit(preset("flash"), stored(preset("flash")), "bfloat16", limit=h200, weights=fmt)
    with pytest.raises(M.DeviceMemoryError):  # in bf16: several times the device
        M.check_weights_fit(cfg, M.param_bytes(cfg, 2)["total"], "bfloat16", limit=h200)


def test_gpu_fit_check_names_xla_memory_fraction(monkeypatch):
    """On a GPU the detected memory is XLA's share of the card (0.75 unless $XLA_PYTHON_CLIENT_MEM_FRACTION says
    otherwise): flash-h200 fails the check at JAX's default share of an H200 (104.8 GiB), and the error names the
    setting that makes it fit; where no share would do (whole Flash), the error does not offer it."""
    fmt = M.report_weight_format(preset("flash"), None, "fp8")
    stored = lambda cfg: M.param_bytes(cfg, 2, weights=fmt)["total"]
    monkeypatch.delenv(M.FRACTION_ENV, raising=False)
    card = int(139.7 * GiB)
    monkeypatch.setattr(M, "device_memory_bytes", lambda device=None: (
        int(M.gpu_memory_fraction() * card),
        f"gpu bytes_limit of cuda:0, {M.FRACTION_ENV}={M.gpu_memory_fraction()} of the card"))
    with pytest.raises(M.DeviceMemoryError, match=f"{M.FRACTION_ENV}=0.95 in the environment"):
        M.check_weights_fit(preset("flash-h200"), stored(preset("flash-h200")), "bfloat16", weights=fmt)
    with pytest.raises(M.DeviceMemoryError) as err:
        M.check_weights_fit(preset("flash"), stored(preset("flash")), "bfloat16", weights=fmt)
    assert M.FRACTION_ENV not in str(err.value).split("would fit")[1]
    monkeypatch.setenv(M.FRACTION_ENV, "0.95")
    M.check_weights_fit(preset("flash-h200"), stored(preset("flash-h200")), "bfloat16", weights=fmt)


def test_gpu_memory_utilization_sizes_the_pools(monkeypatch):
    """gpu_memory_utilization (vLLM's option): each device's pools take the share of its memory the weights leave,
    to whole pages (an engine on one device; the budget of a mesh splitting the pools over 2 devices); a share the
    weights already fill, a share out of (0, 1] and one given beside memory_budget_bytes are errors naming the
    option; the flag reaches LLM."""
    from v4jax.api import LLM
    from v4jax.fields import FieldError
    from v4jax.memory import model_weight_bytes
    limit = 64 << 20
    monkeypatch.setenv(M.MEMORY_ENV, str(limit))  # a CPU device counts nothing in use: the weights are counted
    kw = dict(dtype="float32", max_num_seqs=2, enable_prefix_caching=False)
    llm = LLM("tiny", gpu_memory_utilization=0.5, **kw)
    eng = llm.engine
    weights = model_weight_bytes(llm.model)
    share = int(0.5 * limit) - weights
    pools = M.engine_pools(llm.config, llm.options, llm.max_model_len, "float32")
    assert pools.layout == eng.layout and llm.options.memory_budget_bytes is not None
    assert pools.per_device <= share < 1.01 * pools.per_device  # filled to whole pages (of every shard)
    plain = EngineOptions(**{k: v for k, v in kw.items() if k != "dtype"})
    assert eng.layout.n_pages > M.engine_pools(llm.config, plain, llm.max_model_len, "float32").layout.n_pages
    # over data=2 each device holds half the pools: the budget (all devices) is twice one device's share
    on_mesh = dataclasses.replace(plain, mesh="data=2", gpu_memory_utilization=0.5)
    budget = M.budget_for_utilization(llm.config, on_mesh, llm.max_model_len, "float32", weights)
    split = M.engine_pools(llm.config, dataclasses.replace(on_mesh, gpu_memory_utilization=None,
                                                            memory_budget_bytes=budget), llm.max_model_len, "float32")
    assert split.per_device <= share < 1.01 * split.per_device and split.total > 1.9 * split.per_device
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.001 .* raise it above"):
        LLM("tiny", gpu_memory_utilization=0.001, **kw).engine
    for bad in (0, 1.5):
        with pytest.raises(FieldError, match="gpu_memory_utilization"):
            LLM("tiny", gpu_memory_utilization=bad, **kw)
    with pytest.raises(FieldError, match="give one of them"):
        LLM("tiny", gpu_memory_utilization=0.5, memory_budget_bytes=1 << 20, **kw)
    import argparse

    from v4jax.serve.options import add_llm_arguments, llm_kwargs
    p = argparse.ArgumentParser()
    add_llm_arguments(p)
    assert llm_kwargs(p.parse_args(["--gpu-memory-utilization", "0.9"]))["gpu_memory_utilization"] == 0.9
