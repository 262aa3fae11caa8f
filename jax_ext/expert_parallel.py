"""Expert parallelism in JAX: token dispatch and combine between the devices of a mesh axis
inside ``jax.shard_map``, and an MoE layer on top (router, dispatch, the grouped expert MLP
of the device's experts, combine).

The mode is capacity: static shapes, one ``jax.jit`` compile for any routing, no host
copy. Rows move by the core's permute and unpermute (exact copies, exact zeros where
nothing is sent) and one of two collectives, chosen when the program is lowered for its
platform (``jax.lax.platform_dependent``): ``jax.lax.ragged_all_to_all``, which sends each
peer only its valid rows into a zeroed buffer of ``capacity`` rows per source, and, on the
CPU, where XLA does not implement it, ``jax.lax.all_to_all`` of the padded chunks. Both
leave the same rows in the same places, so the results are the same bits. Which rows is
groupgemm/_dispatch_plan.py, shared with PyTorch, so both frameworks move the same rows and
compute the same bits.
"""

import dataclasses

import jax
import jax.numpy as jnp

from groupgemm import _contract as contract
from groupgemm import _dispatch_plan as rules
from groupgemm.jax_ext.arguments import as_array, dtype_name, index_input, same_varying_axes, shape_and_dtype
from groupgemm.jax_ext.expert import grouped_mlp, permute, softmax_topk, unpermute
from groupgemm.jax_ext.expert_mlp import expert_mlp, runs_fused
from groupgemm.jax_ext.ffi_calls import mark_varying
from groupgemm.jax_ext.functional import grouped_matmul


class _Ops:
    """The plan's array functions, for jax.numpy."""

    @staticmethod
    def arange(n, like):
        return jnp.arange(n, dtype=jnp.int32)

    where = staticmethod(jnp.where)

    @staticmethod
    def cumsum(x, axis):
        return jnp.cumsum(x, axis, dtype=jnp.int32)

    take = staticmethod(jnp.take)

    @staticmethod
    def int32(x):
        return x.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """What combine needs to send dispatch's rows back: returned by dispatch."""
    row_map: jax.Array  # [T, k]: the weighted sum's: the first permute's, -1 where a slot was past capacity
    received_rows: jax.Array  # [ep * capacity, 1]: where each received row went, sorted by local expert
    return_rows: jax.Array  # [T * k, 1]: the returned row holding each permuted row's result, -1: none
    dropped: jax.Array  # int32 scalar: this device's slots past capacity
    sent: jax.Array  # [ep]: the rows this device sent each peer
    received: jax.Array  # [ep]: the rows it received from each
    axis_name: str = dataclasses.field(metadata=dict(static=True))


def _axis_size(axis_name):
    return jax.lax.axis_size(axis_name) if hasattr(jax.lax, "axis_size") else jax.lax.psum(1, axis_name)


def _exchange(x, axis_name):
    """Chunk r of x's leading axis to device r; chunk s of the result from device s."""
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def _exchange_chunks(rows, starts, sizes, received, *, chunks_of, axis_name, capacity, fn):
    """``[ep * capacity, H]``: chunk s holds the ``received[s]`` rows device s sent this one,
    then zeros. This device sends peer r the ``sizes[r]`` rows of ``rows`` from
    ``starts[r]``; ``chunks_of(rows)`` is the same as ``[ep * capacity, H]`` padded chunks,
    for the all_to_all."""
    def padded(rows, *_):
        return _exchange(chunks_of(rows), axis_name)

    def ragged(rows, starts, sizes, received):
        ep = sizes.shape[0]
        (buffer,) = same_varying_axes((jnp.zeros((ep * capacity, rows.shape[1]), rows.dtype),), (rows,))
        here = jnp.full((ep,), jax.lax.axis_index(axis_name) * capacity, jnp.int32)
        return jax.lax.ragged_all_to_all(rows, buffer, starts, sizes, here, received, axis_name=axis_name)

    # Rows the same on every device (tokens replicated over the axis) are typed as varying
    # first: each device sends its own copy, and both branches then give a varying result.
    rows = mark_varying(rows, (axis_name,))
    try:
        return jax.lax.platform_dependent(rows, starts, sizes, received, cpu=padded, default=ragged)
    except AssertionError as e:  # every branch is traced, and ragged_all_to_all's batching rule asserts
        raise NotImplementedError(
            f"{fn}: jax.vmap is not supported, inside the shard_map or outside it (JAX moves the batch inside): the "
            "GPU exchange, ragged_all_to_all, has no batching rule in JAX; loop over the batch with jax.lax.map, or "
            "fold it into the tokens") from e


