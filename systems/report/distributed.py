"""Notebook 07 (all-reduce and DDP): tables, figures and the answers, rendered from the rows.

All-reduce rows come from this run and from committed runs on other machines
(``results/13_allreduce_*.jsonl``, written by ``python -m systems.bench.allreduce --out ...``); each
row keeps its own machine and commit (from its ``env``), so the table says where a number came
from. DDP rows and traces come from ``systems.bench.ddp``.
"""

from __future__ import annotations

import glob
import math
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter
import numpy as np
import pandas as pd

from systems.analysis.fits import fit_latency_bandwidth
from systems.analysis.parallel_math import ddp_bucket_overhead, ddp_bucket_overhead_paced, optimal_bucket_bytes
from systems.bench.ddp import variant_plan
from systems.measure.env import REPO_ROOT
from systems.measure.results import machine_of, read_records
from systems.measure.trace import TraceIntervals, comm_compute_intervals, union
from systems.report.notebook import noise_side, param_count, step_spread, value_range, within_noise

THIS_RUN = "this run"
MiB = 2**20


# ----------------------------------------------------------------------------------------------
# all-reduce
# ----------------------------------------------------------------------------------------------

def _labelled(records: list[dict], source: str) -> pd.DataFrame:
    rows = []
    for r in records:
        env = r.get("env") or {}
        rows.append({**{k: v for k, v in r.items() if k != "env"}, "source": source, "machine": machine_of(env),
                     "gpu": env.get("gpu"), "commit": env.get("git_commit"), "date": (env.get("date") or "")[:10]})
    return pd.DataFrame(rows)


def _name(path: Path, root: Path) -> str:
    """A file's name for tables: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(root.resolve())) if path.is_relative_to(root.resolve()) else str(path)


def read_allreduce(paths, *, this_run: str | Path | None = None, root: Path = REPO_ROOT) -> pd.DataFrame:
    """All-reduce rows from ``paths`` (each read once), each labelled with its file (``this_run``'s
    as "this run"), machine, commit and date."""
    frames, seen = [], set()
    for path in [Path(p) for p in paths]:
        if path.resolve() in seen or not path.exists():
            continue
        seen.add(path.resolve())
        mine = this_run is not None and path.resolve() == Path(this_run).resolve()
        frames.append(_labelled(read_records(path), THIS_RUN if mine else _name(path, root)))
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["backend", "world_size", "size_bytes", "status", "source", "machine", "gpu", "commit", "date"])


def archived(patterns: str | None, *, root: Path = REPO_ROOT) -> list[Path]:
    """The committed files matching the space-separated glob ``patterns`` (relative to ``root``)."""
    return [Path(p) for pattern in (patterns or "").split() for p in sorted(glob.glob(str(root / pattern)))]


def allreduce_rows(this_run: str | Path, *, archives: str | None = None, root: Path = REPO_ROOT) -> pd.DataFrame:
    """This run's all-reduce rows and those of the committed runs matching ``archives``."""
    return read_allreduce([Path(this_run), *archived(archives, root=root)], this_run=this_run, root=root)


def allreduce_sources(df: pd.DataFrame) -> pd.DataFrame:
    """One row per source: machine, commit, date, and what it measured."""
    out = []
    for source, g in df.groupby("source", sort=False):
        ok = g[g["status"] == "ok"]
        out.append({"source": source, "machine": g["machine"].iloc[0], "commit": g["commit"].iloc[0],
                    "date": g["date"].iloc[0], "backends": ", ".join(sorted(ok["backend"].unique())),
                    "world sizes": ", ".join(str(w) for w in sorted(ok["world_size"].unique())),
                    "measured": len(ok), "not run": int((g["status"] != "ok").sum())})
    return pd.DataFrame(out)


def allreduce_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = ["source", "machine", "backend", "world_size", "size_mb", "time_ms", "time_ms_p10", "time_ms_p90",
            "algbw_GBps", "busbw_GBps", "iters"]
    ok = df[df["status"] == "ok"]
    return ok[cols].sort_values(["backend", "source", "world_size", "size_mb"]).reset_index(drop=True)


def _series(df: pd.DataFrame):
    """(label, rows) per (source, machine, backend, world size), sorted by size."""
    ok = df[df["status"] == "ok"]
    for (source, machine, backend, ws), g in ok.groupby(["source", "machine", "backend", "world_size"], sort=True):
        yield f"{backend} x{ws}, {machine}" + (" (this run)" if source == THIS_RUN else ""), source, g.sort_values("size_bytes")


