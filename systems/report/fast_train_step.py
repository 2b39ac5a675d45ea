"""Notebook 10 (fast training step): tables and figures."""

from __future__ import annotations

from systems.bench.train_step import LEVERS, PHASES
from systems.config import size_and_preset
from systems.report.notebook import faster_or_slower, step_spread, within_noise


def step_table(rows, *, baseline: str = "hf_llama", handout: str | None = None):
    """One line per (model, variant): times, MFU, memory, and speed-up over the baseline variant;
    with ``handout``, the size as that handout names it beside the preset. ``step_ms_span``: the
    timed steps' span over their count (with the host's gaps between steps), beside the median."""
    import pandas as pd

    df = pd.DataFrame(rows)
    cols = ["model", "variant", "status", "step_ms", "step_ms_p10", "step_ms_p90", "step_ms_span", "forward_ms",
            "backward_ms", "optimizer_ms", "replay_ms", "first_step_s", "achieved_tflops", "mfu", "peak_memory_gib",
            "tokens_per_s"]
    df = df[[c for c in cols if c in df.columns]].copy()
    if "step_ms" in df.columns:
        base = df[df["variant"] == baseline].set_index("model")["step_ms"]
        df[f"speedup_vs_{baseline}"] = df["model"].map(base) / df["step_ms"]
    if handout is not None:
        df.insert(0, "size", df["model"].map(lambda preset: size_and_preset(preset, handout)))
    return df


