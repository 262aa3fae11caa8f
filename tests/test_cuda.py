"""The CUDA backend on a GPU, through both frontends.

These run wherever a GPU and a CUDA build are present and skip elsewhere. Machines
without a GPU still check the CUDA path's host-visible logic: core_tests emulates the
setup kernel's workspace on every case, and test_cuda_build.py checks the fatbinary, the
absence of host synchronisation and the no-device error.
"""

import jax
import jax.numpy as jnp
import jax_frontend
import numpy as np
import pytest
import torch
import torch_frontend
from bits import assert_same_bits
from cases import CASES, CUDA_DTYPES, VARIANT_IDS, VARIANTS, Case, inputs
from reference import assert_close, empty_groups, padding_rows

import groupgemm
import groupgemm.jax as gj
import groupgemm.torch as gt


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

# Beyond the shared table: several 128 x 128 tiles per group on the tensor-core path, and
# K, N that are not multiples of 8 (the unaligned kernel).
GPU_CASES = CASES + [
    Case("tiles", 1000, 256, 136, (300, 0, 129, 1, 0, 400, 170, 0)),
    Case("unaligned", 200, 36, 20, (50, 0, 100, 50)),
]
GPU_IDS = [c.name for c in GPU_CASES]
each_variant = pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)


ON_CUDA = {"jax": (jax_frontend, JAX_GPU), "torch": (torch_frontend, TORCH_CUDA)}


@each_variant
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
@pytest.mark.parametrize("name", list(ON_CUDA))
def test_cuda_matches_cpu_backend_and_keeps_exact_zeros(name, case, dtype, variant):
    frontend, available = ON_CUDA[name]
    if not available:
        pytest.skip(f"needs a CUDA GPU, {name} with CUDA and a CUDA build")
    gpu, cpu = ([frontend.to_float64(v) for v in frontend.forward_backward(case, dtype, *variant, device)]
                for device in ("cuda", "cpu"))
    for what, a, b in zip(("out", "dlhs", "drhs", "dbias"), gpu, cpu):
        assert_close(a, b, dtype, f"{case.name}/{dtype}/{what}")
    sizes = inputs(case)["group_sizes"]
    pad = padding_rows(sizes, case.m, case.g, case.offset)
    assert (gpu[0][pad] == 0).all() and (gpu[1][pad] == 0).all()
    for g in empty_groups(sizes, case.m, case.g, case.offset):
        assert (gpu[2][g] == 0).all() and (gpu[3][g] == 0).all()


@needs_torch_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_torch_cuda_wgrad_accumulates_and_leaves_empty_groups_bitwise(case):
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
def test_cuda_jax_and_torch_are_bitwise_identical(case, dtype, variant):
    jax_results = jax_frontend.forward_backward(case, dtype, *variant, "cuda")
    torch_results = torch_frontend.forward_backward(case, dtype, *variant, "cuda")
    for name, a, b in zip(("out", "dlhs", "drhs", "dbias"), jax_results, torch_results):
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
def test_torch_cuda_graph_replays_with_changing_group_sizes():
    torch.manual_seed(0)
    layer = gt.GroupedLinear(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(96, 32, device="cuda", dtype=torch.bfloat16)
    sizes = torch.tensor([24, 24, 24, 24], device="cuda", dtype=torch.int32)
    params = (x, layer.weight, layer.bias)

    def step():
        y = layer(x, sizes)
        return (y, *torch.autograd.grad(y, params, dy))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    for new_sizes in ([96, 0, 0, 0], [0, 0, 0, 0], [10, 0, 50, 7], [30, 30, 30, 6]):
        sizes.copy_(torch.tensor(new_sizes, dtype=torch.int32))
        graph.replay()
        for replayed, eager in zip(static, step()):
            assert torch.equal(replayed, eager), new_sizes  # same kernels, same bits
        pad = torch.from_numpy(padding_rows(new_sizes, 96, 4)).cuda()
        assert (static[0][pad] == 0).all() and (static[1][pad] == 0).all()  # out and dx
        for g in empty_groups(new_sizes, 96, 4):
            assert (static[2][g] == 0).all() and (static[3][g] == 0).all()


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
