"""Small helpers the notebooks share: where outputs go, figures, tables and rendered answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from systems.measure.env import environment

PROFILES = ("smoke", "full")


@dataclass
class NotebookContext:
    name: str  # e.g. "01_benchmarking"
    profile: str
    out_dir: Path
    device: str
    env: dict = field(default_factory=dict)

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


def setup(*, name: str, profile: str, out_dir: str | Path, needs_gpu_for_full: bool = True,
          show_env: bool = True) -> NotebookContext:
    """Validate the papermill parameters, make the output folders, and show the environment."""
    import torch

    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    if profile == "full" and needs_gpu_for_full and not torch.cuda.is_available():
        raise RuntimeError("the full profile needs a CUDA GPU; run with profile='smoke' on a CPU")
    ctx = NotebookContext(name=name, profile=profile, out_dir=Path(out_dir).resolve(),
                          device="cuda" if torch.cuda.is_available() else "cpu", env=environment())
    ctx.figures.mkdir(parents=True, exist_ok=True)
    ctx.results.mkdir(parents=True, exist_ok=True)
    if show_env:
        keys = ["gpu", "driver", "torch", "triton", "cuda", "git_commit", "date"]
        md(f"**Run:** profile `{profile}` on {ctx.gpu}; "
           + ", ".join(f"{k} `{ctx.env.get(k)}`" for k in keys[1:]))
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


def show(df: pd.DataFrame, *, caption: str | None = None, floatfmt: str = "{:,.3g}") -> None:
    """Display a table with readable float formatting."""
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None:
            styler = df.style.format(floatfmt, subset=df.select_dtypes("number").columns, na_rep="—")
            if isinstance(df.index, pd.RangeIndex):
                styler = styler.hide(axis="index")  # a 0..n row counter says nothing
            if caption:
                styler = styler.set_caption(caption)
            display(styler)
            return
    except ImportError:
        pass
    print(df.to_string())


def save_figure(fig, ctx: NotebookContext, stem: str, *, dpi: int = 120) -> None:
    """figures/<notebook>_<stem>.png; the figure stays displayed inline.

    Returns nothing, so a cell ending in this call shows the figure and no path repr.
    """
    fig.savefig(ctx.figures / f"{ctx.name}_{stem}.png", dpi=dpi, bbox_inches="tight")


def fmt_ms(seconds: float | None) -> str:
    return "—" if seconds is None or seconds != seconds else f"{seconds * 1e3:,.1f} ms"
