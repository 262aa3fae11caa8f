"""The GEMM ops of groupgemm for PyTorch (namespace ``groupgemm``; their
derivatives are in derivatives.py).

Each op allocates its outputs with torch (so CUDA-graph memory pools work) and hands
every tensor to the core zero-copy through groupgemm._core; the CUDA stream is the
current torch stream. The public functions check every argument first
(functional.py); called directly, an op checks what it needs to run (ranks and
contiguity here, dtypes, shapes and devices in the core). Every optional argument has a
schema default: ``torch.ops.groupgemm.grouped_mm(x, w, group_sizes)`` works.
"""


import torch

from groupgemm import _core
from groupgemm.torch_ext import device_scratch
from groupgemm.torch_ext.core_args import capsule, require, require_count
from groupgemm.torch_ext.op_library import allocator, define, register_outputs

Tensor = torch.Tensor


def _workspace(device: torch.device, num_groups: int) -> Tensor | None:
    return device_scratch.gemm_workspace(device, num_groups, device_scratch.stream(device))


def _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight) -> int:
    require("grouped_mm", (input, 2, "input"), (weight, 3, "weight"), (group_sizes, 1, "group_sizes"),
             (bias, 2, "bias"))
    return weight.shape[1] if transpose_weight else weight.shape[2]


def _grouped_mm_outputs(input, weight, group_sizes, bias, transpose_weight, out_dtype, empty):
    n = _grouped_mm_columns(input, weight, group_sizes, bias, transpose_weight)
    return empty((input.shape[0], n), out_dtype or input.dtype)


def _require_wgrad(op, input, grad, group_sizes, num_groups) -> None:
    require_count(op, num_groups)
    require(op, (input, 2, "input"), (grad, 2, "grad"), (group_sizes, 1, "group_sizes"))


def _wgrad_outputs(input, grad, group_sizes, num_groups, out_dtype, empty):
    _require_wgrad("grouped_mm_wgrad", input, grad, group_sizes, num_groups)
    return empty((num_groups, input.shape[1], grad.shape[1]), out_dtype or input.dtype)


def _require_accumulate(input, grad, group_sizes, accumulate_into) -> None:
    _require_wgrad("grouped_mm_wgrad_accumulate", input, grad, group_sizes, 0)
    require("grouped_mm_wgrad_accumulate", (accumulate_into, 3, "accumulate_into"))


def _bias_grad_outputs(grad, group_sizes, num_groups, out_dtype, empty):
    require_count("grouped_bias_grad", num_groups)
    require("grouped_bias_grad", (grad, 2, "grad"), (group_sizes, 1, "group_sizes"))
    return empty((num_groups, grad.shape[1]), out_dtype or grad.dtype)


@define("grouped_mm", _grouped_mm_outputs)
def grouped_mm_op(input: Tensor, weight: Tensor, group_sizes: Tensor, bias: Tensor | None = None,
                  group_offset: Tensor | None = None, transpose_weight: bool = False,
                  out_dtype: torch.dtype | None = None, group_ends: bool = False) -> Tensor:
    """out_dtype None: the input dtype. group_ends: group_sizes holds cumulative group ends."""
    out = _grouped_mm_outputs(input, weight, group_sizes, bias, transpose_weight, out_dtype, allocator(input.device))
    _core.grouped_matmul(*map(capsule, (input, weight, group_sizes, group_offset, bias, out)),
                         capsule(_workspace(input.device, weight.shape[0])), transpose_rhs=transpose_weight,
                         group_ends=group_ends, stream=device_scratch.stream(input.device))
    return out


@define("grouped_mm_wgrad", _wgrad_outputs)
def grouped_mm_wgrad_op(input: Tensor, grad: Tensor, group_sizes: Tensor, num_groups: int,
                        group_offset: Tensor | None = None, out_dtype: torch.dtype | None = None,
                        group_ends: bool = False) -> Tensor:
    """out_dtype None: the input dtype."""
    out = _wgrad_outputs(input, grad, group_sizes, num_groups, out_dtype, allocator(input.device))
    _core.grouped_matmul_wgrad(*map(capsule, (input, grad, group_sizes, group_offset)), out=capsule(out),
                               workspace=capsule(_workspace(input.device, num_groups)), group_ends=group_ends,
                               stream=device_scratch.stream(input.device))
    return out


