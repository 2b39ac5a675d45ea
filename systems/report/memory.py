"""Tables, figures and answer text of notebook 04 (memory_profiling; 2026: gradient_checkpointing),
rendered from the rows ``systems.bench.memory`` writes. Also the offline "Active memory timeline"
drawing (``render_timeline``) and the memory_viz page beside it."""

from __future__ import annotations

import inspect
import math
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from systems.bench.benchmark import PHASES
from systems.config import ModelConfig, size_label
from systems.measure.memory import (Timeline, build_timeline, largest_allocations, load_snapshot,
                                    match_allocation_size, residual_stream_bytes)
from systems.parallel import checkpoint as checkpointing
from systems.report.deliverables import deliverables
from systems.report.notebook import value_range

GIB = 2**30
MIB = 2**20
SIGNIFICANT = 0.10  # our threshold for calling a change in peak memory significant (not the handout's)
# a change on the timeline is read as a known amount (the gradients, one parameter-sized buffer) when
# it is within 1% of it: the traced sizes are exact requests, and what else moves with them at the
# same moments (the loss, a few small temporaries) is KiB against the GiB of the model's tensors
BYTES_MATCH = 0.01
PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c"}


def asked(handout: str, problem: str, part: str | None = None) -> bool:
    """Whether the handout asks this problem (and part) of notebook 04: memory_profiling (f) and
    gradient_checkpointing are 2026's only."""
    return any(d.problem == problem and (part is None or d.part == part) and d.notebook == "04_memory"
               for d in deliverables(handout))


def model_label(preset: str, handout: str, *, stands_for: str) -> str:
    """The handout's name for the model, or (smoke) which size the small model stands in for."""
    name = size_label(preset, handout)
    return name if name == stands_for else f"{name} (standing in for {stands_for})"


def _unit(nbytes: float) -> tuple[float, str]:
    return (GIB, "GiB") if nbytes >= GIB else (MIB, "MiB") if nbytes >= MIB else (2**10, "KiB")


def fmt_bytes(nbytes: float | None, *, unit_of: float | None = None) -> str:
    """'12.34 GiB', '456.7 MiB' or '12.3 KiB', the unit chosen for ``unit_of`` (default: the value)."""
    if nbytes is None:
        return "—"
    scale, unit = _unit(abs(unit_of if unit_of is not None else nbytes))
    value = nbytes / scale
    return f"{value:,.2f} {unit}" if abs(value) < 100 else f"{value:,.0f} {unit}"


# ----------------------------------------------------------------------------- the timeline drawing


