"""Notebook 08 (optimizer-state sharding and FSDP): tables, figures and answers from the rows.

Every variant ran the same optimizer (torch AdamW, foreach), so what one variant holds beyond
another is the sharding's doing; ``systems.analysis.sharding`` says what each part should be.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from systems.analysis.sharding import (communication_per_step, expected_saving, memory_per_rank, per_rank_bytes,
                                       phase_bytes, sizes_table)
from systems.config import get_config, size_label
from systems.measure.hardware import GPU_PEAKS
from systems.report.notebook import param_count, step_spread, within_noise

MiB = 2**20
GB = 1e9
H200_DATASHEET_BYTES = GPU_PEAKS["H200"].hbm_gb * GB  # one H200's HBM3e, the GPU the full profile runs on
PHASES = {"after_init": "peak_after_init", "before_step": "peak_fwd_bwd", "optimizer_step": "peak_opt_step",
          "after_step": "mem_after_step"}
SCHEME_OF = {"ddp": "ddp", "ddp_sharded": "ddp_sharded", "fsdp": "fsdp", "fsdp2": "fsdp"}


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def measured(df: pd.DataFrame) -> bool:
    """Whether the rows carry allocator statistics (GPU runs do, CPU runs do not)."""
    return "peak_fwd_bwd" in df.columns and _ok(df)["peak_fwd_bwd"].notna().any()


def _pick(df: pd.DataFrame, variant: str, *, model: str, precision: str = "fp32") -> pd.Series | None:
    g = df[(df["variant"] == variant) & (df["model"] == model) & (df["precision"] == precision)]
    return g.iloc[0] if len(g) else None


def memory_table(rows: pd.DataFrame, *, model: str, world_size: int) -> pd.DataFrame:
    """Per variant of ``model``: allocated MiB at the handout's points, measured (peaks; 'after
    step' is what stays allocated) beside the accounting with the measured activations."""
    out = []
    for r in _ok(rows[rows["model"] == model]).to_dict("records"):
        parts = per_rank_bytes(r["n_params"], world_size, SCHEME_OF[r["variant"]])
        expected = phase_bytes(parts, activations=r.get("activations_measured") or 0.0)
        row = {"model": r["model"], "variant": r["variant"], "precision": r["precision"]}
        for phase, col in PHASES.items():
            row[f"{phase}_MiB"] = None if r.get(col) is None or pd.isna(r.get(col)) else r[col] / MiB
            row[f"{phase}_expected_MiB"] = expected[phase] / MiB
        out.append(row)
    return pd.DataFrame(out)


def breakdown(r: pd.Series, *, world_size: int) -> dict[str, tuple[float | None, float]]:
    """part -> (measured bytes, computed bytes) for one fp32 row. Measured: the weights this rank
    holds, the gradients the backward added, the optimizer's state tensors, what the step
    allocated beyond its start, the activations the forward added, and what stays allocated after
    the step beyond weights + gradients + state ('other')."""
    parts = per_rank_bytes(r["n_params"], world_size, SCHEME_OF[r["variant"]])
    held = r["mem_after_step"] - r["param_bytes_local"] - r["grads_measured"] - r["opt_state_bytes"] \
        if pd.notna(r.get("mem_after_step")) else None
    return {"params": (r["param_bytes_local"], parts.params), "grads": (r.get("grads_measured"), parts.grads),
            "optimizer_state": (r["opt_state_bytes"], parts.optimizer_state),
            "optimizer_temporaries": (r.get("opt_temporaries_measured"), parts.optimizer_temporaries),
            "activations": (r.get("activations_measured"), None), "other": (held, 0.0)}


def breakdown_table(rows: pd.DataFrame, *, model: str, world_size: int) -> pd.DataFrame:
    out = []
    for _, r in _ok(rows[rows["model"] == model]).iterrows():
        for part, (measured, computed) in breakdown(r, world_size=world_size).items():
            out.append({"variant": f"{r['variant']} ({r['precision']})", "part": part,
                        "measured_MiB": None if measured is None or pd.isna(measured) else measured / MiB,
                        "computed_MiB": None if computed is None else computed / MiB})
    df = pd.DataFrame(out)
    wide = df.pivot(index="part", columns="variant", values=["measured_MiB", "computed_MiB"]).reindex(
        ["params", "grads", "optimizer_state", "optimizer_temporaries", "activations", "other"])
    # one flat header per column, each variant's measured beside its computed
    variants = list(dict.fromkeys(df["variant"]))
    return pd.DataFrame({f"{v} {kind}": wide[(f"{kind}_MiB", v)] for v in variants for kind in ("measured", "computed")})


