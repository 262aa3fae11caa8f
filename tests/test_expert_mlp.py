"""The fused expert MLP (expert_mlp) in both frameworks: against the float64 NumPy reference,
forward and every gradient, in every dtype; the zero-token cases; bitwise JAX/PyTorch
parity; the composition's bits where the same kernels run; one compile for every routing;
what a gradient keeps; the transformations; the argument checks."""

import dataclasses

import expert_reference as eref
import jax
import jax.numpy as jnp
import jax_frontend
import numpy as np
import pytest
import torch
import torch._dynamo.testing
import torch_frontend
from bits import assert_same_bits
from cases import TOLERANCE, round_to
from jax.test_util import check_grads
from reference import assert_close

import groupgemm.jax as gj
import groupgemm.torch as gt
from groupgemm.jax_ext.expert_mlp import composed_expert_mlp

GRADS = ("tokens", "w_in", "w_out", "probs", "b_in", "b_out")


@dataclasses.dataclass(frozen=True)
class MlpCase:
    name: str
    indices: tuple  # [T][k] global expert ids
    experts: int  # E, the local experts
    activation: str = "swiglu"
    bias: bool = False
    transpose: bool = False
    probs: bool = True
    offset: int | None = None
    offset_dtype: str | None = None  # group_offset given as a one-element array of this dtype, else an int
    hidden: int = 6
    ffn: int = 4  # F; F_in = 2F for swiglu

    @property
    def f_in(self):
        return 2 * self.ffn if self.activation == "swiglu" else self.ffn

    @property
    def shape(self):
        return len(self.indices), len(self.indices[0]) if self.indices else 2


CASES = [
    MlpCase("top2_swiglu", ((1, 0), (2, 1), (0, 2), (1, 1), (0, -1)), 3),
    MlpCase("gelu_bias_transposed", ((3, 0, 1), (2, 3, 1), (0, 1, 2)), 4, "gelu", True, True),
    MlpCase("relu_bias_without_probs", ((0, 1), (1, 1), (1, 0)), 2, "relu", True, probs=False),
    MlpCase("silu_window", ((4, 0), (3, 5), (2, 3), (7, 3)), 2, "silu", True, offset=3),
    MlpCase("idle_experts", ((1, 1), (1, -1), (1, 1)), 4, "swiglu", True, True),
    MlpCase("every_slot_dropped", ((-1, 5), (7, -2)), 3, "swiglu", True, offset=2),
    MlpCase("no_tokens", (), 3, "gelu", True),
    # Expert 0 has 1080 rows: two blocks on the CPU, sharing its weights packed once (the
    # CPU backend packs an expert's weights from 256 rows); expert 1 has 120, read unpacked.
    MlpCase("many_rows", tuple((0, 0 if t % 5 else 1) for t in range(600)), 3, hidden=64, ffn=32),
    # 2700 of 3000 rows on expert 0 (three blocks on the CPU): it runs alone on the threads,
    # its blocks side by side where its GEMMs run on one thread.
    MlpCase("hot_expert", tuple((0,) if t % 10 else (1 + t % 3,) for t in range(3000)), 4, "swiglu", True,
            hidden=32, ffn=16),
    # F over the CPU's column chunk (256, cpu/sigmoid_rows.h): each row's activation in two.
    MlpCase("wide_ffn", tuple((t % 3, (t + 1) % 3) for t in range(12)), 3, hidden=8, ffn=300),
]
BY_NAME = {c.name: c for c in CASES}
DTYPES = ["float32", "bfloat16", "float16", "float64"]


def inputs(case, seed=0):
    """float64 NumPy inputs, weights in the torch layout (w_in [E, F_in, H], w_out [E, H, F])."""
    rng = np.random.default_rng(seed)
    t, k = case.shape
    e, h, f, f_in = case.experts, case.hidden, case.ffn, case.f_in
    return dict(tokens=rng.standard_normal((t, h)), indices=np.asarray(case.indices, np.int32).reshape(t, k),
                probs=rng.uniform(0.1, 1.0, (t, k)) if case.probs else None,
                w_in=rng.standard_normal((e, f_in, h)) / 2, w_out=rng.standard_normal((e, h, f)) / 2,
                b_in=rng.standard_normal((e, f_in)) if case.bias else None,
                b_out=rng.standard_normal((e, h)) if case.bias else None, dout=rng.standard_normal((t, h)))


def group_offset(case, to_array):
    """case.offset as the frameworks get it: a Python int, or to_array of a NumPy array."""
    return case.offset if case.offset_dtype is None else to_array(np.array([case.offset], case.offset_dtype))


