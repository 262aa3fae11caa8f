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
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def _expert_entries(layer, state_dict, prefix):
    """The names of ``layer.experts``' entries in ``state_dict`` (every one is per expert)."""
    inner = prefix + "experts."
    return [name for name in state_dict if name.startswith(inner)]


def _mesh(layer, device_type) -> DeviceMesh:
    return DeviceMesh.from_group(layer.group, device_type)


def _layer_ranks(layer) -> int:
    return dist.get_world_size(layer.group)


def check_experts_mesh(layer, fn):
    """Refuses experts that FSDP2 shards over two or more ranks of the layer's group."""
    group = None
    for name, param in layer.experts.named_parameters():
        if not isinstance(param, DTensor):
            continue  # the layer's own, or FSDP2's unsharded between its hooks
        group = group or set(dist.get_process_group_ranks(layer.group))
        shared = group & set(param.device_mesh.mesh.flatten().tolist())
        if len(shared) > 1:
            raise ValueError(f"{fn}: experts.{name} is sharded over ranks {sorted(shared)} of the layer's "
                             "expert-parallel group, which hold other experts; shard the experts over ranks that "
                             "hold the same experts (a mesh dimension other than the group's)")


def to_sharded_entries(layer, state_dict, prefix, local_metadata):
    """state_dict post-hook: the experts' entries as DTensors over the layer's group."""
    if _layer_ranks(layer) == 1:
        return
    for name in _expert_entries(layer, state_dict, prefix):
        value = state_dict[name]
        local = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2's: gathered over its mesh
        shape = (layer.num_experts, *local.shape[1:])
        state_dict[name] = DTensor.from_local(local.contiguous(), _mesh(layer, local.device.type), [Shard(0)],
                                              run_check=False, shape=torch.Size(shape),
                                              stride=torch.empty(shape, device="meta").stride())


def _local_experts(layer, value, local_count):
    """This rank's experts of a loaded entry (see the module docstring)."""
    rank = dist.get_rank(layer.group)
    window = slice(rank * local_count, (rank + 1) * local_count)
    if isinstance(value, DTensor):
        if value.placements == (Shard(0),) and value.device_mesh.mesh.flatten().tolist() == \
                dist.get_process_group_ranks(layer.group) and value.shape[0] == local_count * _layer_ranks(layer):
            return value.to_local()
        return value.full_tensor()[window]  # another layout: gathered, then this rank's part
    if value.dim() > 0 and value.shape[0] == layer.num_experts and local_count != layer.num_experts:
        return value[window]
    return value  # this rank's own experts (the parameter's shape is checked by the load)


def from_sharded_entries(layer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
    """load_state_dict pre-hook: each of the experts' entries as this rank's parameter takes it."""
    if _layer_ranks(layer) == 1:
        return
    own = layer.experts.state_dict(prefix=prefix + "experts.", keep_vars=True)
    for name in _expert_entries(layer, state_dict, prefix):
        target = own.get(name)
        if not isinstance(target, Tensor) or not isinstance(state_dict[name], Tensor):
            continue  # an unexpected or odd entry: the load reports it
        local = _local_experts(layer, state_dict[name], target.shape[0])  # a DTensor's shape is its mesh's whole
        if isinstance(target, DTensor):  # FSDP2's parameter: sharded again, each rank from its own copy
            local = distribute_tensor(local.to(target.device), target.device_mesh, target.placements,
                                      src_data_rank=None)
        state_dict[name] = local
