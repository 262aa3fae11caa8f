"""Worker of test_expert_parallel.py: groupgemm.torch.ExpertParallelMoE over gloo, one
process per rank, through the steps of ep_cases.py. Each rank saves, per step, its output,
the gradients of its tokens and of every parameter it holds, and the slots it dropped.

Usage: python ep_layer_worker.py WORLD OUT_DIR MODE
  MODE: capacity (dispatch's dropless capacity), dropless, overflow (capacity 2: slots
  dropped), compiled (capacity mode under torch.compile(fullgraph=True), checked against
  eager bit for bit)
"""

import os
import sys

import numpy as np
import torch
import torch._dynamo.testing
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_cases as cases  # noqa: E402

import groupgemm.torch as gt  # noqa: E402

OVERFLOW_CAPACITY = 2


def capacity_of(mode):
    if mode == "dropless":
        return None
    return OVERFLOW_CAPACITY if mode == "overflow" else gt.dropless_capacity(cases.TOKENS_PER_RANK, cases.TOP_K)


def layer_for(world, rank, mode):
    params = cases.init_params(world)
    layer = gt.ExpertParallelMoE(world * cases.LOCAL_EXPERTS, cases.HIDDEN, cases.FFN, cases.TOP_K,
                                 capacity=capacity_of(mode))
    with torch.no_grad():
        layer.router.copy_(torch.tensor(params["router"]))
        layer.experts.fc1.weight.copy_(torch.tensor(params["fc1"][cases.local_experts(rank)]))
        layer.experts.fc2.weight.copy_(torch.tensor(params["fc2"][cases.local_experts(rank)]))
    return layer


def step_results(layer, forward, step, world, rank):
    x, dy, allowed = cases.batch(step, world)
    rows = cases.rank_rows(step, world, rank)
    xt = torch.tensor(x[rows], requires_grad=True)
    out, dropped = forward(xt, torch.tensor(allowed[rows]))
    assert dropped.dtype == torch.int32 and dropped.shape == (), (dropped.dtype, dropped.shape)  # in every mode
    out.backward(torch.tensor(dy[rows]))
    grads = {name: p.grad.clone() for name, p in (("router", layer.router), ("fc1", layer.experts.fc1.weight),
                                                   ("fc2", layer.experts.fc2.weight))}
    layer.zero_grad()
    return {"out": out.detach(), "dx": xt.grad, "dropped": torch.as_tensor(dropped), **grads}


def run(rank, world, out_dir, mode):
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world)
    layer = layer_for(world, rank, mode)
    saved = {}
    steps = cases.SAME_SHAPE_STEPS if mode == "compiled" else cases.STEPS
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    forward = torch.compile(layer, fullgraph=True, backend=counter) if mode == "compiled" else layer
    for step in range(steps):
        results = step_results(layer, forward, step, world, rank)
        if mode == "compiled":  # the compiled layer against the same layer run eagerly, bit for bit
            eager = step_results(layer, layer, step, world, rank)
            for name, value in eager.items():
                assert torch.equal(results[name], value), (step, name)
        saved.update({f"{step}/{k}": v.numpy() for k, v in results.items()})
    # One graph, though eager steps come between the compiled ones (the ranks' agreement
    # check, skipped while compiling, must not make the graph depend on what they agreed).
    assert mode != "compiled" or counter.frame_count == 1, counter.frame_count
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **saved)
    dist.barrier()  # no rank tears the group down while a peer is still in its last exchange
    dist.destroy_process_group()


if __name__ == "__main__":
    world, out_dir, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    mp.spawn(run, args=(world, out_dir, mode), nprocs=world, join=True)
