"""groupgemm.flax refuses bad input with an exception naming the argument: parameters of
the wrong shape (replaced or loaded), a num_experts the mesh's expert axis does not
divide, a missing mesh axis, the layers' own arguments (checked before any parameter is
made) and their calls' x and allowed."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clients import require
from jax.sharding import Mesh

nnx = require("flax.nnx")
import groupgemm.flax as gf  # noqa: E402

MESH = Mesh(np.array(jax.devices("cpu")[:4]), ("expert",))
SIZES = jnp.array([2, 2, 0, 0], jnp.int32)


def replaced(module, path, shape):
    variable = module
    for part in path.split("."):
        variable = getattr(variable, part)
    variable.set_value(jnp.zeros(shape))  # as a checkpoint of another shape would
    return module


BAD = {
    "weight of the wrong shape": (
        lambda: replaced(gf.GroupedLinear(4, 8, 6, rngs=nnx.Rngs(0)), "weight", (4, 8, 6))(jnp.ones((4, 8)), SIZES),
        ValueError, r"GroupedLinear: weight must have shape \(4, 6, 8\), got \(4, 8, 6\)"),
    "bias of the wrong shape": (
        lambda: replaced(gf.GroupedMLP(4, 8, 6, bias=True, rngs=nnx.Rngs(0)), "fc2.bias", (4, 6))(jnp.ones((4, 8)),
                                                                                                  SIZES),
        ValueError, r"GroupedLinear: bias must have shape \(4, 8\), got \(4, 6\)"),
    "router of the wrong shape": (
        lambda: replaced(gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0)), "router", (4, 8))(jnp.ones((3, 8))),
        ValueError, r"MoE: router must have shape \(8, 4\), got \(4, 8\)"),
    "num_experts the expert axis does not divide": (
        lambda: gf.ExpertParallelMoE(6, 8, 6, 2, MESH, rngs=nnx.Rngs(0)),
        ValueError, "ExpertParallelMoE: num_experts = 6 is not a multiple of the expert-parallel group's 4 ranks"),
    "expert axis missing from the mesh": (
        lambda: gf.ExpertParallelMoE(4, 8, 6, 2, MESH, expert_axis="ep", rngs=nnx.Rngs(0)),
        ValueError, r"ExpertParallelMoE: expert_axis 'ep' is not an axis of the mesh \('expert',\)"),
    "no mesh": (
        lambda: gf.ExpertParallelMoE(4, 8, 6, 2, rngs=nnx.Rngs(0))(jnp.ones((4, 8))),
        ValueError, "ExpertParallelMoE: no mesh"),
    "tokens the devices do not split evenly": (
        lambda: gf.ExpertParallelMoE(4, 8, 6, 2, MESH, rngs=nnx.Rngs(0))(jnp.ones((6, 8))),
        ValueError, "ExpertParallelMoE: x has 6 tokens, not a multiple of the 4 devices"),
    "capacity": (
        lambda: gf.ExpertParallelMoE(4, 8, 6, 2, MESH, capacity=0, rngs=nnx.Rngs(0)),
        ValueError, "ExpertParallelMoE: capacity must be a positive int"),
    "top_k above num_experts": (
        lambda: gf.MoE(4, 8, 6, 5, rngs=nnx.Rngs(0)),
        ValueError, r"MoE: top_k = 5 exceeds 4 \(the number of experts\)"),
    "x of the wrong rank": (
        lambda: gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))(jnp.ones(8)),
        ValueError, "MoE: x must be 2-D"),
    "blockwise fp8 widths": (
        lambda: gf.GroupedLinear(4, 8, 128, fp8="blockwise", rngs=nnx.Rngs(0)),
        ValueError, "GroupedLinear: fp8='blockwise' needs in_features to be a multiple of 128"),
    "blockwise fp8 MLP widths": (  # its own name, not its fc1's in_features
        lambda: gf.GroupedMLP(4, 100, 128, fp8="blockwise", rngs=nnx.Rngs(0)),
        ValueError, "GroupedMLP: fp8='blockwise' needs hidden_size to be a multiple of 128"),
    "activation": (
        lambda: gf.GroupedMLP(4, 8, 6, activation="tanh", rngs=nnx.Rngs(0)),
        ValueError, "GroupedMLP: activation must be one of"),
    "fused": (
        lambda: gf.MoE(4, 8, 6, 2, fused="yes", rngs=nnx.Rngs(0)),
        TypeError, "GroupedMLP: fused must be None, True or False, got 'yes'"),
    "fused with fp8": (
        lambda: gf.MoE(4, 8, 128, 2, fp8="rowwise", fused=True, rngs=nnx.Rngs(0)),
        ValueError, "GroupedMLP: fused=True asks for the fused expert MLP, which does not run fp8='rowwise'"),
    "negative width": (
        lambda: gf.GroupedLinear(4, -1, 6, rngs=nnx.Rngs(0)),
        ValueError, "GroupedLinear: in_features must be a non-negative int, got -1"),
    "negative ffn_hidden_size": (
        lambda: gf.GroupedMLP(4, 8, -1, rngs=nnx.Rngs(0)),
        ValueError, "GroupedMLP: ffn_hidden_size must be a non-negative int, got -1"),
    "negative hidden_size, before the router is made": (
        lambda: gf.MoE(4, -1, 6, 2, rngs=nnx.Rngs(0)),
        ValueError, "MoE: hidden_size must be a non-negative int, got -1"),
    "a float hidden_size": (
        lambda: gf.ExpertParallelMoE(4, 8.0, 6, 2, MESH, rngs=nnx.Rngs(0)),
        ValueError, "ExpertParallelMoE: hidden_size must be a non-negative int, got 8.0"),
    "an integer dtype": (
        lambda: gf.MoE(4, 8, 6, 2, dtype=jnp.int32, rngs=nnx.Rngs(0)),
        TypeError, "MoE: dtype must be float32, bfloat16, float16 or float64, got int32"),
    "num_experts the mesh's expert axis does not divide": (
        lambda: gf.MoE(6, 8, 6, 2, mesh=MESH, rngs=nnx.Rngs(0)),
        ValueError, "MoE: num_experts = 6 is not a multiple of the 4 devices of the mesh's expert_axis 'expert'"),
    "expert axis missing from the layer's mesh": (
        lambda: gf.GroupedMLP(4, 8, 6, mesh=MESH, expert_axis="ep", rngs=nnx.Rngs(0)),
        ValueError, r"GroupedMLP: expert_axis 'ep' is not an axis of the mesh \('expert',\); pass expert_axis=None"),
    "grouped rows of another width": (
        lambda: gf.GroupedLinear(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones((6, 7)), [2, 0, 3]),
        ValueError, r"GroupedLinear: x has width 7 \(shape \(6, 7\)\), but the layer's in_features is 8"),
    "grouped rows of another dtype": (
        lambda: gf.GroupedLinear(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones((6, 8), jnp.bfloat16), [2, 0, 3]),
        TypeError, r"GroupedLinear: x has dtype bfloat16, but the layer's dtype \(its parameters'\) is float32"),
    "integer rows": (  # no integer layer to suggest: the layers' dtypes are float
        lambda: gf.GroupedLinear(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones((6, 8), jnp.int32), [2, 0, 3]),
        TypeError, r"GroupedLinear: x has dtype int32, but the layer's dtype \(its parameters'\) is float32; "
                   r"cast x to float32$"),
    "MLP rows of another dtype": (
        lambda: gf.GroupedMLP(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones((6, 8), jnp.bfloat16), [2, 0, 3]),
        TypeError, r"GroupedMLP: x has dtype bfloat16, but the layer's dtype \(its parameters'\) is float32"),
    "MLP rows of another width": (
        lambda: gf.GroupedMLP(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones((6, 9)), [2, 0, 3]),
        ValueError, r"GroupedMLP: x has width 9 \(shape \(6, 9\)\), but the layer's hidden_size is 8"),
    **{f"{layer.__name__} rows of shape {x}": (
        lambda layer=layer, x=x: layer(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones(x), [2, 0, 3]),
        ValueError, rf"{layer.__name__}: x must be 2-D \[rows, {width}\], got shape {re.escape(str(x))}")
       for layer, width in ((gf.GroupedLinear, "in_features"), (gf.GroupedMLP, "hidden_size"))
       for x in ((), (8,), (1, 6, 8))},
    **{f"{layer.__name__} with {len(sizes)} group sizes": (
        lambda layer=layer, sizes=sizes: layer(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones((6, 8)), sizes),
        ValueError, f"{layer.__name__}: group_sizes has {len(sizes)} entries, but the layer has num_experts = 3: one "
        "size per expert")
       for layer in (gf.GroupedLinear, gf.GroupedMLP) for sizes in ([2, 4], jnp.array([2, 0, 3, 1]))},
    **{f"{layer.__name__} with group sizes {sizes!r}": (  # the layer's name, not the GEMM op's
        lambda layer=layer, sizes=sizes: layer(3, 8, 4, rngs=nnx.Rngs(0))(jnp.ones((6, 8)), sizes),
        TypeError, f"{layer.__name__}: group_sizes must {must}")
       for layer in (gf.GroupedLinear, gf.GroupedMLP)
       for sizes, must in ((jnp.array([2.0, 0, 3]), "be an integer array, got float32"),
                           (np.array([True, False, True]), "be an integer array, got bool"),
                           ([2.0, 0, 3], "hold integers, got 2.0"))},
    **{f"routed tokens of another width (fused={fused})": (
        lambda fused=fused: gf.GroupedMLP(3, 8, 4, fused=fused, rngs=nnx.Rngs(0)).forward_routed(
            jnp.ones((6, 9)), jnp.zeros((6, 2), jnp.int32)),
        ValueError, r"GroupedMLP: tokens has width 9 \(shape \(6, 9\)\), but the layer's hidden_size is 8")
       for fused in (False, True)},
    **{f"routed tokens of another dtype (fused={fused})": (
        lambda fused=fused: gf.GroupedMLP(3, 8, 4, fused=fused, rngs=nnx.Rngs(0)).forward_routed(
            jnp.ones((6, 8), jnp.bfloat16), jnp.zeros((6, 2), jnp.int32)),
        TypeError, r"GroupedMLP: tokens has dtype bfloat16, but the layer's dtype \(its parameters'\) is float32")
       for fused in (False, True)},
    "a router of another dtype than the experts": (
        lambda: _with_bfloat16(gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0)), "router")(jnp.ones((3, 8))),
        TypeError, "MoE: parameter router has dtype bfloat16, but experts.fc1.weight has float32; a layer's "
                   "parameters share one dtype"),
    "a dtype that is no dtype": (lambda: gf.MoE(4, 8, 6, 2, dtype="abc", rngs=nnx.Rngs(0)), TypeError,
                                 "MoE: dtype must be a dtype, got 'abc'"),
    "a bias flag that is not a bool": (  # "no" is truthy: a bias would be made silently
        lambda: gf.GroupedLinear(3, 8, 4, bias="no", rngs=nnx.Rngs(0)), TypeError,
        "GroupedLinear: bias must be a bool, got 'no'"),
    "a weight of another dtype than its bias": (
        lambda: _with_bfloat16(gf.GroupedLinear(3, 8, 4, rngs=nnx.Rngs(0)), "weight")(jnp.ones((6, 8)), [2, 0, 3]),
        TypeError, "GroupedLinear: parameter weight has dtype bfloat16, but bias has float32"),
    **{f"an MLP's layers of two dtypes (fused={fused})": (
        lambda fused=fused: _mlp_with_a_bfloat16_fc2(fused).forward_routed(jnp.ones((6, 8)), jnp.zeros((6, 2), int)),
        TypeError, "GroupedMLP: parameter fc2.weight has dtype bfloat16, but fc1.weight has float32")
       for fused in (False, True)},
    "x of another dtype": (
        lambda: gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))(jnp.ones((3, 8), jnp.bfloat16)),
        TypeError, r"MoE: x has dtype bfloat16, but the layer's dtype \(its parameters'\) is float32"),
    "x of another width": (
        lambda: gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))(jnp.ones((3, 9))),
        ValueError, r"MoE: x has width 9 \(shape \(3, 9\)\), but the layer's hidden_size is 8"),
    "allowed that does not broadcast": (
        lambda: gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))(jnp.ones((3, 8)), jnp.ones(5, bool)),
        ValueError, r"MoE: allowed has shape \(5,\), which does not broadcast to \(3, 4\)"),
    "allowed of floats": (
        lambda: gf.ExpertParallelMoE(4, 8, 6, 2, MESH, rngs=nnx.Rngs(0))(jnp.ones((4, 8)), jnp.ones(4)),
        TypeError, "ExpertParallelMoE: allowed must hold booleans"),
}


def _with_bfloat16(layer, name):
    """``layer`` with its parameter ``name`` set to a bfloat16 copy."""
    getattr(layer, name).set_value(getattr(layer, name)[...].astype(jnp.bfloat16))
    return layer


def _mlp_with_a_bfloat16_fc2(fused):
    mlp = gf.GroupedMLP(3, 8, 4, fused=fused, rngs=nnx.Rngs(0))
    _with_bfloat16(mlp.fc2, "weight")
    return mlp


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    call, error, message = BAD[case]
    with pytest.raises(error, match=message):
        call()


def test_a_list_of_group_sizes_may_be_traced_as_a_jit_argument():
    mlp = gf.GroupedMLP(4, 8, 6, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)), jnp.float32)
    traced = nnx.jit(lambda mlp, sizes: mlp(x, sizes))(mlp, [1, 2, 0, 0])  # each size a tracer
    assert np.array_equal(np.asarray(traced), np.asarray(mlp(x, [1, 2, 0, 0])))
