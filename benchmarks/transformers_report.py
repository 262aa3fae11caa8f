"""The transformers experts benchmark's rows (benchmarks/transformers_experts.py) as a markdown
table and a one-line digest. Standard library only: the GPU kit reads the benchmark's JSON
back with it before anything is installed."""

GROUPGEMM, GROUPED_MM, BATCHED_MM, EAGER = "groupgemm", "grouped_mm", "batched_mm", "eager"
IMPLEMENTATIONS = (GROUPGEMM, GROUPED_MM, BATCHED_MM, EAGER)
PHASES = ("forward", "forward+backward", "decode forward")  # in the order the benchmark runs them


def planned_cells(dtypes, train_tokens, decode_tokens):
    """[(dtype, phase, tokens)] in the order the benchmark runs them: at training / prefill
    token counts the forward and the forward+backward, at decode token counts the forward."""
    return [(dtype, phase, tokens) for dtype in dtypes
            for phase, counts in zip(PHASES, (train_tokens, train_tokens, decode_tokens)) for tokens in counts]


def cells(rows):
    """{(dtype, phase, tokens): {implementation: row}} in the rows' order."""
    out = {}
    for r in rows:
        out.setdefault((r["dtype"], r["phase"], r["tokens"]), {})[r["impl"]] = r
    return out


def fastest_built_in(cell):
    """The fastest built-in's time over groupgemm's in one cell, or None (nothing to compare)."""
    return min((r["vs_groupgemm"] for name, r in cell.items() if name != GROUPGEMM and "vs_groupgemm" in r),
               default=None)


def markdown_table(rows, names=IMPLEMENTATIONS):
    built_ins = [n for n in names if n != GROUPGEMM]
    lines = ["| dtype | cell | tokens | groupgemm ms | " + " | ".join(f"{n} / groupgemm" for n in built_ins)
             + " | fastest built-in / groupgemm |",
             "|---|---|---:|---:|" + "---:|" * len(built_ins) + "---:|"]
    for (dtype, phase, tokens), cell in cells(rows).items():
        ours = cell.get(GROUPGEMM, {})
        ratios = [cell[n].get("vs_groupgemm") if n in cell else None for n in built_ins]
        shown = [f"{v:.2f}" if v is not None else "n/a" for v in ratios]
        fastest = fastest_built_in(cell)
        lines.append(f"| {dtype} | {phase} | {tokens} | {ours.get('ms', float('nan')):.2f} | " + " | ".join(shown)
                     + f" | {'n/a' if fastest is None else f'{fastest:.2f}'} |")
    return "\n".join(lines)


def digest(rows):
    """Per phase, the range of the fastest built-in's time over groupgemm's, e.g.
    "forward+backward 0.81-0.93x"; a ratio above 1 is groupgemm faster."""
    by_phase = {}
    for (_, phase, _), cell in cells(rows).items():
        ratio = fastest_built_in(cell)
        if ratio is not None:
            by_phase.setdefault(phase, []).append(ratio)
    parts = []
    for phase in sorted(by_phase, key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES)):
        low, high = min(by_phase[phase]), max(by_phase[phase])
        parts.append(f"{phase} {low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{phase} {low:.2f}-{high:.2f}x")
    return ", ".join(parts)
