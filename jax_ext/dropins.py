"""Drop-ins for the grouped GEMMs JAX code already calls: ``jax.lax.ragged_dot``,
``jax.lax.ragged_dot_general`` and megablox's ``gmm`` / ``tgmm`` (MaxText's path), with
their signatures, their exception types and their output dtypes, backed by groupgemm:
one GEMM per group, group sizes on the device, ``group_offset`` working, exact zeros
where no group owns a row, and every JAX transformation (primitives.py)."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm.jax_ext.arguments import index_operands
from groupgemm.jax_ext.functional import grouped_matmul, grouped_matmul_wgrad
from groupgemm.jax_ext.partitioning import explicit_types, group_ends


@contextlib.contextmanager
def _raised_as(fn, type_error=False, names=()):
    """The errors of the groupgemm function a drop-in calls, raised as the drop-in's: its name
    first, arguments the two name apart in the caller's terms (``names``: (ours, theirs)),
    and for jax.lax's drop-ins a TypeError, as jax.lax raises for operands that do not fit."""
    try:
        yield
    except (TypeError, ValueError) as e:
        message = re.sub(r"^grouped_matmul(_wgrad)?: ", f"{fn}: ", str(e))
        for ours, theirs in names:
            message = re.sub(rf"\b{ours}\b", theirs, message)
        raise (TypeError if type_error else type(e))(message) from e


def check_precision(precision):
    """``precision`` as jax.lax checks it (its ValueError for another value); the core does not
    use it."""
    if precision is not None:
        jax.eval_shape(lambda a: jax.lax.dot(a, a, precision=precision), jax.ShapeDtypeStruct((1, 1), jnp.float32))


def _common_dtype(lhs, rhs):
    """jax.lax promotes mixed operand dtypes; the core multiplies one dtype."""
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    return lhs.astype(dtype), rhs.astype(dtype)


def _output_dtype(lhs, rhs, preferred):
    """The output dtype asked for, or where none is and the operands' dtypes differ, the one
    jax.lax gives them (its own rule: float16 with bfloat16 gives bfloat16, where the common
    dtype is float32). ragged_dot and ragged_dot_general share the rule, which reads only the
    dtypes: it is asked of stand-in operands of one group, since jax.lax knows no
    group_offset window and would refuse the call's group sizes."""
    if preferred is not None or lhs.dtype == rhs.dtype:
        return preferred
    return jax.eval_shape(jax.lax.ragged_dot, jax.ShapeDtypeStruct((1, 1), lhs.dtype),
                          jax.ShapeDtypeStruct((1, 1, 1), rhs.dtype), jax.ShapeDtypeStruct((1,), jnp.int32)).dtype


def _core_output(in_dtype, preferred):
    """The output dtype the core writes for ``preferred_element_type``, and the dtype to
    cast it to afterwards (None: the core writes the requested one). Another dtype is
    rounded to once, from the core's most precise output (float32 for 16-bit inputs): a
    float64 result of bfloat16 operands keeps its float32 sums."""
    if preferred is None:
        return None, None
    name, in_name = np.dtype(preferred).name, np.dtype(in_dtype).name
    wider = contract.WIDER_OUTPUTS.get(in_name, ())
    if name == in_name or name in wider:
        return preferred, None
    return (jnp.dtype(wider[-1]) if wider else None), preferred


def _finish(out, cast, out_sharding):
    """The result in the requested dtype and sharding: on a mesh with explicit axes its
    type (as jax.lax gives it), elsewhere a constraint for XLA's partitioner."""
    out = out if cast is None else out.astype(cast)
    if out_sharding is None:
        return out
    if explicit_types(getattr(out, "aval", None)):
        return jax.sharding.reshard(out, out_sharding)
    return jax.lax.with_sharding_constraint(out, out_sharding)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
               out_sharding=None):
    """``jax.lax.ragged_dot`` with the same arguments, results and exception types.

    One GEMM per group instead of a masked dense product, and ``group_offset`` works.
    ``precision`` is checked as jax.lax checks it, and not used: the core accumulates in
    float32 (float64 for float64 inputs). A ``preferred_element_type`` the core does not
    write (float64 for 16-bit operands, a narrower float) is rounded to once, from its
    most precise result.
    """
    check_precision(precision)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    preferred_element_type = _output_dtype(lhs, rhs, preferred_element_type)
    lhs, rhs = _common_dtype(lhs, rhs)
    native, cast = _core_output(lhs.dtype, preferred_element_type)
    with _raised_as("ragged_dot", type_error=True):
        out = grouped_matmul(lhs, rhs, group_sizes, group_offset=group_offset, preferred_element_type=native)
    return _finish(out, cast, out_sharding)