def layout(x, case):
    """The weights as the case passes them: torch's layout with transpose, else [E, H, F_in], [E, F, H]."""
    return x if case.transpose else {**x, "w_in": x["w_in"].transpose(0, 2, 1), "w_out": x["w_out"].transpose(0, 2, 1)}


def jax_run(case, x, dtype, fn=gj.expert_mlp, device="cpu"):
    """out and the six gradients (None where absent) of fn in JAX, on `device` ("cpu" or "cuda")."""
    with jax_frontend.precision(dtype):
        x = layout(x, case)
        params = {n: jax_frontend.array(x[n], dtype, device) for n in GRADS if x[n] is not None}
        if "probs" in params:
            params["probs"] = jax_frontend.array(x["probs"], "float32" if dtype != "float64" else dtype, device)
        indices = jax.device_put(jnp.asarray(x["indices"]), next(iter(params["tokens"].devices())))

        def layer(p):
            return fn(p["tokens"], indices, p.get("probs"), p["w_in"], p["w_out"], activation=case.activation,
                      b_in=p.get("b_in"), b_out=p.get("b_out"), group_offset=group_offset(case, jnp.asarray),
                      transpose_rhs=case.transpose)

        out, vjp = jax.vjp(layer, params)
        (grads,) = vjp(jax_frontend.array(x["dout"], dtype, device))
        return out, tuple(grads.get(n) for n in GRADS)


def torch_run(case, x, dtype, device="cpu", want=GRADS):
    """out and the six gradients (None where absent or not in `want`) of
    groupgemm.torch.expert_mlp on `device`."""
    x = layout(x, case)
    params = {n: torch_frontend.array(x[n], dtype, device) for n in GRADS if x[n] is not None}
    if "probs" in params:
        params["probs"] = torch_frontend.array(x["probs"], "float32" if dtype != "float64" else dtype, device)
    wanted = [n for n in params if n in want]
    for name in wanted:
        params[name].requires_grad_()
    offset = group_offset(case, lambda a: torch.from_numpy(a).to(device))
    out = gt.expert_mlp(params["tokens"], torch.from_numpy(x["indices"]).to(device), params.get("probs"),
                        params["w_in"], params["w_out"], activation=case.activation, b_in=params.get("b_in"),
                        b_out=params.get("b_out"), group_offset=offset, transpose_weight=case.transpose)
    grads = torch.autograd.grad(out, [params[n] for n in wanted], torch_frontend.array(x["dout"], dtype, device),
                                allow_unused=True)
    by_name = dict(zip(wanted, grads))
    return out.detach(), tuple(by_name.get(n) for n in GRADS)


RUNS = {"jax": jax_run, "torch": torch_run}


def reference(case, x, dtype):
    rounded = {n: None if v is None or n == "indices" else round_to(v, dtype) for n, v in x.items()}
    if x["probs"] is not None:
        rounded["probs"] = round_to(x["probs"], "float32" if dtype != "float64" else dtype)
    return eref.expert_mlp_and_grads(rounded["tokens"], x["indices"], rounded["probs"], rounded["w_in"],
                                     rounded["w_out"], rounded["b_in"], rounded["b_out"], rounded["dout"],
                                     case.activation, case.offset or 0, round_to=lambda a: round_to(a, dtype))


def idle_experts(case):
    local = eref.window_ids(np.array(case.indices, object).reshape(case.shape), case.offset or 0, case.experts)
    return [e for e in range(case.experts) if not (local == e).any()]


def runs(names, dtypes):
    return [(BY_NAME[n], d) for n in names for d in dtypes]


# Every case in float32, every dtype on three of them. JAX gives PyTorch's bits (the parity
# test below), so the reference holds both frameworks to it.
REFERENCE_RUNS = (runs(BY_NAME, ["float32"]) + runs(["top2_swiglu", "gelu_bias_transposed", "no_tokens"], DTYPES[1:])
                  + runs(["many_rows", "wide_ffn", "hot_expert"], ["bfloat16"]))
PARITY_RUNS = (runs(BY_NAME, ["float32"])
               + runs(["top2_swiglu", "gelu_bias_transposed", "many_rows", "hot_expert"], DTYPES[1:]))


def ids(pairs):
    return [f"{c.name}-{d}" for c, d in pairs]


