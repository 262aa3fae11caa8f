"""What one benchmark row times: a contender's forward and forward+backward calls."""

from collections.abc import Callable
from dataclasses import dataclass

GROUPGEMM = "groupgemm"
PER_EXPERT_LOOP = "per-expert loop"
DENSE = "dense GEMM"  # one [M, K] x [K, N] GEMM of the framework: the ceiling for the same FLOPs
# The same dense GEMM through groupgemm (one group holding every row): the ceiling of the
# library groupgemm calls, to tell its kernels' speed from its grouping's cost.
GROUPGEMM_DENSE = "groupgemm dense (one group)"
DENSE_KINDS = (DENSE, GROUPGEMM_DENSE)
RAGGED_DOT = "jax.lax.ragged_dot"
GROUPED_MM = "torch._grouped_mm"
# What a run may leave out (bench.py --skip): where one would take minutes, such as
# ragged_dot's G-fold work or XLA compiling a loop over 128 experts.
SKIPPABLE = (PER_EXPERT_LOOP, RAGGED_DOT, GROUPED_MM, GROUPGEMM_DENSE)


def is_groupgemm_kernel(name):
    """groupgemm's grouped GEMM, on its default kernels or held to one sm90 tile (named
    "groupgemm sm90_..." by torch_contenders): a wrong result there fails the run."""
    return name == GROUPGEMM or name.startswith(f"{GROUPGEMM} sm90")


@dataclass
class Contender:
    name: str
    forward: Callable[[], None]  # runs the forward and waits for it
    forward_backward: Callable[[], tuple]  # runs both, waits, returns (out, dlhs, drhs)
    peak_bytes: Callable[[], int | None]  # peak memory of one forward+backward, or None
    xla_temp_bytes: int | None = None  # XLA's planned temporaries (JAX only)
    checked: bool = True  # the dense ceilings compute something else and are not checked
