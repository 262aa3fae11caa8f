"""The calls the sanitizer driver makes, and which CUDA kernels of the core each reaches.

The rules below restate the CUDA backend's call sequence in core_cuda/ (which calls return
before any launch, when the bias goes into the GEMM epilogue, when 16-bit operands take
the unaligned kernel; for the expert layer, which of permute's steps run, the chunk count
and when its scans span several tiles, which (values, probs) instantiation unpermute
takes), so the driver can prove it reached every kernel and every CUTLASS instantiation,
and a CPU test can check that the planned calls over the planned cases do. Standard
library only.
"""

import dataclasses
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import kernel_table  # noqa: E402
from contenders import SM90_TILES  # noqa: E402

# The setup kernel also writes what no GEMM writes (padding rows, K = 0 rows, bias rows of a
# float32 output, empty groups' weight gradients).
SETUP, BIAS_GRAD = "setup kernel", "bias-grad kernel"
CUTLASS, UNALIGNED = "cutlass", "unaligned"
# The GROUPGEMM_CUDA_KERNEL values the sanitizer driver runs: CUTLASS 2.x (every GPU), and
# CUTLASS 3.x (sm_90a, Hopper only) held to each of its tiles in turn, so that every
# instantiation runs whatever the shapes (by itself, "sm90" lets each call's shape choose).
FAMILIES = ("sm80", *SM90_TILES)
# What tests/test_cuda.py runs every GEMM test under (its gemm_kernel fixture's ids, which
# the GPU kit reads back from failed tests): GROUPGEMM_CUDA_KERNEL unset (on Hopper the
# kernel table's choice per call), the 2.x kernels, the sm90 kernels by the table's shape
# rule, and each tile.
DEFAULT_KERNEL = kernel_table.DEFAULT_KERNEL
TEST_KERNELS = (DEFAULT_KERNEL, "sm80", "sm90", *SM90_TILES)


def families_on(compute_capability):
    """The kernel families a GPU of this (major, minor) runs: sm_90a code runs on 9.0 only."""
    return FAMILIES if tuple(compute_capability) == (9, 0) else FAMILIES[:1]


def is_sm90(family):
    return family in SM90_TILES


def cutlass_kind(family):
    """The kind of GEMM kernel a tensor-core call runs under `family`: "cutlass" for the
    2.x kernels, "cutlass sm90_128x256" and so on for the 3.x kernels of one tile."""
    return f"{CUTLASS} {family}" if is_sm90(family) else CUTLASS


LAYOUTS = ("row_row", "row_col", "col_row")  # forward [G,K,N], forward [G,N,K], wgrad
DTYPES = ("float32", "bfloat16", "float16")
SIXTEEN_BIT = ("bfloat16", "float16")


# What a GEMM adds to A B (call_sequence.h's GemmC): nothing, its group's bias row (the
# sm90 kernels' bias epilogue; a broadcast C row on 2.x), or the output itself (an
# accumulator, or bias rows the setup wrote into a float32 output).
NO_C, BIAS_ROW, OUTPUT_C = "", "+bias", "+C"


@dataclasses.dataclass(frozen=True)
class Call:
    kind: str  # "forward", "wgrad", "bias_grad" or "backward" (dlhs, drhs and, with bias, dbias)
    dtype: str  # input dtype
    out_dtype: str  # forward, wgrad and bias_grad: the output's; backward: drhs's and dbias's
    bias: bool = False  # forward: a bias; backward: a bias gradient
    transpose: bool = False  # rhs stored [G, N, K]
    accumulate: bool = False  # wgrad (backward: drhs) into a float32 buffer
    misaligned: bool = False  # lhs a view one element into its storage (not 16-byte aligned)

    @property
    def name(self):
        flags = [f for f, on in (("bias", self.bias), ("transposed", self.transpose),
                                 ("accumulate", self.accumulate), ("misaligned", self.misaligned)) if on]
        return "/".join([self.kind, f"{self.dtype}->{self.out_dtype}", *flags])


