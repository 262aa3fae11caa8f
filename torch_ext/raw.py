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
from groupgemm.torch_ext import device_scratch
from groupgemm.torch_ext.op_library import define

Tensor = torch.Tensor


def _stream(device: torch.device) -> int:
    return device_scratch.stream(device)


def _workspace(device: torch.device, num_groups: int) -> Tensor | None:
    return device_scratch.gemm_workspace(device, num_groups, _stream(device))


def _require(op: str, *tensors) -> None:
    """(tensor, rank, name) triples: the ranks an op's shape arithmetic relies on (None: any),
    and the dense, contiguous memory the core needs (it takes no strides)."""
    for t, rank, name in tensors:
        if t is None:
            continue
        if t.layout != torch.strided:
            raise TypeError(f"groupgemm::{op}: {name} must be a dense tensor (layout torch.strided), got {t.layout}")
        if rank is not None and t.dim() != rank:
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
                  out_dtype: torch.dtype | None = None, group_ends: bool = False) -> Tensor:
    """out_dtype None: the input dtype. group_ends: group_sizes holds cumulative group ends."""
    n = _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight)
    out = torch.empty((input.shape[0], n), dtype=out_dtype or input.dtype, device=input.device)
    _core.grouped_matmul(*map(_capsule, (input, weight, group_sizes, out)), bias=_capsule(bias),
                         group_offset=_capsule(group_offset), transpose_rhs=transpose_weight, group_ends=group_ends,
                         workspace=_capsule(_workspace(input.device, weight.shape[0])),
                         stream=_stream(input.device))
    return out


@grouped_mm_op.register_fake
def _(input, weight, group_sizes, bias=None, group_offset=None, transpose_weight=False, out_dtype=None,
      group_ends=False):
    n = _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight)
    return input.new_empty((input.shape[0], n), dtype=out_dtype or input.dtype)


@define("grouped_mm_wgrad")
def grouped_mm_wgrad_op(input: Tensor, grad: Tensor, group_sizes: Tensor, num_groups: int,
                        group_offset: Tensor | None = None, out_dtype: torch.dtype | None = None,
                        group_ends: bool = False) -> Tensor:
    """out_dtype None: the input dtype."""
    _require_wgrad("grouped_mm_wgrad", input, grad, group_sizes, num_groups)
    out = torch.empty((num_groups, input.shape[1], grad.shape[1]), dtype=out_dtype or input.dtype,
                      device=input.device)
    _core.grouped_matmul_wgrad(*map(_capsule, (input, grad, group_sizes, out)),
                               group_offset=_capsule(group_offset), accumulate=False, group_ends=group_ends,
                               workspace=_capsule(_workspace(input.device, num_groups)),
                               stream=_stream(input.device))
    return out


@grouped_mm_wgrad_op.register_fake
def _(input, grad, group_sizes, num_groups, group_offset=None, out_dtype=None, group_ends=False):
    _require_wgrad("grouped_mm_wgrad", input, grad, group_sizes, num_groups)
    return input.new_empty((num_groups, input.shape[1], grad.shape[1]), dtype=out_dtype or input.dtype)


# In place, so never differentiable: a torch.library.custom_op, which handles the mutation.
@torch.library.custom_op("groupgemm::grouped_mm_wgrad_accumulate", mutates_args=("accumulate_into",))
def grouped_mm_wgrad_accumulate_op(input: Tensor, grad: Tensor, group_sizes: Tensor,
                                   accumulate_into: Tensor, group_offset: Tensor | None = None,
                                   group_ends: bool = False) -> None:
    _require_accumulate(input, grad, group_sizes, accumulate_into)
    _core.grouped_matmul_wgrad(*map(_capsule, (input, grad, group_sizes, accumulate_into)),
                               group_offset=_capsule(group_offset), accumulate=True, group_ends=group_ends,
                               workspace=_capsule(_workspace(input.device, accumulate_into.shape[0])),
                               stream=_stream(input.device))


@grouped_mm_wgrad_accumulate_op.register_fake
def _(input, grad, group_sizes, accumulate_into, group_offset=None, group_ends=False):
    _require_accumulate(input, grad, group_sizes, accumulate_into)
    return None


