"""transformers' experts implementations on one MoE layer's experts: "groupgemm" against the
built-in "grouped_mm", "batched_mm" and "eager", in one interleaved run.

The experts module is transformers' own Qwen3MoeExperts (the "@use_experts_implementation"
class of Qwen3-MoE) at Qwen3-30B-A3B's expert shape (hidden 2048, moe_intermediate 768, 128
experts, top-8) divided by --scale in its two widths (the expert count and top-k kept: they
set the grouping work). Each implementation is the function transformers' ExpertsInterface
holds under its name, called on the same module, hidden states and routing (softmax top-k
of random router logits, renormalized, as Qwen3-MoE routes).

Cells: at training / prefill token counts, the forward (under torch.no_grad, as prefill runs)
and forward+backward (gradients of the hidden states, the routing weights and both expert
weights); at decode token counts, the forward. Before timing, each implementation's output
is compared once with eager's (relative error by norm); a disagreement fails the run.
batched_mm gathers a copy of the expert weights for every token slot: cells where that copy
would exceed --max-gather-gb are reported, not run. Calls are interleaved round-robin
(timing.py), so machine noise hits every implementation alike.

Prints a markdown table of median milliseconds and each built-in's time over groupgemm's,
and writes the results as JSON, after every cell (a run stopped early keeps the cells it
finished; the GPU kit reads them back).
Example: python benchmarks/transformers_experts.py --dtype bfloat16 --train-tokens 1024 4096
"""

import argparse
import json
import os
import sys

import torch
from bench import machine
from progress import Progress
from timing import interleaved_medians
from transformers_report import BATCHED_MM, EAGER, GROUPGEMM, IMPLEMENTATIONS, markdown_table, planned_cells

QWEN3_30B_A3B = {"hidden": 2048, "ffn": 768, "experts": 128, "top_k": 8}
# Largest relative error (by norm) to eager allowed: float32 differs in summation order;
# bfloat16 rounds the intermediate activations at different points.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "transformers_experts.json")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=list(TOLERANCE))
    p.add_argument("--scale", type=int, default=4, help="divides Qwen3-30B-A3B's hidden and expert widths")
    p.add_argument("--experts", type=int, default=QWEN3_30B_A3B["experts"])
    p.add_argument("--top-k", type=int, default=QWEN3_30B_A3B["top_k"])
    p.add_argument("--train-tokens", type=int, nargs="+", default=[1024, 4096],
                   help="tokens of a training / prefill step (forward, and forward+backward)")
    p.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 8, 32],
                   help="tokens of a decode step (forward)")
    p.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    p.add_argument("--max-gather-gb", type=float, default=2.0,
                   help="largest copy of the expert weights batched_mm may gather (GB)")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per implementation (median)")
    p.add_argument("--decode-repeats", type=int, default=30,
                   help="timed calls per implementation at decode sizes, where a call takes milliseconds")
    p.add_argument("--budget", type=float, default=8.0, help="seconds of timed calls per implementation and cell")
    p.add_argument("--json", default=DEFAULT_JSON, help="where to write the results")
    return p.parse_args(argv)


def experts_module(args, dtype, device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=QWEN3_30B_A3B["hidden"] // args.scale,
                            moe_intermediate_size=QWEN3_30B_A3B["ffn"] // args.scale, num_experts=args.experts,
                            num_experts_per_tok=args.top_k)
    torch.manual_seed(0)
    module = Qwen3MoeExperts(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def implementations(names):
    """{name: fn(module, hidden_states, top_k_index, top_k_weights)} as transformers calls them."""
    from transformers.integrations.moe import ExpertsInterface

    import groupgemm.integrations.transformers  # noqa: F401  (registers "groupgemm")

    interface = ExpertsInterface()
    return {name: interface.get_interface(name, None) if name != EAGER else None for name in names}


def routing(tokens, args, dtype, device):
    generator = torch.Generator().manual_seed(tokens)
    probs = torch.softmax(torch.randn(tokens, args.experts, generator=generator), dim=-1)
    weights, index = probs.topk(args.top_k, dim=-1)
    return index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device=device, dtype=dtype)


def gather_gb(module, tokens, args):
    """What batched_mm copies: each slot's two expert weights."""
    per_expert = (module.gate_up_proj[0].numel() + module.down_proj[0].numel()) * module.down_proj.element_size()
    return tokens * args.top_k * per_expert / 1e9