def calls_for(dtype):
    """Every call made per case and input dtype: both output dtypes, all three layouts,
    bias in the epilogue and written by the setup, accumulation, the backward's one call, a
    misaligned operand."""
    wide = "float32"
    planned = [
        Call("forward", dtype, dtype),
        Call("forward", dtype, dtype, transpose=True),
        Call("forward", dtype, dtype, bias=True),  # bias in the epilogue
        Call("forward", dtype, dtype, bias=True, transpose=True),
        Call("forward", dtype, wide),
        Call("forward", dtype, wide, bias=True),  # 16-bit in, float32 out: bias rows written by the setup
        Call("forward", dtype, wide, transpose=True),
        Call("wgrad", dtype, dtype),
        Call("wgrad", dtype, wide),
        Call("wgrad", dtype, wide, accumulate=True),
        Call("bias_grad", dtype, dtype),
        Call("bias_grad", dtype, wide),
        Call("backward", dtype, dtype, bias=True),
        Call("backward", dtype, wide, transpose=True, accumulate=True),
    ]
    if dtype in SIXTEEN_BIT:
        planned.append(Call("forward", dtype, dtype, misaligned=True))
    return list(dict.fromkeys(planned))  # float32 has one output dtype: drop repeats


def kernels_reached(call, m, k, n, groups, busy, family="sm80"):
    """The kernels `call` launches with real work on a problem of M, K, N, `groups` local
    groups, `busy` when some local group owns rows, with the GEMM kernel `family` chosen
    (call_sequence.h)."""
    reached = set()
    gemms = busy and groups > 0 and m > 0
    if call.kind == "forward":
        if m == 0 or n == 0:
            return reached  # the output is empty: nothing is launched
        reached.add(SETUP)
        if k > 0 and gemms:
            c = (BIAS_ROW if call.out_dtype == call.dtype else OUTPUT_C) if call.bias else NO_C
            reached.add(_gemm(call, call.out_dtype, k, n, "row_col" if call.transpose else "row_row", c, family))
        return reached
    if call.kind == "wgrad":
        if groups == 0 or k == 0 or n == 0:
            return reached
        reached.add(SETUP)
        if gemms:
            reached.add(_gemm(call, call.out_dtype, k, n, "col_row", OUTPUT_C if call.accumulate else NO_C, family))
        return reached
    if call.kind == "bias_grad":
        return reached if groups == 0 or n == 0 else {SETUP, BIAS_GRAD}
    if call.kind == "backward":
        dlhs, drhs, dbias = m > 0 and k > 0, groups > 0 and k > 0 and n > 0, call.bias and groups > 0 and n > 0
        if not (dlhs or drhs or dbias):
            return reached
        reached.add(SETUP)
        if dlhs and n > 0 and gemms:  # dlhs = grad @ rhs[g]^T: K and N swap, so does the layout
            reached.add(_gemm(call, call.dtype, n, k, "row_row" if call.transpose else "row_col", NO_C, family))
        if drhs and gemms:
            kw, nw = (n, k) if call.transpose else (k, n)
            reached.add(_gemm(call, call.out_dtype, kw, nw, "col_row", OUTPUT_C if call.accumulate else NO_C, family))
        if dbias:
            reached.add(BIAS_GRAD)
        return reached
    raise ValueError(f"unknown call kind {call.kind!r}")


def _gemm(call, out_dtype, k, n, layout, c, family):
    aligned = call.dtype == "float32" or (k % 8 == 0 and n % 8 == 0 and not call.misaligned)
    return (_kind(CUTLASS if aligned else UNALIGNED, call.dtype, family), call.dtype, out_dtype, layout, c)


def _kind(kind, dtype, family):
    """Which kernel runs a tensor-core GEMM under `family` (core_cuda/src/kernel_choice.h's
    sm90_runs): the 3.x kernels take every aligned 16-bit GEMM; the rest stays on 2.x."""
    sm90 = is_sm90(family) and kind == CUTLASS and dtype in SIXTEEN_BIT
    return cutlass_kind(family) if sm90 else kind


