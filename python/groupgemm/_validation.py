"""Eager validation of group sizes.

The kernels never read group sizes on the host (that would stall the device and break
CUDA graphs), so they clamp instead of raising: a negative size counts as 0 and rows
past ``num_rows`` are not owned. Call this helper in eager code to turn such input
into an error instead.
"""

import numpy as np

from groupgemm import _contract as contract


def check_group_sizes(group_sizes, num_rows: int) -> None:
    """Raises ``ValueError`` if any size is negative or they sum to more than ``num_rows``.

    ``group_sizes`` may be any array (NumPy, JAX, PyTorch, list); this copies it to the
    host, so keep it out of jitted or captured code.
    """
    if hasattr(group_sizes, "detach"):  # torch tensors, possibly on a device
        group_sizes = group_sizes.detach().cpu()
    fn = "check_group_sizes"
    # An empty list holds no integer for NumPy to infer its dtype from: it has none.
    sizes = np.asarray(group_sizes, np.int64) if isinstance(group_sizes, (list, tuple)) and not group_sizes \
        else np.asarray(group_sizes)
    if sizes.ndim != 1:
        raise ValueError(f"{fn}: group_sizes must be 1-D, got shape {sizes.shape}")
    contract.check_index_dtype(sizes.dtype.name, "group_sizes", fn)
    negative = np.flatnonzero(sizes < 0)
    if negative.size:
        g = int(negative[0])
        raise ValueError(f"{fn}: group_sizes[{g}] = {int(sizes[g])} is negative")
    total = sum(int(s) for s in sizes)  # Python ints: no wrap-around for any integer dtype
    if total > num_rows:
        raise ValueError(f"{fn}: group_sizes sum to {total}, more than num_rows = {num_rows}")
