"""The few-token layer-stack projection kernel (pallas_kernels.layer_linear) against XLA's matmul, and its Triton
lowering from this CPU machine (tests/test_engine_pallas.py checks that the engine's Pallas ops table runs it and
keeps the XLA table's greedy outputs)."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat
from v4jax.model import layers as L

LL = importlib.import_module("pallas_kernels.layer_linear")


def _case(lead, O, D, dtype, n=None, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (*lead, D), dtype),
            jax.random.normal(kw, (O, D) if n is None else (n, O, D), dtype) * D ** -0.5)


@pytest.mark.parametrize("lead,O,D", [((1,), 16, 64), ((5,), 48, 96), ((2, 1), 512, 1024), ((4, 16), 32, 128)])
def test_matches_xla_f32(lead, O, D):
    # O = 512 over D = 1024: 32 row blocks, so D is split in two (partial sums added); 48 x 96: blocks of 16 x 32
    x, w = _case(lead, O, D, jnp.float32)
    out = np.asarray(LL.layer_linear(x, w, interpret=True))
    assert out.shape == (*lead, O)
    np.testing.assert_allclose(out, np.asarray(L.linear(x, w)), rtol=1e-5, atol=1e-5)


def test_reads_one_layer_of_a_stack():
    x, w = _case((3,), 64, 128, jnp.float32, n=3)
    f = jax.jit(lambda i: LL.layer_linear(x, w, i, interpret=True))
    for layer in (0, 2):
        np.testing.assert_allclose(np.asarray(f(jnp.int32(layer))), np.asarray(L.linear(x, w[layer])), rtol=1e-5,
                                   atol=1e-5)


def test_matches_xla_bf16():
    x, w = _case((2,), 64, 256, jnp.bfloat16, n=2)
    out = LL.layer_linear(x, w, jnp.int32(1), interpret=True)
    assert out.dtype == jnp.float32  # f32 sums; the ops table rounds to x's dtype as L.linear does
    ref = jnp.einsum("md,od->mo", x, w[1], preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_unsupported_shapes_are_refused():
    x, w = _case((1,), 24, 64, jnp.float32)  # O = 24: no power-of-two block of >= 16 divides it
    assert not LL.supported(x, w)
    with pytest.raises(ValueError, match="power-of-two"):
        LL.layer_linear(x, w, interpret=True)
    assert not LL.supported(jnp.zeros((LL.MAX_TOKENS + 1, 64)), jnp.zeros((32, 64)))  # prefill: XLA's matmul
    assert LL.supported(jnp.zeros((1, 4096)), jax.ShapeDtypeStruct((43, 32768, 1024), jnp.bfloat16))


def test_lowers_for_gpu():
    x, w = jnp.zeros((1, 4096), jnp.bfloat16), jnp.zeros((4, 512, 4096), jnp.bfloat16)
    txt = _compat.lower_for_cuda(lambda x, w: LL.layer_linear(x, w, jnp.int32(1), interpret=False), x, w)
    assert txt.count("triton") >= 1


@pytest.mark.parametrize("lead,G,R,D", [((1,), 4, 16, 64), ((2, 3), 2, 64, 128)])
def test_grouped_matches_xla(lead, G, R, D):
    # the grouped low-rank output projection: group g's R outputs from x[..., g, :] (two groups per row block
    # would be wrong: R = 16 is one block per group)
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (*lead, G, D), jnp.float32)
    w = jax.random.normal(kw, (3, G * R, D), jnp.float32) * D ** -0.5
    out = np.asarray(LL.layer_linear(x, w, jnp.int32(1), groups=G, interpret=True))
    assert out.shape == (*lead, G, R)
    np.testing.assert_allclose(out, np.asarray(L.linear(x, w[1], groups=G)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lead,outs,D", [((1,), (16, 48, 32), 64), ((3,), (64, 32), 128), ((2, 5), (32, 32), 256)])
def test_several_weights_of_one_input_in_one_launch(lead, outs, D):
    # each weight's outputs as from its own launch; the stacks read at the layer; blocks of 16 rows for (16, 48, 32)
    kx, *kw = jax.random.split(jax.random.key(2), len(outs) + 1)
    x = jax.random.normal(kx, (*lead, D), jnp.float32)
    ws = [jax.random.normal(k, (3, o, D), jnp.float32) * D ** -0.5 for k, o in zip(kw, outs)]
    ys = jax.jit(lambda x, ws, i: LL.layer_linears(x, ws, i, interpret=True))(x, ws, jnp.int32(2))
    assert [y.shape for y in ys] == [(*lead, o) for o in outs]
    for y, w in zip(ys, ws):
        np.testing.assert_allclose(np.asarray(y), np.asarray(L.linear(x, w[2])), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one input width"):
        LL.layer_linears(x, [ws[0], jnp.zeros((3, 16, 2 * D))], 0, interpret=True)


def test_several_weights_lower_for_gpu():
    x = jnp.zeros((1, 4096), jnp.bfloat16)
    ws = [jnp.zeros((4, o, 4096), jnp.bfloat16) for o in (1024, 512, 256)]
    txt = _compat.lower_for_cuda(lambda x, ws: LL.layer_linears(x, ws, jnp.int32(1), interpret=False), x, ws)
    assert txt.count("triton") >= 1


def _fp8_case(lead, O, D, n, groups=1, seed=3):
    """x rounded to FP8 as the release's act_quant leaves it, and a stack of FP8 weights with random block scales."""
    from v4jax.model import quant
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    x = quant.fp8_roundtrip(jax.random.normal(kx, (*lead, *((groups,) if groups > 1 else ()), D), jnp.float32), 128)
    # block magnitudes over a wide range, so every scale differs and a scale applied to the wrong block shows
    mag = jnp.exp2(jax.random.randint(ks, (n, O // 128, D // 128), -6, 6).astype(jnp.float32))
    w = jax.random.normal(kw, (n, O, D), jnp.float32) * jnp.repeat(jnp.repeat(mag, 128, 1), 128, 2)
    return x, quant.Quantized(*quant.quantize(w, "fp8"), "fp8")


@pytest.mark.parametrize("lead,O,D,groups", [((1,), 256, 384, 1), ((5,), 128, 256, 1), ((2,), 512, 128, 2)])
def test_fp8_weights_match_the_dequantized_matmul(lead, O, D, groups):
    # one token (the multiply-and-sum form) and several (the dot form); two groups of 256 rows; layer 1 of 3
    x, w = _fp8_case(lead, O, D, 3, groups)
    assert LL.supported(x, w.values, groups, scaled=True)
    out = jax.jit(lambda x, v, s, i: LL.layer_linear(x, v, i, groups, scale=s[i], interpret=True))(
        x, w.values, w.scale, jnp.int32(1))
    ref = L.linear(x, w[1].astype(jnp.float32), groups)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    # the stack's scales read at the layer in place: the same sums
    stacked = jax.jit(lambda x, v, s, i: LL.layer_linear(x, v, i, groups, scale=s, interpret=True))(
        x, w.values, w.scale, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(out))


@pytest.mark.parametrize("lead,dtype,scaled", [((1,), jnp.float32, True), ((5,), jnp.float32, True),
                                                ((3,), jnp.bfloat16, True), ((1,), jnp.bfloat16, False),
                                                ((4,), jnp.float32, False)])
def test_the_kernel_rounds_its_input_as_the_release_does(lead, dtype, scaled):
    """act_quant: x arrives unrounded and the kernel rounds each 128-column block to FP8 itself, as the jnp
    reference (quant.fp8_roundtrip) does before its matmul; one token (multiply-and-sum) and several (the dot)."""
    from v4jax.model import quant
    _, w = _fp8_case((1,), 256, 512, 2)
    kx, km = jax.random.split(jax.random.key(9))
    mag = jnp.exp2(jax.random.randint(km, (*lead, 4), -12, 12).astype(jnp.float32))  # every block its own scale
    x = (jax.random.normal(kx, (*lead, 512)) * jnp.repeat(mag, 128, -1)).astype(dtype)
    wv = w.values if scaled else w[0].astype(jnp.float32)[None]
    layer = jnp.int32(1 if scaled else 0)
    kw = dict(scale=w.scale[1]) if scaled else {}
    out = jax.jit(lambda x: LL.layer_linear(x, wv, layer, act_quant=True, interpret=True, **kw))(x)
    wf = w[1 if scaled else 0].astype(jnp.float32)
    ref = L.linear(quant.fp8_roundtrip(x, 128).astype(jnp.float32), wf)  # (the kernel's f32 sums)
    tol = 1e-5 * float(jnp.abs(ref).max())
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=tol)
    unrounded = L.linear(x.astype(jnp.float32), wf)
    assert float(jnp.abs(unrounded - ref).max()) > 100 * tol  # the rounding shows at this tolerance


@pytest.mark.parametrize("lead", [(1,), (3,)])
def test_several_fp8_weights_in_one_launch(lead):
    """layer_linears on FP8 stacks, each with its own scale stack read at the layer, x rounded in the kernel: each
    weight's dequantized matmul of the rounded x (attention's wq_a and wkv, the shared expert's w1 and w3)."""
    from v4jax.model import quant
    _, wa = _fp8_case((1,), 256, 512, 3, seed=4)
    _, wb = _fp8_case((1,), 128, 512, 3, seed=5)
    x = jax.random.normal(jax.random.key(6), (*lead, 512)).astype(jnp.bfloat16)
    ya, yb = jax.jit(lambda x, i: LL.layer_linears(x, [wa.values, wb.values], i, scales=[wa.scale, wb.scale],
                                                   act_quant=True, interpret=True))(x, jnp.int32(2))
    xq = quant.fp8_roundtrip(x, 128).astype(jnp.float32)
    for y, w in ((ya, wa), (yb, wb)):
        ref = L.linear(xq, w[2].astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_the_ops_table_projects_fp8_stacks_in_one_launch(monkeypatch):
    """ops.project (the Pallas table's) on FP8 stacks and their scale stacks, as the layer loop hands them over
    (L.LayerOf): one launch, each output the XLA table's `linear` of the same weight with act_quant."""
    from v4jax.model import ops
    _, wa = _fp8_case((1,), 256, 512, 3, seed=4)
    _, wb = _fp8_case((1,), 128, 512, 3, seed=5)
    x = jax.random.normal(jax.random.key(7), (2, 512)).astype(jnp.bfloat16)
    launches = []
    real = LL.layer_linears
    monkeypatch.setattr(LL, "layer_linears", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    i = jnp.int32(1)
    got = ops._project_pallas(x, [L.LayerOf(wa.values, i), L.LayerOf(wb.values, i)],
                              [L.LayerOf(wa.scale, i), L.LayerOf(wb.scale, i)], act_quant=True)
    assert len(launches) == 1
    for y, w in zip(got, (wa, wb)):
        ref = ops._linear_xla(x.astype(jnp.float32), w.values, i, 1, w.scale, act_quant=True)
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    # a layer's scales already sliced (a mesh's arrays) are not taken: the caller's Linear projects
    assert ops._project_pallas(x, [L.LayerOf(wa.values, i), L.LayerOf(wb.values, i)], [wa.scale[1], wb.scale[1]],
                               act_quant=True) == [None, None]


def test_fp8_block_rounding_is_the_reference_bit_for_bit():
    """_common.fp8_round_block (the kernels' act_quant: the scale from amax's bits) against quant.fp8_roundtrip,
    at block maxima on either side of 448 x 2^k, zeros, values under the 1e-4 floor and e4m3's subnormals."""
    from pallas_kernels._common import fp8_round_block
    from v4jax.model import quant
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((8, 128)) * s for s in (1e-9, 1e-5, 1e-4, 0.01, 1.0, 448.0, 1e4, 1e30)]
    for k in range(-24, 24, 3):
        top = np.float32(448 * 2.0 ** k)
        for amax in (top, np.nextafter(top, np.float32(np.inf)), np.nextafter(top, np.float32(0))):
            r = (rng.standard_normal(128) * 0.1 * 2.0 ** k).astype(np.float32)
            r[7] = -amax
            rows.append(r[None])
    x = jnp.asarray(np.concatenate(rows + [np.zeros((1, 128))]).astype(np.float32))
    got = np.asarray(jax.jit(fp8_round_block)(x))
    ref = np.asarray(quant.fp8_roundtrip(x, 128))
    np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32))


def test_fp8_weights_need_whole_scale_blocks():
    x, w = _fp8_case((1,), 128, 256, 1)
    assert not LL.supported(x[..., :192], w.values[..., :192], scaled=True)
    assert LL.supported(x[..., :192], w.values[..., :192].astype(jnp.float32))  # unscaled: blocks of 64


def test_fp8_weights_lower_for_gpu():
    x = jnp.zeros((1, 4096), jnp.bfloat16)
    w = jnp.zeros((4, 1024, 4096), jnp.float8_e4m3fn)
    s = jnp.zeros((8, 32), jnp.float8_e8m0fnu)
    for rows, act_quant in ((1, False), (1, True), (8, True)):  # multiply-and-sum, the dot; x rounded in the kernel
        txt = _compat.lower_for_cuda(lambda x, w, s: LL.layer_linear(x, w, jnp.int32(1), scale=s, act_quant=act_quant,
                                                                     interpret=False), x.repeat(rows, 0), w, s)
        assert txt.count("v4_layer_linear_fp8") >= 1
    ss = jnp.zeros((4, 8, 32), jnp.float8_e8m0fnu)  # two weights of one input, their scale stacks read at the layer
    txt = _compat.lower_for_cuda(lambda x, w, s: LL.layer_linears(x, [w, w[:, :512]], jnp.int32(1), scales=[s, s[:, :4]],
                                                                  act_quant=True, interpret=False), x, w, ss)
    assert txt.count("v4_layer_linear_fp8") >= 1
