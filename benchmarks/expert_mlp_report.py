"""The fused expert MLP benchmark's rows (benchmarks/expert_mlp_fused.py) as a markdown table
and a one-line digest. Standard library only: the GPU kit reads the benchmark's JSON back
with it before anything is installed."""


def planned_cells(frameworks, shapes, dtypes, kernels):
    """[(framework, shape, dtype, kernel)] in the order the benchmark runs them."""
    return [(f, s, d, k) for f in frameworks for s in shapes for d in dtypes for k in kernels]


def cell(row):
    return row["framework"], row["shape"], row["dtype"], row["kernel"]


def digest(rows):
    """Each timed cell's fused / composed time ratio, on one line."""
    return ", ".join(f"{r['framework']} {r['shape']} {r['kernel']} {r['ms_ratio']:.2f}" for r in rows
                     if "ms_ratio" in r)


def _pair(row, quantity, unit):
    """fused / composed (ratio), or "not measured"."""
    if f"{quantity}_ratio" not in row:
        return "not measured"
    return (f"{row[f'fused_{quantity}'] / unit:.1f} / {row[f'composed_{quantity}'] / unit:.1f} "
            f"({row[f'{quantity}_ratio']:.2f})")


def markdown_table(rows):
    """The cells as a markdown table; on CUDA with a column for the kernel choice."""
    mib = 2.0**20
    cuda = any(r.get("device") == "cuda" for r in rows)
    lines = ["| framework | shape | dtype |" + (" kernels |" if cuda else "") +
             " saved MiB fused / composed (ratio) | peak MiB fused / composed (ratio) "
             "| fwd+bwd ms fused / composed (ratio) | max rel. error |",
             "|---|---|---|" + ("---|" if cuda else "") + "---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['framework']} | {r['shape']} | {r['dtype']} |" + (f" {r['kernel']} |" if cuda else "") +
                     f" {_pair(r, 'saved_bytes', mib)} | {_pair(r, 'peak_bytes', mib)} | {_pair(r, 'ms', 1.0)} "
                     f"| {r['check']} ({r['max_rel_error']:.0e}) |")
    return "\n".join(lines)
