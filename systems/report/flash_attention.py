"""Notebook 06 (FlashAttention-2): tables, figures and answer text from the rows of
``systems.bench.flash`` (check_errors, flash_benchmarking, matmul_ceilings, matmul_kernels, leaderboard)."""

from __future__ import annotations

import inspect

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from systems.bench.budget import SKIPPED
from systems.bench.flash import (ERROR_NAMES, LEADERBOARD, LEADERBOARD_TARGET, PASSES, SKIPPED_MEMORY,
                                 SPEED_TARGETS, TRITON_VARIANTS, is_ours)
from systems.measure import flops as flop_count
from systems.report.notebook import faster_or_slower, within_noise

# Our bounds on the errors against float64 (each divided by max(1, max |reference|)), as the tests
# hold them: fp32 is a few ulps times the tiles summed (1e-4 leaves room for the GPU's other
# summation orders); bf16 keeps 8 mantissa bits (~4e-3 per rounding) and the kernels round P and
# dS to it before the tensor-core dots; fp16 keeps 11.
TOLERANCES = {"fp64": 1e-12, "fp32": 1e-4, "fp16": 5e-3, "bf16": 3e-2}
PASS_NAMES = {"fwd": "forward", "bwd": "backward", "e2e": "forward + backward"}
HANDOUT_GPU = {"2025": "H100", "2026": "B200"}  # the GPU each handout's flash_benchmarking names


def _fmt_ms(ms: float) -> str:
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _ratio(x: float) -> str:
    return f"{x:,.0f}x" if x >= 100 else f"{x:.3g}x"


# ----------------------------------------------------------------------------- correctness


def prewarm_line(report: dict) -> str:
    """One sentence on systems.bench.flash.prewarm's compiles ahead of the timed process."""
    text = (f"Compiled ahead: {report['calls']} forward + backward calls in {report['jobs']} jobs over "
            f"{report['workers']} worker processes took {report['seconds']:.0f} s, leaving their compiles in Triton's "
            "on-disk cache; the timings below autotune every key in this process.")
    if report["failed"]:
        text += (f" {len(report['failed'])} job(s) failed there (the check and the sweep below report their own "
                 f"errors); the first: {report['failed'][0]['error'].strip().splitlines()[-1]}")
    return text


def check_table(rows: list[dict]) -> pd.DataFrame:
    """One line per checked (implementation, dtype, shape): the errors, our bound and whether they
    hold it, and whether the graph saved L."""
    df = pd.DataFrame(rows)
    df["q_shape"] = df["q_shape"].map(lambda s: "x".join(map(str, s)))
    df["bound"] = df["dtype"].map(TOLERANCES)
    df["within"] = df["worst"] <= df["bound"]
    return df[["impl", "dtype", "dot", "device", "q_shape", "n_k", "causal", *ERROR_NAMES, "bound", "within",
               "saves_lse"]]


def _worst(table: pd.DataFrame, impl: str, names: tuple[str, ...] = ERROR_NAMES) -> str:
    """Per (dtype, dot precision, device) of ``impl``'s rows: the worst of the ``names`` errors,
    over how many cases, and whether our bound held."""
    texts = []
    for (dtype, dot, device), rows in table[table["impl"] == impl].groupby(["dtype", "dot", "device"], sort=False):
        worst = rows[list(names)].max().max()
        label = dtype if dot == dtype else f"{dtype} ({dot} dots)"
        texts.append(f"{label} on {device}: worst error {worst:.1e} over {len(rows)} cases "
                     f"(our bound {TOLERANCES[dtype]:.0e}: {'held' if worst <= TOLERANCES[dtype] else 'NOT held'})")
    return "; ".join(texts)


