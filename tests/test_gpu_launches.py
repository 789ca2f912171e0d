# ruff: noqa: E501 - the HLO lines are as XLA prints them
"""The launch counter of `v4jax bench gpu-launches` (v4jax.bench.gpu_launches) on a hand-written optimized HLO: a
step loop of unknown trip count around a layer loop of known trip count, fusions, a Pallas kernel, a library call,
a copy and a conditional. (Compiling for an H100 needs the CUDA plugin: a separate install, see its module doc.)"""
from v4jax.bench import gpu_launches as G

HLO = """HloModule jit_step, is_scheduled=true

%layer (p.1: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p.1 = (s32[], f32[16]{0}) parameter(0)
  %gte.1 = f32[16]{0} get-tuple-element(%p.1), index=1
  %loop_dynamic_slice_fusion.3 = f32[1,512]{1,0} fusion(%gte.1), kind=kLoop, calls=%f1
  %pallas_call.7 = f32[16]{0} custom-call(%gte.1), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = \\"v4_hc_weights\\", ir = \\"...\\"}
  %input_reduce_fusion.12 = (f32[16]{0}, /*index=1*/f32[16]{0}) fusion(%pallas_call.7), kind=kInput, calls=%f2
  ROOT %tuple.2 = (s32[], f32[16]{0}) tuple(%gte.1, %pallas_call.7)
}

%layer_cond (p.2: (s32[], f32[16])) -> pred[] {
  %p.2 = (s32[], f32[16]{0}) parameter(0)
  ROOT %loop_compare_fusion = pred[] fusion(%p.2), kind=kLoop, calls=%f3
}

%branch_a (p.3: f32[16]) -> f32[16] {
  %p.3 = f32[16]{0} parameter(0)
  ROOT %loop_add_fusion = f32[16]{0} fusion(%p.3), kind=kLoop, calls=%f4
}

%step (p.4: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p.4 = (s32[], f32[16]{0}) parameter(0)
  %while.9 = (s32[], f32[16]{0}) while(%p.4), condition=%layer_cond, body=%layer, backend_config={"known_trip_count":{"n":"2"}}
  %gte.4 = f32[16]{0} get-tuple-element(%while.9), index=1
  %custom-call.3 = f32[16]{0} custom-call(%gte.4), custom_call_target="__cublas$lt$matmul"
  %conditional.1 = f32[16]{0} conditional(%gte.4), branch_computations={%branch_a, %branch_a}
  ROOT %tuple.5 = (s32[], f32[16]{0}) tuple(%gte.4, %custom-call.3)
}

%step_cond (p.5: (s32[], f32[16])) -> pred[] {
  %p.5 = (s32[], f32[16]{0}) parameter(0)
  ROOT %loop_compare_fusion.1 = pred[] fusion(%p.5), kind=kLoop, calls=%f5
}

ENTRY %main.1 (x.1: f32[16]) -> (s32[], f32[16]) {
  %x.1 = f32[16]{0} parameter(0)
  %copy.4 = f32[16]{0} copy(%x.1)
  %tuple.6 = (s32[], f32[16]{0}) tuple(%x.1, %copy.4)
  ROOT %while.1 = (s32[], f32[16]{0}) while(%tuple.6), condition=%step_cond, body=%step
}
"""


def test_launches_follow_loops_and_branches():
    comps, entry = G.computations(HLO)
    assert entry == "main.1" and set(comps) == {"layer", "layer_cond", "branch_a", "step", "step_cond", "main.1"}
    got = G.launches(HLO, unknown_trips=8)
    # 8 steps x 2 layers of (slice copy, Pallas kernel, reduce), 3 layer conditions a step, 9 step conditions,
    # a cuBLAS call and both branches (an upper bound) a step, one copy a call
    assert got == {"loop_dynamic_slice_fusion": 16, "v4_hc_weights": 16, "input_reduce_fusion": 16,
                   "loop_compare_fusion": 24 + 9, "__cublas$lt$matmul": 8, "loop_add_fusion": 16, "copy": 1}
    assert sum(G.launches(HLO, unknown_trips=1).values()) == 2 * 3 + 3 + 2 + 1 + 2 + 1


def test_chain_follows_operands_through_loops():
    """The layer body: the slice copy and the Pallas kernel both read the carry, the reduce waits for the kernel:
    2 in a row, the condition 1; two trips: 2 x 2 + 3 x 1 = 7. A step: the layer loop, then the cuBLAS call (8; the
    conditional beside it, 1 after the loop). The entry: the copy, then 8 steps and 9 step conditions."""
    assert G.chain(HLO.replace("%step (", "%unused (").replace("body=%step", "body=%layer"), unknown_trips=1) \
        == 1 + 2 + 2 * 1
    assert G.chain(HLO, unknown_trips=8) == 1 + 8 * 8 + 9 * 1
    # the reduce reading the slice copy instead: still 2 in a row
    assert G.chain(HLO.replace("fusion(%pallas_call.7)", "fusion(%loop_dynamic_slice_fusion.3)"), 8) == 74
    # reading both the reduce's output: 3
    longer = HLO.replace("ROOT %tuple.2 = (s32[], f32[16]{0}) tuple(%gte.1, %pallas_call.7)",
                         "%loop_add_fusion.2 = f32[16]{0} fusion(%input_reduce_fusion.12), kind=kLoop, calls=%f4\n"
                         "  ROOT %tuple.2 = (s32[], f32[16]{0}) tuple(%gte.1, %loop_add_fusion.2)")
    assert G.chain(longer, unknown_trips=8) == 1 + 8 * (2 * 3 + 3 + 1) + 9
