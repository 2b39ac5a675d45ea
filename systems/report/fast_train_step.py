"""Notebook 10 (fast training step): tables and figures."""

from __future__ import annotations

from systems.bench.train_step import LEVERS, PHASES


def step_table(rows, *, baseline: str = "hf_llama"):
    """One line per (model, variant): times, MFU, memory, and speed-up over the baseline variant."""
    import pandas as pd

    df = pd.DataFrame(rows)
    cols = ["model", "variant", "status", "step_ms", "step_ms_p10", "step_ms_p90", "forward_ms", "backward_ms",
            "optimizer_ms", "first_step_s", "achieved_tflops", "mfu", "peak_memory_gib", "tokens_per_s"]
    df = df[[c for c in cols if c in df.columns]].copy()
    if "step_ms" in df.columns:
        base = df[df["variant"] == baseline].set_index("model")["step_ms"]
        df[f"speedup_vs_{baseline}"] = df["model"].map(base) / df["step_ms"]
    return df


def lever_table(table, *, levers=LEVERS):
    """One line per (model, lever) whose two variants both ran: step and phase medians before and
    after, and the milliseconds the lever saved (negative: it cost time)."""
    import pandas as pd

    ok = table[table["status"] == "ok"].set_index(["model", "variant"])
    out = []
    for model in dict.fromkeys(table["model"]):
        for lever, before, after in levers:
            if (model, before) not in ok.index or (model, after) not in ok.index:
                continue
            b, a = ok.loc[(model, before)], ok.loc[(model, after)]
            line = {"model": model, "lever": lever, "from": before, "to": after,
                    "step_ms_from": b["step_ms"], "step_ms_to": a["step_ms"], "saved_ms": b["step_ms"] - a["step_ms"]}
            for phase in PHASES:
                line[f"{phase}_ms_change"] = a[f"{phase}_ms"] - b[f"{phase}_ms"]
            out.append(line)
    return pd.DataFrame(out)


def plot_phases(table, *, title: str):
    """Stacked per-phase medians per variant, one panel per model size."""
    import matplotlib.pyplot as plt

    ok = table[table["status"] == "ok"]
    models = list(dict.fromkeys(ok["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        part = ok[ok["model"] == model]
        left = [0.0] * len(part)
        for i, phase in enumerate(("forward_ms", "backward_ms", "optimizer_ms")):
            ax.barh(part["variant"], part[phase], left=left, color=f"C{i}", label=phase.removesuffix("_ms"))
            left = [a + b for a, b in zip(left, part[phase])]
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median of each phase)")
        ax.set_title(model)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


