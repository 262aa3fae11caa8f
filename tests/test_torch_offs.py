"""grouped_mm with torch._grouped_mm's offs= convention (cumulative group ends): it agrees
with torch._grouped_mm on every non-empty group, forward and backward, in both forms (2d x 3d
and 2d x 2d), and writes exact zeros where torch._grouped_mm leaves memory uninitialised."""

import pytest
import torch

import groupgemm.torch as gt

# torch's forward AD (gradcheck's check_forward_ad) loads its decompositions through torch.jit.script.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

# Cumulative ends over 40 rows (or a contraction of 40): empty groups, rows past offs[-1].
ENDS = {
    "uniform": [10, 20, 30, 40],
    "first_empty": [0, 12, 30, 40],
    "middle_empty": [16, 16, 28, 40],
    "last_empty": [16, 24, 40, 40],
    "rows_past_the_end": [8, 8, 20, 33],
    "all_empty": [0, 0, 0, 0],
    "single_group": [40],
}
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
M, K, N = 40, 16, 24  # strides of 16-byte multiples, as torch._grouped_mm needs on CPU


def _bounds(ends):
    starts = [0, *ends[:-1]]
    return [(lo, hi) for lo, hi in zip(starts, ends)]


def _leaves(dtype, *shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def _run(fn, a, b, offs, dout):
    out = fn(a, b, offs=offs)
    a.grad = b.grad = None
    out.backward(dout)
    return out.detach(), a.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(ENDS))