def forward_answers(table: pd.DataFrame, *, triton_where: str) -> dict[tuple[str, str], str]:
    """The code deliverables' answers, keyed (problem, part): what implements each and how it
    checked out in this run (``triton_where`` says where the Triton rows ran)."""
    from systems.attention.flash_triton import FlashAttentionTriton
    from systems.attention.flash_pytorch import TILE_K, TILE_Q

    answers = {}
    pt = table[table["impl"] == "flash_pytorch"]
    answers[("flash_forward", "a")] = (
        "`systems.attention.flash_pytorch.FlashAttentionPytorch` (`flash_forward`): a tiled forward with an "
        f"online softmax over {TILE_Q} x {TILE_K} tiles, saving Q, K, V, O and the logsumexp L. Against float64 autograd of "
        f"the direct formula: {_worst(table, 'flash_pytorch')}; L was saved (a tensor shaped (..., n_queries)) in "
        f"{int(pt['saves_lse'].sum())} of {len(pt)} cases.")
    tri = table[table["impl"].isin(TRITON_VARIANTS)]
    if tri.empty:
        return answers
    answers[("flash_forward", "b")] = (
        "`systems.attention.flash_triton.FlashAttentionTriton`: the forward kernel (`flash_fwd_kernel`, launch "
        "grid (query tiles, batch), one loop over key tiles) behind an autograd Function. Checked "
        f"{triton_where}: {_worst(table, 'triton')}"
        + "".join(f"; `{impl}`: {_worst(table, impl)}" for impl in tri.impl.unique()
                  if impl not in ("triton", "triton_pytorch_bwd"))
        + f"; L saved in {int(tri['saves_lse'].sum())} of {len(tri)} cases.")
    default = inspect.signature(FlashAttentionTriton.forward).parameters["is_causal"].default
    causal = tri[tri["causal"]]
    answers[("flash_forward", "c")] = (
        f"`is_causal` is the last argument of `FlashAttentionTriton.apply` and defaults to `{default}`; the kernels "
        "take it as the constexpr `IS_CAUSAL` and mask the diagonal tiles by an index comparison (adding -1e6), "
        f"skipping the tiles above it. Of the {len(causal)} causal cases above (fewer queries than keys included: "
        f"the queries are the last positions), {int(causal['within'].sum())} hold our bound.")
    return answers


def backward_answer(table: pd.DataFrame) -> str:
    """flash_backward: the recompute backward, equations 13-19 from L, compiled on CUDA."""
    pt = table[table["impl"] == "flash_pytorch"]
    text = ("`systems.attention.flash_pytorch.flash_backward`: dQ, dK, dV from Q, K, V, O, dO and L (D = rowsum(O * dO), "
            "P recomputed as exp(S - L)), run through `torch.compile` on CUDA (eager on a CPU, where inductor's C++ "
            "build would dominate). Its gradients against float64: "
            + _worst(pt, "flash_pytorch", names=ERROR_NAMES[1:]))
    both = table[table["impl"] == "triton_pytorch_bwd"]
    if not both.empty:
        text += ("; the same compiled backward behind the Triton forward (`FlashVariant(backward='pytorch')`): "
                 + _worst(both, "triton_pytorch_bwd", names=ERROR_NAMES[1:]))
    return text + "."


# ----------------------------------------------------------------------------- latency tables


def latency_table(sweep: pd.DataFrame, pass_: str, *, ours: str, baseline: str = "naive") -> pd.DataFrame:
    """One line per (dtype, d, seq): each implementation's median ms for ``pass_``, our p10 and p90,
    our model TFLOP/s, and the baseline's time over ours (> 1: ours is faster), measured in one run."""
    ok = sweep[sweep["status"] == "ok"]
    table = ok.pivot_table(index=["dtype", "d", "seq"], columns="impl", values=f"{pass_}_ms", aggfunc="first")
    # ours first, then our other variants, then the baselines in the order they ran
    order = sorted(dict.fromkeys(sweep["impl"]), key=lambda c: (c != ours, not is_ours(c)))
    table = table[[c for c in order if c in table.columns]]
    table.columns = [f"{c} ms" for c in table.columns]
    mine = ok[ok["impl"] == ours].set_index(["dtype", "d", "seq"])
    for col, name in ((f"{pass_}_p10_ms", f"{ours} p10"), (f"{pass_}_p90_ms", f"{ours} p90"),
                      (f"{pass_}_tflops", f"{ours} TFLOP/s")):
        table[name] = mine[col]
    if f"{baseline} ms" in table and f"{ours} ms" in table:
        table[f"{baseline} / {ours}"] = table[f"{baseline} ms"] / table[f"{ours} ms"]
    # every grid point keeps its line, a point where nothing ran included
    grid = pd.MultiIndex.from_frame(sweep[["dtype", "d", "seq"]].drop_duplicates())
    return table.reindex(grid).sort_index()


