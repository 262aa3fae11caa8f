"""The CUDA backend on a GPU, through both frontends: the grouped GEMMs, the expert layer
(permute, unpermute, GroupedMLP, the fused expert_mlp) and the FP8 path (quantization, the
sm_90a FP8 GEMMs, the training recipe), against the CPU backend and across frameworks.

These run wherever a GPU and a CUDA build are present and skip elsewhere. Machines
without a GPU still check the CUDA path's host-visible logic: core_tests emulates the
setup kernel's workspace on every case (fp8_tests the FP8 call sequences, expert_mlp_tests
the fused expert MLP's), and
test_cuda_build.py checks the fatbinary, the absence of host synchronisation and the
no-device error (test_cuda_sass.py the kernels' instructions).
"""

import os
import subprocess
import sys

import expert_reference as eref
import fp8_reference as fref
import jax
import jax.numpy as jnp
import jax_frontend
import numpy as np
import pytest
import test_expert_mlp as mlp_cases
import torch
import torch_frontend
from bits import assert_same_bits
from capture_check import capture
from cases import CASE_IDS, CASES, CUDA_DTYPES, TOLERANCE, VARIANT_IDS, VARIANTS, Case, inputs, round_to
from driver_calls import DEFAULT_KERNEL, MLP_FAMILIES, TEST_KERNELS
from fp8_reference import LAYER_CASES, RECIPES, layer_inputs
from kernel_table import SM80
from kernel_table import read as read_kernel_table
from reference import assert_close, empty_groups, padding_rows
from test_expert_layer import IDS as ROUTING_IDS
from test_expert_layer import (
    MLP_CASES,
    ROUTER_LOGITS,
    ROUTINGS,
    check_softmax_topk,
    expert_layer_in_both_frameworks,
    mlp_inputs,
    moe_block_in_both_frameworks,
    routing_inputs,
)

import groupgemm
import groupgemm.jax as gj
import groupgemm.torch as gt
from groupgemm.jax_ext import expert_mlp as jax_expert_mlp
from groupgemm.torch_ext import expert_mlp as torch_expert_mlp


def _jax_gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


TORCH_CUDA = groupgemm.cuda_compiled() and torch.cuda.is_available()
JAX_GPU = groupgemm.cuda_compiled() and _jax_gpu() is not None
needs_torch_cuda = pytest.mark.skipif(not TORCH_CUDA, reason="needs a CUDA GPU and a CUDA build")
needs_jax_gpu = pytest.mark.skipif(not JAX_GPU, reason="needs a CUDA GPU, jax[cuda] and a CUDA build")
needs_both = pytest.mark.skipif(not (TORCH_CUDA and JAX_GPU), reason="needs a CUDA GPU in both frameworks")

# Beyond the shared table: several tiles per group on every tensor-core kernel (groups of
# 1 to 400 rows, N = 136 just past a tile edge, odd tile counts for the sm90 2 x 1
# clusters), and K, N that are not multiples of 8 (the unaligned kernel).
GPU_CASES = CASES + [
    Case("tiles", 1000, 256, 136, (300, 0, 129, 1, 0, 400, 170, 0)),
    Case("unaligned", 200, 36, 20, (50, 0, 100, 50)),
]
GPU_IDS = [c.name for c in GPU_CASES]
each_variant = pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)


def _hopper():
    return TORCH_CUDA and torch.cuda.get_device_capability() == (9, 0)


# The skips that depend on the GPU's compute capability, each one the GPU kit expects
# (benchmarks/gpu/steps.py's EXPECTED_SKIPS): Hopper's kernels elsewhere, and on Hopper
# the refusal other GPUs give.
HOPPER_ONLY = "the sm_90a kernels need a compute capability 9.0 GPU"
NOT_ON_HOPPER = "the refusal of a GPU without FP8 tensor cores cannot run on Hopper"


def _run_under(kernel, monkeypatch):
    """GROUPGEMM_CUDA_KERNEL=kernel for the test (DEFAULT_KERNEL: unset); a kernel only
    Hopper runs skips the test elsewhere."""
    if kernel == DEFAULT_KERNEL:
        monkeypatch.delenv("GROUPGEMM_CUDA_KERNEL", raising=False)
        return kernel
    if kernel != SM80 and not _hopper():
        pytest.skip(HOPPER_ONLY)
    monkeypatch.setenv("GROUPGEMM_CUDA_KERNEL", kernel)
    return kernel


@pytest.fixture(params=TEST_KERNELS)
def gemm_kernel(request, monkeypatch):
    """Each GEMM test runs on every kernel choice: the default (GROUPGEMM_CUDA_KERNEL unset:
    the Hopper kernel table's choice per call there, the CUTLASS 2.x kernels elsewhere), the
    2.x kernels (every GPU), and the sm_90a CUTLASS 3.x kernels (Hopper only) by the table's
    shape rule ("sm90") and held to each tile. The ids are what the GPU kit reads back."""
    return _run_under(request.param, monkeypatch)


# One shape in each class of the kernel table (its bound, or past the last bound): rows
# per group = the smaller side, columns wider.
TABLE = read_kernel_table()
TABLE_CLASSES = [(c, c.smaller_side_at_most or 2 * max(x.smaller_side_at_most for x in TABLE.choices) or 256)
                 for c in TABLE.choices]