def assert_matches_the_reference(case, x, dtype):
    """PyTorch's output and gradients against the float64 reference; exact zeros for dropped
    slots' dprobs and idle experts' weight gradients."""
    out, grads = torch_run(case, x, dtype)
    want_out, want_grads = reference(case, x, dtype)
    to_float64 = torch_frontend.to_float64
    assert_close(to_float64(out), want_out, dtype, "out")
    t, k = case.shape
    for name, got, want in zip(GRADS, grads, want_grads):
        if x[name] is None:
            assert got is None, name
            continue
        got = to_float64(got)
        want = layout({**x, name: want}, case)[name] if name in ("w_in", "w_out") else want
        assert_close(got, want, dtype, name)
        if name == "probs":  # a dropped slot's weight: exactly 0
            dropped = eref.window_ids(np.asarray(x["indices"]).reshape(t, k), case.offset or 0, case.experts) < 0
            assert (got[dropped] == 0).all()
        if name in ("w_in", "w_out", "b_in", "b_out"):  # an idle expert: exact zeros, full shape
            assert all((got[e] == 0).all() for e in idle_experts(case))


@pytest.mark.parametrize("case, dtype", REFERENCE_RUNS, ids=ids(REFERENCE_RUNS))
def test_expert_mlp_matches_the_float64_reference_with_exact_zeros(case, dtype):
    assert_matches_the_reference(case, inputs(case), dtype)


# Outputs of 16 MiB and more get huge-page advice before their first write (cpu/huge_pages.h),
# as the grouped GEMMs' do: here h [T, k, F_in] (8192 * 2 * 384 float32 values, 24 MiB: a block
# glibc may serve from its heap), then w_in's gradient (16 * 1024 * 512, 32 MiB: a mapping of its
# own). Their contents must come through it.
LARGE_OUTPUTS = [MlpCase("large_h", tuple((t % 3, (t + 1) % 3) for t in range(8192)), 4, hidden=8, ffn=192),
                 MlpCase("large_w_in_gradient", ((0, 2), (2, 5), (7, 0), (2, 2)), 16, hidden=1024, ffn=256)]


@pytest.mark.parametrize("case", LARGE_OUTPUTS, ids=[c.name for c in LARGE_OUTPUTS])
def test_outputs_advised_huge_pages_match_the_reference(case):
    assert_matches_the_reference(case, inputs(case), "float32")


# Ids and windows past int32, each routed by its value: int64 ids with a Python-int offset
# past int32 (JAX: with x64, on for float64); uint32 ids past int32, which JAX without x64
# (float32) holds in no signed type, with a window straddling int32's maximum, and with one
# below 0 (where 2^32 - 1 is not -1); uint64 ids past int64 with a window ending at int64's
# maximum (they were saturated onto it: routed to its expert).
WIDE_IDS = [("int64", 2**32 + 3, "float64"), ("uint32", 2**31 - 1, "float32"), ("uint32", -1, "float32"),
            ("uint64", 2**63 - 2, "float64")]


@pytest.mark.parametrize("ids_dtype, offset, dtype", WIDE_IDS, ids=[f"{i}-{o}" for i, o, _ in WIDE_IDS])
def test_ids_and_windows_past_int32_route_by_their_values(ids_dtype, offset, dtype):
    steps = np.array([[-1, 0], [1, 2], [0, 1], [2, -1], [1, 1], [0, 3]])
    x = inputs(MlpCase("wide_ids", tuple(map(tuple, steps)), 2, "gelu", True))
    bits = np.iinfo(ids_dtype).bits
    x["indices"] = np.array((offset + steps.astype(object)) % 2**bits).astype(ids_dtype)
    case = MlpCase("wide_ids", tuple(map(tuple, x["indices"].tolist())), 2, "gelu", True, offset=offset)
    assert 0 < (eref.window_ids(x["indices"], offset, case.experts) >= 0).sum() < steps.size  # kept and dropped
    assert_matches_the_reference(case, x, dtype)
    (jax_out, jax_grads), (torch_out, torch_grads) = jax_run(case, x, dtype), torch_run(case, x, dtype)
    for name, a, b in zip(("out", *GRADS), (jax_out, *jax_grads), (torch_out, *torch_grads)):
        assert_same_bits(a, b, name)


# Offset arrays past the signed maximum (device values, so not refused as a static offset
# past it is): uint32 ids in a uint32 window past int32's maximum, which JAX without x64
# holds in no signed type (the offset was saturated onto that maximum: the window moved);
# and ids below a window past int32's (JAX without x64) or int64's maximum, every slot
# dropped (the saturated window held that maximum).
WIDE_OFFSETS = [("uint32", "uint32", 2**31 + 5, "float32"), ("int32", "uint32", 2**31 + 5, "float32"),
                ("int64", "uint64", 2**63 + 5, "float64")]


@pytest.mark.parametrize("ids_dtype, offset_dtype, offset, dtype", WIDE_OFFSETS,
                         ids=[f"{i}-{o}" for i, o, _, _ in WIDE_OFFSETS])