def status_table(sweep: pd.DataFrame) -> pd.DataFrame:
    """The points that did not run, grouped: implementation, dtype, status, how many, the
    sequence lengths and one reason."""
    bad = sweep[sweep["status"] != "ok"]
    if bad.empty:
        return pd.DataFrame(columns=["impl", "dtype", "status", "points", "seq from", "seq to", "reason"])
    return (bad.groupby(["impl", "dtype", "status"], as_index=False)
            .agg(points=("seq", "size"), **{"seq from": ("seq", "min"), "seq to": ("seq", "max")},
                 reason=("error", "first")))


def ceiling_table(ceilings: list[dict]) -> pd.DataFrame:
    """The measured matmul ceilings (systems.bench.flash.matmul_ceilings), one line per dot precision."""
    return pd.DataFrame(ceilings)[["dot", "what", "tflops"]].rename(columns={"tflops": "TFLOP/s"})


def plot_tflops(sweep: pd.DataFrame, *, ceilings: list[dict] | None, title: str):
    """Forward + backward TFLOP/s (model FLOPs) against the sequence length, one panel per (dtype,
    head dim) where something ran, with the measured matmul ceilings of the dtype's dot precisions."""
    ok = sweep[sweep["status"] == "ok"]
    panels = list(ok.groupby(["dtype", "d"]).groups)
    dtypes = list(dict.fromkeys(d for d, _ in panels))
    dims = sorted({d for _, d in panels})
    fig, axes = plt.subplots(len(dtypes), len(dims), figsize=(3.6 * len(dims), 3.2 * len(dtypes)),
                             sharex=True, squeeze=False)
    lines = {c["dot"]: c["tflops"] for c in ceilings or []}
    for r, dtype in enumerate(dtypes):
        for c, d in enumerate(dims):
            ax = axes[r][c]
            part = ok[(ok.dtype == dtype) & (ok.d == d)]
            if part.empty:  # a (dtype, d) with nothing measured: say so rather than leave it blank
                ax.text(0.5, 0.5, "no point ran", ha="center", va="center", transform=ax.transAxes)
            for impl, series in part.groupby("impl", sort=False):
                ax.plot(series.seq, series.e2e_tflops, marker="o", ms=3, label=impl)
            for dot in ((dtype,) if dtype != "fp32" else ("ieee", "tf32")):
                if dot in lines:
                    ax.axhline(lines[dot], color="gray", ls=":", lw=1)
                    ax.annotate(f"{dot} matmul {lines[dot]:.0f}", (0.02, lines[dot]), xycoords=("axes fraction", "data"),
                                fontsize=7, color="gray", va="bottom")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{dtype}, d = {d}", fontsize=9)
            ax.set_xlabel("sequence length")
            if c == 0:
                ax.set_ylabel("fwd + bwd TFLOP/s (model FLOPs)")
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- answers


def _wide(sweep: pd.DataFrame, value: str) -> pd.DataFrame:
    ok = sweep[sweep["status"] == "ok"]
    return ok.pivot_table(index=["dtype", "d", "seq"], columns="impl", values=value, aggfunc="first")