def _check_dimension_numbers(dims, lhs_ndim, rhs_ndim):
    """Each dimension named is one of its operand's, named once (lhs's ragged dimension aside,
    which is one of the others or not): a TypeError otherwise, as jax.lax raises. Taken
    modulo the rank, a wrong one would silently multiply another dimension."""
    fields = ("dot_dimension_numbers", "lhs_ragged_dimensions", "rhs_group_dimensions")
    if not all(hasattr(dims, f) for f in fields):  # where jax.lax raises an AttributeError of its own
        raise TypeError(f"ragged_dot_general: ragged_dot_dimension_numbers must be a "
                        f"jax.lax.RaggedDotDimensionNumbers, got {dims!r}")
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims.dot_dimension_numbers
    for operand, ndim, named, ragged in (
            ("lhs", lhs_ndim, (*lhs_contract, *lhs_batch), tuple(dims.lhs_ragged_dimensions)),
            ("rhs", rhs_ndim, (*rhs_contract, *rhs_batch, *dims.rhs_group_dimensions), ())):
        outside = [d for d in (*named, *ragged) if not 0 <= d < ndim]
        if outside or len(set(named)) != len(named):
            raise TypeError(f"ragged_dot_general: the dimension numbers name {operand} dimensions "
                            f"{sorted(named + ragged)}, which must be distinct dimensions of its {ndim} ({dims})")


def _mode(dims, lhs_ndim):
    """The ragged mode of ``jax.lax.ragged_dot_general``'s dimension numbers."""
    (lhs_contract, _), (lhs_batch, _) = dims.dot_dimension_numbers
    if len(dims.lhs_ragged_dimensions) != 1:
        raise TypeError("ragged_dot_general: lhs must have exactly one ragged dimension")
    ragged = dims.lhs_ragged_dimensions[0]
    if ragged in lhs_contract:
        return "ragged contracting", ragged
    if ragged in lhs_batch:
        return "ragged batch", ragged
    return "ragged non-contracting", ragged


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, out_sharding=None):
    """``jax.lax.ragged_dot_general`` for its three modes, backed by groupgemm:

    - ragged non-contracting: lhs ``[m, k]`` (either order) with ``m`` ragged, rhs with one
      group dimension, one contracting dimension and one output dimension (any order):
      a grouped matmul, ``[m, n]``;
    - ragged contracting: lhs and rhs 2-D, the ragged dimension contracted (such as
      ``lhs [k, m]`` and ``rhs [k, n]`` contracting dimension 0, the weight-gradient form):
      ``[g, m, n]``, each group's rows contracted;
    - ragged batch: the groups do not change the product: ``jax.lax.dot_general``.

    Other dimension numbers (batch dimensions beside a ragged one) raise
    ``NotImplementedError`` naming the mode.
    """
    check_precision(precision)
    dims = ragged_dot_dimension_numbers
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _check_dimension_numbers(dims, lhs.ndim, rhs.ndim)
    preferred_element_type = _output_dtype(lhs, rhs, preferred_element_type)
    lhs, rhs = _common_dtype(lhs, rhs)
    mode, ragged = _mode(dims, lhs.ndim)
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims.dot_dimension_numbers
    native, cast = _core_output(lhs.dtype, preferred_element_type)
    if mode == "ragged batch":  # the groups do not change the product, but they are integers
        contract.check_index_dtype(np.dtype(jnp.asarray(group_sizes).dtype).name, "group_sizes",
                                   "ragged_dot_general")
        return _finish(jax.lax.dot_general(lhs, rhs, dims.dot_dimension_numbers,
                                           preferred_element_type=preferred_element_type), None, out_sharding)
    if lhs_batch or rhs_batch or lhs.ndim != 2 or len(lhs_contract) != 1:
        raise NotImplementedError(f"ragged_dot_general ({mode}): only 2-D lhs without batch dimensions is "
                                  f"supported, got lhs shape {lhs.shape} and {dims}")
    with _raised_as("ragged_dot_general", type_error=True):
        if mode == "ragged non-contracting":
            if len(dims.rhs_group_dimensions) != 1:
                raise TypeError(f"ragged_dot_general ({mode}) requires exactly one rhs group dimension, got {dims}")
            if rhs.ndim != 3:
                raise NotImplementedError(f"ragged_dot_general ({mode}): rhs must be 3-D, got shape {rhs.shape} "
                                          f"and {dims}")
            group_dim, k_dim = dims.rhs_group_dimensions[0], rhs_contract[0]
            (n_dim,) = {0, 1, 2} - {group_dim, k_dim}
            rows = lhs if lhs_contract[0] == 1 else lhs.T  # [m, k]
            weights = jnp.transpose(rhs, (group_dim, k_dim, n_dim))  # [g, k, n]
            out = grouped_matmul(rows, weights, group_sizes, group_offset=group_offset,
                                 preferred_element_type=native)
        else:
            if rhs.ndim != 2 or dims.rhs_group_dimensions:
                raise NotImplementedError(f"ragged_dot_general ({mode}): rhs must be 2-D without a group "
                                          f"dimension, got shape {rhs.shape} and {dims}")
            rows = lhs if ragged == 0 else lhs.T  # [k, m]: the ragged contraction is the row axis
            grad = rhs if rhs_contract[0] == 0 else rhs.T  # [k, n]
            num_groups = jnp.asarray(group_sizes).shape[0]
            out = grouped_matmul_wgrad(rows, grad, group_sizes, num_groups=num_groups, group_offset=group_offset,
                                       preferred_element_type=native)
    return _finish(out, cast, out_sharding)