def _mib(x: float) -> str:
    """Bytes for reading: MiB from 10 MiB up (the GPU runs), KiB below (the smoke runs' toy model)."""
    return f"{x / MiB:,.0f} MiB" if abs(x) >= 10 * MiB else f"{x / 1024:,.0f} KiB"


def sharding_memory_answer(opt: pd.DataFrame, *, model: str, world_size: int, handout: str) -> str:
    """optimizer_state_sharding_accounting (a): the peaks at the three points with and without
    sharding, against the accounting, and the breakdown."""
    ddp, sh = _pick(_ok(opt), "ddp", model=model), _pick(_ok(opt), "ddp_sharded", model=model)
    if ddp is None or sh is None:
        return "Not measured: " + "; ".join(f"{r['variant']} {r['status']}" for _, r in opt.iterrows()) + "."
    n = ddp["n_params"]
    p = per_rank_bytes(n, world_size, "ddp")
    text = (f"{size_label(model, handout)}: {param_count(n)} parameters, so fp32 weights and gradients take {_mib(p.params)} each, AdamW's "
            f"two moments {_mib(p.optimizer_state)}, and torch AdamW's foreach step one more fp32 temporary "
            f"({_mib(p.optimizer_temporaries)}) for the parameters a rank updates. ")
    if not measured(opt):
        return text + ("This device keeps no allocator statistics (CPU), so only the accounting is shown: "
                       f"sharding over {world_size} ranks keeps {_mib(per_rank_bytes(n, world_size, 'ddp_sharded').optimizer_state)}"
                       " of moments per rank instead of all of them.")
    text += ("Measured peaks per rank, without / with sharding: after init "
             f"{_mib(ddp['peak_after_init'])} / {_mib(sh['peak_after_init'])}; before the optimizer step (the "
             f"forward + backward peak) {_mib(ddp['peak_fwd_bwd'])} / {_mib(sh['peak_fwd_bwd'])}; during the step "
             f"{_mib(ddp['peak_opt_step'])} / {_mib(sh['peak_opt_step'])}; after it {_mib(ddp['mem_after_step'])} / "
             f"{_mib(sh['mem_after_step'])}. ")
    worst = []
    for r in (ddp, sh):
        expected = phase_bytes(per_rank_bytes(n, world_size, r["variant"]), activations=r["activations_measured"])
        for phase, col in PHASES.items():
            worst.append((abs(r[col] - expected[phase]) / expected[phase], r["variant"], phase, r[col] - expected[phase]))
    rel, variant, phase, diff = max(worst)
    text += (("As expected: they follow" if rel < 0.05 else "Not as expected: they depart from")
             + " the accounting (weights + moments + the measured activations before the step; weights + gradients + "
             f"moments + temporaries during it) by at most {rel:.1%}, the largest relative gap {diff / MiB:+,.0f} MiB "
             f"({variant}, {phase.replace('_', ' ')}). ")
    b_ddp, b_sh = breakdown(ddp, world_size=world_size), breakdown(sh, world_size=world_size)
    text += ("Breakdown (without / with): weights " + f"{_mib(b_ddp['params'][0])} / {_mib(b_sh['params'][0])}, gradients "
             f"{_mib(b_ddp['grads'][0])} / {_mib(b_sh['grads'][0])}, optimizer state {_mib(b_ddp['optimizer_state'][0])} / "
             f"{_mib(b_sh['optimizer_state'][0])}, the step's temporaries {_mib(b_ddp['optimizer_temporaries'][0])} / "
             f"{_mib(b_sh['optimizer_temporaries'][0])}, activations {_mib(b_ddp['activations'][0])} / "
             f"{_mib(b_sh['activations'][0])}, other {_mib(b_ddp['other'][0])} / {_mib(b_sh['other'][0])}: with "
             f"sharding the moments are {b_sh['optimizer_state'][0] / b_ddp['optimizer_state'][0]:.0%} and the "
             f"temporaries {b_sh['optimizer_temporaries'][0] / b_ddp['optimizer_temporaries'][0]:.0%} of DDP's, while "
             "weights, gradients and activations differ by at most "
             f"{max(abs(b_sh[k][0] / b_ddp[k][0] - 1) for k in ('params', 'grads', 'activations')):.1%}.")
    return text


