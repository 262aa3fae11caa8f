"""What only groupgemm.torch has: GroupedLinear, the raw ops (opcheck, schema defaults,
their own input checks), thread safety. No jax here; the shared bodies are in
test_frontends.py, Megatron's main_grad contract is in test_torch_main_grad.py."""

import re
import threading

import numpy as np
import pytest
import reference as ref
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import groupgemm.torch as gt
from groupgemm.torch import GroupedLinear, GroupedMLP, grouped_mm


def t(x, dtype):
    return torch.tensor(np.asarray(x, np.float64), dtype=getattr(torch, dtype))


def as_np(x):
    return x.detach().to(torch.float64).numpy()


def _zero_token_batches(width=8):
    return {"no_tokens": (torch.randn(0, width), [0, 0, 0]),
            "every_expert_empty": (torch.randn(5, width), [0, 0, 0]),
            "one_expert_empty": (torch.randn(5, width), [2, 0, 3])}


# The layer's widths per FP8 recipe (None: 16-bit GEMMs): blockwise needs multiples of 128.
FP8_WIDTHS = {None: (8, 4), "rowwise": (8, 4), "blockwise": (128, 256)}


@pytest.mark.parametrize("fp8", list(FP8_WIDTHS))
@pytest.mark.parametrize("batch", ["no_tokens", "every_expert_empty", "one_expert_empty"])
def test_grouped_linear_gives_every_parameter_a_full_shape_grad(batch, fp8):
    k, n = FP8_WIDTHS[fp8]
    x, sizes = _zero_token_batches(k)[batch]
    layer = GroupedLinear(3, k, n, fp8=fp8)
    x.requires_grad_(True)
    y = layer(x, torch.tensor(sizes))
    y.sum().backward()  # stride-0 incoming gradient
    assert layer.weight.grad.shape == (3, n, k) and layer.bias.grad.shape == (3, n)
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
    # Only the required arguments: the schema's defaults fill the rest.
    yield torch.ops.groupgemm.grouped_mm, (torch.randn(6, 4), torch.randn(3, 4, 5), torch.tensor([2, 0, 4]))
    yield torch.ops.groupgemm.grouped_mm_wgrad, (torch.randn(6, 4), torch.randn(6, 5), torch.tensor([2, 0, 4]), 3)
    yield torch.ops.groupgemm.grouped_bias_grad, (torch.randn(6, 5), torch.tensor([1, 0, 4, 1]), 2, torch.tensor(1))
    yield torch.ops.groupgemm.permute, (torch.randn(4, 3), torch.tensor([[0, 2], [2, 2], [0, -1], [1, 0]]), 3)
    yield torch.ops.groupgemm.unpermute, (torch.randn(8, 3), torch.tensor([[0, 5], [1, -1], [7, 2]],
                                                                          dtype=torch.int32), torch.rand(3, 2))
    yield torch.ops.groupgemm.unpermute, (torch.randn(8, 3), torch.tensor([[0, 0], [5, 0], [9, 2]],
                                                                          dtype=torch.int32), torch.rand(3, 2))
    yield torch.ops.groupgemm.activation, (torch.randn(5, 6), 0, 3)
    yield torch.ops.groupgemm.activation, (torch.randn(5, 6), 1, 6)
    yield torch.ops.groupgemm.softmax_topk_tangent, (torch.randn(4, 5), torch.tensor([[2, 0], [1, -1], [0, 4], [3, 1]],
                                                                                     dtype=torch.int32),
                                                     torch.randn(4, 5), False)
    yield torch.ops.groupgemm.fp8_quantize_rows, (torch.randn(6, 200), 0, 1, True)
    yield torch.ops.groupgemm.fp8_quantize_blocks, (torch.randn(2, 130, 4).bfloat16(), 1)
    yield torch.ops.groupgemm.fp8_quantize_grouped, (torch.randn(6, 4), torch.tensor([2, 0, 4]), 3, 0, 1, False,
                                                     None)
    yield torch.ops.groupgemm.expert_mlp, (torch.randn(5, 4), torch.tensor([[0, 2], [2, 2], [1, -1], [0, 1], [7, 0]]),
                                           torch.randn(3, 4, 6), torch.randn(3, 3, 4), torch.rand(5, 2), None,
                                           torch.randn(3, 4), torch.tensor(1), 0, False, True)
    yield from _fp8_gemm_samples()


