"""The bad-input table: calls every frontend must refuse with a clear message naming the
argument. ``message`` is a regular expression; ``{lhs}``, ``{rhs}``, ``{transpose}`` and
``{out_dtype}`` stand for each frontend's spelling of those arguments. Rows with a
``core`` pattern reach the C++ core's own checks too, whose message must match it
(test_core.py holds the core to them)."""

import dataclasses
import re
import types
from collections.abc import Callable

import numpy as np
from cases import case, inputs

BOTH = ("jax", "torch")


@dataclasses.dataclass(frozen=True)
class BadInput:
    id: str
    call: Callable
    error: type
    pattern: str
    core: str | None = None  # what the C++ core's message must match, naming the argument its way; None: not reached
    frontends: tuple = BOTH

    def message(self, names):
        return self.pattern.format(**{k: re.escape(v) for k, v in names.items()})


def base_arguments(frontend):
    """lhs [6, 4], rhs [3, 4, 5], group sizes [2, 2, 2] (int32), in float32."""
    x = inputs(case("uniform"))
    return types.SimpleNamespace(
        lhs=frontend.array(x["lhs"][:6, :4], "float32"), rhs=frontend.array(x["rhs"][:3, :4, :5], "float32"),
        sizes=frontend.array([2, 2, 2], "int32"), array=frontend.array, cast=frontend.cast)


def _zeros(a, shape, dtype="float32"):
    return a.array(np.zeros(shape), dtype)


BAD_INPUTS = [
    BadInput("lhs_rank", lambda f, a: f.matmul(a.lhs[None], a.rhs, a.sizes), ValueError, "{lhs} must be 2-D",
             core="lhs must have rank 2"),
    BadInput("rhs_rank", lambda f, a: f.matmul(a.lhs, a.rhs[0], a.sizes), ValueError, "{rhs} must be 3-D",
             core="rhs must have rank 3"),
    BadInput("rhs_dtype", lambda f, a: f.matmul(a.lhs, a.cast(a.rhs, "bfloat16"), a.sizes), TypeError,
             "{rhs} dtype bfloat16 differs",
             core="rhs must have the dtype of lhs"),
    BadInput("lhs_not_float", lambda f, a: f.matmul(a.cast(a.lhs, "int32"), a.rhs, a.sizes), TypeError,
             "{lhs} must be float32, bfloat16, float16 or float64",
             core="lhs must be float32"),
    BadInput("no_contraction", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, transpose=True), ValueError,
             "does not contract .*{transpose}=True",
             core="rhs dimension 2 is 5, expected 4"),
    BadInput("transpose_not_bool", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, transpose="False"), TypeError,
             "{transpose} must be a bool, got 'False'"),
    BadInput("group_count", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes[:2]), ValueError,
             "group_sizes has 2 entries but there are 3 groups",
             core="group_sizes has 2 entries but there are 3 groups"),
    BadInput("sizes_2d", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes[None]), ValueError, "group_sizes must be 1-D",
             core="group_sizes must have rank 1"),
    BadInput("sizes_float", lambda f, a: f.matmul(a.lhs, a.rhs, a.cast(a.sizes, "float32")), TypeError,
             "group_sizes must be an integer",
             core="group_sizes must be int32 or int64"),
    BadInput("sizes_bool", lambda f, a: f.matmul(a.lhs, a.rhs, a.cast(a.sizes, "bool")), TypeError,
             "group_sizes must be an integer",
             core="group_sizes must be int32 or int64"),
    BadInput("window_too_small", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes[:1], offset=0), ValueError,
             "fewer than the 3 local groups",
             core="group_sizes has 1 entries, fewer than the 3 local groups"),
    BadInput("offset_not_scalar", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, offset=a.array([0, 1], "int32")),
             ValueError, "group_offset must be an int or a one-element",
             core="group_offset must be a scalar"),
    BadInput("offset_bool", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, offset=True), TypeError,
             "group_offset must be an integer"),
    BadInput("offset_numpy_bool", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, offset=np.bool_(False)), TypeError,
             "group_offset must be an integer"),
    BadInput("offset_float", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, offset=a.array(0.0, "float32")),
             TypeError, "group_offset must be an integer",
             core="group_offset must be int32 or int64"),
    BadInput("bias_shape", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, bias=_zeros(a, (3, 4))), ValueError,
             r"bias must have shape \(3, 5\)",
             core="bias dimension 1 is 4, expected 5"),
    BadInput("bias_dtype", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, bias=_zeros(a, (3, 5), "bfloat16")),
             TypeError, "bias dtype bfloat16 differs",
             core="bias must have the dtype of lhs"),
    BadInput("output_dtype", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes, out_dtype="float16"), TypeError,
             "{out_dtype} float16 is not supported for float32 inputs",
             core="output dtype float16 is not allowed for float32 inputs"),
    BadInput("wgrad_rows", lambda f, a: f.wgrad(a.lhs, a.lhs[:2], a.sizes, 3), ValueError,
             "grad has 2 rows but {lhs} has 6",
             core="grad dimension 0 is 2, expected 6"),
    BadInput("wgrad_num_groups_bool", lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, True), ValueError,
             "num_groups must be a non-negative int"),
    BadInput("wgrad_num_groups_negative", lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, -1), ValueError,
             "num_groups must be a non-negative int"),
    BadInput("wgrad_num_groups_past_int32", lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, 2**40), ValueError,
             r"num_groups = 1099511627776 exceeds 2147483647 \(the core counts groups in int32\)"),
    BadInput("accumulate_dtype",
             lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, 3, accumulate_into=_zeros(a, (3, 4, 4), "bfloat16")),
             TypeError, "accumulate_into must be float32, got bfloat16",
             core="accumulate_into must be float32, got bfloat16"),
    BadInput("accumulate_shape", lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, 3, accumulate_into=_zeros(a, (3, 4, 5))),
             ValueError, r"accumulate_into must have shape \(3, 4, 4\)",
             core="out dimension 2 is 5, expected 4"),
]

