"""Notebook 02 (kernel profiling, the handouts' nsys_profile): tables, figures and answer text,
all built from the sweep's summary rows (``systems.bench.profile.profile_sweep``) and its
profiles.

    tool_note(nsys=..., device=...)            which profiler produced the numbers, said once
    coverage_table(summary), longest_fit(summary)   what was profiled, what ran out of memory
    forward_table / answer_a, top_kernel_table / answer_b, non_matmul_table / answer_c,
    category_shares, share_changes / answer_d, softmax_table / answer_e
    weight_matmuls(fused_projections=...), launch_split(n, n_layers=..., fused_projections=...)
        what answer_b counts (the kernel families it names: systems.measure.profiler.kernel_family)
    plot_category_shares(summary), plot_step_timeline(trace)
"""

from __future__ import annotations

import functools
from pathlib import Path

import pandas as pd

from systems.config import get_config
from systems.measure.flops import SOFTMAX_FLOPS_PER_ELEMENT
from systems.measure.hardware import lookup_peak
from systems.measure.profiler import (ATTENTION_RANGES, CATEGORIES, PHASE_RANGES, attribute, kernel_family,
                                      kernel_layout, parse_trace)
from systems.measure.trace import STEP_RANGE
from systems.model import Linear, TransformerLM
from systems.report.notebook import join_words, value_range

MS = 1e3


def _ok(summary: pd.DataFrame, mode: str | None = None) -> pd.DataFrame:
    ok = summary[summary["status"] == "ok"]
    return ok if mode is None else ok[ok["mode"] == mode]


def _percent_range(values: pd.Series, digits: int = 1, *, signed: bool = False) -> str:
    """"12.0%–40.5%"; ``signed`` for relative differences, "-12.0% to +40.5%"."""
    return value_range(values, f"{{:{'+' if signed else ''}.{digits}%}}", signed=signed)


def tool_note(*, nsys: bool, device: str) -> str:
    """The one statement of which profiler measured what follows."""
    if device != "cuda":
        return ("No GPU here: this smoke run profiles with `torch.profiler` on the CPU, so the 'kernels' below "
                "are CPU operators (their self time); the full profile on a GPU reads CUDA kernels.")
    if nsys:
        return ("Kernels are read from `torch.profiler` (CUPTI) traces; `nsys` is on this machine, so the last "
                "section also runs one train step under `nsys profile` and parses its `cuda_gpu_kern_sum` report.")
    return ("`nsys` is not installed on this machine, so the profiler is `torch.profiler`: the same CUPTI kernel "
            "records Nsight Systems reads, with the named ranges (`record_function`, which `emit_nvtx` turns "
            "into NVTX ranges under nsys) that the handout asks for: `step` > `forward` / `backward` / "
            "`optimizer step`, and inside attention `attention scores` / `softmax` / `final matmul`. Warm-up "
            "steps run before the profiler starts, as an NVTX capture filter would leave them out.")


# ----------------------------------------------------------------------------- coverage


def coverage_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Size x context, one column per mode: 'ok', 'oom' or why the point was skipped."""
    cov = summary.pivot_table(index=["label", "context_length"], columns="mode", values="status", aggfunc="first",
                              sort=False)
    cov.columns.name = None
    return cov.reset_index()


def longest_fit(summary: pd.DataFrame) -> pd.DataFrame:
    """Per size: the longest context whose train step ran, and the context that ran out of memory."""
    rows = []
    for label, grp in summary[summary["mode"] == "train_step"].groupby("label", sort=False):
        ran = grp[grp["status"] == "ok"]["context_length"]
        oom = grp[grp["status"] == "oom"]["context_length"]
        rows.append({"label": label, "longest_fit": ran.max() if len(ran) else None,
                     "oom_at": oom.min() if len(oom) else None,
                     "contexts_profiled": ", ".join(str(c) for c in ran)})
    return pd.DataFrame(rows, columns=["label", "longest_fit", "oom_at", "contexts_profiled"])


def coverage_text(summary: pd.DataFrame, *, longest: bool) -> str:
    ok, oom = _ok(summary), summary[summary["status"] == "oom"]
    skipped = summary[summary["status"].str.startswith("skipped")]
    text = f"Profiled {len(ok)} of {len(summary)} points (size × context × mode)"
    if len(oom):
        text += "; out of memory: " + ", ".join(f"{r.label} at {r.context_length} ({r.mode})" for r in oom.itertuples())
    if len(skipped):
        text += f"; skipped: {len(skipped)} ({', '.join(sorted(set(skipped['status'])))})"
    text += "."
    if longest:
        fits = longest_fit(summary)
        text += " Longest power-of-two context whose train step fits: " + "; ".join(
            f"{r.label} {r.longest_fit:.0f}" + (f" ({r.oom_at:.0f} ran out of memory)" if pd.notna(r.oom_at) else
                                                " (the top of the ladder: nothing ran out of memory)")
            for r in fits.itertuples() if pd.notna(r.longest_fit)) + "."
    return text


# ----------------------------------------------------------------------------- (a)


# (a) a forward pass "agrees" with the harness when the profiled span is within this fraction of
# the harness's time. Fixed beforehand, not derived from the gap it judges (allowing the profiler's
# own measured slow-down lets every gap agree). Why 5%: where kernels fill the span, a profile at
# most 5% longer added at most 5% to their time, which moves no category's share by more than 5
# points: the shares (c)-(e) read still describe the unprofiled run.
AGREE_TOLERANCE = 0.05
# (a) kernels running for at least this fraction of the forward span keep the GPU busy; below it the
# GPU waits on the CPU's launches, whose cost the profiler raises. Why 0.9 (our cut, not a
# measurement): "launch-bound" says the launches, not the kernels, set the span's length; with nine
# tenths of the span or more in kernels the GPU idles at most a tenth of it, too little for the
# launches to be what sets the pace.
BUSY_SHARE = 0.9


def agrees_column(tolerance: float = AGREE_TOLERANCE) -> str:
    """The name of ``forward_table``'s verdict column, which says its tolerance."""
    return f"agrees (within {tolerance:.0%})"