def required_kernels(family="sm80"):
    """What the driver must reach: the small kernels, every GEMM instantiation (input x
    output dtype x layout) without C, with a forward's bias row (both forward layouts), with
    C = D (an accumulator; bias rows of a float32 output), the same for the unaligned kernel;
    under an sm90 family, that tile's 3.x kernels in place of the 2.x ones they take over."""
    required = {SETUP, BIAS_GRAD}
    for dtype in DTYPES:
        outs = [dtype] + (["float32"] if dtype in SIXTEEN_BIT else [])
        kinds = [CUTLASS] + ([UNALIGNED] if dtype in SIXTEEN_BIT else [])
        for kind in kinds:
            gemms = {(dtype, out, layout, NO_C) for out in outs for layout in LAYOUTS}
            gemms |= {(dtype, dtype, layout, BIAS_ROW) for layout in ("row_row", "row_col")}
            gemms.add((dtype, "float32", "col_row", OUTPUT_C))  # accumulate
            if dtype in SIXTEEN_BIT:
                gemms.add((dtype, "float32", "row_row", OUTPUT_C))  # bias rows of a float32 output
            required |= {(_kind(kind, d, family), d, out, layout, c) for d, out, layout, c in gemms}
    return required


def describe(kernel):
    if isinstance(kernel, str):
        return kernel
    if kernel[0] not in (UNALIGNED, *map(cutlass_kind, FAMILIES)):
        return " ".join(kernel)  # the expert layer's: the kernel, then what is special
    kind, dtype, out, layout, c = kernel
    return f"{kind} {dtype}->{out} {layout}" + (f" {c}" if c else "")


# ---- the expert layer (core_cuda/cuda/expert_backend.cu, permute.cu, unpermute.cu, activation.cu,
# router.cu)

PERMUTE_COUNT, PERMUTE_BUCKET_SCAN, PERMUTE_START_SCAN, PERMUTE_ASSIGN, PERMUTE_FILL = (
    "permute count kernel", "permute bucket scan kernel", "permute start scan kernel", "permute assign kernel",
    "permute fill kernel")
UNPERMUTE, ROW_SORT, ROW_GRADIENT, SLOT_DOT = (
    "unpermute kernel", "unpermute backward row sort", "unpermute backward row kernel",
    "unpermute backward dprobs kernel")
ACTIVATION, ACTIVATION_BACKWARD = "activation kernel", "activation backward kernel"
SOFTMAX_TOPK, SOFTMAX_TOPK_BACKWARD, SOFTMAX_TOPK_TANGENT = (
    "softmax top-k kernel", "softmax top-k backward kernel", "softmax top-k tangent kernel")
ROUTER_KINDS = ("softmax_topk", "softmax_topk_backward", "softmax_topk_tangent")
ROUTER_KERNELS = dict(zip(ROUTER_KINDS, (SOFTMAX_TOPK, SOFTMAX_TOPK_BACKWARD, SOFTMAX_TOPK_TANGENT)))
SEVERAL_TILES = "over several tiles"
SEVERAL_PASSES = "in several radix passes"
CAPPED_CHUNKS = "with the chunk count capped by the counts budget"
ACTIVATIONS = ("swiglu", "gelu", "relu", "silu")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# groupgemm/permute.h and counting_sort.cuh: slots per chunk, the counts budget, the scans'
# tiles, the rows one radix pass of unpermute's backward sorts by (8-bit digits).
SLOTS_PER_CHUNK = 16
MAX_COUNT_ENTRIES = 1 << 22
BUCKET_SCAN_TILE = 256 * 4  # kBucketScanThreads x kScanItems
START_SCAN_TILE = 1024 * 4  # kStartScanThreads x kScanItems
ROW_DIGIT_BUCKETS = 256