def lever_table(table, *, levers=LEVERS):
    """One line per (model, lever) whose two variants both ran: step and phase medians before and
    after, the milliseconds the lever saved (negative: it cost time), and ``beyond_spread``: whether
    the difference is beyond the noise by the report's rule (``notebook.noise_side``: neither
    variant's median step time lies inside the other's p10-p90 range); None where a row lacks its
    spread, which the rule would otherwise read as "apart"."""
    import pandas as pd

    ok = table[table["status"] == "ok"].set_index(["model", "variant"])
    spread = {"step_ms_p10", "step_ms_p90"} <= set(ok.columns)
    out = []
    for model in dict.fromkeys(table["model"]):
        for lever, before, after in levers:
            if (model, before) not in ok.index or (model, after) not in ok.index:
                continue
            b, a = ok.loc[(model, before)], ok.loc[(model, after)]
            line = {"model": model, "lever": lever, "from": before, "to": after,
                    "step_ms_from": b["step_ms"], "step_ms_to": a["step_ms"], "saved_ms": b["step_ms"] - a["step_ms"]}
            if spread:
                inside = within_noise({before: step_spread(b), after: step_spread(a)})
                line["beyond_spread"] = None if inside is None else not inside
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
        # a step replayed as one CUDA graph has no phases: one bar of its whole step
        segments = {"forward_ms": "forward", "backward_ms": "backward", "optimizer_ms": "optimizer",
                    "replay_ms": "whole step, one CUDA graph"}
        for i, (phase, label) in enumerate(segments.items()):
            if phase not in part or part[phase].isna().all():
                continue
            widths = part[phase].fillna(0.0)
            ax.barh(part["variant"], widths, left=left, color=f"C{i}", label=label)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median of each phase)")
        ax.set_title(part["size"].iloc[0] if "size" in part else model)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def gemm_table(rows):
    """One line per (model, projections layout, projection, GEMM): its shape, median time, spread,
    rate and share of the measured peak (``systems.bench.gemms``)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    df["shape (m x k x n)"] = [f"{m} x {k} x {n}" for m, k, n in zip(df["m"], df["k"], df["n"])]
    df["us"], df["us_p10"], df["us_p90"] = df["median_ms"] * 1e3, df["p10_ms"] * 1e3, df["p90_ms"] * 1e3
    cols = ["model", "projections", "projection", "per_block", "gemm", "shape (m x k x n)", "us", "us_p10", "us_p90",
            "tflops", "of_peak"]
    return df[[c for c in cols if c in df.columns]]


def plot_gemms(table, *, title: str, peak_tflops: float | None = None):
    """Each GEMM's rate, separate and fused projections side by side, one panel per model."""
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(table["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        part = table[table["model"] == model]
        labels = [f"{p} {g}" for p, g in zip(part["projection"], part["gemm"])]
        colors = ["C0" if layout == "separate" else "C1" for layout in part["projections"]]
        ax.barh(range(len(part)), part["tflops"], color=colors)
        ax.set_yticks(range(len(part)), labels, fontsize=7)
        ax.invert_yaxis()
        if peak_tflops:
            ax.axvline(peak_tflops, color="k", linestyle="--", linewidth=1, label=f"peak {peak_tflops:.0f}")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel("TFLOP/s (blue: separate projections, orange: fused)")
        ax.set_title(model)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- answers


def step_answer(table, *, targets: dict[str, float], handout: str, target_gpu: str | None = None,
                gpu: str | None = None, peak_label: str | None = None) -> str:
    """Per model: our fastest variant with its spread, rate and MFU, its speed-up over Hugging
    Face's Llama, against our target where we set one, and what changed from ``ours_eager``.
    ``peak_label``: what the MFU divides by, in words (e.g. "731 TFLOP/s measured in this run").
    ``target_gpu``: the GPU the targets are set for; a run whose ``gpu`` does not name it is
    compared with them but not judged met or not (an H200's faster HBM alone moves the step)."""
    import pandas as pd

    ok = table[table["status"] == "ok"].set_index(["model", "variant"])
    lines = []
    for model in dict.fromkeys(table["model"]):
        name = size_and_preset(model, handout)
        if model not in ok.index.get_level_values(0):
            lines.append(f"- **{name}**: no variant ran.")
            continue
        part = ok.loc[model]
        ours = part.drop(index="hf_llama", errors="ignore")
        if ours.empty:
            lines.append(f"- **{name}**: only Hugging Face Llama ran ({part.loc['hf_llama', 'step_ms']:.1f} ms).")
            continue
        best = ours["step_ms"].idxmin()
        b = part.loc[best]
        text = (f"- **{name}**: our fastest variant is `{best}` at {b['step_ms']:.1f} ms per step "
                f"(p10-p90 {b['step_ms_p10']:.1f}-{b['step_ms_p90']:.1f}), {b['achieved_tflops']:.3g} TFLOP/s")
        if "mfu" in b and b["mfu"] == b["mfu"]:
            text += f", MFU {b['mfu']:.1%}" + (f" of the {peak_label}" if peak_label else "")
        if "hf_llama" in part.index:
            text += (f"; {faster_or_slower(b['speedup_vs_hf_llama'])} than Hugging Face Llama's "
                     f"{part.loc['hf_llama', 'step_ms']:.1f} ms")
        if model in targets:
            ratio = f"{b['step_ms'] / targets[model]:.2f}x the target"
            if target_gpu is not None and target_gpu not in (gpu or ""):
                text += (f". Our target (the project's, not the handout's) <= {targets[model]:g} ms is set for "
                         f"one {target_gpu}; this run's {gpu or 'machine'} is another GPU, so it is not judged "
                         f"here ({ratio})")
            else:
                met = b["step_ms"] <= targets[model]
                text += (f". Our target (the project's, not the handout's) <= {targets[model]:g} ms: "
                         f"**{'met' if met else 'not met'}** ({ratio})")
        lines.append(text + ".")
        if "ours_eager" in part.index and best.startswith("ours") and best != "ours_eager":
            e = part.loc["ours_eager"]
            deltas = ", ".join(f"{ph} {e[f'{ph}_ms']:.1f} -> {b[f'{ph}_ms']:.1f} ms" for ph in PHASES
                               if pd.notna(b.get(f"{ph}_ms")))  # a graphed step has no phases
            deltas = deltas or f"step {e['step_ms']:.1f} -> {b['step_ms']:.1f} ms (one CUDA graph: no phases)"
            lines.append(f"  - from `ours_eager` to `{best}`: {deltas}; first step (compilation, autotuning) "
                         f"{b['first_step_s']:.1f} s against {e['first_step_s']:.1f} s.")
    return "**Step time.**\n\n" + "\n".join(lines)


def lever_answer(levers) -> str:
    """The largest single lever per model among those beyond the noise (all of them without
    ``beyond_spread``), from lever_table, then the comparisons this run does not settle and those
    without a measured spread."""
    if levers.empty:
        return "No lever's two variants both ran."
    # == True / == False: the column holds None where a spread is missing, which is neither
    settled = levers[levers["beyond_spread"] == True] if "beyond_spread" in levers else levers  # noqa: E712
    lines = []
    for model in dict.fromkeys(levers["model"]):
        part = settled[settled["model"] == model]
        if part.empty:
            lines.append(f"{model}: no lever's difference is shown beyond the noise in this run")
            continue
        r = part.loc[part["saved_ms"].idxmax()]
        if r.saved_ms <= 0:
            lines.append(f"{model}: every lever beyond the noise cost time, the least {r.lever} (`{r['from']}` -> "
                         f"`{r.to}`, {-r.saved_ms:.1f} ms lost: {r.step_ms_from:.1f} -> {r.step_ms_to:.1f} ms)")
            continue
        lines.append(f"{r.model}: {r.lever} (`{r['from']}` -> `{r.to}`), {r.saved_ms:.1f} ms saved "
                     f"({r.step_ms_from:.1f} -> {r.step_ms_to:.1f} ms)")
    text = "**Largest single lever per model:** " + "; ".join(lines) + "."
    if "beyond_spread" in levers:
        within = levers[levers["beyond_spread"] == False]  # noqa: E712
        unmeasured = levers[levers["beyond_spread"].isna()]
        if len(within):
            text += (f" In {len(within)} of the {len(levers)} comparisons one variant's median step time lies inside "
                     "the other's p10-p90 range, so this run does not settle whether the lever gains or costs: "
                     + "; ".join(f"{r.model} `{r['from']}` -> `{r.to}` (saved {r.saved_ms:+.1f} ms)"
                                 for _, r in within.iterrows()) + ".")
        if len(unmeasured):
            text += (f" In {len(unmeasured)} of the {len(levers)} comparisons a variant's p10-p90 range was not "
                     "measured, so whether the difference is beyond the noise is not known: "
                     + "; ".join(f"{r.model} `{r['from']}` -> `{r.to}` (saved {r.saved_ms:+.1f} ms)"
                                 for _, r in unmeasured.iterrows()) + ".")
    return text


def peak_line(peak_tflops: float, *, gpu: str) -> str:
    """The bf16 matmul rate measured at the start of the run, beside the datasheet's where
    ``systems.measure.hardware`` names the GPU."""
    from systems.measure.hardware import lookup_peak

    sheet = lookup_peak(gpu)
    return (f"Measured bf16 matmul peak: **{peak_tflops:.0f} TFLOP/s** on {gpu}"
            + (f" ({peak_tflops / sheet.bf16_tflops:.0%} of the {sheet.name} datasheet's dense "
               f"{sheet.bf16_tflops:g}, systems.measure.hardware)" if sheet else "") + ".")


def step_profile(trace_path) -> tuple:
    """(kernels, per-phase table, per-category table) of the profiled step's Chrome trace, each
    kernel attributed to the phase it ran in (``systems.measure.profiler``)."""
    from systems.measure import profiler

    items, ranges = profiler.parse_trace(trace_path)
    items = profiler.attribute(items, ranges)
    return items, profiler.range_table(items, ranges), profiler.category_table(items)


def profile_answer(items, phases, cats, *, timed_ms: float) -> str:
    """How busy the kernels kept the profiled step, and its largest category."""
    from systems.measure.trace import total

    top = cats.sort_values("ms_per_step", ascending=False).iloc[0]
    kernel_ms = items["dur"].sum() / 1e3
    # kernels on several streams (the optimizer inside the backward) overlap: the time at least one
    # runs is the union of their spans, not the sum of their durations
    busy = total(list(zip(items["ts"], items["ts"] + items["dur"]))) / 1e3
    step_wall = phases.set_index("range").loc["step", "wall_ms_per_step"]
    text = (f"In the profiled step (each phase closed by a synchronisation, so its range holds its kernels) at least "
            f"one kernel runs for {busy:.1f} ms of the step's {step_wall:.1f} ms ({busy / step_wall:.0%})")
    if kernel_ms > busy * 1.01:
        text += (f"; the kernels' durations add up to {kernel_ms:.1f} ms, {kernel_ms - busy:.1f} ms of it on "
                 "concurrent streams")
    return (text + f". The timed steps of the same variant took {timed_ms:.1f} ms (median). The largest category is "
            f"{top['category']} with {top['ms_per_step']:.1f} ms ({top['share']:.0%} of kernel time) in "
            f"{top['kernels_per_step']:.0f} kernels.")


def leaderboard_row(paths) -> tuple[dict | None, str | None, list[str]]:
    """(row, its file, why earlier rows were passed over): of the first file in ``paths`` holding a
    measurement of the leaderboard's configuration (bench.leaderboard's leaderboard_mismatch), its
    last such row with our own attention (what a submission must run), else its last such row;
    rows of any other configuration (a debug CPU run) are never shown."""
    from pathlib import Path

    from systems.bench.leaderboard import leaderboard_mismatch
    from systems.measure.env import REPO_ROOT
    from systems.measure.results import read_records

    passed_over = []
    for path in map(Path, paths):
        shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
        matching = []
        for row in reversed(read_records(path)):
            why = leaderboard_mismatch(row)
            if why is None:
                matching.append(row)
            elif not matching:
                passed_over.append(f"`{shown}`: {why}")
        if matching:
            return next((r for r in matching if _ours(r)), matching[0]), str(shown), passed_over
    return None, None, passed_over


def leaderboard_table(row: dict):
    import pandas as pd

    keys = ("model", "world_size", "backend", "checkpoint_group", "checkpoint_save", "compile_blocks",
            "step_s", "tflops_per_gpu", "tokens_per_s")
    return pd.DataFrame([{k: row.get(k) for k in keys} | {"attention": leaderboard_attention(row),
                                                          "gpu": (row.get("env") or {}).get("gpu")}])


def _ours(row: dict) -> bool:
    """Whether the row's step ran our own attention kernel."""
    return row.get("attn_impl") == "flash_triton"


def leaderboard_attention(row: dict) -> str:
    """Which attention kernels the row's step ran: ours, or torch's SDPA with its backend."""
    impl = row.get("attn_impl")
    if _ours(row):
        return "ours (Triton FlashAttention-2)"
    if impl == "sdpa":
        return f"SDPA ({row.get('sdpa_backend') or 'auto'})"
    return str(impl)


def _attention_sentence(row: dict) -> str:
    if _ours(row):
        return "Attention ran our own Triton FlashAttention-2, as the handout requires of a submission. "
    return (f"Attention ran {leaderboard_attention(row)}, not our own kernel: the handout requires a submission's "
            "implementation to be its own, so this row measures the rest of the step, not a valid entry "
            "(`--attn-impl flash_triton` runs ours). ")


def leaderboard_answer(row: dict, *, source: str) -> str:
    """The 8B step: its time, rate and memory, where and when it was measured, against the
    handout's baseline and our own target."""
    from systems.bench.leaderboard import HANDOUT_BASELINE_S, TARGET_STEP_S

    env = row.get("env") or {}
    per_rank = ", ".join(f"{r['peak_memory_gib']:.1f}" for r in row.get("per_rank", []) if r.get("peak_memory_gib"))
    return (f"**{row['step_s']:.2f} s per step** for the 8B model on {row['world_size']} x {env.get('gpu')} (the "
            f"handout times two B200s), measured at commit {env.get('git_commit')} on host {env.get('hostname')} "
            f"({env.get('date')}), {source}; {row['tflops_per_gpu']:.0f} TFLOP/s per GPU of model FLOPs (checkpointing's "
            f"recomputation not counted), peak memory per rank {per_rank} GiB. " + _attention_sentence(row)
            + f"Against the handout's naive baseline "
            f"of {HANDOUT_BASELINE_S:g} s: {HANDOUT_BASELINE_S / row['step_s']:.2f}x faster; our own target (the "
            f"project's) of <= {TARGET_STEP_S:g} s: **{'met' if row['step_s'] <= TARGET_STEP_S else 'not met'}**"
            # leaderboard_row prefers a row with ours: this one is not ours only where none was measured
            + ("." if _ours(row) else " with that attention (with ours: not measured)."))


def gemm_answer(rows, *, traced: tuple[str, str, float] | None = None) -> str:
    """Per model: the block's GEMMs per step with separate and with fused projections, and the
    slowest and fastest GEMM against the peak; ``traced``: (model, variant, ms of matmul kernels
    in its profiled step), set beside them."""
    import pandas as pd

    df = pd.DataFrame(rows)
    lines = []
    for model in dict.fromkeys(df["model"]):
        part = df[df["model"] == model]
        layers = int(part["n_layers"].iloc[0])
        per_step = {layout: part.loc[part["projections"] == layout, "block_ms"].sum() * layers
                    for layout in dict.fromkeys(part["projections"])}
        sep = part[part["projections"] == "separate"]
        slow, fast = sep.loc[sep["tflops"].idxmin()], sep.loc[sep["tflops"].idxmax()]
        text = (f"- **{model}** ({int(part['tokens'].iloc[0])} tokens): a block's GEMMs, each timed alone, add up to "
                f"{per_step['separate']:.2f} ms per step over {layers} layers with separate projections")
        if "fused" in per_step:
            saved = per_step["separate"] - per_step["fused"]
            text += (f" and {per_step['fused']:.2f} ms with QKV and W1/W3 fused "
                     f"({abs(saved):.2f} ms {'less' if saved >= 0 else 'more'})")
        text += (f". Slowest: {slow['projection']} {slow['gemm']} ({slow['m']} x {slow['k']} x {slow['n']}) at "
                 f"{slow['tflops']:.3g} TFLOP/s; fastest: {fast['projection']} {fast['gemm']} at {fast['tflops']:.3g}")
        if "of_peak" in part and slow["of_peak"] == slow["of_peak"]:
            text += f" ({slow['of_peak']:.0%} and {fast['of_peak']:.0%} of the measured peak)"
        text += "."
        if traced is not None and traced[0] == model:
            text += (f" The profiled step of `{traced[1]}` spent {traced[2]:.2f} ms in matmul kernels (the LM head's "
                     f"included), beside other kernels and with a warm L2.")
        lines.append(text)
    clock = ("CUDA events, the L2 flushed before each call" if "device" in df and (df["device"] == "cuda").all()
             else "a host clock")
    return f"**The matmuls, shape by shape.** Each GEMM of a block timed alone ({clock}).\n\n" + "\n".join(lines)