def test_offset_arrays_past_the_signed_maximum_route_by_their_values(ids_dtype, offset_dtype, offset, dtype):
    steps = np.array([[-1, 0], [1, 2], [0, 1], [2, -1], [1, 1], [0, 3]])
    x = inputs(MlpCase("wide_offset", tuple(map(tuple, steps)), 2, "gelu", True))
    top = np.iinfo(ids_dtype).max
    x["indices"] = np.array(np.minimum(offset + steps.astype(object), top - steps.astype(object) % 3)).astype(ids_dtype)
    case = MlpCase("wide_offset", tuple(map(tuple, x["indices"].tolist())), 2, "gelu", True, offset=offset,
                   offset_dtype=offset_dtype)
    kept = (eref.window_ids(x["indices"], offset, case.experts) >= 0).sum()
    assert (0 < kept < steps.size) if offset <= top else kept == 0
    assert_matches_the_reference(case, x, dtype)
    (jax_out, jax_grads), (torch_out, torch_grads) = jax_run(case, x, dtype), torch_run(case, x, dtype)
    for name, a, b in zip(("out", *GRADS), (jax_out, *jax_grads), (torch_out, *torch_grads)):
        assert_same_bits(a, b, name)


@pytest.mark.parametrize("case, dtype", PARITY_RUNS, ids=ids(PARITY_RUNS))
def test_jax_and_torch_expert_mlp_are_bitwise_identical(case, dtype):
    x = inputs(case, seed=1)
    (jax_out, jax_grads), (torch_out, torch_grads) = jax_run(case, x, dtype), torch_run(case, x, dtype)
    assert_same_bits(jax_out, torch_out, "out")
    for name, a, b in zip(GRADS, jax_grads, torch_grads):
        if a is not None:
            assert_same_bits(a, b, name)


# A gradient asked for alone: the backward skips the GEMMs and passes only the others need
# (g without dtokens or the fc1 gradients, fc1's output gradient without dw_out, ...).
SUBSETS = [("tokens",), ("probs",), ("w_out",), ("b_out",), ("w_in", "b_in"), ("probs", "w_out")]
SUBSET_RUNS = [(name, dtype, want) for name, dtype in [("gelu_bias_transposed", "float32"), ("silu_window", "bfloat16"),
                                                       ("many_rows", "bfloat16")]
               for want in SUBSETS if BY_NAME[name].bias or not {"b_in", "b_out"} & set(want)]


@pytest.mark.parametrize("name, dtype, want", SUBSET_RUNS, ids=[f"{n}-{d}-{'+'.join(w)}" for n, d, w in SUBSET_RUNS])
def test_a_subset_of_gradients_has_the_full_backwards_bits(name, dtype, want):
    case = BY_NAME[name]
    x = inputs(case, seed=3)
    _, full = torch_run(case, x, dtype)
    _, alone = torch_run(case, x, dtype, want=want)
    for grad, got, expected in zip(GRADS, alone, full):
        if grad in want:
            assert_same_bits(got, expected, grad)
        else:
            assert got is None, grad


@pytest.mark.parametrize("name, dtype", [("top2_swiglu", "float32"), ("gelu_bias_transposed", "float32"),
                                         ("silu_window", "bfloat16"), ("wide_ffn", "bfloat16")])
def test_fused_output_has_the_compositions_bits(name, dtype):
    # Each expert's rows fit one block: the same library GEMMs on the same rows, the same
    # per-token sum (an expert of several blocks, as many_rows's, may round a block's rows
    # otherwise than the composition's one call on all of them). Its gradients differ in
    # rounding only (fc2's input gradient is probs * (dout @ w_out^T), dprobs comes from the
    # identity, weight gradients add blocks).
    case = BY_NAME[name]
    x = inputs(case, seed=2)
    fused_out, fused_grads = jax_run(case, x, dtype)
    composed_out, composed_grads = jax_run(case, x, dtype, fn=composed_expert_mlp)
    assert_same_bits(fused_out, composed_out, "out")
    if case.bias:  # rows of dout times probs, added in row order: the composition's sum
        assert_same_bits(fused_grads[5], composed_grads[5], "b_out")
    for got, want, grad in zip(fused_grads, composed_grads, GRADS):
        if got is not None:
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                                       rtol=0, atol=30 * TOLERANCE[dtype] * max(1.0, np.abs(want).max()), err_msg=grad)