@pytest.mark.parametrize("choice, rows", TABLE_CLASSES, ids=[f"up_to_{c.smaller_side_at_most or 'any'}"
                                                              for c, _ in TABLE_CLASSES])
def test_each_class_runs_the_kernels_the_table_names(monkeypatch, choice, rows):
    # kernel_choice.h: a call's class is the smaller of its rows per group (M / G) and its
    # columns; "sm90" runs the class's sm90 tile, the default its default kernel. The same
    # kernel on the same inputs gives the same bits.
    if not _hopper():
        pytest.skip(HOPPER_ONLY)
    g, k, n = 4, 256, 2 * rows + 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(g * rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(g, k, n, device="cuda", generator=gen).to(torch.bfloat16)
    sizes = torch.full((g,), rows, dtype=torch.int32, device="cuda")
    out = {}
    for kernel in ("sm90", choice.sm90, DEFAULT_KERNEL, choice.default):
        if kernel == DEFAULT_KERNEL:
            monkeypatch.delenv("GROUPGEMM_CUDA_KERNEL", raising=False)
        else:
            monkeypatch.setenv("GROUPGEMM_CUDA_KERNEL", kernel)
        out[kernel] = gt.grouped_mm(x, w, sizes)
    assert_same_bits(out["sm90"], out[choice.sm90], f"sm90 by shape vs {choice.sm90}")
    assert_same_bits(out[DEFAULT_KERNEL], out[choice.default], f"the default vs {choice.default}")
    xs, ws = x.double().cpu().numpy(), w.double().cpu().numpy()
    want = np.concatenate([xs[i * rows:(i + 1) * rows] @ ws[i] for i in range(g)])
    for kernel in ("sm90", DEFAULT_KERNEL):
        assert_close(out[kernel].double().cpu().numpy(), want, "bfloat16", f"{kernel} at {rows} rows per group")


ON_CUDA = {"jax": (jax_frontend, JAX_GPU), "torch": (torch_frontend, TORCH_CUDA)}


@each_variant
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_matches_cpu_backend_and_keeps_exact_zeros(name, case, dtype, variant, gemm_kernel):
    frontend, available = ON_CUDA[name]
    if not available:
        pytest.skip(f"needs a CUDA GPU, {name} with CUDA and a CUDA build")
    gpu, cpu = ([None if v is None else frontend.to_float64(v)
                 for v in frontend.forward_backward(case, dtype, *variant, device)] for device in ("cuda", "cpu"))
    with_bias = variant[0]
    assert (gpu[3] is None) == (cpu[3] is None) == (not with_bias)
    for what, a, b in zip(("out", "dlhs", "drhs", "dbias")[:3 + with_bias], gpu, cpu):
        assert_close(a, b, dtype, f"{case.name}/{dtype}/{what}")
    sizes = inputs(case)["group_sizes"]
    pad = padding_rows(sizes, case.m, case.g, case.offset)
    assert (gpu[0][pad] == 0).all() and (gpu[1][pad] == 0).all()
    for g in empty_groups(sizes, case.m, case.g, case.offset):
        assert (gpu[2][g] == 0).all() and (not with_bias or (gpu[3][g] == 0).all())


@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_torch_cuda_wgrad_accumulates_and_leaves_empty_groups_bitwise(case, gemm_kernel):
    x = inputs(case)
    lhs, dout = (torch.tensor(x[k], dtype=torch.bfloat16, device="cuda") for k in ("lhs", "dout"))
    sizes = torch.tensor(x["group_sizes"], device="cuda")
    offset = None if case.group_offset is None else torch.tensor(case.group_offset, device="cuda")
    acc = torch.tensor(x["acc"], dtype=torch.float32, device="cuda")
    before = acc.clone()
    gt.grouped_mm_wgrad(lhs, dout, sizes, case.g, group_offset=offset, accumulate_into=acc)
    want = gt.grouped_mm_wgrad(lhs.cpu(), dout.cpu(), sizes.cpu(), case.g,
                               group_offset=None if offset is None else offset.cpu(),
                               accumulate_into=before.cpu().clone())
    assert_close(acc.cpu().double().numpy(), want.double().numpy(), "bfloat16")
    for g in empty_groups(x["group_sizes"], case.m, case.g, case.offset):
        assert torch.equal(acc[g].view(torch.int32), before[g].view(torch.int32))


@needs_both
@each_variant
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_cuda_jax_and_torch_are_bitwise_identical(case, dtype, variant, gemm_kernel):
    jax_results = jax_frontend.forward_backward(case, dtype, *variant, "cuda")
    torch_results = torch_frontend.forward_backward(case, dtype, *variant, "cuda")
    for name, a, b in zip(("out", "dlhs", "drhs", "dbias"), jax_results, torch_results):
        if a is None and b is None:  # no bias, no gradient for it
            continue
        assert_same_bits(a, b, f"cuda/{case.name}/{dtype}/{name}")


@needs_jax_gpu
def test_jax_jit_with_traced_group_sizes_compiles_once():
    rng = np.random.default_rng(0)
    with jax.default_device(_jax_gpu()):
        lhs = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.bfloat16)
        step = jax.jit(lambda l, r, s: jax.grad(lambda l, r: gj.grouped_matmul(l, r, s).astype(jnp.float32).sum(),
                                                argnums=(0, 1))(l, r))
        for sizes in ([16, 16, 16, 16], [0, 64, 0, 0], [0, 0, 0, 0], [10, 0, 5, 1]):
            s = jnp.asarray(sizes, jnp.int32)
            got = step(lhs, rhs, s)
            with jax.default_device(jax.devices("cpu")[0]):
                want = jax.grad(lambda l, r: gj.grouped_matmul(l, r, jnp.asarray(sizes, jnp.int32))
                                .astype(jnp.float32).sum(), argnums=(0, 1))(
                    jax.device_put(lhs, jax.devices("cpu")[0]), jax.device_put(rhs, jax.devices("cpu")[0]))
            for a, b in zip(got, want):
                assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), "bfloat16", str(sizes))
        assert step._cache_size() == 1


