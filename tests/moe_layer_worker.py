"""Worker for test_torch_moe_layer_distributed.py: an MoE layer built from groupgemm's expert
layer (permute, GroupedMLP, unpermute), expert-parallel over gloo.

Experts are sharded across ranks, each rank holding a GroupedMLP (SwiGLU) of its local
experts. A replicated softmax top-2 router picks each token's experts; ``permute`` over
all experts groups the token copies by global expert, hence by destination rank; they
travel with the differentiable ``all_to_all_single``, are regrouped by local expert, run
through the local MLP, travel back, and ``unpermute`` combines them with the router's
weights. Rank 1 has no tokens on odd steps, and on step 2 every expert of rank 1 is
barred, so it receives no rows at all. Each rank saves its parameters after the steps
and what it sent and received, step by step.

Usage: python moe_layer_worker.py WORLD OUT_DIR
"""

import math
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.multiprocessing as mp

import groupgemm.torch as gt

DIM, FFN, LOCAL_EXPERTS, TOP_K, STEPS, LR = 8, 16, 2, 2, 4, 0.1
DROP_BELOW = 0.2  # a slot whose renormalised weight is below this is dropped (routed nowhere)


def batch(step, rank):
    """(tokens, target) of one rank at one step."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    count = 0 if (rank == 1 and step % 2 == 1) else 5 + rank  # rank 1 has no tokens on odd steps
    return torch.randn(count, DIM, generator=gen), torch.randn(count, DIM, generator=gen)


def allowed_experts(step, world):
    allowed = torch.ones(world * LOCAL_EXPERTS, dtype=torch.bool)
    if step == 2:
        allowed[LOCAL_EXPERTS:2 * LOCAL_EXPERTS] = False  # rank 1 receives no rows this step
    return allowed


def init_params(world):
    gen = torch.Generator().manual_seed(0)
    experts = world * LOCAL_EXPERTS
    return {"router": torch.randn(DIM, experts, generator=gen),
            "fc1": torch.randn(experts, 2 * FFN, DIM, generator=gen) / math.sqrt(DIM),
            "fc2": torch.randn(experts, DIM, FFN, generator=gen) / math.sqrt(FFN)}


def make_experts(params, experts):
    """A GroupedMLP holding the global experts in the slice ``experts``."""
    fc1, fc2 = params["fc1"][experts], params["fc2"][experts]
    mlp = gt.GroupedMLP(len(fc1), DIM, FFN, activation="swiglu")
    with torch.no_grad():
        mlp.fc1.weight.copy_(fc1)
        mlp.fc2.weight.copy_(fc2)
    return mlp


def route(x, router, allowed):
    """(expert_indices [T, k], probs [T, k]): softmax over the allowed experts, top-k,
    weights renormalised; a slot with a small weight is dropped (index -1)."""
    logits = (x @ router).masked_fill(~allowed, float("-inf"))
    probs, experts = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.where(probs < DROP_BELOW, -1, experts), probs


def expert_parallel_layer(x, router, mlp, allowed, world, traffic):
    expert_indices, probs = route(x, router, allowed)
    permuted, group_sizes, row_map = gt.permute(x, expert_indices, world * LOCAL_EXPERTS)
    # Rows come grouped by global expert, i.e. by destination rank, dropped slots last.
    # torch's all_to_all_single takes its split sizes as host integers, so the dispatcher
    # reads them here: that host read is inherent to the collective's API. The groupgemm
    # ops themselves never read group sizes on the host.
    counts = group_sizes.to(torch.int64)
    recv_counts = torch.empty_like(counts)  # [source rank, local expert]
    dist.all_to_all_single(recv_counts, counts)
    send_split = counts.view(world, LOCAL_EXPERTS).sum(1).tolist()
    recv_split = recv_counts.view(world, LOCAL_EXPERTS).sum(1).tolist()
    sent = sum(send_split)
    traffic.append({"tokens": len(x), "sent": sent, "received": sum(recv_split), "dropped": len(permuted) - sent})
    received = dist_fn.all_to_all_single(x.new_empty(sum(recv_split), DIM), permuted[:sent], recv_split, send_split)
    # Rows arrive by source rank, then local expert: permute (k = 1) regroups them by
    # local expert, unpermute puts the MLP's rows back in arrival order.
    local_expert = torch.arange(LOCAL_EXPERTS).repeat(world).repeat_interleave(recv_counts)
    grouped, local_sizes, local_map = gt.permute(received, local_expert[:, None], LOCAL_EXPERTS)
    y = gt.unpermute(mlp(grouped, local_sizes), local_map)
    back = dist_fn.all_to_all_single(x.new_empty(sent, DIM), y, send_split, recv_split)
    # Dropped slots travelled nowhere; their rows (after the routed ones) add nothing.
    rows = torch.cat([back, back.new_zeros(len(permuted) - sent, DIM)])
    return gt.unpermute(rows, row_map, probs)


def run(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    params = init_params(world)
    router = torch.nn.Parameter(params["router"].clone())
    mlp = make_experts(params, slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS))
    traffic = []
    for step in range(STEPS):
        x, target = batch(step, rank)
        total = torch.tensor(float(len(x)))
        dist.all_reduce(total)
        out = expert_parallel_layer(x, router, mlp, allowed_experts(step, world), world, traffic)
        # Each rank's loss is scaled so that the average over ranks is the global mean
        # loss, the data-parallel convention; gradients are then averaged across ranks.
        loss = world * (out - target).square().sum() / total.clamp(min=1)
        router.grad = None
        mlp.zero_grad(set_to_none=True)
        loss.backward()
        dist.all_reduce(router.grad)  # the replicated router: average its gradient
        router.grad /= world
        # The all_to_all backward brings every rank's loss gradient home to the experts,
        # so theirs is already the sum over ranks: the same average.
        for p in mlp.parameters():
            p.grad /= world
        with torch.no_grad():
            for p in [router, *mlp.parameters()]:
                p -= LR * p.grad
    torch.save({"router": router.detach(), "fc1": mlp.fc1.weight.detach(), "fc2": mlp.fc2.weight.detach(),
                "traffic": traffic}, f"{out_dir}/params{rank}.pt")
    dist.destroy_process_group()


def single_process_reference(world):
    """The same training in one process: every expert, the union of every rank's tokens."""
    params = init_params(world)
    router = torch.nn.Parameter(params["router"].clone())
    mlp = make_experts(params, slice(None))
    for step in range(STEPS):
        batches = [batch(step, r) for r in range(world)]
        x, target = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        expert_indices, probs = route(x, router, allowed_experts(step, world))
        permuted, group_sizes, row_map = gt.permute(x, expert_indices, world * LOCAL_EXPERTS)
        out = gt.unpermute(mlp(permuted, group_sizes), row_map, probs)
        loss = (out - target).square().sum() / max(len(x), 1)
        router.grad = None
        mlp.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in [router, *mlp.parameters()]:
                p -= LR * p.grad
    return {"router": router.detach(), "fc1": mlp.fc1.weight.detach(), "fc2": mlp.fc2.weight.detach()}


if __name__ == "__main__":
    world = int(sys.argv[1])
    mp.spawn(run, args=(world, sys.argv[2]), nprocs=world, join=True)
