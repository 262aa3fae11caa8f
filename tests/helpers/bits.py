"""Raw bits of results from either framework, for the bitwise parity checks."""

import numpy as np

BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def raw_bits(x):
    """The raw bits of an array from either framework, as unsigned integers."""
    if hasattr(x, "element_size"):  # a torch tensor
        import torch

        x = x.detach().cpu()
        return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).numpy().view(
            BITS[x.element_size()])
    x = np.asarray(x)
    return x.view(BITS[x.dtype.itemsize])


def assert_same_bits(a, b, what):
    bits_a, bits_b = raw_bits(a), raw_bits(b)
    assert bits_a.shape == bits_b.shape, what
    assert np.array_equal(bits_a, bits_b), f"{what}: {np.count_nonzero(bits_a != bits_b)} elements differ"


def bf16_ulps(got, want):
    """The largest |got - want| in bfloat16 ulps of want (float64), elementwise."""
    want = np.asarray(want, np.float64)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), np.finfo(np.float32).tiny))) - 7)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / ulp))


def cancelling(rng, shape, axis):
    """Values whose 4 blocks along ``axis`` (one per device of a 4-device mesh) share a large
    component of signs + - + -: each device's part of a sum along it is large, the sum small."""
    sign = np.repeat([1.0, -1.0, 1.0, -1.0], shape[axis] // 4)
    sign = sign[:, None] if axis == 0 else sign[None, :]
    return 100 * sign + rng.standard_normal(shape)