@needs_torch_cuda
def test_torch_cuda_graph_replays_with_changing_group_sizes(gemm_kernel):
    torch.manual_seed(0)
    layer = gt.GroupedLinear(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(96, 32, device="cuda", dtype=torch.bfloat16)
    sizes = torch.tensor([24, 24, 24, 24], device="cuda", dtype=torch.int32)
    params = (x, layer.weight, layer.bias)

    def step():
        y = layer(x, sizes)
        return (y, *torch.autograd.grad(y, params, dy))

    graph, static = capture(torch, step, warm_up=True)

    for new_sizes in ([96, 0, 0, 0], [0, 0, 0, 0], [10, 0, 50, 7], [30, 30, 30, 6]):
        sizes.copy_(torch.tensor(new_sizes, dtype=torch.int32))
        graph.replay()
        for replayed, eager in zip(static, step()):
            assert torch.equal(replayed, eager), new_sizes  # same kernels, same bits
        pad = torch.from_numpy(padding_rows(new_sizes, 96, 4)).cuda()
        assert (static[0][pad] == 0).all() and (static[1][pad] == 0).all()  # out and dx
        for g in empty_groups(new_sizes, 96, 4):
            assert (static[2][g] == 0).all() and (static[3][g] == 0).all()


@needs_jax_gpu
@pytest.mark.parametrize("command_buffers", ["custom-calls", "default"])
def test_jax_cuda_first_call_inside_a_command_buffer(command_buffers, gemm_kernel):
    # A fresh process whose first groupgemm call is recorded by XLA into a CUDA graph
    # (capturing streams refuse some runtime queries); XLA_FLAGS must be set before JAX
    # starts. The process inherits GROUPGEMM_CUDA_KERNEL: every kernel family is captured.
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "jax_capture_check.py")
    run = subprocess.run([sys.executable, script, "--command-buffers", command_buffers], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]


