"""Merges the benchmark runs of the kit's sweep (one bench.py run per expert shape) into
one bench.csv, bench.json and bench.png, prints the merged tables, and ends with a
"RESULT:" line: TFLOP/s and the ratio to dense of groupgemm's forward+backward per
framework. FAIL when a run left no results or a groupgemm result failed its check.

    python3 benchmarks/gpu/bench_merge.py --out DIR PART_DIR...
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import report  # noqa: E402  (benchmarks/report.py: the CLI's own CSV, JSON and tables)
from contenders import GROUPGEMM  # noqa: E402


def load_parts(part_dirs):
    """(documents, [part dirs without results])."""
    documents, missing = [], []
    for part in part_dirs:
        path = os.path.join(part, "bench.json")
        try:
            with open(path) as f:
                documents.append(json.load(f))
        except (OSError, ValueError):
            missing.append(part)
    return documents, missing


def digest(rows):
    """Per framework: groupgemm's forward+backward TFLOP/s and ratio to dense, as ranges."""
    parts = []
    for framework in sorted({r["framework"] for r in rows}):
        mine = [r for r in rows if r["framework"] == framework and r["impl"] == GROUPGEMM
                and r.get("fwd_bwd_gflops") is not None]
        if not mine:
            continue
        tflops = [r["fwd_bwd_gflops"] / 1e3 for r in mine]
        ratios = [r["fwd_bwd_vs_dense"] for r in mine if r.get("fwd_bwd_vs_dense") is not None]
        text = f"{framework} fwd+bwd {min(tflops):.3g}-{max(tflops):.3g} TFLOP/s"
        if ratios:
            text += f", {min(ratios):.2f}-{max(ratios):.2f}x dense"
        parts.append(text)
    return "; ".join(parts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the merged bench.csv, bench.json, bench.png")
    p.add_argument("parts", nargs="+", help="the folders bench.py wrote to")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    documents, missing = load_parts(args.parts)
    rows = [row for doc in documents for row in doc["results"]]
    os.makedirs(args.out, exist_ok=True)
    if rows:
        report.write_csv(os.path.join(args.out, "bench.csv"), rows)
        report.write_json(os.path.join(args.out, "bench.json"), {
            "commands": [doc.get("command") for doc in documents],
            "machine": documents[0].get("machine"),
            "results": rows,
            "overhead": [row for doc in documents for row in doc.get("overhead", [])],
        })
        import chart  # matplotlib only once there is something to draw

        machine = documents[0].get("machine") or {}
        chart.write_chart(os.path.join(args.out, "bench.png"), rows,
                          f"{machine.get('device', 'cuda')}, bfloat16, {len(documents)} expert shapes")
        for framework in sorted({r["framework"] for r in rows}):
            print(f"\n{framework}; each cell is forward / forward+backward\n")
            print(report.markdown_table(rows, framework))
        targets = report.targets_table(rows)
        if targets:
            print(f"\n{targets}")
    wrong = report.failed_checks(rows)
    configs = len({tuple(r[k] for k in report.CONFIG_COLUMNS if k not in ("framework", "device")) for r in rows})
    summary = f"{configs} configurations; {digest(rows) or 'no groupgemm timings'}"
    problems = [f"no results from {len(missing)} of {len(args.parts)} runs"] if missing else []
    problems += [f"{len(wrong)} groupgemm results failed their check"] if wrong else []
    print(f"RESULT: {'FAIL ' + '; '.join(problems) + '; ' if problems else 'PASS '}{summary}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