def _fp8(shape):
    return torch.randn(shape).to(torch.float8_e4m3fn)


def _fp8_gemm_samples():
    sizes = torch.tensor([2, 0, 4])
    yield torch.ops.groupgemm.scaled_grouped_mm, (_fp8((6, 4)), _fp8((3, 5, 4)), torch.rand(6), torch.rand(3, 5),
                                                  sizes, 0, torch.bfloat16, torch.randn(3, 5).bfloat16(), None)
    yield torch.ops.groupgemm.scaled_grouped_mm_wgrad, (_fp8((4, 6)), _fp8((5, 6)), torch.rand(3, 4),
                                                        torch.rand(3, 5), sizes, 3, 0, torch.float32, None)
    yield torch.ops.groupgemm.scaled_grouped_mm_wgrad_accumulate, (_fp8((4, 6)), _fp8((5, 6)), torch.rand(3, 4),
                                                                   torch.rand(3, 5), sizes, 0, torch.randn(3, 4, 5),
                                                                   None)


# The samples whose floating-point operands get requires_grad, so opcheck checks their autograd.
_DIFFERENTIABLE = {"grouped_mm", "grouped_mm_wgrad", "grouped_bias_grad", "permute", "unpermute", "activation",
                   "expert_mlp"}


# opcheck's schema test multiplies the inputs, which torch does not do for float8 on the CPU.
_FLOAT8_OPERANDS = {"scaled_grouped_mm", "scaled_grouped_mm_wgrad", "scaled_grouped_mm_wgrad_accumulate"}


@pytest.mark.parametrize("index", range(len(list(_opcheck_samples()))))
def test_opcheck(index):
    op, args = list(_opcheck_samples())[index]
    name = op._qualified_op_name.split("::")[1]
    if name in _DIFFERENTIABLE:
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    if name in _FLOAT8_OPERANDS:
        torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    else:
        torch.library.opcheck(op, args)


def _sizes():
    return torch.tensor([2, 0, 4])