@needs_torch_cuda
def test_torch_cuda_training_step_never_synchronises_with_the_host():
    # set_sync_debug_mode sees synchronisations made by torch (.item(), .tolist(), a
    # device-to-host copy): it covers the frontend. The core's own calls are covered by
    # the CUDA-graph test above (capture fails on a sync) and the source lint.
    layer = gt.GroupedLinear(8, 64, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sizes = torch.tensor([32, 0, 16, 0, 0, 64, 16, 0], device="cuda", dtype=torch.int32)
    main_grad = torch.zeros(8, 64, 64, device="cuda", dtype=torch.float32)
    layer(x, sizes).float().sum().backward()  # first call: lazy CUDA initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, sizes).float().sum().backward()
        gt.grouped_mm_wgrad(x.detach(), x.detach(), sizes, 8, accumulate_into=main_grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert (main_grad[[1, 3, 4, 7]] == 0).all() and (main_grad[0] != 0).any()


# ---- the expert layer ----------------------------------------------------------------


def _frontend_on_cuda(name):
    frontend, available = ON_CUDA[name]
    if not available:
        pytest.skip(f"needs a CUDA GPU, {name} with CUDA and a CUDA build")
    return frontend


def _unreferenced_rows(row_map, num_rows):
    referenced = np.zeros(num_rows, bool)
    referenced[row_map[row_map >= 0]] = True
    return ~referenced


@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_permute_matches_cpu_backend_and_zeroes_dropped_rows(name, routing, dtype):
    frontend = _frontend_on_cuda(name)
    indices, tokens, dpermuted, _ = routing_inputs(routing)
    tokens, dpermuted = round_to(tokens, dtype), round_to(dpermuted, dtype)
    gpu, cpu = (frontend.permute_and_grad(tokens, indices, routing.num_experts, dpermuted, dtype, device=device)
                for device in ("cuda", "cpu"))
    for what, a, b in zip(("permuted", "group_sizes", "row_map"), gpu, cpu):
        assert_same_bits(a, b, f"{routing.name}/{dtype}/{what}")  # copies and a stable sort: exact
    permuted, sizes = frontend.to_float64(gpu[0]), frontend.to_float64(gpu[1])
    assert (permuted[int(sizes.sum()):] == 0).all()  # dropped slots' rows: exact zeros
    assert_close(frontend.to_float64(gpu[3]), frontend.to_float64(cpu[3]), dtype, f"{routing.name}/{dtype}/dtokens")


@pytest.mark.parametrize("probs_dtype", ["same", "float32", None])
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_unpermute_matches_cpu_backend_with_every_gradient(name, routing, dtype, probs_dtype):
    frontend = _frontend_on_cuda(name)
    indices, _, permuted, probs = routing_inputs(routing, seed=1)
    _, _, row_map = eref.permute(np.zeros((len(indices), 1)), indices, routing.num_experts)
    dout = round_to(np.random.default_rng(2).standard_normal((len(indices), permuted.shape[1])), dtype)
    permuted = round_to(permuted, dtype)
    probs_name = dtype if probs_dtype == "same" else probs_dtype
    probs = None if probs_name is None else round_to(probs, probs_name)
    gpu, cpu = (frontend.unpermute_and_grads(permuted, row_map, probs, dout, dtype, probs_name, device=device)
                for device in ("cuda", "cpu"))
    for what, a, b in zip(("out", "dpermuted", "dprobs"), gpu, cpu):
        if b is None:
            assert a is None
            continue
        assert frontend.dtype_of(a) == frontend.dtype_of(b)
        assert_close(frontend.to_float64(a), frontend.to_float64(b), dtype if what != "dprobs" else max(
            (dtype, probs_name), key=lambda d: TOLERANCE[d]), f"{routing.name}/{dtype}/{what}")
    assert (frontend.to_float64(gpu[1])[_unreferenced_rows(row_map, len(permuted))] == 0).all()
    if probs is not None:
        assert (frontend.to_float64(gpu[2])[row_map < 0] == 0).all()  # dropped slots: exact zeros


MLP_VARIANTS = [("swiglu", False), ("swiglu", True), ("gelu", False), ("relu", True), ("silu", False)]


@pytest.mark.parametrize("activation, with_bias", MLP_VARIANTS, ids=[f"{a}-{'bias' if b else 'nobias'}"
                                                                     for a, b in MLP_VARIANTS])
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("case, sizes, m", MLP_CASES, ids=[c[0] for c in MLP_CASES])
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_grouped_mlp_matches_cpu_backend_and_keeps_exact_zeros(gemm_kernel, name, case, sizes, m, dtype,
                                                                   activation, with_bias):
    frontend = _frontend_on_cuda(name)
    e = len(sizes)
    x, w_in, w_out, dout, b_in, b_out = mlp_inputs(sizes, m, dtype, activation, with_bias)
    gpu, cpu = (frontend.grouped_mlp_and_grads(x, w_in, w_out, sizes, activation, b_in, b_out, dout, dtype,
                                               device=device) for device in ("cuda", "cpu"))
    pad = padding_rows(sizes, m, e)
    y = frontend.to_float64(gpu[0])
    assert_close(y, frontend.to_float64(cpu[0]), dtype, f"{case}/{dtype}/y")
    assert (y[pad] == 0).all()
    for what, a, b in zip(("dx", "dw_in", "dw_out", "db_in", "db_out"), gpu[1], cpu[1]):
        if b is None:
            assert a is None, what
            continue
        a = frontend.to_float64(a)
        assert_close(a, frontend.to_float64(b), dtype, f"{case}/{dtype}/{what}")
        if what == "dx":
            assert (a[pad] == 0).all()
        else:
            for g in empty_groups(sizes, m, e):
                assert (a[g] == 0).all(), (what, g)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "full_softmax"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("logits_name", ROUTER_LOGITS)
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_softmax_topk_matches_reference_and_cpu_choices(name, logits_name, dtype, renormalize):
    frontend = _frontend_on_cuda(name)
    logits, k = round_to(ROUTER_LOGITS[logits_name], dtype), 3
    dprobs = np.random.default_rng(6).standard_normal((len(logits), k))
    gpu, cpu = (frontend.softmax_topk_and_grad(logits, k, renormalize, dprobs, dtype, device=device)
                for device in ("cuda", "cpu"))
    assert_same_bits(gpu[1], cpu[1], f"{logits_name}/{dtype}/expert_indices")
    check_softmax_topk(frontend, logits, k, renormalize, dprobs, dtype, gpu)


@needs_both
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS, ids=ROUTING_IDS)
def test_cuda_permute_and_unpermute_are_bitwise_identical_in_jax_and_torch(routing, dtype):
    indices, tokens, dpermuted, probs = routing_inputs(routing)
    tokens, dpermuted, probs = (round_to(a, dtype) for a in (tokens, dpermuted, probs))
    results = []
    for fe in (jax_frontend, torch_frontend):
        permuted, sizes, row_map, dtokens = fe.permute_and_grad(tokens, indices, routing.num_experts, dpermuted,
                                                                dtype, device="cuda")
        row_map_np = fe.to_float64(row_map).astype(np.int32)
        dout = round_to(np.random.default_rng(5).standard_normal(tokens.shape), dtype)
        unpermuted = fe.unpermute_and_grads(dpermuted, row_map_np, probs, dout, dtype, dtype, device="cuda")
        results.append([permuted, sizes, row_map, dtokens, *unpermuted])
    for what, a, b in zip(("permuted", "group_sizes", "row_map", "dtokens", "out", "dpermuted", "dprobs"), *results):
        assert_same_bits(a, b, f"cuda/{routing.name}/{dtype}/{what}")


@needs_both
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_cuda_expert_layer_is_bitwise_identical_in_jax_and_torch(dtype):
    for i, (a, b) in enumerate(zip(*expert_layer_in_both_frameworks(dtype, device="cuda"))):
        assert_same_bits(a, b, f"cuda/{dtype}/result {i}")


@needs_both
def test_cuda_moe_block_is_bitwise_identical_in_jax_and_torch():
    for i, (a, b) in enumerate(zip(*moe_block_in_both_frameworks(device="cuda"))):
        assert_same_bits(a, b, f"cuda/moe block/result {i}")


# ---- the fused expert MLP (core_cuda/cuda/expert_mlp.cu) -------------------------------


def _routing(t, k, ids, seed):
    """[t][k] expert ids drawn from `ids` (a dropped marker -1 among them, or not)."""
    return tuple(map(tuple, np.random.default_rng(seed).choice(ids, (t, k))))


# test_expert_mlp's cases (H = 6, F = 4: the 16-bit GEMMs take the unaligned kernels) and
# aligned ones over several tiles per expert (the tensor-core kernels): a window with dropped
# ids and an idle expert, both weight layouts.
FUSED_CASES = mlp_cases.CASES + [
    mlp_cases.MlpCase("tiles_swiglu_window", _routing(300, 2, [-1, 0, 1, 2, 4, 5, 6], 0), 5, "swiglu", True,
                      offset=1, hidden=64, ffn=32),
    mlp_cases.MlpCase("tiles_gelu_transposed", _routing(257, 3, [0, 1, 2], 1), 4, "gelu", False, True, hidden=128,
                      ffn=96),
    # K and N past a 64-wide k tile and a 128-wide n tile by less than one (16-byte pieces
    # partly outside), with bias.
    mlp_cases.MlpCase("tiles_edges_bias", _routing(200, 2, [0, 1, 3], 2), 4, "swiglu", True, hidden=136, ffn=72),
]
FUSED_RUNS = {"jax": (mlp_cases.jax_run, JAX_GPU), "torch": (mlp_cases.torch_run, TORCH_CUDA)}


@pytest.fixture(params=MLP_FAMILIES)
def fused_kernel(request, monkeypatch):
    """The fused op's kernels: the default (the CUTLASS 2.x gathered GEMMs on every GPU) and,
    on Hopper, GROUPGEMM_CUDA_KERNEL=sm90, under which A's gathered rows and w_in's
    gradient go through the sm_90a gathered GEMM (cutlass_gathered_sm90.cuh)."""
    return _run_under(request.param, monkeypatch)


def _fused_run(name):
    run, available = FUSED_RUNS[name]
    if not available:
        pytest.skip(f"needs a CUDA GPU, {name} with CUDA and a CUDA build")
    return run


@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=[c.name for c in FUSED_CASES])
@pytest.mark.parametrize("name", list(FUSED_RUNS))
def test_cuda_expert_mlp_matches_the_cpu_backend_with_exact_zeros(name, case, dtype, fused_kernel):
    # An explicit expert_mlp call on a GPU runs the fused kernels (gathered grouped GEMMs):
    # within the dtype's tolerance of the CPU backend, forward and every gradient; a dropped
    # slot's dprobs and an idle expert's weight and bias gradients exactly 0; T = 0 ordinary.
    run = _fused_run(name)
    x = mlp_cases.inputs(case)
    (gpu_out, gpu_grads), (cpu_out, cpu_grads) = (run(case, x, dtype, device=d) for d in ("cuda", "cpu"))
    to_float64 = torch_frontend.to_float64 if name == "torch" else jax_frontend.to_float64
    assert_close(to_float64(gpu_out), to_float64(cpu_out), dtype, f"{case.name}/{dtype}/out")
    t, k = case.shape
    dropped = eref.window_ids(np.asarray(x["indices"]).reshape(t, k), case.offset or 0, case.experts) < 0
    for what, got, want in zip(mlp_cases.GRADS, gpu_grads, cpu_grads):
        if want is None:
            assert got is None, what
            continue
        got = to_float64(got)
        assert_close(got, to_float64(want), dtype, f"{case.name}/{dtype}/d{what}")
        if what == "probs":
            assert (got[dropped] == 0).all()
        if what in ("w_in", "w_out", "b_in", "b_out"):
            assert all((got[e] == 0).all() for e in mlp_cases.idle_experts(case)), what


