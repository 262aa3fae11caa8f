"""Expert parallelism given what it cannot run: every rank gets a clear error naming the
caller's function and argument, and nothing aborts, hangs or answers wrongly. PyTorch over
two gloo processes (helpers/ep_checks_worker.py, under a timeout, so a hang fails); JAX
inside shard_map over four CPU devices."""

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from workers import run_worker

import groupgemm.jax as gj

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "ep_checks_worker.py")
DEVICES, E, H, K = 4, 8, 4, 2


@pytest.fixture(scope="module")
def torch_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_checks")
    run_worker(WORKER, out)
    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


DISAGREEMENTS = {
    "num_experts": "ValueError: dispatch: the ranks of the expert-parallel group disagree on num_experts "
                   "(rank 0 has 4, rank 1 has 2)",
    "capacity": "ValueError: dispatch: the ranks of the expert-parallel group disagree on capacity "
                "(rank 0 has 4, rank 1 has 8)",
    "mode": "ValueError: dispatch: the ranks of the expert-parallel group disagree on capacity "
            "(rank 0 has None, rank 1 has 8)",
    "hidden_size": "ValueError: dispatch: the ranks of the expert-parallel group disagree on the hidden size H "
                   "(rank 0 has 8, rank 1 has 6)",
    "dropless_hidden_size": "ValueError: dispatch: the ranks of the expert-parallel group disagree on the hidden "
                            "size H (rank 0 has 8, rank 1 has 6)",
    "dropless_num_experts": "ValueError: dispatch: the ranks of the expert-parallel group disagree on num_experts "
                            "(rank 0 has 4, rank 1 has 2)",
    "dtype": "ValueError: dispatch: the ranks of the expert-parallel group disagree on the dtype "
             "(rank 0 has float32, rank 1 has float64)",
}


@pytest.mark.parametrize("case", sorted(DISAGREEMENTS))
def test_torch_ranks_that_disagree_each_raise_naming_the_argument_and_every_value(torch_ranks, case):
    for rank in torch_ranks:
        assert rank[case].startswith(DISAGREEMENTS[case]), rank[case]


def test_torch_group_works_after_refusals_and_checks_a_configuration_once(torch_ranks):
    for rank in torch_ranks:
        assert rank["agreed_after_errors"] == "ok"
        assert rank["gathers_for_an_agreed_configuration"] == 0


@pytest.mark.parametrize("case, message", [
    ("combine_one_row_short", "ValueError: combine: expert_output has 19 rows, but dispatch gave this plan 20 rows"),
    ("combine_one_row_over", "ValueError: combine: expert_output has 21 rows, but dispatch gave this plan 20 rows"),
    ("dispatch_probs_transposed", "ValueError: dispatch_probs: probs must have shape (5, 2), got (2, 5)"),
    ("combine_probs_transposed", "ValueError: combine: probs must have shape (5, 2), got (2, 5)"),
    ("indices_rows", "ValueError: dispatch: expert_indices has 6 rows but tokens has 5"),
])
def test_torch_wrong_shapes_are_refused_in_the_callers_terms(torch_ranks, case, message):
    for rank in torch_ranks:
        assert rank[case].startswith(message), rank[case]


def test_torch_a_group_without_the_calling_rank_is_refused(torch_ranks):
    assert torch_ranks[0]["outside_group"] == "ok"  # rank 0 made no call
    assert torch_ranks[1]["outside_group"].startswith(
        "ValueError: dispatch: this process (global rank 1) is not a member of group")


def test_torch_dropless_mode_under_fullgraph_compile_says_to_compile_capacity_mode(torch_ranks):
    for rank in torch_ranks:
        assert "dispatch: dropless mode (capacity=None) copies the token counts to the host" in rank[
            "dropless_compiled"]
        assert "compile capacity mode" in rank["dropless_compiled"]


# ---- JAX ----------------------------------------------------------------------------------


def on_devices(fn, *args, out_specs):
    mesh = Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("ep",))
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(P("ep") for _ in args), out_specs=out_specs)(*args)


def traced_on_devices(fn, *args, out_specs):
    """Traced only: the checks run at trace time, so nothing needs compiling."""
    return jax.eval_shape(lambda *a: on_devices(fn, *a, out_specs=out_specs), *args)


def routed(tokens_per_device):
    rng = np.random.default_rng(0)
    t = DEVICES * tokens_per_device
    return (jnp.asarray(rng.standard_normal((t, H)), jnp.float32),
            jnp.asarray(rng.integers(0, E, (t, K)), jnp.int32))


