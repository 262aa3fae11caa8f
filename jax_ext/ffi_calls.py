"""The FFI calls of groupgemm for JAX: XLA FFI targets registered at import, and the
custom calls, each partitioned by its layout (partitioning.py); primitives.py makes the
grouped GEMMs differentiable primitives of them.

Arguments arrive checked (functional.py); the core re-checks what it can see.
"""

import enum
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _core
from groupgemm.jax_ext.partitioning import Layout, partitioned


def _register_targets():
    """Registers every XLA FFI target of the core with jax, for the platforms this build has."""
    handlers = _core.ffi_handlers()
    for platform in ["cpu"] + (["CUDA"] if _core.cuda_compiled() else []):
        for name, capsule in handlers[platform].items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register_targets()


# jax releases before varying-axis types (0.5, 0.6) have neither of these; there a
# shard_map result carries no such type and nothing needs marking.
_TYPES_VARYING_AXES = hasattr(jax, "typeof") and hasattr(jax.lax, "pcast")


def varying_axes(*values):
    """shard_map axes along which any of `values` varies (None entries are skipped)."""
    if not _TYPES_VARYING_AXES:
        return ()
    axes = set()
    for v in values:
        if v is not None:
            manual = getattr(jax.typeof(v), "manual_axis_type", None)
            axes |= set(manual.varying) if manual is not None else set()
    return tuple(sorted(axes))


def mark_varying(value, axes):
    """Types `value` as varying along `axes` inside shard_map.

    XLA runs the custom call once per device, so a result varies wherever an operand
    does, but ffi_call results carry no such type: without this, a psum over them would
    be computed as if they were replicated, and cotangents would not match their
    primals' types.
    """
    if not _TYPES_VARYING_AXES:
        return value
    missing = tuple(a for a in axes if a not in varying_axes(value))
    return jax.lax.pcast(value, missing, to="varying") if missing else value


# The public ops whose calls a workspace size serves, for the refusal of a symbolic one
# (the calls are made while lowering, where the op the caller named is gone).
_WORKSPACE_OPS = {"workspace_bytes": "grouped_matmul", "permute_workspace_bytes": "permute",
                  "unpermute_backward_workspace_bytes": "unpermute (its gradient)",
                  "expert_mlp_workspace_bytes": "expert_mlp",
                  "fp8_workspace_bytes": "quantize_fp8_grouped / scaled_grouped_matmul / grouped_mlp(fp8=...)"}


def workspace(nbytes, *args):
    """The CUDA backend's scratch for one call, ``nbytes(Device.cuda, *args)`` bytes, as an extra
    XLA output: a command buffer cannot allocate. The CPU backend ignores it (and CPU-only
    builds make it empty). Its size is the core's arithmetic on static sizes, so a symbolic
    one (jax.export's shape polymorphism) is refused, named, where CUDA is built."""
    if not _core.cuda_compiled():
        return jax.ShapeDtypeStruct((0,), jnp.uint8)
    symbolic = [a for a in args if not isinstance(a, (numbers.Integral, enum.Enum))]  # jax.export's dims
    if symbolic:
        op = _WORKSPACE_OPS[nbytes.__name__]
        raise ValueError(f"{op}: a symbolic size ({', '.join(map(str, symbolic))}) sizes this call's CUDA workspace, "
                         "which the core computes from static sizes; export it with static shapes (a symbolic "
                         "number of rows works for grouped_matmul)")
    return jax.ShapeDtypeStruct((nbytes(_core.Device.cuda, *args),), jnp.uint8)


def placeholder(dtype):
    """A size-0 operand standing in for an absent one (a bias, an accumulator, probs), or a
    result not asked for."""
    return jnp.zeros((0,), dtype)


def _matmul_layout(*, transpose_rhs, **_):
    # lhs [M, K], rhs [G, K, N] or [G, N, K], group_sizes, group_offset, bias [G, N] -> [M, N]
    return Layout(("m k", "g n k" if transpose_rhs else "g k n", "t", "", "g n"), ("m n",), rows="m",
                  groups="g", summed=("k", "g"), replicated=("t",), added=(4,), sizes=2, offset=3,
                  dtypes=((0, "out_dtype"),))


@partitioned(_matmul_layout)
def matmul(lhs, rhs, group_sizes, group_offset, bias=None, *, transpose_rhs, out_dtype):
    m, g = lhs.shape[0], rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    call = jax.ffi.ffi_call("groupgemm_matmul",
                            (jax.ShapeDtypeStruct((m, n), out_dtype), workspace(_core.workspace_bytes, g)))
    out, _ = call(lhs, rhs, group_sizes, group_offset, placeholder(lhs.dtype) if bias is None else bias,
                  transpose_rhs=np.bool_(transpose_rhs))
    return (out,)