# Each op's required arguments (from operands x [6, 4], w [3, 4, 5], d [6, 5], acc [3, 4, 5]),
# and its optional arguments' defaults in schema order.
_ROW_MAP = [[0, 5], [1, -1]]
REQUIRED_ONLY = {
    "grouped_mm": (lambda x, w, d, acc: (x, w, _sizes()), (None, None, False, None, False)),
    "grouped_mm_wgrad": (lambda x, w, d, acc: (x, d, _sizes(), 3), (None, None, False)),
    "grouped_mm_wgrad_accumulate": (lambda x, w, d, acc: (x, d, _sizes(), acc), (None, False)),
    "grouped_bias_grad": (lambda x, w, d, acc: (d, _sizes(), 3), (None, None, False)),
    "grouped_mm_backward": (lambda x, w, d, acc: (x, w, d, _sizes(), None), (None, False, False, True, True, None)),
    "permute": (lambda x, w, d, acc: (x, torch.tensor([[0], [2], [2], [1], [0], [2]]), 3), ()),
    "unpermute": (lambda x, w, d, acc: (x, torch.tensor(_ROW_MAP, dtype=torch.int32)), (None,)),
    "unpermute_backward": (lambda x, w, d, acc: (x[:2], x, torch.tensor(_ROW_MAP, dtype=torch.int32)), (None,)),
    "activation": (lambda x, w, d, acc: (x, 0, 2), ()),
    "activation_backward": (lambda x, w, d, acc: (x, x, 1), ()),
    "softmax_topk": (lambda x, w, d, acc: (x, 2), (True,)),
    "softmax_topk_backward": (lambda x, w, d, acc: (x, torch.tensor([[1, 0]] * 6, dtype=torch.int32),
                                                    x[:, :2].contiguous()), (True,)),
    "softmax_topk_tangent": (lambda x, w, d, acc: (x, torch.tensor([[1, 0]] * 6, dtype=torch.int32), x), (True,)),
    "expert_mlp": (lambda x, w, d, acc: (x, torch.tensor([[0], [2], [2], [1], [0], [2]]), w[:, :, :4].contiguous(),
                                         w[:, :2, :4].contiguous()), (None, None, None, None, 0, False, True)),
    "expert_mlp_backward": (lambda x, w, d, acc: (x, x, torch.tensor([[0], [2], [2], [1], [0], [2]]),
                                                  w[:, :, :4].contiguous(), w[:, :2, :4].contiguous(),
                                                  x[:, None].contiguous(), [True] * 6), (None, None, None, 0, False)),
    "fp8_quantize_rows": (lambda x, w, d, acc: (x, 0, 1), (False,)),
    "fp8_quantize_blocks": (lambda x, w, d, acc: (w, 0), (False,)),
    "fp8_quantize_grouped": (lambda x, w, d, acc: (x, _sizes(), 3, 0, 0), (False, None)),
    "scaled_grouped_mm": (lambda x, w, d, acc: (*_fp8_operands(x, w.transpose(1, 2)), torch.ones(6),
                                                torch.ones(3, 5), _sizes(), 0, torch.bfloat16), (None, None, False)),
    "scaled_grouped_mm_wgrad": (lambda x, w, d, acc: (*_fp8_operands(x.t(), d.t()), torch.ones(3, 4),
                                                      torch.ones(3, 5), _sizes(), 3, 0, torch.bfloat16),
                                (None, False)),
    "scaled_grouped_mm_wgrad_accumulate": (lambda x, w, d, acc: (*_fp8_operands(x.t(), d.t()), torch.ones(3, 4),
                                                                 torch.ones(3, 5), _sizes(), 0, acc), (None, False)),
}


def _fp8_operands(*tensors):
    return tuple(t.contiguous().to(torch.float8_e4m3fn) for t in tensors)


def _call(name, spell_out_defaults):
    """The op's result (the updated buffer of the in-place op) on fixed operands."""
    torch.manual_seed(0)
    x, w, d, acc = torch.randn(6, 4), torch.randn(3, 4, 5), torch.randn(6, 5), torch.zeros(3, 4, 5)
    required, defaults = REQUIRED_ONLY[name]
    result = getattr(torch.ops.groupgemm, name)(*required(x, w, d, acc), *(defaults if spell_out_defaults else ()))
    return (acc,) if result is None else result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("name", sorted(REQUIRED_ONLY))
def test_every_op_runs_with_only_its_required_arguments(name):
    arguments = getattr(torch.ops.groupgemm, name).default._schema.arguments
    optional = [a for a in arguments if str(a.type).endswith("?") or str(a.type) == "bool"]
    assert all(a.has_default_value() for a in optional), [a.name for a in optional]
    assert [a.default_value for a in arguments if a.has_default_value()] == list(REQUIRED_ONLY[name][1])
    for short, spelled in zip(_call(name, False), _call(name, True)):
        if short.element_size() == 1:  # float8: torch compares it only as its bytes
            short, spelled = short.view(torch.uint8), spelled.view(torch.uint8)
        assert torch.equal(short, spelled)


