"""Expert-parallel token dispatch, written once for both frameworks: where each routed
slot goes between the ranks of an expert-parallel group, as integer index arithmetic on
the device (no host copy). The frontends (groupgemm.jax.dispatch, groupgemm.torch.dispatch)
move the rows with the core's permute and unpermute (exact copies, zero rows where nothing
is sent) and the framework's own all-to-all; these functions only say which rows.

The layout. Rank r of ``ep`` holds global experts ``[r * E_local, (r + 1) * E_local)``.
``permute`` sorts a rank's slots by global expert, so the rows bound for rank r are one
contiguous run of the permuted rows. In capacity mode every (source, destination) pair
exchanges a chunk of exactly ``capacity`` rows: the first rows of the run, in permute's
order (expert ascending, then slot ``t * k + j`` ascending), then zero padding. Rows past
``capacity`` are dropped: the last rows of the run, so the highest local experts' latest
slots go first. A receiving rank sees the chunks source after source; sorted by its local
expert (permute again), each expert's rows come source after source, each source's in its
slot order: on tokens split over the ranks in order, the order a single process gives the
same expert.

Every function takes ``ops``, the frontend's few array functions on int32 arrays:
``arange(n, like)``, ``where(c, a, b)``, ``cumsum(x, axis)``, ``take(x, index)`` (a 1-D
gather) and ``int32(x)``; the rest are operators both frameworks share.
"""

from groupgemm import _contract as contract


def check(num_experts, ep_size, capacity, fn, *, dropless_mode=True):
    """E_local, the experts per rank; ValueError naming the argument for a num_experts the
    group does not divide, or a capacity that is not a positive int (None: dropless, where
    the frontend has that mode: ``dropless_mode``)."""
    if not contract.is_static_int(num_experts) or num_experts < 1:
        raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % ep_size:
        raise ValueError(f"{fn}: num_experts = {num_experts} is not a multiple of the expert-parallel group's "
                         f"{ep_size} ranks: each rank holds the same number of experts")
    if capacity is None and not dropless_mode:
        raise ValueError(f"{fn}: capacity must be a positive int (rows per sender and receiver), got None: "
                         "capacity is the only mode here (static shapes); dropless_capacity(T, k) drops nothing")
    if capacity is not None and (not contract.is_static_int(capacity) or capacity < 1):
        raise ValueError(f"{fn}: capacity must be a positive int (rows per sender and receiver), got {capacity!r}")
    return int(num_experts) // ep_size


def check_routing(tokens, expert_indices, num_experts, fn):
    """dispatch's ``tokens [T, H]`` and ``expert_indices [T, k]``, as (shape, dtype name)
    pairs, checked in dispatch's terms before any permute sees them."""
    contract.permute(fn, tokens, expert_indices, num_experts)


def check_slot_values(values, expert_indices_shape, name, fn, value_dtype=None):
    """A per-slot operand (probs): ``[T, k]`` as dispatch's expert_indices, a float dtype
    (with ``value_dtype``, that of the values it weights or float32); a tensor of the same
    size in another shape (``probs.t()``) would pair rows with other slots' values."""
    shape, dtype = values
    contract.check_float(dtype, name, fn)
    contract.check_shape(shape, expert_indices_shape, name, fn)
    if value_dtype is not None:
        contract.check_probs_dtype(dtype, value_dtype, "expert_output", fn, name)


def check_plan(plan, plan_type, fn):
    """``plan``: the plan dispatch returned (a DispatchPlan of the caller's framework)."""
    if not isinstance(plan, plan_type):
        raise TypeError(f"{fn}: plan must be the DispatchPlan that dispatch returned, got {type(plan).__name__}")


def check_expert_output(expert_output, rows, fn):
    """combine's ``expert_output``: one row for each row of dispatch's ``expert_input``, in
    its order (a row more or less would leave slots without their result)."""
    shape, dtype = expert_output
    contract.check_float(dtype, "expert_output", fn)
    contract.check_rank(shape, 2, "expert_output", "[rows of expert_input, H]", fn)
    if shape[0] != rows:
        raise ValueError(f"{fn}: expert_output has {shape[0]} rows, but dispatch gave this plan {rows} rows of "
                         "expert_input: the expert output must keep expert_input's rows, in its order")


