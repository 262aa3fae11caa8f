"""Call overhead: a grouped forward with every expert empty, next to a trivial op.

With no rows routed there is nothing to multiply, so the time is what a call costs:
Python argument checks, dispatch, launching the custom call and zeroing the small
output. The trivial op of the same framework (jitted `x + 1`, eager `torch.add`) on the
same lhs is the floor that no call can go below; the framework's own grouped GEMM on the
same empty input is shown beside it. In eager PyTorch a forward whose inputs require
grad also records the autograd node, so it is measured both ways.
"""

import numpy as np
from timing import interleaved_medians

SHAPE = {"tokens": 128, "hidden": 64, "ffn": 64, "experts": 8}
REPEATS = 2000


def _jax_calls(device_name):
    import jax
    import jax.numpy as jnp

    from groupgemm.jax import grouped_matmul

    device = jax.devices(device_name)[0]
    m, k, n, g = SHAPE["tokens"], SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"]
    lhs = jax.device_put(jnp.ones((m, k), jnp.float32), device)
    rhs = jax.device_put(jnp.ones((g, k, n), jnp.float32), device)
    sizes = jax.device_put(jnp.zeros((g,), jnp.int32), device)
    grouped, ragged_dot = jax.jit(grouped_matmul), jax.jit(jax.lax.ragged_dot)
    add_one = jax.jit(lambda x: x + 1)
    assert not np.asarray(grouped(lhs, rhs, sizes)).any(), "all-empty output must be zeros"
    return {"groupgemm grouped_matmul": lambda: grouped(lhs, rhs, sizes).block_until_ready(),
            "jax.lax.ragged_dot": lambda: ragged_dot(lhs, rhs, sizes).block_until_ready(),
            "floor: jitted x + 1": lambda: add_one(lhs).block_until_ready()}


def _torch_calls(device_name):
    import torch

    from groupgemm.torch import grouped_mm

    device = torch.device(device_name)
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    m, k, n, g = SHAPE["tokens"], SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"]
    lhs = torch.ones(m, k, device=device)
    rhs = torch.ones(g, k, n, device=device)
    lhs_grad, rhs_grad = lhs.clone().requires_grad_(), rhs.clone().requires_grad_()
    sizes = torch.zeros(g, dtype=torch.int64, device=device)
    assert not grouped_mm(lhs, rhs, sizes).any(), "all-empty output must be zeros"

    def waited(fn, *args, **kwargs):
        def call():
            fn(*args, **kwargs)
            wait()
        return call

    offsets = torch.zeros(g, dtype=torch.int32, device=device)
    return {"groupgemm grouped_mm": waited(grouped_mm, lhs, rhs, sizes),
            "groupgemm grouped_mm, inputs require grad": waited(grouped_mm, lhs_grad, rhs_grad, sizes),
            "torch._grouped_mm": waited(torch._grouped_mm, lhs, rhs, offs=offsets),
            "floor: torch.add": waited(torch.add, lhs, 1)}


CALLS = {"jax": _jax_calls, "torch": _torch_calls}


def measure(framework, device_name, repeats=REPEATS):
    """Rows {framework, call, median_us, samples}: forward only, float32, all experts empty."""
    calls = CALLS[framework](device_name)
    medians = interleaved_medians(calls, repeats)
    return [{"framework": framework, "call": name, **SHAPE, "median_us": round(seconds * 1e6, 2),
             "samples": samples} for name, (seconds, samples) in medians.items()]
