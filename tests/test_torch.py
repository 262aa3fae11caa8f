"""groupgemm.torch against the float64 NumPy reference, plus torch-specific contracts."""

import threading

import numpy as np
import pytest
import torch

from cases import CASE_IDS, CASES, DTYPES, VARIANT_IDS, VARIANTS, inputs, round_to
from forward_backward import TORCH
from groupgemm.torch import GroupedLinear, grouped_mm, grouped_mm_wgrad
import reference as ref



def t(x, dtype, requires_grad=False):
    return torch.tensor(np.asarray(x, np.float64), dtype=TORCH[dtype], requires_grad=requires_grad)


def as_np(x):
    return x.detach().to(torch.float64).numpy()


def offset_arg(case):
    return None if case.group_offset is None else torch.tensor(case.group_offset)


def dirty_allocator(numel, dtype):
    """Leaves freed NaN-filled blocks behind so fresh outputs likely reuse dirty memory."""
    for _ in range(4):
        torch.full((max(numel, 1),), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_forward_and_gradients_match_reference(case, dtype, variant):
    with_bias, transpose = variant
    x = inputs(case)
    lhs, rhs, bias, dout = (round_to(x[k], dtype) for k in ("lhs", "rhs", "bias", "dout"))
    rhs_stored = rhs.transpose(0, 2, 1) if transpose else rhs
    sizes = x["group_sizes"]
    lhs_t, rhs_t, bias_t = t(lhs, dtype, True), t(rhs_stored, dtype, True), t(bias, dtype, True)
    dirty_allocator(case.m * max(case.n, case.k), TORCH[dtype])
    out = grouped_mm(lhs_t, rhs_t, torch.from_numpy(sizes), bias_t if with_bias else None,
                     transpose_weight=transpose, group_offset=offset_arg(case))
    out.backward(t(dout, dtype))
    off = case.offset
    ref.assert_close(as_np(out), ref.grouped_matmul(lhs, rhs_stored, sizes, bias if with_bias else None,
                                                    transpose, off), dtype, "out")
    ref.assert_close(as_np(lhs_t.grad), ref.grouped_matmul(dout, rhs_stored, sizes, None, not transpose, off),
                     dtype, "dinput")
    want = ref.grouped_matmul_wgrad(lhs, dout, sizes, case.g, off)
    ref.assert_close(as_np(rhs_t.grad), want.transpose(0, 2, 1) if transpose else want, dtype, "dweight")
    pad = torch.from_numpy(ref.padding_rows(sizes, case.m, case.g, off))
    assert (out.detach()[pad] == 0).all() and (lhs_t.grad[pad] == 0).all()
    for g in ref.empty_groups(sizes, case.m, case.g, off):
        assert (rhs_t.grad[g] == 0).all()
    if with_bias:
        ref.assert_close(as_np(bias_t.grad), ref.grouped_bias_grad(dout, sizes, case.g, off), dtype, "dbias")
        for g in ref.empty_groups(sizes, case.m, case.g, off):
            assert (bias_t.grad[g] == 0).all()


# gradcheck needs non-empty tensors; many_groups is left out for time (cost grows with G*K*N).
GRADCHECK_CASES = [c for c in CASES if min(c.m, c.k, c.n, c.g) > 0 and c.name != "many_groups"]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=[c.name for c in GRADCHECK_CASES])
def test_gradcheck_float64(case):
    x = inputs(case)
    args = (t(x["lhs"], "float64", True), t(x["rhs"], "float64", True), t(x["bias"], "float64", True))
    sizes = torch.from_numpy(x["group_sizes"])
    assert torch.autograd.gradcheck(
        lambda a, w, b: grouped_mm(a, w, sizes, b, group_offset=offset_arg(case)), args)


def test_wgrad_accumulate_adds_in_place_and_keeps_empty_groups_bitwise():
    x = inputs(CASES[3])  # middle_empty
    lhs, dout = t(x["lhs"], "bfloat16"), t(x["dout"], "bfloat16")
    acc = torch.from_numpy(x["acc"]).float()
    before = acc.clone()
    result = grouped_mm_wgrad(lhs, dout, torch.from_numpy(x["group_sizes"]), 4, accumulate_into=acc)
    assert result is acc
    assert torch.equal(acc[1].view(torch.int32), before[1].view(torch.int32))
    want = ref.grouped_matmul_wgrad(round_to(x["lhs"], "bfloat16"), round_to(x["dout"], "bfloat16"),
                                    x["group_sizes"], 4, accumulate_into=before.numpy())
    ref.assert_close(acc.numpy(), want, "float32")


