"""flash_benchmarking: attention implementations checked and timed side by side.

Forward, backward and end-to-end (forward + backward) latencies of
- ``triton``: our FlashAttention-2 kernels (systems.attention.flash_triton), and its named
  variants (``TRITON_VARIANTS``: the backwards side by side, the fp32 dot precisions);
- ``naive``: the handout's PyTorch attention (a row "skipped (memory)" where the accounting of
  ``naive_min_bytes`` proves the n x n matrices cannot fit, "oom" where they did not);
- ``sdpa_flash`` / ``sdpa_cudnn``: torch SDPA forced onto its flash / cuDNN backend (a
  configuration a backend cannot run gives a row with status "unsupported");
- ``flash_pytorch`` and ``sdpa`` (torch's own choice): what a CPU can run, for the smoke profile;
all timed in the same process by ``systems.measure.timer.time_fn`` (do_bench on a GPU: median and
10th / 90th percentiles), so the comparison is fair. TFLOP/s are model FLOPs
(``systems.measure.flops``: causal attention counts the pairs its mask keeps, the backward is 2x
the forward, FlashAttention's recomputed Q K^T is not counted). Rows are written as they are
produced, so an interrupted sweep keeps what it measured, and a sweep with a time budget writes
"skipped (budget)" rows for the points it could not afford.

``check_errors`` is the one correctness checker (notebook 06 and systems.bench.flash_tuning): an
implementation's O, dQ, dK, dV against float64 autograd of the direct formula.

    python -m systems.bench.flash --grid full --out build/flash/06_flash_attention_sweep.jsonl
    TRITON_INTERPRET=1 python -m systems.bench.flash --check --impls triton --dtypes fp32 fp16 --device cpu
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from systems.attention import BACKENDS
from systems.attention.naive import naive_attention
from systems.bench.budget import SKIPPED, Budget
from systems.bench.config import DEFAULT_OUT_ROOT, out_file_argument
from systems.measure import flops as flop_count
from systems.measure.devices import DTYPES, catch_oom, is_oom, release_memory, resolve_device, triton_interpreting
from systems.measure.results import ResultWriter, read_records
from systems.measure.timer import time_fn

IMPLS = ("triton", "naive", "sdpa_flash", "sdpa_cudnn")
PASSES = ("fwd", "bwd", "e2e")
FLOP_PASS = {"fwd": "fwd", "bwd": "bwd", "e2e": "fwd_bwd"}  # our pass names -> measure.flops'
SKIPPED_MEMORY = "skipped (memory)"

# The Triton implementations get_impl knows, as FlashVariant fields: our default (TMA kernels above
# flash_triton.TMA_MIN_SEQ, tf32x3 dots for fp32 unless torch allows TF32), named variants for timing
# the kernels side by side, the fp32 dot precisions, and the handout's compiled-PyTorch backward.
TRITON_VARIANTS = {"triton": {}, "triton_split": dict(forward="pointer", backward="split"),
                   "triton_atomic": dict(forward="pointer", backward="atomic"),
                   # the atomic backward (kernels_gluon.py's, with TMA reduce-adds, where it runs) after the TMA forward
                   "triton_atomic_tma": dict(forward="tma", backward="atomic"),
                   "triton_tma": dict(forward="tma", backward="tma"),  # Triton's TMA kernels only
                   "triton_gluon": dict(forward="tma", backward="gluon"),
                   "triton_tf32x3": dict(fp32_dot="tf32x3"), "triton_ieee": dict(fp32_dot="ieee"),
                   "triton_pytorch_bwd": dict(backward="pytorch"), "triton_per_head": dict(launch_order="per_head")}
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
# this project's implementations among systems.attention's backends; the others are baselines
OUR_BACKENDS = ("flash_pytorch", "flash_triton")


def is_ours(impl: str) -> bool:
    """Whether ``impl`` names one of this project's FlashAttention-2 implementations (a Triton
    variant, or a backend in OUR_BACKENDS) rather than a baseline (naive, SDPA's backends)."""
    return impl in TRITON_VARIANTS or impl in OUR_BACKENDS


def _sdpa_with(backend: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(q, k, v, is_causal):
        # only this backend: a config it cannot run raises (its "why not" warnings are
        # silenced; the row's status and error say it)
        with sdpa_kernel([chosen]), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return run


def _triton_variant(name: str):
    from systems.attention.flash_triton import FlashVariant

    return FlashVariant(**TRITON_VARIANTS[name])


def get_impl(name: str) -> Callable:
    """``fn(q, k, v, is_causal)`` for IMPLS, the named Triton variants of TRITON_VARIANTS, and the
    backends of systems.attention (``flash_pytorch``, ``sdpa``)."""
    if name in TRITON_VARIANTS:
        from systems.attention.flash_triton import flash_attention_triton

        variant = _triton_variant(name)
        return lambda q, k, v, is_causal: flash_attention_triton(q, k, v, is_causal=is_causal, variant=variant)
    if name in SDPA_BACKENDS:
        return _sdpa_with(SDPA_BACKENDS[name])
    if name in BACKENDS:
        return BACKENDS[name]
    known = [*TRITON_VARIANTS, *SDPA_BACKENDS, *BACKENDS]
    raise ValueError(f"unknown implementation {name!r}; choose one of {', '.join(dict.fromkeys(known))}")


def dot_of(impl: str, dtype: str) -> str:
    """How the implementation's matmuls multiply: the 16-bit dtype's tensor cores ("bf16", "fp16"),
    or for fp32 "ieee" (fp32 products on the CUDA cores), "tf32" or "tf32x3" (tensor cores). Torch's
    fp32 matmuls follow torch.backends.cuda.matmul.allow_tf32; ours FlashVariant.fp32_dot."""
    if dtype != "fp32":
        return dtype
    if impl in TRITON_VARIANTS:
        from systems.attention.flash_triton import dot_precision

        return dot_precision(torch.float32, _triton_variant(impl).fp32_dot)
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def naive_min_bytes(*, batch: int, heads: int, n_q: int, n_k: int, dtype: str) -> int:
    """A lower bound on naive attention's forward + backward memory: while the softmax's backward
    runs, the saved probabilities P, the incoming dP and the outgoing dS (three n_q x n_k matrices
    per (batch, head)) and the causal mask (one byte per pair) are all alive."""
    pairs = batch * heads * n_q * n_k
    return 3 * pairs * DTYPES[dtype].itemsize + n_q * n_k


def _is_unsupported(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (RuntimeError, ValueError, NotImplementedError)) and any(
        s in text for s in ("No available kernel", "No viable backend", "not supported", "unsupported", "No valid",
                            "cuDNN"))


def _error_text(exc: BaseException) -> str:
    first_line = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line[:200]}"


def _add_rates(row: dict) -> dict:
    """The TFLOP/s beside each measured pass: model FLOPs (systems.measure.flops) over the median."""
    for p in PASSES:
        ms = row.get(f"{p}_ms")
        work = flop_count.attention_flops(batch=row["batch"], heads=row["heads"], n_q=row["seq"], n_k=row["seq"],
                                          d=row["d"], causal=row["causal"], pass_=FLOP_PASS[p])
        row[f"{p}_tflops"] = work / (ms * 1e-3) / 1e12 if ms else None
    return row


def time_attention(impl: str, *, batch: int, heads: int, seq: int, d: int, dtype: str, is_causal: bool = True,
                   warmup_ms: float = 10, rep_ms: float = 50, min_reps: int = 3,
                   expected_ms: dict[str, float] | None = None, device: str = "cuda",
                   free_bytes: int | None = None) -> dict:
    """One row: median, p10 and p90 ms of the forward, the backward (of a kept graph) and both,
    with the TFLOP/s of each median, for one implementation and shape.

    q, k, v are (batch, heads, seq, d): every implementation takes that layout (ours treats the
    leading dims as a batch). ``expected_ms`` (per pass, e.g. scaled from a shorter sequence):
    each pass's repetition budget becomes at least ``min_reps`` calls, so long calls get a spread
    without a fixed budget costing seconds. ``free_bytes``: the device memory naive attention may
    use (default: what the device reports free). status is ok, oom, unsupported, error or
    "skipped (memory)"; passes measured before an OOM keep their times.
    """
    row: dict = dict(impl=impl, batch=batch, heads=heads, seq=seq, d=d, dtype=dtype, causal=is_causal,
                     dot=dot_of(impl, dtype), status="ok", error=None)
    if impl == "naive" and (free_bytes is not None or torch.device(device).type == "cuda"):
        need = naive_min_bytes(batch=batch, heads=heads, n_q=seq, n_k=seq, dtype=dtype)
        free = free_bytes if free_bytes is not None else torch.cuda.mem_get_info(device)[0]
        if need > free:
            row.update(status=SKIPPED_MEMORY, error=f"needs at least {need / 2**30:.1f} GiB (P, dP, dS and the "
                                                    f"mask), {free / 2**30:.1f} GiB free")
            return _add_rates(row)
    fn = get_impl(impl)
    q = k = v = do = out = None
    with catch_oom() as oom:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            shape = (batch, heads, seq, d)
            q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[dtype], generator=gen).requires_grad_()
                       for _ in range(3))
            do = torch.randn(shape, device=device, dtype=DTYPES[dtype], generator=gen)

            def fwd():
                return fn(q, k, v, is_causal)

            def timed(name: str, call: Callable, **kw) -> None:
                rep = max(rep_ms, min_reps * (expected_ms or {}).get(name, 0.0))
                stats = time_fn(call, device=device, warmup_ms=warmup_ms, rep_ms=rep, **kw)
                row[f"{name}_ms"], row[f"{name}_p10_ms"], row[f"{name}_p90_ms"] = (
                    stats["median_ms"], stats["p10_ms"], stats["p90_ms"])

            timed("fwd", fwd)
            out = fwd()
            timed("bwd", lambda: out.backward(do, retain_graph=True), grad_to_none=[q, k, v])
            out = None
            timed("e2e", lambda: fwd().backward(do), grad_to_none=[q, k, v])
        except Exception as exc:  # noqa: BLE001 - a row per failure; the sweep goes on (OOM: catch_oom's)
            if is_oom(exc):
                raise
            row["status"] = "unsupported" if _is_unsupported(exc) else "error"
            row["error"] = _error_text(exc)
    q = k = v = do = out = None  # drop the references before freeing the cache
    if oom:
        row.update(status="oom", error=oom.message)
    release_memory(torch.device(device))
    return _add_rates(row)


