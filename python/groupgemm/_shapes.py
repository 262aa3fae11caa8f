"""The shape contract of the grouped GEMMs, checked by both frontends before any kernel.

Shapes only (tuples of ints), so one message serves JAX and PyTorch alike; dtype and
device checks stay with each frontend. ``fn`` names the public function in the message.
"""


def check_rank(shape, rank, name, layout, fn):
    if len(shape) != rank:
        raise ValueError(f"{fn}: {name} must be {rank}-D {layout}, got shape {tuple(shape)}")


def check_shape(shape, want, name, fn):
    if tuple(shape) != tuple(want):
        raise ValueError(f"{fn}: {name} must have shape {tuple(want)}, got {tuple(shape)}")


def weight_layout(transpose):
    return "[G, N, K]" if transpose else "[G, K, N]"


def groups_and_columns(lhs_shape, rhs_shape, transpose, names, fn):
    """(G, N) of ``lhs [M, K] @ rhs [G, K, N]`` (``[G, N, K]`` when ``transpose``); raises
    if K differs. ``names`` are the caller's names for lhs, rhs and the transpose flag."""
    lhs, rhs, flag = names
    k_axis = 2 if transpose else 1
    if rhs_shape[k_axis] != lhs_shape[1]:
        raise ValueError(f"{fn}: {rhs} shape {tuple(rhs_shape)} does not contract with {lhs} shape "
                         f"{tuple(lhs_shape)} ({flag}={transpose})")
    return rhs_shape[0], rhs_shape[3 - k_axis]
