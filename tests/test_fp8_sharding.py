"""FP8 under jax.jit with sharded inputs on 4 CPU devices: the FP8 calls partition by
their layouts (jax_ext/fp8_ffi_calls.py) as the 16-bit GEMMs do (test_jax_sharding.py). In the
compiled program each device's custom call sees its shard (rows, experts, the rowwise
recipe's output channels, the weight gradient's tokens), nothing is all-gathered that the
layout can keep sharded, and what a scale block spans whole is gathered. Values are the
unsharded call's bits wherever each device runs the unsharded call's arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bits import assert_same_bits, bf16_ulps, cancelling
from hlo import collective_types, collectives, compiled_text, custom_calls
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import cpu_mesh

import groupgemm.jax as gj

M, K, N, G = 16, 128, 8, 4
SIZES = np.asarray((5, 0, 6, 3), np.int32)  # an empty expert, two padding rows; 4-row blocks cut through groups
MATMUL, WGRAD = "groupgemm_scaled_matmul", "groupgemm_scaled_wgrad"
RECIPES = ("rowwise", "blockwise")


def mesh_1d():
    return cpu_mesh((4,), ("x",))


def put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def operands(recipe, seed=0):
    """Quantized lhs, rhs [G, N, K], their scales and a bias, computed unsharded."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, N, K)), jnp.bfloat16)
    (qx, sx), (qw, sw) = gj.quantize_fp8(x, recipe), gj.quantize_fp8(w, recipe)
    return dict(x=x, w=w, qx=qx, sx=sx, qw=qw, sw=sw, bias=jnp.asarray(rng.standard_normal((G, N)), jnp.bfloat16))


def calls(text, target):
    found = custom_calls(text, target)
    assert found, f"no {target} call"
    return found


def reduced(text):
    return [shape for shapes, _ in collectives(text, "all-reduce") for shape in shapes]


def gathered(text):
    return [shape for shapes, _ in collectives(text, "all-gather") for shape in shapes]


# name: the specs of (lhs, lhs_scale, rhs, rhs_scale, bias), each device's (lhs, rhs) shapes
# and the all-reduces; the recipes it applies to.
MATMUL_LAYOUTS = {
    "rows": ((P("x"), P("x"), P(), P(), P()), ((4, K), (G, N, K)), [], RECIPES),
    "experts": ((P(), P(), P("x"), P("x"), P("x")), ((M, K), (1, N, K)), [(M, N)], RECIPES),
    "channels": ((P(), P(), P(None, "x"), P(None, "x"), P(None, "x")), ((M, K), (G, 2, K)), [], ("rowwise",)),
}


@pytest.mark.parametrize("name, recipe", [(n, r) for n, layout in MATMUL_LAYOUTS.items() for r in layout[3]])
def test_scaled_matmul_runs_on_each_devices_shard_with_the_unsharded_bits(name, recipe):
    specs, shard_shapes, reduces, _ = MATMUL_LAYOUTS[name]
    d, mesh = operands(recipe), mesh_1d()
    args = [put(mesh, d[k], *spec) for k, spec in zip(("qx", "sx", "qw", "sw", "bias"), specs)]
    forward = jax.jit(lambda qx, sx, qw, sw, bias: gj.scaled_grouped_matmul(qx, qw, SIZES, sx, sw, recipe=recipe,
                                                                            bias=bias))
    out = forward(*args)

    unsharded = gj.scaled_grouped_matmul(d["qx"], d["qw"], SIZES, d["sx"], d["sw"], recipe=recipe, bias=d["bias"])
    assert_same_bits(out, unsharded, f"{name} {recipe}")
    assert (np.asarray(out, np.float32)[SIZES.sum():] == 0).all()  # padding rows
    text = compiled_text(forward, *args)
    assert gathered(text) == []
    assert [ops[:2] for _, ops in calls(text, MATMUL)] == [list(shard_shapes)]
    assert reduced(text) == reduces