def test_2d_x_3d_agrees_with_torch_grouped_mm_and_zeroes_rows_past_the_last_end(name, dtype):
    ends = ENDS[name]
    g = len(ends)
    a, b = _leaves(dtype, (M, K), (g, K, N))
    offs = torch.tensor(ends, dtype=torch.int32)
    dout = torch.randn(M, N, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, da, db = _run(gt.grouped_mm, a, b, offs, dout)
    want, want_da, want_db = _run(torch._grouped_mm, a, b, offs, dout)
    for e, (lo, hi) in enumerate(_bounds(ends)):
        torch.testing.assert_close(out[lo:hi], want[lo:hi], **TOLERANCE[dtype])
        torch.testing.assert_close(da[lo:hi], want_da[lo:hi], **TOLERANCE[dtype])
        if hi > lo:
            torch.testing.assert_close(db[e], want_db[e], **TOLERANCE[dtype])
        else:
            assert (db[e] == 0).all()
    assert (out[ends[-1]:] == 0).all() and (da[ends[-1]:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(ENDS))
def test_2d_x_2d_agrees_with_torch_grouped_mm_and_the_contraction_past_the_last_end_adds_nothing(name, dtype):
    ends = ENDS[name]
    rows, cols = 16, 24  # out [G, rows, cols]; the contraction of 40 is ragged
    a, b = _leaves(dtype, (rows, M), (M, cols))
    offs = torch.tensor(ends, dtype=torch.int32)
    dout = torch.randn(len(ends), rows, cols, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, da, db = _run(gt.grouped_mm, a, b, offs, dout)
    want, want_da, want_db = _run(torch._grouped_mm, a, b, offs, dout)
    assert out.shape == (len(ends), rows, cols)
    for e, (lo, hi) in enumerate(_bounds(ends)):
        if hi > lo:
            torch.testing.assert_close(out[e], want[e], **TOLERANCE[dtype])
        else:
            assert (out[e] == 0).all()
        torch.testing.assert_close(da[:, lo:hi], want_da[:, lo:hi], **TOLERANCE[dtype])
        torch.testing.assert_close(db[lo:hi], want_db[lo:hi], **TOLERANCE[dtype])
    assert (da[:, ends[-1]:] == 0).all() and (db[ends[-1]:] == 0).all()


@pytest.mark.parametrize("form", ["2d x 3d", "2d x 2d"])
def test_both_forms_are_differentiable_in_both_operands_by_finite_differences(form):
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    shapes = ((9, 4), (3, 4, 5)) if form == "2d x 3d" else ((5, 9), (9, 4))
    a, b = _leaves(torch.float64, *shapes)
    assert torch.autograd.gradcheck(lambda a, b: gt.grouped_mm(a, b, offs=offs), (a, b), check_forward_ad=True)


def test_offs_gives_the_bits_of_the_group_sizes_it_stands_for():
    a, b, bias = _leaves(torch.float32, (12, 8), (4, 8, 8), (4, 8))
    offs = torch.tensor([5, 3, 9, 11], dtype=torch.int32)  # decreasing: the second group is empty
    sizes = torch.tensor([5, -2, 6, 2])
    assert torch.equal(gt.grouped_mm(a, b, None, bias, offs=offs), gt.grouped_mm(a, b, sizes, bias))
    window = dict(group_offset=1, transpose_weight=True)
    assert torch.equal(gt.grouped_mm(a, b[:2], offs=offs, **window), gt.grouped_mm(a, b[:2], sizes, **window))


@pytest.mark.parametrize("form", ["2d x 3d", "2d x 2d"])
def test_offs_compiles_with_fullgraph_and_matches_eager(form):
    torch._dynamo.reset()
    shapes = ((12, 8), (3, 8, 8)) if form == "2d x 3d" else ((8, 12), (12, 8))
    a, b = _leaves(torch.float32, *shapes)

    def forward(a, b, offs):
        return gt.grouped_mm(a, b, offs=offs).square().sum()

    compiled = torch.compile(forward, fullgraph=True)
    for ends in ([4, 4, 10], [0, 12, 12]):
        offs = torch.tensor(ends, dtype=torch.int32)
        loss, want = compiled(a, b, offs), forward(a, b, offs)
        torch.testing.assert_close(loss, want)
        for got, expected in zip(torch.autograd.grad(loss, (a, b)), torch.autograd.grad(want, (a, b))):
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(group_sizes=torch.tensor([4, 4, 4]), offs=torch.tensor([4, 8, 12])), TypeError,
     "pass group_sizes or offs .*, not both"),
    (dict(), TypeError, "group_sizes \\(or offs, the cumulative group ends\\) is required"),
    (dict(offs=torch.tensor([[4, 8, 12]])), ValueError, "offs must be 1-D"),
    (dict(offs=torch.tensor([4.0, 8.0, 12.0])), TypeError, "offs must be an integer"),
    (dict(offs=torch.tensor([4, 12])), ValueError, "offs has 2 entries but there are 3 groups"),
    (dict(offs=torch.tensor([4, 8, 12], device="meta")), ValueError, "offs is on meta but the inputs are on cpu"),
    (dict(offs=[4, 8, 12]), TypeError, "offs must be a 1-D integer tensor"),
])
def test_bad_offs_raise_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=f"grouped_mm: {match}"):
        gt.grouped_mm(torch.randn(12, 8), torch.randn(3, 8, 4), **kwargs)


@pytest.mark.parametrize("weight_shape, kwargs, match", [
    ((12, 4), dict(bias=torch.randn(3, 4)), "bias does not apply to the 2d x 2d form"),
    ((12, 4), dict(transpose_weight=True), "transpose_weight does not apply to the 2d x 2d form"),
    ((4, 12), dict(transpose_weight=True), "transpose_weight does not apply to the 2d x 2d form"),  # laid out for it
    ((12, 4), dict(group_offset=0), "group_offset does not apply to the 2d x 2d form"),
])
def test_the_2d_x_2d_form_refuses_what_does_not_apply_to_it(weight_shape, kwargs, match):
    with pytest.raises(ValueError, match=f"grouped_mm: {match}"):
        gt.grouped_mm(torch.randn(8, 12), torch.randn(weight_shape), offs=torch.tensor([4, 8, 12]), **kwargs)


def test_the_2d_x_2d_form_checks_its_contraction():
    with pytest.raises(ValueError, match=r"weight shape \(10, 4\) does not contract with input shape \(8, 12\)"):
        gt.grouped_mm(torch.randn(8, 12), torch.randn(10, 4), offs=torch.tensor([4, 8, 12]))
