"""The XLA FFI handlers check each buffer against the sizes they hand the core.

groupgemm.jax validates shapes at trace time, but the custom calls are registered targets
that any ``jax.ffi.ffi_call`` can reach: built with other shapes, a call must fail with an
error naming the buffer, never read or write past one. Each case below is a well-formed
call (run first, so the failure is the mismatch alone) and the same call with one buffer
changed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import groupgemm.jax  # noqa: F401  (registers the targets)
from groupgemm import _core

jax.config.update("jax_platforms", "cpu")

M, K, N, G = 8, 16, 24, 2
SIZES = jnp.array([3, 5], jnp.int32)
OFFSET = jnp.zeros((), jnp.int32)  # no window: group 0 first
NO_WORKSPACE = jax.ShapeDtypeStruct((0,), jnp.uint8)
F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn


def _zeros(shape, dtype=F32):
    return jnp.zeros(shape, dtype)


def _struct(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _matmul(lhs=(M, K), rhs=(G, K, N), out=(M, N), bias=(G, N)):
    call = jax.ffi.ffi_call("groupgemm_matmul", (_struct(out), NO_WORKSPACE))
    return call(_zeros(lhs), _zeros(rhs), SIZES, OFFSET, _zeros(bias), transpose_rhs=np.bool_(False))


def _wgrad(grad=(M, N), out=(G, K, N)):
    call = jax.ffi.ffi_call("groupgemm_wgrad", (_struct(out), NO_WORKSPACE))
    return call(_zeros((M, K)), _zeros(grad), SIZES, OFFSET, _zeros((0,)), accumulate=np.bool_(False))


def _bias_grad(out=(G, N)):
    call = jax.ffi.ffi_call("groupgemm_bias_grad", (_struct(out), NO_WORKSPACE))
    return call(_zeros((M, N)), SIZES, OFFSET)


def _backward(grad=(M, N), dlhs=(M, K), drhs=(G, K, N), dbias=(G, N)):
    call = jax.ffi.ffi_call("groupgemm_matmul_backward",
                            (_struct(dlhs), _struct(drhs), _struct(dbias), NO_WORKSPACE))
    return call(_zeros((M, K)), _zeros((G, K, N)), _zeros(grad), SIZES, OFFSET, transpose_rhs=np.bool_(False))


def _fp8_workspace(call, m, k, n):
    nbytes = _core.fp8_workspace_bytes(_core.Device.cpu, call, _core.Fp8Scaling.rowwise, G, m, k, n)
    return _struct((nbytes,), jnp.uint8)


def _scaled_matmul(rhs=(G, N, K), out=(M, N), lhs_scale=(M,), rhs_scale=(G * N,), bias=(G, N)):
    call = jax.ffi.ffi_call("groupgemm_scaled_matmul",
                            (_struct(out), _fp8_workspace(_core.Fp8Call.matmul, M, K, N)))
    return call(_zeros((M, K), E4M3), _zeros(rhs, E4M3), _zeros(lhs_scale), _zeros(rhs_scale), SIZES, OFFSET,
                _zeros(bias), scaling=np.int64(0))


def _scaled_wgrad(rhs=(N, M), out=(G, K, N), lhs_scale=(G * K,), rhs_scale=(G * N,)):
    call = jax.ffi.ffi_call("groupgemm_scaled_wgrad",
                            (_struct(out), _fp8_workspace(_core.Fp8Call.wgrad, M, K, N)))
    return call(_zeros((K, M), E4M3), _zeros(rhs, E4M3), _zeros(lhs_scale), _zeros(rhs_scale), SIZES, OFFSET,
                _zeros((0,)), scaling=np.int64(0), accumulate=np.bool_(False))


def _quantize_rows(q=(M, K), scale=(M,)):
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_rows", (_struct(q, E4M3), _struct(scale)))
    return call(_zeros((M, K)), scaling=np.int64(0), power_of_two=np.bool_(False))


def _quantize_grouped(q=(K, M), scale=(G, K)):  # q channel-major, one rowwise scale per group and channel
    workspace = _fp8_workspace(_core.Fp8Call.quantize_grouped, M, 0, 0)
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_grouped", (_struct(q, E4M3), _struct(scale), workspace))
    return call(_zeros((M, K)), SIZES, OFFSET, num_groups=np.int64(G), scaling=np.int64(0),
                power_of_two=np.bool_(False))


CASES = {
    "matmul rhs K": (_matmul, {"rhs": (G, K + 1, N)}, "rhs"),
    "matmul out": (_matmul, {"out": (M, N - 1)}, "out"),
    "matmul bias": (_matmul, {"bias": (G, N + 8)}, "bias"),
    "wgrad grad": (_wgrad, {"grad": (M - 1, N)}, "grad"),
    "wgrad out": (_wgrad, {"out": (G, K + 1, N)}, "out"),
    "bias_grad out": (_bias_grad, {"out": (G, N + 1)}, "out"),
    "backward grad": (_backward, {"grad": (M, N + 1)}, "grad"),
    "backward dlhs": (_backward, {"dlhs": (M + 1, K)}, "dlhs"),
    "backward drhs": (_backward, {"drhs": (G, K, N - 1)}, "drhs"),
    "backward dbias": (_backward, {"dbias": (G + 1, N)}, "dbias"),
    "scaled_matmul rhs K": (_scaled_matmul, {"rhs": (G, N, K + 1)}, "rhs"),
    "scaled_matmul out": (_scaled_matmul, {"out": (M + 1, N)}, "out"),
    "scaled_matmul lhs_scale": (_scaled_matmul, {"lhs_scale": (M - 1,)}, "lhs_scale"),
    "scaled_matmul rhs_scale": (_scaled_matmul, {"rhs_scale": (G * N + 1,)}, "rhs_scale"),
    "scaled_matmul bias": (_scaled_matmul, {"bias": (G, N + 1)}, "bias"),
    "scaled_wgrad rhs": (_scaled_wgrad, {"rhs": (N, M + 1)}, "rhs"),
    "scaled_wgrad out": (_scaled_wgrad, {"out": (G, K, N + 1)}, "out"),
    "scaled_wgrad rhs_scale": (_scaled_wgrad, {"rhs_scale": (G * N - 1,)}, "rhs_scale"),
    "quantize_rows q": (_quantize_rows, {"q": (M, K + 1)}, "q"),
    "quantize_rows scale": (_quantize_rows, {"scale": (M + 1,)}, "scale"),
    "quantize_grouped q": (_quantize_grouped, {"q": (M, K)}, "q"),
    "quantize_grouped scale": (_quantize_grouped, {"scale": (G + 1, K)}, "scale"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ffi_handler_rejects_a_buffer_of_another_shape_naming_it(case):
    fn, changed, name = CASES[case]
    jax.block_until_ready(fn())  # the well-formed call runs
    with pytest.raises(Exception, match=rf"groupgemm: .*\b{name}\b"):
        jax.block_until_ready(jax.jit(lambda: fn(**changed))())


def _quantize_rows_with(**attributes):
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_rows", (_struct((M, K), E4M3), _struct((M,))))
    return call(_zeros((M, K)), **attributes)


@pytest.mark.parametrize("attributes, match", [
    ({"scaling": np.int64(0), "has_bias": np.bool_(True)},
     r"does not take the attribute has_bias \(its attributes: scaling, power_of_two, out_type\)"),
    ({"power_of_two": np.bool_(False)}, "scaling must be given"),
    ({"scaling": np.int32(0)}, "scaling must be an int64"),
    ({"scaling": np.int64(0), "power_of_two": np.int64(1)}, "power_of_two must be a bool"),
])
def test_ffi_handler_refuses_attributes_it_does_not_declare_naming_them(attributes, match):
    jax.block_until_ready(_quantize_rows_with(scaling=np.int64(0)))  # the well-formed call runs
    with pytest.raises(Exception, match=rf"groupgemm: .*{match}"):
        jax.block_until_ready(jax.jit(lambda: _quantize_rows_with(**attributes))())