def sharding_time_answer(opt: pd.DataFrame, *, model: str, handout: str) -> str:
    """optimizer_state_sharding_accounting (b)."""
    ddp, sh = _pick(_ok(opt), "ddp", model=model), _pick(_ok(opt), "ddp_sharded", model=model)
    if ddp is None or sh is None:
        return "Not measured (a variant did not run)."
    ratio = sh["step_ms"] / ddp["step_ms"]
    inside = within_noise({"ddp": step_spread(ddp), "ddp_sharded": step_spread(sh)})
    measured = inside is not None
    span = lambda r: f" ({r['step_ms_p10']:.4g}-{r['step_ms_p90']:.4g})" if measured else ""  # noqa: E731
    n = int(sh["world_size"])
    if inside:
        verdict = "and the two steps are within the noise (one median inside the other's p10-p90 range)."
    else:
        verdict = (f"and the broadcast costs more than updating 1/{n} of them saves" if ratio > 1
                   else f"and updating 1/{n} of them saves more than the broadcast costs")
        verdict += "." if measured else " by these medians (no p10-p90 spread was recorded to tell it from noise)."
    return (f"{size_label(model, handout)}, fp32, per step (median of the slowest rank"
            f"{', p10-p90' if measured else ''}): {ddp['step_ms']:.4g} ms{span(ddp)} without and {sh['step_ms']:.4g} ms"
            f"{span(sh)} with sharding, x{ratio:.3f}. Each rank updates only the parameters it owns, but then every "
            f"owner broadcasts them, {verdict}")


