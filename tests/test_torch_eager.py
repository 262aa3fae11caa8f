"""The PyTorch eager path (torch_ext/eager.py): a plain eager grouped_mm runs a memoised plan
with the same core calls, and so the same bits, as the torch.ops.groupgemm ops, forward and
backward; anything that must see an op still gets the op; and no call copies a weight that
a kernel can read in place (a transposed view, torchtitan's call), in either path."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from cases import CASE_IDS, CASES, inputs
from torch.utils._python_dispatch import TorchDispatchMode

import groupgemm.torch as gt
from groupgemm.torch_ext import eager

COPIES = ("aten::clone", "aten::copy_", "aten::contiguous", "aten::_to_copy")


class _CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("clone", "copy_", "contiguous", "_to_copy"):
            self.copies.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _operands(c, dtype, transposed_view, bias):
    x = inputs(c)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    lhs = t(x["lhs"]).requires_grad_()
    # [G, N, K] storage read as [G, K, N] (torchtitan's w.transpose(-2, -1)), or [G, K, N] itself.
    weight = (t(x["rhs"].transpose(0, 2, 1)).requires_grad_() if transposed_view else t(x["rhs"]).requires_grad_())
    b = t(x["bias"]).requires_grad_() if bias else None
    offset = None if c.group_offset is None else torch.tensor(c.group_offset)
    return lhs, weight, torch.tensor(c.group_sizes, dtype=torch.int32), b, offset, t(x["dout"])


def _run(lhs, weight, sizes, bias, offset, dout, transposed_view, ops):
    """(out, dlhs, dweight, dbias) of one forward and backward, through the ops or the eager path."""
    for t in (lhs, weight, bias):
        if t is not None:
            t.grad = None
    w = weight.transpose(-2, -1) if transposed_view else weight
    if ops:  # a dispatch mode sends the call through the ops, and sees nothing else
        with _CountCopies():
            out = gt.grouped_mm(lhs, w, sizes, bias, group_offset=offset)
            out.backward(dout)
    else:
        assert eager.takes_eager_path(lhs, w, sizes, bias, offset)
        out = gt.grouped_mm(lhs, w, sizes, bias, group_offset=offset)
        out.backward(dout)
    return [t for t in (out, lhs.grad, weight.grad, None if bias is None else bias.grad)]


@pytest.mark.parametrize("name", CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed_view", [False, True], ids=["weight", "transposed_view"])
def test_eager_path_gives_the_ops_bits_forward_and_backward(name, dtype, transposed_view):
    c = next(c for c in CASES if c.name == name)
    operands = _operands(c, dtype, transposed_view, bias=True)
    through_ops = _run(*operands, transposed_view, ops=True)
    through_eager = _run(*operands, transposed_view, ops=False)
    for ops_result, eager_result in zip(through_ops, through_eager):
        assert ops_result.shape == eager_result.shape and ops_result.dtype == eager_result.dtype
        assert torch.equal(ops_result.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           eager_result.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def _both_paths(fn):
    eager_out = fn()
    with _CountCopies():
        ops_out = fn()
    return eager_out, ops_out


def test_an_int_group_offset_takes_the_eager_path_with_the_ops_bits():
    x, w = torch.randn(15, 8), torch.randn(2, 8, 8)
    sizes = torch.tensor([3, 0, 4, 2, 5, 1])
    # Row boundaries 0, 3, 3, 7, 9, 14, 15; local group l is global group offset + l.
    owned = {2: [(0, 3, 7), (1, 7, 9)], 4: [(0, 9, 14), (1, 14, 15)], -1: [(1, 0, 3)], 9: []}
    for offset, rows in owned.items():
        eager_out, ops_out = _both_paths(lambda: gt.grouped_mm(x, w, sizes, group_offset=offset))
        assert torch.equal(eager_out, ops_out)
        want = np.zeros((15, 8))
        for local, begin, end in rows:
            want[begin:end] = x[begin:end].double().numpy() @ w[local].double().numpy()
        np.testing.assert_allclose(eager_out.double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_offs_with_a_transposed_view_takes_the_eager_path_with_the_ops_bits():
    # torchtitan's call: cumulative ends, read on the device, and a [G, K, N] view of [G, N, K].
    x = torch.randn(20, 8)
    w = torch.randn(3, 6, 8).transpose(-2, -1)
    offs = torch.tensor([5, 5, 17], dtype=torch.int32)
    eager_out, ops_out = _both_paths(lambda: gt.grouped_mm(x, w, offs=offs))
    assert torch.equal(eager_out, ops_out)
    want = np.zeros((20, 6))
    for g, (begin, end) in enumerate([(0, 5), (5, 5), (5, 17)]):
        want[begin:end] = x[begin:end].double().numpy() @ w[g].double().numpy()
    np.testing.assert_allclose(eager_out.double().numpy(), want, rtol=1e-5, atol=1e-5)
    assert (eager_out[17:] == 0).all()


def test_calls_that_must_see_an_op_do_not_take_the_eager_path():
    x, w, sizes = torch.randn(8, 4), torch.randn(2, 4, 3), torch.tensor([3, 5])
    assert eager.takes_eager_path(x, w, sizes, None, None)
    with _CountCopies():
        assert not eager.takes_eager_path(x, w, sizes, None, None)
    with torch.overrides.TorchFunctionMode():
        assert not eager.takes_eager_path(x, w, sizes, None, None)
    with torch.autograd.forward_ad.dual_level():
        assert not eager.takes_eager_path(x, w, sizes, None, None)
    assert not eager.takes_eager_path(torch.nn.Parameter(x).as_subclass(_Subclass), w, sizes, None, None)
    seen = []
    torch.func.vmap(lambda t: seen.append(eager.takes_eager_path(t, w, sizes, None, None)) or t)(x)
    assert seen == [False]


class _Subclass(torch.Tensor):
    pass


def test_bad_input_raises_the_same_error_on_the_first_and_a_memoised_call():
    x, w = torch.randn(8, 4), torch.randn(2, 4, 3)
    gt.grouped_mm(x, w, torch.tensor([3, 5]))  # memoises this key
    for _ in range(2):
        with pytest.raises(ValueError, match="group_sizes has 3 entries but there are 2 groups"):
            gt.grouped_mm(x, w, torch.tensor([3, 5, 0]))
        with pytest.raises(TypeError, match="weight dtype float64 differs from input dtype float32"):
            gt.grouped_mm(x, w.double(), torch.tensor([3, 5]))


@pytest.mark.parametrize("bad", [True, 2.0])
def test_a_group_offset_a_fresh_call_refuses_is_refused_after_an_int_one_too(bad):
    # True == 1 and 2.0 == 2, with equal hashes: the memo must not take them for the ints.
    x, w, sizes = torch.randn(8, 4), torch.randn(2, 4, 3), torch.tensor([3, 5, 0])
    with pytest.raises(TypeError) as fresh:
        with _CountCopies():  # the ops' own check
            gt.grouped_mm(x, w, sizes, group_offset=bad)
    gt.grouped_mm(x, w, sizes, group_offset=int(bad))  # memoises the int's key
    with pytest.raises(TypeError) as memoised:
        gt.grouped_mm(x, w, sizes, group_offset=bad)
    assert str(memoised.value) == str(fresh.value) and "group_offset" in str(fresh.value)


def test_a_negated_view_is_read_as_its_values():
    x, w, sizes = torch.randn(8, 4), torch.randn(2, 4, 3), torch.tensor([3, 5])
    gt.grouped_mm(x, w, sizes)  # the same key, memoised
    for args in ((torch._neg_view(x), w), (x, torch._neg_view(w))):
        assert args[0].is_neg() or args[1].is_neg()
        eager_out, ops_out = _both_paths(lambda: gt.grouped_mm(*args, sizes))
        assert torch.equal(eager_out, ops_out)
        assert torch.equal(eager_out, gt.grouped_mm(-x, w, sizes))


def test_inference_mode_records_no_graph_even_with_grad_mode_on_inside():
    x, w, sizes = torch.randn(8, 4, requires_grad=True), torch.randn(2, 4, 3, requires_grad=True), torch.tensor([3, 5])
    with torch.inference_mode(), torch.enable_grad():
        eager_out, ops_out = _both_paths(lambda: gt.grouped_mm(x, w, sizes))
        want = torch.mm(x, w[0])  # torch's own op, for what it records here
    for out in (eager_out, ops_out):
        assert out.grad_fn is None and not out.requires_grad and out.is_inference()
    assert want.grad_fn is None and torch.equal(eager_out, ops_out)


def test_a_call_memoised_under_inference_mode_can_record_a_graph_later():
    # The plan keeps the tensor it makes from an int group_offset; made under inference mode
    # (an evaluation pass first), it must still be savable by a later training call.
    x, w, sizes = torch.randn(5, 4), torch.randn(2, 4, 3), torch.tensor([1, 2, 2])
    with torch.inference_mode():
        gt.grouped_mm(x, w, sizes, group_offset=1)
    leaf = w.clone().requires_grad_()
    gt.grouped_mm(x, leaf, sizes, group_offset=1).sum().backward()
    want = torch.zeros_like(w)
    want[0] = x[1:3].sum(0)[:, None].expand(4, 3)  # group 1 (rows 1-2) is the window's first
    want[1] = x[3:5].sum(0)[:, None].expand(4, 3)
    assert torch.equal(leaf.grad, want)


def test_the_cached_workspace_outlives_the_kernels_it_is_handed_to(monkeypatch):
    # On CUDA the plan hands the core the address of the stream's cached workspace; another
    # thread on the stream that grows the cache drops the old buffer, which must stay alive
    # (held by the caller) until the core has enqueued its kernels. Played on the CPU with
    # a stand-in stream, workspace and core.
    import gc
    import weakref

    from groupgemm.torch_ext import device_scratch

    cache = {}

    def workspace(device, nbytes, stream):
        if stream not in cache or cache[stream].numel() < nbytes:
            cache[stream] = torch.empty(nbytes, dtype=torch.uint8)
        return cache[stream]

    monkeypatch.setattr(device_scratch, "stream", lambda device: 7)
    monkeypatch.setattr(device_scratch, "workspace", workspace)
    seen = []

    class Core:
        def run(self, *addresses):
            handed = weakref.ref(cache[7])
            workspace(None, 2 * cache[7].numel(), 7)  # another thread grows the cache
            gc.collect()
            seen.append(handed() is not None and handed().data_ptr() == addresses[-2])

    plan = eager._Plan.__new__(eager._Plan)
    plan.device, plan.cuda, plan.workspace_bytes = torch.device("cpu"), True, 64
    plan.out_shape, plan.out_dtype, plan.forward_core, plan.backward_core = (2, 3), torch.float32, Core(), Core()
    plan.flip, plan.num_groups, plan.bias_dtype = False, 2, None
    x, w, sizes = torch.randn(2, 4), torch.randn(2, 4, 3), torch.tensor([1, 1])
    plan.forward(x, w, sizes, None, None)
    plan.backward(torch.randn(2, 3), x, w, sizes, None, (True, True, False, False))
    assert seen == [True, True]


def _copies_in(fn):
    """The aten ops that copy tensor data, recorded while fn runs (the eager path included:
    the profiler sees every dispatcher call without changing the call's path)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name in COPIES]


def _torchtitan_call(x, w_nk, offs):
    """torchtitan's GroupedExperts: grouped_mm(x, w.transpose(-2, -1), offs=offs), fwd+bwd."""
    out = gt.grouped_mm(x, w_nk.transpose(-2, -1), offs=offs)
    out.backward(torch.ones_like(out))


@pytest.mark.parametrize("call", ["grouped_mm", "offs", "GroupedLinear", "GroupedMLP"])
def test_no_call_copies_a_weight_a_kernel_reads_in_place(call):
    torch.manual_seed(0)
    x = torch.randn(24, 16, dtype=torch.bfloat16, requires_grad=True)
    sizes = torch.tensor([10, 0, 9, 5])
    w_nk = torch.randn(4, 8, 16, dtype=torch.bfloat16, requires_grad=True)  # [G, N, K]
    if call == "grouped_mm":
        dout = torch.ones(24, 8, dtype=torch.bfloat16)
        step = lambda: gt.grouped_mm(x, w_nk.transpose(-2, -1), sizes).backward(dout)
    elif call == "offs":
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        step = lambda: _torchtitan_call(x, w_nk, offs)
    else:
        layer = (gt.GroupedLinear(4, 16, 8, dtype=torch.bfloat16) if call == "GroupedLinear"
                 else gt.GroupedMLP(4, 16, 8, dtype=torch.bfloat16))
        dout = torch.ones(24, 8 if call == "GroupedLinear" else 16, dtype=torch.bfloat16)
        step = lambda: layer(x, sizes).backward(dout)
    assert _copies_in(step) == []  # the eager path
    with _CountCopies() as mode:  # the ops, forward and backward
        step()
    assert mode.copies == []


def test_a_layout_no_kernel_reads_is_copied_once_per_call():
    x = torch.randn(8, 4)
    w = torch.randn(2, 3, 8)[:, :, ::2]  # strided: neither it nor its transpose is contiguous
    sizes = torch.tensor([3, 5])
    with _CountCopies() as mode:
        out = gt.grouped_mm(x, w.transpose(-2, -1).transpose(-2, -1), sizes, transpose_weight=True)
    assert len(mode.copies) == 1
    np.testing.assert_allclose(out.numpy(), gt.grouped_mm(x, w.contiguous(), sizes, transpose_weight=True).numpy())


def test_a_process_using_the_eager_path_exits_without_leak_reports():
    # The memoised plans outlive the interpreter's teardown (and so do the autograd nodes
    # of tensors alive at exit): nanobind must not report them as leaks on every run.
    script = ("import torch, groupgemm.torch as gt\n"
              "x = torch.ones(4, 3, requires_grad=True)\n"
              "y = gt.grouped_mm(x, torch.ones(2, 3, 5), torch.tensor([1, 2]))\n"
              "y.sum().backward()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "leaked" not in proc.stderr, proc.stderr