def test_a_torch_function_mode_sees_each_op_call_as_it_was_made():
    # A call that cannot need a derivative skips the autograd kernel (op_library.py);
    # a __torch_function__ mode may still turn grad mode on for it, and then the call
    # must record its derivative as an ordinary op would.
    from torch.overrides import TorchFunctionMode

    from groupgemm.torch_ext.gemm_ops import grouped_mm_op

    class GradModeOn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            with torch.enable_grad():
                return func(*args, **(kwargs or {}))

    x, w = torch.randn(16, 8, requires_grad=True), torch.randn(2, 8, 4, requires_grad=True)
    with torch.no_grad():
        assert grouped_mm_op(x, w, torch.tensor([10, 6])).grad_fn is None
        with GradModeOn():
            y = grouped_mm_op(x, w, torch.tensor([10, 6]))
    assert y.grad_fn is not None
    y.sum().backward()
    np.testing.assert_allclose(as_np(w.grad[1]), as_np(x[10:].sum(0)[:, None].expand(8, 4)), rtol=1e-5)


def test_every_groupgemm_op_is_in_the_required_arguments_table():
    assert {name for name in dir(torch.ops.groupgemm) if not name.startswith("_")} - {"name"} == set(REQUIRED_ONLY)


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


@pytest.mark.parametrize("call, match", [
    (lambda: torch.ops.groupgemm.grouped_mm(torch.randn(6, 4), torch.randn(4, 5), torch.tensor([6]), None, None,
                                            False, torch.float32), "weight must be 3-D"),
    (lambda: torch.ops.groupgemm.grouped_mm(torch.randn(4, 6).T, torch.randn(1, 4, 5), torch.tensor([6]), None,
                                            None, False, torch.float32), "input must be contiguous"),
    (lambda: torch.ops.groupgemm.grouped_mm_wgrad(torch.randn(6, 4), torch.randn(6), torch.tensor([6]), 1, None,
                                                  torch.float32), "grad must be 2-D"),
    (lambda: torch.ops.groupgemm.grouped_mm_wgrad(torch.randn(6, 4), torch.randn(6, 5), torch.tensor([6]), -1, None,
                                                  torch.float32), "num_groups must be non-negative"),
    (lambda: torch.ops.groupgemm.grouped_mm_wgrad_accumulate(torch.randn(6, 4), torch.randn(6, 5), torch.tensor([6]),
                                                             torch.randn(5, 4).T[None], None),
     "accumulate_into must be contiguous"),
    (lambda: torch.ops.groupgemm.grouped_bias_grad(torch.randn(6, 5), torch.tensor([[6]]), 1, None, torch.float32),
     "group_sizes must be 1-D"),
    (lambda: torch.ops.groupgemm.permute(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.int32), 2**40),
     "num_experts = 1099511627776 exceeds 2147483646"),
    (lambda: torch.ops.groupgemm.fp8_quantize_rows(torch.randn(4, 128), 5, 0),
     r"out_type must be one of 0 \(float8_e4m3fn\), 1 \(float8_e5m2\), got 5"),
    (lambda: torch.ops.groupgemm.fp8_quantize_grouped(torch.randn(4, 128), torch.tensor([4]), 1, 0, 2),
     r"scaling must be one of 0 \(rowwise\), 1 \(blockwise\), got 2"),
    (lambda: torch.ops.groupgemm.scaled_grouped_mm(*_raw_fp8_operands(rhs_scale=torch.ones(8, 2).T), 0, torch.float32),
     "rhs_scale must be contiguous"),
    (lambda: torch.ops.groupgemm.scaled_grouped_mm_wgrad(
        *_raw_fp8_operands(wgrad=True, lhs_scale=torch.ones(4, 2).T), 1, 0, torch.float32),
     "lhs_scale must be contiguous"),
])
def test_raw_ops_check_their_inputs_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=f"groupgemm::.*{match}"):
        call()


