"""JAX arguments in the terms of groupgemm._contract: shapes and dtype names, the integer
operands (group sizes, offsets) as the arrays the core reads, and the varying axes every
operand of a call shares inside shard_map. Shared by the checked public functions
(functional.py, expert.py, fp8.py, fp8_recipe.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm.jax_ext import ffi_calls


def dtype_name(dtype):
    return np.dtype(dtype).name


def requested_dtype(dtype, name, fn):
    """A dtype argument's name (None for None); what NumPy does not take for a dtype is
    refused, named."""
    if dtype is None:
        return None
    try:
        return dtype_name(dtype)
    except TypeError as e:
        raise TypeError(f"{fn}: {name} must be a dtype, got {dtype!r}") from e


def shape_and_dtype(x):
    return tuple(x.shape), dtype_name(x.dtype)


def as_array(x, name, fn, optional=False):
    """x as a JAX array, as jnp.asarray makes it (a NumPy array, a list, a scalar); None where
    ``optional`` and x is None. What does not convert (None, a string, a dict) is refused,
    named, rather than with JAX's message, which does not say which argument it was."""
    if x is None and optional:
        return None
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{fn}: {name} must be an array, got {type(x).__name__}") from e


def as_arrays(fn, optional=False, **named):
    """as_array of each keyword argument, named by its keyword, in order."""
    return [as_array(x, name, fn, optional) for name, x in named.items()]


def index_input(x, name, fn):
    """An integer operand as a JAX array holding its values. Without jax_enable_x64, JAX
    holds no 64-bit integers and would silently wrap a NumPy int64 / uint64 array into 32
    bits: such an array is taken when its values fit int32, and refused, named, otherwise."""
    if isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "iu" and x.dtype.itemsize == 8 \
            and not jax.config.jax_enable_x64:
        if x.size and (x.min() < -contract.INT32_MAX - 1 or x.max() > contract.INT32_MAX):
            raise ValueError(f"{fn}: {name} holds values outside int32's range ({x.min()} to {x.max()}), which "
                             "JAX without jax_enable_x64 cannot hold (it would wrap them); enable x64 or pass "
                             "values that fit")
        x = x.astype(np.int32)
    return as_array(x, name, fn)


def index_array(x, role="size"):
    """An integer operand as the int32/int64 array the core reads, its value kept; one past
    the target's maximum saturates or becomes contract.past_maximum(role)."""
    conversion = contract.index_conversion(dtype_name(x.dtype))
    if conversion is None:
        return x
    target, saturate = conversion
    if target == "int64" and not jax.config.jax_enable_x64:
        target = "int32"  # without int64, saturate at int32's maximum instead
    if not saturate:
        return x.astype(target)
    top, past = np.iinfo(target).max, contract.past_maximum(role, target)
    saturated = jnp.minimum(x, top).astype(target)
    return saturated if past is None else jnp.where(x > top, np.array(past, target), saturated)


def index_operands(group_sizes, group_offset, num_groups, num_rows, fn):
    """group_sizes / group_offset as the core's operands (group_offset 0 when absent)."""
    if isinstance(group_sizes, (list, tuple)) and not any(isinstance(v, jax.Array) for v in group_sizes):
        # else traced, as a jit argument; int64 for NumPy (an empty list would be float),
        # held by JAX as int32 without x64 (index_input)
        group_sizes = np.asarray(contract.static_group_sizes(group_sizes, num_rows, fn), np.int64)
    group_sizes = index_input(group_sizes, "group_sizes", fn)
    contract.check_group_sizes(group_sizes.shape, dtype_name(group_sizes.dtype), num_groups,
                               group_offset is not None, fn)
    group_sizes = index_array(group_sizes)
    if group_offset is None:
        return group_sizes, jnp.zeros((), jnp.int32)
    if not isinstance(group_offset, (jax.Array, np.ndarray)):  # a Python or NumPy scalar
        group_offset = contract.static_group_offset(group_offset, num_groups, group_sizes.shape[0], fn)
    group_offset = index_input(group_offset, "group_offset", fn)
    contract.check_group_offset_array(group_offset.shape, dtype_name(group_offset.dtype), fn)
    return group_sizes, index_array(group_offset.reshape(()))


def same_varying_axes(operands, index_operands):
    """Inside shard_map, the float operands get the varying axes of all operands: the
    primitives type results like them, and cotangents must match their primals' types."""
    axes = ffi_calls.varying_axes(*operands, *index_operands)
    return [None if x is None else ffi_calls.mark_varying(x, axes) for x in operands]
