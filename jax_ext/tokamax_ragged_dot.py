"""groupgemm as an implementation of tokamax's ragged dot: a callable that
``tokamax.ragged_dot`` / ``tokamax.ragged_dot_general`` take in ``implementation=[...]``
(checked against tokamax 0.0.12). tokamax calls each implementation in turn with its
keyword arguments and moves on to the next one when it raises ``NotImplementedError``, so
what groupgemm does not compute raises that, naming the argument. The ragged modes and
their dimension numbers are the drop-in's (dropins.ragged_dot_general)."""

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm.jax_ext import dropins

FN = "tokamax_implementation"
# jax.lax.DotAlgorithmPreset names of what the core computes for each operand dtype: the
# products in that dtype, accumulated in float32 (float64 for float64).
EXACT_PRESETS = {"float32": "F32_F32_F32", "bfloat16": "BF16_BF16_F32", "float16": "F16_F16_F32",
                 "float64": "F64_F64_F64"}


def _ragged_dot_dimensions():
    """jax.lax.ragged_dot's dimension numbers, which tokamax.ragged_dot passes; made on use,
    as jax 0.5, the oldest groupgemm supports, lacks their type."""
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _unsupported(name, what):
    return NotImplementedError(f"{FN}: {name} {what}; another implementation may take it")


def _operand_dtype(x, name):
    """The dtype of a plain float array; anything else (a quantized operand, an integer
    array) is for another implementation."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise _unsupported(name, f"is a {type(x).__name__}, not an array (quantized operands are not supported)")
    if np.dtype(x.dtype).name not in contract.FLOAT_DTYPES:
        raise _unsupported(name, f"has dtype {np.dtype(x.dtype).name}; supported: {', '.join(contract.FLOAT_DTYPES)}")
    return x.dtype


def _check_precision(precision, dtype):
    """None, a jax.lax.Precision (or its name, or a pair of them): the core computes in the
    operands' dtype with float32 accumulation whatever is asked, which meets every one of
    them; a DotAlgorithmPreset (or its name) only where it names that arithmetic. A value
    jax.lax refuses gets jax.lax's error."""
    dropins.check_precision(precision)
    pair = isinstance(precision, (tuple, list)) and not isinstance(precision, jax.lax.DotAlgorithm)
    for p in precision if pair else (precision,):
        if isinstance(p, str):  # a Precision's name, or else (jax.lax took it) a preset's
            p = jax.lax.DotAlgorithmPreset[p] if p in jax.lax.DotAlgorithmPreset.__members__ else None
        if p is None or isinstance(p, jax.lax.Precision):
            continue
        if isinstance(p, jax.lax.DotAlgorithmPreset) and p.name in ("DEFAULT", EXACT_PRESETS[dtype]):
            continue
        raise _unsupported("precision", f"{precision!r} is not supported for {dtype} operands (use None, a "
                                        f"jax.lax.Precision, or DotAlgorithmPreset.{EXACT_PRESETS[dtype]})")


def _output_dtype(preferred, dtype):
    """The result's dtype: the operands' by default, or any float dtype the accumulator
    (float32, float64 for float64 operands) rounds to; a wider one would need a wider
    accumulation than the core's."""
    if preferred is None:
        return dtype
    out = np.dtype(preferred).name
    accumulator = contract.accumulate_dtype(dtype)
    if out not in contract.FLOAT_DTYPES or np.dtype(out).itemsize > np.dtype(accumulator).itemsize:
        raise _unsupported("preferred_element_type", f"{out} is not supported for {dtype} operands (use a float "
                                                     f"dtype no wider than {accumulator})")
    return out


def tokamax_implementation(lhs, rhs, *, group_sizes, ragged_dot_dimension_numbers=None, precision=None,
                           preferred_element_type=None, activation=None, **others):
    """groupgemm as a ``tokamax.ragged_dot`` implementation::

        tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=[groupgemm.jax.tokamax_implementation, "xla"])

    Takes the keyword arguments tokamax passes an implementation (``group_sizes``, a
    device array or ``tokamax.RaggedDotGroupSizes``; ``ragged_dot_dimension_numbers``;
    ``precision``; ``preferred_element_type``; ``activation``). The ragged modes are
    ``groupgemm.jax.ragged_dot_general``'s: ragged non-contracting (the forward, either
    weight layout) and ragged contracting (the weight gradient). Gradients are
    groupgemm's: an empty group gets an exact-zero weight gradient, and rows owned by no
    group are exact zeros. ``activation`` is applied to the result in the accumulator's
    dtype (float32, float64 for float64 operands) before it is rounded to the output
    dtype, as tokamax's kernels fuse it.

    Raises ``NotImplementedError`` naming the argument, so that tokamax tries the next
    implementation, for: operands that are not float arrays (quantized ``QArray``s,
    integers), other dimension numbers (batch dimensions beside a ragged one), a
    ``precision`` naming another algorithm than the core's (a ``DotAlgorithm``, or a
    ``DotAlgorithmPreset`` other than ``DEFAULT`` and the operands' own, such as
    ``F32_F32_F32`` for float32), a ``preferred_element_type`` wider than the accumulator
    or not a float, and any keyword argument it does not know.
    """
    if others:
        raise _unsupported(", ".join(sorted(others)), "is not an argument this implementation knows")
    dtype = jnp.promote_types(_operand_dtype(lhs, "lhs"), _operand_dtype(rhs, "rhs")).name  # as jax.lax promotes
    _check_precision(precision, dtype)
    out_dtype = _output_dtype(preferred_element_type, dtype)
    group_sizes = getattr(group_sizes, "value", group_sizes)  # tokamax.RaggedDotGroupSizes: its array
    dimensions = _ragged_dot_dimensions() if ragged_dot_dimension_numbers is None else ragged_dot_dimension_numbers
    # The core writes the accumulator's dtype where the result is rounded afterwards: once.
    # The dtype is named even where direct: left to the drop-in, jax.lax's rule would apply
    # (float16 with bfloat16 gives bfloat16).
    direct = activation is None and out_dtype == dtype
    try:
        out = dropins.ragged_dot_general(lhs, rhs, group_sizes, dimensions,
                                         preferred_element_type=dtype if direct else contract.accumulate_dtype(dtype))
    except NotImplementedError as e:
        raise _unsupported("ragged_dot_dimension_numbers", f"not supported: {e}") from e
    if activation is not None:
        out = activation(out)
    return out.astype(out_dtype)
