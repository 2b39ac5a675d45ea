"""The pytorch_attention sweep and the torch_compile comparisons (notebook 05).

Attention sweep: batch 8, no head dimension, head dim ``d`` x sequence length, and upward (x2)
from the largest listed length until the device runs out of memory. Each point times
``n_forward`` forward passes and ``n_backward`` backward passes (after warm-up, CUDA events per
pass so no host sync sits inside the timed region), and records the memory in use before the
backward pass with the autograd graph alive. An out-of-memory point becomes a row with
``status="oom"`` and the sweep goes on with the next head dim.

Also here: the memory accounting of naive attention (score matrix, softmax output, saved
tensors) against free memory, the same accounting for FlashAttention-style tiling, a log-log
least-squares power-law fit, and the whole-model compiled-vs-eager sweep on top of
``systems.bench.benchmark.run_benchmark`` with a compile-time budget.

    run_attention_sweep(AttentionSweepConfig(...), out_path=...)       -> list of rows
    attention_memory_accounting(batch=, seq=, d=, free_bytes=)          -> DataFrame of terms
    fit_power_law(x, y)                                                  -> PowerLawFit
    run_model_compile_sweep(sizes, out_path=..., budget_s=...)           -> list of harness records
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from systems.attention.naive import naive_attention
from systems.measure.devices import is_oom, release_memory, resolve_device
from systems.measure.results import ResultWriter, read_records

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 2**30

# ----------------------------------------------------------------------------- helpers


def _element_size(dtype: str) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def attention_flops(*, batch: int, seq: int, d: int, backward: bool = False) -> int:
    """Matmul FLOPs of one attention pass: QK^T and PV forward (2 each); backward is twice that
    (dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q)."""
    forward = 2 * 2 * batch * seq * seq * d
    return 2 * forward if backward else forward


def sdpa_one_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """torch SDPA on (batch, seq, d) inputs given one explicit head, (batch, 1, seq, d):
    the fused CUDA kernels (flash / memory-efficient) only accept 4-D inputs and would otherwise
    fall back to the math path, which materialises the score matrix like the naive code."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(-3), k.unsqueeze(-3), v.unsqueeze(-3), is_causal=is_causal)
    return out.squeeze(-3)


# ----------------------------------------------------------------------------- one point


@dataclass(frozen=True)
class AttentionPoint:
    """One configuration of the sweep; what a ``fail_if`` predicate receives."""
    batch: int
    seq: int
    d: int
    dtype: str = "float32"
    compiled: bool = False


class _Timer:
    """Per-pass durations: CUDA events on a GPU (no host sync inside the loop), perf_counter on CPU."""

    def __init__(self, device: torch.device, n: int):
        self.device, self.n = device, n
        if device.type == "cuda":
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(n)]
        self.host: list[float] = []

    def start(self, i: int) -> None:
        if self.device.type == "cuda":
            self.events[i][0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self, i: int) -> None:
        if self.device.type == "cuda":
            self.events[i][1].record()
        else:
            self.host.append(time.perf_counter() - self._t0)

    def seconds(self) -> list[float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) / 1e3 for a, b in self.events]
        return self.host


def _summarise(prefix: str, times: list[float]) -> dict:
    arr = np.asarray(times)
    return {f"{prefix}_ms_median": float(np.median(arr) * 1e3), f"{prefix}_ms_mean": float(arr.mean() * 1e3),
            f"{prefix}_ms_std": float(arr.std(ddof=1) * 1e3) if arr.size > 1 else 0.0}


