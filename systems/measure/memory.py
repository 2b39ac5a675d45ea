"""Memory tooling: snapshots, an offline "Active memory timeline", saved-tensor accounting, and
live-tensor tracking on a CPU.

Recording:   ``record_snapshot(path)`` (CUDA allocator history -> pickle) wraps any harness mode via
             ``run_benchmark(cfg, around_measure=lambda: record_snapshot(path), on_step=step_marker(dev))``;
             ``record_cpu_snapshot(path)`` derives the same format from ``torch.profiler`` on a CPU.
Reading:     ``build_timeline(snapshot)`` walks ``device_traces`` and ``segments``;
             ``render_timeline(snapshot, out_png)`` draws it with matplotlib (no browser) and writes
             the pytorch.org/memory_viz HTML beside it; ``largest_allocations(snapshot, k)``.
Activations: ``saved_tensor_report(block, x, positions)``; ``residual_stream_bytes``;
             ``match_allocation_size``.
CPU peaks:   ``LiveTensorTracker`` follows the storages operators create (a stand-in for
             ``max_memory_allocated`` on a machine without CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import math
import pickle
import re
import timeit
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

STEP_MARKER = "_workbook_step_marker"  # the function name the step-boundary allocation carries in its frames
PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c"}
_FREE_ACTIONS = ("free_completed", "free")  # "free" is the pre-2.1 name of a completed free


# ----------------------------------------------------------------------------- recording


@contextlib.contextmanager
def record_snapshot(path: str | Path, *, max_entries: int = 1_000_000, stacks: str = "python") -> Iterator[Path | None]:
    """Record the CUDA caching allocator's history inside the block; dump it to ``path`` on exit.

    ``stacks="python"`` keeps only Python frames: C++ frames ("all") must be symbolised when
    the snapshot is taken, which costs minutes for a large model. Allocations made by the
    autograd engine's device thread then carry no frames (that thread runs no Python), which
    ``build_timeline`` uses to recognise the backward pass. On a machine without CUDA this
    warns and records nothing.
    """
    if not torch.cuda.is_available():
        warnings.warn("record_snapshot: CUDA is not available, no memory snapshot is recorded "
                      "(record_cpu_snapshot derives one from torch.profiler instead)", stacklevel=3)
        yield None
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
    try:
        yield path
    finally:
        # dump even when the block raised (an OOM snapshot shows what filled the device)
        try:
            torch.cuda.synchronize()
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def record_cpu_snapshot(path: str | Path) -> Iterator[Path]:
    """CPU stand-in for ``record_snapshot``: run the block under ``torch.profiler`` with memory
    profiling and write its allocations as a snapshot dict in the CUDA snapshot's format."""
    from torch.cuda._memory_viz import _profile_to_snapshot
    from torch.profiler import ProfilerActivity, profile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)
    with prof:
        yield path
    snapshot = _profile_to_snapshot(prof)
    with path.open("wb") as f:
        pickle.dump(snapshot, f)


