"""Expert parallelism in PyTorch: token dispatch and combine between the ranks of a
``torch.distributed`` process group, and an MoE layer on top (router, dispatch, the
grouped expert MLP of the rank's experts, combine).

Rows move by the core's permute and unpermute (exact copies, exact zeros where nothing is
sent) and torch's functional all-to-all (``torch.distributed._functional_collectives``,
differentiable and traceable by torch.compile); which rows is groupgemm/_dispatch_plan.py,
shared with JAX, so both frameworks move the same rows and compute the same bits. Two modes:

- capacity (``capacity=int``): every pair of ranks exchanges ``capacity`` rows; static
  shapes, no host copy, CUDA-graph and ``torch.compile(fullgraph=True)`` friendly;
- dropless (``capacity=None``): each rank sends exactly its rows; the split sizes the
  collective takes are Python ints, so each dispatch copies its counts to the host once
  (the sync Megatron's dropless all-to-all dispatcher makes), and cannot be compiled.

The ranks must agree on the configuration (num_experts, capacity, hidden size, dtype): the
collectives' sizes follow from it. dispatch checks that once per (group, configuration),
with one all-gather of four integers and a host copy, and caches the answer.
"""

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as collectives
from torch import Tensor, nn
from torch.autograd import forward_ad

from groupgemm import _contract as contract
from groupgemm import _dispatch_plan as rules
from groupgemm.torch_ext import autocast, expert, expert_parallel_sharding
from groupgemm.torch_ext.arguments import dtype_name, shape_and_dtype
from groupgemm.torch_ext.functional import grouped_mm
from groupgemm.torch_ext.module import GroupedMLP


class _Ops:
    """The plan's array functions, for torch."""

    @staticmethod
    def arange(n, like):
        return torch.arange(n, dtype=torch.int32, device=like.device)

    where = staticmethod(torch.where)

    @staticmethod
    def cumsum(x, axis):
        return torch.cumsum(x, axis, dtype=torch.int32)

    @staticmethod
    def take(x, index):
        return x[index]

    @staticmethod
    def int32(x):
        return x.to(torch.int32)


@dataclasses.dataclass
class DispatchPlan:
    """What combine needs to send dispatch's rows back, and dispatch_probs to send more
    per-slot values the same way: returned by dispatch."""
    expert_indices: Tensor  # [T, k]: dispatch's
    num_experts: int
    row_map: Tensor  # [T, k]: the weighted sum's: the first permute's, -1 where a slot was past capacity
    receive_experts: Tensor  # [received rows, 1]: the local expert of each received row, -1 padding
    send_rows: Tensor | None  # capacity: [ep * capacity, 1], the permuted row of each sent row, -1 padding
    return_rows: Tensor | None  # capacity: [T * k, 1], the returned row of each permuted row, -1: none
    dropped: Tensor  # int32 scalar: this rank's slots past capacity (0 when dropless)
    group: dist.ProcessGroup
    splits: "_Splits | None" = None  # dropless: the rows exchanged with each peer
    received_rows: Tensor | None = None  # where each received row went, sorted by local expert


def _check_no_torch_func(fn) -> None:
    """Refuses torch.func's grad-like transforms and vmap around the exchange (forward mode is
    refused in _exchange): torch's all_to_all is an autograd.Function without torch.func
    support (grad, vjp and jacrev failed inside torch, naming nothing of this call) and has
    no batching rule (vmap's fallback gave wrong rows, silently, in capacity mode; dropless
    mode failed copying batched counts to the host)."""
    if torch.compiler.is_compiling():  # Dynamo cannot trace the interpreter stack: a compiled call goes unchecked
        return
    TransformType = torch._C._functorch.TransformType
    active = {interpreter.key() for interpreter in torch._C._functorch.get_interpreter_stack() or ()}
    if TransformType.Grad in active:
        raise NotImplementedError(f"{fn}: torch.func's grad, vjp and jacrev are not supported: torch's all_to_all, "
                                  "which exchanges the rows, has no torch.func rule; use torch.autograd "
                                  "(loss.backward() or torch.autograd.grad)")
    if TransformType.Vmap in active:
        raise NotImplementedError(f"{fn}: torch.func.vmap is not supported: torch's all_to_all, which exchanges the "
                                  "rows, has no batching rule; loop over the batch, or fold it into the tokens")


