"""The cost of expert-parallel token dispatch: groupgemm.torch.dispatch + combine (capacity
and dropless modes) against the hand-written all-to-all of the guide's earlier version
(sort by expert, counts all-to-all, a host copy of the split sizes, all_to_all_single,
regroup by local expert, and the same back), over gloo processes on the CPU, one
interleaved run. Capacity mode exchanges ``capacity`` rows per pair of ranks whatever the
routing: at 1.25x a peer's share under even routing (no slot dropped here), and at T * k,
which drops nothing under any routing and so moves ``world`` times the rows. The experts
are the identity, so the time is the exchange's: every contender moves the same rows
between the same ranks, and each result is checked against the hand-written one before
timing.

    python benchmarks/ep_dispatch.py [--world 2] [--tokens 2048] [--hidden 256] [--experts 8]
"""

import argparse
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import interleaved_medians  # noqa: E402

HAND_WRITTEN = "hand-written all_to_all_single"
CAPACITY_FACTOR = 1.25  # capacity over a peer's rows under even routing, a common setting
SHUFFLE_SEED = 0  # the same order on every rank: the collectives line up


def hand_written(torch, dist, dist_fn, x, experts, probs, num_experts, world):
    """The guide's dispatch and combine: sort each slot by global expert, exchange the counts,
    copy the split sizes to the host, all_to_all_single, regroup by local expert; back."""
    local = num_experts // world
    flat, slot_probs = experts.reshape(-1), probs.reshape(-1)
    kept = flat >= 0
    ids = torch.where(kept, flat, num_experts)
    order = torch.sort(ids, stable=True).indices
    counts = torch.bincount(ids, minlength=num_experts + 1)[:num_experts]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_split = counts.view(world, local).sum(1).tolist()
    recv_split = recv_counts.view(world, local).sum(1).tolist()
    rows = order[:sum(send_split)]
    token = rows // experts.shape[1]
    received = dist_fn.all_to_all_single(x.new_empty(sum(recv_split), x.shape[1]), x[token], recv_split, send_split)
    local_expert = torch.arange(local).repeat(world).repeat_interleave(recv_counts)
    regroup = torch.sort(local_expert, stable=True).indices
    y = received[regroup]  # the experts (the identity here) take rows grouped by local expert
    y = torch.empty_like(received).index_copy(0, regroup, y)
    back = dist_fn.all_to_all_single(x.new_empty(len(rows), x.shape[1]), y, send_split, recv_split)
    return torch.zeros_like(x).index_add(0, token, back * slot_probs[rows].unsqueeze(-1))


def run(rank, world, args, store, results):
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    import groupgemm.torch as gt

    torch.set_num_threads(1)  # the processes share the cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    logits = torch.randn(args.tokens, args.experts, generator=gen)
    probs, experts = gt.softmax_topk(logits, args.top_k)

    dropped = {}

    def library(name, capacity):
        def call():
            expert_input, _, plan = gt.dispatch(x, experts, args.experts, capacity=capacity)
            dropped[name] = int(plan.dropped) if not dropped.get(name) else dropped[name]
            return gt.combine(expert_input, plan, probs)
        return name, call

    balanced = args.tokens * args.top_k // world  # a peer's rows under even routing
    calls = dict([library(f"groupgemm, capacity {CAPACITY_FACTOR} x balanced", math.ceil(CAPACITY_FACTOR * balanced)),
                  library("groupgemm, capacity T * k (drops nothing)", gt.dropless_capacity(args.tokens, args.top_k)),
                  library("groupgemm, dropless", None)])
    calls[HAND_WRITTEN] = lambda: hand_written(torch, dist, dist_fn, x, experts, probs, args.experts, world)
    want = calls[HAND_WRITTEN]()
    for name, fn in calls.items():
        got = fn()
        if not dropped.get(name):  # a capacity below a peer's load drops slots: another result
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
    medians = interleaved_medians(calls, args.repeats, shuffle_seed=SHUFFLE_SEED)
    if rank == 0:
        results.update({name: seconds for name, (seconds, _) in medians.items()})
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        mp.spawn(run, args=(args.world, args, os.path.join(tmp, "store"), results), nprocs=args.world, join=True)
        results = dict(results)
    base = results[HAND_WRITTEN]
    print(f"gloo, {args.world} processes, {args.tokens} tokens per rank, H = {args.hidden}, E = {args.experts}, "
          f"top-{args.top_k}; medians of {args.repeats} interleaved calls\n")
    print("| dispatch + combine | ms | / hand-written |\n|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