def _raw_fp8_operands(wgrad=False, **scales):
    """Float8 operands of a raw scaled GEMM (the forward form, or the weight-gradient form)
    with unit scales, some replaced by ``scales``."""
    e4m3 = torch.float8_e4m3fn
    if wgrad:  # lhs [K, M], rhs [N, M], scales per (group, channel)
        operands = dict(lhs=torch.zeros(2, 4, dtype=e4m3), rhs=torch.zeros(2, 4, dtype=e4m3),
                        lhs_scale=torch.ones(1, 2), rhs_scale=torch.ones(1, 2))
    else:  # lhs [M, K], rhs [G, N, K], scales per row
        operands = dict(lhs=torch.zeros(4, 16, dtype=e4m3), rhs=torch.zeros(2, 8, 16, dtype=e4m3),
                        lhs_scale=torch.ones(4), rhs_scale=torch.ones(2, 8))
    operands.update(scales)
    return (*operands.values(), torch.tensor([4] if wgrad else [2, 2], dtype=torch.int32))


@pytest.mark.parametrize("call, error, match", [
    (lambda: torch.ops.groupgemm.grouped_mm(torch.randn(6, 4).to_sparse(), torch.randn(1, 4, 5), torch.tensor([6]),
                                            None, None, False, torch.float32),
     TypeError, "input must be a dense tensor"),
    (lambda: torch.ops.groupgemm.scaled_grouped_mm(torch.zeros(4, 16), *_raw_fp8_operands()[1:], 0, torch.float32),
     TypeError, r"lhs must be float8 \(float8_e4m3fn, float8_e5m2\), got torch.float32"),
])
def test_raw_ops_refuse_what_they_cannot_read_naming_the_argument(call, error, match):
    with pytest.raises(error, match=f"groupgemm::.*{match}"):
        call()


def test_grouped_linear_clips_list_sizes_of_any_magnitude():
    torch.manual_seed(0)
    layer = GroupedLinear(3, 4, 2, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64)
    y = layer(x, [-(2**70), 2**70, 7])  # as [0, 5, 0]: expert 1 owns every row
    torch.testing.assert_close(y, x @ layer.weight[1].T + layer.bias[1])


# ---- the expert layer ---------------------------------------------------------------


def _moe_block(dtype=torch.float32, fp8=None, dim=8, ffn=6):
    from moe_block import init_block, torch_block_class

    torch.manual_seed(0)
    return torch_block_class()(init_block(np.random.default_rng(0), dim, ffn, 4), top_k=2, fp8=fp8).to(dtype)


def test_expert_block_compiles_with_fullgraph_and_matches_eager():
    block = _moe_block()
    compiled = torch.compile(block, fullgraph=True)
    allowed = torch.tensor([True, False, True, True])  # expert 1 gets no tokens
    for tokens in (10, 0):
        x = torch.randn(tokens, 8)
        eager_out, _ = block(x, allowed)
        eager_grads = torch.autograd.grad(eager_out.square().sum(), list(block.parameters()), allow_unused=False)
        out, _ = compiled(x, allowed)
        grads = torch.autograd.grad(out.square().sum(), list(block.parameters()))
        torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp8", [None, "rowwise", "blockwise"])
def test_expert_block_with_no_tokens_gives_every_parameter_a_full_shape_zero_grad(fp8):
    dim = 128 if fp8 == "blockwise" else 8
    block = _moe_block(fp8=fp8, dim=dim, ffn=dim)
    x = torch.randn(0, dim, requires_grad=True)
    out, sizes = block(x)
    assert out.shape == (0, dim) and sizes.tolist() == [0, 0, 0, 0]
    out.sum().backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and (p.grad == 0).all(), name