def dispatch(tokens, expert_indices, num_experts, *, axis_name, capacity):
    """Sends each (token, slot) to the device holding its expert, inside ``jax.shard_map``
    over ``axis_name``; returns ``(expert_input [ep * capacity, H], group_sizes [E_local],
    plan)``, the rows grouped by local expert as ``grouped_mlp`` takes them.

    ``tokens [T, H]`` and ``expert_indices [T, k]`` are this device's (global expert ids;
    one outside ``[0, num_experts)`` is a dropped slot, as in ``permute``). Device d holds
    experts ``[d * E_local, (d + 1) * E_local)``, ``E_local = num_experts / ep``. Every pair
    of devices exchanges ``capacity`` rows: nothing is dropped when ``capacity`` is at least
    ``T * k`` (``dropless_capacity``); past it, a device's rows for one peer are dropped
    from the last, in permute's order (expert ascending, then slot), and counted in
    ``plan.dropped``. Rows owned by no local expert (padding) are exact zeros. T = 0, a
    device that sends or receives nothing, and idle experts are ordinary input.
    Differentiable: the backward is the reverse exchange.
    """
    fn = "dispatch"
    chunks, receive_experts, plan = _send(tokens, expert_indices, num_experts, axis_name, capacity, fn)
    expert_input, local_sizes, received_rows = permute(chunks, receive_experts, num_experts // plan.sent.shape[0])
    return expert_input, local_sizes, dataclasses.replace(plan, received_rows=received_rows)


def _send(tokens, expert_indices, num_experts, axis_name, capacity, fn):
    """dispatch's exchange: ``(chunks [ep * capacity, H], receive_experts [ep * capacity, 1],
    plan)``, chunk s the rows device s sent this one (then zeros), each row's local expert
    (-1 for padding), the plan without received_rows."""
    ep = _axis_size(axis_name)
    e_local = rules.check(num_experts, ep, capacity, fn, dropless_mode=False)
    tokens, expert_indices = as_array(tokens, "tokens", fn), index_input(expert_indices, "expert_indices", fn)
    rules.check_routing(shape_and_dtype(tokens), shape_and_dtype(expert_indices), num_experts, fn)
    permuted, group_sizes, row_map = permute(tokens, expert_indices, num_experts)
    send_rows, sent, dropped = rules.send_plan(_Ops, group_sizes, ep, capacity)
    received = _exchange(sent, axis_name)  # [source, local expert]
    rows_to, rows_from = sent.sum(1), received.sum(1)
    bound_for = group_sizes.reshape(ep, e_local).sum(1)  # each peer's run of the permuted rows
    chunks = _exchange_chunks(permuted, _Ops.cumsum(bound_for, 0) - bound_for, rows_to, rows_from,
                              chunks_of=lambda rows: unpermute(rows, send_rows), axis_name=axis_name,
                              capacity=capacity, fn=fn)
    return_rows = rules.return_plan(_Ops, group_sizes, ep, capacity, permuted.shape[0])
    return chunks, rules.receive_plan(_Ops, received, capacity), DispatchPlan(
        rules.combine_row_map(_Ops, row_map, return_rows), None, return_rows, dropped, rows_to, rows_from, axis_name)


def combine(expert_output, plan, probs=None):
    """``out [T, H]``: each token's ``sum over j of probs[t, j] * expert_output`` of its slot
    j, accumulated in float32 in slot order (unpermute), from dispatch's ``plan``; a slot
    that was dropped adds nothing. Differentiable."""
    fn = "combine"
    rules.check_plan(plan, DispatchPlan, fn)
    expert_output = as_array(expert_output, "expert_output", fn)
    output = shape_and_dtype(expert_output)
    rules.check_expert_output(output, plan.received_rows.shape[0], fn)
    if probs is not None:
        probs = as_array(probs, "probs", fn)
        rules.check_slot_values(shape_and_dtype(probs), plan.row_map.shape, "probs", fn, output[1])
    return _send_back(unpermute(expert_output, plan.received_rows), plan, probs, fn)


def _send_back(results, plan, probs, fn):
    """combine's exchange, from the results in the chunks' order (chunk s: the rows device s
    sent, then zeros)."""
    ep = plan.sent.shape[0]
    capacity = results.shape[0] // ep
    back = _exchange_chunks(results, jnp.arange(ep, dtype=jnp.int32) * capacity, plan.received, plan.sent,
                            chunks_of=lambda rows: rows, axis_name=plan.axis_name, capacity=capacity, fn=fn)
    return unpermute(unpermute(back, plan.return_rows), plan.row_map, probs)


def dropless_capacity(num_tokens, top_k):
    """The capacity at which dispatch drops nothing, whatever the routing: ``T * k`` (at least
    1, as a capacity must be; T or k of 0 routes nothing)."""
    return rules.dropless_capacity(num_tokens, top_k)


def _check_layer_params(x, router, w_in, w_out, num_experts, e_local, axis_name, activation, transpose_rhs, fn):
    """moe_layer's ``x [T, H]``, ``params["router"] [H, E]`` of x's dtype, and ``params["w_in"]``
    holding this device's E / devices experts, the experts' weights fitting x (grouped_mlp's
    rule, in moe_layer's terms)."""
    contract.check_rank(x.shape, 2, "x", "[T, H]", fn)
    contract.check_rank(router.shape, 2, "params['router']", "[H, E]", fn)
    if router.shape[1] != num_experts:
        raise ValueError(f"{fn}: params['router'] has shape {router.shape}: {router.shape[1]} experts, but "
                         f"num_experts is {num_experts}")
    contract.check_same_dtype(dtype_name(router.dtype), dtype_name(x.dtype), "params['router']", "x", fn)
    contract.check_rank(w_in.shape, 3, "params['w_in']", "[E_local, ...]", fn)
    if w_in.shape[0] != e_local:
        raise ValueError(f"{fn}: params['w_in'] holds {w_in.shape[0]} experts (shape {w_in.shape}), but each device "
                         f"of axis {axis_name!r} holds num_experts / devices = {e_local}")
    contract.grouped_mlp(fn, shape_and_dtype(x), shape_and_dtype(w_in), shape_and_dtype(w_out), activation,
                         contract.static_flag(transpose_rhs, "transpose_rhs", fn),
                         weight_names=("params['w_in']", "params['w_out']"))


def moe_layer(params, x, *, num_experts, top_k, axis_name, capacity, activation="swiglu", transpose_rhs=False,
              allowed=None, fp8=None, fused=None, renormalize=None):
    """An expert-parallel MoE layer inside ``jax.shard_map`` over ``axis_name``: softmax
    top-k router, dispatch, the grouped MLP of this device's experts, combine. Returns
    ``(out [T, H], dropped)``.

    ``params``: ``router [H, E]`` (replicated), ``w_in [E_local, H, F_in]`` and
    ``w_out [E_local, F, H]`` (this device's experts; with ``transpose_rhs`` the torch
    layout ``[E_local, F_in, H]``, ``[E_local, H, F]``). The router's logits are a core
    GEMM (one group of every token), so every step with arithmetic runs in the core and
    PyTorch's ExpertParallelMoE gives the same bits. ``allowed`` (broadcastable to
    ``[T, E]``) bars experts from routing: a token with none allowed goes nowhere.
    ``renormalize``: softmax_topk's; None (the default) renormalizes for top_k > 1 only (a
    top-1 weight renormalized is always 1, and the router would not learn).

    ``fused``: the received rows go through ``expert_mlp`` (grouped by local expert inside
    its GEMMs, a gradient keeping fc1's output only) instead of permute, grouped_mlp and
    unpermute; the same values. None (the default) fuses where that is measured faster,
    on the CPU, and not under ``fp8``.
    """
    fn = "moe_layer"
    e_local = rules.check(num_experts, _axis_size(axis_name), capacity, fn, dropless_mode=False)
    top_k, renormalize = contract.layer_routing(top_k, num_experts, renormalize, fn)
    fused = runs_fused(fused, fp8, fn)
    names = ("router", "w_in", "w_out")
    if not (hasattr(params, "keys") and set(names) <= set(params.keys())):
        got = f"keys {sorted(map(str, params.keys()))}" if hasattr(params, "keys") else type(params).__name__
        raise TypeError(f"{fn}: params must be a dict holding 'router', 'w_in' and 'w_out', got {got}")
    router, w_in, w_out = (as_array(params[name], f"params['{name}']", fn) for name in names)
    x, allowed = as_array(x, "x", fn), as_array(allowed, "allowed", fn, optional=True)
    _check_layer_params(x, router, w_in, w_out, num_experts, e_local, axis_name, activation, transpose_rhs, fn)
    contract.layer_input(shape_and_dtype(x), router.shape[0], None if allowed is None else shape_and_dtype(allowed),
                         (x.shape[0], num_experts), fn)
    logits = grouped_matmul(x, router[None], jnp.full((1,), x.shape[0], jnp.int32))
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    probs, experts = softmax_topk(logits, top_k, renormalize=renormalize)
    if fused:
        chunks, receive_experts, plan = _send(x, experts, num_experts, axis_name, capacity, fn)
        results = expert_mlp(chunks, receive_experts, None, params["w_in"], params["w_out"], activation=activation,
                             transpose_rhs=transpose_rhs, fp8=fp8)
        return _send_back(results, plan, probs, fn), plan.dropped
    expert_input, group_sizes, plan = dispatch(x, experts, num_experts, axis_name=axis_name, capacity=capacity)
    y = grouped_mlp(expert_input, params["w_in"], params["w_out"], group_sizes, activation=activation,
                    transpose_rhs=transpose_rhs, fp8=fp8)
    return combine(y, plan, probs), plan.dropped