def test_blockwise_scaled_matmul_gathers_output_channels_its_scale_blocks_span():
    # A 128 x 128 weight block's scale covers all 8 channels: they meet on each device.
    d, mesh = operands("blockwise"), mesh_1d()
    args = (d["qx"], put(mesh, d["qw"], None, "x"), d["sx"], d["sw"])
    forward = jax.jit(lambda qx, qw, sx, sw: gj.scaled_grouped_matmul(qx, qw, SIZES, sx, sw, recipe="blockwise"))
    assert_same_bits(forward(*args), gj.scaled_grouped_matmul(d["qx"], d["qw"], SIZES, d["sx"], d["sw"],
                                                              recipe="blockwise"), "gathered N")
    assert [ops[1] for _, ops in calls(compiled_text(forward, *args), MATMUL)] == [(G, N, K)]


# Each device quantizes its rows of x and its expert's weight (rowwise: its [N, K] rows, unreshaped).
QUANTIZED_SHARDS = {("x", "rowwise"): (4, K), ("x", "blockwise"): (4, K), ("w", "rowwise"): (1, N, K),
                    ("w", "blockwise"): (1, N, K)}


@pytest.mark.parametrize("operand, recipe", list(QUANTIZED_SHARDS))
def test_quantize_fp8_keeps_rows_and_experts_on_their_devices(operand, recipe):
    array, mesh = operands(recipe)[operand], mesh_1d()
    quantize = jax.jit(lambda a: gj.quantize_fp8(a, recipe))
    sharded = put(mesh, array, "x")
    for got, want in zip(quantize(sharded), gj.quantize_fp8(array, recipe)):
        assert_same_bits(got, want, f"{operand} {recipe}")
    text = compiled_text(quantize, sharded)
    assert gathered(text) == []
    target = "groupgemm_fp8_quantize_blocks" if array.ndim == 3 and recipe == "blockwise" else \
        "groupgemm_fp8_quantize_rows"
    assert [ops[0] for _, ops in calls(text, target)] == [QUANTIZED_SHARDS[operand, recipe]]


def _wgrad_operands(recipe):
    rng = np.random.default_rng(1)
    dout = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    (qd, sd), (qx, sx) = (gj.quantize_fp8_grouped(a, SIZES, recipe) for a in (dout, x))
    return qd, sd, qx, sx


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_wgrad_contracts_each_devices_tokens_or_gathers_them(recipe):
    # Rowwise: a group's scale serves any of its tokens, so each device contracts its token
    # block and one all-reduce sums the partial gradients. Blockwise: token blocks are
    # numbered over the whole window, so the tokens meet on each device (an all-gather).
    qd, sd, qx, sx = _wgrad_operands(recipe)
    mesh = mesh_1d()
    args = (put(mesh, qd, None, "x"), sd, put(mesh, qx, None, "x"), sx)
    wgrad = jax.jit(lambda qd, sd, qx, sx: gj.scaled_grouped_matmul_wgrad(qd, qx, SIZES, sd, sx, recipe=recipe,
                                                                          preferred_element_type=jnp.float32))
    out = np.asarray(wgrad(*args))
    unsharded = np.asarray(gj.scaled_grouped_matmul_wgrad(qd, qx, SIZES, sd, sx, recipe=recipe,
                                                          preferred_element_type=jnp.float32))
    if recipe == "rowwise":  # the partial sums add in another order
        np.testing.assert_allclose(out, unsharded, rtol=1e-5, atol=1e-5 * np.abs(unsharded).max())
    else:
        assert_same_bits(out, unsharded, recipe)
    assert (out[1] == 0).all()  # the empty expert
    text = compiled_text(wgrad, *args)
    tokens = 4 if recipe == "rowwise" else M
    assert [ops[:2] for _, ops in calls(text, WGRAD)] == [[(N, tokens), (K, tokens)]]
    assert reduced(text) == ([(G, N, K)] if recipe == "rowwise" else [])


