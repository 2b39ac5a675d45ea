"""Memory tooling: snapshots, timelines built from them, saved-tensor accounting, and allocated
bytes read the same way on a GPU and a CPU.

Recording:   ``record_snapshot(path)`` (CUDA allocator history -> pickle) wraps any harness mode via
             ``run_benchmark(cfg, around_measure=lambda: record_snapshot(path), on_step=step_marker(dev))``;
             ``record_cpu_snapshot(path)`` derives the same format from ``torch.profiler`` on a CPU.
Reading:     ``build_timeline(snapshot)`` walks ``device_traces`` and ``segments`` (phases from the
             frames, step markers; ``Timeline.block_total``: the same curve in the allocator's
             blocks); ``largest_allocations(snapshot, k)``; ``match_allocation_size``.
             Drawing a timeline is report code (``systems.report.memory.render_timeline``).
Saved:       ``saved_tensors(fn, *args)``: every tensor one call keeps for its backward, the op that
             keeps it, bytes per storage (the one counter of saved tensors); ``saved_tensor_report``
             (one block) and ``backward_memory`` (gradients measured from allocator changes).
Allocated:   ``MemoryProbe(device)``: the CUDA allocator's counters, or on a CPU a
             ``LiveTensorTracker`` (storages operators create); ``ProbeMarks``: ``Marks`` with
             per-phase peaks on both devices.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn

from systems.measure.timer import Marks

STEP_MARKER = "_workbook_step_marker"  # the function name the step-boundary allocation carries in its frames
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
    # the allocator's block holding it, where the snapshot shows one: only blocks still allocated
    # when it was taken (``segments``); the history (``device_traces``) records each request's size
    block_size: int | None = None

    @property
    def block_bytes(self) -> int:
        """Its block as far as the snapshot tells: the block shown, else the request rounded up to the
        512-byte multiple that is the least block the CUDA caching allocator hands out."""
        return self.block_size if self.block_size is not None else allocator_bytes(self.size, "cuda")


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

    def block_total(self) -> np.ndarray:
        """``total`` with each allocation counted as its block (``Allocation.block_bytes``), as
        ``torch.cuda.max_memory_allocated`` counts it: a lower bound of that count, since a block
        freed before the snapshot was taken may have been larger than its rounded request. Meant for
        a CUDA snapshot; a CPU one (the profiler's) records exact storages, which nothing rounds."""
        extra = np.zeros(len(self.total) + 1, dtype=np.int64)  # what blocks add, from each one's start to its end
        for a in self.allocations:
            extra[a.start] += a.block_bytes - a.size
            extra[a.end if a.end is not None else len(self.total)] -= a.block_bytes - a.size
        return self.total + np.cumsum(extra)[:-1]

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


def _live_segment_blocks(snapshot: dict, device: int) -> Iterator[tuple[int, int, int, list]]:
    """(address, requested size, block size, frames) of every block allocated when the snapshot was taken."""
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg.get("address") or 0
        for b in seg.get("blocks", []):
            b_addr = b.get("address", addr)
            if str(b.get("state", "")).startswith("active"):
                yield b_addr, b.get("requested_size", b["size"]), b["size"], b.get("frames", [])
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
    for addr, size, block, frames in _live_segment_blocks(snapshot, dev):
        if addr in live:
            live[addr].block_size = block
        else:
            allocs.append(Allocation(addr, size, 0, None, frames, None, preexisting=True, block_size=block))
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



# ----------------------------------------------------------------------------- allocated bytes


class LiveTensorTracker:
    """CPU stand-in for ``memory_allocated`` / ``max_memory_allocated``: inside ``with tracker:``
    every tensor storage that an operator creates is followed (through a weak reference to the C++
    storage) until it dies, and the highest total is kept. Counts only storages created inside the
    block: an operator's output that shares an input's storage (a view, an in-place op) is not new.
    A TorchDispatchMode is far cheaper than the profiler's memory analysis."""

    def __init__(self):
        self.peak_bytes = 0
        self.current_bytes = 0
        self._live: dict[int, tuple] = {}
        self._mode = None

    def _prune(self) -> None:
        for k in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current_bytes -= self._live.pop(k)[1]

    def _observe(self, out, args=()) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        inputs = {t.untyped_storage()._cdata for t in tree_leaves(args)
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        new = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st._cdata not in self._live and st._cdata not in inputs:
                    new.append(st)
        if not new:  # the total only rises when a storage appears
            return
        self._prune()  # before adding: a new storage may reuse a dead one's address
        for st in new:
            if st._cdata not in self._live:
                self._live[st._cdata] = (StorageWeakRef(st), st.nbytes())
                self.current_bytes += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def live_bytes(self) -> int:
        """Bytes of the storages created inside the block that are still alive."""
        self._prune()
        return self.current_bytes

    def take_peak(self) -> int:
        """The high-water mark since the last call (or the start), then start a new one from now."""
        peak = self.peak_bytes
        self.peak_bytes = self.live_bytes()
        return peak

    def __enter__(self) -> "LiveTensorTracker":
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._observe(out, (args, kwargs))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None


class MemoryProbe:
    """Bytes allocated now and the high-water mark, the same way on both devices: on CUDA the
    caching allocator's counters (absolute: everything the process holds), on a CPU a
    ``LiveTensorTracker`` entered with the probe (relative: only storages created inside the
    ``with`` block). Read differences between two points, which mean the same on both.

        with MemoryProbe(device) as probe:
            before = probe.allocated(); out = f(x); grown = probe.allocated() - before
    """

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._tracker: LiveTensorTracker | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> "MemoryProbe":
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tracker = LiveTensorTracker().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self._tracker = None

    def allocated(self) -> int:
        # the allocator counts on the host as work is queued: no synchronisation needed
        return torch.cuda.memory_allocated(self.device) if self.cuda else self._tracker.live_bytes()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else self._tracker.peak_bytes

    def take_peak(self) -> int:
        """The high-water mark since the last reset, then a new one starts from what is allocated now."""
        if not self.cuda:
            return self._tracker.take_peak()
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


class ProbeMarks(Marks):
    """``Marks`` whose memory readings work on both devices: on CUDA ``Marks``' own allocator
    tracking, on a CPU the probe's tracker. ``peak_bytes(name)`` is the high-water mark between
    the previous mark and ``name``, ``allocated_bytes(name)`` what was allocated at ``name``."""

    def __init__(self, probe: MemoryProbe, *, clock: str = "auto"):
        super().__init__(probe.device, clock=clock, track_memory=True)
        self.probe = probe

    def mark(self, name: str) -> None:
        super().mark(name)
        if not self.track_memory:  # a CPU: Marks tracks CUDA memory only
            self.allocated[name] = self.probe.allocated()
            self.peaks[name] = self.probe.take_peak()


def allocator_bytes(nbytes: int, device: str | torch.device) -> int:
    """What an allocation of ``nbytes`` adds to ``memory_allocated``: the CUDA caching allocator
    hands out blocks in multiples of 512 bytes; a CPU tracker counts the storage itself."""
    return -(-nbytes // 512) * 512 if torch.device(device).type == "cuda" else nbytes


# ----------------------------------------------------------------------------- saved tensors

SAVED_KINDS = ("activation", "parameter", "excluded")


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd packed for backward."""

    op: str  # the backward node that keeps it (read back through its ``_saved_*`` attributes)
    storage: int  # the storage's address: several views of one storage are one allocation
    nbytes: int  # the storage's bytes
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # activation | parameter (the module's own weights) | excluded (inputs the caller named)


@dataclass
class SavedTensors:
    """Every pack call of one forward, in order. Bytes count each storage once, charged to the
    first op that saved it (q, k and v projections save the same input; softmax and P @ V the
    same probabilities)."""

    tensors: list[SavedTensor]

    def unique(self, kind: str | None = "activation") -> dict[int, SavedTensor]:
        """The first pack of each storage (of one kind; ``None``: every kind)."""
        if kind is not None and kind not in SAVED_KINDS:
            raise ValueError(f"kind must be one of {SAVED_KINDS} or None, got {kind!r}")
        first: dict[int, SavedTensor] = {}
        for t in self.tensors:
            first.setdefault(t.storage, t)
        return {s: t for s, t in first.items() if kind is None or t.kind == kind}

    def total_bytes(self, kind: str = "activation") -> int:
        return sum(t.nbytes for t in self.unique(kind).values())

    @property
    def n_saved(self) -> int:
        return len(self.tensors)

    @property
    def n_storages(self) -> int:
        return len(self.unique(None))

    def by_op(self, top: int | None = None):
        """Activation bytes per saving op, largest first: op, bytes, mib, share, n_tensors (pack calls)."""
        import pandas as pd

        charged: Counter = Counter()
        for t in self.unique("activation").values():
            charged[t.op] += t.nbytes
        calls = Counter(t.op for t in self.tensors)
        total = sum(charged.values())
        rows = [{"op": op, "bytes": b, "mib": b / 2**20, "share": b / total if total else 0.0, "n_tensors": calls[op]}
                for op, b in charged.most_common(top)]
        return pd.DataFrame(rows, columns=["op", "bytes", "mib", "share", "n_tensors"])


class _Packed:
    __slots__ = ("tensor", "owner")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.owner = tensor, None


def _graph_nodes(roots: list) -> list:
    seen, order, stack = set(), [], list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return order


def saved_tensors(fn: Callable, *args, exclude: Iterable[torch.Tensor] = (), autocast_dtype: torch.dtype | None = None,
                  **kwargs) -> SavedTensors:
    """What one call ``fn(*args, **kwargs)`` keeps for its backward, via ``saved_tensors_hooks``.

    Every pack call is recorded; walking the autograd graph afterwards and reading each node's
    ``_saved_*`` attributes calls the unpack hook, which tells which node owns each saved tensor.
    A module's parameters and buffers are kind "parameter" (not activation memory); the tensors
    in ``exclude`` (e.g. inputs that exist anyway) are kind "excluded". The output is dropped.

    The hook packs a detached alias (same storage, no ``grad_fn``): packing the tensor itself
    would make an op's saved output (softmax saves its result) refer to the node that saves it,
    a cycle through C++ that Python's garbage collector cannot see, and every call would leak
    that output and the inputs its views keep alive.
    """
    packed: list[_Packed] = []
    owner: list[str | None] = [None]

    def pack(t: torch.Tensor) -> _Packed:
        p = _Packed(t.detach())
        packed.append(p)
        return p

    def unpack(p: _Packed) -> torch.Tensor:
        if owner[0] is not None and p.owner is None:
            p.owner = owner[0]
        return p.tensor

    params = [*fn.parameters(), *fn.buffers()] if isinstance(fn, nn.Module) else []
    param_ptrs = {t.untyped_storage().data_ptr() for t in params}
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), autocast:
        out = fn(*args, **kwargs)
    from torch.utils._pytree import tree_leaves

    roots = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in _graph_nodes(roots):
        owner[0] = node.name()
        for attr in dir(node):
            if attr.startswith("_saved_"):
                with contextlib.suppress(Exception):  # some saved values cannot be read back; they are not tensors we need
                    getattr(node, attr)
    owner[0] = None
    del out, roots
    tensors = []
    for p in packed:
        t, ptr = p.tensor, p.tensor.untyped_storage().data_ptr()
        kind = "parameter" if ptr in param_ptrs else "excluded" if ptr in excluded else "activation"
        tensors.append(SavedTensor(op=p.owner or "unattributed", storage=ptr, nbytes=t.untyped_storage().nbytes(),
                                   shape=tuple(t.shape), dtype=t.dtype, kind=kind))
    return SavedTensors(tensors)


@dataclass(frozen=True)
class BackwardMemory:
    """Allocator readings around one forward and backward of a module whose input needs no
    gradient, so what the backward leaves behind is the parameters' gradients alone."""

    forward_bytes: int  # allocated by the forward, alive when the backward starts (saved tensors + output)
    output_bytes: int  # the forward's output (alive until dropped after the backward)
    backward_change_bytes: int  # across the backward: gradients made minus saved tensors freed
    grad_bytes: int  # left allocated once the output is dropped: the gradients, measured
    expected_grad_bytes: int  # the parameters' bytes (one gradient per parameter), as the allocator counts them


def backward_memory(module: nn.Module, x: torch.Tensor, *args, autocast_dtype: torch.dtype | None = None) -> BackwardMemory:
    """Measure ``BackwardMemory`` for ``module(x, *args)`` with a ``MemoryProbe``: gradients are
    what remains of the backward's allocations, not a count of ``p.grad`` sizes."""
    params = [p for p in module.parameters() if p.requires_grad]
    x = x.detach()
    autocast = (torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype
                else contextlib.nullcontext())
    # one unmeasured pass first: the backward's first matmul on the autograd engine's thread gives
    # that thread its cuBLAS handle and workspace, which would otherwise count as gradients
    with autocast:
        out = module(x, *args)
    out.backward(torch.ones_like(out))
    del out
    module.zero_grad(set_to_none=True)
    with MemoryProbe(x.device) as probe:
        start = probe.allocated()
        with autocast:
            out = module(x, *args)
        after_forward = probe.allocated()
        grad_out = torch.ones_like(out)
        before_backward = probe.allocated()
        out.backward(grad_out)
        after_backward = probe.allocated()
        output_bytes = allocator_bytes(out.untyped_storage().nbytes(), x.device)
        del out, grad_out
        grads = probe.allocated() - start
    module.zero_grad(set_to_none=True)
    return BackwardMemory(forward_bytes=after_forward - start, output_bytes=output_bytes,
                          backward_change_bytes=after_backward - before_backward, grad_bytes=grads,
                          expected_grad_bytes=sum(allocator_bytes(p.numel() * p.element_size(), x.device)
                                                  for p in params))


@dataclass
class SavedTensorReport:
    """What one block keeps for its backward, and the memory its backward leaves: the gradients."""

    total_bytes: int  # unique storages saved for backward, parameters excluded
    n_saved: int  # pack calls
    n_storages: int
    by_op: "object"  # DataFrame: op, bytes, mib, share, n_tensors
    param_bytes_excluded: int
    grad_bytes: int  # measured: allocated by the backward and left once the output is dropped
    expected_grad_bytes: int  # each parameter's gradient as the allocator counts it (BackwardMemory)
    backward: BackwardMemory


def saved_tensor_report(block: nn.Module, x: torch.Tensor, *args, autocast_dtype: torch.dtype | None = None,
                        top: int = 5) -> SavedTensorReport:
    """``saved_tensors`` of one forward of ``block`` (input included, as the handout's hook
    counts it; parameters left out), its top ``top`` ops, and ``backward_memory``."""
    x = x.detach().requires_grad_(x.is_floating_point())
    block.zero_grad(set_to_none=True)
    saved = saved_tensors(block, x, *args, autocast_dtype=autocast_dtype)
    back = backward_memory(block, x, *args, autocast_dtype=autocast_dtype)
    return SavedTensorReport(total_bytes=saved.total_bytes(), n_saved=saved.n_saved, n_storages=saved.n_storages,
                             by_op=saved.by_op(top), param_bytes_excluded=saved.total_bytes("parameter"),
                             grad_bytes=back.grad_bytes, expected_grad_bytes=back.expected_grad_bytes,
                             backward=back)


def block_grad_bytes_expected(d_model: int, d_ff: int, *, dtype: torch.dtype = torch.float32) -> int:
    """Gradient bytes of one TransformerBlock: one per parameter (4 d^2 attention + 3 d d_ff SwiGLU + 2 d norms)."""
    return (4 * d_model * d_model + 3 * d_model * d_ff + 2 * d_model) * torch.empty((), dtype=dtype).element_size()