# ----------------------------------------------------------------------------- correctness

# (q shape, n_keys, causal): shapes that are not multiples of any tile, n_q != n_k (the queries are
# the last positions), extra leading dims, head dims 16..64 (the Triton kernels take 16..128)
CHECK_CASES = (((2, 100, 64), 100, True), ((2, 4, 77, 32), 130, True), ((3, 90, 16), 45, False))
ERROR_NAMES = ("O", "dQ", "dK", "dV")


def outputs_and_grads(fn: Callable, q, k, v, do, causal: bool) -> tuple[tuple, list]:
    """``fn(q, k, v, causal)``'s output O and dQ, dK, dV for the upstream gradient ``do``, and the
    shapes of the tensors O's autograd node saved (an autograd.Function's; native nodes have none),
    read before the backward frees them."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, causal)
    saved = [t.shape for t in getattr(out.grad_fn, "saved_tensors", ())]
    return (out.detach(), *torch.autograd.grad(out, leaves, do)), saved


def scaled_errors(got: tuple, want: tuple) -> dict:
    """Per ERROR_NAMES output: max |got - want| / max(1, max |want|) (absolute for values of order
    one, relative beyond)."""
    return {name: ((g.double() - w.double()).abs().max() / w.double().abs().max().clamp(min=1)).item()
            for name, g, w in zip(ERROR_NAMES, got, want)}


def check_errors(impl: str, *, shape_q: tuple[int, ...], n_k: int, causal: bool, dtype: str,
                 device: str = "cpu") -> dict:
    """One row: the largest error of O, dQ, dK, dV through ``impl`` against float64 autograd of the
    direct formula (scaled_errors), and whether the autograd graph saved the logsumexp L (a tensor
    shaped (..., n_q))."""
    gen = torch.Generator(device=device).manual_seed(sum(shape_q) + n_k)
    shape_k = (*shape_q[:-2], n_k, shape_q[-1])
    q, k, v, do = (torch.randn(s, device=device, generator=gen).to(DTYPES[dtype])
                   for s in (shape_q, shape_k, shape_k, shape_q))
    got, saved = outputs_and_grads(get_impl(impl), q, k, v, do, causal)
    want, _ = outputs_and_grads(naive_attention, *(t.double() for t in (q, k, v, do)), causal)
    errors = scaled_errors(got, want)
    return dict(impl=impl, dtype=dtype, dot=dot_of(impl, dtype), device=str(device), q_shape=list(shape_q), n_k=n_k,
                causal=causal, saves_lse=any(shape == q.shape[:-1] for shape in saved), **errors,
                worst=max(errors.values()))


def check_rows(*, impls: tuple[str, ...], dtypes: tuple[str, ...], cases=CHECK_CASES, device: str = "cpu",
               writer: ResultWriter | None = None) -> list[dict]:
    """check_errors for every (impl, dtype, case), each row written as it is produced."""
    rows = []
    for impl, dtype, (shape_q, n_k, causal) in itertools.product(impls, dtypes, cases):
        row = check_errors(impl, shape_q=shape_q, n_k=n_k, causal=causal, dtype=dtype, device=device)
        if writer is not None:
            writer.write(row)
        rows.append(row)
    return rows


def check_in_interpreter(*, out_path: str | Path, impls: tuple[str, ...] = ("triton",),
                         dtypes: tuple[str, ...] = ("fp32", "fp16"), timeout_s: float = 300) -> list[dict]:
    """check_rows for the Triton kernels on the CPU, through Triton's interpreter in a subprocess
    (TRITON_INTERPRET must be set before triton is imported, and must not leak into this process).
    The interpreter's dots are numpy's: fp32 is exact to rounding, and it has no bf16."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "systems.bench.flash", "--check", "--device", "cpu", "--out", str(out_path),
           "--impls", *impls, "--dtypes", *dtypes]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the interpreter check failed: {(proc.stdout + proc.stderr)[-1500:]}")
    return read_records(out_path)


