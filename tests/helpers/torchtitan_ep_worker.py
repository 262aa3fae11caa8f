"""Worker of test_torchtitan.py's expert-parallel test: torchtitan's own all-to-all token
dispatcher and groupgemm's (groupgemm.integrations.torchtitan.token_dispatcher_class),
dropless and with a capacity, on the same tokens, routing and experts over 2 gloo ranks
(rank 1's experts get no token at one step). Each rank saves, per dispatcher and step, the
combined output and the gradients of its tokens, scores and experts' weights.

Usage: python torchtitan_ep_worker.py OUT_DIR
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import groupgemm.torch as gt

WORLD, LOCAL_EXPERTS, TOKENS, DIM, TOP_K = 2, 2, 6, 8, 2
EXPERTS = WORLD * LOCAL_EXPERTS


def dispatchers():
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    from groupgemm.integrations.torchtitan import token_dispatcher_class

    ours = token_dispatcher_class().Config
    return {"torchtitan": AllToAllTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K),
            "groupgemm dropless": ours(num_experts=EXPERTS, top_k=TOP_K),
            "groupgemm capacity": ours(num_experts=EXPERTS, top_k=TOP_K, capacity=TOKENS * TOP_K)}


def step_inputs(step, rank):
    gen = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(TOKENS, DIM, generator=gen)
    scores = torch.rand(TOKENS, TOP_K, generator=gen)
    high = LOCAL_EXPERTS if step == 1 else EXPERTS  # step 1: rank 1's experts idle
    ids = torch.stack([torch.randperm(high, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.randn(EXPERTS, DIM, DIM, generator=torch.Generator().manual_seed(99))
    return x, scores, ids, weights[rank * LOCAL_EXPERTS:(rank + 1) * LOCAL_EXPERTS]


def run(rank, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD)
    set_spmd_backend("dtensor")  # torchtitan's dispatcher then reads the wired EP mesh, as ours does
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    saved = {}
    for name, config in dispatchers().items():
        dispatcher = config.build()
        dispatcher.wire_meshes(ep_mesh=mesh)
        for step in range(2):
            x, scores, ids, weights = step_inputs(step, rank)
            x.requires_grad_(), scores.requires_grad_(), weights.requires_grad_()
            counts = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
            rows, sizes, metadata = dispatcher.dispatch(x, scores, ids, counts)
            out = dispatcher.combine(gt.grouped_mm(rows, weights, sizes), metadata, x)
            out.backward(torch.ones_like(out))
            for what, t in (("out", out), ("dx", x.grad), ("dscores", scores.grad), ("dweights", weights.grad)):
                saved[f"{name}/{step}/{what}"] = t.detach().numpy()
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **saved)
    dist.barrier()  # no rank tears the group down while a peer is still in its last exchange
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD, join=True)