def benchmark_answer(sweep: pd.DataFrame, *, ours: str, baseline: str = "naive", device: str, handout: str,
                     like_for_like: bool = True) -> str:
    """flash_benchmarking (a): where ours beats the baseline end to end and by how much, where the
    baseline did not run, read from the sweep; the handout's GPU beside this run's. Where ours and
    the baseline multiply at different precisions, ``like_for_like`` adds the comparison with our
    variant whose dots match; False where ``fp32_answer`` follows and makes it."""
    wide = _wide(sweep, "e2e_ms")
    if ours not in wide or baseline not in wide:
        return f"`{ours}` and `{baseline}` have no point in common in this run."
    ratio = (wide[baseline] / wide[ours]).dropna()
    parts = [f"The three tables above give the forward, backward and end-to-end medians of {sweep['impl'].nunique()} "
             f"implementations over {len(sweep[['dtype', 'd', 'seq']].drop_duplicates())} (dtype, d, seq) points "
             f"(batch 1, causal, on {device}; the {handout} handout asks for one {HANDOUT_GPU[handout]})."]
    noisy = _within_noise(sweep, wide, ratio.index, ours=ours, baseline=baseline)
    for dtype, per in ratio.groupby(level="dtype"):
        longest = per.index.get_level_values("seq").max()
        at_longest = per.xs(longest, level="seq").droplevel("dtype")
        within = noisy.reindex(per.index, fill_value=False)
        slower = per[(per < 1) & ~within]
        text = (f"**{dtype}**: `{ours}` is faster than `{baseline}` end to end at {int(((per > 1) & ~within).sum())} "
                f"of {len(per)} points" + (f" (within the noise, one median inside the other's p10-p90 range, at "
                                           f"{int(within.sum())})" if within.any() else "")
                + f"; at seq {longest} {baseline}'s time over ours is "
                + ", ".join(f"{_ratio(x)} (d = {d})" for d, x in at_longest.items()))
        if len(slower):
            seqs = slower.index.get_level_values("seq")
            text += (f"; ours is slower at {len(slower)} points, seq {seqs.min()}-{seqs.max()}, where it takes "
                     f"{_fmt_ms(wide.loc[slower.index, ours].min())}-{_fmt_ms(wide.loc[slower.index, ours].max())}")
        text += _unlike_dots(sweep, wide, dtype=dtype, ours=ours, baseline=baseline, like_for_like=like_for_like)
        for impl in (ours, baseline):
            text += _missing_points(sweep, impl=impl, dtype=dtype)
        parts.append(text + ".")
    return " ".join(parts)


def _within_noise(sweep: pd.DataFrame, wide: pd.DataFrame, index, *, ours: str, baseline: str) -> pd.Series:
    """Per (dtype, d, seq) of ``index``: whether the two end-to-end medians (``wide``, as
    ``_wide(sweep, "e2e_ms")`` pivots them) are within the noise
    (``notebook.noise_side``); False where a spread was not recorded, so no point is called a tie
    without one."""
    if not {"e2e_p10_ms", "e2e_p90_ms"} <= set(sweep.columns):
        return pd.Series(False, index=index)
    # pivot_table drops an implementation or a point whose values are all missing: reindexed, they
    # read as NaN, for which within_noise gives no verdict
    med, lo, hi = (frame.reindex(index=index, columns=[ours, baseline])
                   for frame in (wide, _wide(sweep, "e2e_p10_ms"), _wide(sweep, "e2e_p90_ms")))

    return pd.Series([bool(within_noise({impl: (med.at[i, impl], lo.at[i, impl], hi.at[i, impl])
                                          for impl in (ours, baseline)})) for i in index], index=index, dtype=bool)


# why a point did not run, by its status (systems.bench.flash's statuses); others show their error
MISSING_REASONS = {SKIPPED: "the sweep's time budget ran out before them",
                   SKIPPED_MEMORY: "its n x n matrices would not fit in memory",
                   "oom": "out of memory", "unsupported": "no kernel for these inputs"}


def _missing_points(sweep: pd.DataFrame, *, impl: str, dtype: str) -> str:
    """'. `impl` did not run at N points ...' per status, or '' when every point of ``impl`` ran."""
    missing = sweep[(sweep.impl == impl) & (sweep.dtype == dtype) & (sweep.status != "ok")]
    text = ""
    for status, part in missing.groupby("status", sort=False):
        seqs = sorted(set(part.seq))
        where = f"seq {seqs[0]}" if len(seqs) == 1 else f"seq {seqs[0]}-{seqs[-1]}"
        text += (f". `{impl}` did not run at {len(part)} points ({where}, {status}: "
                 f"{MISSING_REASONS.get(status, part.error.iloc[0])})")
    return text


