"""What one benchmark row times: a contender's forward and forward+backward calls."""

from collections.abc import Callable
from dataclasses import dataclass

GROUPGEMM = "groupgemm"
PER_EXPERT_LOOP = "per-expert loop"
DENSE = "dense GEMM"  # one [M, K] x [K, N] GEMM: the ceiling for the same FLOPs


@dataclass
class Contender:
    name: str
    forward: Callable[[], None]  # runs the forward and waits for it
    forward_backward: Callable[[], tuple]  # runs both, waits, returns (out, dlhs, drhs)
    peak_bytes: Callable[[], int | None]  # peak memory of one forward+backward, or None
    xla_temp_bytes: int | None = None  # XLA's planned temporaries (JAX only)
    checked: bool = True  # the dense ceiling computes something else and is not checked
