"""An expert-parallel layer's experts sharded beyond its group: in its state dict
(DTensors over the group) and under FSDP2 (over the ranks that hold the same experts).

Rank r holds experts ``[r * E_local, (r + 1) * E_local)`` under the same names as every
other rank (``experts.fc1.weight``, ...). As plain tensors, torch.distributed.checkpoint
would take each name for one replicated tensor and write one rank's: every other rank's
experts would be lost, with no error. So ``state_dict()`` gives each of the experts'
entries as a DTensor of the global shape ``[E, ...]``, sharded on its first dimension over
the group (torchtitan's expert-parallel layout): a distributed checkpoint then writes every
rank's experts, and reloads them on any number of ranks. ``get_model_state_dict(...,
full_state_dict=True)`` gathers them into the single-process layer's ``[E, ...]``.

``load_state_dict`` takes for each entry such a DTensor (this rank's shard of it), the
whole ``[E, ...]`` (a single-process layer's or a full state dict: this rank's experts of
it) or this rank's own ``[E_local, ...]`` (a state dict saved per rank before).

FSDP2 (``fully_shard``) may shard the experts further over ranks that hold the same
experts, torchtitan's layout: another mesh dimension than the group's. Over ranks of the
group itself it would gather other ranks' experts into this rank's and mix them, so the
layer refuses that (check_experts_mesh). Where FSDP2 made the experts' parameters DTensors
over such a mesh, their state-dict entries are that data-parallel mesh's and say
nothing of which experts they are. So ``state_dict()`` gathers each over that mesh first
(the rank's experts, as the layer holds them without FSDP2; a collective, which every rank
runs as it saves), and loading shards this rank's experts over it again.

An optimizer's state of the experts (Adam's moments) has the same names on every rank too:
optimizer_state_dict and load_optimizer_state_dict give and take it the same way, around
torch.distributed.checkpoint.state_dict's get_ and set_optimizer_state_dict.
"""

import dataclasses
import itertools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import state_dict as checkpoint_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def check_experts_mesh(layer, fn):
    """Refuses experts that FSDP2 shards over two or more ranks of the layer's group. It sees
    them sharded outside FSDP2's hooks: in the layer's forward where fully_shard is on
    ``layer.experts``, and in the state dict wherever it is."""
    sharded = [(name, p) for name, p in layer.experts.named_parameters() if isinstance(p, DTensor)]
    if not sharded:  # the layer's own, or FSDP2's unsharded between its hooks (every eager call asks)
        return
    group = set(dist.get_process_group_ranks(layer.group))
    for name, param in sharded:
        shared = group & set(param.device_mesh.mesh.flatten().tolist())
        if len(shared) > 1:
            raise ValueError(f"{fn}: experts.{name} is sharded over ranks {sorted(shared)} of the layer's "
                             "expert-parallel group, which hold other experts; shard the experts over ranks that "
                             "hold the same experts (a mesh dimension other than the group's)")


def _sharded(layer, value: Tensor) -> DTensor:
    """One of this rank's per-expert tensors as a DTensor [E, ...] over the layer's group."""
    local = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2's: gathered over its mesh
    shape = torch.Size((layer.num_experts, *local.shape[1:]))
    return DTensor.from_local(local.contiguous(), DeviceMesh.from_group(layer.group, local.device.type), [Shard(0)],
                              run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())


def _local(layer, value: Tensor, target: Tensor, reshard=True) -> Tensor:
    """A loaded per-expert tensor as `target` (this rank's, plain or FSDP2's) takes it;
    ``reshard=False``: FSDP2's left whole, for a caller that shards it."""
    local_count = target.shape[0]  # a DTensor's shape is its mesh's whole: this rank's experts
    rank, ranks = dist.get_rank(layer.group), dist.get_process_group_ranks(layer.group)
    window = slice(rank * local_count, (rank + 1) * local_count)
    if isinstance(value, DTensor):
        ours = value.placements == (Shard(0),) and value.device_mesh.mesh.flatten().tolist() == ranks and \
            value.shape[0] == local_count * len(ranks)
        value = value.to_local() if ours else value.full_tensor()[window].clone()  # another layout: gathered
    elif value.dim() > 0 and value.shape[0] == layer.num_experts != local_count:
        value = value[window].clone()  # not a view, which would keep every expert alive (load with assign=True)
    if reshard and isinstance(target, DTensor):  # FSDP2's: sharded again, each rank from its own copy
        value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
    return value  # else this rank's own (the load checks its shape)


