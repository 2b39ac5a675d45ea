"""flash_benchmarking: attention implementations timed side by side with triton.testing.do_bench.

Forward, backward and end-to-end (forward + backward) latencies of
- ``triton``: our FlashAttention-2 kernels (systems.attention.flash_triton),
- ``naive``: the handout's PyTorch attention (OOM rows where the n x n scores do not fit),
- ``sdpa_flash`` / ``sdpa_cudnn``: torch SDPA forced onto its flash / cuDNN backend
  (a backend that cannot run a configuration gives a row with status "unsupported"),
all measured in the same process so the comparison is fair. Rows are written as they are
produced (systems.measure.results.ResultWriter), so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from systems.attention.naive import naive_attention
from systems.measure.devices import DTYPES, release_memory
IMPLS = ("triton", "naive", "sdpa_flash", "sdpa_cudnn")
PASSES = ("fwd", "bwd", "e2e")


def attention_flops(*, batch: int, n_q: int, n_k: int, d: int, is_causal: bool, pass_: str) -> float:
    """Matmul FLOPs: forward 4 b n_q n_k d (QK^T and PV), halved when causal;
    backward 2.5x the forward (five matmuls instead of two); e2e the sum."""
    fwd = 4.0 * batch * n_q * n_k * d * (0.5 if is_causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "e2e": 3.5 * fwd}[pass_]


def _sdpa_with(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def run(q, k, v, is_causal):
        # only this backend: a config it cannot run raises (its "why not" warnings are
        # silenced; the row's status and error say it)
        with sdpa_kernel([backend]), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return run


# The Triton implementations get_impl knows, as FlashVariant fields: our default (TMA kernels above
# flash_triton.TMA_MIN_SEQ), and named variants for timing them side by side: the pointer forward
# with the split or the atomic backward, and the TMA-descriptor forward and split backward.
TRITON_VARIANTS = {"triton": {}, "triton_split": dict(forward="pointer", backward="split"),
                   "triton_atomic": dict(forward="pointer", backward="atomic"),
                   "triton_tma": dict(forward="tma", backward="tma")}


def get_impl(name: str) -> Callable:
    """IMPLS, plus the named Triton variants of TRITON_VARIANTS."""
    if name in TRITON_VARIANTS:
        from systems.attention.flash_triton import FlashVariant, flash_attention_triton

        variant = FlashVariant(**TRITON_VARIANTS[name])
        return lambda q, k, v, is_causal: flash_attention_triton(q, k, v, is_causal=is_causal, variant=variant)
    if name == "naive":
        return naive_attention
    if name == "sdpa_flash":
        return _sdpa_with("flash")
    if name == "sdpa_cudnn":
        return _sdpa_with("cudnn")
    raise ValueError(f"unknown implementation {name!r}; choose one of {IMPLS}")


def _is_unsupported(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (RuntimeError, ValueError, NotImplementedError)) and any(
        s in text for s in ("No available kernel", "not supported", "unsupported", "No valid", "cuDNN"))


def time_attention(impl: str, *, batch: int, heads: int, seq: int, d: int, dtype: str, is_causal: bool = True,
                   warmup_ms: float = 10, rep_ms: float = 50, device: str = "cuda") -> dict:
    """One row: median fwd / bwd / e2e ms (do_bench) and TFLOP/s for one implementation and shape.

    q, k, v are (batch, heads, seq, d): every implementation takes that layout (ours treats
    the leading dims as a batch). status is ok, oom, unsupported or error; passes measured
    before an OOM keep their times.
    """
    import triton.testing

    fn = get_impl(impl)
    row: dict = dict(impl=impl, batch=batch, heads=heads, seq=seq, d=d, dtype=dtype, causal=is_causal,
                     status="ok", error=None)
    q = k = v = do = out = None
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (batch, heads, seq, d)
        q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[dtype], generator=gen).requires_grad_()
                   for _ in range(3))
        do = torch.randn(shape, device=device, dtype=DTYPES[dtype], generator=gen)
        bench = dict(warmup=warmup_ms, rep=rep_ms, return_mode="median")

        def fwd():
            return fn(q, k, v, is_causal)

        row["fwd_ms"] = triton.testing.do_bench(fwd, **bench)
        out = fwd()
        row["bwd_ms"] = triton.testing.do_bench(lambda: out.backward(do, retain_graph=True),
                                                grad_to_none=[q, k, v], **bench)
        out = None
        row["e2e_ms"] = triton.testing.do_bench(lambda: fwd().backward(do), grad_to_none=[q, k, v], **bench)
    except torch.OutOfMemoryError:
        row["status"] = "oom"
    except Exception as exc:  # noqa: BLE001 - a row per failure; the sweep goes on
        row["status"] = "unsupported" if _is_unsupported(exc) else "error"
        first_line = (str(exc).splitlines() or [""])[0]
        row["error"] = f"{type(exc).__name__}: {first_line[:200]}"
    finally:
        q = k = v = do = out = None  # drop the references before freeing the cache
        release_memory()
    for p in PASSES:
        ms = row.get(f"{p}_ms")
        flops = attention_flops(batch=batch * heads, n_q=seq, n_k=seq, d=d, is_causal=is_causal, pass_=p)
        row[f"{p}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
    return row


@dataclass
class SweepConfig:
    """The grid of flash_benchmarking (the handout's: batch 1, causal, powers of two)."""
    seq_lens: tuple[int, ...] = tuple(2**i for i in range(7, 17))  # 128 ... 65536
    head_dims: tuple[int, ...] = (16, 32, 64, 128)
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    impls: tuple[str, ...] = IMPLS
    batch: int = 1
    heads: int = 1
    is_causal: bool = True
    warmup_ms: float = 10
    rep_ms: float = 50
    extra: dict = field(default_factory=dict)  # stamped on every row (e.g. the profile)


def flash_benchmarking(cfg: SweepConfig, *, writer=None, progress: bool = True,
                       device: str = "cuda") -> pd.DataFrame:
    """Every (dtype, d, seq, impl) of the grid; each row goes to ``writer`` as soon as it exists."""
    from tqdm.auto import tqdm

    grid = list(itertools.product(cfg.dtypes, cfg.head_dims, cfg.seq_lens, cfg.impls))
    rows = []
    for dtype, d, seq, impl in tqdm(grid, desc="flash_benchmarking", disable=not progress):
        row = time_attention(impl, batch=cfg.batch, heads=cfg.heads, seq=seq, d=d, dtype=dtype,
                             is_causal=cfg.is_causal, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, device=device)
        row = {**row, **cfg.extra}
        if writer is not None:
            writer.write(row)
        rows.append(row)
    return pd.DataFrame(rows)


# the 2025 CS336 leaderboard configuration: q, k, v (16, 16384, 64) bf16, causal, fwd + bwd
LEADERBOARD = dict(batch=1, heads=16, seq=16384, d=64, dtype="bf16", is_causal=True)


def leaderboard(*, impls: tuple[str, ...] = ("triton", "sdpa_flash", "sdpa_cudnn"), writer=None,
                warmup_ms: float = 25, rep_ms: float = 200, device: str = "cuda") -> pd.DataFrame:
    """The leaderboard configuration for each implementation, in this run (batch x heads = 16)."""
    rows = []
    for impl in impls:
        row = time_attention(impl, **LEADERBOARD, warmup_ms=warmup_ms, rep_ms=rep_ms, device=device)
        if writer is not None:
            writer.write(row)
        rows.append(row)
    return pd.DataFrame(rows)


# The speed targets of the "beat cuDNN" work: over seq 1k-64k x d 64/128 (bf16, causal, batch 1),
# the geometric mean of baseline time / our time, per pass, must reach these; at the leaderboard
# shape our forward + backward must take at most LEADERBOARD_TARGET x cuDNN's time.
SPEED_TARGETS = {"sdpa_cudnn": 1.0, "sdpa_flash": 1.3}
RATIO_GRID = dict(dtype="bf16", seq_range=(1024, 65536), head_dims=(64, 128))
LEADERBOARD_TARGET = 0.95


def speed_ratios(sweep: pd.DataFrame, *, ours: str = "triton", baselines: tuple[str, ...] = tuple(SPEED_TARGETS),
                 passes: tuple[str, ...] = ("fwd", "bwd"), dtype: str = RATIO_GRID["dtype"],
                 seq_range: tuple[int, int] = RATIO_GRID["seq_range"],
                 head_dims: tuple[int, ...] = RATIO_GRID["head_dims"]) -> pd.DataFrame:
    """Per (d, seq) point of a sweep: baseline ms / our ms for each pass and baseline (> 1: ours is
    faster). A point where either side did not run is NaN."""
    ok = sweep[(sweep.status == "ok") & (sweep.dtype == dtype) & sweep.d.isin(head_dims)
               & sweep.seq.between(*seq_range)]
    wide = ok.pivot_table(index=["d", "seq"], columns="impl", values=[f"{p}_ms" for p in passes], aggfunc="first")
    out = pd.DataFrame(index=wide.index)
    for p in passes:
        for base in baselines:
            have = (f"{p}_ms", base) in wide.columns and (f"{p}_ms", ours) in wide.columns
            out[f"{p} vs {base}"] = wide[(f"{p}_ms", base)] / wide[(f"{p}_ms", ours)] if have else np.nan
    return out


def geomean_ratios(ratios: pd.DataFrame, *, targets: dict[str, float] = SPEED_TARGETS) -> pd.DataFrame:
    """One row per column of ``speed_ratios``: its geometric mean over the points that ran, the
    target for that baseline, and whether the mean reaches it."""
    rows = []
    for col in ratios.columns:
        pass_, base = col.split(" vs ")
        vals = ratios[col].dropna()
        gm = float(np.exp(np.log(vals).mean())) if len(vals) else float("nan")
        target = targets.get(base)
        rows.append({"pass": pass_, "baseline": base, "points": len(vals), "missing": int(ratios[col].isna().sum()),
                     "geomean speed": gm, "target": target,
                     "met": bool(gm >= target) if target is not None and len(vals) else None})
    return pd.DataFrame(rows)


def full_profile_grids() -> list[SweepConfig]:
    """The grid notebook 06 runs in its full profile, trimmed to fit 8 minutes on one H100:
    bf16 at every power-of-two length 128 ... 65536 and d 16, 32, 64, 128; fp32 (ieee dots, no
    SDPA flash/cuDNN kernels) at every other length and d 64, 128."""
    return [
        SweepConfig(seq_lens=tuple(2**i for i in range(7, 17)), head_dims=(16, 32, 64, 128), dtypes=("bf16",)),
        SweepConfig(seq_lens=tuple(2**i for i in range(7, 17, 2)), head_dims=(64, 128), dtypes=("fp32",)),
    ]
