"""The JAX contenders: groupgemm, jax.lax.ragged_dot, a per-expert loop and one dense GEMM
(XLA's, and groupgemm's with one group).

Every contender is jitted; group sizes are a device array argument, except for the loop,
which cannot slice by traced sizes and so bakes the host sizes into its program (one
compilation per routing, which is why MoE code does not do this).
"""

import jax
import jax.numpy as jnp
import numpy as np
from contenders import DENSE, DENSE_KINDS, GROUPGEMM, GROUPGEMM_DENSE, PER_EXPERT_LOOP, RAGGED_DOT, Contender

from groupgemm.jax import grouped_matmul


def _per_expert_loop(sizes):
    def matmul(lhs, rhs, group_sizes):
        del group_sizes  # the loop needs the sizes on the host
        parts, start = [], 0
        for g, size in enumerate(sizes):
            if size:  # an empty expert is skipped, as MoE loops do
                parts.append(lhs[start:start + size] @ rhs[g])
            start += size
        parts.append(jnp.zeros((lhs.shape[0] - start, rhs.shape[2]), lhs.dtype))  # padding rows
        return jnp.concatenate(parts)
    return matmul


def _matmuls(sizes):
    return {
        GROUPGEMM: lambda lhs, rhs, group_sizes: grouped_matmul(lhs, rhs, group_sizes),
        RAGGED_DOT: lambda lhs, rhs, group_sizes: jax.lax.ragged_dot(lhs, rhs, group_sizes),
        PER_EXPERT_LOOP: _per_expert_loop(sizes),
        DENSE: lambda lhs, rhs, group_sizes: lhs @ rhs,
        GROUPGEMM_DENSE: lambda lhs, rhs, group_sizes: grouped_matmul(lhs, rhs[None],
                                                                      jnp.full((1,), lhs.shape[0], jnp.int32)),
    }


def _forward_backward(matmul):
    def run(lhs, rhs, group_sizes, dout):
        out, vjp = jax.vjp(lambda lhs, rhs: matmul(lhs, rhs, group_sizes), lhs, rhs)
        return (out, *vjp(dout))
    return run


def _peak_bytes(device, fn):
    """Peak device memory of one call above what was in use before it, where the device
    reports it (CUDA). XLA's peak counter cannot be reset, so a call that stays below an
    earlier peak is not measurable: None, like every call on CPU (no allocator stats)."""
    before = device.memory_stats()
    if not before or "peak_bytes_in_use" not in before:
        return None
    fn()
    peak = device.memory_stats()["peak_bytes_in_use"]
    return peak - before["bytes_in_use"] if peak > before["peak_bytes_in_use"] else None


def contenders(problem, device_name):
    """{name: build}, where build() compiles that contender for the problem on 'cpu' or
    'cuda' and returns its Contender (the caller reports a contender that fails)."""
    device = jax.devices(device_name)[0]
    put = lambda a: jax.device_put(a, device)  # noqa: E731
    lhs, rhs, dense_rhs, dout = map(put, (problem.lhs, problem.rhs, problem.dense_rhs, problem.dout))
    sizes = put(np.asarray(problem.config.sizes, np.int32))

    def build(name, matmul):
        args = (lhs, dense_rhs if name in DENSE_KINDS else rhs, sizes)
        forward = jax.jit(matmul)
        forward_backward = jax.jit(_forward_backward(matmul)).lower(*args, dout).compile()
        analysis = forward_backward.memory_analysis()
        run_forward_backward = lambda: jax.block_until_ready(forward_backward(*args, dout))  # noqa: E731
        return Contender(
            name=name,
            forward=lambda: jax.block_until_ready(forward(*args)),
            forward_backward=run_forward_backward,
            peak_bytes=lambda: _peak_bytes(device, run_forward_backward),
            xla_temp_bytes=None if analysis is None else analysis.temp_size_in_bytes,
            checked=name not in DENSE_KINDS,
        )

    return {name: (lambda name=name, matmul=matmul: build(name, matmul))
            for name, matmul in _matmuls(problem.config.sizes).items()}


def to_numpy(x):
    return np.asarray(jnp.asarray(x, jnp.float32))
