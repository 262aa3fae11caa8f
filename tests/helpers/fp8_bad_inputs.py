"""The FP8 bad-input table: calls both frontends must refuse with a clear message naming the
argument (bad_inputs.py's BadInput rows; ``{lhs}``, ``{rhs}``, ``{lhs_scale}``,
``{rhs_scale}``, ``{out_dtype}``, ``{recipe}`` stand for each frontend's spelling: torch's
scaled_grouped_mm says mat_a, mat_b, scale_a, scale_b, output_dtype)."""

import types

import numpy as np
from bad_inputs import BadInput

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def fp8_base_arguments(frontend):
    """Forward: lhs [6, 128], rhs [3, 8, 128] float8_e4m3fn, rowwise scales [6] and [3, 8],
    blockwise [6, 1] and [3, 1, 1]; weight gradient: lhs [8, 6], rhs [5, 6]; sizes [2, 2, 2]."""
    a = frontend.array

    def fp8(shape, dtype=E4M3):
        return a(np.ones(shape), dtype)

    def f32(shape, dtype="float32"):
        return a(np.ones(shape), dtype)

    return types.SimpleNamespace(
        fp8=fp8, f32=f32, sizes=a([2, 2, 2], "int32"), lhs=fp8((6, 128)), rhs=fp8((3, 8, 128)),
        row_scales=(f32((6,)), f32((3, 8))), block_scales=(f32((6, 1)), f32((3, 1, 1))),
        wlhs=fp8((8, 6)), wrhs=fp8((5, 6)), x=f32((6, 128), "bfloat16"))


def _mm(f, a, lhs=None, rhs=None, scales=None, recipe="rowwise", **kw):
    scales = scales or (a.row_scales if recipe == "rowwise" else a.block_scales)
    return f.scaled_matmul(a.lhs if lhs is None else lhs, a.rhs if rhs is None else rhs, a.sizes, *scales, recipe,
                           **kw)


def _wgrad(f, a, lhs=None, rhs=None, scales=None, recipe="rowwise", num_groups=3, **kw):
    if scales is None:
        rows = 3 if recipe == "rowwise" else (6 + 127 * 3) // 128
        scales = (a.f32((rows, 8)), a.f32((rows, 5)))
    return f.scaled_wgrad(a.wlhs if lhs is None else lhs, a.wrhs if rhs is None else rhs, a.sizes, *scales, recipe,
                          num_groups=num_groups, **kw)


def _layer(f, a, k, n, dtype="bfloat16", recipe="blockwise"):
    return f.fp8_linear_and_grads(np.ones((6, k)), np.ones((3, n, k)), [2, 2, 2], None, np.ones((6, n)), recipe,
                                  dtype)


