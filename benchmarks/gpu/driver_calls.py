"""The calls the sanitizer driver makes, and which CUDA kernels of the core each reaches.

The rules below restate the CUDA backend's call sequence in core_cuda/ (which calls return
before any launch, when the bias goes into the GEMM epilogue, when 16-bit operands take
the unaligned kernel), so the driver can prove it reached every kernel and every CUTLASS
instantiation, and a CPU test can check that the planned calls over the planned cases
do. Standard library only.
"""

import dataclasses

SETUP, FILL, LATE_BIAS, ZERO_EMPTY, BIAS_GRAD = (
    "setup kernel", "fill kernel", "late-bias kernel", "empty-group zero kernel", "bias-grad kernel")
CUTLASS, UNALIGNED = "cutlass", "unaligned"
LAYOUTS = ("row_row", "row_col", "col_row")  # forward [G,K,N], forward [G,N,K], wgrad
DTYPES = ("float32", "bfloat16", "float16")
SIXTEEN_BIT = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Call:
    kind: str  # "forward", "wgrad" or "bias_grad"
    dtype: str  # input dtype
    out_dtype: str
    bias: bool = False
    transpose: bool = False  # rhs stored [G, N, K]
    accumulate: bool = False  # wgrad into a float32 buffer
    misaligned: bool = False  # lhs a view one element into its storage (not 16-byte aligned)

    @property
    def name(self):
        flags = [f for f, on in (("bias", self.bias), ("transposed", self.transpose),
                                 ("accumulate", self.accumulate), ("misaligned", self.misaligned)) if on]
        return "/".join([self.kind, f"{self.dtype}->{self.out_dtype}", *flags])


def calls_for(dtype):
    """Every call made per case and input dtype: both output dtypes, all three layouts,
    bias in the epilogue and added afterwards, accumulation, a misaligned operand."""
    wide = "float32"
    planned = [
        Call("forward", dtype, dtype),
        Call("forward", dtype, dtype, transpose=True),
        Call("forward", dtype, dtype, bias=True, transpose=True),  # bias in the epilogue (beta = 1)
        Call("forward", dtype, wide, bias=True),  # 16-bit in, float32 out: the late-bias kernel
        Call("forward", dtype, wide, transpose=True),
        Call("wgrad", dtype, dtype),
        Call("wgrad", dtype, wide),
        Call("wgrad", dtype, wide, accumulate=True),
        Call("bias_grad", dtype, dtype),
        Call("bias_grad", dtype, wide),
    ]
    if dtype in SIXTEEN_BIT:
        planned.append(Call("forward", dtype, dtype, misaligned=True))
    return list(dict.fromkeys(planned))  # float32 has one output dtype: drop repeats


def kernels_reached(call, m, k, n, groups, busy, has_empty):
    """The kernels `call` launches with real work on a problem of M, K, N, `groups` local
    groups, `busy` when some local group owns rows and `has_empty` when some owns none."""
    reached = set()
    if call.kind == "forward":
        if m == 0 or n == 0:
            return reached  # the output is empty: nothing is launched
        reached |= {SETUP, FILL}
        if k == 0 or groups == 0 or not busy:
            return reached
        in_epilogue = call.bias and call.out_dtype == call.dtype
        layout = "row_col" if call.transpose else "row_row"
        reached.add(_gemm(call, k, n, layout, beta=1 if in_epilogue else 0))
        if call.bias and not in_epilogue:
            reached.add(LATE_BIAS)
        return reached
    if call.kind == "wgrad":
        if groups == 0 or k == 0 or n == 0:
            return reached
        reached.add(SETUP)
        if not call.accumulate and has_empty:
            reached.add(ZERO_EMPTY)
        if m > 0 and busy:
            reached.add(_gemm(call, k, n, "col_row", beta=1 if call.accumulate else 0))
        return reached
    if call.kind == "bias_grad":
        return reached if groups == 0 or n == 0 else {SETUP, BIAS_GRAD}
    raise ValueError(f"unknown call kind {call.kind!r}")


def _gemm(call, k, n, layout, beta):
    aligned = call.dtype == "float32" or (k % 8 == 0 and n % 8 == 0 and not call.misaligned)
    return (CUTLASS if aligned else UNALIGNED, call.dtype, call.out_dtype, layout, beta)


def required_kernels():
    """What the driver must reach: the small kernels, every CUTLASS instantiation (input x
    output dtype x layout) without and with a C operand, the same for the unaligned kernel."""
    required = {SETUP, FILL, LATE_BIAS, ZERO_EMPTY, BIAS_GRAD}
    for dtype in DTYPES:
        outs = [dtype] + (["float32"] if dtype in SIXTEEN_BIT else [])
        kinds = [CUTLASS] + ([UNALIGNED] if dtype in SIXTEEN_BIT else [])
        for kind in kinds:
            required |= {(kind, dtype, out, layout, 0) for out in outs for layout in LAYOUTS}
            required.add((kind, dtype, dtype, "row_col", 1))  # bias in the epilogue
            required.add((kind, dtype, "float32", "col_row", 1))  # accumulate
    return required


def describe(kernel):
    if isinstance(kernel, str):
        return kernel
    kind, dtype, out, layout, beta = kernel
    return f"{kind} {dtype}->{out} {layout}" + (" +C" if beta else "")
