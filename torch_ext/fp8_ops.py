"""The FP8 ops of groupgemm for PyTorch: custom ops (namespace ``groupgemm``) for
quantization and the scaled grouped GEMMs (groupgemm/fp8.h).

Like gemm_ops.py's ops, each allocates its outputs with torch and hands every tensor to the
core zero-copy, float8 tensors as their uint8 bytes (``.view(torch.uint8)``, which every
torch version exports through DLPack) with the format passed as an int (the core's
Fp8Type: the index in ``_contract.FP8_DTYPES``). The public functions check every argument
first (fp8.py). The ops are not differentiable: float8 operands are quantized values;
the training recipe (fp8_recipe.py) differentiates through them.
"""

import torch

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.torch_ext import device_scratch
from groupgemm.torch_ext.core_args import capsule, require, require_count
from groupgemm.torch_ext.op_library import allocator, define, register_outputs

Tensor = torch.Tensor
FP8_TORCH_DTYPES = tuple(getattr(torch, name) for name in contract.FP8_DTYPES)


def _bytes(t: Tensor):
    return capsule(t.view(torch.uint8))


def _workspace(device: torch.device, call, scaling: int, num_groups: int, m: int, k: int, n: int) -> Tensor | None:
    """The call's scratch from device_scratch, reused per device and stream like the GEMM ops'."""
    if device.type != "cuda":
        return None
    # Its size depends on the shapes and the device (the sm_90a kernel's scratch scales with the SM count).
    index = -1 if device.index is None else device.index
    nbytes = _core.fp8_workspace_bytes(_core.Device.cuda, call, _core.Fp8Scaling(scaling), num_groups, m, k, n,
                                       device_index=index)
    return device_scratch.workspace(device, nbytes, device_scratch.stream(device))


def _not_differentiable(op_name):
    def refuse(*_):
        raise RuntimeError(f"groupgemm::{op_name} is not differentiable: its float8 operands are quantized values. "
                           "Train through GroupedLinear(fp8=...) or GroupedMLP(fp8=...), whose backward runs the "
                           "FP8 GEMMs of the gradients")

    return refuse


def _no_derivatives(op, name):
    op.register_derivatives(_not_differentiable(name), setup_context=None, jvp=_not_differentiable(name))


def _enum(op: str, name: str, value: int, names) -> int:
    """An int the op takes for one of `names` (the core's enum values are their indices)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(names):
        choices = ", ".join(f"{i} ({n})" for i, n in enumerate(names))
        raise ValueError(f"groupgemm::{op}: {name} must be one of {choices}, got {value!r}")
    return value


def _out_type(op: str, out_type: int) -> torch.dtype:
    return FP8_TORCH_DTYPES[_enum(op, "out_type", out_type, contract.FP8_DTYPES)]


def _scaling(op: str, scaling: int) -> int:
    return _enum(op, "scaling", scaling, contract.FP8_RECIPES)


def _quantize_rows_outputs(x, out_type, scaling, empty):
    require("fp8_quantize_rows", (x, 2, "x"))
    rowwise = _scaling("fp8_quantize_rows", scaling) == contract.FP8_ROWWISE
    scale_shape = (x.shape[0],) if rowwise else (x.shape[0], contract.fp8_blocks(x.shape[1]))
    return empty(x.shape, _out_type("fp8_quantize_rows", out_type)), empty(scale_shape, torch.float32)


@define("fp8_quantize_rows", _quantize_rows_outputs)
def fp8_quantize_rows_op(x: Tensor, out_type: int, scaling: int, power_of_two: bool = False) -> tuple[Tensor, Tensor]:
    """x [R, C] -> (q [R, C] float8, scale [R] rowwise or [R, ceil(C/128)])."""
    q, scale = _quantize_rows_outputs(x, out_type, scaling, allocator(x.device))
    _core.fp8_quantize_rows(capsule(x), _bytes(q), capsule(scale), scaling=scaling, power_of_two=power_of_two,
                            out_type=out_type, stream=device_scratch.stream(x.device))
    return q, scale


def _quantize_blocks_outputs(x, out_type, empty):
    require("fp8_quantize_blocks", (x, 3, "x"))
    scale_shape = (x.shape[0], contract.fp8_blocks(x.shape[1]), contract.fp8_blocks(x.shape[2]))
    return empty(x.shape, _out_type("fp8_quantize_blocks", out_type)), empty(scale_shape, torch.float32)


@define("fp8_quantize_blocks", _quantize_blocks_outputs)
def fp8_quantize_blocks_op(x: Tensor, out_type: int, power_of_two: bool = False) -> tuple[Tensor, Tensor]:
    """x [B, R, C] -> (q [B, R, C] float8, scale [B, ceil(R/128), ceil(C/128)])."""
    q, scale = _quantize_blocks_outputs(x, out_type, allocator(x.device))
    _core.fp8_quantize_blocks(capsule(x), _bytes(q), capsule(scale), power_of_two=power_of_two, out_type=out_type,
                              stream=device_scratch.stream(x.device))
    return q, scale


def _quantize_grouped_outputs(x, group_sizes, num_groups, out_type, scaling, empty):
    require("fp8_quantize_grouped", (x, 2, "x"), (group_sizes, 1, "group_sizes"))
    require_count("fp8_quantize_grouped", num_groups)
    m, c = x.shape
    scaling = _scaling("fp8_quantize_grouped", scaling)
    rows = num_groups if scaling == contract.FP8_ROWWISE else contract.fp8_token_block_bound(m, num_groups)
    return empty((c, m), _out_type("fp8_quantize_grouped", out_type)), empty((rows, c), torch.float32)


@define("fp8_quantize_grouped", _quantize_grouped_outputs)
def fp8_quantize_grouped_op(x: Tensor, group_sizes: Tensor, num_groups: int, out_type: int, scaling: int,
                            power_of_two: bool = False, group_offset: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, C] -> (q [C, M] float8, scale [G, C] rowwise or [token_block_bound(M, G), C])."""
    q, scale = _quantize_grouped_outputs(x, group_sizes, num_groups, out_type, scaling, allocator(x.device))
    _core.fp8_quantize_grouped(capsule(x), capsule(group_sizes), capsule(group_offset), _bytes(q), capsule(scale),
                               capsule(_workspace(x.device, _core.Fp8Call.quantize_grouped, scaling, num_groups,
                                                  x.shape[0], 0, 0)),
                               num_groups=num_groups, scaling=scaling, power_of_two=power_of_two, out_type=out_type,
                               stream=device_scratch.stream(x.device))
    return q, scale