def permute_chunks(slots, experts):
    """permute_chunks(): about 16 slots per chunk, at most 2^22 count entries, at least 1."""
    chunks = min(-(-slots // SLOTS_PER_CHUNK), MAX_COUNT_ENTRIES // (experts + 1))
    return max(chunks, 1)


def permute_workspace_bytes(slots, experts):
    """permute_workspace_layout().bytes: the kept-row count, E + 1 bucket starts and
    (E + 1) x chunks counts, each part 16-byte aligned."""
    align16 = lambda n: -(-n // 16) * 16  # noqa: E731
    return align16(4) + align16((experts + 1) * 4) + align16((experts + 1) * permute_chunks(slots, experts) * 4)


@dataclasses.dataclass(frozen=True)
class ExpertCall:
    kind: str  # "permute", "unpermute", "unpermute_backward", "activation", "activation_backward" or ROUTER_KINDS
    dtype: str  # the values' (the router: the logits') dtype
    probs: str | None = None  # unpermute and its backward: probs' dtype, None without probs
    activation: str | None = None  # the activations: one of ACTIVATIONS
    renormalize: bool | None = None  # the router

    @property
    def name(self):
        extra = ([f"probs {self.probs or 'absent'}"] if self.kind.startswith("unpermute") else
                 [self.activation] if self.activation else
                 ["renormalized" if self.renormalize else "full softmax"] if self.kind in ROUTER_KINDS else [])
        return "/".join([self.kind, self.dtype, *extra])


def expert_calls_for(dtype):
    """Every expert-layer call made per routing case and dtype: permute; unpermute and its
    backward without probs, with probs in the values' dtype and in float32; each activation
    forward and backward (on h of min(T*k, a few thousand) rows and F = hidden columns, 2F
    for swiglu); the router's softmax top-k, its backward and tangent, renormalized or not (on [T, E]
    logits)."""
    probs = list(dict.fromkeys([None, dtype, "float32"]))
    return ([ExpertCall("permute", dtype)]
            + [ExpertCall(kind, dtype, probs=p) for kind in ("unpermute", "unpermute_backward") for p in probs]
            + [ExpertCall(kind, dtype, activation=a) for kind in ("activation", "activation_backward")
               for a in ACTIVATIONS]
            + [ExpertCall(kind, dtype, renormalize=r) for kind in ROUTER_KINDS for r in (True, False)])


def expert_kernels_reached(call, tokens, top_k, experts, hidden):
    """The kernels `call` launches on a routing of `tokens` x `top_k` slots over `experts`
    experts with `hidden` columns (the activations: rows exactly when tokens * top_k > 0)."""
    slots, reached = tokens * top_k, set()
    if call.kind == "permute":
        if slots == 0 and experts == 0:
            return reached  # nothing to write
        chunks = permute_chunks(slots, experts)
        reached |= {PERMUTE_COUNT, PERMUTE_BUCKET_SCAN, PERMUTE_START_SCAN}
        if chunks > BUCKET_SCAN_TILE:
            reached.add((PERMUTE_BUCKET_SCAN, SEVERAL_TILES))
        if experts + 1 > START_SCAN_TILE:
            reached.add((PERMUTE_START_SCAN, SEVERAL_TILES))
        if chunks * SLOTS_PER_CHUNK < slots:
            reached.add((PERMUTE_COUNT, CAPPED_CHUNKS))
        if slots == 0:
            return reached
        reached.add(PERMUTE_ASSIGN)
        if hidden > 0:
            reached.add((PERMUTE_FILL, f"{ELEMENT_BYTES[call.dtype]}-byte"))
        return reached
    if call.kind == "unpermute":
        return {(UNPERMUTE, call.dtype, f"probs {call.probs or call.dtype}")} if tokens * hidden else reached
    if call.kind == "unpermute_backward":  # dpermuted has R = T * k rows here; dprobs with probs
        pair = (call.dtype, f"probs {call.probs or call.dtype}")
        if slots * hidden:
            reached |= {ROW_SORT, (ROW_GRADIENT, *pair)}
            if slots >= ROW_DIGIT_BUCKETS:  # the key of a dropped slot, R, has a second digit
                reached.add((ROW_SORT, SEVERAL_PASSES))
        if slots and call.probs is not None:
            reached.add((SLOT_DOT, *pair))
        return reached
    if call.kind in ("activation", "activation_backward"):
        kernel = ACTIVATION if call.kind == "activation" else ACTIVATION_BACKWARD
        return {(kernel, call.dtype)} if slots * hidden else reached
    if call.kind in ROUTER_KINDS:  # made only when k <= E (the core refuses more choices than experts)
        if top_k > experts:
            return reached
        runs = tokens * experts if call.kind == "softmax_topk_backward" else slots
        return {(ROUTER_KERNELS[call.kind], call.dtype)} if runs else reached
    raise ValueError(f"unknown call kind {call.kind!r}")


def required_expert_kernels():
    """What the driver must reach of the expert layer: each of permute's kernels (its scans
    over several tiles, its chunk count capped), the fill for 2- and 4-byte elements, the
    unpermute kernels for every (values, probs) pair, the backward's row sort (in several
    radix passes), the activations and the router in every dtype."""
    required = {PERMUTE_COUNT, PERMUTE_BUCKET_SCAN, PERMUTE_START_SCAN, PERMUTE_ASSIGN,
                (PERMUTE_BUCKET_SCAN, SEVERAL_TILES), (PERMUTE_START_SCAN, SEVERAL_TILES),
                (PERMUTE_COUNT, CAPPED_CHUNKS), (PERMUTE_FILL, "2-byte"), (PERMUTE_FILL, "4-byte"),
                ROW_SORT, (ROW_SORT, SEVERAL_PASSES)}
    for dtype in DTYPES:
        for probs in dict.fromkeys([dtype, "float32"]):
            required |= {(kernel, dtype, f"probs {probs}") for kernel in (UNPERMUTE, ROW_GRADIENT, SLOT_DOT)}
        required |= {(ACTIVATION, dtype), (ACTIVATION_BACKWARD, dtype)}
        required |= {(kernel, dtype) for kernel in ROUTER_KERNELS.values()}
    return required


# ---- the fused expert MLP (core_cuda/cuda/expert_mlp.cu, expert_mlp_kernels.cu, gathered_gemm_*.cu)

# Its gathered grouped GEMMs: CUTLASS (float32 always, 16-bit with 16-byte aligned rows) by
# input, output, layout and gathered operand; the unaligned 16-bit kernel by input, output
# and gathered operand (its layout is a run-time flag). Its other GEMMs are the grouped
# path's kernels above.
GATHERED, GATHERED_UNALIGNED = "gathered cutlass", "gathered unaligned"
# Under GROUPGEMM_CUDA_KERNEL=sm90 on Hopper, the aligned 16-bit gathered GEMMs (A's rows in
# a forward layout; w_in's gradient, whose contraction is gathered, into the inputs' type) run
# the sm_90a gathered GEMM (cutlass_gathered_sm90.cuh) instead, by input, output, layout and
# gathered operand; the fused op's other GEMMs stay as they are.
GATHERED_SM90 = "gathered cutlass sm90"
# The fused op's kernel choices the sanitizer driver and the kit's fused cells run:
# GROUPGEMM_CUDA_KERNEL unset, and on Hopper "sm90".
MLP_FAMILIES = (DEFAULT_KERNEL, kernel_table.SM90_BY_SHAPE)
MLP_ROUTE, MLP_SETUP, MLP_FILL, MLP_H, MLP_ACTIVATION, MLP_BACKWARD_ROWS, MLP_SUMS, MLP_IDLE = (
    "expert MLP routing sort", "expert MLP setup kernel", "expert MLP row fill kernel", "expert MLP h kernel",
    "expert MLP activation kernel", "expert MLP backward row kernel", "expert MLP bias gradient kernel",
    "expert MLP idle expert kernel")


def mlp_families_on(hopper):
    return MLP_FAMILIES if hopper else MLP_FAMILIES[:1]


@dataclasses.dataclass(frozen=True)
class ExpertMlpCall:
    dtype: str  # the values'
    activation: str  # one of ACTIVATIONS
    bias: bool  # b_in and b_out (and their gradients)
    transpose: bool  # w_in [E, F_in, H], w_out [E, H, F]
    probs: str | None  # probs' (and dprobs') dtype; None: no probs

    @property
    def name(self):
        flags = [f for f, on in (("bias", self.bias), ("transposed", self.transpose)) if on]
        return "/".join(["expert_mlp", self.dtype, self.activation, *flags, f"probs {self.probs or 'absent'}"])


def expert_mlp_calls_for(dtype):
    """Per case and dtype, a forward and a backward (every gradient) each: both weight
    layouts (every gathered GEMM layout), with and without biases, probs in the values'
    dtype and in float32."""
    return [ExpertMlpCall(dtype, "swiglu", True, False, dtype), ExpertMlpCall(dtype, "gelu", False, True, "float32")]


def _gathered(dtype, out, layout, gather, aligned, family):
    sm90_takes = gather == "a_rows" or out == dtype  # a gathered contraction: the inputs' output type only
    if aligned and family == kernel_table.SM90_BY_SHAPE and dtype in SIXTEEN_BIT and sm90_takes:
        return (GATHERED_SM90, dtype, out, layout, gather)
    if aligned:
        return (GATHERED, dtype, out, layout, gather)
    return (GATHERED_UNALIGNED, dtype, out, gather)


def expert_mlp_kernels_reached(call, tokens, top_k, experts, hidden, ffn, family=DEFAULT_KERNEL):
    """The fused kernels a forward (h kept) and a backward (every gradient) of `call` launch
    on T = tokens, k = top_k, E = experts, H = hidden, F = ffn (core_cuda/src/expert_mlp_sequence.h)
    under `family` (one of MLP_FAMILIES)."""
    slots, f = tokens * top_k, ffn
    f_in = 2 * ffn if call.activation == "swiglu" else ffn
    aligned = call.dtype == "float32" or all(n % 8 == 0 for n in (hidden, f_in, f))
    fc1_layout, dgrad_layout = ("row_col", "row_row") if call.transpose else ("row_row", "row_col")

    def gathered(out, layout, gather):
        return _gathered(call.dtype, out, layout, gather, aligned, family)

    reached = set()
    if tokens * hidden or slots * f_in:  # the forward
        reached.add(MLP_ROUTE)
        if slots:
            reached |= {MLP_SETUP} if experts else set()
            if f_in:
                reached |= {gathered(call.dtype, fc1_layout, "a_rows") if hidden else MLP_FILL,
                            (MLP_H, call.dtype)}
            if f:
                reached.add((MLP_ACTIVATION, call.dtype))
            elif hidden:
                reached.add(MLP_FILL)  # fc2 over an empty contraction: its bias rows
    dtokens, dprobs = tokens * hidden > 0, call.probs is not None and slots > 0
    dw_in, dw_out = experts * hidden * f_in > 0, experts * f * hidden > 0
    db_in, db_out = call.bias and experts * f_in > 0, call.bias and experts * hidden > 0
    if dtokens or dprobs or dw_in or dw_out or db_in or db_out:  # the backward
        reached.add(MLP_ROUTE)
        if slots:
            reached |= {MLP_SETUP} if experts else set()
            if (dtokens or dw_in or db_in or dprobs) and f:
                reached.add(gathered("float32", dgrad_layout, "a_rows") if hidden else MLP_FILL)
            reached.add((MLP_BACKWARD_ROWS, call.dtype, f"probs {call.probs or call.dtype}"))
            if dw_in:
                reached.add(gathered(call.dtype, "col_row", "b_k" if call.transpose else "a_k"))
            if dtokens and not f_in:
                reached.add(MLP_FILL)
        if dw_in or dw_out:
            reached.add(MLP_IDLE)
        if db_in or db_out:
            reached.add((MLP_SUMS, call.dtype))
    return reached


def required_expert_mlp_kernels(families=MLP_FAMILIES[:1]):
    """What the driver must reach of the fused expert MLP under `families`: its small
    kernels in every dtype (the backward row kernel for both probs dtypes), and every
    gathered GEMM instantiation: A's rows gathered in both forward layouts with the values'
    and a float32 output, a weight gradient's contraction gathered in A and in B; for 16-bit
    inputs, the unaligned kernel's as well."""
    required = {MLP_ROUTE, MLP_SETUP, MLP_FILL, MLP_IDLE}
    for dtype, family in itertools.product(DTYPES, families):
        for aligned in [True] + ([False] if dtype in SIXTEEN_BIT else []):
            required |= {_gathered(dtype, out, layout, "a_rows", aligned, family) for out in (dtype, "float32")
                         for layout in ("row_row", "row_col")}
            required |= {_gathered(dtype, dtype, "col_row", gather, aligned, family)
                         for gather in ("a_k", "b_k")}
        required |= {(MLP_H, dtype), (MLP_ACTIVATION, dtype), (MLP_SUMS, dtype)}
        required |= {(MLP_BACKWARD_ROWS, dtype, f"probs {p}") for p in dict.fromkeys([dtype, "float32"])}
    return required