def count_saved_tensor_bytes(fn: Callable, *inputs: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one call of ``fn``, excluding the
    inputs' own storage (they exist anyway). Distinct storages are counted once, so a tensor saved
    by two nodes (the softmax output is saved by softmax and by P @ V) counts once."""
    input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in input_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(seen.values())


def _measure_point(point: AttentionPoint, fn: Callable, *, device: torch.device, n_forward: int,
                   n_backward: int, warmup: int, seed: int, count_saved: bool,
                   fail_if: Callable[[AttentionPoint], bool] | None, state: dict) -> dict:
    """Everything that allocates lives in this frame, so it is gone once an OOM has propagated."""
    dtype = DTYPES[point.dtype]
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(seed)
    state["phase"] = "inputs"
    shape = (point.batch, point.seq, point.d)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    rec: dict = {}

    # warm-up: full forward+backward passes, so an OOM anywhere shows up before any timed pass
    # (and, for the compiled variant, compilation of both graphs happens here)
    state["phase"] = "warm-up forward"
    if fail_if is not None and fail_if(point):
        raise torch.OutOfMemoryError(f"injected allocation failure for {point}")
    for i in range(warmup):
        t0 = time.perf_counter()
        state["phase"] = "warm-up forward"
        out = fn(q, k, v)
        state["phase"] = "warm-up backward"
        out.backward(grad_out)
        del out
        q.grad = k.grad = v.grad = None
        if cuda:
            torch.cuda.synchronize(device)
        if i == 0:
            rec["first_call_s"] = time.perf_counter() - t0
    if cuda:
        rec["peak_bytes"] = torch.cuda.max_memory_allocated(device)

    # forward: autograd on (as in training), the output dropped each pass so at most one graph lives
    state["phase"] = "forward"
    timer = _Timer(device, n_forward)
    for i in range(n_forward):
        timer.start(i)
        fn(q, k, v)
        timer.stop(i)
    rec.update(_summarise("forward", timer.seconds()))

    # memory in use before the backward pass: one forward with its graph (saved tensors) and output alive
    state["phase"] = "backward"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    out = fn(q, k, v)
    if cuda:
        torch.cuda.synchronize(device)
        rec["mem_before_backward_bytes"] = torch.cuda.memory_allocated(device)
        rec["activation_bytes"] = rec["mem_before_backward_bytes"] - before
    # each timed backward consumes a fresh graph, as in training (retain_graph would keep P alive
    # through the backward, and compiled backwards with donated buffers refuse it); only the
    # backward sits between the events, and grads are reset so every pass allocates them
    timer = _Timer(device, n_backward)
    for i in range(n_backward):
        if i:
            out = fn(q, k, v)
        q.grad = k.grad = v.grad = None
        timer.start(i)
        out.backward(grad_out)
        timer.stop(i)
        del out
    rec.update(_summarise("backward", timer.seconds()))
    q.grad = k.grad = v.grad = None
    if count_saved:
        rec["saved_tensor_bytes"] = count_saved_tensor_bytes(fn, q, k, v)
    state["phase"] = "done"
    return rec


def run_attention_point(point: AttentionPoint, *, fn: Callable | None = None, device: str | torch.device = "auto",
                        n_forward: int = 100, n_backward: int = 100, warmup: int = 2, seed: int = 0,
                        count_saved: bool | None = None,
                        fail_if: Callable[[AttentionPoint], bool] | None = None) -> dict:
    """Time one point; returns a flat row with status 'ok' or 'oom' (and the phase it ran out in).

    ``fn`` defaults to ``naive_attention``; ``fail_if(point) -> True`` raises an injected
    ``torch.OutOfMemoryError`` after the inputs are allocated (tests and the CPU smoke run).
    ``count_saved`` (default: for eager functions) counts saved-tensor bytes with autograd hooks.
    """
    for name, value in (("n_forward", n_forward), ("n_backward", n_backward), ("warmup", warmup)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    _element_size(point.dtype)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    fn = fn or naive_attention
    count_saved = (not point.compiled) if count_saved is None else count_saved
    row = {**{("batch_size" if k == "batch" else k): v for k, v in asdict(point).items()},
           "device": str(dev), "tf32": torch.backends.cuda.matmul.allow_tf32, "n_forward": n_forward,
           "n_backward": n_backward, "warmup": warmup, "status": "ok", "error": None, "oom_phase": None}
    if dev.type == "cuda":
        release_memory(dev)  # a clean allocator for each point (on a CPU refcounting is enough)
        torch.cuda.reset_peak_memory_stats(dev)
        row["cuda_free_bytes"], row["cuda_total_bytes"] = torch.cuda.mem_get_info(dev)
    state = {"phase": "start"}
    oom_message = None
    try:
        row.update(_measure_point(point, fn, device=dev, n_forward=n_forward, n_backward=n_backward,
                                  warmup=warmup, seed=seed, count_saved=count_saved, fail_if=fail_if,
                                  state=state))
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
        oom_message = str(exc).splitlines()[0][:300]
    if oom_message is not None:
        # after the except block: the traceback, and the tensors its frames hold, are released
        row.update(status="oom", error=oom_message, oom_phase=state["phase"])
        if dev.type == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        release_memory(dev)
    if row["status"] == "ok":
        for phase, backward in (("forward", False), ("backward", True)):
            flops = attention_flops(batch=point.batch, seq=point.seq, d=point.d, backward=backward)
            row[f"{phase}_tflops"] = flops / (row[f"{phase}_ms_median"] / 1e3) / 1e12
        # the column the exponent fit uses: measured allocator delta on a GPU, saved-tensor hooks elsewhere
        row["saved_bytes"] = row.get("activation_bytes", row.get("saved_tensor_bytes"))
    return row


# ----------------------------------------------------------------------------- the sweep


@dataclass
class AttentionSweepConfig:
    batch_size: int = 8
    head_dims: tuple[int, ...] = (16, 32, 64, 128)
    seq_lens: tuple[int, ...] = (256, 1024, 4096, 8192, 16384)
    grow_until_oom: bool = True  # after the listed lengths, double the length until a point runs out of memory
    max_seq_len: int = 65536  # stop doubling here (keeps a sweep on a very large GPU finite)
    n_forward: int = 100
    n_backward: int = 100
    warmup: int = 2
    dtype: str = "float32"
    device: str = "auto"
    compiled: bool = False  # torch.compile the attention function
    compile_backend: str = "inductor"  # "aot_eager" traces without code generation (fast CPU smoke runs)
    compile_dynamic: bool | None = None  # torch.compile's default: static first, then dynamic sizes on recompile
    seed: int = 0

    def __post_init__(self) -> None:
        self.head_dims, self.seq_lens = tuple(self.head_dims), tuple(self.seq_lens)
        if not self.head_dims or not self.seq_lens:
            raise ValueError("head_dims and seq_lens must be non-empty")
        for name in ("batch_size", "n_forward", "n_backward", "warmup", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if any(x < 1 for x in self.head_dims + self.seq_lens):
            raise ValueError(f"head dims and sequence lengths must be positive, got {self.head_dims} {self.seq_lens}")
        if list(self.seq_lens) != sorted(set(self.seq_lens)):
            raise ValueError(f"seq_lens must be strictly increasing, got {self.seq_lens}")
        _element_size(self.dtype)
        resolve_device(self.device)


def attention_function(cfg: AttentionSweepConfig) -> Callable:
    """The function a sweep times: naive attention, compiled when asked (one compiled object for
    the whole sweep; Dynamo recompiles for new shapes and then marks the changing dims dynamic)."""
    if not cfg.compiled:
        return naive_attention
    torch._dynamo.reset()  # start from an empty cache so the sweep's first point pays the compile
    return torch.compile(naive_attention, backend=cfg.compile_backend, dynamic=cfg.compile_dynamic)


def run_attention_sweep(cfg: AttentionSweepConfig, *, out_path: str | Path | None = None,
                        fail_if: Callable[[AttentionPoint], bool] | None = None, progress: bool = True,
                        fn: Callable | None = None, isolate: bool = False, append: bool = False) -> list[dict]:
    """Every head dim x listed length, then doubling past the last length until out of memory.

    For each head dim the lengths run in increasing order; once a point runs out of memory the
    larger listed lengths of that head dim are recorded as ``status="skipped"`` (they cannot
    fit) and the sweep goes on with the next head dim. Rows are written as they are produced.

    ``isolate=True`` runs each head dim's series in its own child process. A CUDA out-of-memory
    error inside ``backward()`` can leave the failed graph's buffers allocated (seen on an H100:
    about 34 GiB stayed in use for the rest of the process after the d=16, seq=32k point), which
    would distort every later measurement in that process; a series ends at its first OOM, so
    with one process per series no point runs after an OOM.
    """
    from tqdm import tqdm

    if isolate:
        if fail_if is not None or fn is not None:
            raise ValueError("isolate=True cannot carry fail_if or fn into the child process")
        if out_path is None:
            raise ValueError("isolate=True needs out_path: the child process writes its rows there")
        if not append:
            Path(out_path).unlink(missing_ok=True)
        for d in cfg.head_dims:
            child = json.dumps(asdict(replace(cfg, head_dims=(d,))))
            cmd = [sys.executable, "-m", "systems.bench.attention", "--config-json", child, "--out", str(out_path),
                   "--append"] + ([] if progress else ["--no-progress"])
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"attention sweep child process (d={d}) failed with exit code "
                                   f"{proc.returncode}; rows written so far are in {out_path}")
        return read_records(out_path)

    device = resolve_device(cfg.device)
    fn = fn or attention_function(cfg)
    writer = ResultWriter(out_path, overwrite=not append) if out_path else None
    rows: list[dict] = []
    label = "compiled" if cfg.compiled else "eager"
    bar = tqdm(total=len(cfg.head_dims) * len(cfg.seq_lens), disable=not progress, desc=f"attention ({label})")

    def emit(row: dict) -> dict:
        row = {**row, "compile_backend": cfg.compile_backend if cfg.compiled else None}
        rows.append(writer.write(row) if writer else row)
        bar.update(1)
        return row

    for d in cfg.head_dims:
        hit_oom = False
        for seq in cfg.seq_lens:
            if hit_oom:
                emit({"batch_size": cfg.batch_size, "seq": seq, "d": d, "dtype": cfg.dtype, "compiled": cfg.compiled,
                      "device": str(device), "status": "skipped", "error": "longer than an out-of-memory point"})
                continue
            bar.set_postfix_str(f"d={d} seq={seq}")
            row = emit(run_attention_point(AttentionPoint(cfg.batch_size, seq, d, cfg.dtype, cfg.compiled), fn=fn,
                                           device=device, n_forward=cfg.n_forward, n_backward=cfg.n_backward,
                                           warmup=cfg.warmup, seed=cfg.seed, fail_if=fail_if))
            hit_oom = row["status"] == "oom"
        seq = cfg.seq_lens[-1] * 2
        while cfg.grow_until_oom and not hit_oom and seq <= cfg.max_seq_len:
            bar.total += 1
            bar.set_postfix_str(f"d={d} seq={seq}")
            row = emit(run_attention_point(AttentionPoint(cfg.batch_size, seq, d, cfg.dtype, cfg.compiled), fn=fn,
                                           device=device, n_forward=cfg.n_forward, n_backward=cfg.n_backward,
                                           warmup=cfg.warmup, seed=cfg.seed, fail_if=fail_if))
            hit_oom = row["status"] == "oom"
            seq *= 2
    bar.close()
    return rows


def simulated_memory_limit(limit_bytes: int, *, dtype: str = "float32") -> Callable[[AttentionPoint], bool]:
    """A ``fail_if`` predicate: the point "runs out of memory" when the accounting's peak exceeds
    ``limit_bytes``. Lets a CPU run show the OOM path at sizes a CPU can time."""
    def fail_if(point: AttentionPoint) -> bool:
        acct = attention_memory_accounting(batch=point.batch, seq=point.seq, d=point.d, dtype=point.dtype)
        return int(acct.attrs["peak_bytes"]) > limit_bytes
    return fail_if


def sweep_table(rows: Sequence[dict]) -> pd.DataFrame:
    """One row per point: status, forward/backward medians, memory before backward, peak, saved bytes."""
    df = pd.DataFrame(rows)
    cols = {"d": "d", "seq": "seq", "status": "status", "oom_phase": "OOM in",
            "forward_ms_median": "fwd ms", "forward_ms_std": "fwd ± ms", "forward_tflops": "fwd TFLOP/s",
            "backward_ms_median": "bwd ms", "backward_ms_std": "bwd ± ms", "backward_tflops": "bwd TFLOP/s",
            "mem_before_backward_bytes": "mem before bwd GiB", "peak_bytes": "peak GiB",
            "saved_bytes": "saved GiB"}
    out = df.reindex(columns=list(cols)).rename(columns=cols)
    for c in ("mem before bwd GiB", "peak GiB", "saved GiB"):
        out[c] = pd.to_numeric(out[c], errors="coerce") / GIB
    return out.reset_index(drop=True)


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


def smallest_oom(rows: Sequence[dict]) -> dict | None:
    """The out-of-memory row with the fewest score-matrix elements (then the smallest d)."""
    ooms = [r for r in rows if r.get("status") == "oom"]
    return min(ooms, key=lambda r: (r["batch_size"] * r["seq"] ** 2, r["d"])) if ooms else None


# ----------------------------------------------------------------------------- accounting


def attention_memory_accounting(*, batch: int, seq: int, d: int, dtype: str = "float32",
                                free_bytes: int | None = None) -> pd.DataFrame:
    """What naive attention (``systems.attention.naive``) allocates for (batch, seq, d).

    Terms follow the code: ``scores = q @ k^T / sqrt(d)`` makes two score-sized tensors (the raw
    product and the scaled copy), softmax makes the probabilities P, ``P @ V`` the output. Autograd
    saves q, k, v (the matmuls' inputs) and P (for softmax and for P @ V); nothing else
    score-sized survives the forward. The backward pass makes dP = dO V^T, then the softmax
    gradient dS (while dP and P are alive), then dS / sqrt(d). Peaks are the sums of the tensors
    alive at the same moment. ``attrs`` carries the totals (and the verdict against ``free_bytes``).
    """
    e = _element_size(dtype)
    vec = batch * seq * d * e  # one (batch, seq, d) tensor
    mat = batch * seq * seq * e  # one (batch, seq, seq) tensor
    terms = [
        ("inputs q, k, v", 3 * vec, "allocated before the call; saved by the two matmuls"),
        ("score matrix Q K^T", mat, "transient: freed once the scaled copy exists"),
        ("scaled scores / sqrt(d)", mat, "transient: freed after softmax reads it"),
        ("softmax output P", mat, "saved for backward (softmax and P @ V)"),
        ("output O = P V", vec, "the result"),
        ("grad of output dO", vec, "backward input"),
        ("dP = dO V^T", mat, "backward: alive while the softmax gradient is formed"),
        ("dS (softmax backward)", mat, "backward: alive while scaled by 1/sqrt(d)"),
        ("dQ, dK, dV", 3 * vec, "backward results"),
    ]
    df = pd.DataFrame(terms, columns=["tensor", "bytes", "when"])
    df["GiB"] = df["bytes"] / GIB
    # forward peak: inputs + raw scores + scaled scores (during the division) or + P (during softmax)
    forward_peak = 3 * vec + 2 * mat
    saved = mat  # beyond the inputs: P
    before_backward = 3 * vec + saved + vec + vec  # inputs, P, O, dO
    # backward peak: inputs, O, dO, P, dP and dS alive together (dS/sqrt(d) replaces dP's slot)
    backward_peak = 3 * vec + 2 * vec + 3 * mat
    df.attrs.update(batch=batch, seq=seq, d=d, dtype=dtype, element_bytes=e, score_matrix_bytes=mat,
                    saved_bytes=saved, forward_peak_bytes=forward_peak, before_backward_bytes=before_backward,
                    backward_peak_bytes=backward_peak, peak_bytes=max(forward_peak, backward_peak),
                    free_bytes=free_bytes)
    if free_bytes is not None:
        df.attrs["forward_fits"] = forward_peak <= free_bytes
        df.attrs["backward_fits"] = backward_peak <= free_bytes
    return df


def flash_attention_accounting(*, batch: int, seq: int, d: int, dtype: str = "float32",
                               block_q: int = 128, block_k: int = 128) -> dict:
    """FlashAttention's alternative: tile Q and K/V into blocks, keep a running max and sum per
    query row, never store P. It saves O and the row logsumexp L (batch x seq) and recomputes each
    P tile in the backward pass from Q, K and L, at the cost of one extra Q K^T matmul."""
    e = _element_size(dtype)
    naive_saved = batch * seq * seq * e
    flash_saved = batch * seq * d * e + batch * seq * 4  # O, and L kept in fp32
    tile_bytes = block_q * block_k * 4  # one score tile, fp32, in on-chip memory
    return {"naive_saved_bytes": naive_saved, "flash_saved_bytes": flash_saved,
            "saving_factor": naive_saved / flash_saved, "score_tile_bytes": tile_bytes,
            "n_tiles": math.ceil(seq / block_q) * math.ceil(seq / block_k) * batch,
            "block_q": block_q, "block_k": block_k,
            "recompute_flops": 2 * batch * seq * seq * d,
            "recompute_fraction_of_backward": (2 * batch * seq * seq * d)
            / attention_flops(batch=batch, seq=seq, d=d, backward=True)}


# ----------------------------------------------------------------------------- fit


@dataclass
class PowerLawFit:
    exponent: float
    prefactor: float
    r2: float  # of the log-log regression
    n: int

    def predict(self, x) -> np.ndarray:
        return self.prefactor * np.asarray(x, dtype=float) ** self.exponent


def fit_power_law(x: Iterable[float], y: Iterable[float]) -> PowerLawFit:
    """Least squares of log y = log a + b log x; returns b as the exponent."""
    x, y = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    if x.shape != y.shape or x.size < 2:
        raise ValueError(f"need at least two (x, y) pairs of equal length, got {x.size} and {y.size}")
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError("a log-log fit needs positive x and y")
    if np.unique(x).size < 2:
        raise ValueError("a fit needs at least two distinct x values")
    lx, ly = np.log(x), np.log(y)
    b, log_a = np.polyfit(lx, ly, 1)
    resid = ly - (log_a + b * lx)
    ss_tot = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return PowerLawFit(exponent=float(b), prefactor=float(np.exp(log_a)), r2=r2, n=int(x.size))


def saved_memory_fits(rows: Sequence[dict], *, column: str = "saved_bytes") -> pd.DataFrame:
    """Per head dim: the exponent of saved memory against sequence length over the points that ran."""
    df = pd.DataFrame([r for r in rows if r.get("status") == "ok" and r.get(column)])
    out = []
    for d, g in df.groupby("d") if not df.empty else []:
        if g["seq"].nunique() < 2:
            continue
        fit = fit_power_law(g["seq"], g[column])
        out.append({"d": d, "exponent": fit.exponent, "r2": fit.r2, "points": fit.n,
                    "seq range": f"{g['seq'].min()}–{g['seq'].max()}"})
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- whole model


MODEL_MEASUREMENTS = ("forward (inference)", "forward (in train step)", "forward+backward", "train step")


def run_model_compile_sweep(sizes: Sequence[str], *, context_length: int = 512, batch_size: int = 4,
                            modes: Sequence[str] = ("forward", "train_step"), precision: str = "fp32",
                            tf32: bool = True, warmup: int = 2, steps: int = 5,
                            device: str = "auto", compile_scope: str | None = "model",
                            budget_s: float | None = None,
                            out_path: str | Path | None = None, progress: bool = True,
                            model_overrides: dict | None = None, bench_fn: Callable | None = None,
                            clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Eager for every size, then compiled smallest first, each point through ``run_benchmark``.

    Forward+backward comes from the train step's separately synchronised forward and backward
    phases, so each size compiles twice (the inference graph and the training graph) instead of
    three times. Compilation dominates the cost; with ``budget_s`` a compiled point is skipped
    (``status="skipped"``) once the time spent on compiled points plus a prediction for this one
    (the last compiled point of the same mode) would exceed the budget. ``compile_scope=None`` runs
the eager points only. With ``compile_scope="model"``
    the prediction scales with layer count, since the whole model is traced into one graph; with
    ``"blocks"`` (BenchmarkConfig's per-block compile, one graph shared by every layer) compile cost
    stays flat with depth, so the last point's time is the prediction.
    ``bench_fn`` replaces ``run_benchmark`` and ``clock`` the wall clock (tests).
    """
    from tqdm.auto import tqdm

    from systems.bench.benchmark import BenchmarkConfig, run_benchmark

    bench_fn = bench_fn or run_benchmark
    if warmup < 1:
        raise ValueError("warmup must be >= 1: the first (compiling) step must stay out of the measurement")
    common = dict(context_length=context_length, batch_size=batch_size, precision=precision, tf32=tf32,
                  warmup=warmup, steps=steps, device=device, model_overrides=dict(model_overrides or {}))
    plan = [BenchmarkConfig(model=s, mode=m, **common) for s in sizes for m in modes]
    if compile_scope is not None:
        plan += [BenchmarkConfig(model=s, mode=m, compile=compile_scope, **common) for s in sizes for m in modes]
    writer = ResultWriter(out_path) if out_path else None
    records: list[dict] = []
    eager_status: dict[tuple[str, str], str] = {}
    last_compiled: dict[str, tuple[int, float]] = {}  # mode -> (n_layers, seconds)
    compiled_spent = 0.0
    for cfg in tqdm(plan, disable=not progress, desc="model compile sweep"):
        n_layers = cfg.model_config().n_layers
        skip = None
        compiled = cfg.compile != "none"
        if compiled and eager_status.get((cfg.model, cfg.mode)) == "oom":
            skip = "eager run out of memory at this size"
        elif compiled and budget_s is not None and cfg.mode in last_compiled:
            layers, seconds = last_compiled[cfg.mode]
            predicted = seconds * (n_layers / layers if compile_scope == "model" else 1.0)
            if compiled_spent + predicted > budget_s:
                skip = (f"compile-time budget: {compiled_spent:.0f} s spent + ~{predicted:.0f} s predicted "
                        f"> {budget_s:.0f} s")
        if skip:
            rec = {**asdict(cfg), "model_overrides": None, "n_layers": n_layers, "status": "skipped", "error": skip}
        else:
            if compiled:
                torch._dynamo.reset()  # one code object (TransformerLM.forward) for every size: avoid the recompile limit
            t0 = clock()
            rec = bench_fn(cfg)
            elapsed = clock() - t0
            rec["wall_s"] = elapsed
            if compiled:
                compiled_spent += elapsed
                last_compiled[cfg.mode] = (n_layers, elapsed)
                torch._dynamo.reset()  # drop the compiled graphs (and the model they reference)
                release_memory(torch.device("cuda" if torch.cuda.is_available() and device != "cpu" else "cpu"))
            else:
                eager_status[(cfg.model, cfg.mode)] = rec["status"]
        if rec["status"] == "ok":
            # the first warm-up step pays compilation (and, for eager, first-call library set-up)
            rec["first_step_overhead_s"] = rec["first_step_s"] - rec["step_median_s"]
        records.append(writer.write(rec) if writer else rec)
    return records


def _model_time(rec: dict, measurement: str) -> float | None:
    if rec is None or rec.get("status") != "ok":
        return None
    if measurement == "forward (inference)":
        return rec["step_median_s"] if rec["mode"] == "forward" else None
    if rec["mode"] != "train_step":
        return None
    if measurement == "forward (in train step)":
        return rec["forward_mean_s"]
    if measurement == "forward+backward":
        return rec["forward_mean_s"] + rec["backward_mean_s"]
    return rec["step_median_s"]


def model_compile_table(records: Sequence[dict]) -> pd.DataFrame:
    """Per size and measurement: eager and compiled ms, speedup, and the compiled run's compile time."""
    by = {(r["model"], r["mode"], r["compile"] != "none"): r for r in records}
    sizes = list(dict.fromkeys(r["model"] for r in records))
    rows = []
    for size in sizes:
        for meas in MODEL_MEASUREMENTS:
            mode = "forward" if meas == "forward (inference)" else "train_step"
            e, c = by.get((size, mode, False)), by.get((size, mode, True))
            if e is None and c is None:
                continue
            te, tc = _model_time(e, meas), _model_time(c, meas)
            status = "/".join(x["status"] if x else "—" for x in (e, c))
            tokens = (e or c)["batch_size"] * (e or c)["context_length"]
            rows.append({"size": size, "measurement": meas, "eager ms": te * 1e3 if te else None,
                         "compiled ms": tc * 1e3 if tc else None, "speedup": te / tc if te and tc else None,
                         "compiled tok/s": tokens / tc if tc else None,
                         "compile s": (c.get("first_step_overhead_s") if c and c["status"] == "ok" else None),
                         "status eager/compiled": status,
                         "note": (c or {}).get("error") if (c or {}).get("status") != "ok" else None})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m systems.bench.attention --config-json '{...}' --out rows.jsonl`` (used by isolate=True)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m systems.bench.attention")
    parser.add_argument("--config-json", required=True, help="AttentionSweepConfig fields as JSON")
    parser.add_argument("--out", required=True, help="the .jsonl file the rows are written to")
    parser.add_argument("--append", action="store_true", help="add to --out instead of replacing it")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = AttentionSweepConfig(**json.loads(args.config_json))
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_attention_sweep(cfg, out_path=args.out, progress=not args.no_progress, append=args.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