def _one_row_per_expert(value, layer, local_count) -> bool:
    """Whether a tensor of an expert's parameter (its state dict entry, an optimizer's state of
    it) holds one row per expert: this rank's ``local_count`` or, loaded, all of them."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] in (local_count, layer.num_experts)


def _expert_tensors(layer, prefix):
    """Name in the model -> the tensor, for the layer's per-expert parameters and buffers."""
    return {f"{prefix}experts.{name}": t for name, t in
            itertools.chain(layer.experts.named_parameters(), layer.experts.named_buffers())}


def _sharded_layer(layer) -> bool:
    return dist.get_world_size(layer.group) > 1


def to_sharded_entries(layer, state_dict, prefix, local_metadata):
    """state_dict post-hook: the experts' entries as DTensors over the layer's group (with
    ``keep_vars=True``, the parameters themselves, as asked)."""
    if _sharded_layer(layer):
        check_experts_mesh(layer, "ExpertParallelMoE.state_dict")
        for name, own in _expert_tensors(layer, prefix).items():  # one order on every rank: FSDP2's are gathered
            value = state_dict.get(name)
            if _one_row_per_expert(value, layer, own.shape[0]) and not isinstance(value, torch.nn.Parameter):
                state_dict[name] = _sharded(layer, value)


def from_sharded_entries(layer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
    """load_state_dict pre-hook: each of the experts' entries as this rank's parameter takes it.
    A router of another shape (another model's state) is refused before the layer loads any
    entry: a whole state of a model with as many experts as this rank holds would otherwise
    pass for this rank's own (without a router in the state, it still does)."""
    router = state_dict.get(f"{prefix}router")
    if isinstance(router, Tensor) and router.shape != layer.router.shape:
        raise ValueError(f"ExpertParallelMoE.load_state_dict: the state's router has shape {tuple(router.shape)}, "
                         f"the layer's {tuple(layer.router.shape)} (num_experts={layer.num_experts}): the state of "
                         "another model")
    if _sharded_layer(layer):
        for name, target in _expert_tensors(layer, prefix).items():
            if _one_row_per_expert(state_dict.get(name), layer, target.shape[0]):
                state_dict[name] = _local(layer, state_dict[name], target)


def _expert_parameters(model, fn):
    """Name (torch's canonical name, without DDP's or torch.compile's wrapper) -> (layer,
    parameter) for every expert parameter of a sharded ExpertParallelMoE in `model`."""
    from groupgemm.torch_ext.expert_parallel import ExpertParallelMoE  # it imports this module

    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE) and _sharded_layer(m)]
    for layer in layers:
        check_experts_mesh(layer, fn)
    experts = {id(p): layer for layer in layers for p in layer.experts.parameters()}
    return {fqn: (experts[id(param)], param) for name, param in model.named_parameters() if id(param) in experts
            for fqn in checkpoint_state._get_fqns(model, name)}


def _per_expert_states(model, state, fn):
    """(name, layer, parameter, the states' dict, key) for each per-expert tensor of an
    optimizer's state (moments, Adafactor's row and column factors; not a step count). Each
    parameter's dict is copied into ``state["state"]`` first (it may be the optimizer's own);
    the caller owns ``state["state"]`` itself."""
    for name, (layer, param) in _expert_parameters(model, fn).items():
        if name not in state.get("state", {}):
            continue
        states = state["state"][name] = dict(state["state"][name])
        for key, value in list(states.items()):
            if _one_row_per_expert(value, layer, param.shape[0]):
                yield name, layer, param, states, key