def relative_error(got, want):
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    scale = torch.linalg.vector_norm(want).item()
    return torch.linalg.vector_norm(got - want).item() / (scale if scale > 0 else 1.0)


def run_cell(module, fns, phase, tokens, dtype_name, args, progress):
    device = module.down_proj.device
    dtype = module.down_proj.dtype
    index, weights = routing(tokens, args, dtype, device)
    x = torch.randn(tokens, module.down_proj.shape[1], dtype=dtype, device=device)
    dout = torch.randn_like(x)
    params = [module.gate_up_proj, module.down_proj]
    eager = type(module).forward.__wrapped__

    def call(name):
        fn = fns[name] or eager
        if phase == "forward+backward":
            xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
            torch.autograd.grad(fn(module, xg, index, wg), [xg, wg, *params], dout)
        else:
            with torch.no_grad():
                fn(module, x, index, weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    label = f"{dtype_name} {phase} T={tokens}"
    base = {"dtype": dtype_name, "phase": phase, "tokens": tokens, "device": device.type}
    rows, calls = {}, {}
    progress.show(f"{label}: check")
    with torch.no_grad():
        want = eager(module, x, index, weights)
    for name in fns:
        row = rows[name] = {**base, "impl": name}
        if name == BATCHED_MM and gather_gb(module, tokens, args) > args.max_gather_gb:
            row["error"] = f"not run: would gather {gather_gb(module, tokens, args):.1f} GB of expert weights"
            continue
        try:
            with torch.no_grad():
                got = (fns[name] or eager)(module, x, index, weights)
        except Exception as exc:  # an implementation that cannot run this cell is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            continue
        row["max_rel_error"] = relative_error(got, want)
        row["check"] = "ok" if row["max_rel_error"] <= TOLERANCE[dtype_name] else "FAIL"
        calls[name] = lambda name=name: call(name)
    repeats = args.decode_repeats if phase == "decode forward" else args.repeats
    medians = interleaved_medians(calls, repeats, args.budget, shuffle_seed=0,
                                  on_round=lambda i, n: progress.show(f"{label}: timing round {i + 1}/{n}"))
    for name, (seconds, samples) in medians.items():
        rows[name]["ms"], rows[name]["samples"] = seconds * 1e3, samples
    ours = rows.get(GROUPGEMM, {}).get("ms")
    for row in rows.values():
        if "ms" in row and ours:
            row["vs_groupgemm"] = row["ms"] / ours
    progress.step(label)
    return list(rows.values())


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    names = [n for n in IMPLEMENTATIONS if n in args.implementations]
    fns = implementations(names)
    todo = planned_cells(args.dtype, args.train_tokens, args.decode_tokens)
    import transformers

    shape = {"hidden": QWEN3_30B_A3B["hidden"] // args.scale, "moe_intermediate": QWEN3_30B_A3B["ffn"] // args.scale,
             "experts": args.experts, "top_k": args.top_k}
    document = {"command": "python benchmarks/transformers_experts.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": machine(args.device),
        "transformers": transformers.__version__, "shape": shape, "results": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    progress = Progress(len(todo))
    rows, modules = document["results"], {}
    for dtype_name, phase, tokens in todo:
        if dtype_name not in modules:
            modules[dtype_name] = experts_module(args, getattr(torch, dtype_name), device)
        rows += run_cell(modules[dtype_name], fns, phase, tokens, dtype_name, args, progress)
        # After every cell, whole or not at all: a run stopped at a time limit keeps what it measured.
        with open(args.json + ".part", "w") as f:
            json.dump(document, f, indent=1)
        os.replace(args.json + ".part", args.json)
    progress.close()
    module = next(iter(modules.values()))
    print(f"\ntransformers {transformers.__version__} experts implementations, Qwen3MoeExperts with hidden "
          f"{module.down_proj.shape[1]}, moe_intermediate {module.down_proj.shape[2]}, {args.experts} experts, "
          f"top-{args.top_k} (Qwen3-30B-A3B's widths / {args.scale}), {args.device}, torch {torch.__version__}; "
          "medians of interleaved calls; a ratio above 1 is groupgemm faster\n")
    print(markdown_table(rows, names))
    print(f"\nwrote {args.json}")
    bad = [r for r in rows if (r["impl"] == GROUPGEMM and r.get("error")) or r.get("check") == "FAIL"]
    for r in bad:
        print(f"{r['impl']} {r['dtype']} {r['phase']} T={r['tokens']}: {r.get('error') or 'disagrees with eager'}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
