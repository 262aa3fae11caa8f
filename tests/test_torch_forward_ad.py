"""Forward-mode AD and the torch.func transforms through groupgemm.torch: tangents equal the
float64 reference on the case table (padding rows exactly 0), never a silent zero; grad,
jacrev, jacfwd, vmap and hessian agree with reverse mode and with dense references."""

import warnings

import numpy as np
import pytest
import reference as ref
import torch
import torch.autograd.forward_ad as fwAD
from cases import CASE_IDS, CASES, VARIANT_IDS, VARIANTS, case, inputs

import groupgemm.torch as gt

F64 = torch.float64
# torch's forward AD loads its jvp decompositions through torch.jit.script on first use.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def _t(a, dtype=F64):
    return torch.tensor(np.asarray(a), dtype=dtype)


def _problem(c, transpose, dtype=F64):
    """Primals and tangents (a second draw of the case's inputs) of a case, weight stored
    [G, N, K] when transposed."""
    x, t = inputs(c), inputs(c, seed=1)
    layout = (lambda w: w.transpose(0, 2, 1)) if transpose else (lambda w: w)
    primals = (_t(x["lhs"], dtype), _t(layout(x["rhs"]), dtype), _t(x["bias"], dtype))
    tangents = (_t(t["lhs"], dtype), _t(layout(t["rhs"]), dtype), _t(t["bias"], dtype))
    offset = None if c.group_offset is None else torch.tensor(c.group_offset)
    return primals, tangents, torch.from_numpy(x["group_sizes"]), offset


def _reference_tangent(c, primals, tangents, with_bias, transpose, which=("input", "weight", "bias")):
    x, w, _ = (p.numpy() for p in primals)
    tx, tw, tb = (t.numpy() for t in tangents)
    sizes, off = inputs(c)["group_sizes"], c.offset
    want = np.zeros((c.m, c.n))
    if "input" in which:
        want += ref.grouped_matmul(tx, w, sizes, None, transpose, off)
    if "weight" in which:
        want += ref.grouped_matmul(x, tw, sizes, None, transpose, off)
    if with_bias and "bias" in which:
        want += ref.grouped_matmul(np.zeros((c.m, 0)), np.zeros((c.g, 0, c.n)), sizes, tb, False, off)
    return want


def _tangent(mode, fn, primals, tangents):
    if mode == "torch.func.jvp":
        return torch.func.jvp(fn, primals, tangents)[1]
    with fwAD.dual_level():
        return fwAD.unpack_dual(fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents)))).tangent


