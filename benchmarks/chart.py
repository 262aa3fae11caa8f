"""The PNG chart: milliseconds per configuration and contender, forward and forward+backward,
one panel per framework, log scale (the slowest contender can be 100x the fastest)."""

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from contenders import DENSE, GROUPGEMM, GROUPGEMM_DENSE, PER_EXPERT_LOOP  # noqa: E402

COLORS = {GROUPGEMM: "#d62728", DENSE: "#7f7f7f", GROUPGEMM_DENSE: "#c7c7c7", PER_EXPERT_LOOP: "#2ca02c"}
PEER_COLOR = "#1f77b4"


def _config_label(row, with_shape):
    label = f"{row['dtype'].replace('float', 'f')} G={row['experts']}\n{row['routing']}"
    return label + (f"\n{row['tokens']}x{row['hidden']}x{row['ffn']}" if with_shape else "")


def write_chart(path, rows, title):
    frameworks = sorted({r["framework"] for r in rows})
    with_shape = len({(r["tokens"], r["hidden"], r["ffn"]) for r in rows}) > 1
    configs_per_panel = max(len({_config_label(r, with_shape) for r in rows if r["framework"] == f})
                            for f in frameworks)
    panel_width = max(6.5, 0.75 * configs_per_panel)  # room for each configuration's label
    fig, axes = plt.subplots(2, len(frameworks), figsize=(panel_width * len(frameworks), 7.5), squeeze=False)
    for col, framework in enumerate(frameworks):
        mine = [r for r in rows if r["framework"] == framework]
        configs = list(dict.fromkeys(_config_label(r, with_shape) for r in mine))
        impls = list(dict.fromkeys(r["impl"] for r in mine))
        width = 0.8 / len(impls)
        for row_index, (mode, mode_name) in enumerate((("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward"))):
            ax = axes[row_index][col]
            for i, impl in enumerate(impls):
                values = {_config_label(r, with_shape): r.get(mode) for r in mine if r["impl"] == impl}
                xs = [c + (i - (len(impls) - 1) / 2) * width for c in range(len(configs))]
                heights = [values.get(c) or 0 for c in configs]
                ax.bar(xs, heights, width, label=impl, color=COLORS.get(impl, PEER_COLOR),
                       alpha=1.0 if impl == GROUPGEMM else 0.75)
            ax.set_yscale("log")
            ax.set_xticks(range(len(configs)), configs, fontsize=7)
            ax.set_ylabel("ms (lower is better)")
            ax.set_title(f"{framework}: {mode_name}", fontsize=10)
            ax.grid(axis="y", alpha=0.3, which="both")
            if row_index == 0:
                ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
