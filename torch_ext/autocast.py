"""torch.autocast for groupgemm's GEMMs, the rule written once.

torch puts its GEMMs (mm, matmul, linear, bmm, ...) on autocast's lower-precision list:
inside an autocast region for their device type, the floating operands (float64 aside)
are cast to the region's dtype, ``torch.get_autocast_dtype``, by a differentiable cast, so
the product runs and comes out in that dtype and float32 parameters still get float32
gradients. The public GEMM functions and layers (grouped_mm, grouped_mm_wgrad,
expert_mlp, GroupedLinear, GroupedMLP) apply the same cast on entry. Routing weights are
not GEMM operands: float32 ones stay float32 (the core takes them so and sums in float32
anyway). Integer operands are never touched. The FP8 functions and layers do not take
part: they quantize what they are given (an FP8 GEMM already runs below autocast's
precision, and a cast first would round twice), so in a region an FP8 layer's input may
come in another dtype than its weight, and its output follows the input. Outside a region
every argument passes through as it is: the same tensors, the same bits.
"""

import torch

from groupgemm import _contract as contract
from groupgemm.torch_ext.arguments import dtype_name

Tensor = torch.Tensor
_CAST = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts: floating, not float64


def _region_dtype(t) -> torch.dtype | None:
    """The autocast dtype for tensor ``t``'s device type, or None: outside a region for it,
    or ``t`` not a tensor (the checks that follow name it)."""
    if not torch._C._is_any_autocast_enabled() or not isinstance(t, Tensor):  # the usual case first: one call
        return None
    kind = t.device.type
    if not (torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)):
        return None
    return torch.get_autocast_dtype(kind)


def casts(t) -> bool:
    """Whether an autocast region casts the GEMMs of tensor ``t``'s device type."""
    return _region_dtype(t) is not None


def layer_dtype(x, layer, fn) -> str | None:
    """The dtype a ``layer``'s input ``x`` must have: its parameters' (checked to be one),
    or None (any) in a region, which casts them all."""
    if casts(x):
        return None
    named = [(name, dtype_name(p.dtype)) for name, p in layer.named_parameters()]
    contract.layer_parameters(named, fn)
    return named[0][1]


def operands(*tensors) -> tuple:
    """A GEMM's operands (None where absent) as autocast runs them, the region read from
    the first one's device type."""
    dtype = _region_dtype(tensors[0])
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.dtype in _CAST else t for t in tensors)


def routing_weights(probs, like: Tensor):
    """Routing weights beside ``like`` (the cast operands or the GEMMs' output): in a region,
    float32 stays, another floating dtype takes like's, which is what the core accepts."""
    if (_region_dtype(like) is None or not isinstance(probs, Tensor) or probs.dtype not in _CAST
            or probs.dtype in (torch.float32, like.dtype)):
        return probs
    return probs.to(like.dtype)
