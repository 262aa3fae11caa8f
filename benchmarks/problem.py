"""One benchmark configuration: its inputs, a float32 reference and the correctness check.

Inputs are drawn once in NumPy and rounded to the benchmark dtype, so every framework
and implementation multiplies the same numbers. The reference is a per-expert NumPy loop
in float32 on those rounded numbers, independent of everything that is timed.

At MoE shapes on a GPU machine a full reference (three GEMMs of the whole problem on the
CPU) and full comparisons took longer than timing every contender, so above
FULL_REFERENCE_FLOPS the reference and the check cover a sample: every group's first and
last rows, the padding rows' ends, rows spread evenly between, and columns spread evenly
over K and N (the weight gradient at those K x N entries of every group, over all its rows).
"""

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np
from routing import group_sizes

# Largest |error| allowed relative to the largest |reference| value: float32 differs only
# in summation order; 16-bit outputs and gradients are rounded once more.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}
FULL_REFERENCE_FLOPS = 3e10
SAMPLED_ROWS, SAMPLED_COLUMNS = 512, 128  # spread evenly, beyond each group's edges
DRAW_CHUNK = 1 << 22  # elements per random stream: the same numbers whatever the thread count


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
    reference: dict  # out, dlhs, drhs in float32, at `sample` when there is one
    sample: tuple | None = None  # (rows, K columns, N columns) the check covers; None: all

    @classmethod
    def draw(cls, config, seed=0):
        m, k, n, g = config.tokens, config.hidden, config.ffn, config.experts
        dtype = np.dtype(config.dtype)
        lhs, rhs, dout = (_normal((seed, i), shape, dtype) for i, shape in enumerate(((m, k), (g, k, n), (m, n))))
        dense_rhs = rhs[0] if g else _normal((seed, 3), (k, n), dtype)
        sample = _sample(config)
        return cls(config, lhs, rhs, dense_rhs, dout, _reference(lhs, rhs, dout, config.sizes, sample), sample)


def _normal(key, shape, dtype):
    """Standard normals rounded to `dtype`, drawn in parallel chunks, each chunk from its
    own stream seeded by (key, chunk index)."""
    out = np.empty(shape, dtype)
    flat = out.reshape(-1)

    def fill(chunk):
        start = chunk * DRAW_CHUNK
        stop = min(start + DRAW_CHUNK, flat.size)
        flat[start:stop] = np.random.default_rng([*key, chunk]).standard_normal(stop - start, dtype=np.float32)

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(fill, range(-(-flat.size // DRAW_CHUNK))))
    return out


def _group_rows(sizes, m):
    """Each group's row range: groups take consecutive rows in order, clipped at M."""
    start, ranges = 0, []
    for size in sizes:
        stop = min(start + size, m)
        ranges.append((start, stop))
        start = stop
    return ranges


def _spread(count, limit):
    return np.linspace(0, limit - 1, count).round().astype(np.int64)


def _sample(config):
    """(rows, K columns, N columns) the check covers, or None for every element."""
    m, k, n = config.tokens, config.hidden, config.ffn
    if 6.0 * m * k * n <= FULL_REFERENCE_FLOPS:
        return None
    ranges = _group_rows(config.sizes, m)
    routed = ranges[-1][1] if ranges else 0
    edges = [r for start, stop in ranges + [(routed, m)] for r in (start, start + 1, stop - 2, stop - 1)
             if start <= r < stop]
    rows = np.unique(np.concatenate([np.array(edges, np.int64), _spread(SAMPLED_ROWS, m)]))
    return rows, _spread(SAMPLED_COLUMNS, k), _spread(SAMPLED_COLUMNS, n)


def _reference(lhs, rhs, dout, sizes, sample=None):
    m, k, n = lhs.shape[0], lhs.shape[1], dout.shape[1]
    rows, k_cols, n_cols = sample or (np.arange(m), np.arange(k), np.arange(n))
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    out = np.zeros((len(rows), len(n_cols)), np.float32)
    dlhs = np.zeros((len(rows), len(k_cols)), np.float32)
    drhs = np.zeros((rhs.shape[0], len(k_cols), len(n_cols)), np.float32)
    for g, (start, stop) in enumerate(_group_rows(sizes, m)):
        mine = (rows >= start) & (rows < stop)  # padding rows belong to no group: 0
        out[mine] = f32(lhs[rows[mine]]) @ f32(rhs[g][:, n_cols])
        dlhs[mine] = f32(dout[rows[mine]]) @ f32(rhs[g][k_cols]).T
        drhs[g] = f32(lhs[start:stop, k_cols]).T @ f32(dout[start:stop, n_cols])
    return {"out": out, "dlhs": dlhs, "drhs": drhs}


def _sampled(name, value, sample):
    """The part of a result that the reference covers."""
    if sample is None:
        return value
    rows, k_cols, n_cols = sample
    if name == "drhs":
        return value[:, k_cols][:, :, n_cols]
    return value[rows][:, n_cols if name == "out" else k_cols]


def check(problem, results):
    """Compares (out, dlhs, drhs), as float32 NumPy arrays, with the reference.

    Returns (passed, worst relative error, name of the worst result). NaN or Inf (for
    example from rows a kernel left uninitialised) or a wrong shape counts as an infinite
    error.
    """
    worst, worst_name = 0.0, ""
    shapes = {"out": problem.dout.shape, "dlhs": problem.lhs.shape, "drhs": problem.rhs.shape}
    for name, value in zip(("out", "dlhs", "drhs"), results):
        ref = problem.reference[name]
        if np.shape(value) != shapes[name]:
            error = float("inf")
        else:
            with np.errstate(invalid="ignore", over="ignore"):  # garbage may hold Inf
                diff = np.abs(np.asarray(_sampled(name, value, problem.sample), np.float32) - ref)
            error = float(diff.max(initial=0.0)) / max(float(np.abs(ref).max(initial=0.0)), 1.0)
        if not np.isfinite(error):
            error = float("inf")
        if error >= worst:
            worst, worst_name = error, name
    return worst <= TOLERANCE.get(problem.config.dtype, 1e-4), worst, worst_name