def test_one_jit_compile_and_one_torch_graph_serve_every_routing():
    case = BY_NAME["gelu_bias_transposed"]
    x = inputs(case)
    routings = [x["indices"], x["indices"][::-1].copy(), np.full_like(x["indices"], -1), np.zeros_like(x["indices"])]

    def loss(tokens, indices, w_in, w_out):
        return (gj.expert_mlp(tokens, indices, None, w_in, w_out, activation="gelu", transpose_rhs=True) ** 2).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 2, 3)))
    args = [jnp.asarray(x[n], jnp.float32) for n in ("tokens", "w_in", "w_out")]
    for indices in routings:
        step(args[0], jnp.asarray(indices), *args[1:])
    assert step._cache_size() == 1

    def torch_layer(tokens, indices, w_in, w_out):
        return gt.expert_mlp(tokens, indices, None, w_in, w_out, activation="gelu", transpose_weight=True)

    torch._dynamo.reset()  # AOTAutograd traces the op's fake kernels and derivatives; Inductor adds nothing here
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(torch_layer, backend=counter, fullgraph=True)
    tensors = [torch.tensor(x[n], dtype=torch.float32, requires_grad=True) for n in ("tokens", "w_in", "w_out")]
    for indices in routings:
        results = []
        for layer in (compiled, torch_layer):
            out = layer(tensors[0], torch.from_numpy(indices), *tensors[1:])
            results.append((out, *torch.autograd.grad((out ** 2).sum(), tensors)))
        for a, b in zip(*results):
            assert_same_bits(a, b, "compiled")
    assert counter.frame_count == 1


def test_a_gradient_keeps_h_and_no_token_rows():
    # tokens [T, H] and h [T, k, F_in] (with the inputs and the integer routing); never a
    # [T * k, H] array (permuted tokens, expert outputs) nor the activation.
    case = MlpCase("kept", tuple((i % 3, (i + 1) % 3) for i in range(16)), 3, hidden=32, ffn=4)
    x = layout(inputs(case), case)
    t, k = case.shape
    rows = (t * k, case.hidden)
    args = [jnp.asarray(x[n], jnp.float32) for n in ("tokens", "probs", "w_in", "w_out")]

    def residual_shapes(fn):  # what jax.vjp's backward closes over
        _, backward = jax.vjp(lambda *a: fn(a[0], x["indices"], *a[1:]), *args)
        return [leaf.shape for leaf in jax.tree_util.tree_leaves(backward)]

    fused = residual_shapes(gj.expert_mlp)
    assert (t, k, case.f_in) in fused and rows not in fused and (t * k, case.ffn) not in fused
    assert rows in residual_shapes(composed_expert_mlp)  # the composition keeps them

    saved = []
    tensors = [torch.tensor(x[n], dtype=torch.float32, requires_grad=True) for n in ("tokens", "probs", "w_in",
                                                                                      "w_out")]
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(tuple(s.shape)) or s, lambda s: s):
        gt.expert_mlp(tensors[0], torch.from_numpy(x["indices"]), *tensors[1:])
    assert (t, k, case.f_in) in saved and rows not in saved and (t * k, case.ffn) not in saved


@pytest.mark.parametrize("name, order, modes", [("silu_window", 2, ["rev"]), ("top2_swiglu", 1, ["fwd", "rev"])])
def test_expert_mlp_passes_check_grads(name, order, modes):
    case = BY_NAME[name]
    x = layout(inputs(case), case)
    names = [n for n in ("tokens", "probs", "w_in", "w_out", "b_in", "b_out") if x[n] is not None]
    with jax_frontend.x64():

        def layer(*params):
            p = dict(zip(names, params))
            return gj.expert_mlp(p["tokens"], x["indices"], p["probs"], p["w_in"], p["w_out"],
                                 activation=case.activation, b_in=p.get("b_in"), b_out=p.get("b_out"),
                                 group_offset=case.offset)

        check_grads(jax.jit(layer), [jnp.asarray(x[n]) for n in names], order=order, modes=modes)


def test_vmap_of_expert_mlp_and_its_gradient_equals_each_entry_bitwise():
    case = BY_NAME["top2_swiglu"]
    x = layout(inputs(case), case)
    tokens = jnp.stack([jnp.asarray(x["tokens"], jnp.float32), -jnp.asarray(x["tokens"], jnp.float32)])
    w_in, w_out = (jnp.asarray(x[n], jnp.float32) for n in ("w_in", "w_out"))
    step = jax.value_and_grad(lambda t, w: gj.expert_mlp(t, x["indices"], None, w, w_out).sum(), argnums=(0, 1))
    values, (dtokens, dw_in) = jax.vmap(step, in_axes=(0, None))(tokens, w_in)
    for i in range(2):
        value, (want_dtokens, want_dw_in) = step(tokens[i], w_in)
        assert_same_bits(values[i], value, "value")
        assert_same_bits(dtokens[i], want_dtokens, "dtokens")
        assert_same_bits(dw_in[i], want_dw_in, "dw_in")