def _fp8_type(op: str, t: Tensor, name: str) -> int:
    if t.dtype not in FP8_TORCH_DTYPES:
        raise TypeError(f"groupgemm::{op}: {name} must be float8 ({', '.join(contract.FP8_DTYPES)}), got {t.dtype}")
    return FP8_TORCH_DTYPES.index(t.dtype)


def _require_scaled(op, lhs, rhs, lhs_scale, rhs_scale, scaling, *others):
    """The scaled GEMMs' operands: float8 lhs and rhs, dense contiguous scales of any rank,
    a known scaling; `others` as _require takes them."""
    require(op, (lhs, 2, "lhs"), (lhs_scale, None, "lhs_scale"), (rhs_scale, None, "rhs_scale"), *others)
    _fp8_type(op, lhs, "lhs"), _fp8_type(op, rhs, "rhs"), _scaling(op, scaling)


def _scaled_mm_outputs(lhs, rhs, lhs_scale, rhs_scale, group_sizes, scaling, out_dtype, bias, empty):
    _require_scaled("scaled_grouped_mm", lhs, rhs, lhs_scale, rhs_scale, scaling, (rhs, 3, "rhs"),
                    (group_sizes, 1, "group_sizes"), (bias, 2, "bias"))
    return empty((lhs.shape[0], rhs.shape[1]), out_dtype)


@define("scaled_grouped_mm", _scaled_mm_outputs)
def scaled_grouped_mm_op(lhs: Tensor, rhs: Tensor, lhs_scale: Tensor, rhs_scale: Tensor, group_sizes: Tensor,
                         scaling: int, out_dtype: torch.dtype, bias: Tensor | None = None,
                         group_offset: Tensor | None = None, group_ends: bool = False) -> Tensor:
    """out [M, N] = scaled lhs [M, K] @ rhs[g]^T ([G, N, K]) per group (+ bias[g]). group_ends:
    group_sizes holds cumulative group ends."""
    op = "scaled_grouped_mm"
    out = _scaled_mm_outputs(lhs, rhs, lhs_scale, rhs_scale, group_sizes, scaling, out_dtype, bias,
                             allocator(lhs.device))
    (m, k), (g, n, _) = lhs.shape, rhs.shape
    _core.scaled_grouped_matmul(_bytes(lhs), _bytes(rhs), *map(capsule, (lhs_scale, rhs_scale, group_sizes,
                                                                          group_offset, bias, out)),
                                capsule(_workspace(lhs.device, _core.Fp8Call.matmul, scaling, g, m, k, n)),
                                scaling=scaling, lhs_type=_fp8_type(op, lhs, "lhs"), rhs_type=_fp8_type(op, rhs, "rhs"),
                                group_ends=group_ends, stream=device_scratch.stream(lhs.device))
    return out


