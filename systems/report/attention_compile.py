"""Tables, figures and answer text of notebook 05 (pytorch_attention, torch_compile), rendered from
the rows ``systems.bench.attention`` writes and the accounting of ``systems.analysis.attention_memory``."""

from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from systems.analysis.attention_memory import (attention_memory_accounting, flash_attention_accounting,
                                               peak_decomposition)
from systems.analysis.fits import fit_power_law
from systems.bench.attention import is_skipped, smallest_oom
from systems.bench.budget import SKIPPED
from systems.config import size_label
from systems.measure.devices import oom_sizes
from systems.report.memory import fmt_bytes, table_unit
from systems.report.notebook import join_words, param_count, value_range

MODEL_MEASUREMENTS = ("forward (inference)", "forward (in train step)", "forward+backward", "train step")


def _ok(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def _largest(rows: Sequence[dict]) -> dict | None:
    ok = _ok(rows)
    return max(ok, key=lambda r: (r["seq"], r["d"])) if ok else None


# ----------------------------------------------------------------------------- (a) the sweep


def sweep_table(rows: Sequence[dict]) -> pd.DataFrame:
    """One row per point: status, forward / backward medians with p10–p90, TFLOP/s, memory."""
    df = pd.DataFrame(rows)
    cols = {"d": "d", "seq": "seq", "status": "status", "oom_phase": "OOM in",
            "forward_ms_median": "fwd ms", "forward_ms_p10": "fwd p10", "forward_ms_p90": "fwd p90",
            "forward_tflops": "fwd TFLOP/s", "backward_ms_median": "bwd ms", "backward_ms_p10": "bwd p10",
            "backward_ms_p90": "bwd p90", "backward_tflops": "bwd TFLOP/s",
            "mem_before_backward_bytes": "mem before bwd", "peak_rise_bytes": "peak rise", "saved_bytes": "saved"}
    out = df.reindex(columns=list(cols)).rename(columns=cols)
    memory = ("mem before bwd", "peak rise", "saved")
    scale, unit = table_unit([v for c in memory for v in pd.to_numeric(out[c], errors="coerce").dropna()])
    for c in memory:
        out[c] = pd.to_numeric(out[c], errors="coerce") / scale
    return out.rename(columns={c: f"{c} {unit}" for c in memory}).reset_index(drop=True)


def timing_text(rows: Sequence[dict], *, max_seq_len: int) -> str:
    big, oom = _largest(rows), smallest_oom(rows)
    parts = []
    if big:
        parts.append(f"The largest point that ran, d = {big['d']}, seq = {big['seq']:,}, takes "
                     f"{big['forward_ms_median']:.3g} ms forward and {big['backward_ms_median']:.3g} ms backward "
                     f"(medians of {big['n_forward']}; {big['forward_tflops']:.3g} / {big['backward_tflops']:.3g} "
                     f"TFLOP/s).")
    parts.append(f"The first configuration to run out of memory is **d = {oom['d']}, seq = {oom['seq']:,}** (in the "
                 f"`{oom['oom_phase']}` phase)." if oom else f"No point ran out of memory up to seq {max_seq_len:,}.")
    if oom:
        # only the points that were attempted at that length: a budget skip is neither a fit nor a failure
        tried = [r for r in rows if r["seq"] == oom["seq"] and not is_skipped(r)]
        failed = [d for d, s in _first_oom_seq(rows).items() if s == oom["seq"]]
        skipped_here = sorted(r["d"] for r in rows if r["seq"] == oom["seq"] and is_skipped(r))
        shorter = [r for r in rows if r["seq"] < oom["seq"]]
        if len(failed) < len(tried):
            verdict = f"{len(failed)} of {len(tried)} head dims ran out of memory"
        elif skipped_here:
            verdict = (f"every head dim tried ran out of memory ({len(tried)}; the budget skipped d = "
                       f"{join_words([str(d) for d in skipped_here])})")
        else:
            verdict = "every head dim ran out of memory"
        parts.append(f"At seq {oom['seq']:,} " + verdict
                     + (f"; every point up to seq {max(r['seq'] for r in shorter):,} ran."
                        if shorter and all(r.get("status") == "ok" for r in shorter) else "."))
    skipped = [r for r in rows if r.get("status") == SKIPPED]
    if skipped:
        parts.append(f"{len(skipped)} points were skipped for the time budget.")
    return " ".join(parts)


def oom_accounting(rows: Sequence[dict], *, device: str, free_bytes: int | None) -> pd.DataFrame | None:
    """The accounting (``attention_memory_accounting``) of the smallest configuration that ran out of memory."""
    oom = smallest_oom(rows)
    if oom is None:
        return None
    return attention_memory_accounting(batch=oom["batch_size"], seq=oom["seq"], d=oom["d"], dtype=oom["dtype"],
                                       device=device, free_bytes=oom.get("cuda_free_bytes") or free_bytes)


def accounting_text(acct: pd.DataFrame, *, oom_phase: str, free_note: str, error: str | None = None) -> str:
    """The accounting of the smallest point that ran out of memory in words; where its bytes fit
    but the point failed, the allocator's state from the error (``error``) says why."""
    a = acct.attrs
    fits = lambda ok: "(no free-memory figure)" if ok is None else ("fits" if ok else "does **not** fit")  # noqa: E731
    free = "unknown free memory" if a.get("free_bytes") is None else f"{fmt_bytes(a['free_bytes'])} free ({free_note})"
    return (f"At d = {a['d']}, seq = {a['seq']:,} one score-sized (batch × seq × seq) tensor is "
            f"{fmt_bytes(a['score_matrix_bytes'])}, against {free}. The forward peaks at "
            f"{fmt_bytes(a['forward_peak_bytes'])} (two score-sized tensors: the scaled scores, still referenced, "
            f"and the softmax output P) and {fits(a.get('forward_fits'))}; autograd then keeps P "
            f"({fmt_bytes(a['saved_bytes'])}; {fmt_bytes(a['before_backward_bytes'])} in use before the "
            f"backward). The backward needs {a['backward_score_tensors']} score-sized tensors at once "
            f"({join_words(list(a['backward_score_tensor_names']))}): {fmt_bytes(a['backward_peak_bytes'])}, which "
            f"{fits(a.get('backward_fits'))}. The "
            f"measured failure was in the `{oom_phase}` phase." + _fragmentation_text(a, error))


def _fragmentation_text(a: dict, error: str | None) -> str:
    """Why a point whose bytes fit still failed, where the error's sizes show it: the free memory
    split between the allocator's partly used blocks and the device, each short of the request."""
    sizes = oom_sizes(error)
    keys = ("requested_bytes", "reserved_unallocated_bytes", "device_free_bytes")
    if not (a.get("forward_fits") and a.get("backward_fits")) or not all(k in sizes for k in keys):
        return ""
    ask, held, free = (sizes[k] for k in keys)
    if not (held < ask <= held + free and free < ask):
        return ""
    mat = a["score_matrix_bytes"]
    # the message rounds to 0.01 GiB: too coarse to say how much the smaller tensors took
    one_block = " (about one score-sized block, less what smaller tensors took of it)" if 0.95 * mat <= held < mat else ""
    return (f" By bytes it fits; by the allocator's blocks it does not. Asked for {fmt_bytes(ask)} more, "
            f"PyTorch held {fmt_bytes(held)} reserved but unallocated{one_block}, in blocks that live tensors "
            f"still partly occupied, so neither usable for the request nor returnable to the device, which had "
            f"{fmt_bytes(free)} left: together enough, apart too small (fragmentation).")


def decomposition_text(rows: Sequence[dict], *, device: str) -> tuple[pd.DataFrame | None, str]:
    """The largest point that ran, its measured peak taken apart term by term, and the check of
    the accounting against it (how many score-sized tensors the measured peak holds)."""
    big = _largest(r for r in rows if r.get("peak_bytes") is not None)
    if big is None:
        return None, ""
    df = peak_decomposition(big, device=device)
    acct = attention_memory_accounting(batch=big["batch_size"], seq=big["seq"], d=big["d"], dtype=big["dtype"],
                                       device=device).attrs
    mats = (big["peak_rise_bytes"] - acct["backward_vectors"] * acct["vector_bytes"]) / acct["score_matrix_bytes"]
    residual = df["bytes"].iloc[-1]
    before = big["mem_before_backward_bytes"] - big["start_bytes"]
    names = join_words(list(acct["backward_score_tensor_names"]))
    return df, (
        f"Check on the largest point that ran (d = {big['d']}, seq = {big['seq']:,}): the measured peak, "
        f"{fmt_bytes(big['peak_bytes'])}, is {fmt_bytes(big['start_bytes'])} that were allocated before the "
        f"point plus a rise of {fmt_bytes(big['peak_rise_bytes'])}; less the six (batch, seq, d) tensors, the "
        f"rise holds **{mats:.3f}** score-sized tensors, the accounting's {acct['backward_score_tensors']} "
        f"({names}), "
        f"and {fmt_bytes(residual)} ({residual / big['peak_bytes']:.2%} of the peak) are left unexplained. "
        f"Before the backward, {fmt_bytes(before)} were in use above the start, against "
        f"{fmt_bytes(acct['before_backward_bytes'])} accounted (inputs, dO, O and P).")


def saved_memory_fits(rows: Sequence[dict]) -> pd.DataFrame:
    """Per head dim and measure: the exponent of memory against sequence length over the points that ran."""
    out = []
    df = pd.DataFrame(_ok(rows))
    for column, what in (("saved_tensor_bytes", "saved for backward (hooks)"),
                         ("activation_bytes", "allocated by the forward (allocator)")):
        if column not in df:
            continue
        for d, g in df.dropna(subset=[column]).groupby("d"):
            if g["seq"].nunique() < 2:
                continue
            fit = fit_power_law(g["seq"], g[column])
            out.append({"measure": what, "d": d, "exponent": fit.exponent, "r2": fit.r2, "points": fit.n,
                        "seq range": f"{g['seq'].min():,}–{g['seq'].max():,}"})
    return pd.DataFrame(out)


def saved_memory_figure(rows: Sequence[dict], *, capacity_bytes: int | None, title: str):
    df = pd.DataFrame(_ok(rows), columns=["d", "seq", "saved_bytes"])
    scale, unit = table_unit([*df["saved_bytes"], capacity_bytes])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if df.empty:
        ax.text(0.5, 0.5, "no point ran", ha="center", va="center", transform=ax.transAxes)
    for (d, g), marker in zip(df.groupby("d"), "osD^v"):
        g = g.sort_values("seq")
        line, = ax.loglog(g["seq"], g["saved_bytes"] / scale, marker, mfc="none", label=f"d = {d}")
        if g["seq"].nunique() > 1:
            f = fit_power_law(g["seq"], g["saved_bytes"])
            xs = np.geomspace(g["seq"].min(), g["seq"].max(), 50)
            ax.loglog(xs, f.predict(xs) / scale, "-", color=line.get_color(), alpha=0.6)
    if capacity_bytes:
        ax.axhline(capacity_bytes / scale, color="k", ls=":", label="free memory")
    ax.set_xlabel("sequence length")
    ax.set_ylabel(f"saved for backward ({unit})")
    ax.set_title(title)
    if not df.empty:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def scaling_text(rows: Sequence[dict], fits: pd.DataFrame) -> str:
    if fits.empty:
        return "Too few points ran to fit how saved memory grows."
    hooks = fits[fits["measure"].str.startswith("saved")]
    alloc = fits[fits["measure"].str.startswith("allocated")]
    pooled = _pooled_saved_fit(rows)
    if pooled is None:
        return "Too few lengths ran to fit how saved memory grows."
    text = (f"The memory saved for backward grows as seq^{pooled.exponent:.3f} (log-log least squares over "
            f"{pooled.n} points, R² {pooled.r2:.5f}; per head dim "
            + ", ".join(f"d = {int(r.d)}: {r.exponent:.3f}" for r in hooks.itertuples())
            + ")" + (": quadratic, because it is the softmax output P, batch × seq × seq, whatever d is."
                     if abs(pooled.exponent - 2) < QUADRATIC_EXPONENT_TOLERANCE else "."))
    if not alloc.empty:
        low = alloc.loc[alloc["exponent"].idxmin()]
        text += (" What the forward leaves allocated also counts the (batch, seq, d) output, a term linear in seq "
                 f"and growing with d: its exponents are {alloc['exponent'].min():.3f}–{alloc['exponent'].max():.3f}, "
                 f"the lowest at d = {int(low['d'])}.")
    return text


def fix_text(oom: dict, sdpa: dict | None) -> str:
    fa = flash_attention_accounting(batch=oom["batch_size"], seq=oom["seq"], d=oom["d"], dtype=oom["dtype"])
    if sdpa is None:
        measured = "not measured in this run"
    elif sdpa["status"] == "ok":
        measured = (f"torch's fused SDPA at the same configuration **runs**: {sdpa['forward_ms_median']:.3g} ms "
                    f"forward, {sdpa['backward_ms_median']:.3g} ms backward (medians of {sdpa['n_forward']}), saving "
                    f"{fmt_bytes(sdpa['saved_tensor_bytes'])} (hooks), peak {fmt_bytes(sdpa['peak_rise_bytes'])} "
                    f"above its start")
    else:
        measured = f"torch SDPA at the same configuration also failed ({sdpa['status']}: {sdpa['error']})"
    return (f"To remove the cost, never materialise P: FlashAttention tiles Q and K/V into blocks held in on-chip "
            f"memory, keeps a running row max and sum (online softmax), and saves only O and the row logsumexp L. "
            f"At d = {oom['d']}, seq = {oom['seq']:,} that is {fmt_bytes(fa['flash_saved_bytes'])} saved instead "
            f"of {fmt_bytes(fa['naive_saved_bytes'])}, {fa['saving_factor']:,.0f}× less, linear in seq; with "
            f"{fa['block_q']}×{fa['block_k']} tiles the scores exist only as {fa['score_tile_bytes'] / 1024:.0f} KiB "
            f"blocks on chip, {fa['n_tiles']:,} per pass. The price is recomputing Q K^T in the backward: "
            f"{fa['recompute_flops'] / 1e12:.3g} TFLOP, {fa['recompute_fraction_of_backward']:.0%} on top of the "
            f"backward's matmuls. Measured: {measured}.")


def attention_answer(rows: Sequence[dict], *, acct: pd.DataFrame | None, check: str, fits: pd.DataFrame,
                     sdpa: dict | None, max_seq_len: int, free_note: str) -> str:
    """pytorch_attention (a): timings, the out-of-memory point and its accounting, the check of the
    accounting against the measured peak, how saved memory scales, and the fix."""
    parts = [timing_text(rows, max_seq_len=max_seq_len)]
    oom = smallest_oom(rows)
    if acct is not None:
        parts.append(accounting_text(acct, oom_phase=oom["oom_phase"], free_note=free_note, error=oom.get("error"))
                     + " " + check)
    parts.append(scaling_text(rows, fits))
    if oom:
        parts.append(fix_text(oom, sdpa))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- torch_compile (a)


def ratio_table(eager: Sequence[dict], compiled: Sequence[dict]) -> pd.DataFrame:
    """Eager vs compiled attention per (d, seq): medians and eager/compiled ratios (> 1: compiled faster)."""
    keys = ["d", "seq"]
    pick = keys + ["status", "forward_ms_median", "backward_ms_median", "mem_before_backward_bytes", "first_call_s"]
    e = pd.DataFrame(eager).reindex(columns=pick)
    c = pd.DataFrame(compiled).reindex(columns=pick)
    m = e.merge(c, on=keys, how="outer", suffixes=(" eager", " compiled")).sort_values(keys)
    out = pd.DataFrame({"d": m["d"], "seq": m["seq"], "eager": m["status eager"], "compiled": m["status compiled"],
                        "fwd ms eager": m["forward_ms_median eager"], "fwd ms compiled": m["forward_ms_median compiled"],
                        "fwd speedup": m["forward_ms_median eager"] / m["forward_ms_median compiled"],
                        "bwd ms eager": m["backward_ms_median eager"],
                        "bwd ms compiled": m["backward_ms_median compiled"],
                        "bwd speedup": m["backward_ms_median eager"] / m["backward_ms_median compiled"],
                        "mem before bwd ratio": (pd.to_numeric(m["mem_before_backward_bytes eager"])
                                                 / pd.to_numeric(m["mem_before_backward_bytes compiled"])),
                        "first call s compiled": m["first_call_s compiled"]})
    return out.reset_index(drop=True)


# quadratic: the exponent of seq a log-log fit gives for what is saved, within this of 2
# (the (batch, seq, d) output adds a linear term that pulls the pooled exponent a little under 2)
QUADRATIC_EXPONENT_TOLERANCE = 0.1


def _first_oom_seq(rows: Sequence[dict]) -> dict[int, int]:
    """Per head dim: the shortest length that ran out of memory."""
    first: dict[int, int] = {}
    for r in rows:
        if r.get("status") == "oom":
            first[r["d"]] = min(r["seq"], first.get(r["d"], r["seq"]))
    return first


def _dims(ds) -> str:
    return ", ".join(str(d) for d in sorted(ds))


def _oom_where(rows: Sequence[dict], *, label: str) -> str:
    """Where one variant first runs out of memory: one length for every head dim where that is so,
    else each length with its head dims; a head dim that never did, how far it ran and why it stopped."""
    first = _first_oom_seq(rows)
    ds = sorted({r["d"] for r in rows})
    by_seq: dict[int, list[int]] = {}
    for d, seq in first.items():
        by_seq.setdefault(seq, []).append(d)
    if len(by_seq) == 1 and len(first) == len(ds):
        text = f"{label} attention first runs out of memory at seq {next(iter(by_seq)):,} for every head dim"
    elif by_seq:
        text = f"{label} attention first runs out of memory at " + ", ".join(
            f"seq {seq:,} for d = {_dims(dl)}" for seq, dl in sorted(by_seq.items()))
    else:
        text = f"{label} attention did not run out of memory at any length it ran"
    stops = []
    for d in (d for d in ds if d not in first):
        ran = [r["seq"] for r in _ok(rows) if r["d"] == d]
        # any row past the last that ran says why the head dim stopped: a skip, or an error
        after = [r for r in rows if r["d"] == d and r.get("status") not in ("ok", "oom") and r["seq"] > max(ran, default=0)]
        stops.append(f"d = {d} ran up to seq {max(ran):,}" if ran else f"d = {d} did not run")
        if after:
            stops[-1] += f", then {after[0].get('error') or after[0]['status']}"
    return text + (f" ({'; '.join(stops)})" if stops else "")


def oom_comparison_text(eager: Sequence[dict], compiled: Sequence[dict]) -> str:
    """Where eager and compiled attention first run out of memory, and compiled's length against eager's."""
    e_first, c_first = _first_oom_seq(eager), _first_oom_seq(compiled)
    factors = {d: c_first[d] / e_first[d] for d in c_first if d in e_first}
    text = _oom_where(eager, label="Eager") + "; " + _oom_where(compiled, label="compiled")
    if len(set(factors.values())) == 1:
        f = next(iter(factors.values()))
        text += (", the same length as eager" if f == 1 else f", {f:g}× the length at which eager does")
    elif factors:
        text += ", against eager's: " + ", ".join(f"{f:g}× at d = {d}" for d, f in sorted(factors.items()))
    return text + "."


def peak_comparison_text(eager: Sequence[dict], compiled: Sequence[dict], *, device: str) -> str:
    """The measured peaks (``peak_bytes``: over the warm-up forward and backward passes) of eager and
    compiled at the longest length both ran, in bytes and in score-sized (batch × seq × seq) tensors;
    ``device``: whose kernels' accounting applies ("cuda" or "cpu")."""
    e_ok = {(r["d"], r["seq"]): r for r in _ok(eager) if r.get("peak_bytes")}
    pairs = {(r["d"], r["seq"]): (e_ok[(r["d"], r["seq"])], r) for r in _ok(compiled)
             if r.get("peak_bytes") and (r["d"], r["seq"]) in e_ok}
    if not pairs:
        return ""
    seq = max(s for _, s in pairs)
    at = [pairs[k] for k in sorted(k for k in pairs if k[1] == seq)]
    ratios = [e["peak_bytes"] / c["peak_bytes"] for e, c in at]
    e, c = at[0]
    acct = attention_memory_accounting(batch=e["batch_size"], seq=seq, d=e["d"], dtype=e["dtype"],
                                       device=device).attrs
    vectors = acct["backward_vectors"] * acct["vector_bytes"]
    n_e, n_c = ((r["peak_rise_bytes"] - vectors) / acct["score_matrix_bytes"] for r in (e, c))
    spread = (f"; {value_range(ratios, '{:.2f}')}× over d = {_dims(r['d'] for r, _ in at)}"
              if len(at) > 1 else "")
    text = (f"At seq {seq:,}, the longest length both ran, the peak over the warm-up forward and backward passes "
            f"is {fmt_bytes(c['peak_bytes'])} compiled against {fmt_bytes(e['peak_bytes'])} eager at d = {e['d']} "
            f"(eager / compiled {ratios[0]:.2f}×{spread}). Above what was allocated before the point, less the "
            f"(batch, seq, d) tensors, that is {n_c:.1f} score-sized tensors (batch × seq × seq in {e['dtype']}, "
            f"{fmt_bytes(acct['score_matrix_bytes'])} each) compiled against {n_e:.1f} eager")
    if round(n_c) < round(n_e) == acct["backward_score_tensors"]:
        text += (f": eager's backward holds {join_words(list(acct['backward_score_tensor_names']))} at once; the "
                 f"compiled backward holds {round(n_c)}")
    return text + "."


def _pooled_saved_fit(rows: Sequence[dict]):
    """The power law of saved memory against seq over every head dim's points (None below two lengths)."""
    pts = [(r["seq"], r["saved_bytes"]) for r in _ok(rows) if r.get("saved_bytes")]
    return fit_power_law(*zip(*pts)) if len({s for s, _ in pts}) >= 2 else None


def quadratic_text(eager: Sequence[dict], compiled: Sequence[dict]) -> str:
    """Whether compiled attention still saves a seq × seq tensor: the exponent of what its forward
    leaves allocated, against eager's saved memory, and that memory in score-sized tensors at the
    longest length compiled ran."""
    c_exp, e_exp = ((None if fit is None else fit.exponent) for fit in map(_pooled_saved_fit, (compiled, eager)))
    if c_exp is None:
        return ""
    big = max((r for r in _ok(compiled) if r.get("saved_bytes")), key=lambda r: (r["seq"], r["d"]))
    # a score-sized tensor's bytes are the same whichever kernels run: the accounting's default device
    score = attention_memory_accounting(batch=big["batch_size"], seq=big["seq"], d=big["d"],
                                        dtype=big["dtype"]).attrs["score_matrix_bytes"]
    text = (f"What the compiled forward leaves allocated for the backward grows as seq^{c_exp:.2f} (log-log fit over "
            f"the points that ran" + (f"; eager's saved memory: seq^{e_exp:.2f}" if e_exp is not None else "")
            + f") and is {big['saved_bytes'] / score:.2f} score-sized tensors at d = {big['d']}, seq = {big['seq']:,}")
    if abs(c_exp - 2) < QUADRATIC_EXPONENT_TOLERANCE:
        return text + (": P is still materialised and saved, so memory stays quadratic in seq.")
    if 1 < c_exp < 2:
        return text + (": between linear and quadratic, as a saved seq × seq P plus (batch, seq, d) terms that still "
                       "weigh at these lengths grows.")
    return text + ": not the growth of a saved seq × seq matrix."


def compile_attention_text(ratios: pd.DataFrame, eager: Sequence[dict], compiled: Sequence[dict], *, device: str,
                           smoke: bool) -> str:
    """torch_compile (a); ``device``: whose kernels' accounting applies ("cuda" or "cpu"), as for the sweep's."""
    both = ratios.dropna(subset=["fwd speedup", "bwd speedup"])
    if both.empty:
        return "No configuration ran both eager and compiled."
    top = both.sort_values(["seq", "d"]).iloc[-1]
    mem = ratios["mem before bwd ratio"].dropna()
    parts = [f"Over {len(both)} points that ran both ways, eager / compiled time has median "
             f"{both['fwd speedup'].median():.2f}× forward (range {both['fwd speedup'].min():.2f}–"
             f"{both['fwd speedup'].max():.2f}) and {both['bwd speedup'].median():.2f}× backward (range "
             f"{both['bwd speedup'].min():.2f}–{both['bwd speedup'].max():.2f}); at the longest common point "
             f"(d = {int(top['d'])}, seq = {int(top['seq']):,}) {top['fwd speedup']:.2f}× / "
             f"{top['bwd speedup']:.2f}×.",
             oom_comparison_text(eager, compiled),
             peak_comparison_text(eager, compiled, device=device)]
    if not mem.empty:
        parts.append(f"Memory in use before the backward (after one forward: inputs, output and what autograd saved, "
                     f"P among it), eager / compiled: median {mem.median():.2f}× (range {value_range(mem, '{:.2f}')}).")
    parts.append(quadratic_text(eager, compiled))
    if smoke:
        parts.append("(Smoke profile: the aot_eager backend generates no kernels, so these ratios only show that the "
                     "path works.)")
    return " ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- torch_compile (b)


def _model_time(rec: dict | None, measurement: str) -> float | None:
    if rec is None or rec.get("status") != "ok":
        return None
    if measurement == "forward (inference)":
        return rec["step_median_s"] if rec["mode"] == "forward" else None
    if rec["mode"] != "train_step":
        return None
    if measurement == "forward (in train step)":
        return rec["forward_median_s"]
    if measurement == "forward+backward":
        return rec["forward_median_s"] + rec["backward_median_s"]
    return rec["step_median_s"]


def model_compile_table(records: Sequence[dict], *, handout: str) -> pd.DataFrame:
    """Per size (the handout's name) and measurement: eager and compiled ms, speedup, compile time."""
    by = {(r["model"], r["mode"], r["compile"] != "none"): r for r in records}
    rows = []
    for size in dict.fromkeys(r["model"] for r in records):
        for meas in MODEL_MEASUREMENTS:
            mode = "forward" if meas == "forward (inference)" else "train_step"
            e, c = by.get((size, mode, False)), by.get((size, mode, True))
            if e is None and c is None:
                continue
            te, tc = _model_time(e, meas), _model_time(c, meas)
            tokens = (e or c)["batch_size"] * (e or c)["context_length"]
            rows.append({"size": size_label(size, handout), "measurement": meas,
                         "eager ms": te * 1e3 if te else None, "compiled ms": tc * 1e3 if tc else None,
                         "speedup": te / tc if te and tc else None, "compiled tok/s": tokens / tc if tc else None,
                         "compile s": c.get("first_step_overhead_s") if c and c["status"] == "ok" else None,
                         "status eager/compiled": "/".join(x["status"] if x else "—" for x in (e, c)),
                         "note": (c or {}).get("error") if (c or {}).get("status") != "ok" else None})
    return pd.DataFrame(rows)


def model_compile_figure(table: pd.DataFrame, *, title: str):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    order = list(dict.fromkeys(table["size"]))
    piv = table.pivot(index="size", columns="measurement", values="speedup").reindex(index=order)
    if piv.notna().any().any():
        piv.plot.bar(ax=ax1)
        ax1.axhline(1.0, color="k", lw=0.8)
        ax1.set_ylabel("eager / compiled time")
        ax1.set_title("Speedup from torch.compile")
    else:  # nothing compiled (smoke): the eager times that were measured
        table.pivot(index="size", columns="measurement", values="eager ms").reindex(index=order).plot.bar(ax=ax1)
        ax1.set_ylabel("ms")
        ax1.set_title("Eager time (no compiled runs in this profile)")
    compile_s = table.dropna(subset=["compile s"])
    if not compile_s.empty:
        compile_s.pivot_table(index="size", columns="measurement", values="compile s").reindex(
            index=[s for s in order if s in set(compile_s["size"])]).plot.bar(ax=ax2)
        ax2.set_title("Compile time (first step − steady state)")
    else:
        ax2.bar(order, [0] * len(order))
        ax2.set_title("Compile time: no compiled runs in this profile")
    ax2.set_ylabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# a record's mode in words, as the table's measurements name them
MODE_WORDS = {"forward": "inference forward", "train_step": "train step"}
# the measurements whose harness record carries their own rate (achieved_tflops): the inference
# forward's record is the forward alone, the train step's the whole step
RATE_MODE = {"forward (inference)": "forward", "train step": "train_step"}
COMPILE_SCOPE_WORDS = {
    "blocks": "each Transformer block compiled on its own (compile scope \"blocks\": one compiled graph that every "
              "layer reuses), not the whole model as the handout asks; the embedding, final norm and LM head, the "
              "loss and the AdamW update run eager",
    "model": "torch.compile of the whole model (compile scope \"model\"); the loss and the AdamW update run eager",
}


def _setting_text(records: Sequence[dict]) -> str:
    """The setting the numbers come from, read from the records: precision, TF32, shape, compile scope."""
    def values(key, recs=records):
        return sorted({str(r.get(key)) for r in recs if r.get(key) is not None})
    tf32 = {r.get("tf32") for r in records}
    matmuls = ("with TF32 matmuls" if tf32 == {True} else "with TF32 off" if tf32 == {False} else
               "with TF32 on in some records and off in others")
    scopes = values("compile", [r for r in records if r.get("compile") != "none"])
    what = "; ".join(COMPILE_SCOPE_WORDS.get(s, f"compile scope {s!r}") for s in scopes)
    return (f"Setting: {'/'.join(values('precision'))} {matmuls}, context {'/'.join(values('context_length'))}, "
            f"batch {'/'.join(values('batch_size'))}; " + (f"compiled means {what}." if what else "nothing compiled."))


def _largest_gain_text(done: pd.DataFrame, records: Sequence[dict], *, handout: str) -> str:
    """Why the largest speed-up is where it is, said only where the rates show it: that size's
    eager run has the lowest matmul rate of the sizes compiled in that measurement."""
    best = done.loc[done["speedup"].idxmax()]
    mode = RATE_MODE.get(best["measurement"])
    if mode is None:
        return ""
    rate = {(size_label(r["model"], handout), r["compile"] != "none"): r["achieved_tflops"] for r in records
            if r["mode"] == mode and r.get("status") == "ok" and r.get("achieved_tflops")}
    sizes = [s for s in done.loc[done["measurement"] == best["measurement"], "size"]
             if (s, False) in rate and (s, True) in rate]
    if len(sizes) < 2 or min(sizes, key=lambda s: rate[(s, False)]) != best["size"]:
        return ""
    top = max(sizes, key=lambda s: rate[(s, False)])
    return (f"The largest gain, {best['size']}'s {MODE_WORDS[mode]} ({best['speedup']:.2f}×), is where eager is least "
            f"efficient: it runs its matmul FLOPs at {rate[(best['size'], False)]:.0f} TFLOP/s against "
            f"{rate[(top, False)]:.0f} for {top}, so more of its time goes to the kernels outside the matmuls "
            f"(elementwise, softmax, norms), each a separate pass over memory, which compiling fuses "
            f"(compiled: {rate[(best['size'], True)]:.0f} TFLOP/s).")


def _not_compiled_text(records: Sequence[dict], table: pd.DataFrame, *, handout: str) -> str:
    """Which sizes were not compiled in which measurement and why (the skipped records' reasons),
    and what compiled timings each of those sizes still has."""
    skipped = [r for r in records if r["compile"] != "none" and is_skipped(r)]
    if not skipped:
        return ""
    params = {r["model"]: r.get("n_params") for r in records if r.get("n_params")}
    per_size: dict[str, list[str]] = {}
    for r in skipped:
        per_size.setdefault(r["model"], []).append(f"{MODE_WORDS.get(r['mode'], r['mode'])} ({r['error']})")
    compiled = table.dropna(subset=["compiled ms"])
    sizes = []
    for model, why in per_size.items():
        label = size_label(model, handout)
        has = list(dict.fromkeys(compiled.loc[compiled["size"] == label, "measurement"]))
        still = (f"its compiled timings: {join_words(has)} only" if has else "no compiled timings for it")
        count = f" ({param_count(params[model])} parameters)" if params.get(model) else ""
        sizes.append(f"{label}{count}: {', '.join(why)}; {still}")
    text = "Not compiled: " + "; ".join(sizes) + "."
    if any(r["status"] == SKIPPED for r in skipped):
        text += (" The compile-time budget is the share of the notebook's time budget left for compiled points, "
                 "which run in the order of the sizes given; a point is skipped once the time already spent compiling plus a "
                 "prediction for it (the last compiled point of that mode) would pass it.")
    return text


def model_compile_text(table: pd.DataFrame, records: Sequence[dict], *, handout: str, smoke: bool) -> str:
    done = table.dropna(subset=["speedup"])
    parts = [_setting_text(records)]
    gains = []
    for meas, g in done.groupby("measurement", sort=False):
        gains.append(f"{meas}: " + ", ".join(f"{s} {x:.2f}×" for s, x in zip(g["size"], g["speedup"])))
    if gains:
        parts.append("Eager / compiled time per size — " + "; ".join(gains) + ".")
    if not done.empty:
        # compared over the sizes both measurements ran, or a size only one ran would decide the medians
        fwd = done[done["measurement"] == "forward (inference)"].set_index("size")["speedup"]
        step = done[done["measurement"] == "train step"].set_index("size")["speedup"]
        shared = [size for size in fwd.index if size in step.index]
        if shared:
            fwd, step = fwd[shared], step[shared]
            more = "more" if fwd.median() > step.median() else "no more"
            over = f"the {len(shared)} size{'s' if len(shared) > 1 else ''} compiled in both modes"
            parts.append(f"Over {over}, compiling helps the inference forward {more} (median "
                         f"{fwd.median():.2f}×) than the whole training step (median {step.median():.2f}×), whose "
                         f"matmuls and AdamW update it leaves as they are.")
        parts.append(_largest_gain_text(done, records, handout=handout))
    parts.append(_not_compiled_text(records, table, handout=handout))
    # an eager point out of memory whose compiled twin was not recorded as skipped for it
    covered = {(r["model"], r["mode"]) for r in records if r["compile"] != "none" and is_skipped(r)}
    oom = [f"{size_label(r['model'], handout)} {MODE_WORDS.get(r['mode'], r['mode'])}" for r in records
           if r["compile"] == "none" and r["status"] == "oom" and (r["model"], r["mode"]) not in covered]
    if oom:
        parts.append(f"Out of memory in eager: {', '.join(oom)}.")
    if smoke:
        parts.append("Smoke profile: eager timings of the debug model only (Inductor on a CPU takes tens of seconds "
                     "per graph).")
    return " ".join(p for p in parts if p)
