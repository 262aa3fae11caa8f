"""The fused expert MLP (expert_mlp) against the composition it replaces (permute, the
grouped MLP, unpermute), forward+backward, in PyTorch and JAX, in one run.

Each cell (framework, shape, dtype) measures the fused op and the composition on the same
weights, tokens and skewed routing (Zipf-like expert shares, every fourth expert idle):

- saved bytes: the activations kept for the backward (torch: every tensor autograd saves,
  one count per storage, parameters left out; JAX: the arrays jax.vjp's backward holds, the
  weights left out; the integer routing counted);
- peak bytes: how far the process's resident memory rises above where it was during one
  forward+backward, outputs and gradients included (a fresh process per measurement,
  large allocations returned to the system when freed, so freed memory is not counted);
  on CUDA, how far torch's allocator rises (its peak statistic; not measured for JAX);
- time: the median forward+backward, the two calls interleaved round-robin.

The hot-expert shape routes each token (top-1) to one expert with probability 0.7, to the
others evenly otherwise: a collapsing router, where that expert's GEMMs outweigh the rest.

On CUDA (--device cuda) each cell runs under each of --kernels: GROUPGEMM_CUDA_KERNEL unset
("default": the fused op's CUTLASS 2.x gathered GEMMs) or set ("sm90" on Hopper: the
gathered GEMMs through the sm_90a gathered GEMM, the composition's on the sm90 kernels).

Before timing, the two results (output and every gradient) are compared (largest
relative error, by norm); a disagreement fails the run. Prints a markdown table of each
quantity and its fused / composed ratio, and writes the results as JSON.
Example: python benchmarks/expert_mlp_fused.py --frameworks torch jax --dtype bfloat16 float32
"""

import argparse
import gc
import json
import os
import subprocess
import sys

import numpy as np
from bench import machine
from contenders import set_kernel_family
from expert_mlp_report import markdown_table, planned_cells
from kernel_table import DEFAULT_KERNEL
from progress import Progress
from timing import interleaved_medians

# Qwen3-30B-A3B's experts have H = 2048, F = 768 (E = 128, top-8): here at half the widths,
# with 16 experts, top-4 and 4096 tokens (16384 routed rows), so that a forward+backward
# takes about a second on 2 cores and the activations outweigh the weights, as in training.
SHAPES = {
    "qwen3-30b-a3b/2": dict(tokens=4096, hidden=1024, ffn=384, experts=16, top_k=4),
    "small-F": dict(tokens=4096, hidden=1024, ffn=128, experts=16, top_k=4),
    "hot-expert": dict(tokens=8192, hidden=1024, ffn=384, experts=16, top_k=1),
}
HOT_SHARE = 0.7  # of the hot-expert shape's tokens on its expert 0
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
VARIANTS = ("fused", "composed")
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "expert_mlp_fused.json")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=list(TOLERANCE))
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b/2", "small-F"], choices=list(SHAPES))
    p.add_argument("--scale", type=float, default=1.0, help="multiplies T, H, F (a quick run: 0.125)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per variant (median)")
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timed calls per variant and cell")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--kernels", nargs="+", default=[DEFAULT_KERNEL],
                   help="on CUDA, the GROUPGEMM_CUDA_KERNEL values each cell runs under ('default': unset)")
    p.add_argument("--json", default=DEFAULT_JSON, help="where to write the results")
    p.add_argument("--peak-of", nargs=4, metavar=("FRAMEWORK", "VARIANT", "SHAPE", "DTYPE"),
                   help=argparse.SUPPRESS)  # the child process of one peak measurement
    return p.parse_args(argv)


def dims(shape, scale):
    d = dict(SHAPES[shape])
    for key in ("tokens", "hidden", "ffn"):
        d[key] = max(8, int(d[key] * scale))
    return d


def skewed_routing(tokens, experts, top_k, seed=0):
    """[T, k] distinct experts per token drawn with Zipf-like shares; every fourth expert idle."""
    rng = np.random.default_rng(seed)
    weights = np.where(np.arange(experts) % 4 == 3, 0.0, 1.0 / (1.0 + np.arange(experts)))
    return np.stack([rng.choice(experts, size=top_k, replace=False, p=weights / weights.sum())
                     for _ in range(tokens)]).astype(np.int32)


def hot_routing(tokens, experts, seed=0):
    """[T, 1]: expert 0 with probability HOT_SHARE, else one of the others evenly."""
    rng = np.random.default_rng(seed)
    others = rng.integers(1, experts, size=(tokens, 1))
    return np.where(rng.uniform(size=(tokens, 1)) < HOT_SHARE, 0, others).astype(np.int32)


