"""The core through groupgemm._core, against the float64 NumPy reference.

torch tensors serve only as DLPack containers here (NumPy has no bfloat16 export).
"""

import os

import numpy as np
import pytest
import reference as ref
import torch
import torch_frontend
from bad_inputs import BAD_INPUTS, base_arguments
from cases import CASE_IDS, CASES, DTYPES, inputs, round_to
from cases import case as named_case
from workers import run_code

import groupgemm._core as core

FLOAT32_OUTPUT_CASES = ["uniform", "skewed", "first_empty", "middle_empty", "last_empty", "all_empty"]


def torch_dtype(name):
    return getattr(torch, name)


def tensor(x, dtype_name):
    return torch.from_numpy(np.ascontiguousarray(x, np.float64)).to(torch_dtype(dtype_name))


def dirty(shape, dtype):
    """Output memory full of NaN: whatever the core does not write stays visible."""
    return torch.full(shape, float("nan"), dtype=dtype)


def offset_arg(case):
    return None if case.group_offset is None else torch.tensor(case.group_offset, dtype=torch.int32)


def as_np(t):
    return t.to(torch.float64).numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["KN", "NK"])
def test_forward_matches_reference_and_zeroes_padding(case, dtype, with_bias, transpose_rhs):
    x = inputs(case)
    lhs, rhs, bias = (round_to(x[k], dtype) for k in ("lhs", "rhs", "bias"))
    rhs_stored = rhs.transpose(0, 2, 1) if transpose_rhs else rhs
    out = dirty((case.m, case.n), torch_dtype(dtype))
    core.grouped_matmul(tensor(lhs, dtype), tensor(rhs_stored, dtype), torch.from_numpy(x["group_sizes"]),
                        group_offset=offset_arg(case), bias=tensor(bias, dtype) if with_bias else None, out=out,
                        transpose_rhs=transpose_rhs)
    expected = ref.grouped_matmul(lhs, rhs_stored, x["group_sizes"], bias if with_bias else None,
                                  transpose_rhs, case.offset)
    ref.assert_close(as_np(out), expected, dtype, case.name)
    pad = ref.padding_rows(x["group_sizes"], case.m, case.g, case.offset)
    assert (out[torch.from_numpy(pad)] == 0).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", FLOAT32_OUTPUT_CASES)