def test_torch_func_per_entry_gradients_equal_each_entry_and_the_jacobian_the_reference():
    # vmap of grad and jacrev batch the backward op, whose `want` flags are a list argument.
    case = BY_NAME["top2_swiglu"]
    x = inputs(case)
    ids = torch.from_numpy(x["indices"])
    tokens, probs, w_in, w_out = (torch.from_numpy(x[n]) for n in ("tokens", "probs", "w_in", "w_out"))
    loss = lambda w, t: gt.expert_mlp(t, ids, probs, w, w_out, transpose_weight=True).sum()  # noqa: E731
    batch = torch.stack([tokens, -tokens, torch.zeros_like(tokens)])
    per_entry = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w_in, batch)
    for entry, got in zip(batch, per_entry):
        assert_same_bits(got, torch.func.grad(loss)(w_in, entry), "dw_in")
    jacobian = torch.func.jacrev(lambda t: gt.expert_mlp(t, ids, probs, w_in, w_out, transpose_weight=True))(tokens)
    for j, row in enumerate(jacobian.reshape(tokens.numel(), *tokens.shape)):  # d out[j] / d tokens
        unit = np.zeros(tokens.numel())
        unit[j] = 1
        _, (want, *_) = eref.expert_mlp_and_grads(x["tokens"], x["indices"], x["probs"], x["w_in"], x["w_out"], None,
                                                  None, unit.reshape(tokens.shape), case.activation)
        np.testing.assert_allclose(row, want, rtol=1e-12, atol=1e-12)


def test_vmap_over_an_empty_batch_differentiates_to_zeros():
    # A batch of 0 routing problems: its gradients and tangents are empty or exact zeros
    # (reshaping the empty batch with -1 divided by zero).
    w_in, w_out = jnp.ones((2, 3, 4)), jnp.ones((2, 2, 3))
    x, e, p = jnp.ones((0, 5, 3)), jnp.zeros((0, 5, 1), jnp.int32), jnp.ones((0, 5, 1))

    def loss(w_in, x, p):
        return jax.vmap(lambda x, e, p: gj.expert_mlp(x, e, p, w_in, w_out))(x, e, p).sum()

    dw_in, dx, dp = jax.grad(loss, argnums=(0, 1, 2))(w_in, x, p)
    assert dw_in.shape == w_in.shape and (dw_in == 0).all() and dx.shape == x.shape and dp.shape == p.shape
    _, tangent = jax.jvp(lambda w: jax.vmap(lambda x, e: gj.expert_mlp(x, e, None, w, w_out))(x, e), (w_in,), (w_in,))
    assert tangent.shape == x.shape


