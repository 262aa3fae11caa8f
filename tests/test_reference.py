"""The tests' own comparison (helpers/reference.py): it fails where a result is wrong."""

import numpy as np
import pytest
import reference as ref


@pytest.mark.parametrize("actual", [np.zeros((16, 1)), 0.0, np.zeros((4, 16)), np.zeros((8, 16, 4))],
                         ids=["column", "scalar", "missing_axis", "axes_swapped"])
def test_assert_close_refuses_an_array_of_another_shape_that_would_broadcast(actual):
    # Each of these broadcasts against the expected zeros, and every value is equal.
    with pytest.raises(AssertionError, match="shape"):
        ref.assert_close(actual, np.zeros((4, 16, 8)), "float32", "planted")


def test_assert_close_refuses_a_value_past_the_tolerance_and_accepts_rounding():
    expected = np.linspace(-2, 2, 12).reshape(3, 4)
    ref.assert_close(expected.astype(np.float32), expected, "float32")
    with pytest.raises(AssertionError, match="max error"):
        ref.assert_close(expected + 1e-2, expected, "float32", "planted")