@needs_both
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("case", [FUSED_CASES[0], FUSED_CASES[-1]], ids=lambda c: c.name)
def test_cuda_expert_mlp_is_bitwise_identical_in_jax_and_torch(case, dtype, fused_kernel):
    x = mlp_cases.inputs(case, seed=1)
    jax_out, jax_grads = mlp_cases.jax_run(case, x, dtype, device="cuda")
    torch_out, torch_grads = mlp_cases.torch_run(case, x, dtype, device="cuda")
    assert_same_bits(jax_out, torch_out, f"cuda/{case.name}/{dtype}/out")
    for what, a, b in zip(mlp_cases.GRADS, jax_grads, torch_grads):
        assert (a is None) == (b is None), what
        if a is not None:
            assert_same_bits(a, b, f"cuda/{case.name}/{dtype}/d{what}")


@needs_torch_cuda
def test_cuda_layers_keep_the_composition_by_default_and_run_the_fused_op_when_told():
    # The fused kernels are not the layers' default on CUDA until a GPU run has validated
    # them: GroupedMLP.forward_routed (fused=None) runs the composition there, fused=True the
    # fused op, which agrees with it within tolerance.
    torch.manual_seed(0)
    experts = gt.GroupedMLP(3, 16, 8, bias=True).cuda()
    tokens, probs = torch.randn(6, 16, device="cuda"), torch.rand(6, 2, device="cuda")
    indices = torch.tensor([[0, 2], [2, 2], [1, -1], [0, 1], [2, 0], [5, 1]], device="cuda")
    assert not torch_expert_mlp.fused_by_default(tokens.device)
    assert not (JAX_GPU and jax_expert_mlp.fused_by_default())  # moe_layer's default on a GPU backend
    default = experts.forward_routed(tokens, indices, probs)
    experts.fused = False
    assert_same_bits(default, experts.forward_routed(tokens, indices, probs), "the default is the composition")
    experts.fused = True
    fused = experts.forward_routed(tokens, indices, probs)
    torch.testing.assert_close(fused, default, rtol=1e-5, atol=1e-5)