def disagreement(values_by_rank, names, fn):
    """The ValueError for ranks whose configurations differ (``values_by_rank[r]``: rank r's
    value of each of ``names``), naming the first argument they disagree on and every
    rank's value; None when they agree."""
    for i, name in enumerate(names):
        values = [v[i] for v in values_by_rank]
        if any(v != values[0] for v in values):
            each = ", ".join(f"rank {r} has {v}" for r, v in enumerate(values))
            return ValueError(f"{fn}: the ranks of the expert-parallel group disagree on {name} ({each}); every "
                              "rank must dispatch with the same num_experts, capacity (mode), hidden size and dtype")
    return None


def dropless_capacity(num_tokens, top_k):
    """The capacity that drops nothing whatever the routing: every slot of a rank to one peer
    (at least 1, as a capacity must be)."""
    fn = "dropless_capacity"
    return max(1, contract.static_count(num_tokens, "num_tokens", fn) * contract.static_count(top_k, "top_k", fn))


def _exclusive(ops, x, axis):
    return ops.cumsum(x, axis) - x


def send_plan(ops, group_sizes, ep_size, capacity):
    """What a rank sends, from its permute's ``group_sizes [E]`` (int32):

    - ``send_rows [ep * capacity, 1]``: for each row of the send buffer (chunk r, row c)
      the permuted row it copies, -1 for padding (unpermute's row map);
    - ``sent [ep, E_local]``: the rows sent of each (destination, local expert);
    - ``dropped``: the slots past capacity, an int32 scalar (torch would sum to int64).
    """
    per_rank = group_sizes.reshape(ep_size, -1)
    counts = per_rank.sum(1)  # rows bound for each rank
    start = _exclusive(ops, counts, 0)  # where each rank's run begins in the permuted rows
    before = _exclusive(ops, per_rank, 1)  # rows of the same run before each local expert
    room = ops.where(capacity - before > 0, capacity - before, 0)
    sent = ops.where(per_rank < room, per_rank, room)
    kept = sent.sum(1)
    c = ops.arange(capacity, group_sizes)[None, :]
    send_rows = ops.where(c < kept[:, None], start[:, None] + c, -1)
    return ops.int32(send_rows.reshape(-1, 1)), sent, ops.int32((counts - kept).sum())


def receive_plan(ops, received, capacity):
    """The local expert of each received row, from ``received [ep, E_local]`` (the rows each
    source sent each local expert): ``[ep * capacity, 1]``, -1 for padding (permute's
    expert_indices: it then sorts the rows by local expert, padding last as zero rows)."""
    ends = ops.cumsum(received, 1)  # [ep, E_local]: each expert's rows end here in its source's chunk
    c = ops.arange(capacity, received)[None, :, None]
    expert = (c >= ends[:, None, :]).sum(2)  # how many of the source's experts end at or before row c
    return ops.int32(ops.where(c[:, :, 0] < ends[:, -1:], expert, -1).reshape(-1, 1))


def return_plan(ops, group_sizes, ep_size, capacity, num_rows):
    """Where each of a rank's ``num_rows`` permuted rows comes back from: the row of the
    returned chunks ``[ep * capacity]`` (chunk r, row c) that holds its result, -1 for a row
    that was not sent (a dropped slot, or past capacity): ``[num_rows, 1]``."""
    per_rank = group_sizes.reshape(ep_size, -1)
    counts = per_rank.sum(1)
    ends = ops.cumsum(counts, 0)
    start = ends - counts
    p = ops.arange(num_rows, group_sizes)[:, None]
    rank = (p >= ends[None, :]).sum(1)  # the run each row belongs to (ep: a dropped slot's row)
    clipped = ops.where(rank < ep_size, rank, 0)
    offset = p[:, 0] - ops.take(start, clipped)
    sent = (rank < ep_size) & (offset < capacity)
    return ops.int32(ops.where(sent, clipped * capacity + offset, -1).reshape(-1, 1))


def combine_row_map(ops, row_map, return_rows):
    """The weighted sum's ``row_map [T, k]`` after a capacity exchange: permute's, with -1
    (a dropped slot) where the slot's row was not sent (``return_plan``'s -1). The row it
    names is zeros, but a slot weight that is NaN or infinite times zero is NaN: a dropped
    slot must add nothing, whatever its weight."""
    if return_rows.shape[0] == 0:  # no slot (T = 0): nothing to take from
        return row_map
    named = ops.where(row_map >= 0, row_map, 0)
    sent = ops.take(return_rows[:, 0], named) >= 0
    return ops.int32(ops.where((row_map >= 0) & sent, row_map, -1))