def forward_table(summary: pd.DataFrame, *, tolerance: float = AGREE_TOLERANCE) -> pd.DataFrame:
    """Forward time: the harness's timer without the profiler, the same loop under it, the profiled
    forward range's span, the kernel time inside it, and whether the span agrees with the harness
    (within ``tolerance`` of its time)."""
    ok = _ok(summary)
    return pd.DataFrame({
        "label": ok["label"], "context": ok["context_length"], "mode": ok["mode"],
        "harness ms": ok["harness_forward_s"] * MS, "harness std ms": ok["harness_forward_std_s"] * MS,
        "profiled ms": ok["profiled_forward_s"] * MS, "profiler overhead": ok["profiler_overhead"],
        "profiled span ms": ok["profiled_forward_span_s"] * MS, "span vs harness": ok["span_vs_harness"],
        "kernel ms": ok["forward_kernel_s"] * MS,
        agrees_column(tolerance): ok["span_vs_harness"].abs() <= tolerance,
    }).reset_index(drop=True)


def _sizes_at(rows: pd.DataFrame, *, context: str = "context_length", note=None) -> str:
    """Configurations in words, each size once with its contexts and 'tokens' after the last one:
    'small at 256 tokens', 'small at 1024 and 4096 and large at 512 tokens'. ``note(row)``, where
    given, follows each context: 'a at 32 (-50.0%) and b at 32 tokens (+25.0%)'."""
    sizes = [(label, [[f"{r[context]:.0f}", note(r) if note else ""] for _, r in grp.iterrows()])
             for label, grp in rows.groupby("label", sort=False)]
    sizes[-1][1][-1][0] += " tokens"  # once, after the last context and before its note
    return join_words([f"{label} at " + join_words([c + n for c, n in contexts]) for label, contexts in sizes])


def answer_a(table: pd.DataFrame, *, device: str, tolerance: float = AGREE_TOLERANCE) -> str:
    """(a): the largest forward pass's profiled time against the harness's, then how many
    forward-only configurations agree within ``tolerance`` (``forward_table``'s verdict, built at the
    same tolerance); the ones that do not are listed with their gap, and called launch-bound only
    where the profile shows it (kernels fill less than ``BUSY_SHARE`` of the span and the profiler
    slowed the same loop by more than ``tolerance``)."""
    verdict = agrees_column(tolerance)
    if verdict not in table.columns:
        raise ValueError(f"the table has no {verdict!r} column: build it with forward_table(summary, "
                         f"tolerance={tolerance}), the tolerance answer_a is asked for")
    fa = table[table["mode"] == "forward"]
    if fa.empty:
        return "No forward-only configuration ran, so there is no forward time to compare."
    big = fa.iloc[-1]
    unit = "kernel" if device == "cuda" else "operator"
    text = (f"For {big['label']} at {big['context']:.0f} tokens a forward pass takes {big['profiled span ms']:.2f} ms in "
            f"the profile (the forward range's start to its last {unit}'s end), against {big['harness ms']:.2f} ± "
            f"{big['harness std ms']:.2f} ms by the harness's Python timer (synchronise, then `perf_counter`) on the "
            f"same model without the profiler ({big['span vs harness']:+.1%}). ")
    within = fa[verdict].astype(bool)
    agree, off = fa[within], fa[~within]
    rule = f"within {tolerance:.0%} (our tolerance)"
    if off.empty:
        return text + (f"All {len(fa)} forward-only configurations agree {rule}: their profiled spans are "
                       f"{_percent_range(fa['span vs harness'], signed=True)} off the harness's time.")
    text += f"{len(agree)} of {len(fa)} forward-only configurations agree {rule}"
    if len(agree):
        text += f", their profiled spans {_percent_range(agree['span vs harness'], signed=True)} off"
    gaps = _sizes_at(off, context="context", note=lambda r: f" ({r['span vs harness']:+.1%})")
    text += f"; {gaps} {'does' if len(off) == 1 else 'do'} not"
    filled = off["kernel ms"] / off["profiled span ms"]
    bound = off[(filled < BUSY_SHARE) & (off["profiler overhead"] > tolerance)]
    if bound.empty:
        return text + "."
    where = "There" if len(bound) == len(off) else f"For {_sizes_at(bound, context='context')}"
    fill = _percent_range(bound["kernel ms"] / bound["profiled span ms"], 0)
    if len(bound) == 1:
        fill += f" ({bound['kernel ms'].iloc[0]:.2f} of {bound['profiled span ms'].iloc[0]:.2f} ms)"
    pace = ("the GPU waits on the CPU's kernel launches, and the profiler's cost per launch" if device == "cuda" else
            "the Python and dispatch work between operators sets the pace, and the profiler's cost per operator")
    return text + (f". {where} the {unit}s run for only {fill} of the forward span, so the forward is "
                   f"{'launch' if device == 'cuda' else 'overhead'}-bound: {pace} slows the same loop by "
                   f"{_percent_range(bound['profiler overhead'], signed=True)} (timed with and without it).")