FP8_BAD_INPUTS = [
    BadInput("rhs_e5m2", lambda f, a: _mm(f, a, rhs=a.fp8((3, 8, 128), E5M2)), TypeError,
             "{rhs} must be float8_e4m3fn; float8_e5m2 is accepted for {lhs}"),
    BadInput("lhs_not_fp8", lambda f, a: _mm(f, a, lhs=a.f32((6, 128), "bfloat16")), TypeError,
             "{lhs} must be float8_e4m3fn or float8_e5m2, got bfloat16"),
    BadInput("blockwise_k", lambda f, a: _mm(f, a, lhs=a.fp8((6, 64)), rhs=a.fp8((3, 8, 64)), recipe="blockwise"),
             ValueError, "blockwise scaling needs K .* to be a multiple of 128, got K = 64"),
    BadInput("k_mismatch", lambda f, a: _mm(f, a, rhs=a.fp8((3, 8, 256))), ValueError,
             "{lhs} has K = 128 but {rhs} has K = 256"),
    BadInput("lhs_scale_shape", lambda f, a: _mm(f, a, scales=(a.f32((5,)), a.row_scales[1])), ValueError,
             r"{lhs_scale} must have shape \(6,\) for rowwise scaling"),
    BadInput("rhs_scale_shape", lambda f, a: _mm(f, a, scales=(a.block_scales[0], a.f32((3, 8))), recipe="blockwise"),
             ValueError, r"{rhs_scale} must have shape \(3, 1, 1\) for blockwise scaling"),
    BadInput("scale_dtype", lambda f, a: _mm(f, a, scales=(a.f32((6,), "bfloat16"), a.row_scales[1])), TypeError,
             "{lhs_scale} must be float32, got bfloat16"),
    BadInput("output_dtype", lambda f, a: _mm(f, a, out_dtype="float16"), TypeError,
             "{out_dtype} must be bfloat16 or float32 for float8 inputs, got float16"),
    BadInput("bias_dtype", lambda f, a: _mm(f, a, bias=a.f32((3, 8), "bfloat16"), out_dtype="float32"), TypeError,
             "bias must have the output dtype float32, got bfloat16"),
    BadInput("bias_shape", lambda f, a: _mm(f, a, bias=a.f32((3, 9), "bfloat16")), ValueError,
             r"bias must have shape \(3, 8\)"),
    BadInput("group_count", lambda f, a: f.scaled_matmul(a.lhs, a.rhs, a.sizes[:2], *a.row_scales, "rowwise"),
             ValueError, "group_sizes has 2 entries but there are 3 groups"),
    BadInput("wgrad_tokens", lambda f, a: _wgrad(f, a, rhs=a.fp8((5, 7))), ValueError,
             "{lhs} has 6 tokens but {rhs} has 7"),
    BadInput("wgrad_rhs_e5m2", lambda f, a: _wgrad(f, a, rhs=a.fp8((5, 6), E5M2)), TypeError,
             "{rhs} must be float8_e4m3fn"),
    BadInput("wgrad_block_scale_rows", lambda f, a: _wgrad(f, a, recipe="blockwise",
                                                           scales=(a.f32((1, 8)), a.f32((3, 5)))),
             ValueError, r"{lhs_scale} must have shape \(3, 8\) for blockwise scaling"),
    BadInput("wgrad_group_count", lambda f, a: _wgrad(f, a, num_groups=2), ValueError,  # scales for 3 groups:
             "group_sizes has 3 entries but there are 2 groups"),                    # the count is what is wrong
    BadInput("wgrad_row_scale", lambda f, a: _wgrad(f, a, scales=(a.f32((3, 8)), a.f32((2, 5)))), ValueError,
             r"{rhs_scale} must have shape \(3, 5\) for rowwise scaling"),
    BadInput("quantize_input_dtype", lambda f, a: f.quantize_fp8(a.f32((6, 128), "int32"), "rowwise"), TypeError,
             "x must be float32, bfloat16 or float16, got int32"),
    BadInput("quantize_dtype", lambda f, a: f.quantize_fp8(a.x, "rowwise", dtype="float16"), TypeError,
             "dtype must be float8_e4m3fn or float8_e5m2, got float16"),
    BadInput("quantize_rank", lambda f, a: f.quantize_fp8(a.x[0], "rowwise"), ValueError,
             r"x must be 2-D \[M, K\] \(activations\) or 3-D \[G, N, K\] \(weights\)"),
    BadInput("quantize_recipe", lambda f, a: f.quantize_fp8(a.x, "tensorwise"), ValueError,
             "recipe must be 'rowwise' or 'blockwise', got 'tensorwise'"),
    BadInput("quantize_grouped_rank", lambda f, a: f.quantize_fp8_grouped(a.x[0], a.sizes, "rowwise"), ValueError,
             r"x must be 2-D \[M, C\]"),
    BadInput("quantize_grouped_count", lambda f, a: f.quantize_fp8_grouped(a.x, a.sizes, "rowwise", num_groups=2),
             ValueError, "group_sizes has 3 entries but there are 2 groups"),
    # named as itself, not as a group_sizes of the wrong length
    *[BadInput(f"{name}_negative_count", call, ValueError, "num_groups must be a non-negative int, got -1")
      for name, call in (("quantize_grouped", lambda f, a: f.quantize_fp8_grouped(a.x, a.sizes, "rowwise",
                                                                                 num_groups=-1)),
                         ("wgrad", lambda f, a: _wgrad(f, a, num_groups=-1)))],
    BadInput("layer_blockwise_width", lambda f, a: _layer(f, a, 64, 128), ValueError,
             "fp8='blockwise' needs in_features to be a multiple of 128 .*, got 64"),
    BadInput("layer_blockwise_out_width", lambda f, a: _layer(f, a, 128, 8), ValueError,
             "fp8='blockwise' needs out_features to be a multiple of 128 .*, got 8"),
    BadInput("layer_dtype", lambda f, a: _layer(f, a, 128, 128, dtype="float16"), TypeError,
             "fp8='blockwise' needs float32 or bfloat16 weights and inputs, got float16"),
    BadInput("layer_recipe", lambda f, a: _layer(f, a, 128, 128, recipe="tensorwise"), ValueError,
             "fp8 must be 'rowwise' or 'blockwise', got 'tensorwise'"),
    BadInput("accumulate_with_output_dtype",
             lambda f, a: _wgrad(f, a, accumulate_into=a.f32((3, 8, 5)), out_dtype="bfloat16"), TypeError,
             "{out_dtype} bfloat16 conflicts with accumulate_into, which is float32"),
    BadInput("accumulate_negative_view", lambda f, a: _wgrad(f, a, accumulate_into=a.f32((3, 8, 5))._neg_view()),
             ValueError, "accumulate_into is a negative or conjugate view", frontends=("torch",)),
    BadInput("power_of_two_not_bool", lambda f, a: f.quantize_fp8(a.x, "rowwise", power_of_two="False"), TypeError,
             "quantize_fp8: power_of_two must be a bool, got 'False'"),  # truthy: power-of-two scales
    BadInput("grouped_power_of_two_not_bool",
             lambda f, a: f.quantize_fp8_grouped(a.x, a.sizes, "rowwise", power_of_two="False"), TypeError,
             "quantize_fp8_grouped: power_of_two must be a bool, got 'False'"),
]

