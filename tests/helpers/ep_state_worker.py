"""Worker of test_expert_parallel_state.py: ExpertParallelMoE's state dict over gloo, one
process per rank, each rank holding its window of the experts of one model drawn from a
seed (so the ranks' experts differ).

Usage: python ep_state_worker.py WORLD OUT_DIR MODE
  MODE: plain (one expert-parallel group of WORLD ranks), fsdp (WORLD = 4: two groups of 2,
  the experts sharded further by fully_shard over the ranks holding the same experts),
  wrong-mesh (WORLD = 2: fully_shard over the group's own ranks), ddp (WORLD = 2: the layer
  under DistributedDataParallel with its experts left out, as the guide shows)
Each rank writes rank{r}.json: what it checked, name -> true/false, or the error it got.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import groupgemm.torch as gt

E, H, F, K = 4, 8, 6, 2


def model(seed):
    """The router and every expert of the model drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    fc1, fc2 = torch.randn(E, 2 * F, H, generator=gen), torch.randn(E, H, F, generator=gen)
    return {"router": torch.randn(H, E, generator=gen), "fc1": fc1, "fc2": fc2}


def layer(group, seed, fsdp_mesh=None):
    moe = gt.ExpertParallelMoE(E, H, F, K, group)
    ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    window = slice(ep_rank * E // ep_size, (ep_rank + 1) * E // ep_size)
    drawn = model(seed)
    with torch.no_grad():
        moe.router.copy_(drawn["router"])
        moe.experts.fc1.weight.copy_(drawn["fc1"][window])
        moe.experts.fc2.weight.copy_(drawn["fc2"][window])
    if fsdp_mesh is not None:
        fully_shard(moe.experts, mesh=fsdp_mesh)
    return moe


def local(t):  # this rank's part of a DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def raises(error, fragment, fn, *args):
    """Whether fn(*args) raises `error` with `fragment` in its message."""
    try:
        fn(*args)
    except error as e:
        return fragment in str(e)
    return False


def same_parameters(a, b):
    return all(torch.equal(local(x), local(y)) for x, y in zip(a.parameters(), b.parameters()))


def step(moe, optimizer, x):
    optimizer.zero_grad()
    moe(x)[0].square().sum().backward()
    dist.all_reduce(moe.router.grad)  # the replicated router stays replicated
    optimizer.step()


def checkpoint_round_trip(saved, other, x, out_dir, optimizer_class=torch.optim.Adam):
    """Each model takes an optimizer step on other tokens; `saved`'s model and optimizer go
    through a distributed checkpoint into `other`; then both take the same step. Returns
    the checks, and `saved`'s output and full state dict at the checkpoint."""
    optimizers = [optimizer_class(m.parameters(), lr=0.01) for m in (saved, other)]
    step(saved, optimizers[0], x)
    step(other, optimizers[1], x + 1)
    path = os.path.join(out_dir, "checkpoint")
    dcp.save({"model": saved.state_dict(), "optim": gt.optimizer_state_dict(saved, optimizers[0])}, checkpoint_id=path)
    with torch.no_grad():
        at_checkpoint = saved(x)[0]
    whole = {name: t.clone() for name, t in  # the router's is the parameter itself, which steps on
             get_model_state_dict(saved, options=StateDictOptions(full_state_dict=True)).items()}
    state = {"model": other.state_dict(), "optim": gt.optimizer_state_dict(other, optimizers[1])}
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state["model"])
    gt.load_optimizer_state_dict(other, optimizers[1], state["optim"])
    params = [o.param_groups[0]["params"] for o in optimizers]  # FSDP2's sharded ones, between its hooks too
    moments = [[local(v) for p in o.param_groups[0]["params"] for v in o.state[p].values()] for o in optimizers]
    checked = {"the parameters restored": all(torch.equal(local(a), local(b)) for a, b in zip(*params)),
               "the optimizer's state restored": all(map(torch.equal, *moments))}
    for model, optimizer in zip((saved, other), optimizers):
        step(model, optimizer, x)
    checked["the next step the same"] = all(torch.equal(local(a), local(b)) for a, b in zip(*params))
    checked["and the outputs"] = torch.equal(saved(x)[0], other(x)[0])
    return checked, at_checkpoint, whole


