"""groupgemm.jax vs jax.lax.ragged_dot vs one dense matmul, forward and forward+backward.

Run: python benchmarks/jax_vs_ragged_dot.py [--dtypes float32] [--groups 8 64]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm.jax import grouped_matmul
from timing import add_shape_arguments, median_seconds


def fwd_and_train(matmul):
    fwd = jax.jit(matmul)
    train = jax.jit(jax.value_and_grad(lambda l, r, s: jnp.sum(matmul(l, r, s).astype(jnp.float32)), argnums=(0, 1)))
    return fwd, train


def main():
    p = argparse.ArgumentParser(description=__doc__)
    add_shape_arguments(p, dtypes=("float32",))
    a = p.parse_args()
    dtype = jnp.dtype(a.dtypes[0])
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((a.m, a.k)), dtype)
    print(f"M={a.m} K={a.k} N={a.n} {dtype}, {jax.devices()[0].platform}, median of {a.repeats} (ms)")
    print(f"{'G':>4} {'impl':>12} {'fwd':>9} {'fwd+bwd':>9} {'fwd GFLOP/s':>12} {'fwd vs dense':>12} {'fwd+bwd speed-up':>17}")
    flops = 2.0 * a.m * a.k * a.n
    for g in a.groups:
        rhs = jnp.asarray(rng.standard_normal((g, a.k, a.n)), dtype)
        sizes = jnp.full((g,), a.m // g, jnp.int32).at[-1].add(a.m % g)
        impls = {
            "dense": lambda l, r, s: l @ r[0],
            "groupgemm": lambda l, r, s: grouped_matmul(l, r, s),
            "ragged_dot": lambda l, r, s: jax.lax.ragged_dot(l, r, s),
        }
        results = {}
        for name, fn in impls.items():
            fwd, train = fwd_and_train(fn)
            repeats = 2 if name == "ragged_dot" and g > 8 else a.repeats
            results[name] = (median_seconds(lambda: jax.block_until_ready(fwd(lhs, rhs, sizes)), repeats),
                             median_seconds(lambda: jax.block_until_ready(train(lhs, rhs, sizes)), repeats))
        for name, (f, t) in results.items():
            print(f"{g:>4} {name:>12} {f * 1e3:>9.1f} {t * 1e3:>9.1f} {flops / f / 1e9:>12.1f} "
                  f"{results['dense'][0] / f:>12.2f} {results['ragged_dot'][1] / t:>16.1f}x")


if __name__ == "__main__":
    main()
