"""FP8 test inputs and a float64 NumPy reference, written independently of the core:
quantization with ml_dtypes' float8 casts, the scaled GEMMs as float64 products of the
dequantized operands (reference.py's grouped GEMMs on them).

The shared case table's group patterns (cases.py) are reused with FP8 sizes: K is a
multiple of 128 (two blocks where the case has 16 columns), N spans a partial second
128-block (136 for the case's 8), so every recipe and every block boundary is exercised.
"""

import ml_dtypes
import numpy as np
import reference as ref
from cases import CASES, Case, round_to

FORMATS = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0), "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
BLOCK = 128
RECIPES = ["rowwise", "blockwise"]
# Relative to the result's largest magnitude: the output's rounding plus float32 sums.
TOLERANCE = {"bfloat16": 8e-3, "float32": 1e-5}


def dims(case: Case):
    """(M, K, N) of a case at FP8 sizes (N a multiple of 8: the CUDA kernels write 16-byte rows)."""
    k = BLOCK * max(1, case.k // 8) if case.k else 0
    return case.m, k, -(-17 * case.n // 8) * 8


def blocks(length):
    return -(-length // BLOCK)


def inputs(case: Case, dtype="bfloat16", seed=0):
    """float64 values of the case at FP8 sizes, rounded to `dtype`, rows of very different
    magnitudes (so per-row and per-block scales matter): x [M, K], w [G, N, K], dout [M, N],
    bias [G, N], acc [G, N, K] and the group sizes."""
    m, k, n = dims(case)
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))

    return dict(x=round_to(draw(m, k), dtype), w=round_to(draw(case.g, n, k), dtype),
                dout=round_to(draw(m, n), dtype), bias=round_to(rng.standard_normal((case.g, n)), dtype),
                acc=rng.standard_normal((case.g, n, k)).astype(np.float32),
                group_sizes=np.asarray(case.group_sizes, np.int32))


# ---- quantization --------------------------------------------------------------------


def scale_of(amax, dtype, power_of_two=False):
    """float32 scales of float32 amaxes: amax / max_finite, at least 2^-126, 1 for 0."""
    amax = np.asarray(amax, np.float32)
    s = np.maximum(amax / np.float32(FORMATS[dtype][1]), np.float32(2.0**-126))
    if power_of_two:
        mantissa, exponent = np.frexp(s)  # an infinite or NaN scale stays what it is
        s = np.where((mantissa == 0.5) | ~np.isfinite(s), s, np.ldexp(np.float32(1), exponent)).astype(np.float32)
    return np.where(amax == 0, np.float32(1), s).astype(np.float32)


def cast(values, dtype):
    """float32 values to float8, nearest even, saturated to +-max_finite; a NaN keeps its
    sign and has every mantissa bit set, as torch's cast writes it (ml_dtypes' float8_e5m2
    NaN clears the last one)."""
    fp8, top = FORMATS[dtype]
    values = np.asarray(values, np.float32)
    q = np.clip(values, -top, top).astype(fp8)
    bits = q.view(np.uint8)
    bits[np.isnan(values)] |= 0x7F
    return q


def _quantize_along(x, width, dtype, power_of_two):
    """x [R, C] in blocks of `width` columns: (q [R, C], scale [R, blocks])."""
    x = np.asarray(x, np.float32)
    r, c = x.shape
    nb = blocks(c) if width == BLOCK else 1
    scale = np.ones((r, nb), np.float32)
    q = np.zeros((r, c), FORMATS[dtype][0])
    for b in range(nb):
        cols = slice(b * width, min(c, (b + 1) * width))
        scale[:, b] = scale_of(np.abs(x[:, cols]).max(axis=1, initial=0), dtype, power_of_two)
        with np.errstate(invalid="ignore"):  # inf / inf: NaN, as the core's
            q[:, cols] = cast(x[:, cols] / scale[:, b:b + 1], dtype)
    return q, scale


def quantize(x, recipe, dtype="float8_e4m3fn", power_of_two=False):
    """quantize_fp8: 2-D activations (per row or 1 x 128), 3-D weights (per row or 128 x 128)."""
    x = np.asarray(x)
    if x.ndim == 2:
        q, scale = _quantize_along(x, x.shape[1] if recipe == "rowwise" else BLOCK, dtype, power_of_two)
        return q, scale[:, 0] if recipe == "rowwise" else scale
    g, n, k = x.shape
    if recipe == "rowwise":
        q, scale = _quantize_along(x.reshape(g * n, k), k, dtype, power_of_two)
        return q.reshape(g, n, k), scale.reshape(g, n)
    x = x.astype(np.float32)
    q = np.zeros(x.shape, FORMATS[dtype][0])
    scale = np.ones((g, blocks(n), blocks(k)), np.float32)
    for rb in range(blocks(n)):
        for cb in range(blocks(k)):
            tile = (slice(None), slice(rb * BLOCK, (rb + 1) * BLOCK), slice(cb * BLOCK, (cb + 1) * BLOCK))
            scale[:, rb, cb] = scale_of(np.abs(x[tile]).max(axis=(1, 2), initial=0), dtype, power_of_two)
            with np.errstate(invalid="ignore"):
                q[tile] = cast(x[tile] / scale[:, rb, cb][:, None, None], dtype)
    return q, scale


def token_blocks(sizes, m, num_groups, offset=0):
    """[(local group, rows begin, rows end, scale row)] of the weight gradient's token blocks
    (blockwise: 128 rows each, restarting at every group's first row)."""
    out, first = [], 0
    for g, (b, e) in enumerate(ref.local_group_rows(sizes, m, num_groups, offset)):
        for start in range(b, e, BLOCK):
            out.append((g, start, min(e, start + BLOCK), first + (start - b) // BLOCK))
        first += blocks(e - b)
    return out


def quantize_grouped(x, sizes, recipe, num_groups, offset=0, dtype="float8_e4m3fn", power_of_two=False):
    """quantize_fp8_grouped: x [M, C] -> (q [C, M], scale [G or B, C])."""
    x = np.asarray(x, np.float32)
    m, c = x.shape
    rows = num_groups if recipe == "rowwise" else (m + (BLOCK - 1) * num_groups) // BLOCK if m and num_groups else 0
    scale = np.ones((rows, c), np.float32)
    q = np.zeros((c, m), FORMATS[dtype][0])
    spans = ([(g, b, e, g) for g, (b, e) in enumerate(ref.local_group_rows(sizes, m, num_groups, offset)) if e > b]
             if recipe == "rowwise" else token_blocks(sizes, m, num_groups, offset))
    for _, b, e, row in spans:
        scale[row] = scale_of(np.abs(x[b:e]).max(axis=0), dtype, power_of_two)
        q[:, b:e] = cast(x[b:e] / scale[row], dtype).T
    return q, scale


# ---- dequantized operands and the GEMMs ------------------------------------------------


def f64(q):
    return np.asarray(q).astype(np.float64)


def dequantize(q, scale, recipe):
    """quantize()'s operands back to float64 (q times its scales)."""
    q = f64(q)
    if q.ndim == 2:
        s = scale[:, None] if recipe == "rowwise" else np.repeat(scale, BLOCK, axis=1)[:, :q.shape[1]]
        return q * s
    if recipe == "rowwise":
        return q * scale[:, :, None]
    _, n, k = q.shape
    return q * np.repeat(np.repeat(scale, BLOCK, axis=1), BLOCK, axis=2)[:, :n, :k]


def dequantize_grouped(q, scale, sizes, recipe, num_groups, offset=0):
    """quantize_grouped()'s operand [C, M] back to float64 (padding columns 0)."""
    q, out = f64(q), np.zeros(np.shape(q))
    c, m = q.shape
    scale = np.asarray(scale, np.float64).reshape(-1, c) if c else None  # rowwise may come flat: [G * C]
    spans = ([(g, b, e, g) for g, (b, e) in enumerate(ref.local_group_rows(sizes, m, num_groups, offset))]
             if recipe == "rowwise" else token_blocks(sizes, m, num_groups, offset))
    for _, b, e, row in spans:
        out[:, b:e] = q[:, b:e] * scale[row][:, None] if c else 0
    return out


def scaled_matmul(a, w, sizes, bias=None, offset=0):
    """float64 a [M, K] @ w[g]^T ([G, N, K]) per group (+ bias)."""
    return ref.grouped_matmul(a, w, sizes, bias, transpose_rhs=True, group_offset=offset)


def scaled_wgrad(a_t, b_t, sizes, num_groups, offset=0):
    """float64 out[g] = a_t[:, rows_g] @ b_t[:, rows_g]^T (a_t [K, M], b_t [N, M])."""
    return ref.grouped_matmul_wgrad(np.asarray(a_t).T, np.asarray(b_t).T, sizes, num_groups, offset)


def assert_close(actual, expected, out_dtype, what=""):
    actual = np.asarray(actual, np.float64)
    scale = max(1e-30, float(np.abs(expected).max(initial=0.0)))
    err = float(np.abs(actual - expected).max(initial=0.0))
    assert err <= TOLERANCE[out_dtype] * scale, f"{what}: max error {err} (scale {scale}, {out_dtype})"


# ---- one grouped linear layer of the training recipe ----------------------------------

LAYER_K, LAYER_N = 128, 256  # in_features, out_features: multiples of 128, as the blockwise recipe needs
LAYER_CASES = [c for c in CASES if c.group_offset is None]  # GroupedLinear has no window


def layer_inputs(c: Case, dtype="bfloat16", seed=1):
    """x [M, 128], the weight [G, 256, 128], bias, dout and the sizes of a case's groups."""
    rng = np.random.default_rng(seed)

    def draw(*shape):
        return round_to(rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, shape[:-1] + (1,))), dtype)

    return dict(x=draw(c.m, LAYER_K), w=draw(c.g, LAYER_N, LAYER_K) / 8, bias=draw(c.g, LAYER_N),
                dout=draw(c.m, LAYER_N), sizes=np.asarray(c.group_sizes, np.int32))


def recipe_reference(x, recipe, g, offset=0):
    """The recipe's output, input, weight and bias gradients in float64 from its quantized
    operands (groupgemm/_fp8_recipe.py's steps), for local groups from global `offset`."""
    deq = lambda a: dequantize(*quantize(a, recipe), recipe)
    sizes = x["sizes"]
    y = scaled_matmul(deq(x["x"]), deq(x["w"]), sizes, x["bias"], offset)
    dx = scaled_matmul(deq(x["dout"]), deq(x["w"].transpose(0, 2, 1)), sizes, None, offset)
    grouped = [dequantize_grouped(*quantize_grouped(x[k], sizes, recipe, g, offset), sizes, recipe, g, offset)
               for k in ("dout", "x")]
    return y, dx, scaled_wgrad(*grouped, sizes, g, offset), ref.grouped_bias_grad(x["dout"], sizes, g, offset)
