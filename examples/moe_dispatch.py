"""Token dispatch for an MoE layer: rows sorted by expert, and per-expert counts that
stay on the device (no host sync, so jit and torch.compile trace straight through).

One function serves JAX and PyTorch arrays; it imports neither framework itself.
"""


def sort_by_expert(expert, num_experts):
    """(order, group_sizes) for a 1-D integer array of expert ids.

    ``order`` sorts the rows by expert, stably (within an expert, by row), and
    ``group_sizes[e]`` counts the rows of expert e. Ids outside ``[0, num_experts)``
    (padding, dropped tokens) sort after every expert and join no group, so they become
    padding rows of the grouped matmul: exact zeros out, no gradient.
    """
    if type(expert).__module__.startswith("torch"):
        import torch

        ids = expert.long()  # index_add's index type, wide enough for num_experts
        ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
        order = torch.sort(ids, stable=True).indices
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert.device)
        return order, counts.index_add(0, ids, torch.ones_like(ids))[:num_experts]
    import jax.numpy as jnp

    ids = jnp.where((expert >= 0) & (expert < num_experts), expert, num_experts)
    order = jnp.argsort(ids, stable=True)
    return order, jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)