def inputs(shape, scale, seed=0):
    d = dims(shape, scale)
    rng = np.random.default_rng(seed)
    t, h, f, e, k = d["tokens"], d["hidden"], d["ffn"], d["experts"], d["top_k"]
    return dict(tokens=rng.standard_normal((t, h)), probs=rng.uniform(0.05, 0.5, (t, k)),
                w_in=rng.standard_normal((e, 2 * f, h)) / np.sqrt(h), w_out=rng.standard_normal((e, h, f)) / np.sqrt(f),
                dout=rng.standard_normal((t, h)),
                indices=hot_routing(t, e, seed) if shape == "hot-expert" else skewed_routing(t, e, k, seed)), d


# ---- the two frameworks: (forward+backward of a variant, its saved bytes) ---------------------


def torch_cell(x, dtype_name, device):
    import torch

    import groupgemm.torch as gt
    from groupgemm.torch_ext.expert_mlp import composed_expert_mlp

    dtype = getattr(torch, dtype_name)
    e, f_in, h = x["w_in"].shape
    mlp = gt.GroupedMLP(e, h, f_in // 2, dtype=dtype).to(device)
    with torch.no_grad():
        mlp.fc1.weight.copy_(torch.from_numpy(x["w_in"]))
        mlp.fc2.weight.copy_(torch.from_numpy(x["w_out"]))
    tokens = torch.from_numpy(x["tokens"]).to(device, dtype).requires_grad_()
    probs = torch.from_numpy(x["probs"]).to(device, torch.float32).requires_grad_()
    indices, dout = torch.from_numpy(x["indices"]).to(device), torch.from_numpy(x["dout"]).to(device, dtype)
    leaves = (tokens, probs, mlp.fc1.weight, mlp.fc2.weight)
    forwards = {"fused": lambda: gt.expert_mlp(tokens, indices, probs, mlp.fc1.weight, mlp.fc2.weight,
                                               transpose_weight=True),
                "composed": lambda: composed_expert_mlp(tokens, indices, probs, mlp)}

    def forward_backward(variant):
        out = forwards[variant]()
        result = (out.detach(), *torch.autograd.grad(out, leaves, dout))
        if device == "cuda":
            torch.cuda.synchronize()  # the time is the GPU's work, not its launch
        return result

    def saved_bytes(variant):
        storages, parameters = {}, {p.untyped_storage().data_ptr() for p in mlp.parameters()}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in parameters:
                storages[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forwards[variant]()
        del out
        return sum(storages.values())

    return forward_backward, saved_bytes, lambda r: [t.double().cpu().numpy() for t in r]


def torch_cuda_peak_bytes(forward_backward, variant):
    """How far torch's CUDA allocator rises above its level during one forward+backward."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward_backward(variant)
    return torch.cuda.max_memory_allocated() - before


def jax_cell(x, dtype_name, device):
    import jax
    import jax.numpy as jnp

    import groupgemm.jax as gj
    from groupgemm.jax_ext.expert_mlp import composed_expert_mlp

    dtype = jnp.dtype(dtype_name)
    place = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    tokens, w_in, w_out, dout = (jax.device_put(jnp.asarray(x[n], dtype), place)
                                 for n in ("tokens", "w_in", "w_out", "dout"))
    probs, indices = (jax.device_put(a, place) for a in (jnp.asarray(x["probs"], jnp.float32),
                                                         jnp.asarray(x["indices"])))
    functions = {"fused": gj.expert_mlp, "composed": composed_expert_mlp}

    def layer(variant):
        return lambda t, p, a, b: functions[variant](t, indices, p, a, b, transpose_rhs=True)

    steps = {}
    for variant in VARIANTS:
        def step(t, p, a, b, g, f=layer(variant)):
            out, vjp = jax.vjp(f, t, p, a, b)
            return (out, *vjp(g))

        steps[variant] = jax.jit(step)

    def forward_backward(variant):
        return jax.block_until_ready(steps[variant](tokens, probs, w_in, w_out, dout))

    def saved_bytes(variant):
        """What jax.vjp's backward closes over, less one array of each weight's shape (the
        parameters; eager vjp holds copies of them)."""
        _, backward = jax.vjp(layer(variant), tokens, probs, w_in, w_out)
        weights = [(w.shape, w.dtype) for w in (w_in, w_out)]
        total = 0
        for leaf in jax.tree_util.tree_leaves(backward):
            if (leaf.shape, leaf.dtype) in weights:
                weights.remove((leaf.shape, leaf.dtype))
            else:
                total += leaf.nbytes
        return total

    return forward_backward, saved_bytes, lambda r: [np.asarray(a, np.float64) for a in r]


CELLS = {"torch": torch_cell, "jax": jax_cell}


# ---- peak memory, in a child process ---------------------------------------------------------


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def peak_child(framework, variant, shape, dtype, scale):
    """Prints how far resident memory rises above its level during one forward+backward
    (after a warm-up one: compiled, caches filled)."""
    x, _ = inputs(shape, scale)
    forward_backward, _, _ = CELLS[framework](x, dtype, "cpu")
    result = forward_backward(variant)
    del result
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the high-water mark (VmHWM) to the current size
    before = _status("VmRSS")
    forward_backward(variant)
    print(_status("VmHWM") - before)


def peak_bytes(framework, variant, shape, dtype, scale):
    # Every allocation of 128 KiB or more gets its own mapping, returned when freed.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--scale", str(scale), "--peak-of", framework,
                           variant, shape, dtype], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"peak measurement failed: {proc.stderr.strip().splitlines()[-1:]}")
    return int(proc.stdout.split()[-1])


# ---- a run ------------------------------------------------------------------------------------


def relative_error(got, want):
    scale = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (scale if scale > 0 else 1.0))


def run_cell(framework, shape, dtype, kernel, args, progress):
    label = f"{framework} {shape} {dtype}" + (f" {kernel}" if args.device == "cuda" else "")
    set_kernel_family(kernel)
    x, d = inputs(shape, args.scale)
    forward_backward, saved_bytes, as_numpy = CELLS[framework](x, dtype, args.device)
    progress.show(f"{label}: check")
    fused, composed = (as_numpy(forward_backward(v)) for v in VARIANTS)
    error = max(relative_error(a, b) for a, b in zip(fused, composed))
    row = {"framework": framework, "shape": shape, "dtype": dtype, "device": args.device, "kernel": kernel, **d,
           "idle_experts": int(d["experts"] - len(np.unique(x["indices"]))), "max_rel_error": error,
           "check": "ok" if error <= TOLERANCE[dtype] else "FAIL"}
    for variant in VARIANTS:
        row[f"{variant}_saved_bytes"] = saved_bytes(variant)
    progress.show(f"{label}: peak memory")
    for variant in VARIANTS:
        if args.device == "cpu":
            row[f"{variant}_peak_bytes"] = peak_bytes(framework, variant, shape, dtype, args.scale)
        elif framework == "torch":
            row[f"{variant}_peak_bytes"] = torch_cuda_peak_bytes(forward_backward, variant)
    medians = interleaved_medians({v: lambda v=v: forward_backward(v) for v in VARIANTS}, args.repeats, args.budget,
                                  on_round=lambda i, n: progress.show(f"{label}: timing round {i + 1}/{n}"),
                                  shuffle_seed=0)
    for variant, (seconds, samples) in medians.items():
        row[f"{variant}_ms"], row[f"{variant}_samples"] = seconds * 1e3, samples
    for quantity in ("saved_bytes", "peak_bytes", "ms"):  # a peak can be 0 on a tiny shape: no page grew
        if f"fused_{quantity}" in row:
            row[f"{quantity}_ratio"] = row[f"fused_{quantity}"] / max(row[f"composed_{quantity}"], 1e-9)
    progress.step(label)
    return row


def write_json(args, argv, rows):
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        command = "python benchmarks/expert_mlp_fused.py " + " ".join(sys.argv[1:] if argv is None else argv)
        json.dump({"command": command, "machine": machine(args.device), "results": rows}, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    if args.peak_of:
        peak_child(*args.peak_of, args.scale)
        return 0
    kernels = args.kernels if args.device == "cuda" else [DEFAULT_KERNEL]
    todo = planned_cells(args.frameworks, args.shapes, args.dtype, kernels)
    progress = Progress(len(todo))
    rows = []
    for cell in todo:
        rows.append(run_cell(*cell, args, progress))
        write_json(args, argv, rows)  # after every cell: a run stopped at a time limit keeps what it measured
    progress.close()
    print(f"\nexpert_mlp (fused) against permute + grouped MLP + unpermute (composed), SwiGLU, forward+backward, "
          f"{args.device.upper()}; skewed routing with every fourth expert idle (hot-expert: {HOT_SHARE} of the "
          f"tokens on one expert, top-1)\n")
    print(markdown_table(rows))
    print(f"\nwrote {args.json}")
    bad = [r for r in rows if r["check"] == "FAIL"]
    for r in bad:
        print(f"{r['framework']} {r['shape']} {r['dtype']}: fused and composed disagree ({r['max_rel_error']:.1e})",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