def zero1_tables(n_params: float, world_size: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(communication per step, persistent memory) per rank and scheme, in MiB."""
    comm = pd.DataFrame(communication_per_step(n_params, world_size))
    comm["MiB_per_rank"] = comm.pop("bytes_per_rank") / MiB
    mem = pd.DataFrame(memory_per_rank(n_params, world_size))
    mem[["params", "grads", "opt_state"]] = mem[["params", "grads", "opt_state"]] / MiB
    mem["total"] = mem[["params", "grads", "opt_state"]].sum(axis=1)
    return comm, mem.rename(columns={c: f"{c}_MiB" for c in ("params", "grads", "opt_state", "total")})


def zero1_answer(n_params: float, world_size: int) -> str:
    """optimizer_state_sharding_accounting (c), from the accounting."""
    c = [r["bytes_per_rank"] for r in communication_per_step(n_params, world_size)]
    m = [r["params"] + r["grads"] + r["opt_state"] for r in memory_per_rank(n_params, world_size)]
    ours, zero1 = c[1], c[2]
    return (f"Memory is ZeRO stage 1's (P_os) in fp32 training: full fp32 weights and gradients and 1/N of the moments "
            f"({_mib(m[1])} per rank here, against {_mib(m[0])} for DDP). In the ZeRO paper's mixed-precision setting "
            "the optimizer state also holds the fp32 master weights (12 bytes per parameter), which P_os shards too; "
            "with fp32 weights there is no separate master, so only the moments' 8 bytes are sharded. Freeing the "
            "gradients outside a rank's shard after a reduce-scatter is stage 2 (P_os+g). Ours gives each rank whole "
            "parameters (assigned greedily by size), where ZeRO splits the flattened state evenly, so our shards are "
            f"only as even as the parameter sizes allow. Communication differs: we all-reduce every gradient ({_mib(c[0])} sent per rank) and then "
            f"broadcast the updated parameters (+{_mib(ours - c[0])}), {_mib(ours)} in all, while ZeRO-1 "
            f"reduce-scatters the gradients (each rank needs only its shard's) and all-gathers the parameters, "
            f"{_mib(zero1)}, what plain DDP sends: ours sends {ours / zero1:.2f}x ZeRO-1's volume.")


def fsdp_table(fsdp: pd.DataFrame) -> pd.DataFrame:
    cols = ["model", "precision", "variant", "status", "step_ms", "step_ms_p10", "step_ms_p90", "peak_after_init",
            "peak_fwd_bwd", "peak_opt_step"]
    out = fsdp[[c for c in cols if c in fsdp.columns]].copy()
    for col in ("peak_after_init", "peak_fwd_bwd", "peak_opt_step"):
        if col in out.columns:
            out[col] = out[col] / MiB
    return out.rename(columns={c: c + "_MiB" for c in ("peak_after_init", "peak_fwd_bwd", "peak_opt_step")})


def fsdp_ratios(fsdp: pd.DataFrame, *, model: str) -> pd.DataFrame:
    """Ours over FSDP2 in the same run, per precision: step time, whether the two steps differ
    beyond their spread (the report's one noise rule), and overall peak memory."""
    rows = []
    for precision, g in _ok(fsdp[fsdp["model"] == model]).groupby("precision", sort=False):
        by = g.set_index("variant")
        if not {"fsdp", "fsdp2"} <= set(by.index):
            continue
        peak = {v: np.nanmax([by.loc[v, "peak_fwd_bwd"], by.loc[v, "peak_opt_step"]]) if measured(g) else np.nan
                for v in ("fsdp", "fsdp2")}
        ratio = by.loc["fsdp", "step_ms"] / by.loc["fsdp2", "step_ms"]
        # the bf16 steps spread over up to a quarter of their median, and the ratio of medians
        # moved from 0.70x to 0.96x between leases (notes entry 31): say whether it clears the spread
        inside = within_noise({v: step_spread(by.loc[v]) for v in ("fsdp", "fsdp2")})
        verdict = ("spread not measured" if inside is None else "within the noise" if inside
                   else "ours faster" if ratio < 1 else "ours slower")
        rows.append({"precision": precision, "step_time_ratio": ratio, "step_time": verdict,
                     "peak_memory_ratio": peak["fsdp"] / peak["fsdp2"]})
    return pd.DataFrame(rows)


def plot_fsdp(fsdp: pd.DataFrame, *, model: str, title: str = ""):
    """Ours against FSDP2: step time and peak memory per precision."""
    f = fsdp_table(_ok(fsdp[fsdp["model"] == model]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, col, label in ((axes[0], "step_ms", "step time (ms, median; bars p10-p90)"),
                           (axes[1], "peak_fwd_bwd_MiB", "peak memory (MiB)")):
        piv = f.pivot(index="precision", columns="variant", values=col)
        err = None
        if col == "step_ms" and {"step_ms_p10", "step_ms_p90"} <= set(f.columns):
            # the spread beside the medians: in bf16 it can exceed the two wrappers' difference
            lo = piv - f.pivot(index="precision", columns="variant", values="step_ms_p10")
            hi = f.pivot(index="precision", columns="variant", values="step_ms_p90") - piv
            err = {v: np.vstack([lo[v].to_numpy(), hi[v].to_numpy()]) for v in piv.columns}
        if piv.notna().any().any():
            piv.plot.bar(ax=ax, rot=0, yerr=err, capsize=3)
        else:
            ax.text(0.5, 0.5, "not measured on a CPU", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(label)
    axes[0].set_title("ours vs FSDP2: step time")
    axes[1].set_title("ours vs FSDP2: forward + backward peak")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def fsdp_saving_answer(opt: pd.DataFrame, fsdp: pd.DataFrame, *, model: str, world_size: int,
                       large: str | None = None, handout: str) -> str:
    """fsdp_accounting (a): the saving expected from the peak over optimizer-state sharding (and
    over DDP), against the measured one, with what the gap is made of; and the large model."""
    sh, ddp = _pick(_ok(opt), "ddp_sharded", model=model), _pick(_ok(opt), "ddp", model=model)
    ours = _pick(_ok(fsdp), "fsdp", model=model)
    if sh is None or ours is None:
        return "Not measured (a variant did not run)."
    n = sh["n_params"]
    acts = sh["activations_measured"] if pd.notna(sh.get("activations_measured")) else 0.0
    exp = expected_saving(n, world_size, frm="ddp_sharded", to="fsdp", activations=acts)
    text = (f"Over optimizer-state sharding, FSDP also shards the weights and the gradients, 1/{world_size} each: "
            f"{_mib(exp['optimizer_step'])} less during the optimizer step (weights and gradients, "
            f"{world_size - 1}/{world_size} of {_mib(2 * 4 * n)}) but only {_mib(exp['before_step'])} at the forward's "
            "end, where no gradient exists yet. The saving from the peak is the difference of the two schemes' peaks "
            f"(each the larger of its forward + backward and its step peak): expected {_mib(exp['peak'])} per rank "
            f"({size_label(model, handout)}, fp32, ignoring the gathered layers). ")
    if measured(opt):
        peak = lambda r: max(r["peak_fwd_bwd"], r["peak_opt_step"])  # noqa: E731
        saved = peak(sh) - peak(ours)
        text += (f"Measured (same run, same optimizer): {_mib(peak(sh))} with sharded optimizer state, {_mib(peak(ours))} "
                 f"with our FSDP, {_mib(saved)} saved ({saved / exp['peak']:.0%} of the expected); ")
        accounted = phase_bytes(per_rank_bytes(n, world_size, "fsdp"), activations=ours["activations_measured"])
        held = ours["peak_fwd_bwd"] - accounted["before_step"]
        text += f"FSDP's forward + backward peak sits {_mib(held)} above its accounting"
        if pd.notna(ours.get("gathered_unit_bytes")):
            in_flight = ours["gathered_unit_bytes"] * (1 + ours["prefetch"])
            text += (f", of which the gathered layers in flight (the current unit and {int(ours['prefetch'])} prefetched, "
                     f"{_mib(ours['gathered_unit_bytes'])} each at most) explain up to {_mib(in_flight)}: the buffers the "
                     "question says to ignore")
        text += ". "
        if ddp is not None:
            vs_ddp = expected_saving(n, world_size, frm="ddp", to="fsdp", activations=acts)
            full = per_rank_bytes(n, world_size, "ddp")
            text += (f"Against plain DDP the step's peak falls by {_mib(ddp['peak_opt_step'] - ours['peak_opt_step'])}, "
                     f"expected {_mib(vs_ddp['optimizer_step'])}: the "
                     f"{full.step_peak / n:.0f} bytes per parameter of weights, gradients, "
                     "moments and the foreach update's temporary all shrink to 1/N. ")
    if large:
        text += large_model_answer(opt, fsdp, model=large, world_size=world_size, handout=handout)
    return text


def large_model_answer(opt: pd.DataFrame, fsdp: pd.DataFrame, *, model: str, world_size: int,
                       handout: str) -> str:
    """What happened to the large model (e.g. 2026's 10B) under each variant, with its accounting."""
    rows = pd.concat([opt[opt["model"] == model], fsdp[fsdp["model"] == model]], ignore_index=True) \
        if "model" in fsdp.columns else opt[opt["model"] == model]
    if not len(rows):
        return f"The {size_label(model, handout)} model was not attempted in this run."
    n = get_config(model).n_params
    parts = []
    for _, r in rows.iterrows():
        what = (f"ran at {r['step_ms']:.4g} ms per step, peak {_mib(max(r['peak_fwd_bwd'], r['peak_opt_step']))}"
                if r["status"] == "ok" and pd.notna(r.get("peak_fwd_bwd")) else
                f"ran at {r['step_ms']:.4g} ms per step" if r["status"] == "ok" else
                "ran out of memory" if r["status"] == "oom" else f"failed ({r.get('error', r['status'])})")
        parts.append(f"`{r['variant']}` ({r['precision'] if pd.notna(r.get('precision')) else 'bf16'}) {what}")
    need = {s: per_rank_bytes(n, world_size, s) for s in ("ddp_sharded", "fsdp")}
    return (f"The {size_label(model, handout)} model ({param_count(n)} parameters) on {world_size} ranks: " + "; ".join(parts) + ". Its weights, "
            f"gradients, moments and step temporaries alone take "
            f"{need['ddp_sharded'].step_peak / GB:.0f} GB per rank with "
            f"sharded optimizer state and {need['fsdp'].step_peak / GB:.0f} GB "
            "with FSDP, before any activation.")


def device_memory() -> tuple[float, str]:
    """(bytes, name) of the device whose memory the sizes table compares with: this run's GPU, or
    on a CPU the H200's datasheet capacity."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"this run's {props.name} ({props.total_memory / GB:.0f} GB)"
    return H200_DATASHEET_BYTES, f"an H200 ({H200_DATASHEET_BYTES / GB:.0f} GB, datasheet; this run has no GPU)"


def sizes_frame(sizes: dict[str, int], *, world_size: int, device_bytes: float) -> pd.DataFrame:
    df = pd.DataFrame(sizes_table(sizes, world_size, device_bytes=device_bytes))
    for s in ("ddp", "ddp_sharded", "fsdp"):
        df[f"{s}_GB"] = df.pop(f"{s}_bytes") / GB
    df["params"] = df["params"] / 1e9
    return df.rename(columns={"params": "params_B"})


# ---------------------------------------------------------------------------------------------- gathers

def plot_timeline(ax, timeline: dict, *, title: str = "", window: tuple[float, float] | None = None) -> None:
    """Three lanes (compute, all-gather, reduce-scatter) with the units' forward ranges shaded."""
    lo, hi = window or (timeline["step"] or (0.0, max(b for _, b in timeline["compute"])))
    clip = lambda xs: [(max(a, lo), min(b, hi) - max(a, lo)) for a, b in xs if b > lo and a < hi]  # noqa: E731
    ax.broken_barh(clip(timeline["compute"]), (20, 8), facecolors="tab:blue")
    ax.broken_barh(clip(timeline["gather"]), (10, 8), facecolors="tab:orange")
    ax.broken_barh(clip(timeline["reduce"]), (0, 8), facecolors="tab:green")
    for k, (_, a, b) in enumerate(timeline["units"]):
        if b > lo and a < hi:
            ax.axvspan(max(a, lo), min(b, hi), color="0.85" if k % 2 else "0.93", zorder=0)
    comm = "NCCL" if timeline["kind"] == "gpu" else "gloo"
    ax.set_yticks([4, 14, 24], [f"{comm} reduce-scatter", f"{comm} all-gather", "compute"])
    ax.set_xlim(lo, hi)
    ax.set_xlabel("time in step (ms); shaded: one unit's forward each")
    if title:
        ax.set_title(title)


def plot_gathers(timeline: dict, *, precision: str):
    """The whole profiled step, and the first few units of its forward."""
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.5))
    plot_timeline(axes[0], timeline, title=f"{precision}: whole step (ours)")
    units = timeline["units"]
    if units:
        k = min(5, len(units))
        start, end = units[0][1], units[k - 1][2]
        plot_timeline(axes[1], timeline, title=f"{precision}: first {k} units of the forward",
                      window=(start - 0.2 * (end - start), end))
    fig.tight_layout()
    return fig


def plot_slack(gathers: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(10, 3))
    for precision, g in gathers.groupby("precision", sort=False):
        ax.plot(g["order"], g["slack_ms"], marker="o", ms=3, label=f"{precision} slack")
        ax.plot(g["order"], g["stall_ms"], ls="--", label=f"{precision} stall")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("unit, in forward order")
    ax.set_ylabel("ms")
    ax.legend()
    ax.set_title("forward all-gathers: slack before each layer and compute stall")
    return fig


def gather_summary(gathers: pd.DataFrame) -> pd.DataFrame:
    return gathers.groupby("precision", sort=False).agg(
        units=("unit", "count"), in_time=("in_time", "sum"), gather_ms_median=("gather_ms", "median"),
        slack_ms_median=("slack_ms", "median"), stall_ms_total=("stall_ms", "sum"))


def gather_answer(gathers: pd.DataFrame, *, model: str, handout: str) -> str:
    """fsdp_accounting (b): did each forward all-gather finish before its layer needed it?"""
    if not len(gathers):
        return "No trace was recorded (profiling off)."
    lines = []
    for precision, r in gather_summary(gathers).iterrows():
        lines.append(f"in {precision}, {int(r['in_time'])} of {int(r['units'])} forward all-gathers had finished before "
                     f"the compute stream reached their layer (median gather {r['gather_ms_median']:.3f} ms, median "
                     f"slack {r['slack_ms_median']:.3f} ms), and waiting for gathers idled the compute stream "
                     f"{r['stall_ms_total']:.3f} ms in all over the forward")
    first = gathers[(gathers["order"] == 0) & ~gathers["in_time"].astype(bool)]
    late = ", ".join(f"{r['precision']} ({r['stall_ms']:.3f} ms stall)" for _, r in first.iterrows())
    return (f"{size_label(model, handout)}, one profiled step of our FSDP per precision (rank 0): " + "; ".join(lines) + "."
            + (f" The first unit's gather is late in {late}: it is issued when the step starts, with no earlier "
               "layer to hide behind." if late else ""))
