"""The expert layer's ops through groupgemm._core, against a float64 NumPy reference.

permute, unpermute (and its backward) and the activations (and their backward) on the
CPU, every dtype, torch tensors serving only as DLPack containers (NumPy has no bfloat16
export); bad input raising an exception that names the argument; a CUDA call without a
device failing clearly.
"""


import expert_reference as eref
import numpy as np
import pytest
import torch
from cases import round_to
from claims_cuda import ClaimsCuda
from reference import assert_close

import groupgemm._core as core

DTYPES = ["float32", "bfloat16", "float16", "float64"]
KINDS = ["swiglu", "gelu", "relu", "silu"]


def tensor(x, dtype_name):
    return torch.from_numpy(np.ascontiguousarray(x, np.float64)).to(getattr(torch, dtype_name))


def dirty(shape, dtype_name):
    """Output memory full of NaN: whatever the core does not write stays visible."""
    return torch.full(shape, float("nan"), dtype=getattr(torch, dtype_name))


def as_np(t):
    return t.to(torch.float64).numpy()


def bits(t):
    """The raw bits of a tensor, for bit-for-bit comparisons (and +0.0 vs -0.0)."""
    return t.reshape(-1).contiguous().view(torch.uint8).numpy()


# ---- float64 reference ------------------------------------------------------------------

