"""The core's entry points read what they declare: the array functions of groupgemm._core
(DLPack) and the XLA FFI targets any ``jax.ffi.ffi_call`` can reach refuse an enumerated
attribute outside its enum as given (never cut to 32 bits first), a weight-gradient
accumulator that is not the output itself, and an attribute, stream or array of the wrong
kind, each with an error naming the argument and what was expected; and an array the op writes
that shares memory with another it reads or writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.nn.functional import ScalingType

import groupgemm.jax  # noqa: F401  (registers the targets)
import groupgemm.torch as gt
from groupgemm import _core as core

M, K, N, G = 8, 16, 24, 2
SIZES = np.array([3, 5], np.int32)
F32 = jnp.float32
NO_WORKSPACE = jax.ShapeDtypeStruct((0,), jnp.uint8)
OUT_OF_ENUM = [2**32, 2**32 + 1, -1, 7]


# ---- enumerated attributes --------------------------------------------------------------


def activation_width(kind):
    return 3 if kind == core.Activation.swiglu else 6  # of h [4, 6]


def activation_raw(kind):
    core.activation(torch.zeros(4, 6), torch.zeros(4, activation_width(kind)), kind=kind)


def quantize_raw(**attributes):
    core.fp8_quantize_rows(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4),
                           **{"scaling": 0, "out_type": 0, **attributes})


def activation_ffi(kind):
    call = jax.ffi.ffi_call("groupgemm_activation", jax.ShapeDtypeStruct((4, activation_width(kind)), F32))
    jax.block_until_ready(jax.jit(lambda: call(jnp.zeros((4, 6)), kind=np.int64(kind)))())


def quantize_ffi(**attributes):
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_rows",
                            (jax.ShapeDtypeStruct((4, 8), jnp.uint8), jax.ShapeDtypeStruct((4,), F32)))
    attributes = {name: np.int64(v) for name, v in {"scaling": 0, "out_type": 0, **attributes}.items()}
    jax.block_until_ready(jax.jit(lambda: call(jnp.zeros((4, 8)), **attributes))())


ENUM_CALLS = {
    "kind": (activation_raw, activation_ffi, "0 \\(swiglu\\), 1 \\(gelu\\), 2 \\(relu\\) or 3 \\(silu\\)"),
    "scaling": (lambda v: quantize_raw(scaling=v), lambda v: quantize_ffi(scaling=v),
                "0 \\(rowwise\\) or 1 \\(blockwise\\)"),
    "out_type": (lambda v: quantize_raw(out_type=v), lambda v: quantize_ffi(out_type=v),
                 "0 \\(e4m3\\) or 1 \\(e5m2\\)"),
}


@pytest.mark.parametrize("value", OUT_OF_ENUM)
@pytest.mark.parametrize("attribute", list(ENUM_CALLS))
def test_an_enumerated_attribute_outside_its_enum_is_refused_as_given(attribute, value):
    raw, ffi, values = ENUM_CALLS[attribute]
    with pytest.raises(ValueError, match=f"{attribute} must be {values}, got {value}$"):
        raw(value)
    with pytest.raises(Exception, match=f"groupgemm: {attribute} must be {values}, got {value}"):
        ffi(value)


def test_every_enumerated_value_is_accepted():
    for kind in core.Activation:
        activation_raw(kind)
        activation_ffi(int(kind))
    for scaling in core.Fp8Scaling:
        quantize_raw(scaling=scaling)
    for fp8 in core.Fp8Type:
        quantize_raw(out_type=fp8)
        quantize_ffi(out_type=int(fp8))


# ---- the weight gradient's accumulator ---------------------------------------------------


def operands(rng):
    lhs, grad = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((M, N)).astype(np.float32)
    before = rng.standard_normal((G, K, N)).astype(np.float32)
    ends = np.cumsum(SIZES)
    want = before + np.stack([lhs[e - s:e].T.astype(np.float64) @ grad[e - s:e] for s, e in zip(SIZES, ends)])
    return lhs, grad, before, want


def test_the_ffi_weight_gradient_adds_into_its_aliased_accumulator():
    lhs, grad, before, want = operands(np.random.default_rng(0))
    call = jax.ffi.ffi_call("groupgemm_wgrad", (jax.ShapeDtypeStruct((G, K, N), F32), NO_WORKSPACE),
                            input_output_aliases={4: 0})
    out = jax.jit(lambda acc: call(lhs, grad, SIZES, jnp.zeros((), jnp.int32), acc, accumulate=np.bool_(True))[0])(
        jnp.asarray(before))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("accumulator, match", [
    ((G, K, N), "accumulate_into must be out itself \\(in XLA, aliased to out by input_output_aliases\\)"),
    ((7,), "accumulate_into must have rank 3, got 1"),
    ((0,), "accumulate_into must be given with accumulate"),
])
def test_the_ffi_weight_gradient_refuses_an_accumulator_it_would_not_read(accumulator, match):
    lhs, grad, before, _ = operands(np.random.default_rng(1))
    call = jax.ffi.ffi_call("groupgemm_wgrad", (jax.ShapeDtypeStruct((G, K, N), F32), NO_WORKSPACE))  # no alias
    acc = jnp.zeros(accumulator, F32)
    with pytest.raises(Exception, match=f"groupgemm: {match}"):
        jax.block_until_ready(jax.jit(lambda: call(lhs, grad, SIZES, jnp.zeros((), jnp.int32), acc,
                                                   accumulate=np.bool_(True)))())


def test_the_ffi_scaled_weight_gradient_refuses_an_unaliased_accumulator():
    call = jax.ffi.ffi_call("groupgemm_scaled_wgrad", (jax.ShapeDtypeStruct((G, K, N), F32), NO_WORKSPACE))
    e4m3 = jnp.float8_e4m3fn
    with pytest.raises(Exception, match="groupgemm: accumulate_into must be out itself"):
        jax.block_until_ready(jax.jit(lambda: call(
            jnp.zeros((K, M), e4m3), jnp.zeros((N, M), e4m3), jnp.ones(G * K), jnp.ones(G * N), SIZES,
            jnp.zeros((), jnp.int32), jnp.zeros((G, K, N)), scaling=np.int64(0), accumulate=np.bool_(True)))())


def test_the_raw_weight_gradient_reads_accumulate_into_as_out_itself():
    lhs, grad, before, want = operands(np.random.default_rng(2))
    lhs, grad, sizes = torch.from_numpy(lhs), torch.from_numpy(grad), torch.from_numpy(SIZES)
    acc = torch.from_numpy(before.copy())
    core.grouped_matmul_wgrad(lhs, grad, sizes, accumulate_into=acc, out=acc, accumulate=True)
    np.testing.assert_allclose(acc.numpy(), want, rtol=1e-5, atol=1e-5)
    for accumulate_into, match in ((None, "accumulate_into must be given with accumulate"),
                                   (acc.clone(), "accumulate_into must be out itself"),
                                   (torch.zeros(7, dtype=torch.float64), "accumulate_into must have rank 3")):
        with pytest.raises(ValueError, match=match):
            core.grouped_matmul_wgrad(lhs, grad, sizes, accumulate_into=accumulate_into, out=acc, accumulate=True)
    with pytest.raises(ValueError, match="accumulate_into is read only with accumulate"):
        core.grouped_matmul_wgrad(lhs, grad, sizes, accumulate_into=acc, out=acc)


# ---- attributes, streams and arrays of the wrong kind -------------------------------------


def test_the_raw_entry_points_name_an_attribute_or_stream_of_the_wrong_kind():
    h, out = torch.zeros(4, 6), torch.zeros(4, 6)
    with pytest.raises(TypeError, match="activation: kind must be an int \\(int64\\), got 'relu'"):
        core.activation(h, out, kind="relu")
    with pytest.raises(TypeError, match="activation: kind must be an int \\(int64\\), got 2.0"):
        core.activation(h, out, kind=2.0)
    with pytest.raises(TypeError, match="activation: kind must be an int \\(int64\\), got 36893488147419103232"):
        core.activation(h, out, kind=2**65)
    with pytest.raises(TypeError, match="activation: stream must be an int \\(a CUDA stream's address\\), got str"):
        core.activation(h, out, kind=2, stream="default")
    with pytest.raises(ValueError, match="transpose_rhs must be a bool \\(0 or 1\\), got 2"):
        core.grouped_matmul(torch.zeros(M, K), torch.zeros(G, K, N), torch.from_numpy(SIZES), out=torch.zeros(M, N),
                            transpose_rhs=2)


def test_a_read_only_operand_is_read_and_a_read_only_result_refused():
    h = np.arange(24, dtype=np.float32).reshape(4, 6) - 12
    h.flags.writeable = False
    out = np.zeros((4, 6), np.float32)
    core.activation(h, out, kind=core.Activation.relu)
    np.testing.assert_array_equal(out, np.maximum(h, 0))
    out.flags.writeable = False
    with pytest.raises(TypeError, match="activation: out must be writable: the op writes its result there"):
        core.activation(h.copy(), out, kind=core.Activation.relu)
    with pytest.raises(TypeError, match="activation: h must be C-contiguous \\(row-major without gaps\\)"):
        core.activation(np.zeros((6, 4), np.float32).T, np.zeros((4, 6), np.float32), kind=core.Activation.relu)
    with pytest.raises(TypeError, match="activation: h must be a DLPack array .*, got list"):
        core.activation([[0.0]], np.zeros((1, 1), np.float32), kind=core.Activation.relu)


def test_an_ffi_target_names_an_attribute_it_does_not_take():
    call = jax.ffi.ffi_call("groupgemm_unpermute", jax.ShapeDtypeStruct((2, 4), F32))
    with pytest.raises(Exception, match="groupgemm: groupgemm_unpermute does not take the attribute scale "
                                        "\\(its attributes: none\\)"):
        jax.block_until_ready(jax.jit(lambda: call(jnp.zeros((2, 4)), jnp.zeros((2, 1), jnp.int32), jnp.zeros((0,)),
                                                   scale=np.int64(2)))())


# ---- arrays the op writes, apart from the rest --------------------------------------------


def test_an_array_the_op_writes_may_not_share_memory_with_one_it_reads_or_writes():
    # Every entry point checks the bytes of the arrays it is given, so the raw calls, the
    # frontends' compiled calls and the layers' accumulators all meet the same refusal, before
    # anything is written; views of one buffer that do not overlap are separate arrays.
    rng = np.random.default_rng(3)
    sizes = torch.from_numpy(SIZES)
    buffer = torch.from_numpy(rng.standard_normal(M * K + M * N + G * K * N).astype(np.float32))
    lhs, out = buffer[:M * K].view(M, K), buffer[M * K:M * K + M * N].view(M, N)
    rhs = torch.from_numpy(rng.standard_normal((G, K, N)).astype(np.float32))
    core.grouped_matmul(lhs, rhs, sizes, out=out)  # adjacent views: apart
    np.testing.assert_allclose(out.numpy()[:3], lhs.numpy()[:3] @ rhs.numpy()[0], rtol=1e-5, atol=1e-5)
    before = buffer.clone()
    with pytest.raises(ValueError, match="^out shares memory with lhs; pass a separate buffer"):
        core.grouped_matmul(lhs, rhs, sizes, out=buffer[M * K - 1:M * K - 1 + M * N].view(M, N))
    grad, both = torch.randn(M, N), torch.zeros(M * K + G * K * N)
    with pytest.raises(ValueError, match="^drhs shares memory with dlhs; pass a separate buffer"):
        core.grouped_matmul_backward(lhs, rhs, grad, sizes, dlhs=both[:M * K].view(M, K),
                                     drhs=both[M * K - 1:-1].view(G, K, N))
    assert torch.equal(buffer, before) and not both.any()

    def frontend_wgrad(acc):  # the raw torch op (the accumulator as out), through the public function
        return gt.grouped_mm_wgrad(acc.view(-1, K)[:M], grad, sizes, G, accumulate_into=acc)

    acc = torch.randn(G, K, N)
    before = acc.clone()
    for run in (frontend_wgrad, torch.compile(frontend_wgrad, fullgraph=True, backend="eager"),
                lambda acc: torch.ops.groupgemm.grouped_mm_wgrad_accumulate(acc.view(-1, K)[:M], grad, sizes, acc)):
        with pytest.raises(ValueError, match="^accumulate_into shares memory with lhs; pass a separate buffer"):
            run(acc)
        assert torch.equal(acc, before)


def test_an_fp8_accumulator_and_a_main_grad_may_not_share_memory_with_an_operand():
    sizes = torch.from_numpy(SIZES)
    acc = torch.rand(G, K, N) + 0.5
    before = acc.clone()
    with pytest.raises(ValueError, match="^accumulate_into shares memory with lhs_scale"):
        gt.scaled_grouped_mm(torch.randn(K, M).to(torch.float8_e4m3fn), torch.randn(N, M).to(torch.float8_e4m3fn).t(),
                             acc.view(-1)[:G * K], ScalingType.RowWise, torch.rand(G * N) + 0.5, ScalingType.RowWise,
                             group_sizes=sizes, accumulate_into=acc)
    assert torch.equal(acc, before)
    layer = gt.GroupedLinear(G, K, N, bias=False, accumulate_into_main_grad=True)
    layer.weight.main_grad = torch.randn(G, N, K)
    before = layer.weight.main_grad.clone()
    out = layer(layer.weight.main_grad.view(-1, K)[:M], sizes)  # the input is main_grad's first rows
    with pytest.raises(ValueError, match="^drhs shares memory with lhs"):
        out.backward(torch.randn(M, N))
    assert torch.equal(layer.weight.main_grad, before)
