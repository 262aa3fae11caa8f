"""What only groupgemm.jax has: the ragged_dot drop-in against jax.lax.ragged_dot, jit
with traced sizes, vmap, shard_map, Python lists of sizes. No torch here; the shared
bodies are in test_frontends.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from cases import CASES, case, inputs

from groupgemm.jax import grouped_matmul, ragged_dot


def _valid_for_lax(c):
    return c.group_offset is None and min(c.group_sizes, default=0) >= 0 and sum(c.group_sizes) <= c.m and c.g > 0


LAX_CASES = [c for c in CASES if _valid_for_lax(c)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", LAX_CASES, ids=[c.name for c in LAX_CASES])
def test_ragged_dot_agrees_with_jax_lax_ragged_dot(case, dtype):
    x = inputs(case)
    lhs, rhs, dout = (jnp.asarray(x[k], dtype) for k in ("lhs", "rhs", "dout"))
    sizes = jnp.asarray(x["group_sizes"])
    ours, our_vjp = jax.vjp(lambda l, r: ragged_dot(l, r, sizes), lhs, rhs)
    theirs, their_vjp = jax.vjp(lambda l, r: jax.lax.ragged_dot(l, r, sizes), lhs, rhs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    for a, b in [(ours, theirs), *zip(our_vjp(dout), their_vjp(dout))]:
        ref.assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), dtype, case.name)


def test_ragged_dot_accepts_group_offset_where_jax_raises():
    x = inputs(case("window_middle"))
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    with pytest.raises((NotImplementedError, TypeError)):  # which one depends on the JAX version
        jax.jit(lambda o: jax.lax.ragged_dot(lhs, rhs, jnp.asarray(x["group_sizes"]), group_offset=o))(
            jnp.array([2], jnp.int32))
    out = ragged_dot(lhs, rhs, jnp.asarray(x["group_sizes"]), group_offset=jnp.array([2], jnp.int32))
    ref.assert_close(np.asarray(out, np.float64),
                     ref.grouped_matmul(x["lhs"], x["rhs"], x["group_sizes"], group_offset=2), "float32")


def test_jit_with_traced_group_sizes_compiles_once():
    traces = []

    @jax.jit
    def f(lhs, rhs, sizes):
        traces.append(1)
        return grouped_matmul(lhs, rhs, sizes)

    x = inputs(case("uniform"))
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    for sizes in ([6, 6, 6, 6], [24, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 4]):
        out = f(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        ref.assert_close(np.asarray(out, np.float64), ref.grouped_matmul(x["lhs"], x["rhs"], sizes), "float32")
    assert len(traces) == 1


def test_python_list_sizes_of_any_magnitude_are_clipped_like_arrays():
    x = inputs(case("uniform"))
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    out = grouped_matmul(lhs, rhs, [-(2**70), 2**70, 5, 2**40])  # as [0, 24, 0, 0]: group 1 owns every row
    ref.assert_close(np.asarray(out, np.float64), ref.grouped_matmul(x["lhs"], x["rhs"], [0, 24, 0, 0]), "float32")


def test_vmap_over_a_batch_axis_matches_per_example_calls():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((3, 12, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 4, 8, 5)), jnp.float32)
    sizes = jnp.asarray([[3, 3, 3, 3], [0, 12, 0, 0], [0, 0, 0, 0]], jnp.int32)
    batched = jax.vmap(grouped_matmul)(lhs, rhs, sizes)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(grouped_matmul(lhs[i], rhs[i], sizes[i])))
    grads = jax.vmap(jax.grad(lambda l, r, s: grouped_matmul(l, r, s).sum(), argnums=1))(lhs, rhs, sizes)
    assert (np.asarray(grads[2]) == 0).all()  # every group empty in example 2


def test_expert_parallel_shard_map_with_group_offset_matches_single_device():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([5, 0, 7, 4], jnp.int32)  # rank 0 holds experts 0-1, rank 1 experts 2-3
    lhs = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 8, 6)), jnp.float32)

    def local(lhs, rhs_local, sizes):
        offset = jax.lax.axis_index("expert") * rhs_local.shape[0]
        out = grouped_matmul(lhs, rhs_local, sizes, group_offset=offset)
        return jax.lax.psum(out, "expert")  # padding rows are exact zeros: the sum is exact

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("expert"), P()), out_specs=P()))
    np.testing.assert_array_equal(np.asarray(sharded(lhs, rhs, sizes)), np.asarray(grouped_matmul(lhs, rhs, sizes)))
