"""Benchmark rows: the derived columns (GFLOP/s, ratios), CSV/JSON files, markdown tables."""

import csv
import json
import math

from contenders import DENSE, DENSE_KINDS, GROUPGEMM, GROUPGEMM_DENSE

CONFIG_COLUMNS = ["framework", "device", "dtype", "experts", "tokens", "hidden", "ffn", "routing"]
COLUMNS = CONFIG_COLUMNS + [
    "impl", "fwd_ms", "fwd_bwd_ms", "fwd_gflops", "fwd_bwd_gflops", "fwd_vs_dense", "fwd_bwd_vs_dense",
    "fwd_vs_groupgemm_dense", "fwd_bwd_vs_groupgemm_dense",
    "groupgemm_speedup_fwd", "groupgemm_speedup_fwd_bwd", "peak_mb", "xla_temp_mb",
    "check", "max_rel_error", "samples", "error",
]
MODES = (("fwd", 1.0), ("fwd_bwd", 3.0))  # forward+backward adds dlhs and drhs: 3x the FLOPs


def _ratio(numerator, denominator):
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def derive(rows, config):
    """Fills GFLOP/s, the ratios to the dense ceilings (the framework's GEMM and groupgemm's
    with one group) and groupgemm's speed-up over each peer, for the rows of one framework
    and configuration. With every expert empty there are no useful FLOPs and the dense
    ceilings mean nothing: those stay empty."""
    by_impl = {row["impl"]: row for row in rows}
    no_work = config.routed_rows == 0
    for row in rows:
        for mode, flop_factor in MODES:
            ms = row.get(f"{mode}_ms")
            flops = config.dense_flops if row["impl"] in DENSE_KINDS else config.forward_flops
            row[f"{mode}_gflops"] = None if no_work or not ms else flop_factor * flops / (ms * 1e-3) / 1e9
            for column, ceiling in (("vs_dense", DENSE), ("vs_groupgemm_dense", GROUPGEMM_DENSE)):
                ceiling_ms = by_impl.get(ceiling, {}).get(f"{mode}_ms")
                row[f"{mode}_{column}"] = None if no_work else _ratio(ceiling_ms, ms)
            groupgemm_ms = by_impl.get(GROUPGEMM, {}).get(f"{mode}_ms")
            is_peer = row["impl"] not in (GROUPGEMM, *DENSE_KINDS)
            row[f"groupgemm_speedup_{mode}"] = _ratio(ms, groupgemm_ms) if is_peer else None
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in COLUMNS})


def write_json(path, document):
    with open(path, "w") as f:
        json.dump(document, f, indent=1, default=str)


def _number(value, kind):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if kind == "ms":
        return f"{value:.3f}" if value < 1 else f"{value:.1f}" if value < 100 else f"{value:.0f}"
    if kind == "rate":
        return f"{value:.1f}" if value < 10 else f"{value:.0f}"
    if kind == "ratio":
        return f"{value:.2f}"
    if kind == "speedup":
        return f"{value:.1f}x" if value < 100 else f"{value:.0f}x"
    if kind == "mb":
        return f"{value:.0f}"
    return str(value)


def _check_cell(row):
    if row.get("error"):
        return f"error: {row['error'][:60]}"
    if row.get("check") in (None, "", "not checked"):
        return ""
    error = row.get("max_rel_error")
    return row["check"] if error is None else f"{row['check']} ({error:.0e})"


def _pair(row, key, kind):
    """'forward / forward+backward' in one cell, so the table stays narrow."""
    values = [row.get(key.format(mode=mode)) for mode, _ in MODES]
    if all(v is None for v in values):
        return ""
    return " / ".join(_number(v, kind) for v in values)


def markdown_table(rows, framework):
    """The rows of one framework as a markdown table (also readable in a terminal).
    Each cell holds 'forward / forward+backward'."""
    rows = [r for r in rows if r["framework"] == framework]
    several_shapes = len({(r["tokens"], r["hidden"], r["ffn"]) for r in rows}) > 1
    with_xla = any(r.get("xla_temp_mb") is not None for r in rows)
    head = (["dtype", "G", "routing"] + (["M,K,N"] if several_shapes else []) +
            ["impl", "ms", "GFLOP/s", "vs dense", "vs groupgemm dense", "groupgemm speed-up", "peak MB"] +
            (["XLA temp MB"] if with_xla else []) + ["check"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["dtype"], str(r["experts"]), r["routing"]]
        cells += [f"{r['tokens']},{r['hidden']},{r['ffn']}"] if several_shapes else []
        cells += [r["impl"], _pair(r, "{mode}_ms", "ms"), _pair(r, "{mode}_gflops", "rate"),
                  _pair(r, "{mode}_vs_dense", "ratio"), _pair(r, "{mode}_vs_groupgemm_dense", "ratio"),
                  _pair(r, "groupgemm_speedup_{mode}", "speedup"),
                  _number(r.get("peak_mb"), "mb")]
        cells += [_number(r.get("xla_temp_mb"), "mb")] if with_xla else []
        cells += [_check_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(rows, framework):
    """One line per configuration: groupgemm's time, its speed-up over each peer and its
    ratio to both dense ceilings, each cell 'forward / forward+backward'."""
    rows = [r for r in rows if r["framework"] == framework]
    peers = list(dict.fromkeys(r["impl"] for r in rows if r["impl"] not in (GROUPGEMM, *DENSE_KINDS)))
    head = ["dtype", "G", "routing", "groupgemm ms"] + [f"speed-up over {p}" for p in peers] + [
        "vs dense", "vs groupgemm dense"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["impl"] != GROUPGEMM:
            continue
        same = {x["impl"]: x for x in rows if all(x[c] == r[c] for c in CONFIG_COLUMNS)}
        cells = [r["dtype"], str(r["experts"]), r["routing"], _pair(r, "{mode}_ms", "ms")]
        cells += [_pair(same.get(p, {}), "groupgemm_speedup_{mode}", "speedup") for p in peers]
        cells += [_pair(r, "{mode}_vs_dense", "ratio"), _pair(r, "{mode}_vs_groupgemm_dense", "ratio")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def overhead_table(rows):
    lines = ["| framework | call | median µs |", "|---|---|---|"]
    lines += [f"| {r['framework']} | {r['call']} | {r.get('error') or format(r['median_us'], '.1f')} |"
              for r in rows]
    return "\n".join(lines)