def snapshot_recorder(path: str | Path, device: str | torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """An ``around_measure`` for the harness: the CUDA allocator history, or the CPU profiler's."""
    kind = torch.device(device).type
    return lambda: record_snapshot(path) if kind == "cuda" else record_cpu_snapshot(path)


def step_marker(device: str | torch.device) -> Callable[[int], None]:
    """An ``on_step`` for the harness: a tiny allocation whose frames name ``STEP_MARKER``, so the
    step boundaries can be found in the snapshot afterwards."""
    dev = torch.device(device)

    def _workbook_step_marker(i: int) -> None:
        marker = torch.zeros(8, device=dev)
        del marker

    return _workbook_step_marker


def load_snapshot(snapshot: dict | str | Path) -> dict:
    if isinstance(snapshot, dict):
        return snapshot
    with Path(snapshot).open("rb") as f:
        return pickle.load(f)


# ----------------------------------------------------------------------------- frames

_PROFILER_FRAME = re.compile(r"^(?P<file>.*\.py)\((?P<line>\d+)\): (?P<name>.*)$")
_LIBRARY_FILE = re.compile(r"(^|/)(torch|site-packages|dist-packages|IPython|ipykernel|papermill)/"
                           r"|/lib/python3\.\d+/|^<")


def _frame(f: dict) -> tuple[str, int, str]:
    """(filename, line, function) of a frame; the profiler-derived snapshot packs all three into name."""
    filename, line, name = f.get("filename", ""), f.get("line", 0), f.get("name", "")
    if filename in ("none", "") and (m := _PROFILER_FRAME.match(name)):
        return m["file"], int(m["line"]), m["name"]
    return filename, line, name


def user_frames(frames: list[dict]) -> list[str]:
    """``file:line function`` for the frames in user code (Python files outside torch, the
    standard library and site-packages), innermost first."""
    out = []
    for f in frames or []:
        filename, line, name = _frame(f)
        # this module's own frames (tracker, markers, checkpoint runners) are tooling, not the model
        if filename.endswith(".py") and not _LIBRARY_FILE.search(filename) and not filename.endswith("systems/measure/memory.py"):
            parts = Path(filename).parts
            short = "/".join(parts[-2:]) if len(parts) >= 2 else filename
            out.append(f"{short}:{line} {name}")
    return out


def classify_frames(frames: list[dict], *, frameless: str | None = None) -> str | None:
    """Which phase of a train step an allocation belongs to, from its stack.

    ``frameless`` is the answer for an allocation with no frames at all: under
    ``stacks="python"`` those come from the autograd engine's device thread, i.e. the backward.
    """
    if not frames:
        return frameless
    parsed = [_frame(f) for f in frames]
    names = {name for _, _, name in parsed}
    if STEP_MARKER in names:
        return "marker"
    if any(name in ("backward", "_engine_run_backward", "run_backward") for _, _, name in parsed):
        return "backward"
    if any("checkpoint" in file and name in ("unpack_hook", "recompute_fn") for file, _, name in parsed):
        return "backward"  # recomputation inside the backward of a checkpointed region
    if any(name == "step" and "optim" in file for file, _, name in parsed):
        return "optimizer"
    if any(name in ("forward", "cross_entropy") for _, _, name in parsed):
        return "forward"
    return None


# ----------------------------------------------------------------------------- timeline


@dataclass
class Allocation:
    addr: int
    size: int
    start: int  # timeline index at which it is live (0: alive before recording began)
    end: int | None  # index at which it is freed; None: still alive at the end
    frames: list = field(default_factory=list)
    phase: str | None = None
    preexisting: bool = False


@dataclass
class PhaseSpan:
    name: str
    start: int
    end: int
    peak_bytes: int


@dataclass
class Timeline:
    x: np.ndarray  # 0 (state before the first event), 1..n (after each alloc / free event)
    total: np.ndarray  # live bytes at each x
    allocations: list[Allocation]
    phases: list[PhaseSpan]
    steps: list[int]  # x of each step-boundary marker
    device: int

    @property
    def peak_bytes(self) -> int:
        return int(self.total.max()) if len(self.total) else 0

    @property
    def peak_index(self) -> int:
        return int(self.total.argmax()) if len(self.total) else 0

    @property
    def baseline_bytes(self) -> int:
        return int(self.total[0]) if len(self.total) else 0

    def phase_peaks(self) -> dict[str, int]:
        """Highest live bytes seen in each phase (over all its spans)."""
        out: dict[str, int] = {}
        for p in self.phases:
            out[p.name] = max(out.get(p.name, 0), p.peak_bytes)
        return out


def _pick_device(snapshot: dict, device: int | None) -> int:
    traces = snapshot.get("device_traces", [])
    if device is not None:
        if not 0 <= device < len(traces):
            raise ValueError(f"device {device} not in the snapshot, which has {len(traces)} device traces")
        return device
    if not traces or not any(traces):
        raise ValueError("the snapshot has no device_traces events: was history recorded "
                         "(torch.cuda.memory._record_memory_history) while the code ran?")
    return max(range(len(traces)), key=lambda i: len(traces[i]))


def _live_segment_blocks(snapshot: dict, device: int) -> Iterator[tuple[int, int, list]]:
    """(address, size, frames) of every block allocated when the snapshot was taken."""
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg.get("address") or 0
        for b in seg.get("blocks", []):
            b_addr = b.get("address", addr)
            if str(b.get("state", "")).startswith("active"):
                yield b_addr, b.get("requested_size", b["size"]), b.get("frames", [])
            addr = b_addr + b["size"]


def build_timeline(snapshot: dict | str | Path, *, device: int | None = None) -> Timeline:
    """Live allocations over the recorded events, the way memory_viz's "Active Memory Timeline"
    counts them: an allocation lives from its ``alloc`` to its ``free_completed``. A free with no
    alloc before it, and a block still allocated at the end that the trace never allocated, were
    alive before recording began."""
    snapshot = load_snapshot(snapshot)
    dev = _pick_device(snapshot, device)
    events = snapshot["device_traces"][dev]
    has_completed = any(e["action"] in _FREE_ACTIONS for e in events)
    free_actions = _FREE_ACTIONS if has_completed else ("free_requested",)

    live: dict[int, Allocation] = {}
    allocs: list[Allocation] = []
    deltas: list[int] = []
    labels: list[str | None] = []  # phase of each x >= 1 (alloc events only; frees inherit)
    steps: list[int] = []
    for e in events:
        action = e["action"]
        if action == "alloc":
            x = len(deltas) + 1
            # frameless allocations (the autograd engine's device thread under stacks="python", or
            # ops the profiler saw without a Python caller) take the phase of what came before
            phase = classify_frames(e.get("frames", []))
            a = Allocation(e["addr"], e["size"], x, None, e.get("frames", []), phase)
            live[e["addr"]] = a
            allocs.append(a)
            deltas.append(e["size"])
            if phase == "marker":
                steps.append(x)
                phase = None
            labels.append(phase)
        elif action in free_actions:
            x = len(deltas) + 1
            a = live.pop(e["addr"], None)
            if a is None:  # allocated before recording (or before the ring buffer's window)
                a = Allocation(e["addr"], e["size"], 0, x, e.get("frames", []), None, preexisting=True)
                allocs.append(a)
            a.end = x
            deltas.append(-a.size)
            labels.append(None)
    baseline = sum(a.size for a in allocs if a.preexisting)
    for addr, size, frames in _live_segment_blocks(snapshot, dev):
        if addr not in live:
            allocs.append(Allocation(addr, size, 0, None, frames, None, preexisting=True))
            baseline += size
    total = np.concatenate([[baseline], baseline + np.cumsum(np.asarray(deltas, dtype=np.int64))]).astype(np.int64)
    x = np.arange(len(total))

    # phases: forward-fill the labels (frees and unlabelled allocs belong to the phase around them)
    filled, current = [], None
    for lab in labels:
        current = lab or current
        filled.append(current)
    for a in allocs:
        if a.phase is None and a.start > 0 and a.start - 1 < len(filled):
            a.phase = filled[a.start - 1]
    phases: list[PhaseSpan] = []
    for i, lab in enumerate(filled, start=1):
        if lab is None:
            continue
        if phases and phases[-1].name == lab and phases[-1].end == i - 1:
            phases[-1].end = i
        else:
            phases.append(PhaseSpan(lab, i, i, 0))
    for p in phases:
        p.peak_bytes = int(total[p.start:p.end + 1].max())
    return Timeline(x=x, total=total, allocations=allocs, phases=phases, steps=steps, device=dev)


def _unit(nbytes: float) -> tuple[float, str]:
    return (2**30, "GiB") if nbytes >= 2**30 else (2**20, "MiB") if nbytes >= 2**20 else (2**10, "KiB")


def render_timeline(snapshot: dict | str | Path, out_png: str | Path, *, title: str = "Active memory timeline",
                    device: int | None = None, top_k: int = 40, html: bool = True, show_phases: bool = True,
                    figsize: tuple[float, float] = (11, 4.5)) -> Timeline:
    """Draw the live allocations over time as stacked bands, the ``top_k`` largest coloured and
    the rest summed into one grey band, with the phases shaded and step boundaries dashed. Writes
    ``out_png`` and (``html=True``) the memory_viz page beside it (same stem, .html)."""
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    for i, a in enumerate(big):
        top = bottom + sizes[i]
        ax.fill_between(tl.x, bottom / scale, top / scale, where=sizes[i] > 0, step="post",
                        color=cmap(i % 20), lw=0)
        bottom = top
    ax.plot(tl.x, tl.total / scale, drawstyle="steps-post", color="black", lw=0.6)
    if show_phases:
        seen = set()
        for p in tl.phases:
            color = PHASE_COLORS.get(p.name, PHASE_COLORS["other"])
            ax.axvspan(p.start - 0.5, p.end + 0.5, color=color, alpha=0.12, lw=0,
                       label=None if p.name in seen else f"{p.name} (from frames)")
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


def largest_allocations(snapshot: dict | str | Path, k: int = 10, *, device: int | None = None):
    """The ``k`` largest allocations, grouped by (size, allocating user-code line), as a DataFrame:
    size, how many times it was allocated, phase, the innermost user frame and the user stack."""
    import pandas as pd

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    tl = build_timeline(snapshot, device=device)
    groups: dict[tuple, dict] = {}
    for a in tl.allocations:
        frames = user_frames(a.frames)
        source = frames[0] if frames else ("(allocated before recording)" if a.preexisting
                                           else "(no user frame: autograd engine thread)")
        key = (a.size, source)
        g = groups.setdefault(key, {"size_bytes": a.size, "count": 0, "phase": a.phase, "source": source,
                                    "stack": " <- ".join(frames[:4])})
        g["count"] += 1
    rows = sorted(groups.values(), key=lambda g: (-g["size_bytes"], -g["count"]))[:k]
    df = pd.DataFrame(rows, columns=["size_bytes", "count", "phase", "source", "stack"])
    df.insert(1, "size_mib", df["size_bytes"] / 2**20)
    return df


# ----------------------------------------------------------------------------- activations


def residual_stream_bytes(*, batch_size: int, context_length: int, d_model: int,
                          dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one residual-stream activation (batch, context, d_model)."""
    return batch_size * context_length * d_model * torch.empty((), dtype=dtype).element_size()


def match_allocation_size(snapshot: dict | str | Path, nbytes: int, *, device: int | None = None) -> dict:
    """How many allocations in the snapshot have exactly ``nbytes`` (the caching allocator rounds
    requests up to a multiple of 512 bytes, so that rounding is allowed), by phase and source."""
    rounded = -(-nbytes // 512) * 512
    tl = build_timeline(snapshot, device=device)
    hits = [a for a in tl.allocations if a.size in (nbytes, rounded)]
    sources = Counter((user_frames(a.frames) or ["(no user frame)"])[0] for a in hits)
    return {"bytes": nbytes, "mib": nbytes / 2**20, "n_matches": len(hits),
            "by_phase": dict(Counter(a.phase or "unknown" for a in hits)),
            "top_sources": sources.most_common(3)}


@dataclass
class SavedTensorReport:
    total_bytes: int  # unique storages saved for backward, parameters excluded
    n_saved: int  # pack calls
    n_storages: int
    by_op: "object"  # DataFrame: op, bytes, mib, share, n_tensors
    param_bytes_excluded: int
    grad_bytes: int  # measured: parameter gradients after one backward
    expected_grad_bytes: int  # closed form: parameters x element size

    @property
    def total_mib(self) -> float:
        return self.total_bytes / 2**20


class _Packed:
    __slots__ = ("tensor", "owner")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.owner = tensor, None


def _graph_nodes(root) -> list:
    seen, order, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return order


def saved_tensor_report(block: nn.Module, x: torch.Tensor, *args, autocast_dtype: torch.dtype | None = None,
                        top: int = 5) -> SavedTensorReport:
    """What one forward of ``block`` keeps for its backward, via ``saved_tensors_hooks``.

    Every pack call is recorded; walking the autograd graph afterwards and reading each node's
    ``_saved_*`` attributes calls the unpack hook, which tells which node (grad_fn) owns each
    saved tensor. Storages are counted once (q, k and v projections save the same input) and
    parameters are left out (they are not activation memory).
    """
    import pandas as pd

    packed: list[_Packed] = []
    owner: list[str | None] = [None]

    def pack(t: torch.Tensor) -> _Packed:
        p = _Packed(t)
        packed.append(p)
        return p

    def unpack(p: _Packed) -> torch.Tensor:
        if owner[0] is not None and p.owner is None:
            p.owner = owner[0]
        return p.tensor

    x = x.detach().requires_grad_(x.is_floating_point())
    block.zero_grad(set_to_none=True)
    autocast = (torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype
                else contextlib.nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), autocast:
        out = block(x, *args)
    for node in _graph_nodes(out.grad_fn):
        owner[0] = node.name()
        for attr in dir(node):
            if attr.startswith("_saved_"):
                with contextlib.suppress(Exception):  # some saved values cannot be read back; they are not tensors we need
                    getattr(node, attr)
    owner[0] = None

    param_ptrs = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    storages: dict[int, tuple[int, str]] = {}
    param_bytes = 0
    counts: Counter = Counter()
    for p in packed:
        st = p.tensor.untyped_storage()
        ptr = st.data_ptr()
        op = p.owner or "unattributed"
        counts[op] += 1
        if ptr in param_ptrs:
            param_bytes += st.nbytes() if ptr not in storages else 0
            storages.setdefault(ptr, (0, "parameter"))
            continue
        storages.setdefault(ptr, (st.nbytes(), op))  # the first op to save a storage is charged for it
    by_op: Counter = Counter()
    for nbytes, op in storages.values():
        if op != "parameter":
            by_op[op] += nbytes
    total = sum(by_op.values())
    rows = [{"op": op, "bytes": b, "mib": b / 2**20, "share": b / total if total else 0.0, "n_tensors": counts[op]}
            for op, b in by_op.most_common(top)]
    df = pd.DataFrame(rows, columns=["op", "bytes", "mib", "share", "n_tensors"])

    out.backward(torch.ones_like(out))
    grad_bytes = sum(p.grad.nbytes for p in block.parameters() if p.grad is not None)
    expected = sum(p.numel() * p.element_size() for p in block.parameters() if p.requires_grad)
    block.zero_grad(set_to_none=True)
    return SavedTensorReport(total_bytes=total, n_saved=len(packed), n_storages=len(storages), by_op=df,
                             param_bytes_excluded=param_bytes, grad_bytes=grad_bytes, expected_grad_bytes=expected)


def block_grad_bytes_expected(d_model: int, d_ff: int, *, dtype: torch.dtype = torch.float32) -> int:
    """Gradient bytes of one TransformerBlock: one per parameter (4 d^2 attention + 3 d d_ff SwiGLU + 2 d norms)."""
    return (4 * d_model * d_model + 3 * d_model * d_ff + 2 * d_model) * torch.empty((), dtype=dtype).element_size()


class LiveTensorTracker:
    """CPU stand-in for ``max_memory_allocated``: inside ``with tracker:`` every tensor storage that
    an operator creates is followed (through a weak reference to the C++ storage) until it dies,
    and the highest total is kept. Counts only storages created inside the block, between
    operators; a TorchDispatchMode is far cheaper than the profiler's memory analysis."""

    def __init__(self):
        self.peak_bytes = 0
        self.current_bytes = 0
        self._live: dict[int, tuple] = {}
        self._mode = None

    def _observe(self, out) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        new = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st._cdata not in self._live:
                    new.append(st)
        if not new:  # the total only rises when a storage appears (in-place ops, views: nothing to do)
            return
        for k in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            # before adding: a new storage may reuse a dead one's address
            self.current_bytes -= self._live.pop(k)[1]
        for st in new:
            if st._cdata not in self._live:
                self._live[st._cdata] = (StorageWeakRef(st), st.nbytes())
                self.current_bytes += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __enter__(self) -> "LiveTensorTracker":
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._observe(out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