def ref_permute(tokens, expert_indices, num_experts):
    """Rows grouped by expert (ascending), ascending slot within one; dropped slots last, zero."""
    t, k = expert_indices.shape
    flat = expert_indices.reshape(-1)
    kept = (flat >= 0) & (flat < num_experts)
    order = [s for e in range(num_experts) for s in range(t * k) if flat[s] == e]
    order += [s for s in range(t * k) if not kept[s]]
    permuted = np.zeros((t * k, tokens.shape[1]))
    row_map = np.full(t * k, -1, np.int32)
    for row, s in enumerate(order):
        if kept[s]:
            permuted[row] = tokens[s // k]
            row_map[s] = row
    group_sizes = np.array([np.count_nonzero(flat == e) for e in range(num_experts)], np.int32)
    return permuted, group_sizes, row_map.reshape(t, k)


def mapped(row_map, num_rows):
    return (row_map >= 0) & (row_map < num_rows)


def ref_unpermute(permuted, row_map, probs=None):
    t, k = row_map.shape
    out = np.zeros((t, permuted.shape[1]))
    ok = mapped(row_map, permuted.shape[0])
    for i in range(t):
        for j in range(k):
            if ok[i, j]:
                out[i] += (1.0 if probs is None else probs[i, j]) * permuted[row_map[i, j]]
    return out


def ref_unpermute_backward(dout, permuted, row_map, probs=None):
    """The forward's derivatives: a row gets every slot that names it."""
    t, k = row_map.shape
    dpermuted = np.zeros_like(permuted)
    dprobs = np.zeros((t, k))
    ok = mapped(row_map, permuted.shape[0])
    for i in range(t):
        for j in range(k):
            if ok[i, j]:
                dpermuted[row_map[i, j]] += (1.0 if probs is None else probs[i, j]) * dout[i]
                dprobs[i, j] = permuted[row_map[i, j]] @ dout[i]
    return dpermuted, dprobs


# ---- routings -----------------------------------------------------------------------------

BIG = np.iinfo(np.int64).max


def routing(name):
    """(tokens T, hidden H, experts E, expert_indices [T, k] int64)."""
    rng = np.random.default_rng(1)
    if name.startswith("random_k"):
        k = int(name[-1])
        return 13, 8, 5, rng.integers(-1, 6, size=(13, k))  # -1 and 5 are dropped
    return {
        "t_zero": (0, 8, 4, np.zeros((0, 2), np.int64)),
        "k_zero": (3, 8, 4, np.zeros((3, 0), np.int64)),
        "e_zero": (4, 8, 0, rng.integers(-1, 3, size=(4, 2))),
        "one_expert": (6, 8, 4, np.full((6, 2), 3)),
        "all_dropped": (5, 8, 4, np.array([[-1, 4], [7, -9], [100, -1], [4, 4], [-2, 5]])),
        "huge_indices": (3, 8, 5, np.array([[BIG, 1, -BIG - 1], [1 << 40, 4, -(1 << 33)], [0, BIG - 1, 2]])),
        "same_expert_twice": (4, 8, 3, np.array([[1, 1, 0], [2, 2, 2], [0, 1, 0], [1, 1, 1]])),
    }[name]


ROUTINGS = ["random_k1", "random_k2", "random_k3", "random_k4", "t_zero", "k_zero", "e_zero", "one_expert",
            "all_dropped", "huge_indices", "same_expert_twice"]


def index_tensor(indices, index_dtype):
    if index_dtype == "int32":
        indices = np.clip(indices, np.iinfo(np.int32).min, np.iinfo(np.int32).max)
    return torch.from_numpy(np.ascontiguousarray(indices.astype(index_dtype)))


def run_permute(tokens_t, indices_t, num_experts):
    t, k = indices_t.shape
    permuted = torch.full((t * k, tokens_t.shape[1]), float("nan"), dtype=tokens_t.dtype)
    group_sizes = torch.full((num_experts,), 12345, dtype=torch.int32)
    row_map = torch.full((t, k), 12345, dtype=torch.int32)
    core.permute(tokens_t, indices_t, permuted, group_sizes, row_map)
    return permuted, group_sizes, row_map


# ---- permute ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("name", ROUTINGS)
def test_permute_groups_rows_by_expert_stably_with_dropped_rows_exactly_zero(name, index_dtype, dtype):
    t, h, e, indices = routing(name)
    tokens = round_to(np.random.default_rng(2).standard_normal((t, h)), dtype)
    indices_t = index_tensor(indices, index_dtype)
    permuted, group_sizes, row_map = run_permute(tensor(tokens, dtype), indices_t, e)
    want_permuted, want_sizes, want_row_map = ref_permute(tokens, indices_t.numpy(), e)
    np.testing.assert_array_equal(group_sizes.numpy(), want_sizes)
    np.testing.assert_array_equal(row_map.numpy(), want_row_map)
    # Copies are bit for bit, and dropped rows are +0.0 in every byte.
    np.testing.assert_array_equal(bits(permuted), bits(tensor(want_permuted, dtype)))


def test_permute_then_unpermute_without_probs_sums_each_kept_choice():
    t, h, e, indices = routing("random_k3")
    tokens = np.random.default_rng(3).integers(-4, 5, size=(t, h)).astype(np.float64)  # exact sums
    permuted, _, row_map = run_permute(tensor(tokens, "bfloat16"), index_tensor(indices, "int64"), e)
    out = dirty((t, h), "bfloat16")
    core.unpermute(permuted, row_map, out=out)
    kept = ((indices >= 0) & (indices < e)).sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(as_np(out), kept * tokens)


# ---- unpermute and its backward ------------------------------------------------------------

def unpermute_inputs(name, dtype, probs_dtype):
    """permuted, row_map from permute plus foreign entries (R itself, a huge row, a row
    another slot names too), probs, dout."""
    t, h, e, indices = routing(name)
    rng = np.random.default_rng(4)
    _, _, row_map = ref_permute(np.zeros((t, h)), indices, e)
    rows = row_map.size
    flat = row_map.reshape(-1)
    dropped = np.flatnonzero(flat < 0)
    flat[dropped[0::3]] = rows  # one past the end: adds nothing
    flat[dropped[1::3]] = np.iinfo(np.int32).max
    flat[3::4] = flat[1::4][:len(flat[3::4])]  # every fourth slot names the row of the slot two before
    permuted = round_to(rng.standard_normal((rows, h)), dtype)
    dout = round_to(rng.standard_normal((t, h)), dtype)
    probs = None if probs_dtype is None else round_to(rng.uniform(size=row_map.shape), probs_dtype)
    return permuted, row_map, probs, dout


PROBS = [None, "same", "float32"]


def probs_name(dtype, probs):
    return None if probs is None else (dtype if probs == "same" else probs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("probs", PROBS, ids=["no_probs", "probs_same_dtype", "probs_float32"])
@pytest.mark.parametrize("name", ROUTINGS)
def test_unpermute_sums_weighted_rows_and_skips_dropped_slots(name, probs, dtype):
    pdt = probs_name(dtype, probs)
    permuted, row_map, p, _ = unpermute_inputs(name, dtype, pdt)
    out = dirty((row_map.shape[0], permuted.shape[1]), dtype)
    core.unpermute(tensor(permuted, dtype), torch.from_numpy(row_map), probs=None if p is None else tensor(p, pdt),
                   out=out)
    assert_close(as_np(out), ref_unpermute(permuted, row_map, p), dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("probs", PROBS, ids=["no_probs", "probs_same_dtype", "probs_float32"])
@pytest.mark.parametrize("name", ROUTINGS)
def test_unpermute_backward_sums_each_rows_slots_with_unreferenced_rows_exactly_zero(name, probs, dtype):
    pdt = probs_name(dtype, probs)
    permuted, row_map, p, dout = unpermute_inputs(name, dtype, pdt)
    dpermuted = dirty(permuted.shape, dtype)
    dprobs = None if p is None else dirty(row_map.shape, pdt)
    core.unpermute_backward(tensor(dout, dtype), tensor(permuted, dtype), torch.from_numpy(row_map),
                            probs=None if p is None else tensor(p, pdt), dpermuted=dpermuted, dprobs=dprobs)
    want_dpermuted, want_dprobs = ref_unpermute_backward(dout, permuted, row_map, p)
    assert_close(as_np(dpermuted), want_dpermuted, dtype, name)
    referenced = np.zeros(permuted.shape[0], bool)
    referenced[row_map[mapped(row_map, permuted.shape[0])]] = True
    assert not bits(dpermuted[torch.from_numpy(~referenced)]).any()
    if p is not None:
        assert_close(as_np(dprobs), want_dprobs, pdt, name)
        dropped = torch.from_numpy(~mapped(row_map, permuted.shape[0]))
        assert not bits(dprobs[dropped]).any()


def test_unpermute_backward_computes_each_output_alone_with_the_same_bits():
    permuted, row_map, p, dout = unpermute_inputs("random_k3", "bfloat16", "float32")
    args = (tensor(dout, "bfloat16"), tensor(permuted, "bfloat16"), torch.from_numpy(row_map))
    both = dirty(permuted.shape, "bfloat16"), dirty(row_map.shape, "float32")
    core.unpermute_backward(*args, tensor(p, "float32"), both[0], both[1])
    rows_only = dirty(permuted.shape, "bfloat16")
    core.unpermute_backward(*args, tensor(p, "float32"), rows_only)
    dots_only = dirty(row_map.shape, "float32")  # dprobs reads permuted and dout, not probs
    core.unpermute_backward(*args, dprobs=dots_only)
    assert np.array_equal(bits(rows_only), bits(both[0])) and np.array_equal(bits(dots_only), bits(both[1]))
    assert np.isfinite(as_np(both[0])).all() and np.isfinite(as_np(both[1])).all()


def test_a_row_named_twice_gets_both_slots_gradients_in_slot_order():
    dout = tensor([[1.0, 3.0], [0.5, 0.25]], "float16")
    row_map = torch.tensor([[0, 0], [0, 5]], dtype=torch.int32)  # row 0 three times, 5 is past R = 3
    probs = tensor([[0.3, 0.7], [2.0, 1.0]], "float32")
    dpermuted = dirty((3, 2), "float16")
    core.unpermute_backward(dout, torch.zeros(3, 2, dtype=torch.float16), row_map, probs=probs, dpermuted=dpermuted)
    want = 0.3 * np.array([1.0, 3.0]) + 0.7 * np.array([1.0, 3.0]) + 2.0 * np.array([0.5, 0.25])
    np.testing.assert_allclose(as_np(dpermuted)[0], want, rtol=2e-3)
    assert not bits(dpermuted[1:]).any()


# ---- activation ---------------------------------------------------------------------------

def activation_input(kind, dtype, rows=6, features=10):
    h = np.random.default_rng(5).standard_normal((rows, 2 * features if kind == "swiglu" else features)) * 2
    h[2] = 0.0  # a padding row
    return round_to(h, dtype)


# 600 features: the CPU takes a row's sigmoids in chunks of 256 columns (cpu/sigmoid_rows.h),
# so a row spans two whole chunks and a partial one.
@pytest.mark.parametrize("features", [10, 600])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_activation_matches_reference_and_keeps_zero_rows_zero(kind, dtype, features):
    h = activation_input(kind, dtype, features=features)
    want = eref.activation(h, kind)
    out = dirty(want.shape, dtype)
    core.activation(tensor(h, dtype), out, getattr(core.Activation, kind))
    assert_close(as_np(out), want, dtype, kind)
    assert not bits(out[2]).any()


@pytest.mark.parametrize("features", [10, 600])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_activation_backward_is_the_exact_derivative(kind, dtype, features):
    h = activation_input(kind, dtype, features=features)
    dout = round_to(np.random.default_rng(6).standard_normal(eref.activation(h, kind).shape), dtype)
    dh = dirty(h.shape, dtype)
    core.activation_backward(tensor(dout, dtype), tensor(h, dtype), dh, getattr(core.Activation, kind))
    assert_close(as_np(dh), eref.activation_grad(dout, h, kind), dtype, kind)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gelu_keeps_its_relative_accuracy_in_the_negative_tail(dtype):
    # 0.5 x (1 + erf(x / sqrt 2)) cancels below about -5 (0 at -6 in float32, where gelu is
    # -5.9e-9); the value and its derivative hold their relative accuracy down to where they
    # leave the normal range (gelu(-12) is -2.1e-32 in float32).
    h = round_to(np.array([[-4.0, -5.0, -5.5, -6.0, -8.0, -10.0, -11.0, -12.0]]), dtype)
    if dtype == "float64":
        h = np.concatenate([h, [[-16.0, -20.0, -24.0, -30.0, -35.0, -37.0, -4.5, -7.0]]])
    out, dh = dirty(h.shape, dtype), dirty(h.shape, dtype)
    core.activation(tensor(h, dtype), out, core.Activation.gelu)
    core.activation_backward(tensor(np.ones_like(h), dtype), tensor(h, dtype), dh, core.Activation.gelu)
    rtol = {"float32": 1e-5, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(as_np(out), eref.activation(h, "gelu"), rtol=rtol, atol=0)
    np.testing.assert_allclose(as_np(dh), eref.activation_grad(np.ones_like(h), h, "gelu"), rtol=rtol, atol=0)


def test_activation_kind_may_be_given_as_its_int_value():
    h = tensor(activation_input("gelu", "float32"), "float32")
    by_enum, by_int = torch.empty_like(h), torch.empty_like(h)
    core.activation(h, by_enum, core.Activation.gelu)
    core.activation(h, by_int, 1)
    assert torch.equal(by_enum, by_int)
    assert [int(getattr(core.Activation, k)) for k in KINDS] == [0, 1, 2, 3]
    assert [getattr(core.Activation, k).value for k in KINDS] == [0, 1, 2, 3]


def test_empty_inputs_are_ordinary():
    for kind in KINDS:
        h = torch.empty((0, 8))
        out = torch.empty((0, 4 if kind == "swiglu" else 8))
        core.activation(h, out, getattr(core.Activation, kind))
        core.activation_backward(out, h, torch.empty_like(h), getattr(core.Activation, kind))
    core.unpermute(torch.empty((0, 4)), torch.empty((0, 2), dtype=torch.int32), probs=torch.empty((0, 2)),
                   out=torch.empty((0, 4)))


# ---- bad input -----------------------------------------------------------------------------

def good_permute_args():
    return dict(tokens=torch.zeros(4, 8), expert_indices=torch.zeros(4, 2, dtype=torch.int32),
                permuted=torch.zeros(8, 8), group_sizes=torch.zeros(3, dtype=torch.int32),
                row_map=torch.zeros(4, 2, dtype=torch.int32))


def good_unpermute_backward_args():
    return dict(dout=torch.zeros(4, 8), permuted=torch.zeros(8, 8), row_map=torch.zeros(4, 2, dtype=torch.int32),
                dpermuted=torch.zeros(8, 8), probs=torch.zeros(4, 2), dprobs=torch.zeros(4, 2))


BAD = {
    "permute_expert_indices_float": (core.permute, good_permute_args, {"expert_indices": torch.zeros(4, 2)},
                                     TypeError, "expert_indices must be int32 or int64"),
    "permute_expert_indices_rows": (core.permute, good_permute_args,
                                    {"expert_indices": torch.zeros(5, 2, dtype=torch.int32)},
                                    ValueError, "expert_indices dimension 0"),
    "permute_permuted_rows": (core.permute, good_permute_args, {"permuted": torch.zeros(7, 8)},
                              ValueError, "permuted dimension 0"),
    "permute_permuted_dtype": (core.permute, good_permute_args, {"permuted": torch.zeros(8, 8, dtype=torch.float16)},
                               TypeError, "permuted must have the dtype of tokens"),
    "permute_group_sizes_int64": (core.permute, good_permute_args,
                                  {"group_sizes": torch.zeros(3, dtype=torch.int64)},
                                  TypeError, "group_sizes must be int32"),
    "permute_row_map_shape": (core.permute, good_permute_args, {"row_map": torch.zeros(4, 3, dtype=torch.int32)},
                              ValueError, "row_map dimension 1"),
    "permute_tokens_rank": (core.permute, good_permute_args, {"tokens": torch.zeros(4, 8, 1)},
                            ValueError, "tokens must have rank 2"),
    "permute_tokens_int": (core.permute, good_permute_args, {"tokens": torch.zeros(4, 8, dtype=torch.int32)},
                           TypeError, "tokens must be float32"),
    "unpermute_backward_dprobs_float64": (core.unpermute_backward, good_unpermute_backward_args,
                                          {"probs": None, "dprobs": torch.zeros(4, 2, dtype=torch.float64)},
                                          TypeError, "dprobs must be float32, got float64"),
    "unpermute_backward_probs_float16": (core.unpermute_backward, good_unpermute_backward_args,
                                         {"probs": torch.zeros(4, 2, dtype=torch.float16)},
                                         TypeError, "probs must be float32, got float16"),
    "unpermute_backward_dprobs_dtype": (core.unpermute_backward, good_unpermute_backward_args,
                                        {"dprobs": torch.zeros(4, 2, dtype=torch.float64)},
                                        TypeError, "dprobs must have the dtype of probs"),
    "unpermute_backward_dout_rows": (core.unpermute_backward, good_unpermute_backward_args,
                                     {"dout": torch.zeros(3, 8)}, ValueError, "dout dimension 0"),
    "unpermute_backward_row_map_int64": (core.unpermute_backward, good_unpermute_backward_args,
                                         {"row_map": torch.zeros(4, 2, dtype=torch.int64)},
                                         TypeError, "row_map must be int32"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    fn, base, change, error, match = BAD[case]
    with pytest.raises(error, match=match):
        fn(**{**base(), **change})


def test_bad_unpermute_and_activation_inputs_name_the_argument():
    row_map = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="probs must be bfloat16 or float32, got float16"):
        core.unpermute(torch.zeros(8, 8, dtype=torch.bfloat16), row_map, probs=torch.zeros(4, 2, dtype=torch.float16),
                       out=torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="probs dimension 1"):
        core.unpermute(torch.zeros(8, 8), row_map, probs=torch.zeros(4, 3), out=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="out dimension 0"):
        core.unpermute(torch.zeros(8, 8), row_map, out=torch.zeros(5, 8))
    with pytest.raises(ValueError, match="swiglu needs an even count"):
        core.activation(torch.zeros(4, 5), torch.zeros(4, 2), core.Activation.swiglu)
    with pytest.raises(ValueError, match="out dimension 1"):
        core.activation(torch.zeros(4, 6), torch.zeros(4, 6), core.Activation.swiglu)
    with pytest.raises(TypeError, match="dh must have the dtype of h"):
        core.activation_backward(torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(4, 6, dtype=torch.float64),
                                 core.Activation.relu)
    with pytest.raises(ValueError, match=r"kind must be 0 \(swiglu\), 1 \(gelu\), 2 \(relu\) or 3 \(silu\), got 7"):
        core.activation(torch.zeros(4, 6), torch.zeros(4, 6), 7)
    with pytest.raises(TypeError):  # a copy would be lost: no conversion from a strided view
        core.activation(torch.zeros(6, 4).T, torch.zeros(4, 6), core.Activation.relu)


def test_permute_workspace_bytes_is_zero_on_cpu_and_aligned_on_cuda():
    for slots, experts in [(0, 0), (1, 1), (100, 8), (1 << 20, 256)]:
        assert core.permute_workspace_bytes(core.Device.cpu, slots, experts) == 0
        cuda = core.permute_workspace_bytes(core.Device.cuda, slots, experts)
        assert cuda > 0 and cuda % 16 == 0
        assert cuda >= 4 * (experts + 1)  # at least one count per bucket


def test_unpermute_backward_workspace_bytes_is_zero_on_cpu_and_aligned_on_cuda():
    for slots in [0, 1, 100, 1 << 20]:
        assert core.unpermute_backward_workspace_bytes(core.Device.cpu, slots) == 0
        cuda = core.unpermute_backward_workspace_bytes(core.Device.cuda, slots)
        assert cuda % 16 == 0 and cuda >= 2 * 4 * slots + 4 * 256  # two slot orders, the digit counts


def test_ffi_handlers_registered_for_both_platforms():
    names = {"groupgemm_permute", "groupgemm_unpermute", "groupgemm_unpermute_backward", "groupgemm_activation",
             "groupgemm_activation_backward", "groupgemm_softmax_topk", "groupgemm_softmax_topk_backward",
             "groupgemm_softmax_topk_tangent"}
    handlers = core.ffi_handlers()
    for platform in ("cpu", "CUDA"):
        assert names <= set(handlers[platform])


# ---- a CUDA call without a usable device -------------------------------------------------



def test_cuda_calls_without_a_device_raise_clearly():
    if torch.cuda.is_available():
        pytest.skip("a real device would be handed host pointers")
    expected = "no usable CUDA device" if core.cuda_compiled() else "built without CUDA"
    f32 = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    workspace = np.zeros(core.permute_workspace_bytes(core.Device.cuda, 8, 3), np.uint8)
    sort_workspace = np.zeros(core.unpermute_backward_workspace_bytes(core.Device.cuda, 8), np.uint8)
    calls = [
        lambda: core.permute(*map(ClaimsCuda, (f32(4, 8), i32(4, 2), f32(8, 8), i32(3), i32(4, 2))),
                             workspace=ClaimsCuda(workspace)),
        lambda: core.unpermute(*map(ClaimsCuda, (f32(8, 8), i32(4, 2), f32(4, 2), f32(4, 8)))),
        lambda: core.unpermute_backward(*map(ClaimsCuda, (f32(4, 8), f32(8, 8), i32(4, 2))),
                                        dpermuted=ClaimsCuda(f32(8, 8)), workspace=ClaimsCuda(sort_workspace)),
        lambda: core.softmax_topk_tangent(*map(ClaimsCuda, (f32(4, 3), i32(4, 2), f32(4, 3), f32(4, 2))), True),
        lambda: core.activation(ClaimsCuda(f32(4, 8)), ClaimsCuda(f32(4, 4)), core.Activation.swiglu),
        lambda: core.activation_backward(*map(ClaimsCuda, (f32(4, 8), f32(4, 8), f32(4, 8))), core.Activation.gelu),
    ]
    for call in calls:
        with pytest.raises((RuntimeError, ValueError), match=expected):
            call()
    if core.cuda_compiled():
        with pytest.raises(ValueError, match="workspace has 0 bytes, permute needs"):
            core.permute(*map(ClaimsCuda, (f32(4, 8), i32(4, 2), f32(8, 8), i32(3), i32(4, 2))))
        with pytest.raises(ValueError, match="workspace has 0 bytes, unpermute_backward needs"):
            core.unpermute_backward(*map(ClaimsCuda, (f32(4, 8), f32(8, 8), i32(4, 2))),
                                    dpermuted=ClaimsCuda(f32(8, 8)))
    with pytest.raises(ValueError, match="float64 is supported on CPU only"):
        core.activation(ClaimsCuda(np.zeros((4, 8))), ClaimsCuda(np.zeros((4, 8))), core.Activation.relu)