# lhs [M, K], grad [M, N], group_sizes, group_offset, accumulate_into [G, K, N] -> [G, K, N]: the rows
# are contracted.
@partitioned(Layout(("m k", "m n", "t", "", "g k n"), ("g k n",), rows="m", groups="g", summed=("m",),
                    replicated=("t",), added=(4,), sizes=2, offset=3, local_sizes=(("num_groups", "g"),),
                    dtypes=((0, "out_dtype"),)))
def wgrad(lhs, grad, group_sizes, group_offset, accumulate_into=None, *, num_groups, out_dtype):
    shape = (num_groups, lhs.shape[1], grad.shape[1])
    accumulate = accumulate_into is not None
    call = jax.ffi.ffi_call(
        "groupgemm_wgrad",
        (jax.ShapeDtypeStruct(shape, out_dtype), workspace(_core.workspace_bytes, num_groups)),
        # The accumulator is updated in place when the caller donates it.
        input_output_aliases={4: 0} if accumulate else None,
    )
    out, _ = call(lhs, grad, group_sizes, group_offset,
                  accumulate_into if accumulate else placeholder(out_dtype), accumulate=np.bool_(accumulate))
    return (out,)


# grad [M, N], group_sizes, group_offset -> [G, N]
@partitioned(Layout(("m n", "t", ""), ("g n",), rows="m", groups="g", summed=("m",), replicated=("t",), sizes=1,
                    offset=2, local_sizes=(("num_groups", "g"),), dtypes=((0, "out_dtype"),)))
def bias_grad(grad, group_sizes, group_offset, *, num_groups, out_dtype):
    call = jax.ffi.ffi_call("groupgemm_bias_grad", (jax.ShapeDtypeStruct((num_groups, grad.shape[1]), out_dtype),
                                                    workspace(_core.workspace_bytes, num_groups)))
    out, _ = call(grad, group_sizes, group_offset)
    return (out,)


def _backward_layout(*, transpose_rhs, want_dlhs, want_drhs, want_dbias, **_):
    # grad [M, N], lhs [M, K], rhs, group_sizes, group_offset -> dlhs [M, K], drhs (rhs's
    # shape), dbias [G, N]; a gradient not wanted is a size-0 placeholder of a factor of its
    # own. Each result is a partial sum over the factors it lacks: dlhs over N and the
    # experts, drhs and dbias over the rows. dlhs is in lhs's dtype (the core's), so a
    # 16-bit dlhs split over N is rounded on each device before the sum.
    rhs = "g n k" if transpose_rhs else "g k n"
    results = ("m k" if want_dlhs else "no_dlhs", rhs if want_drhs else "no_drhs", "g n" if want_dbias else "no_dbias")
    return Layout(("m n", "m k", rhs, "t", ""), results, rows="m", groups="g", summed=("m", "n", "g"),
                  replicated=("t",), sizes=3, offset=4, dtypes=((1, "drhs_dtype"), (2, "dbias_dtype")))


@partitioned(_backward_layout)
def matmul_backward(grad, lhs, rhs, group_sizes, group_offset, *, transpose_rhs, want_dlhs, want_drhs, want_dbias,
                    dbias_dtype, drhs_dtype=None):
    """The gradients of ``matmul(lhs, rhs) + bias`` for its incoming ``grad`` (lhs's dtype),
    from one core call: ``(dlhs, drhs, dbias)``, each a size-0 placeholder unless wanted;
    drhs in rhs's dtype unless ``drhs_dtype`` (float32: a device's partial sum) says."""
    m, k, g = lhs.shape[0], lhs.shape[1], rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    result = lambda wanted, shape, dtype: jax.ShapeDtypeStruct(shape if wanted else (0,), dtype)
    call = jax.ffi.ffi_call(
        "groupgemm_matmul_backward",
        (result(want_dlhs, (m, k), lhs.dtype), result(want_drhs, rhs.shape, drhs_dtype or rhs.dtype),
         result(want_dbias, (g, n), dbias_dtype), workspace(_core.workspace_bytes, g)))
    dlhs, drhs, dbias, _ = call(lhs, rhs, grad, group_sizes, group_offset, transpose_rhs=np.bool_(transpose_rhs))
    return dlhs, drhs, dbias