@needs_torch_cuda
def test_torch_cuda_graph_replays_the_fused_expert_mlp_with_changing_routing(fused_kernel):
    # Forward and backward captured once; each replay routes differently (an idle expert,
    # every slot dropped, all on one expert): the same bits as an eager call, exact zeros
    # for dropped slots' dprobs and idle experts' gradients.
    gen = torch.Generator().manual_seed(0)
    t, k, e, hidden, ffn = 96, 2, 4, 64, 32
    tokens = torch.randn(t, hidden, generator=gen).cuda().bfloat16().requires_grad_()
    w_in = (torch.randn(e, 2 * ffn, hidden, generator=gen) / 8).cuda().bfloat16().requires_grad_()
    w_out = (torch.randn(e, hidden, ffn, generator=gen) / 8).cuda().bfloat16().requires_grad_()
    probs = torch.rand(t, k, generator=gen).cuda().requires_grad_()
    indices = torch.randint(0, e, (t, k), generator=gen, dtype=torch.int32).cuda()
    dout = torch.randn(t, hidden, generator=gen).cuda().bfloat16()
    params = (tokens, w_in, w_out, probs)

    def step():
        y = gt.expert_mlp(tokens, indices, probs, w_in, w_out, activation="swiglu", transpose_weight=True)
        return (y, *torch.autograd.grad(y, params, dout))

    graph, static = capture(torch, step, warm_up=True)
    for seed, ids in ((1, [0, 1, 3]), (2, [-1]), (3, [2]), (4, [-1, 0, 1, 2, 3])):
        routing = np.random.default_rng(seed).choice(ids, (t, k)).astype(np.int32)
        indices.copy_(torch.from_numpy(routing))
        graph.replay()
        eager = step()
        for what, replayed, want in zip(("y", "dtokens", "dw_in", "dw_out", "dprobs"), static, eager):
            assert_same_bits(replayed, want, f"{what} {ids}")
        assert (static[4][torch.from_numpy(routing < 0).cuda()] == 0).all()
        for idle in set(range(e)) - set(ids):
            assert (static[2][idle] == 0).all() and (static[3][idle] == 0).all(), (ids, idle)


def _torch_moe_block(dim=64, ffn=32, experts=8, top_k=2):
    from moe_block import init_block, torch_block_class

    return torch_block_class()(init_block(np.random.default_rng(0), dim, ffn, experts), top_k).cuda()


@needs_torch_cuda
def test_torch_cuda_graph_replays_a_moe_block_with_changing_routing():
    torch.manual_seed(0)
    block = _torch_moe_block()
    experts, tokens, dim = 8, 96, 64
    x = torch.randn(tokens, dim, device="cuda", requires_grad=True)
    allowed = torch.ones(experts, dtype=torch.bool, device="cuda")
    dy = torch.randn(tokens, dim, device="cuda")
    params = (x, block.router, block.experts.fc1.weight, block.experts.fc2.weight)

    def step():
        y, sizes = block(x, allowed)
        return (y, sizes, *torch.autograd.grad(y, params, dy))

    graph, static = capture(torch, step, warm_up=True)

    # Each replay routes differently: new tokens, and experts barred from routing (two
    # allowed: six get no token; one allowed: a barred expert is never chosen, so every
    # token's second slot is dropped).
    for seed, allowed_experts in ((1, range(8)), (2, (0, 3)), (3, (5,)), (4, range(8))):
        with torch.no_grad():
            x.copy_(torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed)).cuda())
        mask = torch.zeros(experts, dtype=torch.bool)
        mask[list(allowed_experts)] = True
        allowed.copy_(mask)
        graph.replay()
        eager = step()
        assert torch.equal(static[1], eager[1]), allowed_experts  # the same routing
        assert int(static[1].sum()) == tokens * min(2, len(allowed_experts))
        for what, replayed, want in zip(("y", "dx", "drouter", "dw_in", "dw_out"), static[:1] + static[2:],
                                        eager[:1] + eager[2:]):
            torch.testing.assert_close(replayed, want, rtol=1e-5, atol=1e-5, msg=f"{what} {allowed_experts}")
        for e in torch.nonzero(static[1] == 0).flatten().tolist():
            assert (static[4][e] == 0).all() and (static[5][e] == 0).all()  # no token: exact-zero weight grads
        if len(allowed_experts) == 2:
            assert int((static[1] > 0).sum()) <= 2


