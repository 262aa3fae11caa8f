"""The raw calls of groupgemm for PyTorch: custom ops (namespace ``groupgemm``) and their
autograd.

Each op allocates its outputs with torch (so CUDA-graph memory pools work) and hands
every tensor to the core zero-copy through groupgemm._core; the CUDA stream is the
current torch stream. Backward is built from the same custom ops and never reads
group sizes on the host. The public functions check every argument first
(functional.py); called directly, an op checks what it needs to run (ranks and
contiguity here, dtypes, shapes and devices in the core).
"""


import torch
from torch.utils.dlpack import to_dlpack

from groupgemm import _core

Tensor = torch.Tensor


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _workspace(device: torch.device, num_groups: int) -> Tensor | None:
    """Scratch for the CUDA backend's per-group setup, allocated by torch like any output."""
    if device.type != "cuda":
        return None
    return torch.empty(_core.workspace_bytes(_core.Device.cuda, num_groups), dtype=torch.uint8, device=device)


def _require(op: str, *tensors) -> None:
    """(tensor, rank, name) triples: the ranks an op's shape arithmetic relies on, and the
    contiguity the core needs (it takes no strides)."""
    for t, rank, name in tensors:
        if t is None:
            continue
        if t.dim() != rank:
            raise ValueError(f"groupgemm::{op}: {name} must be {rank}-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"groupgemm::{op}: {name} must be contiguous")


def _require_count(op: str, num_groups: int) -> None:
    if num_groups < 0:
        raise ValueError(f"groupgemm::{op}: num_groups must be non-negative, got {num_groups}")


def _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight) -> int:
    _require("grouped_mm", (input, 2, "input"), (weight, 3, "weight"), (group_sizes, 1, "group_sizes"),
             (bias, 2, "bias"))
    return weight.shape[1] if transpose_weight else weight.shape[2]


def _require_wgrad(op, input, grad, group_sizes, num_groups) -> None:
    _require_count(op, num_groups)
    _require(op, (input, 2, "input"), (grad, 2, "grad"), (group_sizes, 1, "group_sizes"))


def _require_accumulate(input, grad, group_sizes, accumulate_into) -> None:
    _require_wgrad("grouped_mm_wgrad_accumulate", input, grad, group_sizes, 0)
    _require("grouped_mm_wgrad_accumulate", (accumulate_into, 3, "accumulate_into"))


def _require_bias_grad(grad, group_sizes, num_groups) -> None:
    _require_count("grouped_bias_grad", num_groups)
    _require("grouped_bias_grad", (grad, 2, "grad"), (group_sizes, 1, "group_sizes"))


def _capsule(t: Tensor | None):
    """A tensor as a DLPack capsule for the core (zero-copy). The legacy to_dlpack is used
    on purpose: it is several times cheaper than Tensor.__dlpack__, which would be most
    of an empty call's time (README, call overhead), and it accepts tensors that require
    grad."""
    return None if t is None else to_dlpack(t)


@torch.library.custom_op("groupgemm::grouped_mm", mutates_args=())
def grouped_mm_op(input: Tensor, weight: Tensor, group_sizes: Tensor, bias: Tensor | None,
                  group_offset: Tensor | None, transpose_weight: bool, out_dtype: torch.dtype) -> Tensor:
    n = _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight)
    out = torch.empty((input.shape[0], n), dtype=out_dtype, device=input.device)
    _core.grouped_matmul(*map(_capsule, (input, weight, group_sizes, out)), bias=_capsule(bias),
                         group_offset=_capsule(group_offset), transpose_rhs=transpose_weight,
                         workspace=_capsule(_workspace(input.device, weight.shape[0])),
                         stream=_stream(input.device))
    return out


@grouped_mm_op.register_fake
def _(input, weight, group_sizes, bias, group_offset, transpose_weight, out_dtype):
    n = _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight)
    return input.new_empty((input.shape[0], n), dtype=out_dtype)


