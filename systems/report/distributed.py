"""Tables, figures and data-driven commentary for notebook 07 (all-reduce and DDP results)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from systems.analysis.fits import fit_latency_bandwidth
from systems.measure.trace import TraceIntervals, comm_compute_intervals, union


# ----------------------------------------------------------------------------------------------
# all-reduce
# ----------------------------------------------------------------------------------------------

def allreduce_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = ["backend", "world_size", "size_mb", "status", "time_ms", "time_ms_p10", "time_ms_p90",
            "rank_spread_ms", "algbw_GBps", "busbw_GBps", "iters", "reason"]
    out = df[[c for c in cols if c in df.columns]].sort_values(["backend", "world_size", "size_mb"])
    return out.reset_index(drop=True)


def plot_allreduce(df: pd.DataFrame, *, title: str = ""):
    ok = df[df["status"] == "ok"]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.2))
    markers = {"nccl": "o", "gloo": "s"}
    for (backend, ws), g in ok.groupby(["backend", "world_size"]):
        g = g.sort_values("size_bytes")
        label = f"{backend}, {ws} ranks"
        err = np.clip([g["time_ms"] - g["time_ms_p10"], g["time_ms_p90"] - g["time_ms"]], 0, None)
        ax_t.errorbar(g["size_mb"], g["time_ms"], yerr=err, marker=markers.get(backend, "o"), label=label, capsize=3)
        ax_b.plot(g["size_mb"], g["busbw_GBps"], marker=markers.get(backend, "o"), label=label)
    for ax in (ax_t, ax_b):
        ax.set_xscale("log")
        ax.set_xlabel("tensor size (MB, fp32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("all-reduce time (ms, median; bars p10-p90)")
    ax_b.set_ylabel("bus bandwidth (GB/s) = algbw * 2(n-1)/n")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def fit_alpha_beta(df: pd.DataFrame, *, backend: str, world_size: int) -> dict | None:
    """Per-call overhead o and algorithm bandwidth w from t = o + s/w over the measured sizes."""
    g = df[(df["status"] == "ok") & (df["backend"] == backend) & (df["world_size"] == world_size)]
    if g["size_bytes"].nunique() < 2:
        return None
    o, w = fit_latency_bandwidth(g["size_bytes"].tolist(), (g["time_ms"] / 1e3).tolist())
    source = "least-squares fit t = o + size/w"
    if not (w > 0 and math.isfinite(w)):
        # a noisy CPU run can give a non-positive slope; fall back to the best measured rate
        w = float(g["algbw_GBps"].max() * 1e9)
        source = "w: best measured algbw (fitted slope not positive)"
    if not o > 0:
        # a fitted intercept <= 0 (few sizes, noise) gives no optimum; the smallest message's time
        # is an upper bound on the per-call cost
        o = float(g.sort_values("size_bytes")["time_ms"].iloc[0] / 1e3)
        source += "; o: smallest message's time (fitted intercept not positive)"
    return {"backend": backend, "world_size": world_size, "per_call_overhead_s": o, "bandwidth_bytes_per_s": w,
            "n_sizes": int(g["size_bytes"].nunique()), "source": source}


def allreduce_commentary(df: pd.DataFrame) -> str:
    ok = df[df["status"] == "ok"]
    lines = []
    for backend, g in ok.groupby("backend"):
        for ws, h in g.groupby("world_size"):
            h = h.sort_values("size_bytes")
            small, large = h.iloc[0], h.iloc[-1]
            lines.append(
                f"- **{backend}, {ws} ranks**: {small['size_mb']:g} MB takes {small['time_ms']:.3g} ms "
                f"(bus bandwidth {small['busbw_GBps']:.3g} GB/s), {large['size_mb']:g} MB takes "
                f"{large['time_ms']:.3g} ms ({large['busbw_GBps']:.3g} GB/s): "
                f"{large['size_mb'] / small['size_mb']:.0f}x the data costs "
                f"{large['time_ms'] / small['time_ms']:.1f}x the time"
                + (f" — the small message is latency-bound, reaching {small['busbw_GBps'] / large['busbw_GBps']:.0%} "
                   "of the large message's bandwidth." if small["busbw_GBps"] < 0.67 * large["busbw_GBps"] else
                   f" — the small message already gets {small['busbw_GBps'] / large['busbw_GBps']:.0%} of the "
                   "large one's bandwidth, so per-call latency is small next to its transfer time here."))
        largest = g[g["size_bytes"] == g["size_bytes"].max()].sort_values("world_size")
        if len(largest) > 1:
            parts = ", ".join(f"{int(r.world_size)} ranks {r.busbw_GBps:.3g} GB/s" for r in largest.itertuples())
            lines.append(f"- {backend} bus bandwidth at {largest['size_mb'].iloc[0]:g} MB by world size: {parts}.")
    if (ok["backend"] == "nccl").any() and (ok["backend"] == "gloo").any():
        both = ok.pivot_table(index=["world_size", "size_bytes"], columns="backend", values="time_ms").dropna()
        if len(both):
            ratio = (both["gloo"] / both["nccl"])
            lines.append(f"- Where both ran, gloo on CPU is {ratio.min():.0f}x to {ratio.max():.0f}x slower "
                         "than NCCL on GPUs.")
    not_run = df[df["status"] == "not_run"]
    if len(not_run):
        reasons = "; ".join(f"{n} x {r}" for r, n in not_run["reason"].value_counts().items())
        lines.append(f"- Not run ({len(not_run)} cases): {reasons}.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# DDP variants
# ----------------------------------------------------------------------------------------------

def ddp_table(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for setting, g in df.groupby("setting", sort=False):
        torch_ms = g.loc[g["variant"] == "torch_ddp", "step_ms"]
        ref = float(torch_ms.iloc[0]) if len(torch_ms) else float("nan")
        for r in g.itertuples():
            rows.append({"setting": setting, "variant": r.variant, "n_buckets": r.n_buckets,
                         "step_ms": r.step_ms, "p10_ms": r.step_ms_p10, "p90_ms": r.step_ms_p90,
                         "fwd_bwd_ms": r.fwd_bwd_ms, "sync_wait_ms": r.sync_wait_ms, "optimizer_ms": r.optimizer_ms,
                         "comm_overhead_ms": r.comm_overhead_ms,
                         "comm_share_pct": None if r.comm_share is None or r.comm_share != r.comm_share
                         else 100 * r.comm_share,
                         "vs_torch_ddp": r.step_ms / ref,
                         # the first warm-up step, compilation included where there is any
                         "first_step_s": r.first_step_s})
    return pd.DataFrame(rows)


def best_of_ours(g: pd.DataFrame) -> pd.Series:
    """The fastest of our wrappers in one setting's rows (not the nosync baseline, not torch DDP)."""
    ours = g[~g["variant"].isin(["nosync", "torch_ddp"])]
    return ours.loc[ours["step_ms"].idxmin()]