@needs_torch_cuda
def test_torch_cuda_moe_block_step_never_synchronises_with_the_host():
    # Routing, permute, the expert MLP and unpermute, forward and backward: torch must not
    # read anything back (set_sync_debug_mode raises on a synchronising torch call).
    block = _torch_moe_block()
    x = torch.randn(128, 64, device="cuda", requires_grad=True)
    allowed = torch.tensor([True, False, True, True, False, True, True, True], device="cuda")
    y, _ = block(x, allowed)
    y.sum().backward()  # first call: lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, sizes = block(x, allowed)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert int(sizes[1]) == 0 and int(sizes[4]) == 0 and int(sizes.sum()) == 128 * 2
    assert (block.experts.fc1.weight.grad[[1, 4]] == 0).all()


# ---- FP8 ------------------------------------------------------------------------------

needs_hopper = pytest.mark.skipif(not _hopper(), reason=HOPPER_ONLY)
FP8_GPU_CASES = CASES + [Case("long_groups", 700, 32, 16, (300, 0, 129, 1, 0, 270))]  # groups of several blocks
FP8_GPU_IDS = [c.name for c in FP8_GPU_CASES]


def _gemms(frontend, c, recipe, device):
    """Both GEMM forms' results on `device`, from operands quantized there."""
    x = fref.inputs(c)
    a = lambda values, dtype="bfloat16": frontend.array(values, dtype, device)
    sizes = a(x["group_sizes"], "int32")
    offset = None if c.group_offset is None else c.group_offset
    qx, sx = frontend.quantize_fp8(a(x["x"]), recipe)
    qw, sw = frontend.quantize_fp8(a(x["w"]), recipe, power_of_two=True)
    (qd, sd), (qxt, sxt) = (frontend.quantize_fp8_grouped(a(x[k]), sizes, recipe, num_groups=c.g, offset=offset)
                            for k in ("dout", "x"))
    return {"out": frontend.scaled_matmul(qx, qw, sizes, sx, sw, recipe, bias=a(x["bias"], "float32"),
                                           offset=offset, out_dtype="float32"),
            "out_bf16": frontend.scaled_matmul(qx, qw, sizes, sx, sw, recipe, offset=offset),
            "wgrad": frontend.scaled_wgrad(qd, qxt, sizes, sd, sxt, recipe, num_groups=c.g, offset=offset),
            "accumulated": frontend.scaled_wgrad(qd, qxt, sizes, sd, sxt, recipe, num_groups=c.g, offset=offset,
                                                 accumulate_into=a(x["acc"], "float32"))}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_fp8_quantization_gives_the_cpu_bits(name, c, recipe):
    frontend = _frontend_on_cuda(name)
    x = fref.inputs(c)
    a = {device: (lambda values, dtype="bfloat16", d=device: frontend.array(values, dtype, d)) for device in
         ("cuda", "cpu")}
    for key in ("x", "w"):
        gpu, cpu = (frontend.quantize_fp8(a[d](x[key]), recipe) for d in ("cuda", "cpu"))
        for g, h in zip(gpu, cpu):
            assert_same_bits(g, h, f"{c.name}/{recipe}/{key}")
    gpu, cpu = (frontend.quantize_fp8_grouped(a[d](x["x"]), a[d](x["group_sizes"], "int32"), recipe, num_groups=c.g,
                                              offset=c.group_offset) for d in ("cuda", "cpu"))
    for g, h in zip(gpu, cpu):
        assert_same_bits(g, h, f"{c.name}/{recipe}/grouped")


@needs_hopper
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", FP8_GPU_CASES, ids=FP8_GPU_IDS)
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_fp8_gemms_match_the_cpu_backend_and_keep_exact_zeros(name, c, recipe):
    frontend = _frontend_on_cuda(name)
    gpu, cpu = (_gemms(frontend, c, recipe, d) for d in ("cuda", "cpu"))
    sizes = np.asarray(c.group_sizes)
    for what in gpu:
        g, h = frontend.to_float64(gpu[what]), frontend.to_float64(cpu[what])
        fref.assert_close(g, h, "bfloat16" if what in ("out_bf16", "wgrad") else "float32", f"{c.name}/{what}")
    pad = padding_rows(sizes, c.m, c.g, c.offset)
    assert (frontend.to_float64(gpu["out_bf16"])[pad] == 0).all()
    for e in empty_groups(sizes, c.m, c.g, c.offset):
        assert (frontend.to_float64(gpu["wgrad"])[e] == 0).all()
        assert np.array_equal(frontend.to_float64(gpu["accumulated"])[e],
                              fref.inputs(c)["acc"][e].astype(np.float64))  # bit for bit: float32 widened exactly