# ----------------------------------------------------------------------------- (b)


@functools.cache
def weight_matmuls(*, fused_projections: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The model's weight matmuls (its Linear modules, one GEMM launch each per forward pass): the
    names in one layer, and those outside the layers (the LM head). Which Linears a model has
    depends only on whether its projections are fused, so each layout is counted once."""
    # a one-layer model on the meta device: nothing allocated, the names as the model defines them
    model = TransformerLM(get_config("debug", n_layers=1, fused_projections=fused_projections), device="meta")
    layer = tuple(n for n, m in model.layers[0].named_modules() if isinstance(m, Linear))
    outside = tuple(n for n, m in model.named_modules() if isinstance(m, Linear) and not n.startswith("layers."))
    return layer, outside


def launch_split(n: float, *, n_layers: int, fused_projections: bool) -> tuple[int, int, int] | None:
    """``n`` launches per forward pass as (layers, k per layer, extra): k in each layer plus the
    weight matmuls outside the layers, else without them; None when n is neither (or missing)."""
    if pd.isna(n) or not float(n).is_integer():
        return None
    outside = len(weight_matmuls(fused_projections=fused_projections)[1])
    for extra in (outside, 0):
        k, rest = divmod(int(n) - extra, n_layers)
        if k >= 1 and rest == 0:
            return n_layers, k, extra
    return None


def _split_text(split: tuple[int, int, int] | None, *, fused_projections: bool) -> str:
    if split is None:
        return ""
    n_layers, k, extra = split
    layer, outside = weight_matmuls(fused_projections=fused_projections)
    every = (k, extra) == (len(layer), len(outside))
    return f"{n_layers} × {k}" + (f" + {extra}" if extra else "") + (" (every weight matmul)" if every else "")


SPLIT = "per pass = layers × per layer + outside"


# what a summary row records of the model it measured (systems.bench.profile.summarize), which the
# launch counts are read against
MODEL_SHAPE = ("n_layers", "fused_projections")


def top_kernel_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (size, context): the forward pass's top kernel (inference), its launches per pass and
    how they split over the layers, and the top kernel of the train step's forward+backward;
    whether it is the same kernel (full name); and (``weight matmuls per pass``) what one launch per
    weight matmul would count, from the model the row records (``MODEL_SHAPE``)."""
    ok = _ok(summary, "forward")
    missing = [c for c in MODEL_SHAPE if c not in ok.columns or ok[c].isna().any()]
    if missing and len(ok):
        raise ValueError(f"summary rows without {missing}: rows written before systems.bench.profile.summarize "
                         "recorded the model's shape; profile the sweep again")
    # typed here: the sweep's out-of-memory rows lack the fields, which leaves the columns float / object
    fwd = ok[["label", "model", "context_length", "top_forward_kernel", "top_forward_category", "top_forward_share",
              "top_forward_per_pass", "top_forward_name"]].assign(
        n_layers=ok["n_layers"].astype(int), fused_projections=ok["fused_projections"].astype(bool))
    train = _ok(summary, "train_step")
    cols = ["label", "context_length", "top_fwd_bwd_kernel", "top_fwd_bwd_category", "top_fwd_bwd_share",
            "top_fwd_bwd_name"]
    train = train[cols] if "top_fwd_bwd_kernel" in train.columns else pd.DataFrame(columns=cols)
    b = fwd.merge(train, on=["label", "context_length"], how="left")
    b.insert(b.columns.get_loc("top_forward_per_pass") + 1, SPLIT, [
        _split_text(launch_split(r.top_forward_per_pass, n_layers=r.n_layers, fused_projections=r.fused_projections),
                    fused_projections=r.fused_projections) for r in b.itertuples()])
    layouts = [weight_matmuls(fused_projections=fused) for fused in b["fused_projections"]]
    b["weight matmuls per pass"] = [n * len(layer) + len(outside)
                                    for n, (layer, outside) in zip(b["n_layers"], layouts)]
    for col in MODEL_SHAPE:  # beside the count they explain
        b[col] = b.pop(col)
    b["same kernel leads fwd+bwd"] = b["top_fwd_bwd_name"] == b["top_forward_name"]
    return b.reset_index(drop=True)


def _launch_counts(table: pd.DataFrame) -> str:
    """'small 72× at 256 tokens, 85× at 1024 and 4096; large 72× at 256 and 512': per size, each
    count with the contexts it occurs at, in context order."""
    parts = []
    for label, grp in table.groupby("label", sort=False):
        by_count = grp.groupby("top_forward_per_pass", sort=False)["context_length"].agg(list)
        items = [f"{n:g}× at {join_words([str(c) for c in ctxs])}" for n, ctxs in by_count.items()]
        parts.append(f"{label} " + items[0] + " tokens" + "".join(f", {i}" for i in items[1:]))
    return "; ".join(parts)


def answer_b(table: pd.DataFrame) -> str:
    """(b): the top forward kernel by family (full names in ``top_kernel_table``), its launches
    per pass for every (size, context), explained from the config where every weight matmul
    launches it once; then whether it also leads forward+backward."""
    if table.empty:
        return "No forward-only configuration ran."
    family = table["top_forward_kernel"].map(kernel_family)
    counts = family.value_counts()
    rows = table[family == counts.index[0]]
    text = (f"The top forward kernel is a {rows['top_forward_category'].iloc[0]} kernel of the `{counts.index[0]}` "
            f"family in {counts.iloc[0]} of {len(table)} configurations ({_percent_range(rows['top_forward_share'], 0)} "
            f"of forward kernel time; full names in the table)")
    if len(counts) > 1:
        text += ", elsewhere " + ", ".join(f"`{k}`" for k in counts.index[1:])
    text += f", launched per forward pass: {_launch_counts(table)}. " + _per_weight_matmul(table)
    both = table.dropna(subset=["top_fwd_bwd_name"])
    if both.empty:
        return text + " No train step ran to compare with forward+backward."
    moved = both[~both["same kernel leads fwd+bwd"]]
    text += (f" The same kernel (full name) also leads forward+backward in {int(both['same kernel leads fwd+bwd'].sum())} "
             f"of {len(both)} configurations")
    if moved.empty:
        return text + "."
    leaders = ", ".join(f"`{k}`" for k in dict.fromkeys(moved["top_fwd_bwd_kernel"].map(kernel_family)))
    layouts = moved["top_fwd_bwd_kernel"].map(kernel_layout)
    fwd_layouts = moved["top_forward_kernel"].map(kernel_layout)
    if ((moved["top_fwd_bwd_category"] == "matmul") & layouts.notna() & fwd_layouts.notna()
            & (layouts != fwd_layouts)).all():
        # the layout letters are the data: a leader that reads its operands transposed otherwise than
        # the forward's GEMM is what the backward's transposed products call for
        return text + (f"; in the {_other(len(moved))} a GEMM with another operand layout than the forward's "
                       f"`{'`/`'.join(sorted(set(fwd_layouts)))}` leads ({leaders}; the letters say which operand is "
                       f"read transposed), as the gradient products dX = dY·W and dW = dYᵀ·X need.")
    return text + f"; in the {_other(len(moved))} another kernel leads ({leaders})."


def _other(n: int) -> str:
    return "other one" if n == 1 else f"other {n}"


def _per_weight_matmul(table: pd.DataFrame) -> str:
    """What one launch per weight matmul would count per size (``top_kernel_table``'s column), and
    which configurations reach it: those run every weight matmul on the top kernel; fewer launches
    leave some matmul shapes to other kernels (cuBLAS picks a kernel per shape)."""
    sizes = table.drop_duplicates("label").set_index("label")
    split = {label: weight_matmuls(fused_projections=bool(r.fused_projections)) for label, r in sizes.iterrows()}
    names = {(tuple(n.rsplit(".", 1)[-1] for n in layer), tuple(out)) for layer, out in split.values()}
    if len(names) == 1:  # the sizes share one layout: name its matmuls once
        (layer, out), = names
        text = (f"One launch per weight matmul is layers × {len(layer)} ({', '.join(layer)}) + {len(out)} "
                f"({', '.join(out)}): ")
    else:
        text = "One launch per weight matmul is layers × weight matmuls per layer + the ones outside the layers: "
    text += ", ".join(f"{r.n_layers} × {len(split[label][0])} + {len(split[label][1])} = "
                      f"{r['weight matmuls per pass']} for {label}" for label, r in sizes.iterrows())
    need = table["weight matmuls per pass"]
    every, short = table[table["top_forward_per_pass"] == need], table[table["top_forward_per_pass"] < need]
    parts = []
    if len(every):
        parts.append(("every configuration runs" if len(every) == len(table) else
                      f"{_sizes_at(every)} run{'s' if len(every) == 1 else ''}")
                     + " every weight matmul on it")
    if len(short):
        who = ("every configuration's count falls" if len(short) == len(table) else
               "the other counts fall" if len(every) + len(short) == len(table) else
               f"the counts of {_sizes_at(short)} fall")
        parts.append(who + " short of one launch per weight matmul")
    return text + ("; " + " and ".join(parts) if parts else "") + "."


# ----------------------------------------------------------------------------- (c)


def non_matmul_table(result, *, top: int = 12) -> pd.DataFrame:
    """The largest kernels of one profile's forward pass other than matrix multiplies."""
    fwd = result.kernels(ranges="forward")
    return fwd[fwd["category"] != "matmul"].head(top).drop(columns="name").reset_index(drop=True)


def forward_category_shares(summary: pd.DataFrame) -> pd.DataFrame:
    ok = _ok(summary, "forward")
    cols = {f"fwd_share_{c}": c for c in CATEGORIES if f"fwd_share_{c}" in ok.columns}
    return ok[["label", "context_length", *cols]].rename(columns=cols).reset_index(drop=True)


def answer_c(result, label: str, shares: pd.DataFrame) -> str:
    fwd = result.kernels(ranges="forward")
    non_mm = fwd[fwd["category"] != "matmul"]
    if non_mm.empty:
        return f"For {label} every forward kernel is a matrix multiply."
    lead = non_mm.iloc[0]
    by_cat = non_mm.groupby("category")["share"].sum().sort_values(ascending=False)
    return (f"For {label}, kernels other than matrix multiplies take {non_mm['share'].sum():.1%} of forward kernel "
            f"time: by category " + ", ".join(f"{c} {v:.1%}" for c, v in by_cat.items() if v >= 0.001)
            + f". The largest is `{lead['kernel']}` ({lead['category']}, {lead['share']:.1%}, "
            f"{lead['instances_per_step']:.0f} launches per pass), followed by "
            + ", ".join(f"`{r.kernel}` ({r.share:.1%})" for r in non_mm.iloc[1:5].itertuples())
            + f". Across configurations the non-matmul share of the forward pass runs from "
            f"{_percent_range(1 - shares['matmul'])}. Each of these kernels reads and writes whole activations "
            f"(or the T×T scores) for a few FLOPs per element.")


# ----------------------------------------------------------------------------- (d)


def category_shares(summary: pd.DataFrame) -> pd.DataFrame:
    """Share of each configuration's kernel time by category (what kernels compute), and for a
    train step the share of each phase (where they ran)."""
    ok = _ok(summary)
    cats = [c for c in CATEGORIES if f"share_{c}" in ok.columns]
    phases = [f"phase_share_{p.replace(' ', '_')}" for p in PHASE_RANGES]
    out = ok[["label", "context_length", "mode"] + [f"share_{c}" for c in cats]].rename(
        columns={f"share_{c}": c for c in cats})
    for col in phases:
        out[col.removeprefix("phase_share_").replace("_", " ") + " (phase)"] = ok[col] if col in ok.columns else None
    return out.reset_index(drop=True)


# (d) a share that moves by less than this (one point) between inference and a train step is
# reported as unchanged, not as a direction: each configuration is one profile, with no repeat to
# give a spread that a smaller shift could be judged against. So the value cannot be a measured
# noise floor; one point is our cut, and the answer says so wherever it applies.
SHARE_CHANGE = 0.01


def share_changes(shares: pd.DataFrame) -> pd.DataFrame:
    """Per (size, context) that ran both ways: each category's share in a train step minus its
    share in inference (share points), and the matmul share's direction ('falls', 'rises' or
    'holds': within ``SHARE_CHANGE``)."""
    cats = [c for c in CATEGORIES if c in shares.columns]
    pair = shares.pivot_table(index=["label", "context_length"], columns="mode", values=cats, sort=False)
    if ("matmul", "forward") not in pair.columns or ("matmul", "train_step") not in pair.columns:
        return pd.DataFrame(columns=["label", "context_length", *cats, "direction"])
    pair = pair.dropna()
    out = pd.DataFrame({c: pair[(c, "train_step")] - pair[(c, "forward")] for c in cats}).reset_index()
    out["direction"] = ["falls" if d <= -SHARE_CHANGE else "rises" if d >= SHARE_CHANGE else "holds"
                        for d in out["matmul"]]
    return out


def _points(values: pd.Series, *, signed: bool = False) -> str:
    """Share changes in points: '6.7–8.7' (magnitudes, the direction said in words), or signed
    '-0.4 to -0.2'."""
    return value_range(values * 100, "{:+.1f}", signed=True) if signed else value_range(values.abs() * 100, "{:.1f}")


def _context_groups(changes: pd.DataFrame) -> list[tuple[str, list[int]]]:
    """Contexts in order, grouped while the matmul share moves the same way at every size;
    a context where the sizes disagree is its own 'mixed' group."""
    groups: list[tuple[str, list[int]]] = []
    for ctx, grp in changes.groupby("context_length", sort=True):
        way = grp["direction"].iloc[0] if grp["direction"].nunique() == 1 else "mixed"
        if groups and groups[-1][0] == way != "mixed":
            groups[-1][1].append(ctx)
        else:
            groups.append((way, [ctx]))
    return groups


def _group_phrase(way: str, contexts: list[int], changes: pd.DataFrame) -> str:
    at = f"at {join_words([str(c) for c in contexts])} tokens"
    by = ", ".join(f"{_points(changes.loc[changes['context_length'] == c, 'matmul'])} at {c}" for c in contexts)
    moved = changes.loc[changes["context_length"].isin(contexts), "matmul"]
    if way == "holds":
        return f"moves by under {SHARE_CHANGE * 100:.0f} point {at} ({_points(moved, signed=True)}; our cut for no change)"
    if way == "mixed":
        return f"goes either way {at} ({_points(moved, signed=True)} points)"
    return f"{way} {at} (by {by.replace(' at', ' points at', 1)})"


def attention_pointwise_share(forward: pd.DataFrame) -> pd.Series:
    """Share of a forward pass's kernel time spent in naive attention's ranges on kernels other
    than matmuls: the scaling and masking of the T×T scores, the softmax."""
    pointwise = sum(forward[f"{r.replace(' ', '_')}_s"] - forward[f"{r.replace(' ', '_')}_matmul_s"]
                    for r in ATTENTION_RANGES)
    return pointwise / forward["forward_kernel_s"]


def answer_d(shares: pd.DataFrame, summary: pd.DataFrame, *, device: str) -> str:
    """(d): how the matmul share moves from inference to a train step, per context length (it can
    move either way), with the category that moves most against it; then why, where the rows show
    it: the optimizer step's elementwise kernels where it falls, the forward's attention pointwise
    kernels and a more matmul-heavy backward where it rises."""
    changes = share_changes(shares)
    if changes.empty:
        return "Inference and a train step did not both run at any size and context, so there is no pair to compare."
    ok = shares[shares.set_index(["label", "context_length"]).index.isin(
        changes.set_index(["label", "context_length"]).index)]
    groups = _context_groups(changes)
    ways = {way for way, _ in groups}
    moves = ("which way the share moves depends on the context length" if len(ways - {"mixed"}) > 1 else
             "which way the share moves differs between configurations" if "mixed" in ways else
             "the share moves the same way at every context")
    text = (f"Matrix multiplies take {_percent_range(ok.loc[ok['mode'] == 'forward', 'matmul'])} of kernel time in "
            f"inference (forward only) and {_percent_range(ok.loc[ok['mode'] == 'train_step', 'matmul'])} in a full "
            f"train step; {moves}"
            f" (a range spans the sizes profiled at that context): it "
            + "; it ".join(_group_phrase(way, ctxs, changes) for way, ctxs in groups) + ".")
    reasons = [r for r in (_falls_reason(changes, groups, summary, device=device),
                           _rises_reason(changes, groups, summary)) if r]
    if not reasons:
        return text
    joined = "; ".join(reasons)
    return f"{text} {joined[0].upper()}{joined[1:]}."


def _mover(changes: pd.DataFrame) -> str:
    """The category other than matmul that moves most (mean size of its change) in these rows."""
    others = [c for c in changes.columns if c not in ("label", "context_length", "matmul", "direction")]
    return max(others, key=lambda c: changes[c].abs().mean())


def _rows_at(frame: pd.DataFrame, contexts: list[int]) -> pd.DataFrame:
    return frame[frame["context_length"].isin(contexts)]


def _falls_reason(changes, groups, summary, *, device: str) -> str:
    contexts = [c for way, ctxs in groups if way == "falls" for c in ctxs]
    mine = _rows_at(changes, contexts)
    train = _rows_at(_ok(summary, "train_step"), contexts)
    if mine.empty or _mover(mine) != "elementwise" or (mine["elementwise"] <= 0).any() \
            or train.get("phase_share_optimizer_step", pd.Series(dtype=float)).isna().all():
        return ""
    kernels = "multi-tensor `_foreach` kernels" if device == "cuda" else "per-parameter operators"
    return (f"where it falls, elementwise kernels gain {_points(mine['elementwise'])} points: a train step adds the "
            f"optimizer step, {_percent_range(train['phase_share_optimizer_step'])} of its kernel time there and "
            f"{train['optimizer_elementwise_share'].median():.0%} (median) elementwise (our AdamW's {kernels}, which "
            f"read and write every parameter, gradient and moment whatever the context)")


def _rises_reason(changes, groups, summary) -> str:
    contexts = [c for way, ctxs in groups if way == "rises" for c in ctxs]
    mine = _rows_at(changes, contexts)
    train, forward = _rows_at(_ok(summary, "train_step"), contexts), _rows_at(_ok(summary, "forward"), contexts)
    needed = {"phase_share_backward", "fwd_share_matmul", "bwd_share_matmul"}
    attention = {"forward_kernel_s", *(f"{r.replace(' ', '_')}{end}" for r in ATTENTION_RANGES for end in ("_s", "_matmul_s"))}
    if mine.empty or not needed <= set(train.columns) or not attention <= set(forward.columns):
        return ""
    backward = train["bwd_share_matmul"]  # the backward phase's own kernels (bench.profile.summarize)
    if (backward <= train["fwd_share_matmul"]).any():
        return ""
    mover = _mover(mine)
    sign = "lose" if (mine[mover] < 0).all() else "gain" if (mine[mover] > 0).all() else "move by"
    return (f"where it rises, the forward pass spends {_percent_range(attention_pointwise_share(forward))} of its "
            f"kernel time on the attention's pointwise kernels over the T×T scores (scaling, masking, softmax), "
            f"while the backward, {_percent_range(train['phase_share_backward'])} of a train step's kernel time, is "
            f"{_percent_range(backward)} matmul against the step's forward's {_percent_range(train['fwd_share_matmul'])}, "
            f"so {mover} kernels {sign} {_points(mine[mover])} points")


def plot_category_shares(shares: pd.DataFrame, *, title: str):
    """Stacked category shares per (size, context), inference beside the train step."""
    import matplotlib.pyplot as plt

    modes = [m for m in ("forward", "train_step") if m in set(shares["mode"])]
    cats = [c for c in CATEGORIES if c in shares.columns]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False, sharey=True)
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    for ax, mode in zip(axes[0], modes):
        sub = shares[shares["mode"] == mode]
        ticks = [f"{r.label} {r.context_length}" for r in sub.itertuples()]
        bottom = pd.Series(0.0, index=sub.index)
        for cat in cats:
            ax.bar(ticks, sub[cat], bottom=bottom, color=colors[cat], label=cat)
            bottom += sub[cat].fillna(0)
        ax.set_title("inference (forward only)" if mode == "forward" else "train step (fwd + bwd + AdamW)")
        ax.set_xlabel("size, context")
        ax.tick_params(axis="x", labelsize=7, rotation=90)
    axes[0][0].set_ylabel("share of kernel time")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.suptitle(title)
    fig.tight_layout()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)  # beside, not over, the bars
    return fig


