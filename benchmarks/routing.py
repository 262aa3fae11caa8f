"""Rows per expert for the routings the benchmark sweeps, as host lists summing to M (or 0)."""

import numpy as np

ROUTINGS = ("uniform", "skewed", "some-empty", "skewed-some-empty", "all-empty")


def _spread(total, weights):
    """Integer sizes proportional to `weights` that sum to `total` (largest remainders first)."""
    weights = np.asarray(weights, dtype=np.float64)
    exact = total * weights / weights.sum()
    sizes = np.floor(exact).astype(np.int64)
    for i in np.argsort(sizes - exact)[: total - int(sizes.sum())]:
        sizes[i] += 1
    return sizes


def group_sizes(routing, experts, tokens, seed=0):
    """Rows per expert. uniform: equal; skewed: Zipf-like (expert of rank r gets ~1/r of the
    rows, ranks shuffled so the busy experts are not all first); some-empty: every fourth
    expert (a quarter, rounded down) gets none, the rest share equally; skewed-some-empty:
    the same quarter gets none, the rest share by Dirichlet(1) weights (closest to real
    router traffic); all-empty: none at all."""
    if routing == "uniform":
        sizes = _spread(tokens, np.ones(experts))
    elif routing == "skewed":
        zipf = 1.0 / np.arange(1, experts + 1)
        sizes = _spread(tokens, np.random.default_rng(seed).permutation(zipf))
    elif routing in ("some-empty", "skewed-some-empty"):
        busy = np.arange(experts) % 4 != 3
        weights = (np.ones(int(busy.sum())) if routing == "some-empty" else
                   np.random.default_rng(seed).dirichlet(np.ones(int(busy.sum()))))
        sizes = np.zeros(experts, np.int64)
        sizes[busy] = _spread(tokens, weights)
    elif routing == "all-empty":
        sizes = np.zeros(experts, np.int64)
    else:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
    return [int(s) for s in sizes]