@needs_hopper
@pytest.mark.skipif(not (TORCH_CUDA and JAX_GPU), reason="needs a CUDA GPU in both frameworks")
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("c", LAYER_CASES, ids=[c.name for c in LAYER_CASES])
def test_cuda_fp8_training_recipe_is_bitwise_identical_in_jax_and_torch(c, recipe):
    x = layer_inputs(c)
    results = [f.fp8_linear_and_grads(x["x"], x["w"], x["sizes"], x["bias"], x["dout"], recipe, "bfloat16",
                                      device="cuda") for f in (jax_frontend, torch_frontend)]
    (jax_y, jax_grads), (torch_y, torch_grads) = results
    assert_same_bits(jax_y, torch_y, f"{c.name}/{recipe}/y")
    for name, a, b in zip(("dx", "dw", "dbias"), jax_grads, torch_grads):
        assert_same_bits(a, b, f"{c.name}/{recipe}/{name}")


@needs_hopper
def test_torch_cuda_graph_replays_an_fp8_layer_with_changing_routing():
    torch.manual_seed(0)
    layer = gt.GroupedLinear(4, 128, 256, device="cuda", dtype=torch.bfloat16, fp8="blockwise")
    x = torch.randn(96, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sizes = torch.tensor([40, 0, 30, 26], device="cuda")

    def step():
        layer.zero_grad(set_to_none=False)
        x.grad = None
        y = layer(x, sizes)
        y.float().square().sum().backward()
        return y

    step()  # warm up: allocations and the first calls outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for routing in ([40, 0, 30, 26], [0, 0, 0, 0], [96, 0, 0, 0], [1, 2, 3, 4]):
        sizes.copy_(torch.tensor(routing))
        graph.replay()
        replayed = [t.clone() for t in (y, layer.weight.grad, layer.bias.grad)]
        eager = [step().clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
        for a, b in zip(replayed, eager):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for e in np.flatnonzero(np.asarray(routing) == 0):
            assert (replayed[1][e] == 0).all()


@needs_jax_gpu
@pytest.mark.parametrize("capacity", [24, 5], ids=["dropless", "dropping"])
def test_jax_gpu_dispatch_through_ragged_all_to_all_moves_the_cpus_rows(capacity):
    # On a GPU, groupgemm.jax.dispatch and combine exchange rows with ragged_all_to_all (the
    # CPU, which lacks it, with all_to_all of padded chunks): the same rows in the same
    # places, and the same sums, forward and backward.
    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((12, 16)).astype(np.float32)
    experts = rng.integers(0, 4, (12, 2)).astype(np.int32)
    experts[3] = [4, 1]  # one slot routed nowhere
    probs = rng.random((12, 2)).astype(np.float32)

    def run(device):
        mesh = jax.sharding.Mesh(np.array([device]), ("ep",))

        def layer(x, e, p):
            rows, sizes, plan = gj.dispatch(x, e, 4, axis_name="ep", capacity=capacity)
            return rows, sizes, plan.dropped[None], gj.combine(rows * 2.0, plan, p)

        spec = jax.sharding.PartitionSpec("ep")
        step = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 4))
        out = step(tokens, experts, probs)
        grads = jax.grad(lambda x, p: jnp.sum(step(x, experts, p)[3] ** 2), argnums=(0, 1))(tokens, probs)
        text = step.lower(tokens, experts, probs).as_text()
        return [np.asarray(a) for a in (*out, *grads)], text

    (gpu, gpu_text), (cpu, cpu_text) = run(_jax_gpu()), run(jax.devices("cpu")[0])
    assert "ragged_all_to_all" in gpu_text and "ragged_all_to_all" not in cpu_text
    for what, a, b in zip(("rows", "group_sizes", "dropped"), gpu, cpu):
        assert_same_bits(a, b, what)  # copies
    assert int(gpu[2][0]) == (0 if capacity == 24 else 24 - 1 - capacity)
    for what, a, b in zip(("out", "dtokens", "dprobs"), gpu[3:], cpu[3:]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=what)


@needs_torch_cuda
@pytest.mark.skipif(_hopper(), reason=NOT_ON_HOPPER)
def test_cuda_fp8_gemm_refuses_a_gpu_without_fp8_tensor_cores():
    q = torch.zeros(8, 128, device="cuda", dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 16, 128, device="cuda", dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="need FP8 tensor cores: a compute capability 9.0 GPU"):
        gt.scaled_grouped_mm(q, w.transpose(-2, -1), torch.ones(8, device="cuda"), "RowWise",
                             torch.ones(2, 16, device="cuda"), "RowWise", group_sizes=torch.tensor([4, 4]).cuda())
    qx, scale = gt.quantize_fp8(torch.ones(8, 128, device="cuda"), "blockwise")  # quantization runs anywhere
    assert qx.is_cuda and (scale == 1 / 448).all()