# In place, so never differentiable: a torch.library.custom_op, which handles the mutation.
@torch.library.custom_op("groupgemm::grouped_mm_wgrad_accumulate", mutates_args=("accumulate_into",))
def grouped_mm_wgrad_accumulate_op(input: Tensor, grad: Tensor, group_sizes: Tensor,
                                   accumulate_into: Tensor, group_offset: Tensor | None = None,
                                   group_ends: bool = False) -> None:
    _require_accumulate(input, grad, group_sizes, accumulate_into)
    _core.grouped_matmul_wgrad(*map(capsule, (input, grad, group_sizes, group_offset)),
                               capsule(accumulate_into), out=capsule(accumulate_into), accumulate=True,
                               group_ends=group_ends,
                               workspace=capsule(_workspace(input.device, accumulate_into.shape[0])),
                               stream=device_scratch.stream(input.device))


register_outputs("grouped_mm_wgrad_accumulate", _require_accumulate)


@define("grouped_bias_grad", _bias_grad_outputs)
def grouped_bias_grad_op(grad: Tensor, group_sizes: Tensor, num_groups: int, group_offset: Tensor | None = None,
                         out_dtype: torch.dtype | None = None, group_ends: bool = False) -> Tensor:
    """out_dtype None: grad's dtype."""
    out = _bias_grad_outputs(grad, group_sizes, num_groups, out_dtype, allocator(grad.device))
    _core.grouped_bias_grad(*map(capsule, (grad, group_sizes, group_offset, out)),
                            capsule(_workspace(grad.device, num_groups)), group_ends=group_ends,
                            stream=device_scratch.stream(grad.device))
    return out


def _backward_outputs(input, weight, grad, group_sizes, accumulate_into, transpose_weight, input_grad, weight_grad,
                      bias_dtype, empty):
    n = _grouped_mm_columns(input, weight, group_sizes, None, transpose_weight)
    require("grouped_mm_backward", (grad, 2, "grad"), (accumulate_into, 3, "accumulate_into"))
    none = lambda: empty((0,), input.dtype)  # one each: a custom op's outputs may not alias
    return (empty(tuple(input.shape), input.dtype) if input_grad else none(),
            empty(tuple(weight.shape), weight.dtype) if weight_grad and accumulate_into is None else none(),
            empty((weight.shape[0], n), bias_dtype) if bias_dtype is not None else none())


# The gradients of a grouped_mm from one core call: the input gradient (input_grad), the
# weight gradient (weight_grad: a new tensor, or added into accumulate_into in place) and
# the bias gradient (bias_dtype not None); a gradient not asked for comes back as an empty
# tensor. The same bits as grouped_mm, grouped_mm_wgrad (or its accumulate form) and
# grouped_bias_grad called apart. Not differentiable itself: a backward that must be
# differentiated again calls those ops instead (derivatives.py). accumulate_into, the
# argument it may mutate, has no default: torch 2.11 leaves a defaulted argument out of a
# call that does not pass it, and then fails looking for the mutated one.
@torch.library.custom_op("groupgemm::grouped_mm_backward", mutates_args=("accumulate_into",))
def grouped_mm_backward_op(input: Tensor, weight: Tensor, grad: Tensor, group_sizes: Tensor,
                           accumulate_into: Tensor | None, group_offset: Tensor | None = None,
                           transpose_weight: bool = False, group_ends: bool = False, input_grad: bool = True,
                           weight_grad: bool = True,
                           bias_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    dinput, dweight, dbias = _backward_outputs(input, weight, grad, group_sizes, accumulate_into, transpose_weight,
                                               input_grad, weight_grad, bias_dtype, allocator(input.device))
    drhs = accumulate_into if weight_grad and accumulate_into is not None else dweight if weight_grad else None
    _core.grouped_matmul_backward(*map(capsule, (input, weight, grad, group_sizes, group_offset)),
                                  dlhs=capsule(dinput) if input_grad else None, drhs=capsule(drhs),
                                  dbias=capsule(dbias) if bias_dtype is not None else None,
                                  workspace=capsule(_workspace(input.device, weight.shape[0])),
                                  transpose_rhs=transpose_weight, accumulate=accumulate_into is not None,
                                  group_ends=group_ends, stream=device_scratch.stream(input.device))
    return dinput, dweight, dbias


register_outputs("grouped_mm_backward", _backward_outputs)
