"""The expert-parallel layer's test cases, for both frameworks: one global batch per step,
its split over the ranks, the routing masks that make the hard cases happen, the shared
initialisation, and the single-process reference (the same layer on the whole batch).

Steps (each a global batch of tokens and an ``allowed [T, E]`` mask):
  0. plain routing;
  1. every token of rank 0 barred from every expert: rank 0 sends nothing;
  2. every token barred from rank 1's experts: rank 1 receives nothing, its experts idle;
  3. every token allowed expert 0 alone: all tokens to one expert (their second slot dropped);
  4. (PyTorch, whose ranks may hold different token counts) the last rank holds no tokens.
"""

import math

import numpy as np

HIDDEN, FFN, LOCAL_EXPERTS, TOP_K, TOKENS_PER_RANK = 8, 6, 2, 2, 6
STEPS = 5
SAME_SHAPE_STEPS = 4  # the steps JAX runs: its devices hold equal shards


def init_params(world):
    """NumPy float32 parameters of world * LOCAL_EXPERTS experts, in PyTorch's layout."""
    rng = np.random.default_rng(0)
    experts = world * LOCAL_EXPERTS
    return {"router": (rng.standard_normal((HIDDEN, experts)) * 0.5).astype(np.float32),
            "fc1": (rng.standard_normal((experts, 2 * FFN, HIDDEN)) / math.sqrt(HIDDEN)).astype(np.float32),
            "fc2": (rng.standard_normal((experts, HIDDEN, FFN)) / math.sqrt(FFN)).astype(np.float32)}


def token_counts(step, world):
    counts = [TOKENS_PER_RANK] * world
    if step == 4:
        counts[-1] = 0
    return counts


def batch(step, world):
    """(x [T, H], dy [T, H], allowed [T, E]) of the whole step, ranks' tokens in rank order."""
    rng = np.random.default_rng(100 + step)
    counts = token_counts(step, world)
    total, experts = sum(counts), world * LOCAL_EXPERTS
    x = rng.standard_normal((total, HIDDEN)).astype(np.float32)
    dy = rng.standard_normal((total, HIDDEN)).astype(np.float32)
    allowed = np.ones((total, experts), bool)
    if step == 1:
        allowed[:counts[0]] = False
    elif step == 2:
        allowed[:, LOCAL_EXPERTS:2 * LOCAL_EXPERTS] = False
    elif step == 3:
        allowed[:, 1:] = False
    return x, dy, allowed


def rank_rows(step, world, rank):
    counts = token_counts(step, world)
    begin = sum(counts[:rank])
    return slice(begin, begin + counts[rank])


def local_experts(rank):
    return slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)


def idle_experts(step, world):
    """The global experts that receive no row at this step."""
    if step == 2:
        return list(range(LOCAL_EXPERTS, 2 * LOCAL_EXPERTS))
    if step == 3:
        return list(range(1, world * LOCAL_EXPERTS))
    return []


def single_process(params, x, dy, allowed, dtype="float32"):
    """The layer on the whole batch in one PyTorch process (router, softmax top-k, permute,
    GroupedMLP of every expert, unpermute): output and gradients of x, the router, fc1 and
    fc2, as float64 NumPy. ``dtype="float64"`` gives the float64 reference."""
    import torch

    import groupgemm.torch as gt

    t = getattr(torch, dtype)
    router = torch.tensor(params["router"], dtype=t, requires_grad=True)
    mlp = gt.GroupedMLP(params["fc1"].shape[0], HIDDEN, FFN, activation="swiglu", dtype=t)
    with torch.no_grad():
        mlp.fc1.weight.copy_(torch.tensor(params["fc1"]))
        mlp.fc2.weight.copy_(torch.tensor(params["fc2"]))
    xt = torch.tensor(x, dtype=t, requires_grad=True)
    logits = gt.grouped_mm(xt, router[None], torch.full((1,), x.shape[0], dtype=torch.int32))
    logits = logits.masked_fill(~torch.tensor(allowed), float("-inf"))
    probs, experts = gt.softmax_topk(logits, TOP_K)
    permuted, sizes, row_map = gt.permute(xt, experts, router.shape[1])
    out = gt.unpermute(mlp(permuted, sizes), row_map, probs)
    out.backward(torch.tensor(dy, dtype=t))
    return {k: v.detach().double().numpy() for k, v in (("out", out), ("dx", xt.grad), ("router", router.grad),
                                                          ("fc1", mlp.fc1.weight.grad), ("fc2", mlp.fc2.weight.grad))}


def expected_dropped(params, step, world, capacity):
    """Per rank, the slots dispatch drops at ``capacity``: the rows past capacity of each
    (source, destination) pair, counted with NumPy from the single-process routing."""
    import torch

    import groupgemm.torch as gt

    x, _, allowed = batch(step, world)
    logits = gt.grouped_mm(torch.tensor(x), torch.tensor(params["router"])[None],
                           torch.full((1,), x.shape[0], dtype=torch.int32))
    _, experts = gt.softmax_topk(logits.masked_fill(~torch.tensor(allowed), float("-inf")), TOP_K)
    dropped = []
    for source in range(world):
        ids = experts.numpy()[rank_rows(step, world, source)]
        per_destination = np.bincount(ids[ids >= 0] // LOCAL_EXPERTS, minlength=world)
        dropped.append(int(np.maximum(per_destination - capacity, 0).sum()))
    return dropped
