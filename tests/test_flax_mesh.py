"""groupgemm.flax on a mesh of CPU devices: ExpertParallelMoE gives the bits of
groupgemm.torch's ExpertParallelMoE over as many gloo ranks, through a rank that sends no
tokens and a rank whose experts receive none, in one nnx.jit compile; with a data axis
beside the expert axis it matches the one-device MoE, on auto and explicit meshes, and
with no tokens anywhere every gradient is a full-shape zero; MoE's parameters carry their
sharding, and under nnx.jit on a data x expert mesh (auto or explicit, a batch of one
included), called eagerly there, or inside a caller's shard_map it keeps the one-device
bits, on an auto mesh without gathering anything; without the fused op ExpertParallelMoE
gives the one-device bits, the token gradient included."""

import os

import ep_cases as cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clients import require
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from workers import run_worker

nnx = require("flax.nnx")

import groupgemm.flax as gf  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "ep_layer_worker.py")
RANKS = 2


def mesh_of(axis_type):
    """A mesh builder whose axes are all of ``axis_type`` (Explicit is jax.make_mesh's default)."""
    return lambda shape, names: jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                                              devices=jax.devices("cpu")[:int(np.prod(shape))])


auto_mesh, explicit_mesh = mesh_of(jax.sharding.AxisType.Auto), mesh_of(jax.sharding.AxisType.Explicit)


@pytest.fixture(scope="module")
def torch_ranks(tmp_path_factory):
    """Per rank, {"step/name": array} of groupgemm.torch's ExpertParallelMoE over RANKS gloo
    processes at dispatch's dropless capacity (ep_layer_worker.py)."""
    out = tmp_path_factory.mktemp("ep")
    run_worker(WORKER, RANKS, out, "capacity")
    return [dict(np.load(out / f"rank{rank}.npz")) for rank in range(RANKS)]