def render_timeline(snapshot: dict | str | Path, out_png: str | Path, *, title: str = "Active memory timeline",
                    device: int | None = None, top_k: int = 40, html: bool = True, show_phases: bool = True,
                    figsize: tuple[float, float] = (11, 4.5)) -> Timeline:
    """Draw the live allocations over time as stacked bands, the ``top_k`` largest coloured and
    the rest summed into one grey band, with the phases shaded and step boundaries dashed. Writes
    ``out_png`` and (``html=True``) the memory_viz page beside it (same stem, .html)."""
    snapshot = load_snapshot(snapshot)
    tl = build_timeline(snapshot, device=device)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    scale, unit = _unit(max(tl.peak_bytes, 1))
    n = len(tl.x)
    big = sorted(tl.allocations, key=lambda a: -a.size)[:top_k]
    big.sort(key=lambda a: (a.start, a.addr))  # older allocations sit lower, as in memory_viz
    sizes = np.zeros((len(big), n), dtype=np.float64)
    for i, a in enumerate(big):
        sizes[i, a.start:(a.end if a.end is not None else n)] = a.size
    other = tl.total - sizes.sum(axis=0)
    fig, ax = plt.subplots(figsize=figsize)
    ax.fill_between(tl.x, 0, other / scale, step="post", color="#d0d0d0", lw=0, label="other allocations")
    bottom = other.copy()
    cmap = plt.get_cmap("tab20")
    for i in range(len(big)):
        top = bottom + sizes[i]
        ax.fill_between(tl.x, bottom / scale, top / scale, where=sizes[i] > 0, step="post", color=cmap(i % 20), lw=0)
        bottom = top
    ax.plot(tl.x, tl.total / scale, drawstyle="steps-post", color="black", lw=0.6)
    if show_phases:
        seen = set()
        for p in tl.phases:
            ax.axvspan(p.start - 0.5, p.end + 0.5, color=PHASE_COLORS.get(p.name, PHASE_COLORS["other"]), alpha=0.12,
                       lw=0, label=None if p.name in seen else f"{p.name} (from frames)")
            seen.add(p.name)
        for j, s in enumerate(tl.steps):
            ax.axvline(s, color="black", ls="--", lw=0.8, label=None if j else "step boundary (marker)")
    ax.annotate(f"peak {tl.peak_bytes / scale:,.2f} {unit}", xy=(tl.peak_index, tl.peak_bytes / scale),
                xytext=(0, 6), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, tl.peak_bytes / scale * 1.12 if tl.peak_bytes else 1)
    ax.set_xlabel("allocator event (alloc / free)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(f"{title}: {len(big)} largest of {len(tl.allocations)} allocations coloured")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.savefig(out_png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    if html:
        write_memory_viz_html(snapshot, out_png.with_suffix(".html"))
    return tl


def write_memory_viz_html(snapshot: dict | str | Path, out_html: str | Path) -> Path:
    """pytorch.org/memory_viz's Active Memory Timeline as one HTML file (its JavaScript comes
    from a CDN, so it needs internet to view)."""
    from torch.cuda._memory_viz import trace_plot

    out_html = Path(out_html)
    out_html.write_text(trace_plot(load_snapshot(snapshot)))
    return out_html


# ----------------------------------------------------------------------------- (a) timelines


def snapshot_row(rows: list[dict], mode: str, precision: str = "fp32") -> dict | None:
    """The largest context of ``mode`` that ran and left a snapshot."""
    have = [r for r in rows if r["mode"] == mode and r["precision"] == precision and r["status"] == "ok"
            and r.get("snapshot") and Path(r["snapshot"]).exists()]
    return max(have, key=lambda r: r["context_length"]) if have else None


def draw_timelines(rows: list[dict], *, figures: Path, stem: str, label: str) -> dict[str, tuple[dict, Timeline]]:
    """The fp32 timeline of each mode at its largest context that ran: {mode: (row, timeline)}."""
    out = {}
    for mode in ("forward", "train_step"):
        row = snapshot_row(rows, mode)
        if row is not None:
            title = f"{label} {mode} fp32, batch {row['batch_size']} x ctx {row['context_length']}"
            out[mode] = (row, render_timeline(row["snapshot"], figures / f"{stem}_timeline_{mode}.png", title=title))
    return out


def timeline_links(timelines: dict[str, tuple[dict, Timeline]], *, figures: Path, stem: str, out_dir: Path) -> str:
    """Markdown showing each drawn timeline, with a link to its memory_viz page."""
    lines = []
    for mode, (row, _) in timelines.items():
        png = (figures / f"{stem}_timeline_{mode}.png").relative_to(out_dir)
        html = png.with_suffix(".html")
        alt = f"active memory over the {mode.replace('_', ' ')}, context {row['context_length']}, by allocation"
        lines.append(f"**{mode}**, context {row['context_length']}: ![{alt}]({png}) ([memory_viz page]({html}))")
    return "\n\n".join(lines) or "No timeline: no mode ran in fp32 with a snapshot."


def _level(tl: Timeline, x: int) -> int:
    return int(tl.total[min(max(x, 0), len(tl.total) - 1)])


def _first_spans(tl: Timeline) -> dict[str, tuple[int, int, int]]:
    """name -> (level before, level after, peak) of each phase's first span."""
    first: dict[str, tuple[int, int, int]] = {}
    for p in tl.phases:
        first.setdefault(p.name, (_level(tl, p.start - 1), _level(tl, p.end), p.peak_bytes))
    return first


def _matches(measured: float, expected: float) -> bool:
    """Whether a measured change is ``expected`` bytes, within ``BYTES_MATCH``."""
    return expected > 0 and abs(measured - expected) <= BYTES_MATCH * expected


def _move(before: int, after: int) -> str:
    return (f"stays at {fmt_bytes(after)}" if fmt_bytes(after) == fmt_bytes(before) else
            f"{'rises' if after > before else 'falls'} from {fmt_bytes(before)} to {fmt_bytes(after)}")


def _step_phases(tl: Timeline, first: dict[str, tuple[int, int, int]], *, grad_bytes: int) -> list[str]:
    """One sentence per stretch of the training step's curve, each move read off the curve and
    explained only where the bytes add up: the drop at the start (the previous step's gradients),
    the forward's rise (what it keeps for the backward), the backward (gradients written against
    that freed) and the optimizer's spike (one parameter-sized temporary). ``first``: _first_spans(tl)."""
    out = []
    kept = None  # what the forward leaves for the backward
    if "forward" in first:
        f_before, f_after, f_peak = first["forward"]
        drop = tl.baseline_bytes - f_before
        if _matches(drop, grad_bytes):
            out.append(f"Before the forward allocates anything it drops {fmt_bytes(drop)} to {fmt_bytes(f_before)}: "
                       f"the step opens with `optimizer.zero_grad(set_to_none=True)`, which frees the previous "
                       f"step's gradients ({fmt_bytes(grad_bytes)}, one fp32 value per parameter).")
        text = f"The forward {_move(f_before, f_after)} (peak {fmt_bytes(f_peak)})"
        if f_after > f_before:
            kept = f_after - f_before
            text += f": the {fmt_bytes(kept)} it adds are the activations autograd saves for the backward"
        out.append(text + ".")
    if "backward" in first:
        b_before, b_after, b_peak = first["backward"]
        text = f"The backward {_move(b_before, b_after)} (peak {fmt_bytes(b_peak)})"
        # the backward writes the gradients and frees what the forward kept; say so only where that
        # accounts for where it ends
        if kept is not None and _matches(b_after - b_before + kept, grad_bytes):
            larger = ("the gradients outweigh what it frees, so memory climbs"
                      if b_after > b_before and grad_bytes > kept else
                      "what it frees outweighs the gradients, so memory falls"
                      if b_after < b_before and kept > grad_bytes else "the two about cancel")
            text += (f": it writes {fmt_bytes(grad_bytes)} of gradients while freeing the {fmt_bytes(kept)} the "
                     f"forward kept ({fmt_bytes(b_before)} + {fmt_bytes(grad_bytes)} − {fmt_bytes(kept)} = "
                     f"{fmt_bytes(b_after)}), and {larger}")
        out.append(text + ".")
    if "optimizer" in first:
        o_before, o_after, o_peak = first["optimizer"]
        text = f"The optimizer step {_move(o_before, o_after)} (peak {fmt_bytes(o_peak)})"
        if _matches(o_peak - max(o_before, o_after), grad_bytes):
            text += (f": its spike of {fmt_bytes(o_peak - max(o_before, o_after))} is one more parameter-sized "
                     f"fp32 buffer, the square roots of all second moments that `adamw_foreach_` takes at once "
                     f"(`torch._foreach_sqrt`) and frees when the update is done")
        out.append(text + ".")
    return out


def _stage_verdict(first: dict[str, tuple[int, int, int]]) -> str:
    """Whether the peaks give each stage of a training step away, decided on the curve: the forward
    by ending higher than it starts, the backward by falling from where the forward ended (which
    puts a peak between them), the optimizer by a spike above where it starts and ends; ``first``:
    each phase's first span (_first_spans)."""
    checks = {"forward": ("the forward is a ramp, ending higher than it starts",
                          "the forward does not end higher than it starts",
                          lambda b, a, pk: a > b),
              "backward": ("the backward falls from where the forward ended, so a peak marks the boundary between "
                           "them",
                           "the backward does not fall from where the forward ended, so no peak separates the two "
                           "(the boundary here comes from the allocations' stack frames, not from the curve)",
                           lambda b, a, pk: a < b),
              "optimizer": ("the optimizer is a short spike above both where it starts and where it ends",
                            "the optimizer rises no higher than where it starts or ends",
                            lambda b, a, pk: pk > max(b, a))}
    seen = [name for name in checks if name in first]
    holds = [name for name in seen if checks[name][2](*first[name])]
    fails = [name for name in seen if name not in holds]
    if len(holds) == len(checks):
        return "So yes, the peaks tell each stage: " + "; ".join(checks[n][0] for n in holds) + "."
    missing = [name for name in checks if name not in seen]
    return ("So the peaks tell the stages apart only in part: "
            + "; ".join([checks[n][0] for n in holds] + [checks[n][1] for n in fails]
                        + [f"no {n} phase was found" for n in missing]) + ".")


def _peak_note(timelines: dict[str, tuple[dict, Timeline]]) -> str:
    """Why a timeline's peak differs from the same step's peak in the tables of (b) and (c), where it
    does: how much of the gap the allocator's blocks account for, counted from the snapshot's
    allocations (``Timeline.block_total``), and what they leave."""
    differ = [(mode, _peak(row), tl) for mode, (row, tl) in timelines.items()
              if row.get("peak_source") == "allocator" and _peak(row) is not None
              and fmt_bytes(_peak(row)) != fmt_bytes(tl.peak_bytes)]
    if not differ:
        return ""
    names = {"forward": "forward", "train_step": "training step"}
    above = all(table > tl.peak_bytes for _, table, tl in differ)
    timeline_peaks = ", ".join(f"{fmt_bytes(tl.peak_bytes)} {names.get(m, m)}" for m, _, tl in differ)
    text = (f"These timeline peaks ({timeline_peaks}) "
            f"are {'below' if above else 'different from'} the peaks in the tables of (b) and (c) "
            f"({', '.join(fmt_bytes(p) for _, p, _ in differ)}), though both are read from the same measured step")
    if not above:
        return text + "."
    # (mode, gap, what the blocks add to the timeline's peak, what is left), each printed in the gap's unit
    gaps = []
    for mode, table, tl in differ:
        gap = table - tl.peak_bytes
        blocks = int(tl.block_total().max()) - tl.peak_bytes
        gaps.append((names.get(mode, mode), gap, blocks, gap - blocks))
    # blocks past the gap (events outside the tables' window, below) raise the peak by the whole gap and more
    accounted = " and ".join((f"{fmt_bytes(blocks, unit_of=gap)} of" if blocks <= gap else "more than")
                             + f" the {name}'s {fmt_bytes(gap)} gap" for name, gap, blocks, _ in gaps)
    # the blocks are at most what the tables count, so a rest below zero can only come from events
    # outside the tables' window (the step marker between steps): at or below zero, the blocks cover the gap
    left = [(name, rest, gap) for name, gap, _, rest in gaps
            if rest > 0 and fmt_bytes(rest, unit_of=gap) != fmt_bytes(0, unit_of=gap)]
    tail = ("; they cover the whole gap" if not left else
            ", leaving " + " and ".join(f"{fmt_bytes(rest, unit_of=gap)} ({name})" for name, rest, gap in left)
            + " that the sizes the snapshot records do not account for")
    return (text + ": the timeline adds up the bytes each allocation asked for, as the allocator's history "
            "records them, while the tables read `torch.cuda.max_memory_allocated`, which counts the blocks the "
            "caching allocator handed out. Counting each allocation as its block instead (the block the snapshot "
            "shows for one still allocated when it was taken, otherwise its request rounded up to a multiple of 512 "
            f"bytes, the least block the allocator hands out) raises the timeline peaks by {accounted}{tail}.")


def timeline_answer(timelines: dict[str, tuple[dict, Timeline]], *, cfg: ModelConfig) -> str:
    """(a): what each timeline shows, read off its phases (found from the allocations' frames)."""
    if not timelines:
        return "No mode ran in fp32 with a snapshot, so there is no timeline to read."
    param_bytes = cfg.n_params * 4  # fp32 parameters; their gradients and each AdamW moment are as large
    parts = []
    if "forward" in timelines:
        row, tl = timelines["forward"]
        parts.append(f"The forward pass (context {row['context_length']}) starts from {fmt_bytes(tl.baseline_bytes)} "
                     f"(the parameters, allocated before recording), climbs {fmt_bytes(tl.peak_bytes - tl.baseline_bytes)} "
                     f"to its peak of {fmt_bytes(tl.peak_bytes)} and ends at {fmt_bytes(int(tl.total[-1]))}: under "
                     f"`no_grad` nothing is kept for a backward, so each block's activations are freed once the "
                     f"next block has read them and the climb is the few tensors alive at once.")
    if "train_step" in timelines:
        row, tl = timelines["train_step"]
        first = _first_spans(tl)
        stories = _step_phases(tl, first, grad_bytes=param_bytes)
        f_before = first.get("forward", (tl.baseline_bytes,))[0]
        held = ("the weights, AdamW's two moments and the previous step's gradients"
                if _matches(tl.baseline_bytes - f_before, param_bytes) else "the weights and AdamW's state")
        peak_phase = next((p.name for p in tl.phases if p.start <= tl.peak_index <= p.end), "unlabelled")
        parts.append(f"The training step (context {row['context_length']}) starts from {fmt_bytes(tl.baseline_bytes)}, "
                     f"{tl.baseline_bytes / param_bytes:.2f}× the {fmt_bytes(param_bytes)} of fp32 parameters: {held}, "
                     f"all allocated before recording began. " + " ".join(stories)
                     + f" The step's peak, {fmt_bytes(tl.peak_bytes)}, falls in the **{peak_phase}** phase.")
        parts.append(_stage_verdict(first))
    note = _peak_note(timelines)
    return " ".join(parts + ([note] if note else []))


# ----------------------------------------------------------------------------- (b), (c) peaks


def _peak(row: dict | None, key: str = "peak_gib") -> float | None:
    """A row's peak in bytes, None unless it ran."""
    return row[key] * GIB if row and row["status"] == "ok" and row.get(key) is not None else None


def table_unit(values: list[float | None]) -> tuple[float, str]:
    """One unit for a table's memory columns, from its largest value."""
    return _unit(max([abs(v) for v in values if v is not None and v == v] or [1]))  # v == v: not NaN


def peak_table(rows: list[dict], precision: str) -> pd.DataFrame:
    """Two numbers per context (forward and train-step peaks), with each point's status."""
    scale, unit = table_unit([_peak(r) for r in rows])
    table = {}
    for r in rows:
        if r["precision"] != precision:
            continue
        line = table.setdefault(r["context_length"], {"context": r["context_length"]})
        name = "forward" if r["mode"] == "forward" else "train step"
        peak = _peak(r)
        line[f"{name} peak {unit}"] = peak / scale if peak is not None else None
        line[f"{name} status"] = r["status"]
    return pd.DataFrame(sorted(table.values(), key=lambda line: line["context"]))


def peak_answer(rows: list[dict], *, label: str, source: str) -> str:
    """(b): the two numbers per context, in words."""
    parts = []
    for mode, name in (("forward", "forward pass"), ("train_step", "training step")):
        mine = sorted((r for r in rows if r["mode"] == mode and r["precision"] == "fp32"), key=lambda r: r["context_length"])
        ran = [f"{fmt_bytes(_peak(r))} at context {r['context_length']}" for r in mine if r["status"] == "ok"]
        oom = [str(r["context_length"]) for r in mine if r["status"] == "oom"]
        parts.append(f"{name}: " + ", ".join(ran or ["nothing ran"])
                     + (f"; out of memory at context {', '.join(oom)}" if oom else ""))
    return f"Peak memory of the {label} model in fp32 ({source}): " + "; ".join(parts) + "."


def peak_phase(row: dict) -> str | None:
    """The phase in which a step reached its peak: where the cumulative high-water mark stops rising."""
    marks = [(p, row.get(f"peak_{p}_gib")) for p in PHASES if row.get(f"peak_{p}_gib") is not None]
    if not marks:
        return None
    top = max(v for _, v in marks)
    return next(p for p, v in marks if v >= top)


def _pairs(rows: list[dict]) -> list[tuple[str, int, dict | None, dict | None]]:
    """(mode, context, fp32 row, bf16 row) for every mode and context swept."""
    by = {(r["mode"], r["context_length"], r["precision"]): r for r in rows}
    keys = dict.fromkeys((r["mode"], r["context_length"]) for r in rows)
    return [(m, c, by.get((m, c, "fp32")), by.get((m, c, "bf16"))) for m, c in keys]


def precision_table(rows: list[dict]) -> pd.DataFrame:
    """Per mode and context: the fp32 and bf16-autocast peaks, their ratio, and (train step) the
    phase in which each peak was reached."""
    scale, unit = table_unit([_peak(r) for r in rows])
    out = []
    for mode, context, a, b in _pairs(rows):
        line = {"mode": mode, "context": context}
        for name, r in (("fp32", a), ("bf16", b)):
            peak = _peak(r)
            line[f"{name} {unit}"] = peak / scale if peak is not None else None
            line[f"{name} status"] = r["status"] if r else None
        pa, pb = _peak(a), _peak(b)
        line["bf16 / fp32"] = pb / pa if pa and pb else None
        if mode == "train_step":
            line["fp32 peak in"] = peak_phase(a) if _peak(a) else None
            line["bf16 peak in"] = peak_phase(b) if _peak(b) else None
        out.append(line)
    return pd.DataFrame(out)


def precision_answer(rows: list[dict], *, cfg: ModelConfig, label: str) -> str:
    """(c): whether bf16 autocast changes the peaks, and which phase sets the training step's peak."""
    param_bytes = cfg.n_params * 4
    parts = []
    both = [(m, c, a, b) for m, c, a, b in _pairs(rows) if _peak(a) and _peak(b)]
    fwd = [(c, _peak(a), _peak(b)) for m, c, a, b in both if m == "forward"]
    if fwd:
        ratios = [pb / pa for _, pa, pb in fwd]
        c, pa, pb = max(fwd, key=lambda t: abs(t[2] / t[1] - 1))
        parts.append(f"Forward pass: the bf16-autocast peak is {value_range(ratios, '{:.2f}')}× the fp32 peak (largest "
                     f"change at context {c}: {fmt_bytes(pa)} → {fmt_bytes(pb)}). Both hold the same "
                     f"{fmt_bytes(param_bytes)} of fp32 weights (autocast keeps them and casts a bf16 copy per use); "
                     f"only what sits above them differs, {fmt_bytes(pa - param_bytes)} → {fmt_bytes(pb - param_bytes)} "
                     f"there: matmul outputs become bf16, while softmax and the norms' reductions still run in fp32 "
                     f"and the casts of weights and activations are extra tensors.")
    steps = [(c, a, b) for m, c, a, b in _pairs(rows) if m == "train_step" and (_peak(a) or _peak(b))]
    if steps:
        ratios = [_peak(b) / _peak(a) for _, a, b in steps if _peak(a) and _peak(b)]
        phases = {peak_phase(r) for _, a, b in steps for r in (a, b) if _peak(r)}
        peaks = [_peak(r) for _, a, b in steps for r in (a, b) if _peak(r)]
        text = (f"Training step: bf16 / fp32 = {value_range(ratios, '{:.3f}')}. " if ratios else "Training step: ")
        text += (f"Every step that ran reached its peak ({fmt_bytes(min(peaks))}–{fmt_bytes(max(peaks))}) in the "
                 f"**{' / '.join(sorted(phases))}** phase")
        if phases == {"optimizer"}:
            text += (f", at {value_range([p / param_bytes for p in peaks], '{:.2f}')}× the parameters' "
                     f"{fmt_bytes(param_bytes)}: our AdamW step holds the weights, the gradients, both moments and "
                     f"the square roots of the second moments that `adamw_foreach_` allocates at once (5× the "
                     f"parameter bytes), all fp32 whatever the autocast dtype, so autocast cannot lower it")
        parts.append(text + ".")
        starts = [(r["start_gib"] * GIB, _peak(r)) for _, a, b in steps for r in (a, b) if _peak(r) and r.get("start_gib")]
        if starts:
            share = min(s / p for s, p in starts)
            parts.append(f"What the step holds before it starts (parameters, gradients, AdamW state) is at least "
                         f"{share:.0%} of its peak.")
    oom = [f"{m} {p} at context {c}" for m, c, a, b in _pairs(rows) for p, r in (("fp32", a), ("bf16", b))
           if r and r["status"] == "oom"]
    if oom:
        parts.append("Out of memory: " + ", ".join(oom) + ".")
    changed = [abs(_peak(b) / _peak(a) - 1) for m, c, a, b in both]
    if not changed:
        return " ".join(parts + ["No point ran in both precisions, so there is nothing to compare."])
    worst = max(changed)
    verdict = (f"So mixed precision changes the {label} model's peaks by at most {worst:.0%}: "
               + ("not significant" if worst < SIGNIFICANT else "significant")
               + f" by our threshold of {SIGNIFICANT:.0%}.")
    return " ".join(parts) + " " + verdict


# ----------------------------------------------------------------------------- (d), (e) the snapshot


def residual_answer(*, cfg: ModelConfig, batch_size: int, contexts: tuple[int, ...], snapshot_row_: dict | None,
                    label: str) -> str:
    """(d): one residual-stream activation, derived, and how often that size is allocated in the snapshot."""
    sizes = {c: residual_stream_bytes(batch_size=batch_size, context_length=c, d_model=cfg.d_model) for c in contexts}
    text = ("A residual-stream activation is batch × context × d_model fp32 values of 4 bytes: "
            + "; ".join(f"{batch_size} × {c} × {cfg.d_model} × 4 = {b:,} bytes = **{b / MIB:,.4g} MiB** (context {c})"
                        for c, b in sizes.items()) + f" for the {label} model.")
    if snapshot_row_ is not None:
        c = snapshot_row_["context_length"]
        m = match_allocation_size(snapshot_row_["snapshot"], sizes[c])
        text += (f" In the {snapshot_row_['mode']} snapshot at context {c}, {m['n_matches']} allocations have exactly "
                 f"that size ({', '.join(f'{n} in the {phase}' for phase, n in m['by_phase'].items())}), most often from "
                 + "; ".join(f"`{src}` ×{n}" for src, n in m["top_sources"]) + ".")
    return text


def known_tensors(cfg: ModelConfig, *, batch_size: int, context: int) -> dict[int, str]:
    """Bytes -> name(s) of the model's large activation shapes (fp32 and bf16), to name an allocation by its size."""
    b, t = batch_size, context
    shapes = {"(b, h, T, T) attention scores": b * cfg.n_heads * t * t, "(b, T, d_ff) feed-forward hidden": b * t * cfg.d_ff,
              "(b, T, vocab) logits": b * t * cfg.vocab_size, "(b, T, d_model) residual stream": b * t * cfg.d_model}
    out: dict[int, list[str]] = {}
    for name, n in shapes.items():
        for size, dtype in ((n * 4, "fp32"), (n * 2, "bf16")):
            # a CUDA snapshot records the allocator's block, the request rounded up to 512 bytes
            for key in dict.fromkeys((size, -(-size // 512) * 512 if size >= 512 else size)):
                out.setdefault(key, []).append(f"{name}, {dtype}")
    return {size: " or ".join(names) for size, names in out.items()}


def largest_table(row: dict, *, cfg: ModelConfig, k: int = 8) -> pd.DataFrame:
    """The ``k`` largest allocations of a snapshot by (size, allocating line), named by shape where one
    matches (``size_bytes`` is for ``largest_answer``; show the table without it)."""
    df = largest_allocations(row["snapshot"], k=k)
    names = known_tensors(cfg, batch_size=row["batch_size"], context=row["context_length"])
    df.insert(2, "tensor (by size)", [names.get(int(s), "—") for s in df["size_bytes"]])
    return df


def largest_answer(table: pd.DataFrame, row: dict) -> str:
    """(e): the largest forward allocations, what they are, and the user-code lines that make them."""
    if table.empty:
        return "The snapshot holds no allocations."
    top = table.iloc[0]
    same = table[table["size_bytes"] == top["size_bytes"]]
    lines = "; ".join(f"`{src}` ×{n}" + (f" (called from `{stack.split(' <- ')[1]}`)" if " <- " in str(stack) else "")
                      for src, n, stack in zip(same["source"], same["count"], same["stack"]))
    name = top["tensor (by size)"]
    why = {"attention scores": "naive attention materialises the scores and the softmax probabilities at full "
                               "(batch, heads, context, context) size, which grows with the square of the context",
           "logits": "the LM head writes a score for every vocabulary entry at every position",
           "feed-forward": "SwiGLU's hidden layer is d_ff = 4 d_model wide"}
    reason = "; ".join(text for key, text in why.items() if key in name) or None
    rest = table.iloc[len(same):len(same) + 3]
    return (f"In the forward pass at context {row['context_length']} ({row['precision']}), the largest allocations are "
            f"**{top['size_mib']:,.1f} MiB** each ({int(same['count'].sum())} of them)"
            + (f", the size of one {name} tensor" if name != "—" else "")
            + f". Their stack traces end in user code at {lines}"
            + (f": {reason}" if reason else "") + ". The next sizes down: "
            + ", ".join(f"{mib:,.1f} MiB ({what})" for mib, what in zip(rest["size_mib"], rest["tensor (by size)"]))
            + ".")


# ----------------------------------------------------------------------------- (f) one block


def block_ops_table(row: dict) -> pd.DataFrame:
    df = pd.DataFrame(row["top_ops"])
    return df.drop(columns=["bytes"]).rename(columns={"mib": "MiB", "share": "share of saved", "n_tensors": "pack calls"})


def block_answer(row: dict, *, label: str) -> str:
    """(f): what one block saves for backward (top five ops) and its gradients, measured from allocator changes."""
    ops = pd.DataFrame(row["top_ops"])
    saved, grad, expected = row["saved_bytes"], row["grad_bytes"], row["expected_grad_bytes"]
    verdict = "equal to" if grad == expected else f"{(grad - expected) / expected:+.2%} away from"
    return (
        f"One {label} block at batch {row['batch_size']} × context {row['context_length']} saves "
        f"**{fmt_bytes(saved)}** for its backward ({row['n_saved']} pack calls over {row['n_storages']} storages; the "
        f"input is counted, as the handout's hook counts it, the {fmt_bytes(row['param_bytes_excluded'])} of weights "
        f"the matmuls also save are not), = {saved / row['residual_bytes']:.1f} residual-stream tensors of "
        f"{fmt_bytes(row['residual_bytes'])}. The five largest contributors, "
        + ", ".join(f"{op} {fmt_bytes(b)} ({share:.0%})" for op, b, share in zip(ops["op"], ops["bytes"], ops["share"]))
        + f", hold {ops['share'].sum():.0%} of it; one (b, h, T, T) fp32 attention matrix is "
        f"{fmt_bytes(row['attention_matrix_bytes'])}.\n\n"
        f"The gradients, from the allocator rather than from `p.grad` sizes: after the forward, "
        f"{fmt_bytes(row['forward_bytes'])} more were allocated (the saved tensors and the "
        f"{fmt_bytes(row['output_bytes'])} output); across the backward, memory changed by "
        f"{'+' if row['backward_change_bytes'] >= 0 else '−'}{fmt_bytes(abs(row['backward_change_bytes']))} (saved "
        f"tensors freed, gradients written), and once the output is dropped {fmt_bytes(grad)} stay allocated: the "
        f"gradients. One gradient per parameter, (4 d² + 3 d d_ff + 2 d) × 4 bytes with d = {row['d_model']} and "
        f"d_ff = {row['d_ff']}, is {fmt_bytes(expected)}, so the measurement is {verdict} what we expect.")


# ----------------------------------------------------------------------------- gradient checkpointing (a)


def chain_sketch() -> str:
    """The constant-memory runner's code (``systems.parallel.checkpoint``), for the answer's sketch."""
    call = textwrap.dedent(inspect.getsource(checkpointing.ChainCheckpointing.__call__))
    return (inspect.getsource(checkpointing._run_chain)
            + "\n\n# the model's layer runner, ChainCheckpointing.__call__:\n" + call)


def strategies_table(rows: list[dict]) -> pd.DataFrame:
    scale, unit = table_unit([r["rise_bytes"] for r in rows])
    return pd.DataFrame([{"N": r["n_layers"], "strategy": r["label"], "block forwards": r["block_forwards"],
                          "forwards per block": r["forwards_per_block"],
                          f"activation peak {unit}": r["rise_bytes"] / scale, "step ms": r["step_ms"]} for r in rows])


def strategies_figure(rows: list[dict], *, title: str):
    """Activation peak (above the step's start) and block forwards per block against N, per strategy."""
    df = pd.DataFrame(rows)
    scale, unit = table_unit(df["rise_bytes"].tolist())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for _, g in df.groupby("strategy", sort=False):
        name = g["label"].iloc[-1].split(",")[0]
        ax1.plot(g["n_layers"], g["rise_bytes"] / scale, "o-", label=name)
        ax2.plot(g["n_layers"], g["forwards_per_block"], "o-", label=name)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks N")
    ax1.set_ylabel(f"activation peak above the step's start ({unit})")
    ax2.set_ylabel("block forwards per block (recompute included)")
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plan_answer(rows: list[dict]) -> str:
    """gradient_checkpointing (a): the memory-optimal arrangement, its asymptotics, and the measured check."""
    df = pd.DataFrame(rows)
    n_lo, n_hi = df["n_layers"].min(), df["n_layers"].max()
    at = {r["strategy"]: r for r in rows if r["n_layers"] == n_hi}
    first = {r["strategy"]: r for r in rows if r["n_layers"] == n_lo}
    growth = ", ".join(f"{at[s]['rise_bytes'] / first[s]['rise_bytes']:.2f}× ({at[s]['label'].split(',')[0]})"
                       for s in at)
    return (
        "Ignoring compute, the floor is one block's residuals: a block's backward needs its own, so nothing goes "
        "lower, and nested checkpoints reach it for any N: peak activation memory **O(1)** in N, with the "
        "per-checkpoint bookkeeping (the stored block boundaries) negligible, as the handout assumes. Recursive "
        "bisection gets there: checkpoint each half of the stack, each half's halves inside it, down to single "
        "blocks; in the backward one block's residuals are alive at a time, beside one stored boundary per nesting "
        "level (O(log N) boundaries, the bookkeeping), for O(N log N) block forwards. Counting the boundaries too, "
        "the chain goes lowest: checkpoint the whole stack and, inside it, everything but the last block, "
        "recursively; the backward of block i recomputes blocks 1..i from the input, so only the input, one "
        "block's residuals and the gradient between blocks are alive, O(1) boundaries included, for "
        "N + N(N+1)/2 block forwards, **O(N²)** compute. One level of √N groups (no nesting) gives O(√N) for one "
        "extra forward. The chain's "
        "runner (`systems.parallel.checkpoint`):\n\n"
        f"```python\n{chain_sketch()}```\n\n"
        f"Measured on the debug model from N = {n_lo} to {n_hi} blocks, the activation peak grows {growth}; at "
        f"N = {n_hi} the chain needs {fmt_bytes(at['chain']['rise_bytes'])} against "
        f"{fmt_bytes(at['nested']['rise_bytes'])} for binary nesting, {fmt_bytes(at['one_level']['rise_bytes'])} for "
        f"√N groups and {fmt_bytes(at['none']['rise_bytes'])} without checkpointing, running "
        f"{at['chain']['forwards_per_block']:.1f} block forwards per block (binary nesting "
        f"{at['nested']['forwards_per_block']:.1f}, √N groups {at['one_level']['forwards_per_block']:.1f}).")


# ----------------------------------------------------------------------------- gradient checkpointing (b)


def _model_bytes(k: int, *, n: int, block: dict) -> int:
    """ceil(N/k) stored group inputs r plus one group's k blocks of saved tensors A."""
    return math.ceil(n / k) * block["residual_bytes"] + k * block["saved_bytes"]


def groups_table(rows: list[dict], *, block: dict) -> pd.DataFrame:
    """Per group size k: forward + backward peak, AdamW step's peak, step time, and each k's
    difference from the lowest forward + backward peak, measured and by ``_model_bytes``."""
    ok = [r for r in rows if r["status"] == "ok"]
    scale, unit = table_unit([r["peak_bytes"] for r in ok])
    best = min(ok, key=lambda r: r["activation_peak_bytes"]) if ok else None
    out = []
    for r in rows:
        line = {"k": r.get("group_size"), "groups": r.get("n_groups"), "status": r["status"]}
        if r["status"] == "ok":
            n, k = r["n_layers"], r["group_size"]
            line.update({f"fwd+bwd peak {unit}": r["activation_peak_bytes"] / scale,
                         f"optimizer peak {unit}": r.get("peak_optimizer_bytes", 0) / scale, "step ms": r["step_ms"],
                         f"fwd+bwd − lowest {unit}": (r["activation_peak_bytes"] - best["activation_peak_bytes"]) / scale,
                         f"model − model at lowest {unit}": (_model_bytes(k, n=n, block=block)
                                                             - _model_bytes(best["group_size"], n=n, block=block)) / scale})
        out.append(line)
    return pd.DataFrame(out)


def groups_figure(rows: list[dict], *, title: str):
    ok = [r for r in rows if r["status"] == "ok"]
    scale, unit = table_unit([r["peak_bytes"] for r in ok])
    ks = [r["group_size"] for r in ok]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.plot(ks, [r["activation_peak_bytes"] / scale for r in ok], "o-", label="forward + backward peak")
    if all("peak_optimizer_bytes" in r for r in ok):
        ax.plot(ks, [r["peak_optimizer_bytes"] / scale for r in ok], "s--", label="AdamW step's peak")
    best = min(ok, key=lambda r: r["activation_peak_bytes"])
    ax.plot([best["group_size"]], [best["activation_peak_bytes"] / scale], "r*", ms=14,
            label=f"lowest forward + backward peak: k = {best['group_size']}")
    oom = [r["group_size"] for r in rows if r["status"] == "oom" and r.get("group_size")]
    for k in oom:
        ax.axvline(k, color="red", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks per checkpoint group (k)")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title(title + (" (red dotted: out of memory)" if oom else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def groups_answer(rows: list[dict], *, block: dict, label: str) -> str:
    """gradient_checkpointing (b): the reasoning (closed form from the measured block), the best k by
    the forward + backward peak, its neighbours, and where the AdamW step's peak sits."""
    ok = [r for r in rows if r["status"] == "ok"]
    oom = [r["group_size"] for r in rows if r["status"] == "oom" and r.get("group_size")]
    if not ok:
        return (f"No group size fits: the {label} training step runs out of memory at every k tried"
                + (f" ({', '.join(map(str, oom))})" if oom else " (the model and its AdamW state alone do not fit)") + ".")
    n, r, a = block["n_layers"], block["residual_bytes"], block["saved_bytes"]
    k_star = math.sqrt(n * r / a)
    hypothesis = max(1, round(k_star))
    i = min(range(len(ok)), key=lambda j: ok[j]["activation_peak_bytes"])
    best = ok[i]
    neighbours = [ok[j] for j in (i - 1, i + 1) if 0 <= j < len(ok)]
    opt = [x["peak_optimizer_bytes"] for x in ok if "peak_optimizer_bytes" in x]
    above = [x["group_size"] for x in ok if x.get("peak_optimizer_bytes", 0) > x["activation_peak_bytes"]]
    text = (
        f"With one level of checkpointing in groups of k blocks, the backward holds the ceil(N/k) stored group "
        f"inputs (r = {fmt_bytes(r)} each) plus the recomputed saved tensors of one group, k × A with "
        f"A = {fmt_bytes(a)} per block (measured for one {label} block at batch {block['batch_size']} × context "
        f"{block['context_length']}); the compute is the same for every k, since each block is recomputed once. "
        f"ceil(N/k) r + k A is smallest near k* = √(N r / A) = √({n} × {fmt_bytes(r)} / {fmt_bytes(a)}) = "
        f"{k_star:.2f}, so the hypothesis is the group size nearest it, k = {hypothesis}. The measured forward + "
        f"backward peaks {'agree' if best['group_size'] == hypothesis else 'disagree'}: lowest at "
        f"**k = {best['group_size']}, "
        f"{fmt_bytes(best['activation_peak_bytes'])}**, against "
        + ", ".join(f"{fmt_bytes(x['activation_peak_bytes'])} at k = {x['group_size']} "
                    f"({fmt_bytes(x['activation_peak_bytes'] - best['activation_peak_bytes'], unit_of=a)} more)"
                    for x in neighbours)
        + (f"; out of memory at k = {', '.join(map(str, oom))}" if oom else "") + ".")
    if opt:
        lo, hi = fmt_bytes(min(opt)), fmt_bytes(max(opt))
        span = lo if lo == hi else f"{lo}–{hi}"
        text += (f" The AdamW step peaks at {span} whatever k is, "
                 + (f"above the forward + backward peak for k = {', '.join(map(str, above))}: there the step's "
                    f"overall peak is the optimizer's, which checkpointing cannot lower, so comparing k by the "
                    f"step's overall peak would show a tie" if above else "below every forward + backward peak")
                 + ".")
    return text + f" A step takes {best['step_ms']:,.0f} ms at k = {best['group_size']}."
