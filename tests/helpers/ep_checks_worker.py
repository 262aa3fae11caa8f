"""Worker of test_expert_parallel_checks.py: groupgemm.torch's dispatch, dispatch_probs and
combine given wrong input over two gloo ranks. Each case runs on both ranks; each rank
records what it raised (type and message) or "ok", and how many all-gathers the
configuration check made, into rank{r}.json. A case that aborted a rank or hung fails the
test (the process exits non-zero, or runs past the test's timeout).

Usage: python ep_checks_worker.py OUT_DIR
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import groupgemm.torch as gt

WORLD, H, E, K, T = 2, 8, 4, 2, 5


def routing(rank, tokens=T, width=H, dtype=torch.float32):
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(tokens, width, generator=gen, dtype=dtype), torch.randint(0, E, (tokens, K), generator=gen)


def disagree(rank, **per_rank):
    """A dispatch where the named arguments take rank 0's or rank 1's value."""
    mine = {name: values[rank] for name, values in per_rank.items()}
    tokens, experts = routing(rank, width=mine.pop("width", H), dtype=mine.pop("dtype", torch.float32))
    gt.dispatch(tokens, experts, mine.pop("num_experts", E), **mine)


def one_dispatch(rank, capacity=T * K):
    tokens, experts = routing(rank)
    expert_input, _, plan = gt.dispatch(tokens, experts, E, capacity=capacity)
    return tokens, experts, expert_input, plan


def combine_rows(rank, extra):
    _, _, expert_input, plan = one_dispatch(rank)
    gt.combine(torch.zeros(expert_input.shape[0] + extra, H), plan, torch.ones(T, K))


def combine_probs_transposed(rank):
    _, _, expert_input, plan = one_dispatch(rank)
    gt.combine(expert_input, plan, torch.ones(T, K).t())


def dropless_compiled(rank):
    tokens, experts = routing(rank)
    torch.compile(lambda x, e: gt.dispatch(x, e, E, capacity=None)[0], fullgraph=True)(tokens, experts)


def outside_group(rank):
    group = dist.new_group([0])  # every rank takes part in making it; rank 1 is not in it
    if rank == 1:
        tokens, experts = routing(rank)
        gt.dispatch(tokens, experts, E, group)


CASES = {
    "num_experts": lambda r: disagree(r, num_experts=(4, 2), capacity=(T * K,) * 2),
    "capacity": lambda r: disagree(r, capacity=(4, 8)),
    "mode": lambda r: disagree(r, capacity=(None, 8)),
    "hidden_size": lambda r: disagree(r, width=(8, 6), capacity=(T * K,) * 2),
    "dtype": lambda r: disagree(r, dtype=(torch.float32, torch.float64), capacity=(T * K,) * 2),
    "dropless_hidden_size": lambda r: disagree(r, width=(8, 6)),
    "dropless_num_experts": lambda r: disagree(r, num_experts=(4, 2)),
    "combine_one_row_short": lambda r: combine_rows(r, -1),
    "combine_one_row_over": lambda r: combine_rows(r, 1),
    "dispatch_probs_transposed": lambda r: gt.dispatch_probs(torch.ones(T, K).t(), one_dispatch(r)[3]),
    "combine_probs_transposed": combine_probs_transposed,
    "indices_rows": lambda r: gt.dispatch(routing(r)[0], routing(r, tokens=T + 1)[1], E, capacity=4),
    "outside_group": outside_group,
    "dropless_compiled": dropless_compiled,
    "agreed_after_errors": lambda r: one_dispatch(r),  # the group still works
}


def run(rank, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=WORLD)
    gathers = []
    all_gather = dist.all_gather
    dist.all_gather = lambda *a, **k: (gathers.append(1), all_gather(*a, **k))[1]  # the check's collective
    results = {}
    for name, case in CASES.items():
        try:
            case(rank)
            results[name] = "ok"
        except Exception as e:  # recorded for the test to judge
            results[name] = f"{type(e).__name__}: {e}"
    before = len(gathers)
    one_dispatch(rank)  # a configuration already agreed: no second check
    results["gathers_for_an_agreed_configuration"] = len(gathers) - before
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()  # no rank tears the group down while a peer is still in its last exchange
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=WORLD, join=True)