def _zero_token_batches():
    return {"no_tokens": (torch.randn(0, 8), [0, 0, 0]),
            "every_expert_empty": (torch.randn(5, 8), [0, 0, 0]),
            "one_expert_empty": (torch.randn(5, 8), [2, 0, 3])}


@pytest.mark.parametrize("batch", ["no_tokens", "every_expert_empty", "one_expert_empty"])
def test_grouped_linear_gives_every_parameter_a_full_shape_grad(batch):
    x, sizes = _zero_token_batches()[batch]
    layer = GroupedLinear(3, 8, 4)
    x.requires_grad_(True)
    y = layer(x, torch.tensor(sizes))
    y.sum().backward()  # stride-0 incoming gradient
    assert layer.weight.grad.shape == (3, 4, 8) and layer.bias.grad.shape == (3, 4)
    assert x.grad.shape == x.shape
    for e, size in enumerate(sizes):
        if size == 0:
            assert (layer.weight.grad[e] == 0).all() and (layer.bias.grad[e] == 0).all()
    owned = sum(sizes)
    assert (y[owned:] == 0).all() and (x.grad[owned:] == 0).all()


def test_grouped_linear_matches_per_expert_nn_linear_and_accepts_lists():
    torch.manual_seed(0)
    layer = GroupedLinear(3, 8, 4, dtype=torch.float64)
    x = torch.randn(9, 8, dtype=torch.float64)
    y = layer(x, [4, 0, 5])
    want = torch.cat([x[:4] @ layer.weight[0].T + layer.bias[0], x[4:] @ layer.weight[2].T + layer.bias[2]])
    torch.testing.assert_close(y, want)
    assert "num_experts=3" in repr(layer)
    bound = 1 / np.sqrt(8)
    assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound


def test_non_contiguous_incoming_gradients_are_handled():
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(2, 4, 8, requires_grad=True)
    y = grouped_mm(x, w, torch.tensor([3, 3]))
    y[:, ::2].sum().backward()
    dy = torch.zeros(6, 8)
    dy[:, ::2] = 1
    torch.testing.assert_close(x.grad, torch.cat([dy[:3] @ w[0].T, dy[3:] @ w[1].T]).detach())


