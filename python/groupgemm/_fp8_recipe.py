"""The FP8 training recipe of a grouped linear layer, written once for both frameworks.

As in DeepSeek-V3's and torchao's float8 MoE training, the three GEMMs of a layer run in
float8 from the high-precision (bfloat16 or float32) master weight and activations, each
operand quantized right before its GEMM, every one K-major as FP8 tensor cores read it:

- forward ``y = x @ W^T``: x along K (rowwise, or 1 x 128 tiles), W [G, N, K] per
  output channel (rowwise) or per 128 x 128 block;
- input gradient ``dx = dy @ W``: dy along N, W^T [G, K, N] likewise;
- weight gradient ``dW[g] = dy_g^T @ x_g``: dy^T [N, M] and x^T [K, M], the tokens
  contiguous, with scales per (group, channel) or per 128 tokens x 1 channel restarting
  at every group's first token (quantize_fp8_grouped), so no scale block spans two
  experts; into a new gradient or accumulated into a float32 ``main_grad``.

Every quantization uses float8_e4m3fn (DeepSeek-V3 keeps E4M3 for gradients too: its
fine-grained scales give them the range). An empty expert's weight gradient is exactly
zero and padding rows stay zero throughout. ``ops`` is a frontend's adapter over its
FP8 ops (torch_ext/fp8_recipe.py, jax_ext/fp8_recipe.py), with the methods used below;
weights are ``[G, N, K]`` when ``k_major`` (the nn.Linear layout) and ``[G, K, N]`` otherwise.
"""

from groupgemm import _contract as contract

FP8_E4M3 = contract.FP8_DTYPES.index("float8_e4m3fn")


def forward(ops, x, weight, group_sizes, group_offset, bias, recipe, k_major):
    """``y [M, N]`` in x's dtype: the scaled forward GEMM (bias in its epilogue)."""
    qx, sx = ops.quantize_rows(x, recipe)
    qw, sw = ops.quantize_weight(weight if k_major else ops.transpose(weight), recipe)
    return ops.scaled_mm(qx, qw, sx, sw, group_sizes, group_offset, bias, recipe, ops.dtype(x))


def input_grad(ops, dy, weight, group_sizes, group_offset, recipe, k_major, dtype):
    """``dx [M, K]`` in ``dtype``: dy against the weight read along N."""
    qdy, sdy = ops.quantize_rows(dy, recipe)
    qw, sw = ops.quantize_weight(ops.transpose(weight) if k_major else weight, recipe)
    return ops.scaled_mm(qdy, qw, sdy, sw, group_sizes, group_offset, None, recipe, dtype)


def weight_grad(ops, x, dy, group_sizes, group_offset, num_groups, recipe, k_major, dtype, accumulate_into=None):
    """The weight's gradient in its layout and ``dtype``, or added into ``accumulate_into``
    (float32, returned)."""
    qdy, sdy = ops.quantize_grouped(dy, group_sizes, group_offset, num_groups, recipe)
    qx, sx = ops.quantize_grouped(x, group_sizes, group_offset, num_groups, recipe)
    (a, sa), (b, sb) = ((qdy, sdy), (qx, sx)) if k_major else ((qx, sx), (qdy, sdy))
    return ops.scaled_wgrad(a, b, sa, sb, group_sizes, group_offset, num_groups, recipe, dtype, accumulate_into)
