"""Worker for test_torch_ddp.py: 2-process DDP (gloo) where rank 1 has zero tokens.

Usage: python ddp_worker.py OUT_DIR [FP8_RECIPE]. Each rank saves its averaged gradients;
with FP8_RECIPE (rowwise, blockwise) the experts' GEMMs run in FP8.
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


def width(fp8=None):
    return 128 if fp8 == "blockwise" else 16  # the blockwise recipe contracts in 128-blocks


def make_block(fp8=None):
    torch.manual_seed(0)
    return MoEBlock(dim=width(fp8), ffn=2 * width(fp8), experts=4, top_k=2, fp8=fp8)


def batch(rank, fp8=None):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS[rank], width(fp8), generator=gen)


def loss_fn(out):
    return out.square().sum() / GLOBAL_TOKENS


def run(rank, out_dir, fp8):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD)
    model = DistributedDataParallel(make_block(fp8))  # find_unused_parameters stays False
    loss_fn(model(batch(rank, fp8))).backward()
    torch.save({n: p.grad for n, p in model.module.named_parameters()}, f"{out_dir}/grads{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer is still in its last exchange
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None), nprocs=WORLD, join=True)