def _checked_arguments(model, optimizer, options, fn):
    """The arguments torch's state-dict functions take, named here where they are not; returns
    the optimizer, or an iterable of them as a tuple (read once here)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):  # torch takes an iterable of them too
        try:
            optimizers = tuple(optimizer)
        except TypeError:
            optimizers = ()
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(f"{fn}: optimizer must be a torch.optim.Optimizer or an iterable of them, got "
                            f"{type(optimizer).__name__}")
        optimizer = optimizers
    if options is not None and not isinstance(options, checkpoint_state.StateDictOptions):
        raise TypeError(f"{fn}: options must be a StateDictOptions or None, got {type(options).__name__}")
    for flag in ("flatten_optimizer_state_dict", "broadcast_from_rank0"):
        if options is not None and getattr(options, flag):
            raise ValueError(f"{fn}: StateDictOptions({flag}=True) is not supported with expert-parallel layers")
    return optimizer


def optimizer_state_dict(model, optimizer, options=None):
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer,
    options=options)`` with the state of every ``ExpertParallelMoE``'s experts as DTensors
    over its group, as the layer's state dict gives the experts: a distributed checkpoint
    then keeps every rank's (plain tensors of one name would be taken for one replicated
    tensor, and all ranks' but one lost). With ``full_state_dict``, every sharded tensor is
    gathered whole, the experts' ``[E, ...]`` (with ``cpu_offload`` too, each moved to the
    CPU as it is gathered and kept on rank 0 only, as torch does). Load it with
    ``load_optimizer_state_dict``. Every rank calls it: it may run collectives."""
    fn = "optimizer_state_dict"
    optimizer = _checked_arguments(model, optimizer, options, fn)
    full, offload = options is not None and options.full_state_dict, options is not None and options.cpu_offload
    sharded = dataclasses.replace(options, full_state_dict=False, cpu_offload=False) if full else options
    state = checkpoint_state.get_optimizer_state_dict(model, optimizer, options=sharded)
    state["state"] = dict(state["state"])
    for _, layer, _, states, key in _per_expert_states(model, state, fn):
        states[key] = _sharded(layer, states[key])
    if not full:
        return state
    kept = not offload or dist.get_rank() == 0
    for name, states in state["state"].items():  # in one order on every rank
        whole = {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in states.items()}
        state["state"][name] = {key: value.cpu() if offload and isinstance(value, Tensor) else value
                                for key, value in whole.items()} if kept else {}
    return state if kept else {}


def load_optimizer_state_dict(model, optimizer, state, options=None):
    """Loads an ``optimizer_state_dict`` (after ``torch.distributed.checkpoint.load`` filled
    it, or a full one on every rank), leaving ``state`` as it is: each rank takes its
    experts' state, then ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``."""
    fn = "load_optimizer_state_dict"
    optimizer = _checked_arguments(model, optimizer, options, fn)
    if not (isinstance(state, dict) and {"state", "param_groups"} <= state.keys()):
        got = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{fn}: state must be what optimizer_state_dict returns, a dict with 'state' and "
                         f"'param_groups', got {got}")
    full = options is not None and options.full_state_dict  # torch then shards FSDP2's itself
    state = {**state, "state": dict(state["state"])}
    for name, layer, param, states, key in _per_expert_states(model, state, fn):
        # A plain tensor is a full state's, one row per expert. One of this rank's rows only
        # (no form this takes) may be another model's whole state: refused, not loaded.
        if not isinstance(states[key], DTensor) and states[key].shape[0] != layer.num_experts:
            raise ValueError(f"{fn}: the state {key!r} of {name} has {states[key].shape[0]} rows, but a full "
                             f"state has one per expert ({layer.num_experts}): pass what optimizer_state_dict "
                             "returns (after torch.distributed.checkpoint.load fills it) or a full one")
        states[key] = _local(layer, states[key], param, reshard=not full)
    checkpoint_state.set_optimizer_state_dict(model, optimizer, state, options=options)
