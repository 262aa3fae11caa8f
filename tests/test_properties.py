"""Property-based checks: random shapes and group sizes (zeros likely), both frontends
against the float64 reference, with exact zeros where the contract promises them."""

import numpy as np
import reference as ref
from frontends import frontend  # noqa: F401 - the fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


# The frontend fixture is the same for every example of a test: nothing to reset.
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


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
def test_matches_reference_on_random_problems(frontend, problem):
    lhs, rhs, dout, gs = data(problem)
    check(problem, *frontend.matmul_and_grads(lhs, rhs, gs, dout, offset=problem[5]))
