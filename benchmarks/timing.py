"""The benchmarks' timer: medians of calls interleaved round-robin."""

import random
import time


def _seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def wait_until_quiet(window_s=0.005, max_wait_s=0.5):
    """Returns once this process has used almost no CPU for one window (or after
    max_wait_s). A call can leave work running after its result is ready: XLA frees a
    program's temporaries on its own threads, about 40 ms of CPU after each float32
    G = 8 `jax.lax.ragged_dot` forward+backward (its gigabyte of temporaries), which
    would otherwise slow whichever call comes next on a 2-core machine. Waiting charges
    that work to no one, so the contender that leaves it is, if anything, favoured."""
    deadline = time.perf_counter() + max_wait_s
    while time.perf_counter() < deadline:
        cpu = time.process_time()
        time.sleep(window_s)
        if time.process_time() - cpu < 0.1 * window_s:
            return


def interleaved_medians(fns, repeats, budget_s=float("inf"), on_round=None, settle=False, shuffle_seed=None):
    """Median wall time of each fn in `fns` (a dict), sampled round-robin.

    Each round calls every fn once, so a slow-down of the machine (another process
    compiling, frequency changes) hits all of them alike and their ratios stay fair. With
    `shuffle_seed`, each round calls them in a fresh (seeded) order, so no fn always
    follows the same one: a call that leaves work behind (an autograd backward's freed
    graph, a thread pool winding down) then slows each of the others alike, instead of
    always whichever comes next.
    After one warm-up call each, a fn gets `repeats` samples, or fewer when that would
    take longer than `budget_s` (at least one): a 10 s call is not worth 5 samples.
    Every fn must wait for its own result. With `settle`, each sample starts once the
    process is quiet (wait_until_quiet): for calls of milliseconds and more.
    Returns {name: (median seconds, samples)}.
    """
    wanted = {}
    for name, fn in fns.items():
        affordable = budget_s / max(_seconds(fn), 1e-9)
        wanted[name] = max(1, int(min(repeats, affordable)))
    samples = {name: [] for name in fns}
    order = random.Random(shuffle_seed) if shuffle_seed is not None else None
    names = list(fns)
    for round_index in range(max(wanted.values(), default=0)):
        if on_round is not None:
            on_round(round_index, max(wanted.values()))
        if order is not None:
            order.shuffle(names)
        for name in names:
            fn = fns[name]
            if len(samples[name]) < wanted[name]:
                if settle:
                    wait_until_quiet()
                samples[name].append(_seconds(fn))
    return {name: (sorted(t)[len(t) // 2], len(t)) for name, t in samples.items()}
