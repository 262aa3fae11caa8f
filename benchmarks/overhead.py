"""Call overhead: grouped GEMMs with every expert empty, so that only the host path runs.

With no rows routed there is nothing to multiply: the time is what a call costs (argument
checks, dispatch, the custom call, zeroing the small output), next to each framework's own
grouped GEMM on the same empty input and a trivial op as the floor. bfloat16, M = 128,
K = N = 64, G = 8. One interleaved run per framework, in a shuffled order each round.

PyTorch rows, groupgemm against ``torch._grouped_mm``: a forward without grad; a forward
and backward (inputs that require grad, a given output gradient: ``torch._grouped_mm``'s
backward refuses the stride-0 one of ``y.sum().backward()``); and torchtitan's literal call,
``grouped_mm(x, w.transpose(-2, -1), offs=offs)`` with the transposed view made in the
call, as ``GroupedExperts`` makes it. JAX rows, jitted, groupgemm against
``jax.lax.ragged_dot``: a forward, and a forward and backward (``jax.vjp``).

``python benchmarks/overhead.py [repeats]`` prints the table; bench.py runs it at its end.
"""

import sys

import numpy as np
from timing import interleaved_medians

SHAPE = {"tokens": 128, "hidden": 64, "ffn": 64, "experts": 8}
REPEATS = 2000
SHUFFLE_SEED = 0
GROUPGEMM, FLOOR = "groupgemm", "floor"


def _jax_calls(device_name):
    import jax
    import jax.numpy as jnp

    from groupgemm.jax import grouped_matmul

    device = jax.devices(device_name)[0]
    m, k, n, g = SHAPE["tokens"], SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"]
    put = lambda x: jax.device_put(x, device)
    lhs, rhs = put(jnp.ones((m, k), jnp.bfloat16)), put(jnp.ones((g, k, n), jnp.bfloat16))
    sizes, dout = put(jnp.zeros((g,), jnp.int32)), put(jnp.ones((m, n), jnp.bfloat16))
    grouped, ragged = jax.jit(grouped_matmul), jax.jit(jax.lax.ragged_dot)

    def forward_backward(fn):
        return jax.jit(lambda x, w, s, dy: jax.vjp(lambda x, w: fn(x, w, s), x, w)[1](dy))

    grouped_fb, ragged_fb = forward_backward(grouped_matmul), forward_backward(jax.lax.ragged_dot)
    add_one = jax.jit(lambda x: x + 1)
    assert not np.asarray(grouped(lhs, rhs, sizes)).astype(np.float32).any(), "all-empty output must be zeros"
    wait = jax.block_until_ready
    return {
        ("forward", GROUPGEMM): lambda: wait(grouped(lhs, rhs, sizes)),
        ("forward", "jax.lax.ragged_dot"): lambda: wait(ragged(lhs, rhs, sizes)),
        ("forward + backward", GROUPGEMM): lambda: wait(grouped_fb(lhs, rhs, sizes, dout)),
        ("forward + backward", "jax.lax.ragged_dot"): lambda: wait(ragged_fb(lhs, rhs, sizes, dout)),
        ("jitted x + 1", FLOOR): lambda: wait(add_one(lhs)),
    }


def _torch_calls(device_name):
    import torch

    from groupgemm.torch import grouped_mm

    device = torch.device(device_name)
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    m, k, n, g = SHAPE["tokens"], SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"]
    make = lambda *shape: torch.ones(*shape, dtype=torch.bfloat16, device=device)
    x, w, w_nk, dout = make(m, k), make(g, k, n), make(g, n, k), make(m, n)
    x_grad, w_grad = x.clone().requires_grad_(), w.clone().requires_grad_()
    sizes = torch.zeros(g, dtype=torch.int64, device=device)
    offs = torch.zeros(g, dtype=torch.int32, device=device)
    assert not grouped_mm(x, w, sizes).any(), "all-empty output must be zeros"

    def waited(fn):
        def call():
            fn()
            wait()
        return call

    return {
        ("forward, no grad", GROUPGEMM): waited(lambda: grouped_mm(x, w, sizes)),
        ("forward, no grad", "torch._grouped_mm"): waited(lambda: torch._grouped_mm(x, w, offs=offs)),
        ("forward + backward", GROUPGEMM): waited(lambda: grouped_mm(x_grad, w_grad, sizes).backward(dout)),
        ("forward + backward", "torch._grouped_mm"):
            waited(lambda: torch._grouped_mm(x_grad, w_grad, offs=offs).backward(dout)),
        ("torchtitan's call, grouped_mm(x, w.transpose(-2, -1), offs=offs)", GROUPGEMM):
            waited(lambda: grouped_mm(x, w_nk.transpose(-2, -1), offs=offs)),
        ("torchtitan's call, grouped_mm(x, w.transpose(-2, -1), offs=offs)", "torch._grouped_mm"):
            waited(lambda: torch._grouped_mm(x, w_nk.transpose(-2, -1), offs=offs)),
        ("torch.add", FLOOR): waited(lambda: torch.add(x, 1)),
    }


CALLS = {"jax": _jax_calls, "torch": _torch_calls}


def measure(framework, device_name, repeats=REPEATS):
    """Rows {framework, call, impl, median_us, samples} of one interleaved run."""
    calls = CALLS[framework](device_name)
    medians = interleaved_medians(calls, repeats, shuffle_seed=SHUFFLE_SEED)
    return [{"framework": framework, "call": call, "impl": impl, **SHAPE, "dtype": "bfloat16",
             "median_us": round(seconds * 1e6, 2), "samples": samples}
            for (call, impl), (seconds, samples) in medians.items()]


def main(argv):
    import report

    repeats = int(argv[0]) if argv else REPEATS
    rows = [row for framework in CALLS for row in measure(framework, "cpu", repeats)]
    print(report.overhead_table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