@pytest.mark.parametrize("make, error, message", [
    (lambda: GroupedMLP(4, 8, -1), ValueError, "GroupedMLP: ffn_hidden_size must be a non-negative int, got -1"),
    (lambda: GroupedMLP(4, 128, 64, fp8="blockwise"), ValueError,  # its own name, not its fc2's in_features
     "GroupedMLP: fp8='blockwise' needs ffn_hidden_size to be a multiple of 128 .*, got 64"),
    (lambda: GroupedMLP(4, 8.0, 6), ValueError, "GroupedMLP: hidden_size must be a non-negative int, got 8.0"),
    (lambda: GroupedLinear(4, -1, 6), ValueError, "GroupedLinear: in_features must be a non-negative int, got -1"),
    (lambda: GroupedLinear(4, 8, 6, dtype=torch.int32), TypeError,
     "GroupedLinear: dtype must be float32, bfloat16, float16 or float64, got int32"),
    # A flag's truthiness would pick the other mode silently ("False" is truthy):
    (lambda: GroupedLinear(4, 8, 6, accumulate_into_main_grad="False"), TypeError,
     "GroupedLinear: accumulate_into_main_grad must be a bool, got 'False'"),
    (lambda: GroupedMLP(4, 8, 6, bias="False"), TypeError, "GroupedMLP: bias must be a bool, got 'False'"),
    (lambda: GroupedLinear(3, 8, 4)(torch.randn(6, 7), [2, 0, 3]), ValueError,
     r"GroupedLinear: x has width 7 \(shape \(6, 7\)\), but the layer's in_features is 8"),
    # Outside autocast, which casts both (test_torch_autocast.py):
    (lambda: GroupedMLP(3, 8, 4)(torch.randn(6, 8, dtype=torch.bfloat16), [2, 0, 3]), TypeError,
     r"GroupedMLP: x has dtype bfloat16, but the layer's dtype \(its parameters'\) is float32"),
    (lambda: GroupedMLP(3, 8, 4)(torch.randn(6, 7), [2, 0, 3]), ValueError,
     r"GroupedMLP: x has width 7 \(shape \(6, 7\)\), but the layer's hidden_size is 8"),
    (lambda: GroupedLinear(3, 8, 4)(torch.ones(6, 8, dtype=torch.int32), [2, 0, 3]), TypeError,  # no int layers
     r"GroupedLinear: x has dtype int32, but the layer's dtype \(its parameters'\) is float32; cast x to float32$"),
    # Rows and group sizes in the layer's terms (no group_offset to point to), 0-D x included:
    *[(lambda layer=layer, x=x: layer(torch.randn(x), [2, 0, 3]), ValueError,
       rf"{type(layer).__name__}: x must be 2-D \[rows, {width}\], got shape {re.escape(str(x))}")
      for layer, width in ((GroupedLinear(3, 8, 4), "in_features"), (GroupedMLP(3, 8, 4), "hidden_size"))
      for x in ((), (8,), (1, 6, 8))],
    *[(lambda layer=layer, sizes=sizes: layer(torch.randn(6, 8), sizes), ValueError,
       f"{type(layer).__name__}: group_sizes has {len(sizes)} entries, but the layer has num_experts = 3: one size "
       "per expert") for layer in (GroupedLinear(3, 8, 4), GroupedMLP(3, 8, 4))
      for sizes in ([2, 4], torch.tensor([2, 0, 3, 1]))],
    *[(lambda layer=layer, sizes=sizes: layer(torch.randn(6, 8), sizes), TypeError,  # not the GEMM op's name
       f"{type(layer).__name__}: group_sizes must {must}") for layer in (GroupedLinear(3, 8, 4), GroupedMLP(3, 8, 4))
      for sizes, must in ((torch.tensor([2.0, 0, 3]), "be an integer array, got float32"),
                          (torch.tensor([True, False, True]), "be an integer array, got bool"),
                          ([2.0, 0, 3], "hold integers, got 2.0"))],
    # Routed tokens in the layer's terms, not the permuted rows' or the fused op's:
    *[(lambda fused=fused: GroupedMLP(3, 8, 4, fused=fused).forward_routed(
        torch.randn(6, 7), torch.zeros(6, 2, dtype=torch.int32)),
       ValueError, r"GroupedMLP: tokens has width 7 \(shape \(6, 7\)\), but the layer's hidden_size is 8")
      for fused in (False, True)],
    *[(lambda fused=fused: GroupedMLP(3, 8, 4, fused=fused).forward_routed(
        torch.randn(6, 8, dtype=torch.float64), torch.zeros(6, 2, dtype=torch.int32)),
       TypeError, r"GroupedMLP: tokens has dtype float64, but the layer's dtype \(its parameters'\) is float32")
      for fused in (False, True)],
    # Parameters of two dtypes, set by hand: named, before an op would name its operands.
    (lambda: _with_bfloat16(GroupedLinear(3, 8, 4), "bias")(torch.randn(6, 8), [2, 0, 3]), TypeError,
     "GroupedLinear: parameter bias has dtype bfloat16, but weight has float32; a layer's parameters share one"),
    *[(lambda fused=fused: _with_bfloat16(GroupedMLP(3, 8, 4, fused=fused), "fc2").forward_routed(
        torch.randn(6, 8), torch.zeros(6, 2, dtype=torch.int32)),
       TypeError, "GroupedMLP: parameter fc2.weight has dtype bfloat16, but fc1.weight has float32")
      for fused in (False, True)],
])
def test_modules_refuse_a_bad_configuration_naming_the_argument(make, error, message):
    with pytest.raises(error, match=message):
        make()