# ----------------------------------------------------------------------------- the sweep


@dataclass
class SweepConfig:
    """The grid of flash_benchmarking (the handout's: batch 1, causal, powers of two)."""
    seq_lens: tuple[int, ...] = tuple(2**i for i in range(7, 17))  # 128 ... 65536
    head_dims: tuple[int, ...] = (16, 32, 64, 128)
    dtypes: tuple[str, ...] = ("bf16", "fp32")
    impls: dict[str, tuple[str, ...]] = field(default_factory=lambda: {
        "bf16": IMPLS, "fp32": ("triton", "triton_ieee", "naive", "sdpa_flash", "sdpa_cudnn")})
    batch: int = 1
    heads: int = 1
    is_causal: bool = True
    warmup_ms: float = 5
    rep_ms: float = 25  # short calls: hundreds of timed calls; long ones: min_reps
    min_reps: int = 3  # timed calls per pass at least, however long a call is
    budget_s: float | None = None  # the sweep's wall-clock budget; points past it are skipped
    # run over the whole grid before the others: the handout's table is ours against the baselines,
    # so a budget cut should take baselines' longest points, never ours
    first: tuple[str, ...] = ("triton",)
    extra: dict = field(default_factory=dict)  # stamped on every row (e.g. the profile)

    def __post_init__(self) -> None:
        unknown = [t for t in self.dtypes if t not in DTYPES]
        if unknown:
            raise ValueError(f"unknown dtypes {unknown}; choose from {', '.join(DTYPES)}")
        for name in ("seq_lens", "head_dims"):
            if not all(isinstance(n, int) and n > 0 for n in getattr(self, name)):
                raise ValueError(f"{name} must be positive integers, got {getattr(self, name)}")
        if self.min_reps < 1:
            raise ValueError(f"min_reps must be at least 1, got {self.min_reps}")
        known = {*TRITON_VARIANTS, *SDPA_BACKENDS, *BACKENDS}
        for dtype, impls in self.impls.items():
            if set(impls) - known:
                raise ValueError(f"unknown implementations {sorted(set(impls) - known)} for {dtype}; choose from "
                                 f"{', '.join(sorted(known))}")

    def points(self) -> list[tuple[str, int, int, str]]:
        """(dtype, d, seq, impl) in the order they run: the ``first`` implementations' points, then
        the others'; within each, by increasing length, every series at one length before the next,
        so the budget's estimates scale from a measured shorter point and a budget cut takes the
        longest (costliest) points of every series, not whole series."""
        grid = [(dtype, d, seq, impl) for seq in sorted(self.seq_lens) for dtype in self.dtypes
                for d in self.head_dims for impl in self.impls.get(dtype, IMPLS)]
        return [p for p in grid if p[3] in self.first] + [p for p in grid if p[3] not in self.first]


