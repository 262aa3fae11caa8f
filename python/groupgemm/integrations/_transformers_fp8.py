"""An FP8 checkpoint's experts (transformers' ``FP8Experts``) on groupgemm's scaled grouped
GEMMs: the checkpoint's float8_e4m3fn weights ``[E, N, K]`` and their 128 x 128 block
scales ``*_scale_inv [E, N/128, K/128]`` (dequantized weight = weight x scale) are read as
they are, which is the blockwise recipe's weight operand (groupgemm/_fp8_recipe.py); the
activations are quantized per 1 x 128 tile on the fly, as the checkpoints' dynamic
activation scheme does. The input gradient runs in FP8 too: the transposed weight's
128 x 128 blocks are the same blocks, transposed. The weights get no gradient (frozen, as
in transformers)."""

from dataclasses import dataclass

import torch

import groupgemm.torch as gt
from groupgemm import _contract as contract
from groupgemm.torch_ext import arguments, fp8_ops

BLOCK = 128  # the blockwise recipe's block, the only weight_block_size served
_ACTIVATION, _WEIGHT = "BlockWise1x128", "BlockWise128x128"
_E4M3, _BLOCKWISE = contract.FP8_DTYPES.index("float8_e4m3fn"), contract.FP8_RECIPES.index("blockwise")


@dataclass(frozen=True)
class Fp8Weight:
    """One projection's FP8 weight ``[E, N, K]`` and its float32 block scales; ``name`` is
    the module's attribute, as errors name it (``GptOssExperts.down_proj``)."""
    weight: torch.Tensor
    scale: torch.Tensor
    name: str
    fn: str

    @property
    def num_experts(self):
        return self.weight.shape[0]


def layers(module, fn: str) -> tuple[Fp8Weight, Fp8Weight]:
    """The module's two projections, checked; errors name the attribute and the class."""
    family = type(module).__name__
    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{fn}: {family}.activation_scheme is {scheme!r}; groupgemm quantizes the activations "
                         "per 1 x 128 tile on the fly (the 'dynamic' scheme)")
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (BLOCK, BLOCK):
        raise ValueError(f"{fn}: {family}.block_size (the checkpoint's weight_block_size) is {block}; groupgemm's "
                         f"FP8 experts take [{BLOCK}, {BLOCK}] block scales")
    up_name = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    up, down = (_weight(module, name, family, fn) for name in (up_name, "down_proj"))
    if down.num_experts != up.num_experts:
        raise ValueError(f"{fn}: {down.name} holds {down.num_experts} experts but {up.name} {up.num_experts}")
    return up, down


def _weight(module, name, family, fn):
    weight, scale = getattr(module, name, None), getattr(module, f"{name}_scale_inv", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn or weight.dim() != 3:
        what = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"{fn}: {family}.{name} must be a float8_e4m3fn [E, N, K] weight (FP4 and other formats "
                        f"are not served), got {what}")
    e, n, k = weight.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"{fn}: {family}.{name} is [E, N, K] = {[e, n, k]}; the blockwise FP8 GEMMs contract in "
                         f"{BLOCK}-blocks over K (and, for the input gradient, N): both must be multiples of {BLOCK}")
    want = (e, n // BLOCK, k // BLOCK)
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != want:
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{fn}: {family}.{name}_scale_inv must be {list(want)} (one scale per {BLOCK} x {BLOCK} "
                         f"block), got {got}")
    # float32 or UE8M0 (powers of two): float32 holds either exactly.
    return Fp8Weight(weight, scale if scale.dtype == torch.float32 else scale.float(), f"{family}.{name}", fn)


def grouped_linear(x: torch.Tensor, layer: Fp8Weight, group_sizes: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight[g]^T`` per group in FP8 (x bfloat16 or float32, the result in
    x's dtype); differentiable in x."""
    if x.shape[-1] != layer.weight.shape[-1]:
        raise ValueError(f"{layer.fn}: {layer.name} takes {layer.weight.shape[-1]} input features, got "
                         f"{x.shape[-1]}")
    return _FrozenFp8Linear.apply(x, layer.weight, layer.scale, group_sizes)


def _scaled_mm(x, weight, scale, group_sizes):
    """x against the K-major ``weight [E, N, K]`` (block scales ``[E, N/128, K/128]``), every
    argument checked."""
    qx, sx = gt.quantize_fp8(x.contiguous(), "blockwise")
    return gt.scaled_grouped_mm(qx, weight.transpose(-2, -1), sx, _ACTIVATION, scale, _WEIGHT,
                                group_sizes=group_sizes, output_dtype=x.dtype)


class _FrozenFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, scale, group_sizes):
        return _scaled_mm(x, weight, scale, group_sizes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, weight, scale, group_sizes = inputs
        ctx.save_for_backward(weight, scale, group_sizes)

    @staticmethod
    def backward(ctx, grad):
        weight, scale, group_sizes = ctx.saved_tensors
        # dx = dy @ W[g]: W^T [E, K, N] K-major in N, its blocks the same blocks transposed. The
        # forward checked these operands (dy has its output's shape), so the ops run unchecked:
        # torch.compile traces a backward in strict mode, which bans the checks' reading of
        # a tensor's layout.
        qdy, sdy = fp8_ops.fp8_quantize_rows_op(grad.contiguous(), _E4M3, _BLOCKWISE)
        dx = fp8_ops.scaled_grouped_mm_op(qdy, weight.transpose(-2, -1).contiguous(), sdy,
                                          scale.transpose(-2, -1).contiguous(), arguments.index_tensor(group_sizes),
                                          _BLOCKWISE, grad.dtype)
        return dx, None, None, None
