"""The shared case table: named shapes and group-size patterns used by every test.

Inputs are generated once in NumPy from a fixed seed; every frontend receives the same
values, so results can be compared to one float64 reference and to each other.
"""

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    m: int
    k: int
    n: int
    group_sizes: tuple
    num_groups: int | None = None  # local groups; default len(group_sizes)
    group_offset: int | None = None

    @property
    def g(self):
        return len(self.group_sizes) if self.num_groups is None else self.num_groups

    @property
    def offset(self):
        return self.group_offset or 0


_many = tuple(int(x) for x in np.random.default_rng(7).choice([0, 0, 1, 2, 3, 5], size=128))

CASES = [
    Case("uniform", 24, 16, 8, (6, 6, 6, 6)),
    Case("skewed", 24, 16, 8, (20, 1, 0, 3)),
    Case("first_empty", 24, 16, 8, (0, 8, 8, 8)),
    Case("middle_empty", 24, 16, 8, (8, 0, 8, 8)),
    Case("last_empty", 24, 16, 8, (8, 8, 8, 0)),
    Case("all_empty", 16, 16, 8, (0, 0, 0, 0)),
    Case("no_rows", 0, 16, 8, (0, 0, 0)),
    Case("sum_below_rows", 30, 16, 8, (5, 5, 5)),
    Case("sum_above_rows", 10, 16, 8, (4, 4, 4, 4)),
    Case("negative_size", 12, 16, 8, (5, -3, 4, 2)),
    Case("single_group", 10, 16, 8, (10,)),
    Case("many_groups", sum(_many) + 5, 8, 4, _many),
    Case("window_start", 15, 8, 8, (3, 0, 4, 2, 5, 1), num_groups=2, group_offset=0),
    Case("window_middle", 15, 8, 8, (3, 0, 4, 2, 5, 1), num_groups=2, group_offset=2),
    Case("window_end", 15, 8, 8, (3, 0, 4, 2, 5, 1), num_groups=2, group_offset=4),
    Case("window_past_end", 15, 8, 8, (3, 0, 4, 2, 5, 1), num_groups=2, group_offset=5),
    Case("window_before_start", 15, 8, 8, (3, 0, 4, 2, 5, 1), num_groups=2, group_offset=-1),
    Case("window_outside", 15, 8, 8, (3, 0, 4, 2, 5, 1), num_groups=2, group_offset=9),
    Case("zero_k", 12, 0, 8, (5, 0, 7)),
    Case("zero_n", 12, 16, 0, (5, 0, 7)),
    Case("no_groups", 6, 16, 8, ()),
]

CASE_IDS = [c.name for c in CASES]
_BY_NAME = {c.name: c for c in CASES}


def case(name: str) -> Case:
    """A case of the table, by name."""
    return _BY_NAME[name]


# (with_bias, transpose_rhs) variants every frontend test runs each case in.
VARIANTS = [(False, False), (True, True)]
VARIANT_IDS = ["plain", "bias_transposed"]

# The tests' dtype table: each input dtype, its NumPy type (ml_dtypes for bfloat16) and the
# tolerance of its results relative to their scale. A new dtype is one row here.
DTYPE_TABLE = {
    "float32": (np.float32, 1e-5),
    "bfloat16": (ml_dtypes.bfloat16, 2e-2),
    "float16": (np.float16, 2e-3),
    "float64": (np.float64, 1e-12),
}
DTYPES = list(DTYPE_TABLE)
CUDA_DTYPES = [d for d in DTYPES if d != "float64"]  # float64 is CPU-only
TOLERANCE = {name: tol for name, (_, tol) in DTYPE_TABLE.items()}


def inputs(case: Case, seed: int = 0):
    """float64 NumPy inputs of a case: lhs, rhs [G,K,N], bias, dout, acc, group_sizes."""
    rng = np.random.default_rng(seed)
    return dict(
        lhs=rng.standard_normal((case.m, case.k)),
        rhs=rng.standard_normal((case.g, case.k, case.n)),
        bias=rng.standard_normal((case.g, case.n)),
        dout=rng.standard_normal((case.m, case.n)),
        acc=rng.standard_normal((case.g, case.k, case.n)),
        group_sizes=np.asarray(case.group_sizes, dtype=np.int32),
    )


def round_to(x, dtype_name):
    """Rounds float64 values to dtype_name and back, so references see the same inputs."""
    return np.asarray(x).astype(DTYPE_TABLE[dtype_name][0]).astype(np.float64)


def host_rounded(values, dtype_name):
    """Values for a framework array of dtype_name: floats rounded once, here, by NumPy
    (then every framework's conversion is exact; torch turns float64 into float16 through
    float32, which rounds some values differently), integers as they are."""
    if dtype_name not in DTYPE_TABLE:
        return np.asarray(values, dtype_name)
    return round_to(values, dtype_name)
