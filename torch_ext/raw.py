"""The raw calls of groupgemm for PyTorch: the GEMM ops (namespace ``groupgemm``; their
derivatives are in derivatives.py).

Each op allocates its outputs with torch (so CUDA-graph memory pools work) and hands
every tensor to the core zero-copy through groupgemm._core; the CUDA stream is the
current torch stream. The public functions check every argument first
(functional.py); called directly, an op checks what it needs to run (ranks and
contiguity here, dtypes, shapes and devices in the core). Every optional argument has a
schema default: ``torch.ops.groupgemm.grouped_mm(x, w, group_sizes)`` works.
"""


import torch
from torch.utils.dlpack import to_dlpack

from groupgemm import _core
from groupgemm.torch_ext.op_library import define

Tensor = torch.Tensor


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _workspace(device: torch.device, num_groups: int) -> Tensor | None:
    """Scratch for the CUDA backend's per-group setup, allocated by torch like any output."""
    if device.type != "cuda":
        return None
    # Its size depends on the device (the sm_90a kernels' scheduler scratch scales with the SM count).
    index = -1 if device.index is None else device.index
    nbytes = _core.workspace_bytes(_core.Device.cuda, num_groups, device_index=index)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


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


@define("grouped_mm")
def grouped_mm_op(input: Tensor, weight: Tensor, group_sizes: Tensor, bias: Tensor | None = None,
                  group_offset: Tensor | None = None, transpose_weight: bool = False,
                  out_dtype: torch.dtype | None = None) -> Tensor:
    """out_dtype None: the input dtype."""
    n = _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight)
    out = torch.empty((input.shape[0], n), dtype=out_dtype or input.dtype, device=input.device)
    _core.grouped_matmul(*map(_capsule, (input, weight, group_sizes, out)), bias=_capsule(bias),
                         group_offset=_capsule(group_offset), transpose_rhs=transpose_weight,
                         workspace=_capsule(_workspace(input.device, weight.shape[0])),
                         stream=_stream(input.device))
    return out


@grouped_mm_op.register_fake
def _(input, weight, group_sizes, bias=None, group_offset=None, transpose_weight=False, out_dtype=None):
    n = _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight)
    return input.new_empty((input.shape[0], n), dtype=out_dtype or input.dtype)


@define("grouped_mm_wgrad")
def grouped_mm_wgrad_op(input: Tensor, grad: Tensor, group_sizes: Tensor, num_groups: int,
                        group_offset: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """out_dtype None: the input dtype."""
    _require_wgrad("grouped_mm_wgrad", input, grad, group_sizes, num_groups)
    out = torch.empty((num_groups, input.shape[1], grad.shape[1]), dtype=out_dtype or input.dtype,
                      device=input.device)
    _core.grouped_matmul_wgrad(*map(_capsule, (input, grad, group_sizes, out)),
                               group_offset=_capsule(group_offset), accumulate=False,
                               workspace=_capsule(_workspace(input.device, num_groups)),
                               stream=_stream(input.device))
    return out


@grouped_mm_wgrad_op.register_fake
def _(input, grad, group_sizes, num_groups, group_offset=None, out_dtype=None):
    _require_wgrad("grouped_mm_wgrad", input, grad, group_sizes, num_groups)
    return input.new_empty((num_groups, input.shape[1], grad.shape[1]), dtype=out_dtype or input.dtype)


# In place, so never differentiable: a torch.library.custom_op, which handles the mutation.
@torch.library.custom_op("groupgemm::grouped_mm_wgrad_accumulate", mutates_args=("accumulate_into",))
def grouped_mm_wgrad_accumulate_op(input: Tensor, grad: Tensor, group_sizes: Tensor,
                                   accumulate_into: Tensor, group_offset: Tensor | None = None) -> None:
    _require_accumulate(input, grad, group_sizes, accumulate_into)
    _core.grouped_matmul_wgrad(*map(_capsule, (input, grad, group_sizes, accumulate_into)),
                               group_offset=_capsule(group_offset), accumulate=True,
                               workspace=_capsule(_workspace(input.device, accumulate_into.shape[0])),
                               stream=_stream(input.device))


@grouped_mm_wgrad_accumulate_op.register_fake
def _(input, grad, group_sizes, accumulate_into, group_offset=None):
    _require_accumulate(input, grad, group_sizes, accumulate_into)
    return None


@define("grouped_bias_grad")
def grouped_bias_grad_op(grad: Tensor, group_sizes: Tensor, num_groups: int, group_offset: Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> Tensor:
    """out_dtype None: grad's dtype."""
    _require_bias_grad(grad, group_sizes, num_groups)
    out = torch.empty((num_groups, grad.shape[1]), dtype=out_dtype or grad.dtype, device=grad.device)
    _core.grouped_bias_grad(*map(_capsule, (grad, group_sizes, out)), group_offset=_capsule(group_offset),
                            workspace=_capsule(_workspace(grad.device, num_groups)),
                            stream=_stream(grad.device))
    return out


@grouped_bias_grad_op.register_fake
def _(grad, group_sizes, num_groups, group_offset=None, out_dtype=None):
    _require_bias_grad(grad, group_sizes, num_groups)
    return grad.new_empty((num_groups, grad.shape[1]), dtype=out_dtype or grad.dtype)


def incoming_grad(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """Incoming gradients may be wider, stride-0 (``y.sum().backward()``) or strided."""
    return grad.to(dtype).contiguous()