# What only one frontend can be handed: JAX takes Python lists and has no devices,
# contiguity or autograd flags at trace time; torch has no preferred_element_type here.
TORCH_ONLY = [
    BadInput("sizes_list", lambda f, a: f.matmul(a.lhs, a.rhs, [2, 2, 2]), TypeError,
             "group_sizes must be a 1-D integer tensor", frontends=("torch",)),
    BadInput("sizes_device", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes.to("meta")), ValueError,
             "group_sizes is on meta but the inputs are on cpu", frontends=("torch",)),
    BadInput("accumulate_not_contiguous",
             lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, 3, accumulate_into=_zeros(a, (3, 4, 4)).transpose(1, 2)),
             ValueError, "accumulate_into must be contiguous", frontends=("torch",)),
    BadInput("accumulate_requires_grad",
             lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, 3, accumulate_into=_zeros(a, (3, 4, 4)).requires_grad_()),
             ValueError, "accumulate_into must not require grad", frontends=("torch",)),
    BadInput("accumulate_operand_requires_grad",  # the in-place sum would have no gradient
             lambda f, a: f.wgrad(a.lhs.detach().requires_grad_(), a.lhs, a.sizes, 3,
                                  accumulate_into=_zeros(a, (3, 4, 4))),
             ValueError, "accumulate_into adds in place, outside autograd, so its operands must not require grad",
             frontends=("torch",)),
    BadInput("accumulate_negative_view",  # its memory holds the negated sums: adding would subtract
             lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, 3, accumulate_into=_zeros(a, (3, 4, 4))._neg_view()),
             ValueError, "accumulate_into is a negative or conjugate view", frontends=("torch",)),
    BadInput("input_sparse", lambda f, a: f.matmul(a.lhs.to_sparse(), a.rhs, a.sizes), TypeError,
             "{lhs} must be a dense tensor \\(layout torch.strided\\), got torch.sparse_coo", frontends=("torch",)),
    BadInput("weight_mkldnn", lambda f, a: f.matmul(a.lhs, a.rhs.to_mkldnn(), a.sizes), TypeError,
             "{rhs} must be a dense tensor \\(layout torch.strided\\), got torch._mkldnn", frontends=("torch",)),
    BadInput("sizes_sparse", lambda f, a: f.matmul(a.lhs, a.rhs, a.sizes.to_sparse()), TypeError,
             "group_sizes must be a dense tensor", frontends=("torch",)),
    BadInput("accumulate_aliases_input",
             lambda f, a: (lambda buf: f.wgrad(buf.view(12, 4), buf.view(12, 4), a.array([4, 4, 4], "int32"), 3,
                                               accumulate_into=buf))(_zeros(a, (3, 4, 4))),
             ValueError, "accumulate_into shares memory with lhs", frontends=("torch",)),
]
JAX_ONLY = [
    BadInput("accumulate_with_output_dtype",
             lambda f, a: f.wgrad(a.lhs, a.lhs, a.sizes, 3, accumulate_into=_zeros(a, (3, 4, 4)), out_dtype="bfloat16"),
             TypeError, "preferred_element_type bfloat16 conflicts with accumulate_into", frontends=("jax",)),
]
BAD_INPUTS += TORCH_ONLY + JAX_ONLY