def _exchange(x: Tensor, group, send=None, receive=None) -> Tensor:
    """Chunk r of x's rows to rank r (equal chunks, or ``send[r]`` rows), chunk s of the
    result from rank s; differentiable in reverse mode."""
    # torch's all_to_all has no forward-mode formula and drops a tangent without an error.
    if forward_ad._current_level >= 0 and forward_ad.unpack_dual(x).tangent is not None:
        raise NotImplementedError("dispatch / combine / dispatch_probs (and ExpertParallelMoE): forward-mode "
                                  "derivatives (jvp) are not supported: torch's all_to_all, which exchanges the rows, "
                                  "drops the tangent; use reverse mode")
    return collectives.wait_tensor(collectives.all_to_all_single_autograd(x, receive, send, group))


def _exchange_counts(counts: Tensor, group) -> Tensor:
    return collectives.wait_tensor(collectives.all_to_all_single(counts.contiguous(), None, None, group))


def dispatch(tokens: Tensor, expert_indices: Tensor, num_experts: int, group=None, *,
             capacity: int | None = None) -> tuple[Tensor, Tensor, DispatchPlan]:
    """Sends each (token, slot) to the rank holding its expert; returns
    ``(expert_input, group_sizes [E_local], plan)``, the rows grouped by local expert as
    ``GroupedMLP`` takes them.

    ``tokens [T, H]`` and ``expert_indices [T, k]`` are this rank's (global expert ids; one
    outside ``[0, num_experts)`` is a dropped slot, as in ``permute``). ``group`` (default
    the world) is the expert-parallel group; rank r holds experts
    ``[r * E_local, (r + 1) * E_local)``, ``E_local = num_experts / group size``.

    ``capacity=int``: every pair of ranks exchanges ``capacity`` rows, ``expert_input`` is
    ``[ep * capacity, H]`` with zero padding rows last; nothing is dropped when capacity is
    at least ``T * k`` (``dropless_capacity``), past it a rank's rows for one peer are
    dropped from the last, in permute's order (expert ascending, then slot), and counted in
    ``plan.dropped``. No host copy. ``capacity=None``: dropless, ``expert_input`` holds
    exactly the received rows; this copies the token counts to the host once (the split
    sizes of ``all_to_all_single`` are Python ints). Either way T = 0, a rank that sends or
    receives nothing, and idle experts are ordinary input, and every rank takes part in
    each collective. Differentiable: the backward is the reverse exchange.
    """
    arrived, plan = _send(tokens, expert_indices, num_experts, group, capacity, "dispatch")
    expert_input, local_sizes, plan.received_rows = expert.permute(arrived, plan.receive_experts,
                                                                   num_experts // dist.get_world_size(plan.group))
    return expert_input, local_sizes, plan


def _send(tokens, expert_indices, num_experts, group, capacity, fn) -> tuple[Tensor, DispatchPlan]:
    """dispatch's exchange: the rows this rank received, in the order they arrived
    (plan.receive_experts gives each its local expert, -1 for padding), and the plan
    without received_rows."""
    _check_no_torch_func(fn)
    group = group or dist.group.WORLD
    ep = _group_size(group, fn)
    e_local = rules.check(num_experts, ep, capacity, fn)
    rules.check_routing(shape_and_dtype(tokens, "tokens", fn), shape_and_dtype(expert_indices, "expert_indices", fn),
                        num_experts, fn)
    if capacity is None and torch.compiler.is_compiling():
        raise RuntimeError(f"{fn}: dropless mode (capacity=None) copies the token counts to the host, which a "
                           "compiled graph cannot; compile capacity mode (capacity=int, no host copy; "
                           "dropless_capacity(T, k) drops nothing)")
    _check_ranks_agree(group, tokens, num_experts, capacity, fn)
    permuted, group_sizes, row_map = expert.permute(tokens, expert_indices, num_experts)
    if capacity is None:
        sent_counts = group_sizes.reshape(ep, e_local)
        received = _exchange_counts(sent_counts.reshape(-1), group).reshape(ep, e_local)
        counts = torch.cat([sent_counts.sum(1), received.sum(1)]).tolist()  # the one host copy of a dispatch
        splits = _Splits(tuple(counts[:ep]), tuple(counts[ep:]), dist.get_rank(group))
        local_expert = torch.arange(e_local, dtype=torch.int32, device=permuted.device).repeat(ep)
        receive_experts = local_expert.repeat_interleave(received.reshape(-1), output_size=sum(splits.receive))
        nothing = torch.zeros((), dtype=torch.int32, device=permuted.device)
        plan = DispatchPlan(expert_indices, num_experts, row_map, receive_experts[:, None], None, None, nothing,
                            group, splits)
    else:
        send_rows, sent, dropped = rules.send_plan(_Ops, group_sizes, ep, capacity)
        received = _exchange_counts(sent.reshape(-1), group).reshape(ep, e_local)
        return_rows = rules.return_plan(_Ops, group_sizes, ep, capacity, permuted.shape[0])
        plan = DispatchPlan(expert_indices, num_experts, rules.combine_row_map(_Ops, row_map, return_rows),
                            rules.receive_plan(_Ops, received, capacity), send_rows, return_rows, dropped, group)
    return _arrive(permuted, plan), plan


def _group_size(group, fn) -> int:
    """The expert-parallel group's size; a process outside the group has none."""
    if dist.get_rank(group) < 0:
        raise ValueError(f"{fn}: this process (global rank {dist.get_rank()}) is not a member of group; only the "
                         "group's ranks take part in its exchanges")
    return dist.get_world_size(group)


_CONFIGURATION = ("num_experts", "capacity", "the hidden size H", "the dtype")
_agreed = set()  # (group, configuration) pairs every rank of the group has been seen to use


def _check_ranks_agree(group, tokens: Tensor, num_experts: int, capacity, fn) -> None:
    """Every rank of ``group`` dispatches with the same configuration, or each raises the
    same ValueError naming what differs. A difference would otherwise make the
    collectives' sizes differ (an abort inside the backend, or counts read half-written).
    The check costs one all-gather of four integers and a host copy, once per (group,
    configuration); it is skipped where a host copy cannot run (while torch.compile traces,
    or a CUDA graph captures), so an eager step checks before those."""
    if torch.compiler.is_compiling():  # first: a traced look into _agreed would guard on it (a recompile later)
        return
    configuration = (num_experts, capacity, tokens.shape[1], dtype_name(tokens.dtype))
    capturing = tokens.is_cuda and torch.cuda.is_current_stream_capturing()
    if (group, configuration) in _agreed or capturing:
        return
    codes = torch.tensor([num_experts, -1 if capacity is None else capacity, tokens.shape[1],
                          contract.FLOAT_DTYPES.index(configuration[3])], dtype=torch.int64, device=tokens.device)
    gathered = [torch.empty_like(codes) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, codes, group)
    by_rank = [(e, None if c < 0 else c, h, contract.FLOAT_DTYPES[d]) for e, c, h, d in torch.stack(gathered).tolist()]
    error = rules.disagreement(by_rank, _CONFIGURATION, fn)
    if error is not None:
        raise error
    _agreed.add((group, configuration))


def _arrive(permuted: Tensor, plan: DispatchPlan) -> Tensor:
    """Rows in permute's order on this rank -> the rows its peers receive, in the order they arrive."""
    if plan.splits is None:
        return _exchange(expert.unpermute(permuted, plan.send_rows), plan.group)
    return plan.splits.forward(permuted[:sum(plan.splits.send)], plan.group)  # the slots kept come first


def _to_experts(permuted: Tensor, plan: DispatchPlan) -> tuple[Tensor, Tensor, Tensor]:
    """Rows in permute's order on this rank -> the rows its peers' experts receive, grouped
    by local expert: permute's three results on the received rows."""
    e_local = plan.num_experts // dist.get_world_size(plan.group)
    return expert.permute(_arrive(permuted, plan), plan.receive_experts, e_local)


def dispatch_probs(probs: Tensor, plan: DispatchPlan) -> Tensor:
    """``probs [T, k]`` (one value per slot) sent where dispatch sent the slots' rows:
    ``[rows of expert_input]``, 0 on padding rows; for experts that weight their own rows
    (Megatron-core's take the probs with the rows). One more all-to-all, of one column;
    no host copy. Differentiable in ``probs``."""
    fn = "dispatch_probs"
    _check_no_torch_func(fn)
    rules.check_plan(plan, DispatchPlan, fn)
    rules.check_slot_values(shape_and_dtype(probs, "probs", fn), tuple(plan.expert_indices.shape), "probs", fn)
    slots = probs.reshape(-1, 1)
    permuted, _, _ = expert.permute(slots, plan.expert_indices.reshape(-1, 1), plan.num_experts)
    return _to_experts(permuted, plan)[0][:, 0]


@dataclasses.dataclass(frozen=True)
class _Splits:
    """A dropless exchange's rows per peer (Python ints). Where a rank's send or receive
    buffer would be empty, it also sends itself one zero row, dropped on arrival: the
    collective then never sees a zero-size buffer (which has hung all_to_all_single on some
    backends), and no peer's sizes change."""
    send: tuple
    receive: tuple
    rank: int

    @property
    def spare(self):
        return sum(self.send) == 0 or sum(self.receive) == 0

    def _sizes(self, counts):
        return [c + int(self.spare and r == self.rank) for r, c in enumerate(counts)]

    def _end_of_own_chunk(self, counts):
        return sum(counts[:self.rank + 1])

    def _exchange(self, x, group, send, receive):
        if self.spare:
            at = self._end_of_own_chunk(send)
            x = torch.cat([x[:at], x.new_zeros((1, x.shape[1])), x[at:]])
        y = _exchange(x, group, self._sizes(send), self._sizes(receive))
        if self.spare:
            at = self._end_of_own_chunk(receive)
            y = torch.cat([y[:at], y[at + 1:]])
        return y

    def forward(self, x, group):
        return self._exchange(x, group, self.send, self.receive)

    def backward(self, x, group):
        return self._exchange(x, group, self.receive, self.send)


def combine(expert_output: Tensor, plan: DispatchPlan, probs: Tensor | None = None) -> Tensor:
    """``out [T, H]``: each token's ``sum over j of probs[t, j] * expert_output`` of its slot
    j, accumulated in float32 in slot order (unpermute), from dispatch's ``plan``; a slot
    that was dropped adds nothing. Differentiable."""
    fn = "combine"
    _check_no_torch_func(fn)
    rules.check_plan(plan, DispatchPlan, fn)
    output = shape_and_dtype(expert_output, "expert_output", fn)
    rules.check_expert_output(output, plan.received_rows.shape[0], fn)
    if probs is not None:
        rules.check_slot_values(shape_and_dtype(probs, "probs", fn), tuple(plan.row_map.shape), "probs", fn,
                                output[1])
    return _send_back(expert.unpermute(expert_output, plan.received_rows), plan, probs)


def _send_back(back_local: Tensor, plan: DispatchPlan, probs: Tensor | None) -> Tensor:
    """combine's exchange, from the results in the order the rows arrived."""
    if plan.splits is None:
        permuted = expert.unpermute(_exchange(back_local, plan.group), plan.return_rows)
    else:
        back = plan.splits.backward(back_local, plan.group)
        dropped_slots = back.new_zeros((plan.row_map.numel() - back.shape[0], back.shape[1]))  # no result
        permuted = torch.cat([back, dropped_slots])
    return expert.unpermute(permuted, plan.row_map, probs)


def dropless_capacity(num_tokens: int, top_k: int) -> int:
    """The capacity at which dispatch drops nothing, whatever the routing: ``T * k`` (at least
    1, as a capacity must be; T or k of 0 routes nothing)."""
    return rules.dropless_capacity(num_tokens, top_k)


class ExpertParallelMoE(nn.Module):
    """An expert-parallel MoE layer: softmax top-k router (``router [H, E]``, replicated
    over the group), dispatch, ``GroupedMLP`` of this rank's ``E_local = num_experts /
    group size`` experts (``experts``), combine. ``forward(x, allowed=None)`` returns
    ``(out [T, H], dropped)``; ``allowed`` (broadcastable to ``[T, E]``) bars experts from
    routing. The router's logits are a core GEMM (one group of every token), so every step
    with arithmetic runs in the core and groupgemm.jax.moe_layer gives the same bits.
    ``capacity`` as in dispatch (None: dropless). The router's gradient is this rank's
    tokens' share: all-reduce it over the data-parallel ranks as for any replicated weight.
    The received rows go through ``experts.forward_routed``: ``fused`` is GroupedMLP's.
    ``state_dict()`` gives the experts as DTensors ``[E, ...]`` sharded over the group, which
    torch.distributed.checkpoint saves whole (every rank calls it: where FSDP2 shards the
    experts further it gathers them, a collective); ``load_state_dict`` also takes the
    single-process layer's ``[E, ...]`` or this rank's ``[E_local, ...]``
    (expert_parallel_sharding.py).
    ``renormalize``: softmax_topk's; None (the default) renormalizes for top_k > 1 only (a
    top-1 weight renormalized is always 1, and the router would not learn).
    """

    def __init__(self, num_experts, hidden_size, ffn_hidden_size, top_k, group=None, *, capacity=None,
                 activation="swiglu", fp8=None, device=None, dtype=None, fused=None, renormalize=None):
        super().__init__()
        self.group = group or dist.group.WORLD
        fn = "ExpertParallelMoE"
        contract.layer_config(fn, dtype_name(dtype or torch.get_default_dtype()), num_experts=num_experts,
                              hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        e_local = rules.check(num_experts, _group_size(self.group, fn), capacity, fn)
        self.num_experts, self.capacity = num_experts, capacity
        self.top_k, self.renormalize = contract.layer_routing(top_k, num_experts, renormalize, fn)
        self.router = nn.Parameter(torch.empty(hidden_size, num_experts, device=device, dtype=dtype))
        self.reset_parameters()
        self.experts = GroupedMLP(e_local, hidden_size, ffn_hidden_size, activation=activation, fp8=fp8,
                                  device=device, dtype=dtype, fused=fused)
        # The experts' entries as DTensors over the group, so a distributed checkpoint keeps
        # every rank's (expert_parallel_sharding.py).
        self.register_state_dict_post_hook(expert_parallel_sharding.to_sharded_entries)
        self.register_load_state_dict_pre_hook(expert_parallel_sharding.from_sharded_entries)

    def reset_parameters(self):
        """Initializes the router, N(0, 0.02). The experts' layers have their own
        ``reset_parameters``, so a model built on the meta device and moved with ``to_empty``
        is initialized by calling it on each of ``modules()`` that has one."""
        nn.init.normal_(self.router, std=0.02)

    def __deepcopy__(self, memo):
        """A copy (``copy.deepcopy``, ``torch.optim.swa_utils.AveragedModel``) on the same
        process group: the group is the ranks' communicator, shared, not data (it does not
        copy)."""
        memo[id(self.group)] = self.group
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return twin

    def forward(self, x: Tensor, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
        fn = "ExpertParallelMoE"
        tokens = shape_and_dtype(x, "x", fn)
        contract.check_rank(tokens[0], 2, "x", "[T, H]", fn)
        contract.layer_input(tokens, self.router.shape[0],
                             None if allowed is None else shape_and_dtype(allowed, "allowed", fn),
                             (x.shape[0], self.num_experts), fn,
                             autocast.layer_dtype(x, self, fn))
        if not torch.compiler.is_compiling():  # the mesh's ranks are host data; the state dict checks too
            expert_parallel_sharding.check_experts_mesh(self, fn)
        every_token = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)  # no host copy
        logits = grouped_mm(x, self.router[None], every_token)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        probs, experts = expert.softmax_topk(logits, self.top_k, renormalize=self.renormalize)
        arrived, plan = _send(x, experts, self.num_experts, self.group, self.capacity, "ExpertParallelMoE")
        return _send_back(self.experts.forward_routed(arrived, plan.receive_experts), plan, probs), plan.dropped
