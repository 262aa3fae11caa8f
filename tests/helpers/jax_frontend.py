"""groupgemm.jax behind the tests' frontend surface (see frontends.py). No torch here."""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
from cases import inputs

import groupgemm.jax as gj
from groupgemm import _contract

NAME = "jax"
NAMES = _contract.JAX_NAMES


def x64(enabled=True):
    """jax.enable_x64 as a context manager (jax.experimental's before jax 0.7)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    return enable(enabled)


def precision(dtype):
    """The context a dtype's arrays need: float64 exists only with x64 on."""
    return x64(dtype == "float64")


def _device(kind):
    return jax.devices("cpu" if kind == "cpu" else "gpu")[0]


def array(values, dtype, device="cpu"):
    return jax.device_put(jnp.asarray(values, dtype), _device(device))


def to_float64(a):
    return np.asarray(a).astype(np.float64)  # NumPy (ml_dtypes for bfloat16) widens exactly


def matmul(lhs, rhs, sizes, *, bias=None, transpose=False, offset=None, out_dtype=None):
    return gj.grouped_matmul(lhs, rhs, sizes, bias=bias, transpose_rhs=transpose, group_offset=offset,
                             preferred_element_type=out_dtype)


def wgrad(lhs, grad, sizes, num_groups, *, offset=None, accumulate_into=None, out_dtype=None):
    return gj.grouped_matmul_wgrad(lhs, grad, sizes, num_groups=num_groups, group_offset=offset,
                                   accumulate_into=accumulate_into, preferred_element_type=out_dtype)


def accumulate(lhs, grad, sizes, num_groups, acc, offset=None):
    """acc + the weight gradient, as a jitted step that donates acc (updated in place)."""
    step = jax.jit(lambda a: wgrad(lhs, grad, sizes, num_groups, offset=offset, accumulate_into=a), donate_argnums=0)
    return step(acc)


def forward_backward(case, dtype, with_bias, transpose, device="cpu"):
    """[out, dlhs, drhs, dbias] of a case's inputs in `dtype` (dbias is zeros without bias)."""
    x = inputs(case)
    rhs = x["rhs"].transpose(0, 2, 1) if transpose else x["rhs"]
    offset = None if case.group_offset is None else jnp.int32(case.group_offset)
    with precision(dtype), jax.default_device(_device(device)):
        sizes = jnp.asarray(x["group_sizes"])
        out, vjp = jax.vjp(lambda l, r, b: matmul(l, r, sizes, bias=b if with_bias else None, transpose=transpose,
                                                  offset=offset),
                           *(jnp.asarray(a, dtype) for a in (x["lhs"], rhs, x["bias"])))
        return [np.asarray(a) for a in (out, *vjp(jnp.asarray(x["dout"], dtype)))]


def check_float64_gradients(fn, args):
    """Reverse-mode gradients of fn against finite differences, in float64."""
    with x64():
        jax.test_util.check_grads(fn, tuple(jnp.asarray(a, jnp.float64) for a in args), order=1, modes=["rev"])


def cast(a, dtype):
    return jnp.asarray(a).astype(dtype)


def dtype_of(a):
    return np.dtype(a.dtype).name


def matmul_and_grads(lhs, rhs, sizes, dout, offset=None):
    """out, dlhs, drhs of a float32 grouped matmul of NumPy inputs, as float64 NumPy."""
    out, vjp = jax.vjp(lambda l, r: matmul(l, r, jnp.asarray(sizes), offset=offset), jnp.asarray(lhs), jnp.asarray(rhs))
    return [to_float64(a) for a in (out, *vjp(jnp.asarray(dout)))]