@define("grouped_bias_grad")
def grouped_bias_grad_op(grad: Tensor, group_sizes: Tensor, num_groups: int, group_offset: Tensor | None = None,
                         out_dtype: torch.dtype | None = None, group_ends: bool = False) -> Tensor:
    """out_dtype None: grad's dtype."""
    _require_bias_grad(grad, group_sizes, num_groups)
    out = torch.empty((num_groups, grad.shape[1]), dtype=out_dtype or grad.dtype, device=grad.device)
    _core.grouped_bias_grad(*map(_capsule, (grad, group_sizes, out)), group_offset=_capsule(group_offset),
                            group_ends=group_ends, workspace=_capsule(_workspace(grad.device, num_groups)),
                            stream=_stream(grad.device))
    return out


@grouped_bias_grad_op.register_fake
def _(grad, group_sizes, num_groups, group_offset=None, out_dtype=None, group_ends=False):
    _require_bias_grad(grad, group_sizes, num_groups)
    return grad.new_empty((num_groups, grad.shape[1]), dtype=out_dtype or grad.dtype)


def _backward_outputs(input, weight, grad, group_sizes, transpose_weight, input_grad, weight_grad, bias_dtype,
                      accumulate_into, empty):
    n = _grouped_mm_columns(input, weight, group_sizes, None, transpose_weight)
    _require("grouped_mm_backward", (grad, 2, "grad"), (accumulate_into, 3, "accumulate_into"))
    none = lambda: empty((0,), input.dtype)  # one each: a custom op's outputs may not alias
    return (empty(tuple(input.shape), input.dtype) if input_grad else none(),
            empty(tuple(weight.shape), weight.dtype) if weight_grad and accumulate_into is None else none(),
            empty((weight.shape[0], n), bias_dtype) if bias_dtype is not None else none())


# The gradients of a grouped_mm from one core call: the input gradient (input_grad), the
# weight gradient (weight_grad: a new tensor, or added into accumulate_into in place) and
# the bias gradient (bias_dtype not None); a gradient not asked for comes back as an empty
# tensor. The same bits as grouped_mm, grouped_mm_wgrad (or its accumulate form) and
# grouped_bias_grad called apart. Not differentiable itself: a backward that must be
# differentiated again calls those ops instead (derivatives.py).
@torch.library.custom_op("groupgemm::grouped_mm_backward", mutates_args=("accumulate_into",))
def grouped_mm_backward_op(input: Tensor, weight: Tensor, grad: Tensor, group_sizes: Tensor,
                           group_offset: Tensor | None = None, transpose_weight: bool = False,
                           group_ends: bool = False, input_grad: bool = True, weight_grad: bool = True,
                           bias_dtype: torch.dtype | None = None,
                           accumulate_into: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=input.device)
    dinput, dweight, dbias = _backward_outputs(input, weight, grad, group_sizes, transpose_weight, input_grad,
                                               weight_grad, bias_dtype, accumulate_into, empty)
    drhs = accumulate_into if weight_grad and accumulate_into is not None else dweight if weight_grad else None
    _core.grouped_matmul_backward(*map(_capsule, (input, weight, grad, group_sizes)),
                                  dlhs=_capsule(dinput) if input_grad else None, drhs=_capsule(drhs),
                                  dbias=_capsule(dbias) if bias_dtype is not None else None,
                                  group_offset=_capsule(group_offset), transpose_rhs=transpose_weight,
                                  accumulate=accumulate_into is not None, group_ends=group_ends,
                                  workspace=_capsule(_workspace(input.device, weight.shape[0])),
                                  stream=_stream(input.device))
    return dinput, dweight, dbias


@grouped_mm_backward_op.register_fake
def _(input, weight, grad, group_sizes, group_offset=None, transpose_weight=False, group_ends=False,
      input_grad=True, weight_grad=True, bias_dtype=None, accumulate_into=None):
    return _backward_outputs(input, weight, grad, group_sizes, transpose_weight, input_grad, weight_grad,
                             bias_dtype, accumulate_into, lambda shape, dtype: input.new_empty(shape, dtype=dtype))


def incoming_grad(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """Incoming gradients may be wider, stride-0 (``y.sum().backward()``) or strided."""
    return grad.to(dtype).contiguous()