def trace_row(overlap: pd.DataFrame | None, *, setting: str, variant: str) -> pd.Series | None:
    """The overlap analysis of one (setting, variant)'s profiled trace, None when it was not profiled."""
    if overlap is None or not len(overlap):
        return None
    rows = overlap[(overlap["setting"] == setting) & (overlap["variant"] == variant)]
    return rows.iloc[0] if len(rows) else None


def ddp_targets(table: pd.DataFrame, overlap: pd.DataFrame | None) -> str:
    """Per setting (of ddp_table's output): the best variant's step time over torch DDP's and its
    trace's exposed-communication share, each beside its target."""
    lines = []
    for setting, g in table.groupby("setting", sort=False):
        best = best_of_ours(g)
        traced = trace_row(overlap, setting=setting, variant=best["variant"])
        exposed = traced["exposed_comm_pct_of_step"] if traced is not None else float("nan")
        lines.append(f"- {setting}: best `{best['variant']}` runs at {best['vs_torch_ddp']:.3f}x torch DDP's step "
                     f"time (target <= 1) with {exposed:.1f}% of the step exposed communication in its trace "
                     f"(target <= 3%).")
    return "\n".join(lines)


def plot_ddp(df: pd.DataFrame, *, title: str = ""):
    settings = list(dict.fromkeys(df["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        g = df[df["setting"] == setting]
        base = g["baseline_step_ms"].fillna(g["step_ms"]).to_numpy()
        over = np.clip(g["step_ms"].to_numpy() - base, 0, None)
        x = np.arange(len(g))
        ax.bar(x, np.minimum(base, g["step_ms"]), color="tab:blue", label="computation (nosync step)")
        ax.bar(x, over, bottom=np.minimum(base, g["step_ms"]), color="tab:orange",
               label="communication overhead")
        ax.set_xticks(x, g["variant"], rotation=45, ha="right")
        ax.set_ylabel("time per step (ms, median)")
        ax.set_title(setting)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def ddp_commentary(df: pd.DataFrame, overlap: pd.DataFrame | None = None) -> str:
    lines = []
    overlap = overlap if overlap is not None and len(overlap) else None
    for setting, g in df.groupby("setting", sort=False):
        best = best_of_ours(g)
        naive = g[g["variant"] == "naive"]
        torch_row = g[g["variant"] == "torch_ddp"]
        base = g[g["variant"] == "nosync"]
        s = f"- **{setting}**: the best of our variants is `{best['variant']}` at {best['step_ms']:.4g} ms/step"
        if len(torch_row):
            t = torch_row.iloc[0]
            ratio = best["step_ms"] / t["step_ms"]
            s += (f", {ratio:.3f}x torch DDP's {t['step_ms']:.4g} ms "
                  f"({'as fast or faster' if ratio <= 1 else 'slower'})")
        if len(base):
            s += f"; without any communication a step takes {base.iloc[0]['step_ms']:.4g} ms, so "
            if best["comm_overhead_ms"] > 0:
                s += (f"`{best['variant']}` is {best['comm_overhead_ms']:.3g} ms slower "
                      f"({100 * best['comm_share']:.1f}% of its step)")
                traced = trace_row(overlap, setting=setting, variant=best["variant"])
                if traced is not None:
                    exposed = float(traced["exposed_comm_ms"])
                    # overlapped communication still costs: NCCL kernels take SMs and memory
                    # bandwidth from the computation running beside them
                    s += (f"; its trace shows {exposed:.3g} ms/step of communication with no computation beside it, "
                          + ("so most of the difference is computation slowed by the communication running beside it"
                             if exposed < best["comm_overhead_ms"] / 2 else
                             "so most of the difference is communication left exposed"))
            else:
                b0 = base.iloc[0]
                s += f"`{best['variant']}` costs nothing measurable over it ({best['comm_overhead_ms']:.3g} ms"
                lo, hi = b0.get("step_ms_p10"), b0.get("step_ms_p90")
                if pd.notna(lo) and pd.notna(hi):
                    inside = lo <= best["step_ms"] <= hi
                    s += (f"; the no-communication steps range {lo:.4g}–{hi:.4g} ms from 10th to 90th percentile, "
                          + ("and this step time lies inside that range)" if inside else
                             "and this step time lies outside it: something other than communication, such as "
                             "host-bound kernel launches, moves the step time by more than communication does)"))
                else:
                    s += ")"
        if len(naive) and len(base):
            n = naive.iloc[0]
            s += (f". Naive DDP (one blocking all-reduce per parameter after backward) takes {n['step_ms']:.4g} ms, "
                  f"{100 * n['comm_share']:.1f}% of it communication overhead")
        lines.append(s + ".")
        if overlap is not None:
            o = overlap[overlap["setting"] == setting]
            for r in o.itertuples():
                if r.overlap_pct is None or r.overlap_pct != r.overlap_pct:
                    continue
                lines.append(f"  - trace of `{r.variant}`: communication {r.comm_ms:.3g} ms/step, "
                             f"{r.overlap_pct:.1f}% of it overlapped with computation, exposed "
                             f"{r.exposed_comm_ms:.3g} ms/step ({r.exposed_comm_pct_of_step:.1f}% of the step).")
    return "\n".join(lines)


def plot_streams(ax, iv: TraceIntervals, *, title: str = "", step: int | None = 0) -> None:
    """Two lanes, computation and communication, over one profiled step (or all with step=None)."""
    lo, hi = (iv.steps[step] if (step is not None and iv.steps) else
              (0.0, max(b for _, b in iv.comm + iv.compute)))

    def clip(xs):
        return [(max(a, lo) / 1e3, (min(b, hi) - max(a, lo)) / 1e3) for a, b in union(xs) if b > lo and a < hi]

    compute_label = "compute kernels" if iv.kind == "gpu" else "compute (aten ops)"
    comm_label = "NCCL kernels" if iv.kind == "gpu" else "gloo all-reduce"
    ax.broken_barh(clip(iv.compute), (10, 8), facecolors="tab:blue", label=compute_label)
    ax.broken_barh(clip(iv.comm), (0, 8), facecolors="tab:orange", label=comm_label)
    ax.set_yticks([4, 14], [comm_label, compute_label])
    ax.set_xlim(lo / 1e3, hi / 1e3)
    ax.set_xlabel("time in step (ms)")
    if title:
        ax.set_title(title)


def plot_overlap(overlap: pd.DataFrame, *, title: str = ""):
    """Per setting, one lane pair per profiled variant: computation vs communication over a step."""
    rows = list(overlap.itertuples())
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.9 * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        iv = comm_compute_intervals(r.trace)
        pct = "n/a" if r.overlap_pct is None or r.overlap_pct != r.overlap_pct else f"{r.overlap_pct:.0f}%"
        plot_streams(ax, iv, title=f"{r.setting} · {r.variant}: {pct} of communication overlapped, "
                                   f"exposed {r.exposed_comm_ms:.3g} ms/step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# bucket overhead model
# ----------------------------------------------------------------------------------------------

def bucket_model_frame(df: pd.DataFrame, fit: dict, *, overhead_fn, optimal_bytes_fn) -> tuple[pd.DataFrame, dict]:
    """Measured bucketed overheads beside the model's prediction at the same bucket count."""
    rows = []
    for r in df[df["kind"] == "bucketed"].itertuples():
        predicted = overhead_fn(total_bytes=r.grad_bytes, bandwidth_bytes_per_s=fit["bandwidth_bytes_per_s"],
                                per_call_overhead_s=fit["per_call_overhead_s"], n_buckets=r.n_buckets)
        rows.append({"setting": r.setting, "bucket_size_mb": r.bucket_size_mb, "n_buckets": r.n_buckets,
                     "measured_sync_wait_ms": r.sync_wait_ms, "measured_overhead_ms": r.comm_overhead_ms,
                     "model_overhead_ms": predicted * 1e3, "grad_bytes": r.grad_bytes})
    frame = pd.DataFrame(rows)
    grad_bytes = float(df["grad_bytes"].iloc[0])
    opt = {"optimal_bucket_bytes": optimal_bytes_fn(total_bytes=grad_bytes,
                                                    bandwidth_bytes_per_s=fit["bandwidth_bytes_per_s"],
                                                    per_call_overhead_s=fit["per_call_overhead_s"]),
           "grad_bytes": grad_bytes}
    opt["optimal_n_buckets"] = grad_bytes / opt["optimal_bucket_bytes"]
    return frame, opt


def plot_bucket_model(frame: pd.DataFrame, fit: dict, opt: dict, *, overhead_fn, title: str = ""):
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    grad_bytes = opt["grad_bytes"]
    n_max = max(float(frame["n_buckets"].max()) if len(frame) else 1.0, opt["optimal_n_buckets"]) * 3
    n = np.logspace(0, math.log10(max(n_max, 2.0)), 200)
    model = [overhead_fn(total_bytes=grad_bytes, bandwidth_bytes_per_s=fit["bandwidth_bytes_per_s"],
                         per_call_overhead_s=fit["per_call_overhead_s"], n_buckets=x) * 1e3 for x in n]
    size_mb = grad_bytes / n / 2**20
    ax.plot(size_mb, model, color="black", label="model s/(n_b w) + n_b o")
    ax.axvline(opt["optimal_bucket_bytes"] / 2**20, color="gray", ls="--",
               label=f"model optimum {opt['optimal_bucket_bytes'] / 2**20:.3g} MiB")
    for setting, g in frame.groupby("setting", sort=False):
        g = g.sort_values("bucket_size_mb")
        eff = grad_bytes / g["n_buckets"] / 2**20  # the mean bucket actually built
        ax.plot(eff, g["measured_sync_wait_ms"], marker="o", ls=":", label=f"{setting}: wait after backward")
        ax.plot(eff, g["measured_overhead_ms"], marker="s", ls=":", label=f"{setting}: step - nosync step")
    ax.set_xscale("log")
    ax.set_xlabel("mean bucket size (MiB) = gradient bytes / number of buckets")
    ax.set_ylabel("DDP overhead (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"fit: o = {fit['per_call_overhead_s'] * 1e6:.3g} us, "
                          f"w = {fit['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    """``python -m systems.report.distributed allreduce RESULTS.jsonl FIGURE.png``: the time and
    bus-bandwidth figure of an all-reduce run (``python -m systems.bench.allreduce --out RESULTS``)."""
    import argparse
    import sys

    from systems.measure.results import read_records

    parser = argparse.ArgumentParser(prog="python -m systems.report.distributed", description=main.__doc__)
    parser.add_argument("figure_kind", choices=["allreduce"])
    parser.add_argument("results", help="the .jsonl file the benchmark wrote")
    parser.add_argument("figure", help="the .png to write")
    args = parser.parse_args(argv)
    rows = read_records(args.results)
    if not rows:
        print(f"error: {args.results} holds no rows; run python -m systems.bench.allreduce --out {args.results} first",
              file=sys.stderr)
        return 2
    env = rows[0].get("env", {})
    where = env.get("gpu") or f"{env.get('cpu', 'CPU')}"
    fig = plot_allreduce(pd.DataFrame(rows), title=f"all-reduce, fp32, on {where} ({env.get('date', '')[:10]})")
    Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figure, dpi=120, bbox_inches="tight")
    print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