def checks_plain(world, out_dir):
    group = dist.group.WORLD
    saved, other = layer(group, 1), layer(group, 2)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    checked = {"experts differ between the two models": not same_parameters(saved, other)}
    state = saved.state_dict()
    checked["experts are DTensors of every expert"] = all(
        isinstance(state[f"experts.{n}.weight"], DTensor) and state[f"experts.{n}.weight"].shape[0] == E
        for n in ("fc1", "fc2"))

    full = get_model_state_dict(saved, options=StateDictOptions(full_state_dict=True))
    checked["the full state dict is the whole model"] = all(torch.equal(full[n], w) for n, w in zip(
        ("router", "experts.fc1.weight", "experts.fc2.weight"), model(1).values()))
    fresh = layer(group, 3)
    fresh.load_state_dict(full)
    checked["a full state dict loads this rank's experts"] = same_parameters(saved, fresh)

    path = os.path.join(out_dir, f"rank{dist.get_rank()}.pt")
    torch.save(saved.state_dict(), path)
    fresh = layer(group, 3)
    fresh.load_state_dict(torch.load(path))  # weights_only, torch.load's default
    checked["torch.save and torch.load round trip"] = same_parameters(saved, fresh)
    fresh = layer(group, 3)
    fresh.load_state_dict({"router": saved.router.detach(), "experts.fc1.weight": saved.experts.fc1.weight.detach(),
                           "experts.fc2.weight": saved.experts.fc2.weight.detach()})
    checked["this rank's own experts load"] = same_parameters(saved, fresh)
    # The whole state of a model of E / world experts has this rank's shapes but for the
    # router: refused before any expert loads, not taken for this rank's own.
    fresh, e_local = layer(group, 3), E // world
    foreign = {"router": torch.zeros(H, e_local), "experts.fc1.weight": torch.zeros(e_local, 2 * F, H),
               "experts.fc2.weight": torch.zeros(e_local, H, F)}
    checked["another model's state is refused before an expert loads"] = \
        raises(ValueError, "the state of another model", fresh.load_state_dict, foreign) and \
        same_parameters(fresh, layer(group, 3))
    round_trip, _, whole = checkpoint_round_trip(saved, other, x, out_dir)
    checked.update(round_trip)
    solo = [dist.new_group([r]) for r in range(world)][dist.get_rank()]  # each rank a group of one: every expert
    alone = layer(solo, 3)
    restored = {"model": alone.state_dict()}
    dcp.load(restored, checkpoint_id=os.path.join(out_dir, "checkpoint"))
    alone.load_state_dict(restored["model"])
    checked["a group of one loads every expert"] = all(torch.equal(t, whole[n]) for n, t in alone.state_dict().items())

    # the full optimizer state on rank 0: every rank's moments, in rank order
    optimizer = torch.optim.Adam(saved.parameters())
    step(saved, optimizer, x)
    full = gt.optimizer_state_dict(saved, optimizer, StateDictOptions(full_state_dict=True, cpu_offload=True))
    moments = [None] * world
    dist.all_gather_object(moments, optimizer.state[saved.experts.fc1.weight]["exp_avg"])
    if dist.get_rank() == 0:
        checked["the full optimizer state holds every rank's moments"] = torch.equal(
            full["state"]["experts.fc1.weight"]["exp_avg"], torch.cat(moments))
    else:
        checked["the full optimizer state holds every rank's moments"] = full == {}  # rank 0's, as torch's

    # Moments of this rank's rows only, plain (another model's whole state, or a rank's):
    # refused, not loaded as this rank's own.
    own = gt.optimizer_state_dict(saved, optimizer)
    own["state"] = {name: {key: local(v) for key, v in states.items()} for name, states in own["state"].items()}
    checked["an optimizer state of this rank's rows only is refused"] = raises(
        ValueError, "experts.fc1.weight has 2 rows, but a full state has one per expert (4)",
        gt.load_optimizer_state_dict, saved, optimizer, own)

    # Adafactor's row and column factors: one row per expert, not the parameter's shape
    factored = checkpoint_round_trip(layer(group, 4), layer(group, 5), x, out_dir + "/factored", torch.optim.Adafactor)
    checked.update({f"Adafactor: {name}": held for name, held in factored[0].items()})
    return checked