# do_bench's calls per pass besides the timed ones: the first call and five to estimate its length
_UNTIMED_CALLS = 6


def estimate_point_s(expected_ms: dict[str, float], cfg: SweepConfig) -> float:
    """Wall seconds to time one point whose passes take ``expected_ms``: per pass, do_bench's
    untimed calls, its warm-up (at least one call) and the timed repetitions (at least min_reps)."""
    total_ms = 0.0
    for ms in expected_ms.values():
        ms = max(ms, 1e-3)
        warm = max(1, int(cfg.warmup_ms / ms))
        reps = max(1, int(max(cfg.rep_ms, cfg.min_reps * ms) / ms))
        total_ms += (_UNTIMED_CALLS + warm + reps) * ms
    return total_ms / 1e3


# the error of an "unsupported" row the sweep inferred from its series' earlier refusal
NOT_TRIED = "not tried (past the budget)"


def _scaled(prev: dict | None, *, seq: int, cfg: SweepConfig) -> dict[str, float] | None:
    """The passes' expected ms at ``seq``: the same series' previous measured point scaled by the
    ratio of FLOPs (attention's work grows with the pairs it keeps)."""
    if prev is None or prev.get("status") != "ok":
        return None

    def pairs(n):
        return flop_count.attention_pairs(n, n, causal=cfg.is_causal)

    ratio = pairs(seq) / pairs(prev["seq"])
    return {p: prev[f"{p}_ms"] * max(ratio, 1.0) for p in PASSES if prev.get(f"{p}_ms")}