def _require_wgrad(op, lhs, rhs, lhs_scale, rhs_scale, scaling, group_sizes, num_groups):
    require_count(op, num_groups)
    _require_scaled(op, lhs, rhs, lhs_scale, rhs_scale, scaling, (rhs, 2, "rhs"), (group_sizes, 1, "group_sizes"))


def _scaled_wgrad_outputs(lhs, rhs, lhs_scale, rhs_scale, group_sizes, num_groups, scaling, out_dtype, empty):
    _require_wgrad("scaled_grouped_mm_wgrad", lhs, rhs, lhs_scale, rhs_scale, scaling, group_sizes, num_groups)
    return empty((num_groups, lhs.shape[0], rhs.shape[0]), out_dtype)


def _require_scaled_accumulate(lhs, rhs, lhs_scale, rhs_scale, group_sizes, scaling, accumulate_into):
    _require_wgrad("scaled_grouped_mm_wgrad_accumulate", lhs, rhs, lhs_scale, rhs_scale, scaling, group_sizes, 0)
    require("scaled_grouped_mm_wgrad_accumulate", (accumulate_into, 3, "accumulate_into"))


def _run_wgrad(lhs, rhs, lhs_scale, rhs_scale, group_sizes, scaling, out, group_offset, accumulate, group_ends):
    g, k, n = out.shape
    _core.scaled_grouped_matmul_wgrad(
        _bytes(lhs), _bytes(rhs), *map(capsule, (lhs_scale, rhs_scale, group_sizes, group_offset)),
        accumulate_into=capsule(out) if accumulate else None, out=capsule(out),
        workspace=capsule(_workspace(lhs.device, _core.Fp8Call.wgrad, scaling, g, lhs.shape[1], k, n)),
        scaling=scaling, lhs_type=FP8_TORCH_DTYPES.index(lhs.dtype), rhs_type=FP8_TORCH_DTYPES.index(rhs.dtype),
        accumulate=accumulate, group_ends=group_ends, stream=device_scratch.stream(lhs.device))


@define("scaled_grouped_mm_wgrad", _scaled_wgrad_outputs)
def scaled_grouped_mm_wgrad_op(lhs: Tensor, rhs: Tensor, lhs_scale: Tensor, rhs_scale: Tensor, group_sizes: Tensor,
                               num_groups: int, scaling: int, out_dtype: torch.dtype,
                               group_offset: Tensor | None = None, group_ends: bool = False) -> Tensor:
    """out [G, K, N]: out[g] = scaled lhs[:, rows_g] @ rhs[:, rows_g]^T (lhs [K, M], rhs [N, M])."""
    out = _scaled_wgrad_outputs(lhs, rhs, lhs_scale, rhs_scale, group_sizes, num_groups, scaling, out_dtype,
                                allocator(lhs.device))
    _run_wgrad(lhs, rhs, lhs_scale, rhs_scale, group_sizes, scaling, out, group_offset, False, group_ends)
    return out


# In place, so never differentiable: a torch.library.custom_op, which handles the mutation.
@torch.library.custom_op("groupgemm::scaled_grouped_mm_wgrad_accumulate", mutates_args=("accumulate_into",))
def scaled_grouped_mm_wgrad_accumulate_op(lhs: Tensor, rhs: Tensor, lhs_scale: Tensor, rhs_scale: Tensor,
                                          group_sizes: Tensor, scaling: int, accumulate_into: Tensor,
                                          group_offset: Tensor | None = None, group_ends: bool = False) -> None:
    _require_scaled_accumulate(lhs, rhs, lhs_scale, rhs_scale, group_sizes, scaling, accumulate_into)
    _run_wgrad(lhs, rhs, lhs_scale, rhs_scale, group_sizes, scaling, accumulate_into, group_offset, True,
               group_ends)


register_outputs("scaled_grouped_mm_wgrad_accumulate", _require_scaled_accumulate)


for _op, _name in ((fp8_quantize_rows_op, "fp8_quantize_rows"), (fp8_quantize_blocks_op, "fp8_quantize_blocks"),
                   (fp8_quantize_grouped_op, "fp8_quantize_grouped"), (scaled_grouped_mm_op, "scaled_grouped_mm"),
                   (scaled_grouped_mm_wgrad_op, "scaled_grouped_mm_wgrad")):
    _no_derivatives(_op, _name)