def _unlike_dots(sweep: pd.DataFrame, wide: pd.DataFrame, *, dtype: str, ours: str, baseline: str,
                 like_for_like: bool) -> str:
    """Where ours and the baseline multiply at different precisions (fp32: our tf32x3 against
    IEEE), that, and with ``like_for_like`` the comparison with our variant whose dots match the
    baseline's, if one ran."""
    dots = sweep[(sweep.dtype == dtype) & (sweep.status == "ok")].groupby("impl")["dot"].first()
    if ours not in dots or baseline not in dots or dots[ours] == dots[baseline]:
        return ""
    text = f" (ours multiplies in {dots[ours]}, `{baseline}` in {dots[baseline]}"
    if not like_for_like:
        return text + f": the {dtype} paragraph below compares like for like)"
    alike = [i for i in dots.index if i != ours and is_ours(i) and dots[i] == dots[baseline]]
    if alike and alike[0] in wide:
        ratio = (wide.xs(dtype, level="dtype")[baseline] / wide.xs(dtype, level="dtype")[alike[0]]).dropna()
        if len(ratio):
            text += (f"; like for like, `{alike[0]}` ({dots[baseline]}) is faster at {int((ratio > 1).sum())} of "
                     f"{len(ratio)} points, {baseline}'s time over its {_ratio(ratio.min())}-{_ratio(ratio.max())}")
    return text + ")"


def fp32_answer(sweep: pd.DataFrame, *, ceilings: list[dict], kernels: pd.DataFrame | None, long_from: int = 2048
                ) -> str:
    """Why fp32 runs as it does, from the data: each side's dot precision (the rows' ``dot``), the
    time ratios at seq >= ``long_from``, the measured matmul ceilings, and naive's matmul kernels."""
    fp = sweep[(sweep.dtype == "fp32") & (sweep.status == "ok")]
    wide = _wide(fp, "e2e_ms")
    if "naive" not in wide:
        return "fp32: naive attention did not run in this run."
    long = wide[wide.index.get_level_values("seq") >= long_from]
    dots = fp.groupby("impl")["dot"].first()
    ceiling = {c["dot"]: c["tflops"] for c in ceilings}
    parts = ["**fp32** (dot precision per side, from the rows: "
             + ", ".join(f"`{impl}` {dot}" for impl, dot in dots.items()) + ")."]
    for impl in (c for c in wide.columns if is_ours(c) and c in long):
        r = (long[impl] / long["naive"]).dropna()
        if len(r):
            gm = float(np.exp(np.log(r).mean()))
            parts.append(f"At seq >= {long_from}, `{impl}` takes {_ratio(gm)} naive's end-to-end time (geometric "
                         f"mean over {len(r)} points, range {_ratio(r.min())}-{_ratio(r.max())}).")
    if ceiling:
        parts.append(f"Measured in this run, a {ceilings[0]['what']} runs at "
                     + ", ".join(f"{ceiling[d]:.3g} TFLOP/s in {d}" for d in ("ieee", "tf32", "bf16") if d in ceiling)
                     + " (ieee: fp32 with TF32 off, torch's default).")
    if kernels is not None and not kernels.empty:
        mm = kernels[kernels["category"] == "matmul"]
        if len(mm):
            row = kernels.iloc[0]
            executed = flop_count.attention_flops(batch=1, heads=1, n_q=row.seq, n_k=row.seq, d=row.d, causal=True,
                                                  pass_="fwd_bwd", executed=True)
            rate = executed / (mm["ms"].sum() * 1e-3) / 1e12
            names = ", ".join(f"`{n[:48]}`" for n in mm["name"].head(3))
            parts.append(f"Naive fp32's matmuls (profiled at seq {row.seq}, d {row.d}) ran as {names}: "
                         f"{'with' if mm['tf32'].any() else 'no'} TF32 in their names, at {rate:.3g} TFLOP/s of the "
                         "full score matrix they compute.")
    naive_dot = dots.get("naive")
    naive_tf32 = kernels is not None and bool(kernels["tf32"].any())
    ours_by_dot = {dot: impl for impl, dot in dots.items() if is_ours(impl) and impl in long}
    ieee, x3 = ours_by_dot.get("ieee"), ours_by_dot.get("tf32x3")
    if ieee is not None:
        mine = fp[(fp.impl == ieee) & (fp.seq >= long_from)]["e2e_tflops"].max()
        slower = float(np.exp(np.log((long[ieee] / long["naive"]).dropna()).mean())) > 1
        if naive_dot == "ieee" and not naive_tf32:
            parts.append(f"With `{ieee}` both sides multiply in IEEE fp32 on the CUDA cores (neither runs a TF32 "
                         "product)"
                         + (", and ours is the slower: cuBLAS's fp32 GEMM is tuned for them while our `ieee` dots "
                            "are Triton's scalar FMA loop (tests/attention/test_flash_triton.py compiles them: no "
                            "tensor-core instruction)" if slower else "") + ".")
        if "ieee" in ceiling:
            parts.append(f"Our `ieee` kernels reach at most {mine:.3g} TFLOP/s of model FLOPs end to end, against "
                         f"the {ceiling['ieee']:.3g} TFLOP/s cuBLAS's fp32 matmul reaches alone.")
    if x3 is not None:
        best = fp[(fp.impl == x3) & (fp.seq >= long_from)]["e2e_tflops"].max()
        text = (f"tf32x3 (`{x3}`) moves our products onto the tensor cores (three TF32 products per fp32 one; its "
                f"accuracy is checked above): up to {best:.3g} TFLOP/s")
        if ieee is not None:
            r = (long[x3] / long[ieee]).dropna()
            text += f", {_ratio(float(np.exp(np.log(r).mean())))} the `ieee` kernels' time (geometric mean)"
        parts.append(text + ".")
    if "triton" in dots:
        parts.append(f"Our default (`triton`) ran {dots['triton']} dots on fp32 inputs in this run "
                     "(`FlashVariant.fp32_dot='auto'`: tf32x3 unless torch allows TF32 for fp32 matmuls).")
    return " ".join(parts)