def flash_benchmarking(cfg: SweepConfig, *, writer: ResultWriter | None = None, progress: bool = True,
                       device: str = "cuda", clock: Callable[[], float] = time.perf_counter,
                       plans_writer: ResultWriter | None = None) -> pd.DataFrame:
    """Every (dtype, d, seq, impl) of the grid; each row goes to ``writer`` as soon as it exists.
    With ``cfg.budget_s``, a point whose estimated time (its series' previous point scaled by the
    FLOPs, estimate_point_s) would overrun the budget becomes a "skipped (budget)" row, or an
    "unsupported" one, not tried, where its series' backend refused the previous length.
    ``plans_writer``: after the sweep, one row per tile plan this process's Triton kernels ran
    with (``sweep_plans``), so that two runs whose times differ can be told apart by their
    autotuner's picks."""
    from tqdm.auto import tqdm

    budget = Budget(seconds=cfg.budget_s, clock=clock)
    rows: list[dict] = []
    last: dict[tuple, dict] = {}  # (impl, dtype, d) -> its latest row
    for dtype, d, seq, impl in tqdm(cfg.points(), desc="flash_benchmarking", disable=not progress):
        series = (impl, dtype, d)
        prev = last.get(series)
        expected = _scaled(prev, seq=seq, cfg=cfg)
        point = dict(batch=cfg.batch, heads=cfg.heads, seq=seq, d=d, dtype=dtype)
        if not budget.allows(need_s=estimate_point_s(expected, cfg) if expected else 0.0):
            if prev is not None and prev.get("status") == "unsupported":
                # a backend refuses a dtype or head size at any length: a row that said "skipped"
                # would hide that it could not have run (notebook 06's fp32 SDPA at 65,536 tokens)
                refused = prev.get("error") or ""
                status, error = "unsupported", (refused if refused.startswith(NOT_TRIED) else
                                                f"{NOT_TRIED}; at seq {prev['seq']}: {refused}")
            else:
                status, error = SKIPPED, f"estimated past the sweep's {cfg.budget_s:g} s budget"
            row = _add_rates(dict(impl=impl, **point, causal=cfg.is_causal, dot=dot_of(impl, dtype),
                                  status=status, error=error))
        else:
            row = time_attention(impl, **point, is_causal=cfg.is_causal, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms,
                                 min_reps=cfg.min_reps, expected_ms=expected, device=device)
        row = {**row, **cfg.extra}
        last[series] = row
        if writer is not None:
            writer.write(row)
        rows.append(row)
    if plans_writer is not None:
        for plan in sweep_plans(cfg):
            plans_writer.write(plan)
    return pd.DataFrame(rows)


def sweep_plans(cfg: SweepConfig) -> list[dict]:
    """The tile plans (kernel, dtype, autotune key, config, origin: ``flash_triton.tuned_plans``)
    this process holds, where the sweep runs a Triton variant; [] otherwise. The autotuner picks
    once per key and process (or reads the persisted plans), so these are the sweep's own picks,
    together with those of any Triton call before it in the process."""
    if not any(impl in TRITON_VARIANTS for impls in cfg.impls.values() for impl in impls):
        return []
    from systems.attention.flash_triton import tuned_plans

    return tuned_plans()