@torch.library.custom_op("groupgemm::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad_op(input: Tensor, grad: Tensor, group_sizes: Tensor, num_groups: int,
                        group_offset: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    _require_wgrad("grouped_mm_wgrad", input, grad, group_sizes, num_groups)
    out = torch.empty((num_groups, input.shape[1], grad.shape[1]), dtype=out_dtype, device=input.device)
    _core.grouped_matmul_wgrad(*map(_capsule, (input, grad, group_sizes, out)),
                               group_offset=_capsule(group_offset), accumulate=False,
                               workspace=_capsule(_workspace(input.device, num_groups)),
                               stream=_stream(input.device))
    return out


@grouped_mm_wgrad_op.register_fake
def _(input, grad, group_sizes, num_groups, group_offset, out_dtype):
    _require_wgrad("grouped_mm_wgrad", input, grad, group_sizes, num_groups)
    return input.new_empty((num_groups, input.shape[1], grad.shape[1]), dtype=out_dtype)


@torch.library.custom_op("groupgemm::grouped_mm_wgrad_accumulate", mutates_args=("accumulate_into",))
def grouped_mm_wgrad_accumulate_op(input: Tensor, grad: Tensor, group_sizes: Tensor,
                                   accumulate_into: Tensor, group_offset: Tensor | None) -> None:
    _require_accumulate(input, grad, group_sizes, accumulate_into)
    _core.grouped_matmul_wgrad(*map(_capsule, (input, grad, group_sizes, accumulate_into)),
                               group_offset=_capsule(group_offset), accumulate=True,
                               workspace=_capsule(_workspace(input.device, accumulate_into.shape[0])),
                               stream=_stream(input.device))


@grouped_mm_wgrad_accumulate_op.register_fake
def _(input, grad, group_sizes, accumulate_into, group_offset):
    _require_accumulate(input, grad, group_sizes, accumulate_into)
    return None


@torch.library.custom_op("groupgemm::grouped_bias_grad", mutates_args=())
def grouped_bias_grad_op(grad: Tensor, group_sizes: Tensor, num_groups: int,
                         group_offset: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    _require_bias_grad(grad, group_sizes, num_groups)
    out = torch.empty((num_groups, grad.shape[1]), dtype=out_dtype, device=grad.device)
    _core.grouped_bias_grad(*map(_capsule, (grad, group_sizes, out)), group_offset=_capsule(group_offset),
                            workspace=_capsule(_workspace(grad.device, num_groups)),
                            stream=_stream(grad.device))
    return out


@grouped_bias_grad_op.register_fake
def _(grad, group_sizes, num_groups, group_offset, out_dtype):
    _require_bias_grad(grad, group_sizes, num_groups)
    return grad.new_empty((num_groups, grad.shape[1]), dtype=out_dtype)


def incoming_grad(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """Incoming gradients may be wider, stride-0 (``y.sum().backward()``) or strided."""
    return grad.to(dtype).contiguous()


def input_and_bias_grads(ctx, grad, weight, group_sizes, group_offset, dtype):
    """dinput and dbias of a grouped_mm, shared by the plain and the main_grad autograd."""
    dinput = dbias = None
    if ctx.needs_input_grad[0]:
        dinput = grouped_mm_op(grad, weight, group_sizes, None, group_offset, not ctx.transpose_weight, dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
        dbias = grouped_bias_grad_op(grad, group_sizes, weight.shape[0], group_offset, ctx.bias_dtype)
    return dinput, dbias


def _setup_context(ctx, inputs, output):
    input, weight, group_sizes, bias, group_offset, transpose_weight, _ = inputs
    ctx.save_for_backward(input, weight, group_sizes, group_offset)
    ctx.transpose_weight = transpose_weight
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    input, weight, group_sizes, group_offset = ctx.saved_tensors
    grad = incoming_grad(grad, input.dtype)
    dinput, dbias = input_and_bias_grads(ctx, grad, weight, group_sizes, group_offset, input.dtype)
    dweight = None
    if ctx.needs_input_grad[1]:
        a, b = (grad, input) if ctx.transpose_weight else (input, grad)  # weight [G,N,K] or [G,K,N]
        dweight = grouped_mm_wgrad_op(a, b, group_sizes, weight.shape[0], group_offset, weight.dtype)
    return dinput, dweight, None, dbias, None, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