def _owned_rows(group_sizes, group_offset, num_local, num_rows):
    """Mask of the rows the local groups own (the schedule's clamped group ends), from the
    sizes and offset as the core reads them: widened first, so a narrow dtype (uint8 sizes
    of more rows than it holds) or an int64 offset past int32 is not wrapped."""
    sizes, offset = index_operands(group_sizes, group_offset, num_local, num_rows, "gmm")
    ends = group_ends(sizes, num_rows)
    bounds = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends])  # bounds[g] = where group g starts
    total = ends.shape[0]
    first = jnp.clip(offset, -num_local, total)  # the window's groups, clipped to those that exist
    begin, end = bounds[jnp.clip(first, 0, total)], bounds[jnp.clip(first + num_local, 0, total)]
    rows = jnp.arange(num_rows)
    return (rows >= begin) & (rows < end)


def _existing_out(existing_out, out, fn):
    """existing_out, which must be what the call writes: out's shape and dtype (the
    preferred_element_type; megablox raises ValueError for another), not broadcast or cast."""
    existing_out = jnp.asarray(existing_out)
    if existing_out.shape != out.shape or existing_out.dtype != out.dtype:
        raise ValueError(f"{fn}: existing_out must have the output's shape {out.shape} and dtype {out.dtype} "
                         f"(preferred_element_type), got {existing_out.shape} {existing_out.dtype}")
    return existing_out


def gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, tiling=(128, 128, 128), group_offset=None,
        existing_out=None, transpose_rhs=False, interpret=False):
    """megablox's ``gmm``: ``out[r] = lhs[r] @ rhs[g]`` for the local groups' rows, with its
    signature (``tiling`` and ``interpret`` are accepted and ignored: the core picks its
    kernel). With ``existing_out`` the local groups' rows are overwritten and every other
    row keeps ``existing_out``; without it they are exact zeros. Differentiable in
    ``lhs``, ``rhs`` (and ``existing_out``)."""
    del tiling, interpret
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    native, cast = _core_output(lhs.dtype, preferred_element_type)
    with _raised_as("gmm"):
        out = grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, group_offset=group_offset,
                             preferred_element_type=native)
    out = out if cast is None else out.astype(cast)
    if existing_out is None:
        return out
    owned = _owned_rows(group_sizes, group_offset, rhs.shape[0], lhs.shape[0])
    return jnp.where(owned[:, None], out, _existing_out(existing_out, out, "gmm"))


def tgmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, tiling=(128, 128, 128), group_offset=None,
         num_actual_groups=None, existing_out=None, interpret=False):
    """megablox's ``tgmm``: ``out[g] = lhs[:, rows_g] @ rhs[rows_g, :]`` for ``lhs [k, m]`` and
    ``rhs [m, n]``, ``[num_actual_groups, k, n]`` (all of group_sizes' groups by
    default, from ``group_offset``); empty groups give exact zeros; ``existing_out`` is
    added to. ``tiling`` and ``interpret`` are accepted and ignored."""
    del tiling, interpret
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[1] != rhs.shape[0]:  # named here: the core sees lhs.T
        raise ValueError(f"tgmm: lhs [k, m] and rhs [m, n] must share m, got lhs {lhs.shape} and rhs {rhs.shape}")
    if jnp.ndim(group_sizes) != 1:
        raise ValueError(f"tgmm: group_sizes must be 1-D [num_groups], got shape {jnp.shape(group_sizes)}")
    num_groups = jnp.asarray(group_sizes).shape[0] if num_actual_groups is None else num_actual_groups
    if group_offset is None and num_groups != jnp.asarray(group_sizes).shape[0]:
        group_offset = 0
    native, cast = _core_output(lhs.dtype, preferred_element_type)
    with _raised_as("tgmm", names=(("grad", "rhs"), ("num_groups", "num_actual_groups"))):
        out = grouped_matmul_wgrad(lhs.T, rhs, group_sizes, num_groups=num_groups, group_offset=group_offset,
                                   preferred_element_type=native)
    out = out if cast is None else out.astype(cast)
    return out if existing_out is None else out + _existing_out(existing_out, out, "tgmm")
