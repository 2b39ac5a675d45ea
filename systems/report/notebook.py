"""What every notebook uses: its context (profile, handout, where outputs go), tables, figures, and
answers rendered under the anchors the report's deliverables index links to.

    ctx = nb.setup(name="01_benchmarking", profile=profile, out_dir=out_dir, handout=handout)
    nb.show(df, caption=...)                   # a table, each column formatted for reading
    nb.save_figure(fig, ctx, "phases")         # figures/01_benchmarking_phases.png
    nb.answer(ctx, "benchmarking_script", "b", text)   # an answer, recorded for the index
    nb.not_run(ctx, "nsys_profile", "e", "nsys is not installed on this machine")
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from systems.config import DEFAULT_HANDOUT, check_choice, check_handout
from systems.measure.env import environment
from systems.measure.results import ResultWriter
from systems.measure.timer import launch_pace

PROFILES = ("smoke", "full")


@dataclass
class NotebookContext:
    name: str  # e.g. "01_benchmarking"
    profile: str
    out_dir: Path
    device: str
    handout: str = DEFAULT_HANDOUT
    env: dict = field(default_factory=dict)
    answers: ResultWriter | None = None  # results/<name>_deliverables.jsonl

    @property
    def figures(self) -> Path:
        return self.out_dir / "figures"

    @property
    def results(self) -> Path:
        return self.out_dir / "results"

    def result_path(self, stem: str) -> Path:
        """results/<notebook>_<stem>.jsonl"""
        return self.results / f"{self.name}_{stem}.jsonl"

    @property
    def full(self) -> bool:
        return self.profile == "full"

    @property
    def gpu(self) -> str:
        return self.env.get("gpu") or "CPU"


def setup(*, name: str, profile: str, out_dir: str | Path, handout: str = DEFAULT_HANDOUT,
          needs_gpu_for_full: bool = True, show_env: bool = True, gpus_in_ranks: bool = False) -> NotebookContext:
    """Validate the papermill parameters, make the output folders, and show the environment.
    ``gpus_in_ranks``: the notebook runs its GPU work in rank processes it starts, so this process
    makes no CUDA context (the host's pace is measured in a child process)."""
    import torch

    check_choice("profile", profile, PROFILES)
    check_handout(str(handout))
    if profile == "full" and needs_gpu_for_full and not torch.cuda.is_available():
        raise RuntimeError("the full profile needs a CUDA GPU; run with profile='smoke' on a CPU")
    ctx = NotebookContext(name=name, profile=profile, out_dir=Path(out_dir).resolve(),
                          device="cuda" if torch.cuda.is_available() else "cpu", handout=str(handout),
                          env=environment())
    ctx.figures.mkdir(parents=True, exist_ok=True)
    ctx.results.mkdir(parents=True, exist_ok=True)
    ctx.answers = ResultWriter(ctx.result_path("deliverables"))
    if show_env:
        keys = ["gpu", "driver", "torch", "triton", "cuda", "git_commit", "date"]
        # A CPU run has no driver or CUDA version; leaving them out reads better than "None".
        # the host's pace (in a child process where the ranks own the GPUs): it bounds a sweep's
        # shortest points (a call of n launches takes at least about n times it) and differs between
        # hosts with the same GPU (docs/flash_attention_notes.md, entry 30)
        pace = launch_pace(ctx.device, in_child=gpus_in_ranks and ctx.device == "cuda")
        md(f"**Run:** profile `{profile}`, {handout} handout, on {ctx.gpu}; "
           + ", ".join(f"{k} `{ctx.env[k]}`" for k in keys[1:] if ctx.env.get(k) is not None)
           + f"; host pace {pace['median_us']:.3g} us per small op issued back to back "
             f"({pace['p10_us']:.3g}-{pace['p90_us']:.3g}, `systems.measure.timer.launch_pace`)")
    return ctx


def md(text: str) -> None:
    """Render Markdown in the notebook (and print it when not under IPython)."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def _record(ctx: NotebookContext, problem: str, part: str, status: str, reason: str | None,
            measured_by: dict | None = None) -> str:
    from systems.report.deliverables import find

    item = find(ctx.handout, problem, part)  # a misspelt problem or part fails here, in the notebook
    if ctx.answers is not None:
        row = {"notebook": ctx.name, "handout": ctx.handout, "problem": problem, "part": part,
               "anchor": item.anchor, "status": status, "reason": reason, "profile": ctx.profile}
        if measured_by is not None:
            row["measured_by"] = measured_by
        ctx.answers.write(row)
    return item.anchor


def answer(ctx: NotebookContext, problem: str, part: str = "", text: str = "", *,
           measured_by: dict | None = None) -> None:
    """Render an answer to (problem, part) of the notebook's handout, under the anchor the report's
    deliverables index links to, and record it as answered. ``measured_by``: the environment stamp
    (``env``) of the rows the answer quotes when another run measured them, which the index then
    names instead of this run's commit and machine."""
    anchor = _record(ctx, problem, part, "answered", None, measured_by)
    label = f"{problem} ({part})" if part else problem
    # a list must start on its own line to render as one
    sep = "\n\n" if text.lstrip().startswith(("- ", "* ", "1. ", "|")) else " "
    md(f'<a id="{anchor}"></a>\n\n**{label}.**{sep}{text}')


def not_run(ctx: NotebookContext, problem: str, part: str, reason: str) -> None:
    """Record (and say) that this run could not answer (problem, part), and why."""
    anchor = _record(ctx, problem, part, "not run", reason)
    label = f"{problem} ({part})" if part else problem
    md(f'<a id="{anchor}"></a>\n\n**{label}:** not answered in this run: {reason}.')


# ----------------------------------------------------------------------------- tables


def join_words(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def noise_side(timings: dict[str, tuple[float, float, float]]) -> str | None:
    """The report's one rule for "within noise". ``timings``: two named (median, p10, p90) step
    times. Returns the first name whose median lies inside the other's p10–p90 range, or None when
    neither does: then the difference of medians is larger than the steps of either spread over."""
    (a, (med_a, lo_a, hi_a)), (b, (med_b, lo_b, hi_b)) = timings.items()
    if lo_b <= med_a <= hi_b:
        return a
    if lo_a <= med_b <= hi_a:
        return b
    return None


def spread_measured(timings: dict[str, tuple[float, float, float]]) -> bool:
    """Whether every (median, p10, p90) in ``timings`` is present: ``noise_side`` reads a missing
    value as "no overlap", so a caller asks this before taking its None as a verdict."""
    return all(x is not None and x == x for spread in timings.values() for x in spread)  # x == x: not NaN


def within_noise(timings: dict[str, tuple[float, float, float]]) -> bool | None:
    """The noise rule as a verdict on two (median, p10, p90) step times: True where one median lies
    inside the other's p10-p90 range (``noise_side``), False where neither does, None where a
    spread is missing (``spread_measured``), which is no verdict at all."""
    return noise_side(timings) is not None if spread_measured(timings) else None


def step_spread(row, key: str = "step_ms") -> tuple:
    """A row's (median, p10, p90) step time as ``noise_side`` reads it: ``key``, ``key``_p10 and
    ``key``_p90 (None where the row lacks one)."""
    return row.get(key), row.get(f"{key}_p10"), row.get(f"{key}_p90")


def param_count(n: float) -> str:
    """A parameter count for prose, three significant figures, trailing zeros kept: '3.41 B',
    '2.00 B', '12.8 B', '128 M', '0.850 M'."""
    value, unit = (n / 1e9, "B") if n >= 1e9 else (n / 1e6, "M")
    decimals = max(0, 2 - math.floor(math.log10(value))) if value > 0 else 0
    return f"{value:.{decimals}f} {unit}"


def value_range(values, fmt: str, *, signed: bool = False) -> str:
    """The smallest and largest of ``values`` formatted with ``fmt``: '0.99–1.04', or one value
    when both read the same; ``signed``: '-12.0% to +40.5%' (a dash between signed numbers would
    read as a minus)."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo} to {hi}" if signed else f"{lo}–{hi}"


def faster_or_slower(ratio: float) -> str:
    """A time ratio (theirs / ours) in words that cannot be read the wrong way round:
    "1.65x faster" for 1.65, "1.25x slower" for 0.8."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def _column_formatter(values: pd.Series):
    """One format for a whole numeric column, chosen for reading: integers with thousands
    separators, ordinary magnitudes in fixed point with about three significant digits for the
    column's typical value, scientific notation only for very small magnitudes (errors, rates)."""
    finite = [float(v) for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return lambda v: "—"
    if all(float(v).is_integer() for v in finite) and max(abs(v) for v in finite) < 1e15:
        fmt = "{:,.0f}"
    else:
        nonzero = sorted(abs(v) for v in finite if v != 0)
        typical = nonzero[len(nonzero) // 2] if nonzero else 0.0
        if nonzero and nonzero[-1] < 1e-3:
            fmt = "{:.2e}"
        else:
            decimals = 0 if typical >= 100 else 1 if typical >= 10 else 2 if typical >= 1 else 3 if typical >= 0.01 else 4
            fmt = "{:,.%df}" % decimals

    def format_value(v) -> str:
        if v is None or (isinstance(v, float) and not math.isfinite(v)) or v is pd.NA:
            return "—"
        try:
            return fmt.format(v)
        except (TypeError, ValueError):
            return str(v)

    return format_value


def format_table(df: pd.DataFrame, formats: dict[str, str] | None = None) -> pd.DataFrame:
    """The table as strings, each numeric column formatted by ``_column_formatter`` (or by its
    format string in ``formats``, where a value's digits are the point), missing values (None,
    NaN) as an em dash."""
    out = pd.DataFrame(index=df.index)
    for col in df.columns:
        series = df[col]
        if formats and col in formats:
            fmt = formats[col]
            out[col] = series.map(lambda v, fmt=fmt: "—" if v is None or (isinstance(v, float) and math.isnan(v))
                                  else fmt.format(v))
        elif pd.api.types.is_bool_dtype(series):
            out[col] = series.map(lambda v: "yes" if v else "no")
        elif pd.api.types.is_numeric_dtype(series):
            out[col] = series.map(_column_formatter(series))
        else:
            out[col] = series.map(lambda v: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
    return out


def show(df: pd.DataFrame, *, caption: str | None = None, formats: dict[str, str] | None = None) -> None:
    """Display a table with each column formatted for reading (``format_table``); an empty one as a
    line saying so, not a header over no rows."""
    if df.empty:
        md(f"*{caption or 'table'}*: none.")
        return
    table = format_table(df, formats)
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            styler = table.style
            if isinstance(df.index, pd.RangeIndex):
                styler = styler.hide(axis="index")  # a 0..n row counter says nothing
            if caption:
                styler = styler.set_caption(caption)
            display(styler)
            return
    except ImportError:
        pass
    print(table.to_string())


def figure_description(fig) -> str:
    """The figure's titles and axis labels in words: its alternative text in the report."""
    parts = [fig._suptitle.get_text()] if getattr(fig, "_suptitle", None) is not None else []
    for ax in fig.get_axes():
        axis = [ax.get_title()] + [f"{name}: {label}" for name, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel()))
                                   if label]
        parts.append("; ".join(a for a in axis if a))
    return " | ".join(p for p in parts if p) or "a figure"


def save_figure(fig, ctx: NotebookContext, stem: str, *, dpi: int = 120) -> None:
    """figures/<notebook>_<stem>.png, displayed as saved (the report shows the file's pixels, with
    the figure's titles and axis labels as alternative text), then closed so it is not shown twice.

    Returns nothing, so a cell ending in this call shows the figure and no path repr.
    """
    path = ctx.figures / f"{ctx.name}_{stem}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    import matplotlib.pyplot as plt

    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None:  # in a plain Python process there is nothing to show
        from IPython.display import Image, display

        display(Image(data=path.read_bytes(), format="png", metadata={"alt": figure_description(fig)}))
    plt.close(fig)