# ----------------------------------------------------------------------------- (e)


def softmax_table(summary: pd.DataFrame, *, gpu: str | None = None) -> pd.DataFrame:
    """Forward pass: softmax kernel time against the two attention matmuls', and the same for FLOPs;
    the softmax's rates (its least traffic, ``systems.bench.profile.softmax_bytes``, and its FLOPs,
    over its time) and, where ``gpu`` has a named peak (``systems.measure.hardware``), their shares
    of its datasheet HBM bandwidth and fp32 rate. ``attrs``: the ``gpu`` and its ``peak`` (or None),
    which ``answer_e`` reads."""
    ok = _ok(summary, "forward")
    mm = ok["attention_scores_matmul_s"] + ok["final_matmul_matmul_s"]
    e = pd.DataFrame({
        "label": ok["label"], "context": ok["context_length"], "softmax ms": ok["softmax_s"] * MS,
        "attention matmuls ms": mm * MS, "softmax / matmul time": ok["softmax_to_matmul_time"],
        "softmax / matmul FLOPs": ok["softmax_to_matmul_flops"]})
    e["time ratio / FLOP ratio"] = e["softmax / matmul time"] / e["softmax / matmul FLOPs"]
    traffic = (ok["softmax_bytes"] if "softmax_bytes" in ok.columns else pd.Series(None, index=ok.index)).astype(float)
    # the bytes a score element costs, from the same rows (the count's element size by precision)
    e["bytes / element"] = traffic / (ok["softmax_flops"] / SOFTMAX_FLOPS_PER_ELEMENT)
    e["softmax TB/s"] = traffic / ok["softmax_s"] / 1e12
    e["softmax TFLOP/s"] = ok["softmax_flops"] / ok["softmax_s"] / 1e12
    e["matmuls TFLOP/s"] = (ok["scores_matmul_flops"] + ok["final_matmul_flops"]) / mm / 1e12
    # the matmuls' peak is their precision's (TF32's where the row allowed it; rows from before the
    # flag was recorded ran without); the softmax computes in fp32 on the CUDA cores whatever the
    # precision, so its FLOPs go against the fp32 peak
    precision = ok["precision"].tolist()
    tf32 = ok["tf32"].fillna(False).astype(bool).tolist() if "tf32" in ok.columns else [False] * len(ok)
    e["matmul peak"] = ["fp32 with TF32" if p == "fp32" and t else p for p, t in zip(precision, tf32)]
    peak = lookup_peak(gpu)
    e["of HBM peak"] = e["softmax TB/s"] / peak.hbm_tb_s if peak else float("nan")
    e["of fp32 peak"] = e["softmax TFLOP/s"] / peak.fp32_tflops if peak else float("nan")
    e["matmuls of peak"] = (e["matmuls TFLOP/s"] / [peak.tflops(p, tf32=t) for p, t in zip(precision, tf32)]
                            if peak else float("nan"))
    e = e.reset_index(drop=True)
    e.attrs.update(gpu=gpu, peak=peak)
    return e