@pytest.mark.parametrize("mode", ["torch.func.jvp", "forward_ad"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_grouped_mm_tangent_matches_reference_and_is_zero_on_padding_rows(mode, case, variant):
    with_bias, transpose = variant
    primals, tangents, sizes, offset = _problem(case, transpose)
    used = 3 if with_bias else 2

    def fn(x, w, b=None):
        return gt.grouped_mm(x, w, sizes, b, transpose_weight=transpose, group_offset=offset)

    tangent = _tangent(mode, fn, primals[:used], tangents[:used])
    assert tangent is not None and tangent.shape == (case.m, case.n) and tangent.dtype == F64
    want = _reference_tangent(case, primals, tangents, with_bias, transpose)
    ref.assert_close(tangent.numpy(), want, "float64", "tangent")
    pad = ref.padding_rows(inputs(case)["group_sizes"], case.m, case.g, case.offset)
    assert (tangent.numpy()[pad] == 0).all()


@pytest.mark.parametrize("which", [("input",), ("weight",), ("bias",), ("input", "bias")])
def test_a_tangent_on_some_operands_only_gives_their_terms(which):
    c = case("window_middle")
    primals, tangents, sizes, offset = _problem(c, True)
    names = ("input", "weight", "bias")
    with fwAD.dual_level():
        args = [fwAD.make_dual(p, t) if n in which else p for n, p, t in zip(names, primals, tangents)]
        out = gt.grouped_mm(*args[:2], sizes, args[2], transpose_weight=True, group_offset=offset)
        tangent = fwAD.unpack_dual(out).tangent
    ref.assert_close(tangent.numpy(), _reference_tangent(c, primals, tangents, True, True, which), "float64")


def test_grouped_linear_tangent_matches_reference():
    c = case("middle_empty")
    primals, tangents, sizes, _ = _problem(c, True)
    layer = gt.GroupedLinear(c.g, c.k, c.n, dtype=F64)
    params = {"weight": primals[1], "bias": primals[2]}
    t_params = {"weight": tangents[1], "bias": tangents[2]}
    _, tangent = torch.func.jvp(lambda x, p: torch.func.functional_call(layer, p, (x, sizes)),
                                (primals[0], params), (tangents[0], t_params))
    ref.assert_close(tangent.numpy(), _reference_tangent(c, primals, tangents, True, True), "float64")


def test_bfloat16_inputs_with_a_float32_output_give_a_float32_tangent():
    c = case("skewed")
    primals, tangents, sizes, _ = _problem(c, False, torch.bfloat16)
    _, tangent = torch.func.jvp(lambda x, w: gt.grouped_mm(x, w, sizes, out_dtype=torch.float32),
                                primals[:2], tangents[:2])
    assert tangent.dtype == torch.float32
    as64 = tuple(p.to(F64) for p in primals), tuple(t.to(F64) for t in tangents)
    ref.assert_close(tangent.to(F64).numpy(), _reference_tangent(c, *as64, False, False), "bfloat16")


GRADIENT_CASES = ["skewed", "middle_empty", "sum_above_rows", "window_middle", "window_past_end"]


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_forward_and_reverse_mode_of_every_gemm_op_match_finite_differences(name):
    """grouped_mm, grouped_mm_wgrad and grouped_bias_grad: both modes, batched (vmap) too,
    and second order for grouped_mm."""
    c = case(name)
    primals, _, sizes, offset = _problem(c, False)
    x, w, b = (p.requires_grad_() for p in primals)
    dout = _t(inputs(c)["dout"]).requires_grad_()
    checks = dict(check_forward_ad=True, check_batched_grad=True, check_batched_forward_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: gt.grouped_mm(x, w, sizes, b, group_offset=offset), (x, w, b),
                                    **checks)
    assert torch.autograd.gradgradcheck(lambda x, w, b: gt.grouped_mm(x, w, sizes, b, group_offset=offset), (x, w, b),
                                        check_fwd_over_rev=True)
    assert torch.autograd.gradcheck(lambda x, d: torch.ops.groupgemm.grouped_mm_wgrad(x, d, sizes, c.g, offset),
                                    (x, dout), **checks)
    assert torch.autograd.gradcheck(lambda d: torch.ops.groupgemm.grouped_bias_grad(d, sizes, c.g, offset), (dout,),
                                    **checks)


def test_torch_func_grad_gives_the_bits_of_backward():
    c = case("skewed")
    (x, w, b), _, sizes, _ = _problem(c, True, torch.float32)
    loss = lambda x, w, b: gt.grouped_mm(x, w, sizes, b, transpose_weight=True).square().sum()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(x, w, b)
    leaves = [p.clone().requires_grad_() for p in (x, w, b)]
    loss(*leaves).backward()
    for got, leaf in zip(grads, leaves):
        assert torch.equal(got, leaf.grad)


def _dense_grouped_mm(c):
    """A float64 torch reference of grouped_mm on a case's routing (host sizes), differentiable
    by torch itself."""
    rows = ref.local_group_rows(inputs(c)["group_sizes"], c.m, c.g, c.offset)

    def fn(x, w, b):
        out = x.new_zeros((c.m, c.n))
        for g, (lo, hi) in enumerate(rows):
            out = out.index_put((torch.arange(lo, hi),), x[lo:hi] @ w[g] + b[g])
        return out
    return fn


@pytest.mark.parametrize("name", ["middle_empty", "window_middle"])
def test_jacobians_and_hessian_match_a_dense_reference(name):
    c = case(name)
    (x, w, b), _, sizes, offset = _problem(c, False)
    ours = lambda x, w, b: gt.grouped_mm(x, w, sizes, b, group_offset=offset)
    dense = _dense_grouped_mm(c)
    for transform in (torch.func.jacrev, torch.func.jacfwd):
        for got, want in zip(transform(ours, argnums=(0, 1, 2))(x, w, b), transform(dense, argnums=(0, 1, 2))(x, w, b)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    loss = lambda f: (lambda w: f(x, w, b).sin().sum())  # nonlinear, so the hessian is not 0
    torch.testing.assert_close(torch.func.hessian(loss(ours))(w), torch.func.hessian(loss(dense))(w),
                               rtol=1e-12, atol=1e-12)


def test_vmap_runs_each_batch_entry_as_one_call_without_a_fallback_warning():
    c = case("skewed")
    (x, w, b), _, sizes, _ = _problem(c, False, torch.float32)
    xs = torch.stack([x, 2 * x, -x])
    routings = torch.stack([sizes, sizes.flip(0), torch.zeros_like(sizes)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's batched fallback warns of a performance drop
        batched = torch.func.vmap(lambda x, s: gt.grouped_mm(x, w, s, b))(xs, routings)
        per_sample = torch.func.vmap(torch.func.grad(lambda x: gt.grouped_mm(x, w, sizes, b).square().sum()))(xs)
    for i in range(3):
        assert torch.equal(batched[i], gt.grouped_mm(xs[i], w, routings[i], b))
        leaf = xs[i].clone().requires_grad_()
        gt.grouped_mm(leaf, w, sizes, b).square().sum().backward()
        torch.testing.assert_close(per_sample[i], leaf.grad)


def test_vmap_over_an_empty_batch_gives_empty_results_and_zero_gradients():
    # As torch's own ops: results of shape [0, *an entry's], and a derivative through them
    # is zeros of each input's shape.
    tokens, ids = torch.ones(0, 5, 4, dtype=F64), torch.zeros(5, 1, dtype=torch.int32)
    w = torch.randn(3, 4, 3, dtype=F64, requires_grad=True)
    w_in, w_out = torch.randn(3, 4, 4, dtype=F64, requires_grad=True), torch.randn(3, 2, 4, dtype=F64)
    ops = {"grouped_mm": (lambda x: gt.grouped_mm(x, w, torch.tensor([2, 2, 1])), (0, 5, 3), w),
           "permute": (lambda x: gt.permute(x, ids, 3)[0], (0, 5, 4), None),
           "unpermute": (lambda x: gt.unpermute(x, ids), (0, 5, 4), None),
           "softmax_topk": (lambda x: gt.softmax_topk(x[:, :3].contiguous(), 2)[0], (0, 5, 2), None),
           "expert_mlp": (lambda x: gt.expert_mlp(x, ids, None, w_in, w_out), (0, 5, 4), w_in)}
    for name, (op, shape, weight) in ops.items():
        out = torch.func.vmap(op)(tokens)
        assert out.shape == shape, name
        if weight is not None:
            (grad,) = torch.autograd.grad(out.sum(), weight)
            assert grad.shape == weight.shape and (grad == 0).all(), name


# ---- the expert layer ------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu", "silu"])
def test_expert_layer_tangent_matches_finite_differences(activation):
    torch.manual_seed(0)
    experts = torch.tensor([[0, 2], [2, 2], [0, -1], [0, 2], [1, 0], [2, 0]])
    mlp = gt.GroupedMLP(3, 8, 6, activation=activation, bias=True, dtype=F64)
    primals = (torch.randn(6, 8, dtype=F64), torch.rand(6, 2, dtype=F64),
               {k: v.detach() for k, v in mlp.named_parameters()})
    tangents = (torch.randn(6, 8, dtype=F64), torch.randn(6, 2, dtype=F64),
                {k: torch.randn_like(v) for k, v in primals[2].items()})

    def layer(tokens, probs, params):
        permuted, sizes, row_map = gt.permute(tokens, experts, 3)
        return gt.unpermute(torch.func.functional_call(mlp, params, (permuted, sizes)), row_map, probs)

    _, tangent = torch.func.jvp(layer, primals, tangents)
    eps = 1e-6
    moved = lambda s: torch.utils._pytree.tree_map(lambda p, t: p + s * t, primals, tangents)
    finite_difference = (layer(*moved(eps)) - layer(*moved(-eps))) / (2 * eps)
    torch.testing.assert_close(tangent, finite_difference, rtol=1e-6, atol=1e-6)
    assert (tangent[2] != 0).any()  # token 2 keeps one slot, through expert 0


@pytest.mark.parametrize("mode", ["torch.func.jvp", "forward_ad"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "full_softmax"])
def test_router_tangent_matches_finite_differences(renormalize, mode):
    torch.manual_seed(1)
    logits = torch.randn(5, 6, dtype=F64)
    logits[1, [0, 3]] = float("-inf")  # masked experts
    logits[2] = float("-inf")  # a token with every expert masked: dropped slots
    tangent_in = torch.randn(5, 6, dtype=F64)
    probs_of = lambda x: gt.softmax_topk(x, 3, renormalize=renormalize)[0]  # noqa: E731
    tangent = _tangent(mode, probs_of, (logits,), (tangent_in,))
    eps = 1e-6
    finite_difference = (probs_of(logits + eps * tangent_in) - probs_of(logits - eps * tangent_in)) / (2 * eps)
    torch.testing.assert_close(tangent, finite_difference, rtol=1e-6, atol=1e-6)
    assert (tangent[2] == 0).all() and (tangent[0] != 0).all()


def test_an_op_that_computes_a_gradient_itself_refuses_forward_mode_naming_it():
    permuted, row_map = torch.randn(4, 3, dtype=F64), torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    dout = torch.randn(2, 3, dtype=F64)
    with pytest.raises(RuntimeError, match="groupgemm::unpermute_backward has no forward-mode derivative"):
        torch.func.jvp(lambda d: torch.ops.groupgemm.unpermute_backward(d, permuted, row_map)[0], (dout,), (dout,))


def test_a_second_order_gradient_through_an_op_that_computes_a_gradient_itself_names_it():
    tokens = torch.randn(4, 6, dtype=F64, requires_grad=True)
    w_in, w_out = torch.randn(3, 6, 8, dtype=F64), torch.randn(3, 4, 6, dtype=F64)
    out = gt.expert_mlp(tokens, torch.tensor([[0, 1], [2, 0], [1, 1], [0, 2]]), None, w_in, w_out)
    (grad,) = torch.autograd.grad(out.square().sum(), tokens, create_graph=True)
    with pytest.raises(RuntimeError, match="groupgemm::expert_mlp_backward has no derivative: .* a second-order "
                                           "gradient \\(backward with create_graph=True"):
        grad.sum().backward()


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_accumulate_mode_names_itself_under_torch_func(transform):
    # It adds in place, outside autograd: a transform would get torch's internal errors
    # (or, for grad, no derivative), so it is refused by name.
    x, dy, sizes = torch.randn(6, 4, dtype=F64), torch.randn(6, 5, dtype=F64), torch.tensor([2, 0, 4])

    def accumulated(x):
        return gt.grouped_mm_wgrad(x, dy, sizes, 3, accumulate_into=torch.zeros(3, 4, 5, dtype=F64)).sum()

    call = {"grad": lambda: torch.func.grad(accumulated)(x), "vmap": lambda: torch.func.vmap(accumulated)(x[None]),
            "jvp": lambda: torch.func.jvp(accumulated, (x,), (x,))}[transform]
    with pytest.raises(ValueError, match="grouped_mm_wgrad: accumulate_into adds in place and is not supported "
                                         "under torch.func transforms"):
        call()


def test_accumulate_mode_runs_inside_a_backward_with_create_graph():
    # Megatron's main_grad pattern: a custom backward adds the weight gradient in place, a
    # side effect no one differentiates, while its saved input requires grad.
    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, main_grad):
            ctx.save_for_backward(x)
            ctx.main_grad = main_grad
            return x @ weight

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensors
            gt.grouped_mm_wgrad(x, dy, torch.tensor([x.shape[0]]), 1, accumulate_into=ctx.main_grad)
            return dy @ torch.ones(3, 4, dtype=F64), None, None

    x, weight, main_grad = torch.randn(5, 4, dtype=F64, requires_grad=True), torch.randn(4, 3, dtype=F64), \
        torch.zeros(1, 4, 3, dtype=F64)
    (dx,) = torch.autograd.grad(Linear.apply(x, weight, main_grad).square().sum(), x, create_graph=True)
    dy = 2 * (x @ weight)
    torch.testing.assert_close(main_grad[0], (x.T @ dy).detach(), rtol=1e-12, atol=1e-12)
