"""Benchmark rows: the derived columns (GFLOP/s, ratios), CSV/JSON files, markdown tables."""

import csv
import json
import math

from contenders import (
    DENSE,
    DENSE_KINDS,
    GROUPED_MM,
    GROUPGEMM,
    GROUPGEMM_DENSE,
    RAGGED_DOT,
    is_groupgemm_kernel,
    is_hopper_contender,
)

CONFIG_COLUMNS = ["framework", "device", "dtype", "experts", "tokens", "hidden", "ffn", "routing"]
COLUMNS = CONFIG_COLUMNS + [
    "impl", "fwd_ms", "fwd_bwd_ms", "fwd_gflops", "fwd_bwd_gflops", "fwd_vs_dense", "fwd_bwd_vs_dense",
    "fwd_vs_groupgemm_dense", "fwd_bwd_vs_groupgemm_dense",
    "groupgemm_speedup_fwd", "groupgemm_speedup_fwd_bwd", "peak_mb", "xla_temp_mb",
    "check", "max_rel_error", "samples", "error",
]
MODES = (("fwd", 1.0), ("fwd_bwd", 3.0))  # forward+backward adds dlhs and drhs: 3x the FLOPs
# The speed groupgemm must reach on Hopper: forward+backward (a training step) at least as
# fast as torch._grouped_mm on the same groups, in PyTorch and in JAX (against torch's
# time at the same shape); the fraction of dense cuBLAS is shown beside it.
HOPPER_TARGET_OVER_GROUPED_MM = 1.0
TARGETS_TITLE = ("Hopper speed target, forward+backward: groupgemm's kernels at least "
                 f"{HOPPER_TARGET_OVER_GROUPED_MM:.1f}x torch._grouped_mm")


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


def failed_checks(rows):
    """The rows of groupgemm's kernels whose result was wrong or missing: they fail a run."""
    return [r for r in rows if is_groupgemm_kernel(r["impl"]) and r.get("check") != "ok"]


def target_rows(rows):
    """Each groupgemm kernel's forward+backward in either framework at each configuration
    on Hopper (one with kernel-family contenders and PyTorch's dense and torch._grouped_mm
    times): {config, framework, impl, ms, vs_dense, over_grouped_mm, met, problem}. A kernel
    with a wrong result or no time is judged too, as not met."""
    shape_columns = [c for c in CONFIG_COLUMNS if c != "framework"]
    key = lambda r: tuple(r[c] for c in shape_columns)  # noqa: E731
    out = []
    for config in dict.fromkeys(map(key, rows)):
        same = [r for r in rows if key(r) == config]
        torch_rows = {r["impl"]: r for r in same if r["framework"] == "torch"}
        dense_ms, grouped_ms = (torch_rows.get(name, {}).get("fwd_bwd_ms") for name in (DENSE, GROUPED_MM))
        if not (dense_ms and grouped_ms and any(map(is_hopper_contender, torch_rows))):
            continue
        for r in same:
            if not is_groupgemm_kernel(r["impl"]):
                continue
            ms = r.get("fwd_bwd_ms")
            vs_dense, over_grouped = _ratio(dense_ms, ms), _ratio(grouped_ms, ms)
            problem = r.get("error") or ("" if r.get("check") == "ok" else f"check: {r.get('check')}")
            met = not problem and over_grouped is not None and over_grouped >= HOPPER_TARGET_OVER_GROUPED_MM
            out.append({"config": dict(zip(shape_columns, config)), "framework": r["framework"], "impl": r["impl"],
                        "ms": ms, "vs_dense": vs_dense, "over_grouped_mm": over_grouped, "met": met,
                        "problem": problem})
    return out


def targets_table(rows):
    """The Hopper speed target against each groupgemm kernel: a title, a markdown table and
    one line per kernel saying at how many configurations it met it. Empty off Hopper."""
    judged = target_rows(rows)
    if not judged:
        return ""
    lines = [TARGETS_TITLE, "", "| dtype | G | M,K,N | routing | framework | groupgemm kernel | fwd+bwd ms | "
             "vs dense | over `_grouped_mm` | met |", "|" + "---|" * 10]
    for j in judged:
        c = j["config"]
        verdict = "yes" if j["met"] else f"no ({j['problem'][:60]})" if j["problem"] else "no"
        lines.append(f"| {c['dtype']} | {c['experts']} | {c['tokens']},{c['hidden']},{c['ffn']} | {c['routing']} | "
                     f"{j['framework']} | {j['impl']} | {_number(j['ms'], 'ms')} | {_number(j['vs_dense'], 'ratio')} | "
                     f"{_number(j['over_grouped_mm'], 'ratio')} | {verdict} |")
    lines.append("")
    for framework, impl in dict.fromkeys((j["framework"], j["impl"]) for j in judged):
        mine = [j for j in judged if (j["framework"], j["impl"]) == (framework, impl)]
        lines.append(f"{framework} {impl}: met at {sum(j['met'] for j in mine)} of {len(mine)} configurations")
    return "\n".join(lines)


def digest(rows):
    """Per framework: groupgemm's forward+backward TFLOP/s and its speed-up over the
    framework's own grouped GEMM (torch._grouped_mm, jax.lax.ragged_dot), as ranges."""
    parts = []
    for framework in sorted({r["framework"] for r in rows}):
        mine = [r for r in rows if r["framework"] == framework and r["impl"] == GROUPGEMM
                and r.get("fwd_bwd_gflops") is not None]
        if not mine:
            continue
        tflops = [r["fwd_bwd_gflops"] / 1e3 for r in mine]
        text = f"{framework} fwd+bwd {min(tflops):.3g}-{max(tflops):.3g} TFLOP/s"
        peer = {"torch": GROUPED_MM, "jax": RAGGED_DOT}.get(framework)
        speedups = [r["groupgemm_speedup_fwd_bwd"] for r in rows if r["framework"] == framework
                    and r["impl"] == peer and r.get("groupgemm_speedup_fwd_bwd") is not None]
        if speedups:
            text += f", {min(speedups):.2f}-{max(speedups):.2f}x {peer}"
        parts.append(text)
    return "; ".join(parts)


def overhead_table(rows):
    """One line per framework and call: groupgemm's median, the peer's (the framework's own
    grouped GEMM, or the floor op) and groupgemm's time over the peer's."""
    lines = ["| framework | call | groupgemm µs | peer | peer µs | groupgemm / peer |", "|---|---|---|---|---|---|"]
    for (framework, call), group in _grouped(rows, ("framework", "call")).items():
        ours = next((r for r in group if r.get("impl") == "groupgemm"), None)
        peer = next((r for r in group if r.get("impl") != "groupgemm"), None)
        cell = lambda r: "" if r is None else r.get("error") or format(r["median_us"], ".1f")
        ratio = (f"{ours['median_us'] / peer['median_us']:.2f}x" if ours and peer and not ours.get("error")
                 and not peer.get("error") else "")
        lines.append(f"| {framework} | {call} | {cell(ours)} | {'' if peer is None else peer['impl']} | "
                     f"{cell(peer)} | {ratio} |")
    return "\n".join(lines)


def _grouped(rows, keys):
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return groups