def full_profile_grid(*, budget_s: float | None = None) -> SweepConfig:
    """The handout's grid, as notebook 06's full profile runs it on one H100: seq 128 ... 65536 x
    d 16, 32, 64, 128 x {bf16, fp32}; fp32 times our kernels with their default (tf32x3) and with IEEE dots; 5 ms
    warm-up and 25 ms of repetitions per pass (at least 3 timed calls at long sequences)."""
    return SweepConfig(budget_s=budget_s)


def smoke_grid() -> SweepConfig:
    """What a CPU can time in seconds: the PyTorch FlashAttention against naive attention and
    torch's SDPA, fp32, two lengths and two head dims."""
    return SweepConfig(seq_lens=(128, 256), head_dims=(16, 32), dtypes=("fp32",),
                       impls={"fp32": ("flash_pytorch", "naive", "sdpa")}, warmup_ms=2, rep_ms=10)


# ----------------------------------------------------------------------------- compiling ahead


@dataclass(frozen=True)
class WarmCall:
    """One forward + backward of ``impl`` whose kernels ``prewarm`` compiles ahead: q is ``shape_q``,
    k and v have ``n_k`` rows (contiguous, as check_errors and time_attention make them)."""
    impl: str
    dtype: str
    shape_q: tuple[int, ...]
    n_k: int
    causal: bool

    def kernels_key(self) -> tuple:
        """What decides which kernels a Triton call compiles besides the variant: the dot
        precision, head dim, causality, the lengths' integer specialisation (a multiple of 16 or
        not) and whether the default variant runs the TMA kernels there. Calls sharing it share
        most of their compiles, so they go to one process: two processes compiling one kernel
        would waste a core."""
        from systems.attention.flash_triton import auto_prefers_tma

        n_q = self.shape_q[-2]
        return (dot_of(self.impl, self.dtype), self.shape_q[-1], self.causal, n_q % 16 == 0, self.n_k % 16 == 0,
                auto_prefers_tma(max(n_q, self.n_k), DTYPES[self.dtype]))


def check_warm_calls(*, impls: tuple[str, ...], dtypes: tuple[str, ...], cases=CHECK_CASES) -> list[WarmCall]:
    """The Triton calls of check_rows(impls, dtypes, cases)."""
    return [WarmCall(impl, dtype, tuple(shape_q), n_k, causal)
            for impl, dtype, (shape_q, n_k, causal) in itertools.product(impls, dtypes, cases)
            if impl in TRITON_VARIANTS]


def distinct_warm_calls(calls) -> list[WarmCall]:
    """The Triton calls among ``calls`` that compile something new: the shortest of each (impl,
    dtype, kernels_key) class (all its lengths compile the same kernels; the autotuner's
    candidates depend on the dtype and d, not the length)."""
    distinct = {}
    for call in sorted((c for c in calls if c.impl in TRITON_VARIANTS), key=lambda c: c.shape_q[-2]):
        distinct.setdefault((call.impl, call.dtype, call.kernels_key()), call)
    return list(distinct.values())


def sweep_warm_calls(cfg: SweepConfig) -> list[WarmCall]:
    """Calls that compile every kernel the sweep's Triton points will (distinct_warm_calls)."""
    return distinct_warm_calls(WarmCall(impl, dtype, (cfg.batch, cfg.heads, seq, d), seq, cfg.is_causal)
                               for dtype, d, seq, impl in cfg.points())


