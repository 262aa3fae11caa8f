"""What one benchmark row times: a contender's forward and forward+backward calls."""

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import kernel_table

GROUPGEMM = "groupgemm"
PER_EXPERT_LOOP = "per-expert loop"
DENSE = "dense GEMM"  # one [M, K] x [K, N] GEMM of the framework: the ceiling for the same FLOPs
# The same dense GEMM through groupgemm (one group holding every row): the ceiling of the
# library groupgemm calls, to tell its kernels' speed from its grouping's cost.
GROUPGEMM_DENSE = "groupgemm dense (one group)"
DENSE_KINDS = (DENSE, GROUPGEMM_DENSE)
RAGGED_DOT = "jax.lax.ragged_dot"
GROUPED_MM = "torch._grouped_mm"
# GROUPGEMM_CUDA_KERNEL's values that hold the sm_90a kernels to one tile: the Hopper kernel
# table's tiles (Hopper only).
SM90_TILES = kernel_table.read().tile_names
# What the benchmark runs on Hopper besides the default (the table's choice per call): the
# 2.x kernels, the sm_90a kernels choosing each call's tile by the table's sm90 column, and
# each tile alone.
HOPPER_FAMILIES = (kernel_table.SM80, kernel_table.SM90_BY_SHAPE, *SM90_TILES)


def set_kernel_family(family):
    """GROUPGEMM_CUDA_KERNEL=family for the calls that follow (the core reads it at every
    call); None or kernel_table.DEFAULT_KERNEL unsets it."""
    if family in (None, kernel_table.DEFAULT_KERNEL):
        os.environ.pop("GROUPGEMM_CUDA_KERNEL", None)
    else:
        os.environ["GROUPGEMM_CUDA_KERNEL"] = family


@contextlib.contextmanager
def kernel_family(family):
    """GROUPGEMM_CUDA_KERNEL=family for the calls inside, then as it was (None: left as it
    is). The core reads it at every call, so a backward must run inside too."""
    before = os.environ.get("GROUPGEMM_CUDA_KERNEL")
    if family is not None:
        set_kernel_family(family)
    try:
        yield
    finally:
        set_kernel_family(before)


def family_contender(family):
    """The benchmark row of groupgemm held to a kernel family: "groupgemm sm90_128x256"."""
    return f"{GROUPGEMM} {family}"


# What a run may leave out (bench.py --skip): where one would take minutes, such as
# ragged_dot's G-fold work or XLA compiling a loop over 128 experts, or what a short run
# measures elsewhere (the GPU kit times each tile per GEMM).
SKIPPABLE = (PER_EXPERT_LOOP, RAGGED_DOT, GROUPED_MM, GROUPGEMM_DENSE, *map(family_contender, HOPPER_FAMILIES))


def is_hopper_contender(name):
    """groupgemm held to a kernel family (those rows exist on Hopper only)."""
    return name in map(family_contender, HOPPER_FAMILIES)


def is_groupgemm_kernel(name):
    """groupgemm's grouped GEMM, on its default kernels or held to a family: a wrong result
    there fails the run."""
    return name == GROUPGEMM or is_hopper_contender(name)


@dataclass
class Contender:
    name: str
    forward: Callable[[], None]  # runs the forward and waits for it
    forward_backward: Callable[[], tuple]  # runs both, waits, returns (out, dlhs, drhs)
    peak_bytes: Callable[[], int | None]  # peak memory of one forward+backward, or None
    xla_temp_bytes: int | None = None  # XLA's planned temporaries (JAX only)
    checked: bool = True  # the dense ceilings compute something else and are not checked