def checks_fsdp(world, out_dir):
    ep = 2
    expert_groups = [dist.new_group(list(range(i, i + ep))) for i in range(0, world, ep)]
    replica_groups = [dist.new_group(list(range(j, world, ep))) for j in range(ep)]
    rank = dist.get_rank()
    group, replicas = expert_groups[rank // ep], DeviceMesh.from_group(replica_groups[rank % ep], "cpu")
    saved, other = layer(group, 1, replicas), layer(group, 2, replicas)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(rank))
    checked, at_checkpoint, _ = checkpoint_round_trip(saved, other, x, out_dir)
    unsharded = layer(group, 3)  # the same checkpoint without FSDP2: each rank's whole experts
    restored = {"model": unsharded.state_dict()}
    dcp.load(restored, checkpoint_id=os.path.join(out_dir, "checkpoint"))
    unsharded.load_state_dict(restored["model"])
    checked["loaded without FSDP2: the group rank's experts"] = torch.equal(unsharded(x)[0], at_checkpoint)
    return checked


def checks_wrong_mesh(world, out_dir):
    """The errors of a forward and of a state dict, fully_shard on the experts or the layer."""
    errors, world_mesh = {}, DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for where, call in (("forward", lambda moe: moe(torch.randn(5, H))), ("state_dict", lambda moe: moe.state_dict())):
        for sharded in ("experts", "layer"):
            moe = layer(dist.group.WORLD, 1)
            fully_shard(moe.experts if sharded == "experts" else moe, mesh=world_mesh)
            try:
                call(moe)
                errors[f"{where}, {sharded}"] = None
            except ValueError as error:
                errors[f"{where}, {sharded}"] = str(error)
    return errors


def checks_ddp(world, out_dir):
    from torch.nn.parallel import DistributedDataParallel

    plain, wrapped = layer(dist.group.WORLD, 1), layer(dist.group.WORLD, 1)
    held = [p.detach().clone() for p in wrapped.experts.parameters()]
    experts = [f"experts.{name}" for name, _ in wrapped.experts.named_parameters()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapped, experts)
    ddp = DistributedDataParallel(wrapped)
    kept = all(torch.equal(a, b) for a, b in zip(held, wrapped.experts.parameters()))
    checked = {"DDP keeps each rank's experts": kept}
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    for module in (plain, ddp):
        module(x)[0].square().sum().backward()
    checked["the experts' gradients are the rank's own"] = all(
        torch.equal(a.grad, b.grad) for a, b in zip(plain.experts.parameters(), wrapped.experts.parameters()))
    dist.all_reduce(plain.router.grad)
    checked["the router's is averaged"] = torch.allclose(wrapped.router.grad, plain.router.grad / world)
    optimizer = torch.optim.Adam(ddp.parameters())
    optimizer.step()
    moment = gt.optimizer_state_dict(ddp, optimizer)["state"]["experts.fc1.weight"]["exp_avg"]  # DDP's name stripped
    checked["through DDP the optimizer state is sharded too"] = isinstance(moment, DTensor) and moment.shape[0] == E
    moment = gt.optimizer_state_dict(torch.compile(wrapped), optimizer)["state"]["experts.fc1.weight"]["exp_avg"]
    checked["and through torch.compile's wrapper"] = isinstance(moment, DTensor) and moment.shape[0] == E
    return checked


def run(rank, world, out_dir, mode):
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world)
    try:
        checks = {"plain": checks_plain, "fsdp": checks_fsdp, "wrong-mesh": checks_wrong_mesh, "ddp": checks_ddp}
        checked = checks[mode](world, out_dir)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(checked, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, out_dir, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.multiprocessing.spawn(run, args=(world, out_dir, mode), nprocs=world)