def prewarm(calls: list[WarmCall], *, device: str = "cuda", processes: int | None = None,
            timeout_s: float = 300.0) -> dict:
    """Compile ahead, in parallel processes, the kernels ``calls`` will need, so that this process
    finds them in Triton's (and inductor's) on-disk caches instead of compiling them one after
    another: a cold notebook 06 on an H100 spent most of its budget in compiles. Each worker runs
    its calls' forward + backward once and exits. Its autotuner picks tiles on a shared, busy GPU,
    so those picks are thrown away (the workers' FLASH_TRITON_CACHE_DIR is a temporary directory):
    this process still autotunes every key itself, with the compiles already done.

    Triton's cache directory is pinned in this process's environment (TRITON_CACHE_DIR, where
    unset, to Triton's default): the first torch.compile here would otherwise point it at
    inductor's own cache (inductor sets it where unset), and every compile after that would miss
    what the workers left. That happened to the first H100 run of notebook 06 with prewarm.

    Returns the calls, workers and seconds, and the calls that failed with their output's tail (a
    failure here is not a result: the check and the sweep still run, and report their own)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import triton

    from systems.attention.flash_triton.tuning import CACHE_ENV

    os.environ.setdefault("TRITON_CACHE_DIR", triton.knobs.cache.dir)

    jobs: dict[tuple, list[WarmCall]] = {}
    for call in calls:
        jobs.setdefault(call.kernels_key() if call.impl in TRITON_VARIANTS else (call.impl,), []).append(call)
    workers = max(1, min(len(jobs), processes or max(1, (os.cpu_count() or 2) - 1)))
    start = time.perf_counter()
    failed: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="flash_prewarm_") as plans:
        env = {**os.environ, CACHE_ENV: plans}

        def run(job: list[WarmCall]) -> None:
            spec = json.dumps([asdict(c) for c in job])
            cmd = [sys.executable, "-m", "systems.bench.flash", "--warm", spec, "--device", device]
            tail = run_leaving_nothing(cmd, env=env, timeout_s=timeout_s)
            if tail is not None:
                failed.append(dict(calls=[asdict(c) for c in job], error=tail))

        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(run, jobs.values()))
    return dict(calls=len(calls), jobs=len(jobs), workers=workers, seconds=time.perf_counter() - start,
                failed=failed)


def run_leaving_nothing(cmd: list[str], *, env: dict, timeout_s: float) -> str | None:
    """Run ``cmd`` in its own session and, once it has exited or timed out, kill whatever is left
    in that session: a worker killed mid-compile must not leave its compilers (ptxas, inductor's
    compile workers) competing for the CPU with the timed process. None when it succeeded, else
    its output's tail."""
    import signal

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        tail = None if proc.returncode == 0 else out[-800:]
    except subprocess.TimeoutExpired:
        tail = f"timed out after {timeout_s:g} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # nothing left in the session
            pass
        if proc.poll() is None:
            proc.wait()
    return tail


def run_warm_calls(calls: list[WarmCall], *, device: str) -> None:
    """A prewarm worker's work: one forward + backward per call."""
    for call in calls:
        fn = get_impl(call.impl)
        gen = torch.Generator(device=device).manual_seed(0)
        shape_k = (*call.shape_q[:-2], call.n_k, call.shape_q[-1])
        q, k, v = (torch.randn(s, device=device, generator=gen, dtype=DTYPES[call.dtype]).requires_grad_()
                   for s in (call.shape_q, shape_k, shape_k))
        fn(q, k, v, call.causal).sum().backward()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- the dot precision of fp32


def matmul_ceilings(*, n: int = 8192) -> list[dict]:
    """Measured cuBLAS rates of an n^3 matmul on this GPU, the ceilings of each dot precision: bf16
    (tensor cores), fp32 with TF32 off (IEEE products on the CUDA cores: what torch's fp32 matmuls
    run by default) and fp32 with TF32 on. torch's TF32 setting is restored afterwards."""
    from systems.measure.hardware import measure_matmul_tflops

    rows = [dict(dot="bf16", tflops=measure_matmul_tflops(n=n, dtype=torch.bfloat16))]
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for dot, tf32 in (("ieee", False), ("tf32", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            rows.append(dict(dot=dot, tflops=measure_matmul_tflops(n=n, dtype=torch.float32)))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return [dict(**r, n=n, what=f"cuBLAS {n}^3 matmul") for r in rows]


def matmul_kernels(impl: str, *, seq: int, d: int, dtype: str, trace_path: str | Path,
                   device: str = "cuda") -> pd.DataFrame:
    """What one forward + backward of ``impl`` runs, from torch.profiler read by the one trace
    reader: the GPU kernels (on a CPU, the operators) with their category, calls and total ms,
    longest first; where a cuBLAS kernel's name says "tf32", its products ran as TF32 on the
    tensor cores."""
    from torch.profiler import profile

    from systems.measure.devices import sync
    from systems.measure.profiler import categorize, export_trace, load_trace, parse_trace, profiler_activities

    fn = get_impl(impl)
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, 1, seq, d, device=dev, dtype=DTYPES[dtype], generator=gen).requires_grad_()
               for _ in range(3))
    fn(q, k, v, True).sum().backward()  # compile, autotune and allocate outside the profile
    sync(dev)
    with profile(activities=profiler_activities(dev)) as prof:
        fn(q, k, v, True).sum().backward()
        sync(dev)
    export_trace(prof, Path(trace_path))
    items, _ = parse_trace(load_trace(trace_path))
    items = items[items["kind"].isin(("kernel", "cpu_op"))].assign(category=lambda t: t["name"].map(categorize))
    table = items.groupby(["name", "category"], as_index=False).agg(calls=("dur", "size"), ms=("dur", "sum"))
    table["ms"] /= 1e3  # the trace's microseconds
    table["tf32"] = table["name"].str.contains("tf32", case=False)
    return table.assign(impl=impl, dtype=dtype, seq=seq, d=d).sort_values("ms", ascending=False, ignore_index=True)


