"""Property-based checks: random shapes and group sizes (zeros likely), both frontends
against the float64 reference, with exact zeros where the contract promises them."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import groupgemm.jax as gj
import groupgemm.torch as gt
import reference as ref

sizes_st = st.lists(st.one_of(st.just(0), st.integers(-2, 12)), min_size=0, max_size=7)


@st.composite
def problems(draw):
    sizes = draw(sizes_st)
    m = draw(st.integers(0, max(0, sum(max(s, 0) for s in sizes)) + 6))
    k, n = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    if sizes and draw(st.booleans()):  # an expert-parallel window
        num_local = draw(st.integers(1, len(sizes)))
        offset = draw(st.integers(-2, len(sizes) + 1))
    else:
        num_local, offset = len(sizes), None
    seed = draw(st.integers(0, 2**16))
    return sizes, m, k, n, num_local, offset, seed


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def data(problem):
    sizes, m, k, n, g, offset, seed = problem
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((g, k, n)).astype(np.float32),
            rng.standard_normal((m, n)).astype(np.float32), np.asarray(sizes, np.int32))


def check(problem, out, dlhs, drhs):
    sizes, m, k, n, g, offset, _ = problem
    lhs, rhs, dout, gs = data(problem)
    off = offset or 0
    ref.assert_close(out, ref.grouped_matmul(lhs, rhs, gs, group_offset=off), "float32", "out")
    ref.assert_close(dlhs, ref.grouped_matmul(dout, rhs, gs, None, True, off), "float32", "dlhs")
    ref.assert_close(drhs, ref.grouped_matmul_wgrad(lhs, dout, gs, g, off), "float32", "drhs")
    pad = ref.padding_rows(gs, m, g, off)
    assert (out[pad] == 0).all() and (dlhs[pad] == 0).all()
    for e in ref.empty_groups(gs, m, g, off):
        assert (drhs[e] == 0).all()


@SETTINGS
@given(problems())
def test_jax_matches_reference_on_random_problems(problem):
    lhs, rhs, dout, gs = data(problem)
    offset = problem[5]
    out, vjp = jax.vjp(lambda l, r: gj.grouped_matmul(
        l, r, jnp.asarray(gs), group_offset=None if offset is None else jnp.int32(offset)),
        jnp.asarray(lhs), jnp.asarray(rhs))
    dlhs, drhs = vjp(jnp.asarray(dout))
    check(problem, np.asarray(out), np.asarray(dlhs), np.asarray(drhs))


@SETTINGS
@given(problems())
def test_torch_matches_reference_on_random_problems(problem):
    lhs, rhs, dout, gs = data(problem)
    offset = problem[5]
    lhs_t = torch.from_numpy(lhs).requires_grad_()
    rhs_t = torch.from_numpy(rhs).requires_grad_()
    out = gt.grouped_mm(lhs_t, rhs_t, torch.from_numpy(gs), group_offset=offset)
    out.backward(torch.from_numpy(dout))
    check(problem, out.detach().numpy(), lhs_t.grad.numpy(), rhs_t.grad.numpy())