def _roofline_text(table: pd.DataFrame) -> str:
    """What the softmax's rates say against the named peaks ``softmax_table`` found, or why the run
    cannot say."""
    gpu, peak = table.attrs.get("gpu"), table.attrs.get("peak")
    if peak is None:
        return (f" No named peak covers {gpu or 'this device'} (systems.measure.hardware), so the run cannot say "
                f"whether the softmax's memory traffic or its arithmetic bounds its time; the time per FLOP above "
                f"is what it measured.")
    counted = table.dropna(subset=["bytes / element"])
    if counted.empty:
        return (" These rows carry no count of the softmax's memory traffic (a precision without one, or rows "
                "from before the count): profile again in fp32 for its bandwidth.")
    per_element = counted["bytes / element"].max()
    # the time one score element takes at each peak: streamed in and out, and computed
    memory_s = per_element / (peak.hbm_tb_s * 1e12)
    compute_s = SOFTMAX_FLOPS_PER_ELEMENT / (peak.fp32_tflops * 1e12)
    text = (f" Its least traffic, one read of the scores and one write of the probabilities ({per_element:g} bytes "
            f"per score element), moves at {value_range(counted['softmax TB/s'], '{:.3g}')} TB/s, "
            f"{_percent_range(counted['of HBM peak'])} of the {peak.name}'s datasheet HBM bandwidth "
            f"({peak.hbm_tb_s:g} TB/s), while its arithmetic runs at {_percent_range(counted['of fp32 peak'], 2)} of "
            f"the fp32 peak ({peak.fp32_tflops:g} TFLOP/s). At those peaks an element's bytes take "
            f"{memory_s / compute_s:.3g}x as long as its {SOFTMAX_FLOPS_PER_ELEMENT} FLOPs")
    matmul_peaks = sorted(set(counted["matmul peak"]))
    matmuls = (f" The two matmuls, on the same rows, run at {_percent_range(counted['matmuls of peak'])} of the "
               f"{join_words(matmul_peaks)} peak{'s' if len(matmul_peaks) > 1 else ''}.")
    if memory_s > compute_s:
        return text + (f", so moving the scores, not computing on them, bounds the softmax's time: the "
                       f"measured time is {value_range(1 / counted['of HBM peak'], '{:.2g}')}x that traffic's "
                       f"floor." + matmuls)
    return text + (", so the arithmetic, not the traffic, bounds the softmax's time on this GPU."
                   + matmuls)