def test_rowwise_scaled_wgrad_in_bfloat16_sums_the_devices_parts_in_float32():
    # As the 16-bit weight gradients' (test_jax_sharding.py): each device's part of an
    # expert's gradient stays float32 until the sum is rounded once. Expert 2's rows
    # (5..10) are -100 on one device and +100 on the next: rounded parts lost its bits.
    rng, mesh = np.random.default_rng(4), mesh_1d()
    dout = jnp.asarray(cancelling(rng, (M, N), 0), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    (qd, sd), (qx, sx) = (gj.quantize_fp8_grouped(a, SIZES, "rowwise") for a in (dout, x))
    args = (put(mesh, qd, None, "x"), sd, put(mesh, qx, None, "x"), sx)
    wgrad = jax.jit(lambda qd, sd, qx, sx: gj.scaled_grouped_matmul_wgrad(qd, qx, SIZES, sd, sx, recipe="rowwise"))
    exact = gj.scaled_grouped_matmul_wgrad(qd, qx, SIZES, sd, sx, recipe="rowwise", preferred_element_type=jnp.float32)
    assert bf16_ulps(wgrad(*args), exact) <= 1.0
    assert [set(t) for t in collective_types(compiled_text(wgrad, *args), "all-reduce")] == [{"f32"}]


def test_rowwise_scaled_wgrad_gives_each_device_its_experts_gradients():
    qd, sd, qx, sx = _wgrad_operands("rowwise")
    mesh = mesh_1d()
    args = (qd, put(mesh, sd, "x"), qx, put(mesh, sx, "x"))
    wgrad = jax.jit(lambda qd, sd, qx, sx: gj.scaled_grouped_matmul_wgrad(qd, qx, SIZES, sd, sx, recipe="rowwise"),
                    out_shardings=NamedSharding(mesh, P("x")))
    assert_same_bits(wgrad(*args), gj.scaled_grouped_matmul_wgrad(qd, qx, SIZES, sd, sx, recipe="rowwise"), "experts")
    text = compiled_text(wgrad, *args)
    assert gathered(text) == [] and reduced(text) == []
    assert [results[0] for results, _ in calls(text, WGRAD)] == [(1, N, K)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_mlp_forward_runs_each_devices_tokens(recipe):
    rng, mesh = np.random.default_rng(2), mesh_1d()
    h, f = 128, 128
    x = jnp.asarray(rng.standard_normal((M, h)), jnp.bfloat16)
    w_in = jnp.asarray(rng.standard_normal((G, 2 * f, h)) * 0.1, jnp.bfloat16)  # the torch layout
    w_out = jnp.asarray(rng.standard_normal((G, h, f)) * 0.1, jnp.bfloat16)
    mlp = jax.jit(lambda x, w_in, w_out: gj.grouped_mlp(x, w_in, w_out, SIZES, transpose_rhs=True, fp8=recipe))
    sharded = put(mesh, x, "x")
    assert_same_bits(mlp(sharded, w_in, w_out), mlp(x, w_in, w_out), recipe)
    text = compiled_text(mlp, sharded, w_in, w_out)
    assert gathered(text) == [] and reduced(text) == []
    assert [ops[0] for _, ops in calls(text, MATMUL)] == [(4, h), (4, f)]


# ---- explicit axes ----------------------------------------------------------------------


def explicit_mesh():
    return cpu_mesh((4,), ("x",), jax.sharding.AxisType.Explicit)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_gives_weight_gradients_typed_like_the_weights_on_explicit_axes(recipe):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w_in, w_out = (rng.standard_normal(s).astype(np.float32) for s in ((G, K, 256), (G, 128, K)))
    loss = lambda w_in, w_out: jnp.sum(gj.grouped_mlp(x, w_in, w_out, SIZES, fp8=recipe) ** 2)  # noqa: E731
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(w_in, w_out)
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        sharded = (put(mesh, w_in, "x"), put(mesh, w_out, "x"))  # experts over the devices
        got = jax.jit(jax.grad(loss, argnums=(0, 1)))(*sharded)
    for g, w, primal in zip(got, want, sharded):
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec == P("x", None, None)
        assert_same_bits(np.asarray(g), np.asarray(w), recipe)


def test_rowwise_quantization_of_a_weight_sharded_along_n_on_explicit_axes():
    w = np.random.default_rng(9).standard_normal((G, 256, K)).astype(np.float32)
    want = jax.jit(lambda w: gj.quantize_fp8(w, "rowwise"))(w)
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        q, scale = jax.jit(lambda w: gj.quantize_fp8(w, "rowwise"))(put(mesh, w, None, "x"))
    assert jax.typeof(q).sharding.spec == P(None, "x", None) and jax.typeof(scale).sharding.spec == P(None, "x")
    assert_same_bits(np.asarray(q).view(np.uint8), np.asarray(want[0]).view(np.uint8), "q")
    assert_same_bits(np.asarray(scale), np.asarray(want[1]), "scale")