# ----------------------------------------------------------------------------- leaderboard, targets

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


# The project's own speed targets (not the handout's) for the "beat cuDNN" work: over seq 1k-64k x
# d 64/128 (bf16, causal, batch 1), the geometric mean of baseline time / our time, per pass, should
# reach these; at the leaderboard shape our forward + backward should take at most
# LEADERBOARD_TARGET x cuDNN's time.
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
    """One row per column of ``speed_ratios``: its geometric mean over the points that ran, our
    target for that baseline, and whether the mean reaches it."""
    rows = []
    for col in ratios.columns:
        pass_, base = col.split(" vs ")
        vals = ratios[col].dropna()
        gm = float(np.exp(np.log(vals).mean())) if len(vals) else float("nan")
        target = targets.get(base)
        rows.append({"pass": pass_, "baseline": base, "points": len(vals), "missing": int(ratios[col].isna().sum()),
                     "geomean speed": gm, "our target": target,
                     "met": bool(gm >= target) if target is not None and len(vals) else None})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.flash", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check errors against float64 instead of timing")
    parser.add_argument("--grid", default="full", choices=["full", "smoke"], help="the sweep's grid (timing)")
    parser.add_argument("--budget-s", type=float, default=None, help="the sweep's time budget (timing)")
    parser.add_argument("--impls", nargs="+", default=None, help="implementations to check (default: triton)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES), help="dtypes to check")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=out_file_argument, default=None, help=f"JSON-lines results (default under {DEFAULT_OUT_ROOT}/flash/)")
    parser.add_argument("--warm", default=None, metavar="JSON",
                        help="a prewarm worker: run these WarmCalls (a JSON list) once and exit")
    args = parser.parse_args(argv)
    if args.warm is not None:
        try:
            calls = [WarmCall(**{**c, "shape_q": tuple(c["shape_q"])}) for c in json.loads(args.warm)]
        except (ValueError, TypeError, KeyError) as exc:
            parser.error(f"--warm takes a JSON list of WarmCall fields ({exc})")
        run_warm_calls(calls, device=args.device)
        return 0
    # every option is checked before the results file is started afresh (which moves the last
    # run's rows aside), so a bad one leaves that file as it was
    try:
        device = resolve_device(args.device)
        impls = tuple(args.impls or ("triton",))
        if args.check or args.impls:  # the sweep runs its grid's own; "triton" would import Triton for nothing
            for name in impls:
                get_impl(name)
    except ValueError as exc:
        parser.error(str(exc))
    if args.check and device.type != "cuda" and not triton_interpreting() and any(n in TRITON_VARIANTS for n in impls):
        parser.error("the Triton kernels run on a GPU (or under TRITON_INTERPRET=1); give --impls of the PyTorch "
                     "paths on a CPU")
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if not args.check and device.type == "cpu" and args.grid == "full":
        parser.error("the full grid times GPU kernels; use --grid smoke on a CPU")
    stem = "check" if args.check else f"sweep_{args.grid}"
    writer = ResultWriter(args.out or f"{DEFAULT_OUT_ROOT}/flash/06_flash_attention_{stem}.jsonl")
    if args.check:
        for row in check_rows(impls=impls, dtypes=tuple(args.dtypes), device=str(device), writer=writer):
            print(json.dumps({k: row[k] for k in ("impl", "dtype", "q_shape", "n_k", "causal", "worst")}), flush=True)
        return 0
    cfg = full_profile_grid() if args.grid == "full" else smoke_grid()
    cfg.budget_s = args.budget_s if args.budget_s is not None else cfg.budget_s
    sweep = flash_benchmarking(cfg, writer=writer, device=str(device))
    print(sweep.groupby(["impl", "status"]).size().to_string())
    print(f"rows: {writer.path}; config: {json.dumps(asdict(cfg), default=str)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