def test_forward_writes_float32_output_for_16bit_inputs(name, dtype):
    case = named_case(name)
    x = inputs(case)
    lhs, rhs = round_to(x["lhs"], dtype), round_to(x["rhs"], dtype)
    out = dirty((case.m, case.n), torch.float32)
    core.grouped_matmul(tensor(lhs, dtype), tensor(rhs, dtype), torch.from_numpy(x["group_sizes"]), out=out)
    expected = ref.grouped_matmul(lhs, rhs, x["group_sizes"])
    ref.assert_close(as_np(out), expected, "float32" if dtype == "float16" else "float16", case.name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_wgrad_matches_reference_and_zeroes_empty_groups(case, dtype):
    x = inputs(case)
    lhs, dout = round_to(x["lhs"], dtype), round_to(x["dout"], dtype)
    out = dirty((case.g, case.k, case.n), torch_dtype(dtype))
    core.grouped_matmul_wgrad(tensor(lhs, dtype), tensor(dout, dtype), torch.from_numpy(x["group_sizes"]),
                              group_offset=offset_arg(case), out=out)
    expected = ref.grouped_matmul_wgrad(lhs, dout, x["group_sizes"], case.g, case.offset)
    ref.assert_close(as_np(out), expected, dtype, case.name)
    for g in ref.empty_groups(x["group_sizes"], case.m, case.g, case.offset):
        assert (out[g] == 0).all(), f"empty group {g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_wgrad_accumulate_leaves_empty_groups_bitwise_unchanged(case, dtype):
    x = inputs(case)
    lhs, dout = round_to(x["lhs"], dtype), round_to(x["dout"], dtype)
    acc_dtype = torch.float64 if dtype == "float64" else torch.float32
    acc = torch.from_numpy(x["acc"]).to(acc_dtype)
    before = acc.clone()
    core.grouped_matmul_wgrad(tensor(lhs, dtype), tensor(dout, dtype), torch.from_numpy(x["group_sizes"]),
                              group_offset=offset_arg(case), accumulate_into=acc, out=acc, accumulate=True)
    expected = ref.grouped_matmul_wgrad(lhs, dout, x["group_sizes"], case.g, case.offset,
                                        accumulate_into=as_np(before))
    ref.assert_close(as_np(acc), expected, "float64" if dtype == "float64" else "float32", case.name)
    for g in ref.empty_groups(x["group_sizes"], case.m, case.g, case.offset):
        assert torch.equal(acc[g].view(torch.int32 if acc_dtype == torch.float32 else torch.int64),
                           before[g].view(torch.int32 if acc_dtype == torch.float32 else torch.int64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bias_grad_matches_reference_and_zeroes_empty_groups(case, dtype):
    x = inputs(case)
    dout = round_to(x["dout"], dtype)
    out = dirty((case.g, case.n), torch_dtype(dtype))
    core.grouped_bias_grad(tensor(dout, dtype), torch.from_numpy(x["group_sizes"]), group_offset=offset_arg(case),
                           out=out)
    expected = ref.grouped_bias_grad(dout, x["group_sizes"], case.g, case.offset)
    ref.assert_close(as_np(out), expected, dtype, case.name)
    for g in ref.empty_groups(x["group_sizes"], case.m, case.g, case.offset):
        assert (out[g] == 0).all()


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32", "accumulate"])
def test_bfloat16_wgrad_of_long_groups(out_dtype):
    # The bfloat16 weight gradient runs the contraction in chunks of at most 2048 rows,
    # the last one padded with zero rows to a multiple of 64: groups longer than a chunk,
    # of exactly one chunk, and one row over it.
    rng = np.random.default_rng(5)
    sizes = np.array([4300, 0, 64, 2048, 2049, 7], np.int32)
    m, k, n = int(sizes.sum()), 16, 24
    lhs, dout = (round_to(rng.standard_normal(s), "bfloat16") for s in ((m, k), (m, n)))
    before = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    out = (torch.from_numpy(before.copy()) if out_dtype == "accumulate"
           else dirty((len(sizes), k, n), torch_dtype(out_dtype)))
    core.grouped_matmul_wgrad(tensor(lhs, "bfloat16"), tensor(dout, "bfloat16"), torch.from_numpy(sizes), out=out,
                              accumulate_into=out if out_dtype == "accumulate" else None,
                              accumulate=out_dtype == "accumulate")
    expected = ref.grouped_matmul_wgrad(lhs, dout, sizes, len(sizes),
                                        accumulate_into=before if out_dtype == "accumulate" else None)
    ref.assert_close(as_np(out), expected, "bfloat16" if out_dtype == "bfloat16" else "float32", "long groups")
    if out_dtype == "accumulate":
        assert torch.equal(out[1].view(torch.int32), torch.from_numpy(before[1]).view(torch.int32))
    else:
        assert (out[1] == 0).all()


def test_large_accumulate_buffer_keeps_its_contents():
    # Outputs of 16 MiB and more get huge-page advice before they are written; the
    # buffer's contents must come through it: the empty group bit for bit, the others
    # added to.
    rng = np.random.default_rng(6)
    sizes = np.array([5, 0, 3, 2], np.int32)
    k, n = 2048, 1024
    lhs, dout = rng.standard_normal((10, k)), rng.standard_normal((10, n))
    before = rng.standard_normal((4, k, n)).astype(np.float32)  # 32 MiB
    acc = torch.from_numpy(before.copy())
    core.grouped_matmul_wgrad(tensor(lhs, "float32"), tensor(dout, "float32"), torch.from_numpy(sizes), out=acc,
                              accumulate_into=acc, accumulate=True)
    expected = ref.grouped_matmul_wgrad(round_to(lhs, "float32"), round_to(dout, "float32"), sizes, 4,
                                        accumulate_into=before)
    ref.assert_close(as_np(acc), expected, "float32", "large buffer")
    assert torch.equal(acc[1].view(torch.int32), torch.from_numpy(before[1]).view(torch.int32))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_group_sizes_and_offset_accept_int32_and_int64(index_dtype):
    case = named_case("window_start")
    x = inputs(case)
    out = dirty((case.m, case.n), torch.float64)
    core.grouped_matmul(tensor(x["lhs"], "float64"), tensor(x["rhs"], "float64"),
                        torch.from_numpy(x["group_sizes"]).to(index_dtype),
                        group_offset=torch.tensor(case.offset, dtype=index_dtype), out=out)
    np.testing.assert_allclose(as_np(out), ref.grouped_matmul(x["lhs"], x["rhs"], x["group_sizes"],
                                                              group_offset=case.offset), atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_call_gives_same_bits(dtype):
    rng = np.random.default_rng(3)
    sizes = torch.tensor([100, 0, 37, 300, 91], dtype=torch.int32)
    lhs = tensor(rng.standard_normal((528, 256)), dtype)
    rhs = tensor(rng.standard_normal((5, 256, 192)), dtype)
    dout = tensor(rng.standard_normal((528, 192)), dtype)
    outs, wgrads = [], []
    for _ in range(3):
        out = torch.empty(528, 192, dtype=torch_dtype(dtype))
        core.grouped_matmul(lhs, rhs, sizes, out=out)
        w = torch.empty(5, 256, 192, dtype=torch_dtype(dtype))
        core.grouped_matmul_wgrad(lhs, dout, sizes, out=w)
        outs.append(out.view(torch.int16 if dtype == "bfloat16" else torch.int32))
        wgrads.append(w.view(torch.int16 if dtype == "bfloat16" else torch.int32))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(torch.equal(wgrads[0], w) for w in wgrads[1:])


@pytest.mark.parametrize("sizes, k, n", [([40, 0, 75, 33, 64, 1, 90, 57], 128, 96),
                                         ([171, 0, 107, 71, 58, 2, 0, 2], 128, 96),
                                         ([30000, 200, 5], 64, 32), ([400], 32, 64), ([4096], 1024, 64),
                                         ([8192], 512, 8), ([2048, 0], 32, 32), ([1001, 20, 20, 20], 64, 64)],
                         ids=["small_groups", "skewed", "long_contraction", "one_short_group", "one_long_group",
                              "router", "one_of_two_groups", "one_hot_group"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_groups_give_the_single_thread_bits_however_the_threads_share_them(dtype, sizes, k, n):
    # With several threads, small groups run concurrently, one thread each, and (skewed
    # routing, one group) the largest alone on all threads first: the bits must be those
    # of a single-threaded run, whichever threads ran which group. A weight gradient with a
    # small output and a long contraction is where a kernel could split the sums across
    # threads (both of oneDNN's bfloat16 weight-gradient kernels do: they run on one thread;
    # the last three cases differed, brgemm's contraction split while the group ran alone).
    # A group's GEMM is never cut into blocks of rows: on an AVX2 CPU, oneDNN's float32
    # kernel gave some rows of one_hot_group other bits in a block than in the whole GEMM.
    rng = np.random.default_rng(4)
    sizes = torch.tensor(sizes, dtype=torch.int32)
    m = int(sizes.sum())
    lhs = tensor(rng.standard_normal((m, k)), dtype)
    rhs = tensor(rng.standard_normal((len(sizes), k, n)), dtype)
    dout = tensor(rng.standard_normal((m, n)), dtype)
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    results = []
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 2):
            torch.set_num_threads(num_threads)
            out = torch.empty(m, n, dtype=torch_dtype(dtype))
            core.grouped_matmul(lhs, rhs, sizes, out=out)
            w = torch.empty(len(sizes), k, n, dtype=torch_dtype(dtype))
            core.grouped_matmul_wgrad(lhs, dout, sizes, out=w)
            results.append((out.view(bits), w.view(bits)))
    finally:
        torch.set_num_threads(threads)
    for out, w in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(w, results[0][1])


# A process's weight gradients, hashed: bfloat16 ones of long contractions (one group alone,
# or one of two with the other empty), in bfloat16 and accumulated into float32; float64.
# And float32 / float16 / bfloat16 products with the weight stored [N, K] (nn.Linear's
# layout), one group alone: on AVX-512 oneDNN's float32 kernel gave them other bits on one
# thread than on two, so the core multiplies such a weight row-major (bfloat16's too, where
# it runs widened to float32).
THREADS_SCRIPT = """
import hashlib, sys, numpy as np, torch
import groupgemm._core as core
rng, digest = np.random.default_rng(0), hashlib.sha256()
for m, k, n, dtype in ((2048, 1024, 384, torch.float32), (64, 900, 200, torch.float32),
                       (3000, 1024, 384, torch.float16), (2048, 1024, 384, torch.bfloat16),
                       (64, 900, 200, torch.bfloat16)):
    lhs = torch.from_numpy(rng.standard_normal((m, k))).to(dtype)
    rhs = torch.from_numpy(rng.standard_normal((1, n, k)) / 32).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    core.grouped_matmul(lhs, rhs, torch.tensor([m], dtype=torch.int32), out=out, transpose_rhs=True)
    digest.update(out.view(torch.uint8).numpy().tobytes())
for sizes, k, n, dtype in (([4096], 1024, 64, torch.bfloat16), ([8192], 512, 8, torch.bfloat16),
                           ([2048, 0], 32, 32, torch.bfloat16), ([600], 256, 192, torch.float64)):
    m = sum(sizes)
    lhs = torch.from_numpy(rng.standard_normal((m, k))).to(dtype)
    dout = torch.from_numpy(rng.standard_normal((m, n))).to(dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    for out, accumulate in ((torch.empty(len(sizes), k, n, dtype=dtype), False),
                            (torch.zeros(len(sizes), k, n, dtype=wide), True)):
        core.grouped_matmul_wgrad(lhs, dout, torch.tensor(sizes, dtype=torch.int32), out=out, accumulate=accumulate,
                                  accumulate_into=out if accumulate else None)
        digest.update(out.view(torch.uint8).numpy().tobytes())
print(digest.hexdigest())
"""


def test_weight_gradients_and_transposed_weights_have_the_same_bits_in_processes_of_any_thread_count():
    # oneDNN fixes a primitive's threading when it creates it, so only fresh processes show
    # it: its bfloat16 brgemm split these contractions across two threads (in-process thread
    # changes reuse the first primitive), as OpenBLAS did float64's. They run on one thread.
    # With oneDNN held to AVX-512 without bfloat16 instructions, an AVX-512 CPU runs bfloat16
    # widened to float32 (backends.md), whatever its own bfloat16 kernels.
    def digest(threads, **isa):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **isa)
        return run_code(THREADS_SCRIPT, timeout=300, env=env).stdout.strip()

    assert digest(1) == digest(2) == digest(3)
    assert digest(1, ONEDNN_MAX_CPU_ISA="AVX512_CORE") == digest(2, ONEDNN_MAX_CPU_ISA="AVX512_CORE")


def test_errors_name_the_argument():
    lhs = torch.zeros(4, 3)
    rhs = torch.zeros(2, 3, 5)
    sizes = torch.tensor([2, 2], dtype=torch.int32)
    out = torch.zeros(4, 5)
    with pytest.raises(ValueError, match="group_sizes has 3 entries"):
        core.grouped_matmul(lhs, rhs, torch.tensor([1, 1, 2], dtype=torch.int32), out=out)
    with pytest.raises(ValueError, match="fewer than the 2 local groups"):
        core.grouped_matmul(lhs, rhs, torch.tensor([4], dtype=torch.int32),
                            group_offset=torch.tensor(0, dtype=torch.int32), out=out)
    with pytest.raises(TypeError, match="rhs must have the dtype of lhs"):
        core.grouped_matmul(lhs, rhs.double(), sizes, out=out)
    with pytest.raises(ValueError, match="rhs dimension 1"):
        core.grouped_matmul(lhs, torch.zeros(2, 4, 5), sizes, out=out)
    with pytest.raises(ValueError, match="lhs must have rank 2"):
        core.grouped_matmul(lhs[None], rhs, sizes, out=out)
    with pytest.raises(TypeError, match="group_sizes must be int32 or int64"):
        core.grouped_matmul(lhs, rhs, sizes.float(), out=out)
    with pytest.raises(ValueError, match="group_offset must be a scalar"):
        core.grouped_matmul(lhs, rhs, sizes, group_offset=torch.tensor([0, 1], dtype=torch.int32), out=out)
    with pytest.raises(ValueError, match="output dtype float64 is not allowed"):
        core.grouped_matmul(lhs, rhs, sizes, out=out.double())
    with pytest.raises(TypeError, match="grouped_matmul: no argument bogus"):
        core.grouped_matmul(lhs, rhs, sizes, out=out, bogus=1)
    with pytest.raises(TypeError, match="grouped_matmul: out must be given"):
        core.grouped_matmul(lhs, rhs, sizes)
    with pytest.raises(TypeError, match="grouped_matmul: out given twice"):
        core.grouped_matmul(lhs, rhs, sizes, None, None, out, out=out)
    with pytest.raises(TypeError, match="grouped_matmul: lhs must be C-contiguous"):
        core.grouped_matmul(torch.zeros(3, 4).T, rhs, sizes, out=out)
    with pytest.raises(ValueError, match="accumulate_into must be float32"):
        bf16_sums = torch.zeros(2, 3, 5).bfloat16()
        core.grouped_matmul_wgrad(lhs.bfloat16(), torch.zeros(4, 5).bfloat16(), sizes, accumulate_into=bf16_sums,
                                  out=bf16_sums, accumulate=True)


class _CoreCalls:
    """groupgemm._core called directly (torch tensors as DLPack containers), with the call
    surface of the bad-input table: the C++ checks behind the frontends' checks."""

    array, cast = staticmethod(torch_frontend.array), staticmethod(torch_frontend.cast)

    @staticmethod
    def matmul(lhs, rhs, sizes, *, bias=None, transpose=False, offset=None, out_dtype=None):
        n = rhs.shape[1 if transpose and rhs.dim() == 3 else -1]
        out = torch.empty((lhs.shape[0], n), dtype=torch_dtype(out_dtype) if out_dtype else lhs.dtype)
        offset = torch.tensor(offset) if isinstance(offset, int) else offset
        core.grouped_matmul(lhs, rhs, sizes, group_offset=offset, bias=bias, out=out, transpose_rhs=transpose)

    @staticmethod
    def wgrad(lhs, grad, sizes, num_groups, *, offset=None, accumulate_into=None, out_dtype=None):
        out = torch.empty((num_groups, lhs.shape[-1], grad.shape[-1]), dtype=lhs.dtype) \
            if accumulate_into is None else accumulate_into
        core.grouped_matmul_wgrad(lhs, grad, sizes, accumulate_into=accumulate_into, out=out,
                                  accumulate=accumulate_into is not None)


CORE_ROWS = [r for r in BAD_INPUTS if r.core]


def assert_core_refuses(row, calls):
    """The row's call one layer down raises TypeError or ValueError with a message that
    names the argument as the core does (the row's core pattern)."""
    with pytest.raises((TypeError, ValueError), match=row.core):
        row.call(calls, base_arguments(calls))


@pytest.mark.parametrize("row", CORE_ROWS, ids=[r.id for r in CORE_ROWS])
def test_core_refuses_what_the_frontends_refuse(row):
    # The same calls as the frontends' bad-input table, one layer down: the core names
    # the argument in its own words (the row's core pattern); its exception type may be
    # the other of TypeError and ValueError.
    assert_core_refuses(row, _CoreCalls)


class _NamelessCore(_CoreCalls):
    """A planted fault: a core that refuses everything with a message naming nothing."""

    @staticmethod
    def matmul(*args, **kwargs):
        raise ValueError("invalid argument")

    wgrad = matmul


@pytest.mark.parametrize("row", CORE_ROWS, ids=[r.id for r in CORE_ROWS])
def test_the_core_refusal_check_fails_on_a_message_that_names_no_argument(row):
    with pytest.raises(AssertionError, match="Regex pattern did not match"):
        assert_core_refuses(row, _NamelessCore)
