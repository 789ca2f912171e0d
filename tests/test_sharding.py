"""Sharding leaves greedy outputs unchanged, and splits the parameters and pools as the rules table says.

The mesh runs go through tests/mesh_worker.py in a subprocess with 8 fake CPU devices (the device count is fixed
at JAX start-up); one single-device reference run serves every mesh of that process. Context parallelism's merges
and per-shard attention are checked on one device in tests/test_context.py."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

from sharding import LOGICAL_RULES, MeshRules, make_mesh, parse_mesh_spec, spec_for
from sharding.place import variable_axes
from v4jax.cache import LOGICAL_AXES as POOL_AXES
from v4jax.cache.boundary import LOGICAL_AXES as STORE_AXES
from v4jax.config import preset
from v4jax.model import Transformer
import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ":pallas" = attention_impl="pallas" (interpret mode)
MESHES = ["tensor=8", "expert=8", "data=2,tensor=2,expert=2", "data=4,tensor=2", "context=2,tensor=4",
          "data=2,tensor=2,expert=2:pallas"]
# long prompts over small pages (mesh_worker.context_meshes)
CONTEXT_MESHES = ["context=2,tensor=4", "context=4", "data=2,context=2,tensor=2", "context=2,tensor=4:pallas"]
# the TPU export: one mesh of every attention axis in the default run, the others -m slow
TPU_EXPORT_MESH = "data=2,context=2,tensor=2"
MORE_TPU_EXPORT_MESHES = ["tensor=8", "data=8", "expert=8", "context=2,tensor=4", "data=2,tensor=4"]
# mesh -> the local experts of each experts-kernel call (tiny's 8 experts; [] = the XLA forms ran)
EXPERTS_MESHES = {"expert=4,tensor=2": [2], "data=2,expert=2": [4], "data=8": [8], "tensor=8": []}


def _run_worker(args, timeout=1500) -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags.cpu(8), JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "mesh_worker.py"), *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = [json.loads(line[len("RESULT "):]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return {(row["check"], row.get("mesh")): row for row in rows}


def _check_meshes(results, meshes):
    assert results[("reference", None)]["hit_tokens"] >= 16  # the workload has a prefix hit
    for mesh in meshes:
        row = results[("mesh", mesh)]
        assert row["tokens_equal"], row
        assert row["logprob_err"] <= 1e-4, row
        mesh, _, impl = mesh.partition(":")
        # the Pallas table runs the experts kernel per shard (tiny's experts are 32 wide: 16 a shard at tensor=2)
        assert (row["experts_kernel_calls"] > 0) == (impl == "pallas"), row
        axes = parse_mesh_spec(mesh)
        if "data" in axes and "context" not in axes:
            # per-slot compressor state split over `data`, and still as the table says after the steps ran
            assert row["state_spec"] == ["None", "data", "None", "None"], row
            # the paged pools too: a device holds only its data shard's pages (and slots, and boundary rows)
            assert row["kv_spec"] == ["None", "data", "None"] and row["swa_spec"] == ["None", "data", "None"], row
            assert row["tokens_spec"] == ["data", "None"], row
            assert row["pool_device_fraction"] == pytest.approx(1 / axes["data"], rel=1e-9), row
            # and the memory report's per-device figure is what a device holds
            assert row["pool_device_estimate"] == row["pool_device_bytes"], row
            # a prefix hit within a shard, and requests in more than one shard
            assert row["hit_tokens"] >= 16 and len(row["data_shards"]) >= 2, row


def test_every_parameter_and_pool_dimension_has_a_logical_name():
    abstract = nnx.eval_shape(lambda: Transformer(preset("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32))
    for path, var in nnx.to_flat_state(nnx.state(abstract)):
        axes = variable_axes(var, ".".join(map(str, path)))
        assert all(a in LOGICAL_RULES for a in axes), (path, axes)
        if path[0] == "stacks":
            assert axes[0] == "layers", path
    for axes in list(POOL_AXES.values()) + [STORE_AXES]:
        assert all(a in LOGICAL_RULES for a in axes), axes
    assert LOGICAL_RULES["layers"] is None


def test_spec_rules():
    class FakeMesh:  # spec_for reads axis sizes only
        shape = {"data": 2, "context": 1, "tensor": 4, "expert": 2}

    m = FakeMesh()
    assert tuple(spec_for(("experts", "mlp", "embed"), (8, 32, 64), m)) == ("expert", "tensor", None)
    # a dim the axis does not divide stays whole; an axis used once is not used again in the same array
    assert tuple(spec_for(("experts", "mlp", "embed"), (3, 32, 64), m)) == (None, "tensor", None)
    assert tuple(spec_for(("heads", "q_lora"), (256, 32), m)) == ("tensor", None)
    assert tuple(spec_for(("layers", "slots", "window", "state_dim"), (2, 4, 8, 8), m)) == (None, "data", None, None)
    # full-page pools over data x context (context has size 1 here), SWA rows over data
    assert tuple(spec_for(("layers", "pool_rows", "head_dim"), (2, 64, 8), m)) == (None, "data", None)
    assert tuple(spec_for(("layers", "swa_rows", "head_dim"), (2, 64, 8), m)) == (None, "data", None)

    class DataContextMesh:
        shape = {"data": 2, "context": 2, "tensor": 2, "expert": 1}
    dc = DataContextMesh()
    assert tuple(spec_for(("pages", "page_tokens"), (8, 16), dc)) == (("data", "context"), None)
    assert tuple(spec_for(("layers", "swa_rows", "head_dim"), (2, 64, 8), dc)) == (None, "data", None)
    custom = dict(LOGICAL_RULES, vocab=("tensor", "expert"))  # a strategy is a table
    assert tuple(spec_for(("vocab", "embed"), (512, 64), m, custom)) == (("tensor", "expert"), None)
    with pytest.raises(KeyError, match="not in the sharding rules"):
        spec_for(("nonsense",), (4,), m)
    with pytest.raises(ValueError, match="16 devices"):
        make_mesh("tensor=16")
    with pytest.raises(ValueError, match="unknown mesh axes"):
        parse_mesh_spec("model=2")
    assert MeshRules.make(None) is None and MeshRules.make("") is None


@pytest.fixture(scope="module")
def worker_results(tiny_checkpoint, tmp_path_factory):
    """One worker process for the default run's mesh checks: the checkpoint and orbax loads, the model's steps
    with page tables placed by the layout contract (data=2,context=2,tensor=2), the TPU export of the steps on
    that mesh, the experts kernel per shard."""
    from checkpoints.orbax_io import is_orbax_dir
    from v4jax.cli import main
    orbax_dir = str(tmp_path_factory.mktemp("orbax") / "orbax")
    assert main(["convert", tiny_checkpoint, orbax_dir, "--dtype", "float32"]) == 0 and is_orbax_dir(orbax_dir)
    return _run_worker(["--checkpoint", tiny_checkpoint, "--orbax", orbax_dir, "--memory-mesh", "tensor=4,expert=2",
                        "--paged-meshes", "data=2,context=2,tensor=2", "--tpu-export", TPU_EXPORT_MESH,
                        "--experts-meshes", *EXPERTS_MESHES])


@pytest.mark.filterwarnings("ignore:no tokenizer.json")
def test_checkpoint_loads_into_its_shards(worker_results):
    """Read straight into the shards of tensor=4,expert=2: the same values, at most 30% of the parameter bytes on
    any device. An orbax checkpoint converted on one device restores onto that mesh with the same values and
    logits. (Greedy tokens on a mesh: tests/test_multihost.py, two processes, one 8-device mesh, -m slow.)"""
    results = worker_results
    ck = results[("checkpoint", "tensor=4,expert=2")]
    assert ck["same_values"], ck
    assert ck["max_device_fraction"] <= 0.30, ck
    assert ck["w1_spec"][:3] == ["None", "expert", "tensor"], ck  # [layers, experts, width, D]
    ob = results[("orbax", "tensor=4,expert=2")]
    assert ob["same_values"] and ob["logits_err"] <= 1e-4, ob
    assert ob["w1_spec"][:3] == ["None", "expert", "tensor"], ob


def test_context_parallel_steps_with_pages_placed_by_the_layout_contract(worker_results):
    """data=2,context=2,tensor=2, the pools' rows over ("data", "context") and the SWA rows over "data": the
    cached steps (chunked prefill, decode; a scanned layer stack) give the single-device logits with page tables
    built by hand by the layout contract (a slot's pages anywhere in its data shard's blocks, interleaved over
    `context` or not: the model side alone, whatever the allocator does)."""
    row = worker_results[("paged_by_contract", "data=2,context=2,tensor=2")]
    assert row["logits_err"] <= 1e-4, row
    assert row["c4_kv_spec"] == ["None", "('data', 'context')", "None"], row
    assert row["swa_spec"] == ["None", "data", "None"], row


def _check_tpu_export(row):
    assert row["xla_devices"] == row["pallas_devices"] == row["prefill_devices"] == 8, row
    # tiny: CSA, HCA, CSA layers (two compressors each on CSA, one on HCA), mHC twice a layer, 4 layers; the
    # routed experts take the TPU's own kernel (pallas_kernels.experts_tpu: w1, w3, w2 a layer, per shard)
    cached = {"v4_sparse_attention": 4, "v4_indexer_scores": 2, "v4_sinkhorn": 8, "v4_experts_tpu": 12}
    assert row["decode_kernels"] == dict(cached, v4_compressor_decode=5), row
    assert row["prefill_kernels"] == dict(cached, v4_compressor_prefill=5), row


def test_mesh_steps_export_for_tpu(worker_results):
    """The decode and prefill steps on data=2,context=2,tensor=2 lower for TPU: the XLA form, and the Pallas one
    with every kernel a Mosaic call inside a shard_map (attention's, the compressors', Sinkhorn's)."""
    _check_tpu_export(worker_results[("tpu_export", TPU_EXPORT_MESH)])


def test_experts_kernel_runs_per_shard(worker_results):
    """On a mesh the Pallas table runs the experts kernel per shard, on the shard's experts read from the layer
    stack (the tokens of other shards' experts add nothing), the shards' sum the single-device XLA forms; where
    the shard's slice of the width does not fit the kernel (tensor=8: 4 wide), the XLA forms per shard."""
    for mesh, local in EXPERTS_MESHES.items():
        row = worker_results[("experts", mesh)]
        assert row["err"] <= 1e-5, row
        assert row["kernel_local_experts"] == local, row


POOL_MESHES = ["data=2,context=2,tensor=2", "data=4,tensor=2"]


@pytest.mark.slow  # minutes on CPU; -m slow
def test_memory_command_per_device():
    """`v4jax memory --json` with an LLM's options reports exactly what the engine built with them holds over a
    mesh: the bytes of its pools and boundary store in all, and on one device (the most any device's shards
    hold): SWA pages, boundary rows and compressor state split over `data`, full pages over `data` x `context`,
    copies over `tensor`; paged and dense, prefix cache on and off, sized by max_model_len or a budget."""
    results = _run_worker(["--pool-meshes", *POOL_MESHES])
    for mesh in POOL_MESHES:
        row = results[("pool_bytes", mesh)]
        for name, v in row["variants"].items():
            assert v["rc"] == 0, (mesh, name, v)
            assert (v["reported_total"], v["reported_per_device"], v["reported_n_pages"]) == (
                v["total"], v["per_device"], v["n_pages"]), (mesh, name, v)
            assert v["per_device"] < v["total"] / 2, (mesh, name, v)


@pytest.mark.slow
def test_more_meshes_export_for_tpu():
    """The same lowering for TPU on a tensor, a data, an expert mesh and two more."""
    results = _run_worker(["--tpu-export", *MORE_TPU_EXPORT_MESHES])
    for mesh in MORE_TPU_EXPORT_MESHES:
        _check_tpu_export(results[("tpu_export", mesh)])


@pytest.mark.slow
def test_meshes_equal_single_device():
    """One single-device reference; on every mesh the preset's weights are created in their shards (one jit with
    out_shardings) and give the same greedy tokens and log-probs. Context meshes: prompts of 90 and 37 tokens
    over pages of 16 (their pages in several blocks of the pools' rows), prefilled in chunks of 32, 12 decoded
    tokens (the second prompt's with presence, frequency and repetition penalties), against their own single-device
    reference; the compressed pools' rows split over `data` x `context`, the SWA rows over `data`."""
    results = _run_worker(["--meshes", *MESHES, "--context-meshes", *CONTEXT_MESHES], timeout=3000)
    _check_meshes(results, MESHES)
    ref = results[("context_reference", None)]
    assert ref["penalties_change_tokens"] and ref["unpenalised_equal"], ref
    for mesh in CONTEXT_MESHES:
        row = results[("context", mesh)]
        assert row["tokens_equal"] and row["n_tokens"] == [12, 12], row
        assert row["logprob_err"] <= 1e-4, row
        data = "data" in parse_mesh_spec(mesh.partition(":")[0])
        for pool in ("c4_kv_spec", "c4_index_spec", "c128_kv_spec"):
            assert row[pool] == ["None", "('data', 'context')" if data else "context", "None"], row
        assert row["swa_spec"] == ["None", "data" if data else "None", "None"], row