# What only one frontend can be handed or say: torch's scaled_grouped_mm has storage
# orders, swizzles, ScalingType pairs and contraction_dim; JAX names its recipe directly.
TORCH_ONLY = [
    BadInput("mat_b_row_major", lambda f, a: f.gt.scaled_grouped_mm(a.lhs, a.rhs.transpose(1, 2).contiguous(),
                                                                    a.row_scales[0], "RowWise", a.row_scales[1],
                                                                    "RowWise", group_sizes=a.sizes),
             ValueError, "mat_b must be column-major, a transposed view of a contiguous", frontends=("torch",)),
    BadInput("recipe_pair", lambda f, a: f.gt.scaled_grouped_mm(a.lhs, a.rhs.transpose(1, 2), *a.block_scales[:1],
                                                                "RowWise", a.block_scales[1], "BlockWise128x128",
                                                                group_sizes=a.sizes),
             ValueError, "RowWise x BlockWise128x128 is not supported in the 2d-3d form; use RowWise x RowWise or "
                         "BlockWise1x128 x BlockWise128x128", frontends=("torch",)),
    BadInput("swizzle", lambda f, a: f.gt.scaled_grouped_mm(a.lhs, a.rhs.transpose(1, 2), a.row_scales[0], "RowWise",
                                                            a.row_scales[1], "RowWise", swizzle_a="SWIZZLE_32_4_4",
                                                            group_sizes=a.sizes),
             ValueError, "swizzle_a must be None or NO_SWIZZLE", frontends=("torch",)),
    BadInput("contraction_dim", lambda f, a: f.gt.scaled_grouped_mm(a.lhs, a.rhs.transpose(1, 2), a.row_scales[0],
                                                                    "RowWise", a.row_scales[1], "RowWise",
                                                                    contraction_dim=(0, 2), group_sizes=a.sizes),
             ValueError, r"contraction_dim must be \(\) or \(1, 1\)", frontends=("torch",)),
    BadInput("quantize_sparse", lambda f, a: f.gt.quantize_fp8(a.f32((6, 128)).to_sparse(), "rowwise"), TypeError,
             "x must be a dense tensor \\(layout torch.strided\\)", frontends=("torch",)),
    BadInput("quantize_grouped_sizes_list", lambda f, a: f.gt.quantize_fp8_grouped(a.f32((6, 128)), [3, 3], "rowwise"),
             TypeError, "group_sizes must be a 1-D integer tensor, got list", frontends=("torch",)),
    BadInput("wgrad_window_count", lambda f, a: f.gt.scaled_grouped_mm(a.wlhs, a.wrhs.t(), a.f32((9,)), "RowWise",
                                                                       a.f32((9,)), "RowWise", group_sizes=a.sizes,
                                                                       group_offset=1),
             TypeError, "num_groups is required with group_offset", frontends=("torch",)),
]
FP8_BAD_INPUTS += TORCH_ONLY