def sdpa_answer(ratios: pd.DataFrame, geomeans: pd.DataFrame) -> str:
    """Our speed against SDPA's flash and cuDNN backends, against our own targets."""
    # a mean over fewer points than the grid's (a budget cut or an unsupported baseline) says so:
    # its verdict covers those points only
    verdicts = "; ".join(
        f"{r['pass']} vs {r['baseline']}: no point ran" if not r["points"] else
        f"{r['pass']} {r['geomean speed']:.2f}x {r['baseline']}"
        + (f" over the {r['points']} of {len(ratios)} points where both ran" if r["missing"] else "")
        + f" (our target {r['our target']:.1f}x: {'met' if r['met'] else 'not met'})"
        for r in geomeans.to_dict("records"))
    return (f"Geometric-mean speed of ours over {len(ratios)} points: {verdicts}. Ours is faster at "
            f"{int((ratios > 1).sum().sum())} of {int(ratios.notna().sum().sum())} (point, pass, baseline) comparisons. "
            f"The targets ({', '.join(f'{k} {v}x' for k, v in SPEED_TARGETS.items())}) are the project's, not the "
            "handout's.")


def leaderboard_answer(lb: pd.DataFrame, *, gpu: str) -> str:
    """The 2025 handout's leaderboard configuration: our time and its ratio to cuDNN's, against our target."""
    ms = lb[lb.status == "ok"].set_index("impl")["e2e_ms"]
    if "triton" not in ms:
        return "Our kernels did not run the leaderboard configuration in this run."
    text = (f"q, k, v of shape ({LEADERBOARD['heads']}, {LEADERBOARD['seq']}, {LEADERBOARD['d']}), "
            f"{LEADERBOARD['dtype']}, causal: our forward + backward takes **{ms['triton']:.2f} ms** on {gpu}")
    for base in ("sdpa_flash", "sdpa_cudnn"):
        if base in ms:
            text += f"; {base} {ms[base]:.2f} ms (ours is {faster_or_slower(ms[base] / ms['triton'])})"
    if "sdpa_cudnn" in ms:
        ratio = ms["triton"] / ms["sdpa_cudnn"]
        text += (f". Our time is {ratio:.3f}x cuDNN's; our own target (not the handout's) is at most "
                 f"{LEADERBOARD_TARGET}x: {'met' if ratio <= LEADERBOARD_TARGET else 'not met'}")
    return text + "."


__all__ = ["PASS_NAMES", "PASSES", "TOLERANCES", "backward_answer", "benchmark_answer", "ceiling_table", "check_table",
           "forward_answers",
           "fp32_answer", "latency_table", "leaderboard_answer", "plot_tflops", "sdpa_answer", "status_table"]