def _with_bfloat16(module, name):
    """``module`` with its submodule or parameter ``name`` converted to bfloat16."""
    if isinstance(getattr(module, name), torch.nn.Module):
        getattr(module, name).to(torch.bfloat16)
    else:
        setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().bfloat16()))
    return module


def test_accumulate_into_is_checked_by_the_bytes_it_spans_and_traces():
    # Two views of one buffer that do not overlap are separate buffers; an overlapping one
    # is refused, compiled as in eager (the core's entry point checks the buffers it is
    # given), and left as it was. Traced, fake and meta tensors have no addresses: fullgraph
    # compile, export and shape propagation run the call.
    sizes, buffer = torch.tensor([2, 0, 3]), torch.randn(144)
    x, grad = buffer[:48].view(6, 8), torch.randn(6, 4)
    want = torch.einsum("rk,rn->kn", x[:2].double(), grad[:2].double())
    acc = buffer[48:].view(3, 8, 4)
    before = acc.clone()
    # float32 sums against the float64 reference: float32's tolerance
    torch.testing.assert_close(gt.grouped_mm_wgrad(x, grad, sizes, 3, accumulate_into=acc)[0],
                               (before[0].double() + want).float())

    def call(x, grad, sizes, acc):
        return gt.grouped_mm_wgrad(x, grad, sizes, 3, accumulate_into=acc)

    before = buffer.clone()
    for run in (call, torch.compile(call, fullgraph=True, backend="eager")):
        with pytest.raises(ValueError, match="accumulate_into shares memory with lhs; pass a separate buffer"):
            run(x, grad, sizes, buffer[40:136].view(3, 8, 4))
        assert torch.equal(buffer, before)

    x, eager_acc = torch.randn(6, 8), torch.randn(3, 8, 4)
    compiled_acc = eager_acc.clone()
    torch.compile(call, fullgraph=True, backend="eager")(x, grad, sizes, compiled_acc)
    assert torch.equal(compiled_acc, call(x, grad, sizes, eager_acc))
    with FakeTensorMode():
        fake = call(torch.randn(6, 8), torch.randn(6, 4), torch.tensor([2, 0, 3]), torch.zeros(3, 8, 4))
    assert fake.shape == (3, 8, 4)
    meta = [torch.empty(shape, device="meta") for shape in ((6, 8), (6, 4))]
    assert call(*meta, sizes.to("meta"), torch.zeros(3, 8, 4, device="meta")).shape == (3, 8, 4)
