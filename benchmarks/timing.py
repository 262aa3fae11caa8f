"""Shared pieces of the benchmark scripts: the problem-shape flags and a median timer."""

import time


def add_shape_arguments(parser, dtypes=("float32", "bfloat16"), repeats=5):
    parser.add_argument("--m", type=int, default=4096, help="rows (tokens x top-k)")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dtypes", nargs="+", default=list(dtypes))
    parser.add_argument("--repeats", type=int, default=repeats)


def median_seconds(fn, repeats):
    """Median wall time of fn() after one warm-up call; fn must wait for its own result."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
