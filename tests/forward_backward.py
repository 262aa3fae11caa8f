"""One case's forward and all its gradients through each frontend, on "cpu" or "cuda",
from the shared inputs: what the parity and GPU tests compare."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from cases import inputs
import groupgemm.jax as gj
import groupgemm.torch as gt

JNP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}
def x64(enabled):
    """jax.enable_x64 as a context manager (jax.experimental's before jax 0.7)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    return enable(enabled)


TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _operands(case, transpose):
    x = inputs(case)
    return x, (x["rhs"].transpose(0, 2, 1) if transpose else x["rhs"])


def jax_forward_backward(case, dtype, with_bias, transpose, device="cpu"):
    """[out, dlhs, drhs, dbias] as NumPy arrays in `dtype` (dbias is zeros without bias)."""
    x, rhs = _operands(case, transpose)
    off = case.group_offset
    with x64(dtype == "float64"), jax.default_device(jax.devices("cpu" if device == "cpu" else "gpu")[0]):
        j = lambda a: jnp.asarray(a, JNP[dtype])  # noqa: E731
        out, vjp = jax.vjp(lambda l, r, b: gj.grouped_matmul(
            l, r, jnp.asarray(x["group_sizes"]), bias=b if with_bias else None, transpose_rhs=transpose,
            group_offset=None if off is None else jnp.int32(off)), j(x["lhs"]), j(rhs), j(x["bias"]))
        return [np.asarray(a) for a in (out, *vjp(j(x["dout"])))]


def torch_forward_backward(case, dtype, with_bias, transpose, device="cpu"):
    """[out, dinput, dweight, dbias] as tensors on `device` (dbias is zeros without bias)."""
    x, rhs = _operands(case, transpose)
    off = case.group_offset
    t = lambda a: torch.tensor(np.asarray(a), dtype=TORCH[dtype], device=device, requires_grad=True)  # noqa: E731
    lhs_t, rhs_t, bias_t = t(x["lhs"]), t(rhs), t(x["bias"])
    out = gt.grouped_mm(lhs_t, rhs_t, torch.from_numpy(x["group_sizes"]).to(device), bias_t if with_bias else None,
                        transpose_weight=transpose,
                        group_offset=None if off is None else torch.tensor(off, device=device))
    out.backward(t(x["dout"]).detach())
    return [out, lhs_t.grad, rhs_t.grad, bias_t.grad if with_bias else torch.zeros_like(bias_t)]