def test_main_grad_accumulation_follows_megatron_contract():
    torch.manual_seed(0)
    layer = GroupedLinear(3, 8, 4, dtype=torch.bfloat16, accumulate_into_main_grad=True)
    reference = GroupedLinear(3, 8, 4, dtype=torch.bfloat16)
    reference.load_state_dict(layer.state_dict())
    layer.weight.main_grad = torch.randn(3, 4, 8)
    before = layer.weight.main_grad.clone()
    layer.weight.grad_added_to_main_grad = False
    x = torch.randn(7, 8, dtype=torch.bfloat16)
    sizes = torch.tensor([3, 0, 4])
    layer(x, sizes).float().square().sum().backward()
    reference(x, sizes).float().square().sum().backward()
    assert layer.weight.grad_added_to_main_grad is True
    assert layer.weight.grad.shape == layer.weight.shape and (layer.weight.grad == 0).all()
    torch.testing.assert_close(layer.weight.main_grad - before, reference.weight.grad.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(layer.weight.main_grad[1].view(torch.int32), before[1].view(torch.int32))
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


def test_main_grad_mode_without_main_grad_raises():
    layer = GroupedLinear(2, 4, 4, accumulate_into_main_grad=True)
    with pytest.raises(RuntimeError, match="weight.main_grad is not set"):
        layer(torch.randn(3, 4), [1, 2]).sum().backward()


def _opcheck_samples():
    f32 = dict(dtype=torch.float32)
    yield torch.ops.groupgemm.grouped_mm, (torch.randn(6, 4, **f32), torch.randn(3, 4, 5, **f32),
                                           torch.tensor([2, 0, 4]), torch.randn(3, 5), None, False, torch.float32)
    yield torch.ops.groupgemm.grouped_mm, (torch.randn(0, 4), torch.randn(3, 5, 4), torch.tensor([0, 0, 0]),
                                           None, None, True, torch.float32)
    yield torch.ops.groupgemm.grouped_mm, (torch.randn(6, 4).bfloat16(), torch.randn(2, 4, 5).bfloat16(),
                                           torch.tensor([0, 0, 3, 3]), None, torch.tensor(1), False, torch.float32)
    yield torch.ops.groupgemm.grouped_mm_wgrad, (torch.randn(6, 4), torch.randn(6, 5), torch.tensor([2, 0, 4]),
                                                 3, None, torch.float32)
    yield torch.ops.groupgemm.grouped_mm_wgrad, (torch.randn(0, 4), torch.randn(0, 5), torch.tensor([0, 0]),
                                                 2, None, torch.float32)
    yield torch.ops.groupgemm.grouped_mm_wgrad_accumulate, (torch.randn(6, 4), torch.randn(6, 5),
                                                            torch.tensor([2, 0, 4]), torch.randn(3, 4, 5), None)
    yield torch.ops.groupgemm.grouped_bias_grad, (torch.randn(6, 5), torch.tensor([0, 6, 0]), 3, None,
                                                  torch.float32)
    yield torch.ops.groupgemm.grouped_bias_grad, (torch.randn(0, 5), torch.tensor([0, 0]), 2, None, torch.float32)


@pytest.mark.parametrize("index", range(8))
def test_opcheck(index):
    op, args = list(_opcheck_samples())[index]
    if op is torch.ops.groupgemm.grouped_mm:
        args = (args[0].requires_grad_(), args[1].requires_grad_(), *args[2:])
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_concurrent_calls_from_threads_are_correct(dtype):
    # One layer's shapes (K, N) in every job, so the threads share one cached kernel, with
    # groups large enough for oneDNN's blocked (brgemm) bfloat16 path.
    rng = np.random.default_rng(5)
    jobs = []
    for i in range(8):
        sizes = rng.integers(0, 300, size=6)
        lhs = t(rng.standard_normal((int(sizes.sum()) + i, 256)), dtype)
        rhs = t(rng.standard_normal((6, 192, 256)), dtype)
        jobs.append((lhs, rhs, torch.from_numpy(sizes)))
    expected = [grouped_mm(*job, transpose_weight=True) for job in jobs]
    results, errors = [None] * len(jobs), []

    def worker(i):
        try:
            for _ in range(5):
                results[i] = grouped_mm(*jobs[i], transpose_weight=True)
                assert torch.equal(results[i], expected[i]), f"job {i} differs from its serial result"
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and all(not th.is_alive() for th in threads), errors
    for (lhs, rhs, sizes), result in zip(jobs, results):
        want = ref.grouped_matmul(as_np(lhs), as_np(rhs), sizes.numpy(), transpose_rhs=True)
        ref.assert_close(as_np(result), want, dtype)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w, s: grouped_mm(x[None], w, s), ValueError, "input must be 2-D"),
    (lambda x, w, s: grouped_mm(x, w[0], s), ValueError, "weight must be 3-D"),
    (lambda x, w, s: grouped_mm(x, w.double(), s), TypeError, "weight dtype"),
    (lambda x, w, s: grouped_mm(x.int(), w, s), TypeError, "input must be float32"),
    (lambda x, w, s: grouped_mm(x, w, s, transpose_weight=True), ValueError, "does not contract"),
    (lambda x, w, s: grouped_mm(x, w, s[:2]), ValueError, "group_sizes has 2 entries"),
    (lambda x, w, s: grouped_mm(x, w, s.float()), TypeError, "group_sizes must be an integer"),
    (lambda x, w, s: grouped_mm(x, w, [1, 2, 3]), TypeError, "group_sizes must be a 1-D integer tensor"),
    (lambda x, w, s: grouped_mm(x, w, s[:1], group_offset=0), ValueError, "fewer than the 3 local"),
    (lambda x, w, s: grouped_mm(x, w, s, group_offset=torch.zeros(2, dtype=torch.int64)), ValueError, "group_offset"),
    (lambda x, w, s: grouped_mm(x, w, s, torch.zeros(3, 4)), ValueError, "bias must have shape"),
    (lambda x, w, s: grouped_mm(x, w, s, out_dtype=torch.float16), TypeError, "out_dtype"),
    (lambda x, w, s: grouped_mm(x, w, s.to("meta")), ValueError, "group_sizes is on meta"),
    (lambda x, w, s: grouped_mm_wgrad(x, x[:2], s, 3), ValueError, "grad has 2 rows"),
    (lambda x, w, s: grouped_mm_wgrad(x, x, s, 3, accumulate_into=torch.zeros(3, 4, 4).bfloat16()),
     TypeError, "accumulate_into must be a torch.float32"),
    (lambda x, w, s: grouped_mm_wgrad(x, x, s, 3, accumulate_into=torch.zeros(3, 4, 4).transpose(1, 2)),
     ValueError, "accumulate_into must be contiguous"),
])
def test_bad_input_raises_naming_the_argument(call, error, match):
    x, w, s = torch.randn(6, 4), torch.randn(3, 4, 5), torch.tensor([2, 2, 2])
    with pytest.raises(error, match=match):
        call(x, w, s)