def expert_parallel_step(traces):
    @nnx.jit
    def step(layer, x, allowed, dy):
        traces.append(1)

        def loss(layer, x):
            out, dropped = layer(x, allowed)
            return jnp.sum(out * dy), (out, dropped)

        (_, (out, dropped)), (grads, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
        return out, dropped, grads, dx

    return step


def test_expert_parallel_moe_gives_pytorchs_bits_in_one_compile(torch_ranks):
    mesh = Mesh(np.array(jax.devices("cpu")[:RANKS]), ("expert",))
    params = cases.init_params(RANKS)  # the PyTorch layer's parameters (the worker copies them in)
    layer = nnx.eval_shape(lambda: gf.ExpertParallelMoE(RANKS * cases.LOCAL_EXPERTS, cases.HIDDEN, cases.FFN,
                                                        cases.TOP_K, mesh, rngs=nnx.Rngs(0)))
    for path, name in (("router", "router"), ("experts.fc1.weight", "fc1"), ("experts.fc2.weight", "fc2")):
        variable = layer
        for part in path.split("."):
            variable = getattr(variable, part)
        assert variable.shape == params[name].shape
        variable.set_value(jnp.asarray(params[name]))
    state = nnx.state(layer)  # placed by the annotations, as the layer places what it draws
    nnx.update(layer, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
    traces = []
    step = expert_parallel_step(traces)
    for s in range(cases.SAME_SHAPE_STEPS):
        x, dy, allowed = cases.batch(s, RANKS)
        out, dropped, grads, dx = step(layer, jnp.asarray(x), jnp.asarray(allowed), jnp.asarray(dy))
        got = {"out": out, "dx": dx, "fc1": grads["experts"]["fc1"]["weight"][...],
               "fc2": grads["experts"]["fc2"]["weight"][...]}
        for name, value in got.items():  # tokens and experts in rank order
            want = np.concatenate([r[f"{s}/{name}"] for r in torch_ranks])
            assert np.array_equal(np.asarray(value), want), f"step {s} {name}"
        # The replicated router's gradient: the ranks' partial sums added, as JAX's psum adds them.
        router = np.float32(torch_ranks[0][f"{s}/router"]) + np.float32(torch_ranks[1][f"{s}/router"])
        assert np.array_equal(np.asarray(grads["router"][...]), router), f"step {s} router"
        assert np.asarray(dropped).tolist() == [0] * RANKS
        for e in cases.idle_experts(s, RANKS):  # step 2: rank 1's experts receive nothing
            assert not np.asarray(got["fc1"])[e].any() and not np.asarray(got["fc2"])[e].any()
    assert cases.idle_experts(2, RANKS) == list(range(cases.LOCAL_EXPERTS, RANKS * cases.LOCAL_EXPERTS))  # rank 1's
    assert not cases.batch(1, RANKS)[2][:cases.TOKENS_PER_RANK].any()  # step 1: rank 0 sends nothing
    assert len(traces) == 1  # every routing through one compile


@pytest.mark.parametrize("make_mesh", [auto_mesh, explicit_mesh], ids=["auto", "explicit"])
def test_expert_parallel_moe_with_a_data_axis_matches_the_one_device_moe(make_mesh):
    mesh = make_mesh((2, 2), ("data", "expert"))
    layer = gf.ExpertParallelMoE(4, 8, 6, 2, mesh, rngs=nnx.Rngs(3))
    assert layer.experts.fc1.weight[...].sharding.spec == P("expert", None, None)
    single = gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(3))  # the same draws: the same parameters
    x = jnp.asarray(np.random.default_rng(4).standard_normal((16, 8)), jnp.float32)  # 4 blocks of 4 tokens
    allowed = jnp.asarray([True, True, False, True])  # [E]: broadcast to every token

    def expert_parallel_loss(layer, x=x, allowed=allowed):
        out, dropped = layer(x, allowed)
        return jnp.sum(jnp.sin(out)), (out, dropped)

    grads_ep, (out, dropped) = nnx.jit(nnx.grad(expert_parallel_loss, has_aux=True))(layer)
    grads_one, want = nnx.jit(nnx.grad(lambda m: (jnp.sum(jnp.sin(m(x, allowed))), m(x, allowed)),
                                       has_aux=True))(single)
    assert np.asarray(dropped).tolist() == [0] * 4
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    for path in ("router", "experts.fc1.weight", "experts.fc2.weight"):
        parts = path.split(".")
        np.testing.assert_allclose(_leaf(grads_ep, parts), _leaf(grads_one, parts), rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    # No tokens on any device (equal blocks: the one way a JAX device holds none): every
    # parameter still gets its full-shape gradient, all zeros.
    grads_none, (out, _) = nnx.jit(nnx.grad(expert_parallel_loss, has_aux=True))(layer, x=jnp.zeros((0, 8)),
                                                                                  allowed=None)
    assert out.shape == (0, 8)
    for path in ("router", "experts.fc1.weight", "experts.fc2.weight"):
        grad = _leaf(grads_none, path.split("."))
        assert grad.shape == _leaf(nnx.state(layer), path.split(".")).shape and not grad.any(), path


def test_expert_parallel_moe_without_the_fused_op_gives_the_one_device_bits():
    # With fused=False on both (expert-parallelism.md), the output and every gradient but the
    # router's (a sum over devices) are the one-device MoE's bits, the token gradient included,
    # where each device holds 16 tokens or more: on an AVX-512 CPU a row of an input gradient
    # has other bits in a GEMM of fewer rows (the router's, over a device's own tokens; at 6 a
    # device they differed by up to 4.8e-7). 24 is also a multiple of 6, where an AVX2 CPU's
    # float32 kernel gives a row the bits it has at the same place in a longer call.
    mesh = auto_mesh((4,), ("expert",))
    layer = gf.ExpertParallelMoE(8, 16, 12, 2, mesh, fused=False, rngs=nnx.Rngs(5))
    single = gf.MoE(8, 16, 12, 2, fused=False, rngs=nnx.Rngs(5))  # the same draws: the same parameters
    rng = np.random.default_rng(7)
    x, dy = (jnp.asarray(rng.standard_normal((4 * 24, 16)), jnp.float32) for _ in range(2))  # 24 a device

    def grads(model, forward):
        def loss(m, x):
            out = forward(m, x)
            return jnp.sum(out * dy), out

        (_, out), (model_grads, dx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(model, x)
        return out, dx, model_grads

    out, dx, got = grads(layer, lambda m, x: m(x)[0])
    want_out, want_dx, want = grads(single, lambda m, x: m(x))
    assert np.array_equal(np.asarray(out), np.asarray(want_out))
    assert np.array_equal(np.asarray(dx), np.asarray(want_dx))
    for path in ("experts.fc1.weight", "experts.fc2.weight"):
        assert np.array_equal(_leaf(got, path.split(".")), _leaf(want, path.split("."))), path
    np.testing.assert_allclose(_leaf(got, ["router"]), _leaf(want, ["router"]), rtol=1e-5, atol=1e-6)


def _leaf(state, parts):
    for part in parts:
        state = state[part]
    return np.asarray(state[...])


def test_moe_parameters_carry_their_sharding_and_keep_the_one_device_bits_on_a_data_expert_mesh():
    mesh = auto_mesh((2, 2), ("data", "expert"))
    with jax.set_mesh(mesh):
        model = gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model))
    assert specs["experts"]["fc1"]["weight"].get_value() == P("expert", None, None)
    assert specs["router"].get_value() == P(None, None)
    assert model.experts.fc2.weight[...].sharding.spec == P("expert", None, None)
    plain = gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))  # no mesh: annotated, on one device
    assert plain.experts.fc1.weight.get_metadata()["out_sharding"] == ("expert", None, None)

    x = np.random.default_rng(1).standard_normal((2, 6, 8)).astype(np.float32)  # 2 routing groups
    graph, state = nnx.split(model)

    def loss(state, x):  # the output's own bits, and a loss whose cotangent is 2 * out
        out = nnx.merge(graph, state)(x)
        return jnp.sum(out**2), out

    with jax.set_mesh(mesh):
        step = jax.jit(jax.grad(loss, has_aux=True)).lower(state, x).compile()
        grads, out = step(state, x)
    want_grads, want_out = jax.jit(jax.grad(loss, has_aux=True))(nnx.state(plain), x)

    def assert_one_device_bits(grads, out):
        assert np.array_equal(np.asarray(out), np.asarray(want_out))
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            assert np.array_equal(np.asarray(got), np.asarray(want))

    assert_one_device_bits(grads, out)
    assert "all-gather" not in step.as_text()  # each device: its routing group, its experts
    on_one_device = jnp.asarray(x)  # made outside the mesh (inside, it would be made on it)
    with jax.set_mesh(mesh):  # called eagerly: the data axis's constraint still applies
        out = model(on_one_device)
        grads, _ = jax.grad(loss, has_aux=True)(state, on_one_device)
    assert_one_device_bits(grads, out)
    assert out.sharding.spec == P("data")