@pytest.mark.parametrize("call", ["dispatch", "moe_layer"])
def test_jax_capacity_none_is_refused_saying_capacity_is_the_only_mode(call):
    x, experts = routed(3)
    params = {"router": jnp.zeros((H, E)), "w_in": jnp.zeros((E // DEVICES, H, 2 * H)),
              "w_out": jnp.zeros((E // DEVICES, H, H))}
    run = {"dispatch": lambda x, e: gj.dispatch(x, e, E, axis_name="ep", capacity=None)[0],
           "moe_layer": lambda x, e: gj.moe_layer(params, x, num_experts=E, top_k=K, axis_name="ep",
                                                  capacity=None)[0]}[call]
    with pytest.raises(ValueError, match=f"{call}: capacity must be a positive int .*got None: capacity is the "
                                         "only mode here"):
        traced_on_devices(run, x, experts, out_specs=P("ep"))


@pytest.mark.parametrize("option, value", [("fused", 1), ("renormalize", "yes")])
def test_jax_moe_layer_refuses_an_option_that_is_not_a_bool(option, value):
    x, experts = routed(3)
    params = {"router": jnp.zeros((H, E)), "w_in": jnp.zeros((E // DEVICES, H, 2 * H)),
              "w_out": jnp.zeros((E // DEVICES, H, H))}
    with pytest.raises(TypeError, match=f"moe_layer: {option} must be None, True or False, got {value!r}"):
        traced_on_devices(lambda x, e: gj.moe_layer(params, x, num_experts=E, top_k=K, axis_name="ep", capacity=6,
                                                    **{option: value})[0], x, experts, out_specs=P("ep"))


@pytest.mark.parametrize("params, got", [({"router": jnp.zeros((H, E))}, r"keys \['router'\]"),
                                         (None, "NoneType")])
def test_jax_moe_layer_refuses_params_without_its_three_arrays(params, got):
    x, experts = routed(3)
    with pytest.raises(TypeError, match=f"moe_layer: params must be a dict holding 'router', 'w_in' and 'w_out', "
                                        f"got {got}"):
        traced_on_devices(lambda x, e: gj.moe_layer(params, x, num_experts=E, top_k=K, axis_name="ep",
                                                    capacity=6)[0], x, experts, out_specs=P("ep"))


LAYER_PARAMS = {"router": ((H, E), P()), "w_in": ((E, H, 2 * H), P("ep")), "w_out": ((E, H, H), P("ep"))}
BAD_LAYER_PARAMS = {  # name: (replaced params' (shape, spec), moe_layer's other arguments, the error, its message)
    "a router of more experts (every slot would be dropped)": (
        {"router": ((H, E + 4), P())}, {}, ValueError, r"params\['router'\] has shape \(4, 12\): 12 experts, but "
                                                        "num_experts is 8"),
    "every expert on every device": (
        {"w_in": ((E, H, 2 * H), P()), "w_out": ((E, H, H), P())}, {}, ValueError,
        r"params\['w_in'\] holds 8 experts .*, but each device of axis 'ep' holds num_experts / devices = 2"),
    "a router of another dtype": ({"router": ((H, E), P(), jnp.bfloat16)}, {}, TypeError,
                                  r"params\['router'\] dtype bfloat16 differs from x dtype float32"),
    "an expert output of another width": ({"w_out": ((E, H, H // 2), P("ep"))}, {}, ValueError,
                                          r"params\['w_out'\] must have shape \(2, 4, 4\), got \(2, 4, 2\)"),
    "experts of another dtype": ({"w_in": ((E, H, 2 * H), P("ep"), jnp.bfloat16)}, {}, TypeError,
                                 r"params\['w_in'\] dtype bfloat16 differs from x dtype float32"),
    "the torch layout without transpose_rhs": ({"w_in": ((E, 2 * H, H), P("ep"))}, {}, ValueError,
                                               r"params\['w_in'\] \(2, 8, 4\) takes inputs of width 8, but x has "
                                               r"width 4"),
    "top_k above num_experts": ({}, {"top_k": E + 1}, ValueError, "top_k = 9 exceeds 8"),
    "allowed of floats": ({}, {"allowed": jnp.ones(E)}, TypeError, "allowed must hold booleans"),
}


@pytest.mark.parametrize("case", list(BAD_LAYER_PARAMS))
def test_jax_moe_layer_refuses_params_and_arguments_that_do_not_fit_naming_them(case):
    replaced, options, error, message = BAD_LAYER_PARAMS[case]
    layout = {**LAYER_PARAMS, **replaced}
    params = {name: jnp.zeros(spec[0], *spec[2:]) for name, spec in layout.items()}
    specs = {name: spec[1] for name, spec in layout.items()}
    x, _ = routed(3)
    mesh = Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("ep",))
    call = jax.shard_map(lambda p, x: gj.moe_layer(p, x, **{"num_experts": E, "top_k": K, "axis_name": "ep",
                                                            "capacity": 6, **options})[0],
                         mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
    with pytest.raises(error, match=f"moe_layer: {message}"):
        jax.eval_shape(call, params, x)


def test_jax_combine_refuses_an_expert_output_with_a_row_too_few_or_too_many():
    x, experts = routed(3)
    for extra in (-1, 1):
        def step(x, e):
            expert_input, _, plan = gj.dispatch(x, e, E, axis_name="ep", capacity=6)
            rows = expert_input.shape[0] + extra
            return gj.combine(jnp.zeros((rows, H)), plan)

        with pytest.raises(ValueError, match=f"combine: expert_output has {24 + extra} rows, but dispatch gave this "
                                             "plan 24 rows"):
            traced_on_devices(step, x, experts, out_specs=P("ep"))


def test_jax_wrong_shapes_are_refused_in_the_callers_terms():
    x, experts = routed(3)
    with pytest.raises(ValueError, match="dispatch: expert_indices has 2 rows but tokens has 3"):
        traced_on_devices(lambda x, e: gj.dispatch(x, e[:2], E, axis_name="ep", capacity=6)[0], x, experts,
                   out_specs=P("ep"))

    def transposed_probs(x, e):
        expert_input, _, plan = gj.dispatch(x, e, E, axis_name="ep", capacity=6)
        return gj.combine(expert_input, plan, jnp.ones((K, x.shape[0])))

    with pytest.raises(ValueError, match=r"combine: probs must have shape \(3, 2\), got \(2, 3\)"):
        traced_on_devices(transposed_probs, x, experts, out_specs=P("ep"))


def test_jax_dispatch_with_no_tokens_on_any_device_returns_zero_group_sizes_under_jit():
    x, experts = routed(0)
    sizes = jax.jit(lambda x, e: on_devices(lambda x, e: gj.dispatch(x, e, E, axis_name="ep", capacity=1)[1],
                                            x, e, out_specs=P("ep")))(x, experts)
    assert sizes.shape == (E,) and (np.asarray(sizes) == 0).all()


def test_jax_dispatch_and_combine_with_no_tokens_on_any_device_run_in_an_unjitted_shard_map():
    # Each op of an unjitted shard_map is compiled on its own: here every operand of
    # several (permute, combine's unpermutes and their transposes) is empty.
    x, experts = routed(0)
    probs = jnp.zeros(experts.shape)

    def exchange(x, e, p):
        expert_input, _, plan = gj.dispatch(x, e, E, axis_name="ep", capacity=1)
        return gj.combine(expert_input * 2, plan, p)

    out, grad = jax.value_and_grad(lambda x: on_devices(exchange, x, experts, probs, out_specs=P("ep")).sum())(x)
    assert out == 0 and grad.shape == x.shape == (0, H)


def test_jax_permute_of_no_slots_gives_permutes_results_and_gradients():
    tokens = jnp.ones((3, H))
    permuted, sizes, row_map = gj.permute(tokens, jnp.zeros((3, 0), jnp.int32), E)
    assert permuted.shape == (0, H) and row_map.shape == (3, 0) and sizes.shape == (E,) and not sizes.any()
    grad = jax.grad(lambda t: gj.permute(t, jnp.zeros((3, 0), jnp.int32), E)[0].sum())(tokens)
    assert grad.shape == tokens.shape and not grad.any()


def test_jax_calls_without_data_give_the_cores_results_inside_an_unjitted_shard_map():
    # Every operand empty, a result not: the values the core writes (PyTorch's), made
    # without a custom call, which XLA's partitioner refuses to place in a shard_map whose
    # operands are all empty.
    import torch

    import groupgemm.torch as gt

    mesh = Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("ep",))
    rows = jax.shard_map(lambda x: gj.quantize_fp8(x, "rowwise")[1], mesh=mesh, in_specs=P("ep"),
                         out_specs=P("ep"))(jnp.zeros((DEVICES * 2, 0)))
    np.testing.assert_array_equal(np.asarray(rows), gt.quantize_fp8(torch.zeros(DEVICES * 2, 0), "rowwise")[1])
    out = jax.shard_map(lambda x, r: gj.unpermute(x, r), mesh=mesh, in_specs=(P(), P("ep")), out_specs=P("ep"))(
        jnp.zeros((0, H)), jnp.zeros((DEVICES * 3, 0), jnp.int32))
    assert out.shape == (DEVICES * 3, H) and not np.asarray(out).any()


@pytest.mark.parametrize("framework, call", [("torch", "combine"), ("torch", "dispatch_probs"), ("jax", "combine")])
@pytest.mark.parametrize("plan", [None, {}, ("rows", "map")])
def test_a_plan_that_dispatch_did_not_return_is_refused_naming_it(framework, call, plan):
    ones = np.ones((4, 2), np.float32)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        operand, module = torch.from_numpy(ones), importlib.import_module("groupgemm.torch")
    else:
        operand, module = jnp.asarray(ones), gj
    with pytest.raises(TypeError, match=f"{call}: plan must be the DispatchPlan that dispatch returned, got "
                                        f"{type(plan).__name__}"):
        getattr(module, call)(operand, plan)