def answer_e(table: pd.DataFrame) -> str:
    if table.empty:
        return "No forward-only configuration ran."
    return (f"The softmax performs {_percent_range(table['softmax / matmul FLOPs'], 2)} of the two attention "
            f"matmuls' FLOPs (QKᵀ and PV) but takes {value_range(table['softmax / matmul time'], '{:.3g}')}× their "
            f"runtime: per FLOP it is {value_range(table['time ratio / FLOP ratio'], '{:.3g}')}× slower."
            + _roofline_text(table))


# ----------------------------------------------------------------------------- timeline


def plot_step_timeline(source, *, step: int = -1, ax=None, title: str | None = None):
    """Kernel categories over time in one step, drawn from the Chrome trace (or a ProfileResult's
    items, themselves parsed from it); phases shaded. Returns the figure."""
    import matplotlib.pyplot as plt

    if isinstance(source, (str, Path)):
        items, ranges = parse_trace(source)
        items = attribute(items, ranges)
    else:  # a systems.bench.profile.ProfileResult
        items, ranges = source.items, source.ranges
    n = int(items["step_index"].max()) + 1 if len(items) else 0
    if n == 0:
        raise ValueError("the trace has no kernels inside a 'step' range")
    k = step % n
    steps = ranges[ranges["name"] == STEP_RANGE].sort_values("ts").reset_index(drop=True)
    t0, t1 = steps.loc[k, "ts"], steps.loc[k, "end"]
    mine = items[(items["step_index"] == k) & items["on_timeline"]]
    dur = mine["wall_dur"] if "wall_dur" in mine.columns else mine["dur"]
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 3.2))
    else:
        fig = ax.figure
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    for y, cat in enumerate(CATEGORIES):
        sel = mine["category"] == cat
        bars = list(zip((mine.loc[sel, "ts"] - t0) / 1e3, dur[sel] / 1e3))
        if bars:
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors[cat], linewidth=0)
    for i, phase in enumerate(PHASE_RANGES):
        pr = ranges[(ranges["name"] == phase) & (ranges["ts"] >= t0) & (ranges["end"] <= t1 + 1e-3)]
        for r in pr.itertuples():
            ax.axvspan((r.ts - t0) / 1e3, (r.end - t0) / 1e3, color=f"C{i + 6}", alpha=0.12, lw=0,
                       label=phase)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=8)
    ax.set_yticks(range(len(CATEGORIES)), CATEGORIES)
    # GPU work launched inside the step can finish after the CPU range closes (asynchronous
    # launches): keep it in view
    end = max(t1, float((mine["ts"] + dur).max())) if len(mine) else t1
    ax.set_xlim(0, (end - t0) / 1e3)
    ax.set_xlabel("time since step start (ms)")
    what = "GPU kernels" if (mine["device"] == "cuda").any() else "CPU operators"
    ax.set_title(title or f"one step: {what} by category")
    fig.tight_layout()
    return fig
