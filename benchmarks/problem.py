"""One benchmark configuration: its inputs, a float32 reference and the correctness check.

Inputs are drawn once in NumPy and rounded to the benchmark dtype, so every framework
and implementation multiplies the same numbers. The reference is a per-expert NumPy loop
in float32 on those rounded numbers, independent of everything that is timed.
"""

from dataclasses import dataclass

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np
from routing import group_sizes

# Largest |error| allowed relative to the largest |reference| value: float32 differs only
# in summation order; 16-bit outputs and gradients are rounded once more.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


@dataclass(frozen=True)
class Config:
    dtype: str
    experts: int
    tokens: int  # M: rows after top-k dispatch
    hidden: int  # K
    ffn: int  # N
    routing: str

    @property
    def sizes(self):
        return group_sizes(self.routing, self.experts, self.tokens)

    @property
    def routed_rows(self):
        return min(sum(self.sizes), self.tokens)

    @property
    def forward_flops(self):
        """Useful forward FLOPs: what one GEMM per non-empty expert does."""
        return 2.0 * self.routed_rows * self.hidden * self.ffn

    @property
    def dense_flops(self):
        return 2.0 * self.tokens * self.hidden * self.ffn


@dataclass
class Problem:
    """Inputs in the benchmark dtype (as NumPy arrays) and the float32 reference results."""
    config: Config
    lhs: np.ndarray  # [M, K]
    rhs: np.ndarray  # [G, K, N]
    dense_rhs: np.ndarray  # [K, N], the one weight of the dense ceiling
    dout: np.ndarray  # [M, N], the incoming gradient of forward+backward
    reference: dict  # out, dlhs, drhs in float32

    @classmethod
    def draw(cls, config, seed=0):
        rng = np.random.default_rng(seed)
        m, k, n, g = config.tokens, config.hidden, config.ffn, config.experts
        dtype = np.dtype(config.dtype)

        def normal(*shape):
            return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

        lhs, rhs, dout = normal(m, k), normal(g, k, n), normal(m, n)
        dense_rhs = rhs[0] if g else normal(k, n)
        return cls(config, lhs, rhs, dense_rhs, dout, _reference(lhs, rhs, dout, config.sizes))


def _reference(lhs, rhs, dout, sizes):
    lhs, rhs, dout = (a.astype(np.float32) for a in (lhs, rhs, dout))
    out, dlhs, drhs = np.zeros_like(dout), np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, min(start + size, lhs.shape[0]))
        out[rows] = lhs[rows] @ rhs[g]
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
        start = rows.stop
    return {"out": out, "dlhs": dlhs, "drhs": drhs}


def check(problem, results):
    """Compares (out, dlhs, drhs), as float32 NumPy arrays, with the reference.

    Returns (passed, worst relative error, name of the worst result). NaN or Inf (for
    example from rows a kernel left uninitialised) counts as an infinite error.
    """
    worst, worst_name = 0.0, ""
    for name, value in zip(("out", "dlhs", "drhs"), results):
        ref = problem.reference[name]
        with np.errstate(invalid="ignore", over="ignore"):  # garbage may hold Inf
            diff = np.abs(np.asarray(value, np.float32) - ref)
        error = float(diff.max(initial=0.0)) / max(float(np.abs(ref).max(initial=0.0)), 1.0)
        if not np.isfinite(error):
            error = float("inf")
        if error >= worst:
            worst, worst_name = error, name
    return worst <= TOLERANCE.get(problem.config.dtype, 1e-4), worst, worst_name