@pytest.mark.parametrize("groups", [1, 2])
def test_moe_on_an_explicit_mesh_or_inside_shard_map_keeps_the_one_device_bits(groups):
    # An explicit mesh takes its data axis only where it divides the routing groups (decoding's
    # batch of one stays whole); inside a caller's shard_map each device routes its own groups.
    x = np.random.default_rng(2).standard_normal((groups, 6, 8)).astype(np.float32)
    want = gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))(x)
    with jax.set_mesh(explicit_mesh((2, 2), ("data", "expert"))):
        out = nnx.jit(lambda m, x: m(x))(gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0)), x)
    assert np.array_equal(np.asarray(out), np.asarray(want))
    allowed = np.array([True, True, False, True])  # split over the data axis with x
    with jax.set_mesh(explicit_mesh((2, 2), ("data", "expert"))):
        out = nnx.jit(lambda m, x, a: m(x, a))(gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0)), x, allowed)
    assert np.array_equal(np.asarray(out), np.asarray(gf.MoE(4, 8, 6, 2, rngs=nnx.Rngs(0))(x, allowed)))
    if groups % 2:
        return
    graph, state = nnx.split(gf.MoE(4, 8, 6, 2, expert_axis=None, rngs=nnx.Rngs(0)))
    with jax.set_mesh(auto_mesh((2,), ("data",))):
        per_device = jax.shard_map(lambda state, x: nnx.merge(graph, state)(x), in_specs=(P(), P("data")),
                                   out_specs=P("data"))
        out = jax.jit(per_device)(state, x)
    assert np.array_equal(np.asarray(out), np.asarray(want))