def plot_allreduce(df: pd.DataFrame, *, title: str = ""):
    """Time and bus bandwidth against size, one line per (source, backend, ranks): colour by world
    size, marker by backend (o NCCL, s gloo), line by source (solid: this run)."""
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 4.8))
    others = [src for src in dict.fromkeys(df["source"]) if src != THIS_RUN]
    dashes = {THIS_RUN: "-", **{src: ("--", ":", "-.")[i % 3] for i, src in enumerate(others)}}
    for label, source, g in _series(df):
        ws = int(g["world_size"].iloc[0])
        style = dict(color=plt.cm.tab10((ws // 2 - 1) % 10), ls=dashes[source],
                     marker="o" if g["backend"].iloc[0] == "nccl" else "s", ms=4, label=label)
        err = np.clip([g["time_ms"] - g["time_ms_p10"], g["time_ms_p90"] - g["time_ms"]], 0, None)
        ax_t.errorbar(g["size_mb"], g["time_ms"], yerr=err, capsize=2, **style)
        ax_b.plot(g["size_mb"], g["busbw_GBps"], **style)
    for ax in (ax_t, ax_b):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (MB, fp32)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("all-reduce time (ms, median; bars p10-p90)")
    ax_b.set_ylabel("bus bandwidth (GB/s) = algbw x 2(n-1)/n")
    ax_b.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _widest(ok: pd.DataFrame, backend: str) -> pd.DataFrame:
    """The backend's rows from the (source, machine) that measured the most world sizes."""
    g = ok[ok["backend"] == backend]
    if not len(g):
        return g
    span = g.groupby(["source", "machine"])["world_size"].nunique()
    source, machine = max(span.index, key=lambda k: (span[k], k[0] == THIS_RUN))
    return g[(g["source"] == source) & (g["machine"] == machine)]


def _at(g: pd.DataFrame, *, size: int) -> pd.DataFrame:
    return g[g["size_bytes"] == size].sort_values("world_size")


def allreduce_answer(df: pd.DataFrame) -> str:
    """distributed_communication_single_node: how size, world size and backend interact, from every
    measured row (this run's and the committed runs')."""
    ok = df[df["status"] == "ok"]
    parts = []
    nccl, gloo = _widest(ok, "nccl"), _widest(ok, "gloo")
    for name, g in (("NCCL", nccl), ("gloo", gloo)):
        if not len(g):
            continue
        small, large = g["size_bytes"].min(), g["size_bytes"].max()
        ws = int(g["world_size"].min())
        a, b = _at(g, size=small), _at(g, size=large)
        a_ws, b_ws = a[a["world_size"] == ws].iloc[0], b[b["world_size"] == ws].iloc[0]
        where = f"{g['machine'].iloc[0]}, {g['source'].iloc[0]}" + (
            f", commit {g['commit'].iloc[0]}" if g["commit"].iloc[0] and g["source"].iloc[0] != THIS_RUN else "")
        text = (f"With {name} ({where}) at {ws} ranks, {small / 1e6:g} MB takes {a_ws['time_ms']:.3g} ms "
                f"({a_ws['busbw_GBps']:.3g} GB/s bus bandwidth) and {large / 1e6:g} MB {b_ws['time_ms']:.3g} ms "
                f"({b_ws['busbw_GBps']:.3g} GB/s): {large / small:,.0f}x the data costs "
                f"{b_ws['time_ms'] / a_ws['time_ms']:,.0f}x the time"
                # the reason once, with the first backend: it is the same for both
                + (", since a small message pays a fixed per-call latency and only a large one fills the links."
                   if not parts and b_ws["busbw_GBps"] > a_ws["busbw_GBps"] else "."))
        if b["world_size"].nunique() > 1:
            by_ws = ", ".join(f"{int(r.world_size)} ranks {r.busbw_GBps:.3g} GB/s ({r.time_ms:.3g} ms)"
                              for r in b.itertuples())
            lo, hi = b["busbw_GBps"].min(), b["busbw_GBps"].max()
            trend = ("stays within " + f"{hi / lo - 1:.0%}" + " as ranks are added, so the time grows only with the "
                     "2(n-1)/n bytes each rank must move" if hi / lo < 1.3 else
                     ("falls as ranks are added: they share the machine's cores and memory bandwidth"
                      if b.iloc[-1]["busbw_GBps"] < b.iloc[0]["busbw_GBps"] else "rises as ranks are added"))
            text += f" At {large / 1e6:g} MB the bus bandwidth by world size is {by_ws}: it {trend}."
        parts.append(text)
    both = ok.pivot_table(index=["world_size", "size_bytes"], columns="backend", values="time_ms", aggfunc="min")
    if {"nccl", "gloo"} <= set(both.columns):
        ratio = (both["gloo"] / both["nccl"]).dropna()
        if len(ratio):
            parts.append(f"Where both backends measured the same size and world size ({len(ratio)} cases), gloo on "
                         f"CPU is {ratio.min():,.0f}x to {ratio.max():,.0f}x slower than NCCL on GPUs: its bytes go "
                         "through host memory and TCP, NCCL's over NVLink.")
    mine = ok[(ok["source"] == THIS_RUN) & (ok["backend"] == "nccl")]
    other = ok[(ok["source"] != THIS_RUN) & (ok["backend"] == "nccl")]
    same = mine.merge(other, on=["world_size", "size_bytes"], suffixes=("", "_archived"))
    if len(same):
        r = (same["time_ms"] / same["time_ms_archived"])
        parts.append(f"This run's NCCL times are {r.min():.2f}x to {r.max():.2f}x those of the committed runs at the same "
                     f"size and world size ({len(same)} pairs).")
    not_run = df[(df["status"] != "ok") & (df["source"] == THIS_RUN)]
    if len(not_run):
        parts.append(f"Not run here ({len(not_run)} cases): "
                     + "; ".join(f"{r} ({n} {'case' if n == 1 else 'cases'})"
                                 for r, n in not_run["reason"].value_counts().items()) + ".")
    return " ".join(parts)


FIT_LEAST_SQUARES = "least-squares fit t = o + size/w"  # fit_alpha_beta's "how" when neither fallback was taken


def fit_alpha_beta(df: pd.DataFrame, *, backend: str, world_size: int, source: str = THIS_RUN) -> dict | None:
    """Per-call overhead o and algorithm bandwidth w from t = o + s/w over the measured sizes."""
    g = df[(df["status"] == "ok") & (df["backend"] == backend) & (df["world_size"] == world_size)]
    if "source" in g.columns:
        g = g[g["source"] == source]
    if g["size_bytes"].nunique() < 2:
        return None
    o, w = fit_latency_bandwidth(g["size_bytes"].tolist(), (g["time_ms"] / 1e3).tolist())
    how = FIT_LEAST_SQUARES
    if not (w > 0 and math.isfinite(w)):
        # a noisy CPU run can give a non-positive slope; fall back to the best measured rate
        # (algbw = size / time, from the columns every row has)
        w = float((g["size_bytes"] / (g["time_ms"] / 1e3)).max())
        how = "w: best measured algbw (fitted slope not positive)"
    if not o > 0:
        # a fitted intercept <= 0 (few sizes, noise) gives no optimum; the smallest message's time
        # is an upper bound on the per-call cost
        o = float(g.sort_values("size_bytes")["time_ms"].iloc[0] / 1e3)
        how += "; o: smallest message's time (fitted intercept not positive)"
    return {"backend": backend, "world_size": world_size, "per_call_overhead_s": o, "bandwidth_bytes_per_s": w,
            "n_sizes": int(g["size_bytes"].nunique()), "how": how}


# ----------------------------------------------------------------------------------------------
# correctness (the code deliverables)
# ----------------------------------------------------------------------------------------------

def correctness_answer(check: pd.DataFrame, wrapper: str, *, what: str) -> str:
    """naive_ddp / ddp_overlap_individual_parameters / ddp_overlap_bucketed: the wrapper, and how far
    its training landed from one process on the whole batch (both ranks)."""
    rows = check[check["wrapper"] == wrapper]
    r = rows.loc[rows["max_abs_diff"].idxmax()]
    ulp = np.spacing(np.float32(r["max_weight"]))
    return (f"`{what}` (`systems.parallel.ddp`). Trained on {rows['rank'].nunique()} gloo ranks, each on half of a "
            f"{int(r['global_batch'])}-sequence batch of random tokens, for {int(r['steps'])} AdamW steps, a "
            f"{int(r['n_params']):,}-parameter Transformer ends within {r['max_abs_diff']:.2g} of the same training in "
            f"one process on the whole batch (largest difference, in `{r['worst_param']}`; the weights reach "
            f"{r['max_weight']:.2g}, whose float32 spacing is {ulp:.2g}): equal up to the rounding of gradient sums "
            "taken in another order.")


# ----------------------------------------------------------------------------------------------
# DDP variants
# ----------------------------------------------------------------------------------------------

def _ok(ddp: pd.DataFrame) -> pd.DataFrame:
    return ddp[ddp["status"] == "ok"] if "status" in ddp.columns else ddp


def _row(ddp: pd.DataFrame, setting: str, variant: str) -> pd.Series | None:
    g = _ok(ddp)
    g = g[(g["setting"] == setting) & (g["variant"] == variant)]
    return g.iloc[0] if len(g) else None


def ddp_table(ddp: pd.DataFrame) -> pd.DataFrame:
    """One row per (setting, variant): step time (median, p10, p90), its phases, the communication
    overhead over the no-communication step, and the ratio to torch DDP's step."""
    rows = []
    for setting, g in ddp.groupby("setting", sort=False):
        ref = _row(ddp, setting, "torch_ddp")
        for r in g.to_dict("records"):
            ok = r.get("status", "ok") == "ok"
            rows.append({"setting": setting, "variant": r["variant"], "status": r.get("status", "ok"),
                         "n_buckets": r.get("n_buckets"), "step_ms": r.get("step_ms"), "p10_ms": r.get("step_ms_p10"),
                         "p90_ms": r.get("step_ms_p90"), "backward_ms": r.get("backward_ms"),
                         "sync_wait_ms": r.get("sync_wait_ms"), "comm_overhead_ms": r.get("comm_overhead_ms"),
                         "comm_share_pct": 100 * r["comm_share"] if ok and r.get("comm_share") is not None else None,
                         "vs_torch_ddp": r["step_ms"] / ref["step_ms"] if ok and ref is not None else None,
                         "grad_check_ms": r.get("grad_check_ms"), "first_step_s": r.get("first_step_s")})
    return pd.DataFrame(rows)


def plot_ddp(ddp: pd.DataFrame, *, title: str = ""):
    """Per setting: each variant's step split into the no-communication step and the overhead."""
    ok = _ok(ddp)
    settings = list(dict.fromkeys(ok["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(5.5 * len(settings), 4.4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        g = ok[ok["setting"] == setting]
        base = g["baseline_step_ms"].fillna(g["step_ms"]).to_numpy()
        x = np.arange(len(g))
        low = np.minimum(base, g["step_ms"])
        ax.bar(x, low, color="tab:blue", label="no-communication step")
        ax.bar(x, np.clip(g["step_ms"].to_numpy() - base, 0, None), bottom=low, color="tab:orange",
               label="communication overhead")
        ax.errorbar(x, g["step_ms"], yerr=np.clip([g["step_ms"] - g["step_ms_p10"], g["step_ms_p90"] - g["step_ms"]],
                                                 0, None), fmt="none", color="k", capsize=3, lw=1)
        ax.set_xticks(x, g["variant"], rotation=45, ha="right")
        ax.set_ylabel("time per step (ms, median; bars p10-p90)")
        ax.set_title(setting)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def setup_text(ddp: pd.DataFrame, *, model_label: str) -> str:
    r = _ok(ddp).iloc[0]
    settings = ", ".join(dict.fromkeys(_ok(ddp)["setting"]))
    return (f"the {model_label} model ({param_count(r['n_params'])} parameters, {r['grad_bytes'] / 1e6:,.0f} MB of fp32 "
            f"gradients in {int(r['n_tensors'])} tensors), context {int(r['context_length'])}, global batch {int(r['global_batch'])} split "
            f"{int(r['local_batch'])} per rank over {int(r['world_size'])} ranks ({r['backend']} on {r['device']}), "
            f"our AdamW; settings {settings}; {int(r['steps'])} timed steps after the warm-up, each the slowest rank's "
            "time, median (p10-p90)")


def _comm(r: pd.Series) -> str:
    return f"{r['sync_wait_ms']:.3g} ms ({100 * r['sync_wait_ms'] / r['step_ms']:.1f}%)"


def naive_answer(ddp: pd.DataFrame, *, model_label: str) -> str:
    """naive_ddp_benchmarking: setup, step time, and the time spent communicating gradients."""
    clock = "CUDA events" if _ok(ddp)["device"].iloc[0] != "cpu" else "the host clock"
    lines = [f"Setup: {setup_text(ddp, model_label=model_label)}. Communication time is measured two ways: "
             f"the wait from the end of the backward to the end of the gradient sync ({clock}; for naive DDP "
             "this is every all-reduce), and the step time minus that of the same step without any communication."]
    for setting in dict.fromkeys(_ok(ddp)["setting"]):
        n, base = _row(ddp, setting, "naive"), _row(ddp, setting, "nosync")
        if n is None:
            continue
        text = (f"- {setting}: {n['step_ms']:.4g} ms per step ({n['step_ms_p10']:.4g}-{n['step_ms_p90']:.4g}), of which "
                f"{_comm(n)} is the all-reduce of every gradient after the backward")
        if base is not None:
            text += f"; the step without communication takes {base['step_ms']:.4g} ms, {n['step_ms'] - base['step_ms']:.3g} ms less"
        lines.append(text + ".")
    return "\n".join(lines)


def _compare(a: float, b: float, unit: str = "ms") -> str:
    """'2.3 ms faster' / '1.1 ms slower' for a against b (lower is faster)."""
    return f"{abs(a - b):.3g} {unit} {'faster' if a < b else 'slower'}"


def _longer(ms: float) -> str:
    """'2.3 ms longer' / '0.5 ms shorter': noise can put a median below the baseline's."""
    return f"{abs(ms):.3g} ms {'longer' if ms >= 0 else 'shorter'}"


def flat_answer(ddp: pd.DataFrame, *, fit: dict | None) -> str:
    """minimal_ddp_flat_benchmarking: one flattened all-reduce against one per parameter."""
    lines = []
    for setting in dict.fromkeys(_ok(ddp)["setting"]):
        f, n = _row(ddp, setting, "flat"), _row(ddp, setting, "naive")
        if f is None or n is None:
            continue
        lines.append(f"- {setting}: flat {f['step_ms']:.4g} ms per step, communication {_comm(f)}; per-parameter "
                     f"{n['step_ms']:.4g} ms, {_comm(n)}: flat is {_compare(f['step_ms'], n['step_ms'])} per step and its "
                     f"communication {_compare(f['sync_wait_ms'], n['sync_wait_ms'])}.")
    setting = next(iter(dict.fromkeys(_ok(ddp)["setting"])))
    first, flat = _row(ddp, setting, "naive"), _row(ddp, setting, "flat")
    why = "Both send the same bytes; batching removes the fixed cost of each call"
    if fit is not None and first is not None:
        calls = first["n_tensors"] * fit["per_call_overhead_s"] * 1e3
        data = first["grad_bytes"] / fit["bandwidth_bytes_per_s"] * 1e3
        why += (f": {int(first['n_tensors'])} calls at o = {fit['per_call_overhead_s'] * 1e6:.3g} us each (the all-reduce "
                f"fit above) are {calls:.3g} ms, against {data:.3g} ms for the bytes at "
                f"{fit['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s, so the fit predicts that one call saves about "
                f"{calls:.3g} ms")
        if flat is not None:
            saved = first["sync_wait_ms"] - flat["sync_wait_ms"]
            why += f"; measured ({setting}), flat's communication is {_compare(flat['sync_wait_ms'], first['sync_wait_ms'])}"
            if saved < calls / 2:
                # the fit's o is a lone call timed to completion; DDP's calls are queued back to back
                why += (". The fit's o comes from single calls, each timed until it finished; naive DDP queues its "
                        "calls back to back without waiting, so their fixed costs overlap one another and most "
                        "of o never shows in the step")
        why += "; flattening also copies every gradient twice (into the flat buffer and back)"
    return "\n".join(lines) + f"\n\n{why}."


def overlap_answer(ddp: pd.DataFrame) -> str:
    """ddp_overlap_individual_parameters_benchmarking (a): overlap against naive and flat."""
    lines = []
    for setting in dict.fromkeys(_ok(ddp)["setting"]):
        o, n, f, base = (_row(ddp, setting, v) for v in ("overlap", "naive", "flat", "nosync"))
        if o is None or n is None or f is None:
            continue
        text = (f"- {setting}: overlapped {o['step_ms']:.4g} ms per step ({o['step_ms_p10']:.4g}-{o['step_ms_p90']:.4g}), "
                f"{_compare(o['step_ms'], n['step_ms'])} than naive ({n['step_ms']:.4g}) and "
                f"{_compare(o['step_ms'], f['step_ms'])} than flat ({f['step_ms']:.4g}); the wait after the backward "
                f"is {o['sync_wait_ms']:.3g} ms against naive's {n['sync_wait_ms']:.3g} ms")
        if base is not None:
            slowed, over = o["backward_ms"] - base["backward_ms"], o["step_ms"] - base["step_ms"]
            if 0 <= slowed <= over:
                text += (f", and of its {over:.3g} ms over the no-communication step, {slowed:.3g} ms is a longer "
                         + ("backward, which shares the GPU with the all-reduce kernels launched during it"
                            if o["device"] != "cpu" else "backward (gloo's threads share the CPU with it)"))
            else:
                # medians of different quantities: they need not add up, and here they do not
                text += (f"; its backward's median is {_longer(slowed)} than the no-communication step's and "
                         f"its step's {_longer(over)}, so these medians do not split the overhead (the "
                         f"no-communication step spreads over {base['step_ms_p10']:.4g}-{base['step_ms_p90']:.4g} ms)")
        lines.append(text + ".")
    return "\n".join(lines)


def trace_answer(overlap: pd.DataFrame) -> str:
    """ddp_overlap_individual_parameters_benchmarking (b): what the traces show, per setting."""
    ok = overlap[overlap["status"] == "ok"] if len(overlap) else overlap
    lines = []
    for r in ok.itertuples():
        lines.append(f"- {r.setting} · `{r.variant}`: {r.comm_ms:.3g} ms of communication per step, "
                     f"{(r.overlap_pct or 0):.0f}% of it beside computation; {r.exposed_comm_ms:.3g} ms exposed "
                     f"({(r.exposed_comm_pct_of_step or 0):.1f}% of the {r.step_window_ms:.4g} ms step).")
    return ("The figure shows one whole profiled step of each (rank 0; GPU: the kernels on all streams, "
            "communication = NCCL kernels, symmetric memory's barriers and the copies on their streams; CPU: gloo's "
            "all-reduce ranges against the training thread's operators). "
            "Naive DDP's communication starts only when the backward has ended; the overlapped variants' runs "
            "beside the backward.\n" + "\n".join(lines))


def reads_peers(variant: str) -> bool:
    """Whether a DDP variant's updates read the other GPU's gradients where they lie (no copies)."""
    return variant_plan(variant).read_peers


def best_of_ours(g: pd.DataFrame) -> pd.Series | None:
    """The fastest of our wrappers in one setting's rows (not the nosync baseline, not torch DDP);
    None when none of them ran (the budget skipped them)."""
    ours = g[~g["variant"].isin(["nosync", "torch_ddp"])]
    return ours.loc[ours["step_ms"].idxmin()] if len(ours) else None


def trace_row(overlap: pd.DataFrame | None, *, setting: str, variant: str) -> pd.Series | None:
    """The overlap analysis of one (setting, variant)'s profiled trace, None when it was not profiled."""
    if overlap is None or not len(overlap):
        return None
    rows = overlap[(overlap["setting"] == setting) & (overlap["variant"] == variant)]
    if "status" in rows.columns:
        rows = rows[rows["status"] == "ok"]
    return rows.iloc[0] if len(rows) else None


# Our targets for DDP in the compiled bf16 setting (the project's, not the handout's): the best
# variant's step over torch DDP's, its step over the no-communication step (% of its step), and
# the communication its trace shows exposed (% of the step).
TARGET_VS_TORCH_DDP = 1.0
TARGET_OVER_NOSYNC_PCT = 5.0
TARGET_EXPOSED_IN_TRACE_PCT = 3.0


def ddp_targets(table: pd.DataFrame, overlap: pd.DataFrame | None, paired: pd.DataFrame | None = None) -> str:
    """Per setting (of ddp_table's output): the best variant's step time over torch DDP's, its step
    over the no-communication step, and its trace's exposed-communication share, each beside our
    own target (the project's, not the handout's: the ``TARGET_*`` constants above). Where
    ``paired`` (the benchmark's paired rounds) has rounds of the setting, the time over the
    no-communication step and, where torch DDP ran in every round, the step over torch DDP's are
    also given as the rounds' medians, the estimates a drifting machine moves least."""
    lines = []
    for setting, g in _ok(table).groupby("setting", sort=False):
        best = best_of_ours(g)
        if best is None:
            continue
        traced = trace_row(overlap, setting=setting, variant=best["variant"])
        exposed = traced["exposed_comm_pct_of_step"] if traced is not None else None
        # a variant the budget skipped (torch DDP and the profiled step come last) leaves its
        # column empty: say so, rather than print a NaN against a target
        line = f"- {setting}: best `{best['variant']}` " + (
            f"runs at {best['vs_torch_ddp']:.3f}x torch DDP's step time (our target <= {TARGET_VS_TORCH_DDP:g})"
            if pd.notna(best["vs_torch_ddp"]) else
            f"has no torch DDP step beside it in this run (our target <= {TARGET_VS_TORCH_DDP:g}x not judged)")
        line += "; " + (
            f"{best['comm_share_pct']:.1f}% of its step is time over the no-communication step "
            f"(our target <= {TARGET_OVER_NOSYNC_PCT:g}%)" if pd.notna(best["comm_share_pct"]) else
            f"the no-communication step did not run (our target <= {TARGET_OVER_NOSYNC_PCT:g}% over it not judged)")
        rounds = paired_summary(paired, setting=setting)
        if rounds is not None:
            with_torch = rounds["vs_torch_ddp"] is not None
            line += (f", {100 * rounds['share']:.1f}% as the median of {rounds['n']} rounds alternating it with "
                     f"no sync{' and torch DDP' if with_torch else ''} ({100 * rounds['share_min']:.1f}% to "
                     f"{100 * rounds['share_max']:.1f}% by round)")
            if with_torch:
                line += (f"; by the rounds' median it runs at {rounds['vs_torch_ddp']:.3f}x torch DDP's step "
                         f"({rounds['vs_torch_ddp_min']:.3f}x to {rounds['vs_torch_ddp_max']:.3f}x by round)")
        lines.append(line + (f", {exposed:.1f}% exposed communication in its trace (our target <= "
                             f"{TARGET_EXPOSED_IN_TRACE_PCT:g}%)." if pd.notna(exposed) else
                             f"; no step of it was profiled (our target <= {TARGET_EXPOSED_IN_TRACE_PCT:g}% exposed "
                             "communication in its trace not judged)."))
    return "\n".join(lines)


def paired_summary(paired: pd.DataFrame | None, *, setting: str) -> dict | None:
    """The paired rounds of ``setting``: their count, the median overhead (ms), the median, lowest
    and highest share of the variant's step, and the same of its step over torch DDP's (None
    unless torch DDP ran in every completed round, so that both stand for the same rounds); None
    without a completed round."""
    if paired is None or not len(paired):
        return None
    g = _ok(paired)
    g = g[g["setting"] == setting]
    if not len(g):
        return None
    out = {"n": len(g), "overhead_ms": float(g["overhead_ms"].median()),
           "share": float(g["share"].median()), "share_min": float(g["share"].min()),
           "share_max": float(g["share"].max()), "vs_torch_ddp": None, "vs_torch_ddp_min": None,
           "vs_torch_ddp_max": None}
    if "vs_torch_ddp" in g and g["vs_torch_ddp"].notna().all():
        ratio = g["vs_torch_ddp"]
        out.update(vs_torch_ddp=float(ratio.median()), vs_torch_ddp_min=float(ratio.min()),
                   vs_torch_ddp_max=float(ratio.max()))
    return out


def paired_table(paired: pd.DataFrame) -> pd.DataFrame:
    """One row per paired round: which ran first, the step medians, the overhead over no sync and its
    share, and (where the rounds ran torch DDP) the step over torch DDP's."""
    columns = ["setting", "round", "variant", "first", "nosync_ms", "variant_ms", "overhead_ms", "share"]
    if "torch_ddp_ms" in paired:
        columns += ["torch_ddp_ms", "vs_torch_ddp"]
    out = paired.reindex(columns=columns + ["status"]).copy()
    out.insert(out.columns.get_loc("share"), "share_pct", 100 * out.pop("share"))
    return out


def _within_noise(a: pd.Series, b: pd.Series) -> str | None:
    """'within the noise (...)' where one row's median step lies inside the other's p10-p90 range
    (``notebook.noise_side``), else None, as also where a spread is missing."""
    if within_noise({"a": step_spread(a), "b": step_spread(b)}):
        return "within the noise: one median inside the other's p10-p90 range"
    return None


def ddp_commentary(df: pd.DataFrame, overlap: pd.DataFrame | None = None) -> str:
    """Per setting: the best of our variants against torch DDP and the no-communication step, and
    whether what communication costs is exposed communication or computation slowed beside it."""
    lines = []
    overlap = overlap if overlap is not None and len(overlap) else None
    for setting, g in _ok(df).groupby("setting", sort=False):
        best = best_of_ours(g)
        if best is None:
            continue
        torch_row = g[g["variant"] == "torch_ddp"]
        base = g[g["variant"] == "nosync"]
        s = f"- **{setting}**: the best of our variants is `{best['variant']}` at {best['step_ms']:.4g} ms/step"
        if len(torch_row):
            t = torch_row.iloc[0]
            ratio = best["step_ms"] / t["step_ms"]
            s += (f", {ratio:.3f}x torch DDP's {t['step_ms']:.4g} ms "
                  f"({_within_noise(best, t) or ('as fast or faster' if ratio <= 1 else 'slower')})")
        if len(base):
            s += f"; without any communication a step takes {base.iloc[0]['step_ms']:.4g} ms, so "
            if best["comm_overhead_ms"] > 0:
                s += (f"`{best['variant']}` is {best['comm_overhead_ms']:.3g} ms slower "
                      f"({100 * best['comm_share']:.1f}% of its step"
                      + (f"; {noise}" if (noise := _within_noise(best, base.iloc[0])) else "") + ")")
                traced = trace_row(overlap, setting=setting, variant=best["variant"])
                if traced is not None:
                    exposed = float(traced["exposed_comm_ms"])
                    # overlapped communication still costs: NCCL kernels take SMs and memory
                    # bandwidth from the computation running beside them
                    s += f"; its trace shows {exposed:.3g} ms/step of communication with no computation beside it"
                    if reads_peers(best["variant"]):
                        s += (" (its barriers); the rest of the difference is in its updates, which load the other "
                              "GPU's gradients over NVLink inside the update kernels (computation, to a trace)")
                    elif exposed > best["comm_overhead_ms"]:
                        # the profiler's own host work can leave the GPU idle beside the communication
                        s += (", more than the whole difference: the profiled step did not run as the timed ones did, "
                              "so its trace does not say how their difference splits")
                    elif exposed < best["comm_overhead_ms"] / 2:
                        s += ", so most of the difference is computation slowed by the communication running beside it"
                    else:
                        s += ", so most of the difference is communication left exposed"
            else:
                b0 = base.iloc[0]
                s += f"`{best['variant']}` costs nothing measurable over it ({best['comm_overhead_ms']:.3g} ms"
                inside = within_noise({r["variant"]: step_spread(r) for r in (b0, best)})
                if inside is not None:
                    s += (f"; the no-communication steps range {b0['step_ms_p10']:.4g}-{b0['step_ms_p90']:.4g} ms "
                          "from 10th to 90th percentile, "
                          + ("and the two are within the noise (one median inside the other's p10-p90 range))"
                             if inside else
                             "and the two lie apart: something other than communication, such as host-bound "
                             "kernel launches, moves the step time by more than communication does)"))
                else:
                    s += ")"
        lines.append(s + ".")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# overlap traces
# ----------------------------------------------------------------------------------------------

def plot_streams(ax, iv: TraceIntervals, *, title: str = "", step: int = 0) -> None:
    """Two lanes, computation and communication, over one whole profiled step."""
    lo, hi = iv.steps[step] if iv.steps else (0.0, max(b for _, b in iv.comm + iv.compute))

    def clip(xs):
        return [(max(a, lo) / 1e3, (min(b, hi) - max(a, lo)) / 1e3) for a, b in union(xs) if b > lo and a < hi]

    compute_label = "compute kernels" if iv.kind == "gpu" else "compute (aten ops)"
    comm_label = "NCCL kernels" if iv.kind == "gpu" else "gloo all-reduce"
    ax.broken_barh(clip(iv.compute), (10, 8), facecolors="tab:blue")
    ax.broken_barh(clip(iv.comm), (0, 8), facecolors="tab:orange")
    ax.set_yticks([4, 14], [comm_label, compute_label])
    ax.set_xlim(lo / 1e3, hi / 1e3)
    ax.set_xlabel("time (ms) from the first profiled step's start")
    if title:
        ax.set_title(title, fontsize=10)


OVERLAP_COLUMNS = ["setting", "variant", "step_window_ms", "comm_ms", "compute_ms", "overlapped_ms", "exposed_comm_ms",
                   "overlap_pct"]


def overlap_table(overlap: pd.DataFrame) -> pd.DataFrame:
    """The profiled steps' overlap numbers; the variants the budget left unprofiled, by status."""
    if not len(overlap):
        return pd.DataFrame(columns=OVERLAP_COLUMNS)
    return overlap.reindex(columns=OVERLAP_COLUMNS + ["status"])


def plot_overlap(overlap: pd.DataFrame, *, title: str = ""):
    """One lane pair per profiled (setting, variant): computation against communication over the
    first profiled step, whole."""
    rows = list(overlap[overlap["status"] == "ok"].itertuples()) if len(overlap) else []
    if not rows:
        fig, ax = plt.subplots(figsize=(8, 1.5))
        ax.text(0.5, 0.5, "no step was profiled in this run", ha="center", va="center")
        ax.set_axis_off()
        return fig
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.9 * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        pct = "n/a" if r.overlap_pct is None or r.overlap_pct != r.overlap_pct else f"{r.overlap_pct:.0f}%"
        plot_streams(ax, comm_compute_intervals(r.trace),
                     title=f"{r.setting} · {r.variant}: {pct} of communication overlapped, "
                           f"exposed {r.exposed_comm_ms:.3g} ms of a {r.step_window_ms:.4g} ms step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# bucket sweep against the overhead model
# ----------------------------------------------------------------------------------------------

def quietest_setting(ddp: pd.DataFrame) -> str:
    """The setting whose no-communication step varies least (p90 - p10 over the median): the one
    whose differences between variants are least noise."""
    base = _ok(ddp)[_ok(ddp)["variant"] == "nosync"]
    spread = (base["step_ms_p90"] - base["step_ms_p10"]) / base["step_ms"]
    return base.loc[spread.idxmin(), "setting"]


def bucket_model_frame(ddp: pd.DataFrame, fit: dict) -> pd.DataFrame:
    """Per bucketed row: the measured wait after backward and step overhead beside the models.

    ``handout_model_ms``: s/(n_b w) + n_b o, which assumes each bucket's gradients take as long to
    compute as to send. ``paced_model_ms``: the same queue with the backward this setting measured
    (its no-communication step's) and the real last bucket. ``backward_slowdown_ms``: how much
    longer the backward ran than without communication, which neither model has.
    """
    rows = []
    ok = _ok(ddp)
    for r in ok[ok["kind"].isin(["bucketed", "bucketed_tail"])].to_dict("records"):
        base = _row(ddp, r["setting"], "nosync")
        if base is None:
            continue
        w, o = fit["bandwidth_bytes_per_s"], fit["per_call_overhead_s"]
        rows.append({
            "setting": r["setting"], "variant": r["variant"], "n_buckets": int(r["n_buckets"]),
            "mean_bucket_mib": r["grad_bytes"] / r["n_buckets"] / MiB, "last_bucket_mib": r["last_bucket_bytes"] / MiB,
            "step_ms": r["step_ms"], "p10_ms": r["step_ms_p10"], "p90_ms": r["step_ms_p90"],
            "overhead_ms": r["step_ms"] - base["step_ms"], "wait_after_backward_ms": r["sync_wait_ms"],
            "paced_model_ms": 1e3 * ddp_bucket_overhead_paced(
                total_bytes=r["grad_bytes"], bandwidth_bytes_per_s=w, per_call_overhead_s=o, n_buckets=r["n_buckets"],
                backward_s=base["backward_ms"] / 1e3, last_bucket_bytes=r["last_bucket_bytes"]),
            "handout_model_ms": 1e3 * ddp_bucket_overhead(total_bytes=r["grad_bytes"], bandwidth_bytes_per_s=w,
                                                          per_call_overhead_s=o, n_buckets=r["n_buckets"]),
            "backward_slowdown_ms": r["backward_ms"] - base["backward_ms"],
            "grad_bytes": r["grad_bytes"], "backward_ms": base["backward_ms"]})
    return pd.DataFrame(rows)


def robust_best(frame: pd.DataFrame) -> tuple[pd.Series, list[str]]:
    """The row with the lowest p90 step time, and the other variants within the noise of it by the
    report's rule (``notebook.noise_side``): not told apart from it by these steps."""
    best = frame.loc[frame["p90_ms"].idxmin()]
    spread = lambda r: (r["step_ms"], r["p10_ms"], r["p90_ms"])  # noqa: E731
    ties = [r["variant"] for _, r in frame.iterrows() if r["variant"] != best["variant"]
            and noise_side({"best": spread(best), "other": spread(r)}) is not None]
    return best, ties


def plot_bucket_model(frame: pd.DataFrame, fit: dict, *, title: str = ""):
    """Per setting: measured wait after backward and step overhead against the mean bucket, with
    the two models over the same axis."""
    settings = list(dict.fromkeys(frame["setting"]))
    fig, axes = plt.subplots(1, len(settings), figsize=(5.8 * len(settings), 4.4), squeeze=False)
    w, o = fit["bandwidth_bytes_per_s"], fit["per_call_overhead_s"]
    for ax, setting in zip(axes[0], settings):
        g = frame[(frame["setting"] == setting)].sort_values("mean_bucket_mib")
        s, bwd = float(g["grad_bytes"].iloc[0]), float(g["backward_ms"].iloc[0]) / 1e3
        n = np.geomspace(1, max(2.0, 3 * g["n_buckets"].max()), 200)
        ax.plot(s / n / MiB, [1e3 * ddp_bucket_overhead(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o,
                                                        n_buckets=x) for x in n], "k--",
                label="handout model s/(n_b w) + n_b o")
        ax.plot(s / n / MiB, [1e3 * ddp_bucket_overhead_paced(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o,
                                                              n_buckets=x, backward_s=bwd) for x in n], "k-",
                label="paced by the measured backward")
        ax.axvline(optimal_bucket_bytes(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o) / MiB,
                   color="gray", ls=":", label="handout model's optimum")
        ax.plot(g["mean_bucket_mib"], g["wait_after_backward_ms"], "o", color="tab:orange", label="measured wait after backward")
        ax.errorbar(g["mean_bucket_mib"], g["overhead_ms"], yerr=np.clip([g["step_ms"] - g["p10_ms"], g["p90_ms"] - g["step_ms"]],
                                                                     0, None), fmt="s", color="tab:blue", capsize=3,
                    label="measured step - no-communication step")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a short log axis collide
        ax.set_xlabel("mean bucket (MiB) = gradient bytes / buckets")
        ax.set_ylabel("ms")
        ax.set_title(setting)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or f"bucketed DDP against the overhead model (o = {o * 1e6:.3g} us, w = {w / 1e9:.3g} GB/s)")
    fig.tight_layout()
    return fig


def _bytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _span(values: pd.Series) -> str:
    return f"{value_range(values, '{:.3g}')} ms"


def bucketed_answer(ddp: pd.DataFrame, frame: pd.DataFrame, fit: dict) -> str:
    """ddp_bucketed_benchmarking (a): step time per bucket size, what the handout's model expects,
    whether the measurements match it, why not, and the setup that would: all from the rows."""
    quiet = quietest_setting(ddp)
    g = frame[(frame["setting"] == quiet) & (frame["variant"].str.startswith("bucketed:"))].sort_values("mean_bucket_mib")
    if not len(g):
        return "No bucketed variant ran in this profile."
    best, ties = robust_best(g)
    w, o = fit["bandwidth_bytes_per_s"], fit["per_call_overhead_s"]
    s, bwd = float(g["grad_bytes"].iloc[0]), float(g["backward_ms"].iloc[0])
    transfer = s / w * 1e3
    cap = lambda r: r["variant"].partition(":")[2]  # noqa: E731
    naive, overlap = _row(ddp, quiet, "naive"), _row(ddp, quiet, "overlap")
    text = (f"Step time by bucket cap ({quiet}, the setting whose no-communication steps vary least): "
            + ", ".join(f"{cap(r)} MiB {r['step_ms']:.4g} ms ({r['p10_ms']:.4g}-{r['p90_ms']:.4g})" for _, r in g.iterrows())
            + (f"; without buckets, per-parameter overlap {overlap['step_ms']:.4g} ms and naive {naive['step_ms']:.4g} ms"
               if naive is not None and overlap is not None else "")
            + f". By the lowest 90th percentile the best cap is {cap(best)} MiB ({best['p90_ms']:.4g} ms)"
            + (f", not told apart by these steps from {', '.join(ties)}" if ties else "") + ". ")
    expected = g.loc[g["handout_model_ms"].idxmin()]
    optimum = optimal_bucket_bytes(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o) / MiB
    agree = cap(expected) == cap(best) or cap(expected) in [t.partition(":")[2] for t in ties]
    text += (f"Expected, from the handout's model with this run's o = {o * 1e6:.3g} us and w = {w / 1e9:.3g} GB/s: an "
             f"optimum at {optimum:,.3g} MiB buckets, so among these caps {cap(expected)} MiB, "
             f"{expected['handout_model_ms']:.3g} ms after the backward. The measured best "
             + ("agrees" if agree else "does not") + ". ")
    ratio = bwd / transfer
    gap = (g["paced_model_ms"] - g["wait_after_backward_ms"]).abs()
    text += (f"The model assumes a bucket's gradients take as long to compute as to send; here the backward takes "
             f"{bwd:.4g} ms and sending all {_bytes(s)} {transfer:.3g} ms, "
             + (f"{ratio:.3g}x less, so communication keeps pace and mostly the last bucket waits"
                if ratio > 1 else f"{1 / ratio:.3g}x more, so the all-reduces queue up behind the backward")
             + f": with the measured backward (the paced model) the predicted wait after the backward is within "
             f"{gap.max():.3g} ms of the measured one ({_span(g['wait_after_backward_ms'])}), against "
             f"{(g['handout_model_ms'] - g['wait_after_backward_ms']).abs().max():.3g} ms for the handout's model. ")
    slowed = g["backward_slowdown_ms"]
    order = np.corrcoef(g["n_buckets"], slowed)[0, 1] if len(g) > 2 and slowed.std() > 0 else float("nan")
    mostly = "mostly not" if (g["overhead_ms"] - g["wait_after_backward_ms"]).median() > g["wait_after_backward_ms"].median() \
        else "mostly"
    text += (f"The step overhead over the no-communication step ({_span(g['overhead_ms'])}) is {mostly} that wait: "
             f"the backward itself runs {_span(slowed)} longer beside the communication"
             + (", more with more (smaller) buckets" if order > 0.5 else ", less with more (smaller) buckets"
                if order < -0.5 else "") + ", which neither model has. ")
    text += (f"A setup whose communication is as slow as its backward would match the handout's model: a link "
             f"{ratio:.3g}x slower than this run's (about {s / (bwd / 1e3) / 1e9:.3g} GB/s), or a backward {ratio:.3g}x "
             "faster." if ratio > 1 else "This setup already sends as slowly as it computes, the model's assumption.")
    return text


# ----------------------------------------------------------------------------------------------
# the all-reduce figure as a command
# ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``python -m systems.report.distributed allreduce RESULTS.jsonl FIGURE.png``: the time and
    bus-bandwidth figure of an all-reduce run (``python -m systems.bench.allreduce --out RESULTS``)."""
    import argparse
    import sys

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
    fig = plot_allreduce(_labelled(rows, THIS_RUN),
                         title=f"all-reduce, fp32, on {machine_of(env)} ({env.get('date', '')[:10]})")
    Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figure, dpi=120, bbox_inches="tight")
    print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
