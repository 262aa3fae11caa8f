"""Worker for test_torch_expert_parallel.py: expert parallelism over gloo.

Experts are sharded across ranks (GroupedLinear of the local experts); tokens travel to
their expert's rank and back with all_to_all; the replicated router's gradients are
summed across ranks. Some steps give rank 1 zero tokens, one step leaves every expert
of rank 1 without tokens. Each rank saves its parameters after the steps.

Usage: python ep_worker.py WORLD OUT_DIR
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.multiprocessing as mp

from groupgemm.torch import GroupedLinear

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from moe_dispatch import sort_by_expert  # noqa: E402

DIM, FFN, LOCAL_EXPERTS, STEPS, LR = 8, 16, 2, 4, 0.1


def tokens(step, rank):
    """Per-rank batch of a step and which experts may be routed to."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    count = 0 if (rank == 1 and step % 2 == 1) else 5 + rank  # rank 1 idle on odd steps
    return torch.randn(count, DIM, generator=gen), torch.randn(count, DIM, generator=gen)


def allowed_experts(step, world):
    allowed = torch.ones(world * LOCAL_EXPERTS, dtype=torch.bool)
    if step == 2:
        allowed[LOCAL_EXPERTS:2 * LOCAL_EXPERTS] = False  # every expert of rank 1 gets no tokens
    return allowed


def init_params(world):
    torch.manual_seed(0)
    experts = world * LOCAL_EXPERTS
    return {"router": torch.randn(DIM, experts) * 0.5,
            "w1": torch.randn(experts, FFN, DIM) / 3, "w2": torch.randn(experts, DIM, FFN) / 4}


class Experts(torch.nn.Module):
    def __init__(self, w1, w2):
        super().__init__()
        self.up = GroupedLinear(w1.shape[0], DIM, FFN, bias=False)
        self.down = GroupedLinear(w2.shape[0], FFN, DIM, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(w1)
            self.down.weight.copy_(w2)

    def forward(self, x, sizes):
        return self.down(torch.nn.functional.gelu(self.up(x, sizes)), sizes)


def route(x, router, allowed):
    probs = torch.softmax((x @ router).masked_fill(~allowed, float("-inf")), -1)
    gate, expert = probs.max(-1)
    order, counts = sort_by_expert(expert, len(allowed))
    return gate, order, counts


def ep_forward(x, router, experts, allowed, rank, world):
    gate, order, counts = route(x, router, allowed)
    recv_counts = torch.empty_like(counts)  # [source rank, local expert]
    dist.all_to_all_single(recv_counts, counts)
    send_split = counts.view(world, LOCAL_EXPERTS).sum(1).tolist()  # the dispatcher's split sizes
    recv_split = recv_counts.view(world, LOCAL_EXPERTS).sum(1).tolist()
    received = dist_fn.all_to_all_single(x.new_empty(sum(recv_split), DIM), x[order], recv_split, send_split)
    # Rows arrive by source rank, then expert: regroup them by local expert.
    local_expert = torch.arange(LOCAL_EXPERTS).repeat(world).repeat_interleave(recv_counts)
    regroup, sizes = sort_by_expert(local_expert, LOCAL_EXPERTS)
    y = torch.empty_like(received).index_copy(0, regroup, experts(received[regroup], sizes))
    back = dist_fn.all_to_all_single(x.new_empty(len(order), DIM), y, send_split, recv_split)
    return torch.zeros_like(x).index_add(0, order, back * gate[order].unsqueeze(-1))


def run(rank, world, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    params = init_params(world)
    router = torch.nn.Parameter(params["router"])
    local = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    experts = Experts(params["w1"][local], params["w2"][local])
    parameters = [router, *experts.parameters()]
    for step in range(STEPS):
        x, target = tokens(step, rank)
        total = torch.tensor(float(len(x)))
        dist.all_reduce(total)
        out = ep_forward(x, router, experts, allowed_experts(step, world), rank, world)
        loss = (out - target).square().sum() / total
        for p in parameters:
            p.grad = None
        loss.backward()
        dist.all_reduce(router.grad)  # replicated: sum the per-rank contributions
        with torch.no_grad():
            for p in parameters:
                p -= LR * p.grad
    torch.save({"router": router.detach(), "w1": experts.up.weight.detach(), "w2": experts.down.weight.detach()},
               f"{out_dir}/params{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer is still in its last exchange
    dist.destroy_process_group()


def single_process_reference(world):
    """The same training on one process: all experts, the union of every rank's tokens."""
    params = init_params(world)
    router = torch.nn.Parameter(params["router"])
    experts = Experts(params["w1"], params["w2"])
    parameters = [router, *experts.parameters()]
    for step in range(STEPS):
        batches = [tokens(step, r) for r in range(world)]
        x = torch.cat([b[0] for b in batches])
        target = torch.cat([b[1] for b in batches])
        gate, order, sizes = route(x, router, allowed_experts(step, world))
        y = experts(x[order], sizes)
        out = torch.zeros_like(x).index_add(0, order, y * gate[order].unsqueeze(-1))
        loss = (out - target).square().sum() / max(len(x), 1)
        for p in parameters:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in parameters:
                p -= LR * p.grad
    return {"router": router.detach(), "w1": experts.up.weight.detach(), "w2": experts.down.weight.detach()}


if __name__ == "__main__":
    world = int(sys.argv[1])
    mp.spawn(run, args=(world, sys.argv[2]), nprocs=world, join=True)