def test_forward_mode_matches_reverse_mode_in_both_frameworks():
    case = BY_NAME["gelu_bias_transposed"]
    x = layout(inputs(case), case)
    names = ("tokens", "probs", "w_in", "w_out", "b_in", "b_out")
    rng = np.random.default_rng(4)
    tangents = [rng.standard_normal(np.shape(x[n])) for n in names]
    with jax_frontend.x64():
        primals = [jnp.asarray(x[n]) for n in names]

        def layer(tokens, probs, w_in, w_out, b_in, b_out):
            return gj.expert_mlp(tokens, x["indices"], probs, w_in, w_out, activation="gelu", b_in=b_in, b_out=b_out,
                                 transpose_rhs=True)

        _, jvp_out = jax.jvp(layer, primals, [jnp.asarray(t) for t in tangents])
        out, vjp = jax.vjp(layer, *primals)
        cotangent = np.asarray(rng.standard_normal(out.shape))
        grads = vjp(jnp.asarray(cotangent))
        assert np.isclose(np.vdot(jvp_out, cotangent), sum(np.vdot(g, t) for g, t in zip(grads, tangents)))

    tensors = [torch.tensor(x[n]) for n in names]

    def torch_layer(tokens, probs, w_in, w_out, b_in, b_out):
        return gt.expert_mlp(tokens, torch.from_numpy(x["indices"]), probs, w_in, w_out, activation="gelu",
                             b_in=b_in, b_out=b_out, transpose_weight=True)

    _, torch_jvp = torch.func.jvp(torch_layer, tuple(tensors), tuple(torch.tensor(t) for t in tangents))
    np.testing.assert_allclose(torch_jvp.numpy(), np.asarray(jvp_out), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("framework", RUNS)
def test_bad_arguments_are_refused_naming_them(framework):
    x = inputs(BY_NAME["top2_swiglu"])
    fw = {"jax": (gj.expert_mlp, jnp.asarray), "torch": (gt.expert_mlp, torch.tensor)}
    fn, array = fw[framework]
    tokens, indices = array(x["tokens"].astype(np.float32)), array(x["indices"])
    w_in, w_out = (array(x[n].transpose(0, 2, 1).astype(np.float32)) for n in ("w_in", "w_out"))
    with pytest.raises(ValueError, match="expert_mlp: expert_indices has 4 rows but tokens has 5"):
        fn(tokens, indices[:4], None, w_in, w_out)
    with pytest.raises(TypeError, match="expert_mlp: probs must be float32, got float16"):
        fn(tokens, indices, array(x["probs"].astype(np.float16)), w_in, w_out)
    with pytest.raises(ValueError, match=r"expert_mlp: w_in \(3, 5, 8\) takes inputs of width 5, but tokens has "
                                         r"width 6 \(shape \(5, 6\)\)"):
        fn(tokens, indices, None, w_in[:, 1:], w_out)
    with pytest.raises(ValueError, match="expert_mlp: b_out must have shape"):
        fn(tokens, indices, None, w_in, w_out, b_out=array(np.zeros((3, 5), np.float32)))
    with pytest.raises(TypeError, match="expert_mlp: expert_indices must be an integer array"):
        fn(tokens, array(x["indices"].astype(np.float32)), None, w_in, w_out)
    with pytest.raises(NotImplementedError, match="fp8"):
        fn(tokens, indices, None, w_in, w_out, fp8="rowwise")
    with pytest.raises(ValueError, match=r"expert_mlp: w_in must be 3-D \[E, H, F_in\], got shape \(8,\)"):
        fn(tokens, indices, None, w_in[0, 0], w_out)  # its rank before its expert count
    kind = {"jax": "an array", "torch": "a torch.Tensor"}[framework]
    with pytest.raises(TypeError, match=f"expert_mlp: w_out must be {kind}, got NoneType"):
        fn(tokens, indices, None, w_in, None)
    flag = {"jax": "transpose_rhs", "torch": "transpose_weight"}[framework]
    with pytest.raises(TypeError, match=f"expert_mlp: {flag} must be a bool, got 'False'"):  # truthy: True
        fn(tokens, indices, None, w_in, w_out, **{flag: "False"})
    largest = {"jax": 2**31 - 1, "torch": 2**63 - 1}[framework]  # the largest id (JAX without x64: int32)
    with pytest.raises(ValueError, match=f"expert_mlp: group_offset = {largest + 1} exceeds {largest}"):
        fn(tokens, indices, None, w_in, w_out, group_offset=largest + 1)
    if framework == "torch":  # a window past int64's maximum (JAX: with x64)
        with pytest.raises(ValueError, match=f"expert_mlp: the window of group_offset = {largest - 1} and 3 experts "
                                             f"holds ids past {largest}, which no int64 holds"):
            fn(tokens, indices, None, w_in, w_out, group_offset=largest - 1)


@pytest.mark.parametrize("framework", RUNS)
def test_the_composition_refuses_what_the_fused_op_refuses(framework):
    # fused=False, FP8 and main_grad layers run the composition: float ids were truncated
    # there (-0.5 routed to expert 0).
    x = inputs(BY_NAME["top2_swiglu"])
    tokens, indices = x["tokens"].astype(np.float32), x["indices"]
    if framework == "jax":
        w_in, w_out = (jnp.asarray(x[n].transpose(0, 2, 1), jnp.float32) for n in ("w_in", "w_out"))
        composed = lambda t, i, p: composed_expert_mlp(t, i, p, w_in, w_out)  # noqa: E731
        array = jnp.asarray
    else:
        composed = gt.GroupedMLP(3, 6, 4, fused=False).forward_routed
        array = torch.tensor
    with pytest.raises(TypeError, match="expert_mlp: expert_indices must be an integer array, got float32"):
        composed(array(tokens), array(indices.astype(np.float32) - 0.5), None)
    with pytest.raises(ValueError, match="expert_mlp: expert_indices has 4 rows but tokens has 5"):
        composed(array(tokens), array(indices[:4]), None)
    with pytest.raises(ValueError, match=r"expert_mlp: probs must have shape \(5, 2\)"):
        composed(array(tokens), array(indices), array(np.ones((5, 3), np.float32)))


def test_expert_mlp_runs_each_devices_tokens_through_its_experts_on_a_data_by_expert_mesh():
    # Tokens (and their routing) over data, experts over expert: each device's forward and
    # backward see its T / 2 tokens and E / 2 experts (group_offset shifted to its window);
    # the values equal the unsharded call's.
    from hlo import compiled_text, custom_calls
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    case = MlpCase("mesh", tuple((i % 4, (3 * i + 1) % 4) for i in range(8)), 4, "swiglu", True, True)
    x = layout(inputs(case), case)
    names = ("tokens", "probs", "w_in", "w_out", "b_in", "b_out")
    mesh = jax.make_mesh((2, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    specs = {"tokens": P("data"), "probs": P("data"), "w_in": P("expert"), "w_out": P("expert"),
             "b_in": P("expert"), "b_out": P("expert")}
    args = [jax.device_put(jnp.asarray(x[n], jnp.float32), NamedSharding(mesh, specs[n])) for n in names]
    indices = jax.device_put(jnp.asarray(x["indices"]), NamedSharding(mesh, P("data")))
    dout = jnp.asarray(x["dout"], jnp.float32)

    def loss(indices, tokens, probs, w_in, w_out, b_in, b_out):
        out = gj.expert_mlp(tokens, indices, probs, w_in, w_out, b_in=b_in, b_out=b_out, transpose_rhs=True)
        return jnp.sum(out * dout)

    step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5, 6)))
    value, grads = step(indices, *args)
    want_value, want_grads = step(jnp.asarray(x["indices"]), *(jnp.asarray(x[n], jnp.float32) for n in names))
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want, name in zip(grads, want_grads, names):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
    text = compiled_text(step, indices, *args)
    t, k = case.shape
    for target in ("groupgemm_expert_mlp", "groupgemm_expert_mlp_backward"):
        calls = custom_calls(text, target)
        assert calls and all((t // 2, k) in operands and (2, case.f_in, case.hidden) in operands
                             for _, operands in calls), (target, calls)


def test_moe_layer_gives_the_same_output_fused_or_composed_and_close_gradients():
    # moe_layer over 4 devices, one of them without tokens: the received rows through
    # expert_mlp (the CPU's default) or through permute, grouped_mlp and unpermute.
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(5)
    devices, e, h, f, t = 4, 8, 8, 4, 6
    params = {"router": jnp.asarray(rng.standard_normal((h, e)), jnp.float32),
              "w_in": jnp.asarray(rng.standard_normal((e, h, 2 * f)) / 3, jnp.float32),
              "w_out": jnp.asarray(rng.standard_normal((e, f, h)) / 3, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((devices * t, h)), jnp.float32)
    mesh = jax.make_mesh((devices,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    allowed = jnp.asarray(np.arange(devices * t) >= t)[:, None]  # device 0's tokens go nowhere

    def loss(params, x, allowed, fused):
        def local(params, x, allowed):
            out, _ = gj.moe_layer(params, x, num_experts=e, top_k=2, axis_name="ep", capacity=2 * t,
                                  allowed=allowed, fused=fused)
            return out

        specs = ({"router": P(), "w_in": P("ep"), "w_out": P("ep")}, P("ep"), P("ep"))
        out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("ep"))(params, x, allowed)
        return jnp.sum(out ** 2), out

    results = [jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=3)(params, x, allowed, fused)
               for fused in (True, False)]
    (_, fused_out), fused_grads = results[0]
    (_, composed_out), composed_grads = results[1]
    assert_same_bits(fused_out, composed_out, "out")
    assert (np.asarray(fused_out)[:t] == 0).all()
    for name in params:
        np.testing.assert_allclose(fused_grads[name], composed_grads[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("fp8", [None, "rowwise"])
def test_grouped_mlp_forward_routed_fuses_by_default_on_the_cpu(fp8):
    torch.manual_seed(0)
    experts = gt.GroupedMLP(3, 8, 4, bias=True, fp8=fp8)
    composed = gt.GroupedMLP(3, 8, 4, bias=True, fp8=fp8, fused=False)
    composed.load_state_dict(experts.state_dict())
    tokens = torch.randn(5, 8, requires_grad=True)
    indices = torch.tensor([[4, 2], [3, 3], [2, 9], [-1, 4], [3, 2]])  # global ids; the module holds 2, 3 and 4
    probs = torch.rand(5, 2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(tuple(s.shape)) or s, lambda s: s):
        outs = [m.forward_routed(tokens, indices, probs, group_offset=2) for m in (experts, composed)]
    assert ((5, 2, 8) in saved) == (fp8 is None)  # the fused op keeps h [T, k, F_in]; FP8 runs the composition
    grads = [torch.autograd.grad(out.square().sum(), [tokens, *m.parameters()]) for out, m in zip(outs,
                                                                                                (experts, composed))]
    if fp8 is None:
        assert_same_bits(outs[0], outs[1], "out")
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0 if fp8 is None else 1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="GroupedMLP: fused=True asks for the fused expert MLP, which does not run "
                                         "fp8='rowwise'"):  # refused when built, not at the first call
        gt.GroupedMLP(3, 8, 4, fp8="rowwise", fused=True)
    with pytest.raises(TypeError, match="GroupedMLP: fused must be None, True or False, got 'yes'"):
        gt.GroupedMLP(3, 8, 4, fused="yes")
