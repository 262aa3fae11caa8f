"""Float64 NumPy reference of DESIGN.md §2, written independently of the core."""

import numpy as np
from cases import TOLERANCE


def local_group_rows(group_sizes, num_rows, num_local, group_offset=0):
    """[(begin, end)] per local group: clamped sizes, exclusive cumsum, clipped to num_rows."""
    sizes = np.maximum(np.asarray(group_sizes, dtype=np.int64), 0)
    ends = np.minimum(np.cumsum(sizes), num_rows)
    starts = np.concatenate([[0], ends[:-1]]) if len(sizes) else ends
    rows = []
    for local in range(num_local):
        g = group_offset + local
        rows.append((int(starts[g]), int(ends[g])) if 0 <= g < len(sizes) else (0, 0))
    return rows


def grouped_matmul(lhs, rhs, group_sizes, bias=None, transpose_rhs=False, group_offset=0):
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = rhs.transpose(0, 2, 1)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    for g, (b, e) in enumerate(local_group_rows(group_sizes, lhs.shape[0], rhs.shape[0], group_offset)):
        if e > b:
            out[b:e] = lhs[b:e] @ rhs[g]
            if bias is not None:
                out[b:e] += np.asarray(bias, np.float64)[g]
    return out


def grouped_matmul_wgrad(lhs, grad, group_sizes, num_groups, group_offset=0, accumulate_into=None):
    lhs = np.asarray(lhs, np.float64)
    grad = np.asarray(grad, np.float64)
    out = np.zeros((num_groups, lhs.shape[1], grad.shape[1]))
    if accumulate_into is not None:
        out += np.asarray(accumulate_into, np.float64)
    for g, (b, e) in enumerate(local_group_rows(group_sizes, lhs.shape[0], num_groups, group_offset)):
        out[g] += lhs[b:e].T @ grad[b:e]
    return out


def grouped_bias_grad(grad, group_sizes, num_groups, group_offset=0):
    grad = np.asarray(grad, np.float64)
    out = np.zeros((num_groups, grad.shape[1]))
    for g, (b, e) in enumerate(local_group_rows(group_sizes, grad.shape[0], num_groups, group_offset)):
        out[g] = grad[b:e].sum(axis=0)
    return out


def padding_rows(group_sizes, num_rows, num_local, group_offset=0):
    """Boolean mask of rows owned by no local group."""
    owned = np.zeros(num_rows, bool)
    for b, e in local_group_rows(group_sizes, num_rows, num_local, group_offset):
        owned[b:e] = True
    return ~owned


def empty_groups(group_sizes, num_rows, num_local, group_offset=0):
    return [g for g, (b, e) in enumerate(local_group_rows(group_sizes, num_rows, num_local, group_offset))
            if e == b]


def assert_close(actual, expected, dtype_name, what=""):
    """actual has expected's shape (no broadcasting) and is within the dtype's tolerance."""
    actual = np.asarray(actual, np.float64)
    assert actual.shape == np.shape(expected), f"{what}: shape {actual.shape}, expected {np.shape(expected)}"
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    err = float(np.abs(actual - expected).max(initial=0.0))
    assert err <= TOLERANCE[dtype_name] * scale, f"{what}: max error {err} (scale {scale}, {dtype_name})"
