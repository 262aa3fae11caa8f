"""The benchmarks' timer: medians of calls interleaved round-robin."""

import time


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(fns, repeats, budget_s=float("inf"), on_round=None):
    """Median wall time of each fn in `fns` (a dict), sampled round-robin.

    Each round calls every fn once, so a slow-down of the machine (another process
    compiling, frequency changes) hits all of them alike and their ratios stay fair.
    After one warm-up call each, a fn gets `repeats` samples, or fewer when that would
    take longer than `budget_s` (at least one): a 10 s call is not worth 5 samples.
    Every fn must wait for its own result. Returns {name: (median seconds, samples)}.
    """
    wanted = {}
    for name, fn in fns.items():
        affordable = budget_s / max(_seconds(fn), 1e-9)
        wanted[name] = max(1, int(min(repeats, affordable)))
    samples = {name: [] for name in fns}
    for round_index in range(max(wanted.values(), default=0)):
        if on_round is not None:
            on_round(round_index, max(wanted.values()))
        for name, fn in fns.items():
            if len(samples[name]) < wanted[name]:
                samples[name].append(_seconds(fn))
    return {name: (sorted(t)[len(t) // 2], len(t)) for name, t in samples.items()}
