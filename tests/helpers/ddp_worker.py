"""Worker for test_torch_ddp.py: 2-process DDP (gloo) where rank 1 has zero tokens.

Usage: python ddp_worker.py OUT_DIR. Each rank saves its averaged gradients.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))  # moe_dispatch
from moe_torch import MoEBlock  # noqa: E402

WORLD = 2
TOKENS = {0: 12, 1: 0}  # rank 1 receives no tokens at all
GLOBAL_TOKENS = sum(TOKENS.values())


def make_block():
    torch.manual_seed(0)
    return MoEBlock(dim=16, ffn=32, experts=4, top_k=2)


def batch(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS[rank], 16, generator=gen)


def loss_fn(out):
    return out.square().sum() / GLOBAL_TOKENS


def run(rank, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD)
    model = DistributedDataParallel(make_block())  # find_unused_parameters stays False
    loss_fn(model(batch(rank))).backward()
    torch.save({n: p.grad for n, p in model.module.named_parameters()}, f"{out_dir}/grads{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD, join=True)
