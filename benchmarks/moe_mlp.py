"""Expert MLP benchmark: groupgemm's GroupedMLP (SwiGLU) forward+backward against the same
MLP built from a per-expert loop of torch.nn.functional.linear and from torch._grouped_mm,
in one run.

Every contender multiplies the same weights (GroupedMLP's fc1.weight [G, 2F, H] and
fc2.weight [G, H, F]) and the same rows sorted by expert, and computes silu(gate) * up with
the gate the first F columns of fc1's output. Only the loop reads the group sizes on the
host; torch._grouped_mm takes the cumulative int32 row ends. Before timing, each
contender's output and gradients (input, fc1, fc2) are compared once with groupgemm's
(largest relative error, by norm); a disagreement fails the run. Calls are interleaved
round-robin (timing.py), so machine noise hits all contenders alike.

Prints a markdown table (median ms of forward+backward, and each contender's time over
groupgemm's) and writes the results as JSON.
Example: python benchmarks/moe_mlp.py --dtype float32 bfloat16 --experts 8 64
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from bench import machine
from progress import Progress
from routing import group_sizes
from timing import interleaved_medians

from groupgemm.torch import GroupedMLP

GROUPGEMM, LOOP, GROUPED_MM = "groupgemm", "per-expert loop", "torch._grouped_mm"
ROUTINGS = ("uniform", "skewed-some-empty")
# Largest relative error (by norm) to groupgemm allowed: float32 differs in summation
# order only; bfloat16 rounds the intermediate activations where the peers round too.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe_mlp.json")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=list(TOLERANCE))
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64], help="G, experts")
    p.add_argument("--tokens", type=int, default=4096, help="M, rows after top-k dispatch")
    p.add_argument("--hidden", type=int, default=1024, help="H, model width")
    p.add_argument("--ffn", type=int, default=1024, help="F, expert FFN width (fc1 makes 2F: gate and up)")
    p.add_argument("--routing", nargs="+", default=list(ROUTINGS), choices=ROUTINGS,
                   help="rows per expert: equal; Zipf-like with every fourth expert empty")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per contender (median)")
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timed calls per contender and configuration")
    p.add_argument("--json", default=DEFAULT_JSON, help="where to write the results")
    return p.parse_args(argv)


def routed_sizes(routing, experts, tokens):
    """Rows per expert, summing to `tokens`. skewed-some-empty: every fourth expert gets
    none, the others Zipf-like shares (benchmarks/routing.py's skewed)."""
    if routing == "uniform":
        return group_sizes("uniform", experts, tokens)
    sizes = np.zeros(experts, np.int64)
    busy = np.arange(experts) % 4 != 3
    sizes[busy] = group_sizes("skewed", int(busy.sum()), tokens)
    return [int(s) for s in sizes]


def per_expert_loop(x, w1, w2, sizes):
    counts = sizes.tolist()  # the loop needs the sizes on the host (a sync on a GPU); only this contender
    parts = []
    for rows, w_in, w_out in zip(torch.split(x, counts), w1, w2):
        gate, up = F.linear(rows, w_in).chunk(2, dim=-1)
        parts.append(F.linear(F.silu(gate) * up, w_out))
    return torch.cat(parts)


def grouped_mm_mlp(x, w1, w2, sizes):
    # _grouped_mm takes [G, K, N] weights (transposed views of [G, N, K]) and each group's
    # end row. Rows past the last end would be left unwritten; here the sizes sum to M.
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


def relative_error(got, want):
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    scale = torch.linalg.vector_norm(want).item()
    return torch.linalg.vector_norm(got - want).item() / (scale if scale > 0 else 1.0)


def run_config(dtype_name, experts, routing, args, progress):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    mlp = GroupedMLP(experts, args.hidden, args.ffn, activation="swiglu", dtype=dtype)
    w1, w2 = mlp.fc1.weight, mlp.fc2.weight
    x = torch.randn(args.tokens, args.hidden, dtype=dtype, requires_grad=True)
    dout = torch.randn(args.tokens, args.hidden, dtype=dtype)
    sizes_list = routed_sizes(routing, experts, args.tokens)
    sizes = torch.tensor(sizes_list, dtype=torch.int64)
    forwards = {GROUPGEMM: lambda: mlp(x, sizes),
                LOOP: lambda: per_expert_loop(x, w1, w2, sizes),
                GROUPED_MM: lambda: grouped_mm_mlp(x, w1, w2, sizes)}

    def forward_backward(forward):
        out = forward()
        return (out.detach(), *torch.autograd.grad(out, (x, w1, w2), dout))

    label = f"{dtype_name} G={experts} {routing}"
    base = {"dtype": dtype_name, "experts": experts, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
            "routing": routing, "empty_experts": sizes_list.count(0)}
    rows, calls = {}, {}
    progress.show(f"{label}: check")
    want = forward_backward(forwards[GROUPGEMM])
    for name, forward in forwards.items():
        row = rows[name] = {**base, "impl": name}
        try:
            got = forward_backward(forward)
        except Exception as exc:  # a contender that cannot run this case is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            continue
        error = max(relative_error(g, w) for g, w in zip(got, want))
        row["max_rel_error"] = error
        row["check"] = "ok" if error <= TOLERANCE[dtype_name] else "FAIL"
        calls[name] = lambda forward=forward: forward_backward(forward)
    medians = interleaved_medians(calls, args.repeats, args.budget,
                                  on_round=lambda i, n: progress.show(f"{label}: timing round {i + 1}/{n}"))
    for name, (seconds, samples) in medians.items():
        rows[name]["fwd_bwd_ms"] = seconds * 1e3
        rows[name]["samples"] = samples
    groupgemm_ms = rows[GROUPGEMM].get("fwd_bwd_ms")
    for row in rows.values():
        if "fwd_bwd_ms" in row and groupgemm_ms:
            row["vs_groupgemm"] = row["fwd_bwd_ms"] / groupgemm_ms
    progress.step(label)
    return list(rows.values())


def markdown_table(rows):
    lines = ["| dtype | G | routing | contender | fwd+bwd ms | time / groupgemm's | max rel. error vs groupgemm |",
             "|---|---:|---|---|---:|---:|---|"]
    for r in rows:
        if r.get("error"):
            ms = ratio = "n/a"
            check = f"error: {r['error'][:60]}"
        else:
            ms, ratio = f"{r['fwd_bwd_ms']:.1f}", f"{r['vs_groupgemm']:.2f}"
            check = f"{r['check']} ({r['max_rel_error']:.0e})"
        routing = r["routing"] + (f" ({r['empty_experts']} empty)" if r["empty_experts"] else "")
        lines.append(f"| {r['dtype']} | {r['experts']} | {routing} | {r['impl']} | {ms} | {ratio} | {check} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    todo = [(d, g, r) for d in args.dtype for g in args.experts for r in args.routing]
    progress = Progress(len(todo))
    rows = []
    for dtype_name, experts, routing in todo:
        rows += run_config(dtype_name, experts, routing, args, progress)
    progress.close()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"command": "python benchmarks/moe_mlp.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   "machine": machine("cpu"), "results": rows}, f, indent=1)
    print(f"\nGroupedMLP (SwiGLU) forward+backward, M={args.tokens}, H={args.hidden}, F={args.ffn}, CPU, "
          f"torch {torch.__version__}; medians of interleaved calls\n")
    print(markdown_table(rows))
    print(f"\nwrote {args.json}")
    bad = [r for r in rows if (r["impl"] == GROUPGEMM and r.get("error")) or r.get("check") == "FAIL"]
    for r in bad:
        what = r.get("error") or "disagrees with groupgemm"
        print(f"{r['impl']} {r['dtype']} G={r['experts']} {r['routing']}: {what}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
