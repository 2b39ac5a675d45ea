"""Tile-size exploration for the FlashAttention-2 Triton kernels, one kernel at a time.

The autotuner inside ``systems.attention.flash_triton`` picks among a short list of configs
per (sequence bucket, head dim, causal, dtype); this tool measures a longer list of candidates
for each kernel (forward, dK/dV, dQ, and the whole atomic backward) directly, next to torch SDPA's
flash and cuDNN backends at the same shapes, so the short list can be chosen from data. It launches
the kernels with explicit tile sizes, bypassing the autotuner, and writes one row per (shape,
kernel, candidate) as it goes.

    python -m systems.bench.flash_tuning --out build/flash/06_flash_attention_tuning.jsonl

``--compare-backward`` instead checks the Triton variants ("split", "atomic", the TMA-descriptor
forward + split pair, and that pair with the Gluon kernels where they run) against a float64 reference
(systems.bench.flash.check_errors), then times them through the public function (forward,
backward, forward + backward) and as bare kernel launches, next to SDPA cuDNN and SDPA flash in
the same process (``--paths`` picks a subset):

    python -m systems.bench.flash_tuning --compare-backward --out build/flash/06_flash_backward_compare.jsonl
    python -m systems.bench.flash_tuning --compare-backward --paths triton_split,triton_tma,sdpa_cudnn \
        --shape 1,16,16384,64 --out build/flash/06_flash_tma_compare.jsonl

Timings are ``systems.measure.timer.time_fn`` medians with 10th / 90th percentiles; TFLOP/s are
model FLOPs (``systems.measure.flops``), each kernel credited with the products it contributes to
its pass (``KERNEL_SHARE``), recomputation not counted.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from systems.bench.config import DEFAULT_OUT_ROOT, out_file_argument, shape_argument
from systems.measure import flops as flop_count
from systems.measure.devices import DTYPES, release_memory
from systems.measure.results import ResultWriter
from systems.measure.timer import time_fn


def _tiles(spec: str) -> list[tuple[int, int, int, int]]:
    """Candidates written as the notes write them, "rows x cols / warps / stages":
    "64x128/8/3, 128x64/4/4" -> [(64, 128, 8, 3), (128, 64, 4, 4)]."""
    out = []
    for item in spec.split(","):
        tile, warps, stages = item.strip().split("/")
        rows, cols = tile.split("x")
        out.append((int(rows), int(cols), int(warps), int(stages)))
    return out


# Per kernel, (block_m, block_n, num_warps, num_stages[, meta-parameters besides the kernel's
# tuning.OPTIONS]); for dK/dV block_m is the streamed query tile and block_n the resident key
# tile, for dQ block_m is the resident query tile.
TILE_CANDIDATES: dict[str, list[tuple]] = {
    "fwd": _tiles("64x64/4/4, 64x128/4/3, 128x64/8/3, 128x64/4/3, 128x128/8/3, 128x128/8/2, 128x32/4/4, 64x32/4/4"),
    "dkdv": _tiles("32x64/4/3, 64x64/4/3, 32x128/4/3, 32x128/8/3, 64x128/8/3, 64x128/8/2, 16x64/4/4, 16x128/4/4"),
    "dq": _tiles("64x64/4/3, 128x64/8/3, 128x64/4/3, 128x32/4/3, 128x32/8/4, 128x128/8/2, 64x32/4/4, 32x64/4/3"),
    # block_m the streamed query tile, block_n the resident key tile (which sets the atomic traffic);
    # the two leaders also with the dQ add not deferred (the kernel's default defers it by one query tile)
    "atomic": _tiles("64x128/8/3, 64x64/4/3, 64x128/8/2, 64x128/8/4, 32x128/8/3, 128x64/8/3")
              + [(64, 128, 8, 3, {"DEFER_DQ_ADD": False}), (64, 64, 4, 3, {"DEFER_DQ_ADD": False})],
    # the TMA-descriptor kernels (same tile meaning as their pointer twins): the pointer winners and
    # the 128x128 tiles and deeper pipelines that TMA loads leave registers for
    "fwd_tma": _tiles("128x128/8/3, 128x128/8/2, 128x64/8/3, 128x64/4/4, 64x128/4/3, 64x64/4/4, 128x128/8/4, 128x64/8/5"),
    # (entry 13 added the 128-query streamed tiles over 4 and 8 warps and the 64x64 tile's neighbours)
    "dkdv_tma": _tiles("64x128/8/3, 64x128/8/4, 128x128/8/2, 32x128/8/4, 64x64/4/3, 32x64/4/3, 64x128/8/2, 128x128/8/3, "
                       "128x64/4/3, 128x64/8/3, 64x64/4/4, 64x64/8/3"),
    "dq_tma": _tiles("128x64/8/3, 128x64/8/4, 128x128/8/2, 128x32/4/4, 64x64/4/3, 128x32/8/4, 128x128/8/3, 64x128/4/3"),
}


def _with(spec: str, **options) -> list[tuple]:
    """Candidates of _tiles' spec, each carrying ``options`` (meta-parameters besides the tiles)."""
    return [(*tile, dict(options)) for tile in _tiles(spec)]


# The loop-schedule options (notes entry 13), each on the tables' winners (the leaderboard shape's
# 64-row tiles and d = 128's larger ones) so they are timed beside the same tiles without them:
# FMA_SOFTMAX (the forward's scale folded into one multiply-add), EARLY_DP (the backward's dP product
# issued before the exponentials) and WS (Triton's warp specialisation of the TMA loops). The
# baselines carry the kernels' defaults, so FMA_SOFTMAX's are timed with it off.
SCHEDULE_CANDIDATES: dict[str, list[tuple]] = {
    "fwd": _with("64x128/4/3, 128x64/8/3", FMA_SOFTMAX=False),
    "dkdv": _with("64x64/4/3, 64x128/8/3", EARLY_DP=True),
    "dq": _with("64x64/4/3, 128x64/8/3", EARLY_DP=True),
    "fwd_tma": _with("64x128/4/3, 128x128/8/3", FMA_SOFTMAX=False) + _with("128x128/8/3", WS=True),
    "dkdv_tma": _with("64x64/4/3, 64x128/8/3", EARLY_DP=True) + _with("64x64/4/3, 64x128/8/3", WS=True),
    "dq_tma": _with("64x64/4/3, 128x64/8/3", EARLY_DP=True) + _with("64x64/4/3, 128x64/8/3", WS=True),
}
CANDIDATES = {kernel: tiles + SCHEDULE_CANDIDATES.get(kernel, []) for kernel, tiles in TILE_CANDIDATES.items()}


def schedule_candidates(kernel: str) -> list[tuple]:
    """SCHEDULE_CANDIDATES of ``kernel``, after the same tiles with the kernel's default options
    (the baseline each option is a ratio against, timed in the same run)."""
    options = SCHEDULE_CANDIDATES[kernel]
    baselines = list(dict.fromkeys(c[:4] for c in options))
    return baselines + options

# The kernels whose programs kernels._program_tile places, so the launch order's head group applies
LAUNCH_ORDER_KERNELS = ("fwd", "dkdv", "dq", "fwd_tma", "dkdv_tma", "dq_tma")
# The head groups --launch-order times each config with: 1 (longest tile first within each head),
# powers of two up to the leaderboard's 16 heads, and None, launch.head_group's rule for the shape
LAUNCH_ORDER_GROUPS = (1, 2, 4, 8, 16, None)


def launch_order_candidates(kernel: str, groups: tuple = LAUNCH_ORDER_GROUPS) -> list[tuple]:
    """Each 16-bit config of ``kernel``'s tuning table with each head group of ``groups`` (the
    candidate's "head_group", which ``launch`` passes to the launcher): the same tiles and
    options, only the order the programs launch in differs. A config's groups are timed back to
    back, so a clock that drifts over the run (a warming GPU) moves them alike."""
    from systems.attention.flash_triton import tuning

    if kernel not in LAUNCH_ORDER_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} for the launch order; choose one of {list(LAUNCH_ORDER_KERNELS)}")
    names = tuning.TILE_NAMES[kernel.removesuffix("_tma")]
    return [(c.kwargs[names[0]], c.kwargs[names[1]], c.num_warps, c.num_stages,
             {**{k: v for k, v in c.kwargs.items() if k not in names}, "head_group": group})
            for c in tuning.CONFIGS[kernel]["half"] for group in groups]


def head_group_ratios(rows: list[dict]) -> list[dict]:
    """Per (kernel, shape, config): the time under each head group over the time with one head a
    group (the order before groups), from explore's rows of one run; the rule's choice (rows whose
    candidate gave None) is the row "rule"."""
    def key(r):
        return (r["kernel"], r["batch"], r["seq"], r["d"], r["block_m"], r["block_n"], r["warps"], r["stages"],
                tuple(sorted((k, v) for k, v in r["meta"].items() if k != "head_group")))

    times: dict = {}
    for r in rows:
        if r.get("impl") == "triton" and r.get("status") == "ok" and "head_group" in (r.get("meta") or {}):
            label = "rule" if r["meta"]["head_group"] is None else r["meta"]["head_group"]
            times.setdefault(key(r), {})[label] = (r["ms"], r.get("head_group_used"))
    out = []
    for k, by_group in times.items():
        if 1 not in by_group:
            continue
        base = by_group[1][0]
        for label, (ms, used) in by_group.items():
            out.append(dict(kernel=k[0], batch=k[1], seq=k[2], d=k[3], tile=f"{k[4]}x{k[5]}/{k[6]}/{k[7]}",
                            group=label, group_used=used, ms=ms, ratio=ms / base))
    return out


# fp32 tiles hold twice the bytes of 16-bit ones, and with the default tf32x3 dots every product is
# three TF32 tensor-core products; the tuning tables' fp32 entries were chosen when fp32 ran IEEE
# dots on the CUDA cores, so these candidates surround them (smaller tiles give a batch-1 head more
# CTAs, larger ones fewer reloads)
FP32_CANDIDATES: dict[str, list[tuple]] = {
    "fwd": _tiles("64x64/4/3, 64x32/4/2, 32x64/4/2, 32x32/4/2, 64x64/8/2, 32x64/4/3, 32x128/4/2, 16x64/4/2"),
    "dkdv": _tiles("32x64/4/2, 32x32/4/2, 64x32/4/2, 16x32/4/2, 32x32/4/3, 32x32/2/2, 64x32/8/2, 32x16/4/2"),
    "dq": _tiles("64x32/4/2, 32x32/4/2, 32x64/4/2, 16x32/4/2, 16x64/4/2, 32x32/4/3, 64x64/8/2, 32x16/4/2"),
}

SHAPES = [(1, 1024, 64), (1, 4096, 64), (1, 16384, 64), (1, 65536, 64),
          (1, 1024, 128), (1, 4096, 128), (1, 16384, 128), (1, 65536, 128),
          (16, 16384, 64)]  # (batch, seq, head dim); the last is the leaderboard shape


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    do: torch.Tensor
    delta: torch.Tensor


def make_inputs(*, batch: int, seq: int, d: int, dtype: str, device: str = "cuda") -> Inputs:
    from systems.attention.flash_triton import flash_forward_triton

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(batch, seq, d, device=device, dtype=DTYPES[dtype], generator=gen) for _ in range(4))
    o, lse = flash_forward_triton(q, k, v, True)
    delta = (o.float() * do.float()).sum(-1)
    return Inputs(q, k, v, o, lse, do, delta)


# The model FLOPs (systems.measure.flops, in forward passes) each kernel is credited with: the
# forward's two products (S = Q K^T, P V) are one forward; the backward's four (dV = P^T dO,
# dP = dO V^T, dK = dS^T Q, dQ = dS K) are two. The dK/dV kernel produces dV, dP and dK, the dQ
# kernel dQ (the S and dP each recomputes are not counted), the atomic backward all four.
KERNEL_SHARE = {"fwd": 1.0, "dkdv": 1.5, "dq": 0.5, "atomic": 2.0, "fwd_tma": 1.0, "dkdv_tma": 1.5, "dq_tma": 0.5}


def launch(kernel: str, x: Inputs, cfg: tuple, *, is_causal: bool = True):
    """A zero-argument closure launching ``kernel`` once with the tile sizes of ``cfg``, through
    the kernel module's own launchers (its outputs are the closure's ``o``, ``dk``/``dv`` or ``dq``).
    "atomic" is the whole atomic backward (prep kernel, atomic kernel, cast), which replaces both
    the dQ and the dK/dV kernel; its closure also holds ``dq_acc`` and the ``delta`` it wrote."""
    from systems.attention import flash_triton as ft
    from systems.attention.flash_triton import tuning

    if kernel not in CANDIDATES:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {list(CANDIDATES)}")
    bm, bn, warps, stages = cfg[:4]
    options = dict(cfg[4]) if len(cfg) > 4 else {}
    order = {"head_group": options.pop("head_group")} if "head_group" in options else {}
    config = tuning.config_meta(tuning.tile_config(kernel, bm, bn, warps=warps, stages=stages, **options))
    tma = kernel.endswith("_tma")
    if tma and not ft.tma_usable(x.q, x.k, x.v, x.o, x.do):
        raise ValueError(f"{kernel}: these inputs cannot be read through TMA descriptors (see tma_usable)")
    if kernel in ("fwd", "fwd_tma"):
        o, lse = torch.empty_like(x.q), torch.empty_like(x.lse)
        return lambda: ft.launch_forward(x.q, x.k, x.v, o, lse, is_causal, config=config, tma=tma, **order)
    if kernel in ("dkdv", "dkdv_tma"):
        dk, dv = torch.empty_like(x.k), torch.empty_like(x.v)
        return lambda: ft.launch_dkdv(x.q, x.k, x.v, x.do, x.lse, x.delta, dk, dv, is_causal, config=config, tma=tma,
                                      **order)
    dq = torch.empty_like(x.q)
    delta = torch.empty_like(x.delta)  # the dQ kernel writes D; the dK/dV candidates read x.delta
    if kernel in ("dq", "dq_tma"):
        return lambda: ft.launch_dq(x.q, x.k, x.v, x.o, x.do, x.lse, delta, dq, is_causal, config=config, tma=tma,
                                    **order)
    if order:
        raise ValueError(f"{kernel}: head_group applies to {list(LAUNCH_ORDER_KERNELS)} only")
    dk, dv = torch.empty_like(x.k), torch.empty_like(x.v)
    dq_acc = torch.empty(x.q.shape, device=x.q.device, dtype=torch.float32)
    return lambda: ft.launch_backward_atomic(x.q, x.k, x.v, x.o, x.do, x.lse, delta, dq_acc, dq, dk, dv, is_causal,
                                             config=config)


def explore(*, shapes=SHAPES, candidates=CANDIDATES, dtype: str = "bf16", out_path: str | None = None,
            rep_ms: float = 30) -> list[dict]:
    """Every candidate of every kernel at every shape, plus SDPA flash / cuDNN fwd and bwd."""
    from systems.attention.flash_triton import dot_precision, tuning
    from systems.attention.flash_triton.launch import resolve_head_group
    from systems.bench.flash import time_attention

    writer = ResultWriter(out_path) if out_path else None
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        if writer is not None:
            writer.write(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    for batch, seq, d in shapes:
        shape = dict(batch=batch, seq=seq, d=d, dtype=dtype)
        fwd_flops = flop_count.attention_flops(batch=batch, heads=1, n_q=seq, n_k=seq, d=d, causal=True)
        for impl in ("naive",) if dtype == "fp32" else ("sdpa_flash", "sdpa_cudnn"):  # SDPA's take no fp32
            r = time_attention(impl, batch=batch, heads=1, seq=seq, d=d, dtype=dtype, rep_ms=rep_ms)
            emit(dict(**shape, kernel="baseline", impl=impl, status=r["status"], fwd_ms=r.get("fwd_ms"),
                      bwd_ms=r.get("bwd_ms"), e2e_ms=r.get("e2e_ms")))
        x = make_inputs(batch=batch, seq=seq, d=d, dtype=dtype)
        for kernel, cands in candidates.items():
            flops = fwd_flops * KERNEL_SHARE[kernel]
            for cfg in cands:
                row = dict(**shape, kernel=kernel, impl="triton", dot=dot_precision(DTYPES[dtype]),
                           block_m=cfg[0], block_n=cfg[1],
                           warps=cfg[2], stages=cfg[3], meta={**tuning.kernel_options(kernel), **(cfg[4:] or [{}])[0]},
                           status="ok")
                if "head_group" in row["meta"]:  # what the launcher ran with (None: the rule's choice)
                    row["head_group_used"] = resolve_head_group(x.q, x.k, row["meta"]["head_group"])
                try:
                    fn = launch(kernel, x, cfg)
                    fn()
                    stats = time_fn(fn, device="cuda", warmup_ms=5, rep_ms=rep_ms)
                    ms = stats["median_ms"]
                    row.update(ms=ms, p10_ms=stats["p10_ms"], p90_ms=stats["p90_ms"], tflops=flops / (ms * 1e-3) / 1e12)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: a row, go on
                    row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                emit(row)
        del x
        release_memory()
    return rows


def host_overhead(*, shapes=((1, 1024, 64), (1, 4096, 128)), dtype: str = "bf16", calls: int = 200,
                  device: str = "cuda") -> list[dict]:
    """Host (CPU) time per call of each path, the GPU left to run behind: microseconds to enqueue
    our public forward, our public forward + backward, one direct forward-kernel launch, and SDPA's
    forward + backward. When a path's host time exceeds its kernels' device time, the GPU waits
    and the path's measured latency is the host time (the short-sequence points of the sweep)."""
    import time

    from systems.attention.flash_triton import flash_attention_triton
    from systems.bench.flash import get_impl

    rows = []
    for batch, seq, d in shapes:
        x = make_inputs(batch=batch, seq=seq, d=d, dtype=dtype, device=device)
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        sdpa = get_impl("sdpa_flash")
        paths = {
            "public_fwd": lambda: flash_attention_triton(x.q, x.k, x.v, is_causal=True),
            "public_fwd_bwd": lambda: flash_attention_triton(q, k, v, is_causal=True).backward(x.do),
            "kernel_fwd": launch("fwd", x, CANDIDATES["fwd"][1]),
            "sdpa_flash_fwd_bwd": lambda: sdpa(q[None], k[None], v[None], True).backward(x.do[None]),
        }
        for name, fn in paths.items():
            fn()  # compile, autotune, allocate outside the timed loop
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host_s = time.perf_counter() - t0  # enqueue time only: no synchronisation inside
            if device == "cuda":
                torch.cuda.synchronize()
            total_s = time.perf_counter() - t0
            rows.append(dict(batch=batch, seq=seq, d=d, dtype=dtype, path=name, calls=calls,
                             host_us_per_call=host_s / calls * 1e6, wall_us_per_call=total_s / calls * 1e6))
            q.grad = k.grad = v.grad = None
    return rows


# The two Triton backwards side by side (docs/flash_attention_notes.md, entry 4).
# Points timed, as (batch, heads, seq, d): the leaderboard shape, then batch 1 at three lengths x
# the sweep target's two head dims
COMPARE_SHAPES = [(1, 16, 16384, 64), (1, 1, 4096, 64), (1, 1, 16384, 64), (1, 1, 65536, 64),
                  (1, 1, 4096, 128), (1, 1, 16384, 128), (1, 1, 65536, 128)]
# (q shape, n_keys, causal) checked before any timing: several heads at d 64, and d 128; both
# compile the kernels the timings use (a case with a new head dim would cost its own compiles)
CHECK_CASES = [((2, 3, 1000, 64), 1000, True), ((2, 1024, 128), 1024, True)]
COMPARE_PATHS = ("triton_split", "triton_atomic", "triton_tma", "triton_gluon", "sdpa_cudnn", "sdpa_flash")
# each Triton path's bare launches, as time_backwards names them: the backward as one closure, then
# its launches one by one ("triton_tma" also times both forwards, its change being in the forward too)
KERNEL_ROWS = {"triton_split": ("kernels_split", ("part_dq", "part_dkdv")),
               "triton_atomic": ("kernels_atomic", ("part_prep", "part_atomic", "part_atomic_gluon", "part_cast")),
               "triton_tma": ("kernels_tma", ("part_fwd", "part_fwd_tma", "part_dq_tma", "part_dkdv_tma")),
               "triton_gluon": ("kernels_gluon", ("part_dq_gluon", "part_dkdv_gluon"))}
PASS_NAMES = ("fwd", "bwd", "e2e")


def check_backwards(*, cases=CHECK_CASES, dtype: str = "bf16", device: str = "cuda", tol: float = 3e-2,
                    paths: tuple[str, ...] = tuple(KERNEL_ROWS)) -> list[dict]:
    """systems.bench.flash.check_errors (O, dQ, dK, dV against float64, divided by max(1, max
    |reference|)) through each Triton path of ``paths``, with a status: "ok" within ``tol``, else "error".

    tol: the tests' bf16 bound (8 mantissa bits, ~4e-3 per rounding; P and dS are rounded to the
    input dtype before the tensor-core dots)."""
    from systems.bench.flash import check_errors

    rows = []
    for shape_q, n_k, causal in cases:
        for path in paths:
            row = check_errors(path, shape_q=shape_q, n_k=n_k, causal=causal, dtype=dtype, device=device)
            rows.append(dict(kind="check", **row, tol=tol, status="ok" if row["worst"] <= tol else "error"))
    release_memory()
    return rows


def _bench(fn, *, warmup_ms: float, rep_ms: float) -> dict:
    """Median, 10th and 90th percentile ms of ``fn`` (time_fn); its first call (compiles,
    autotunes, allocates) runs before, whose length would otherwise skew the repetition count."""
    fn()
    torch.cuda.synchronize()
    stats = time_fn(fn, device="cuda", warmup_ms=warmup_ms, rep_ms=rep_ms)
    return dict(ms=stats["median_ms"], p10_ms=stats["p10_ms"], p90_ms=stats["p90_ms"])


def time_backwards(*, shapes=COMPARE_SHAPES, dtype: str = "bf16", warmup_ms: float = 25, rep_ms: float = 100,
                   emit=print, paths: tuple[str, ...] = COMPARE_PATHS) -> list[dict]:
    """Per shape (causal): fwd, bwd and fwd+bwd ms of each of ``paths`` through its public
    function (systems.bench.flash.time_attention: the backward of a retained graph; time_fn
    medians), then the Triton paths' backwards as bare kernel launches (no autograd, no allocation:
    the GPU time the launches themselves take), KERNEL_ROWS names which."""
    from systems.attention import flash_triton as ft
    from systems.bench.flash import time_attention

    rows = []
    for batch, heads, seq, d in shapes:
        point = dict(batch=batch, heads=heads, seq=seq, d=d, dtype=dtype)
        bwd_flops = flop_count.attention_flops(batch=batch, heads=heads, n_q=seq, n_k=seq, d=d, causal=True,
                                               pass_="bwd")
        bench = dict(warmup_ms=warmup_ms, rep_ms=rep_ms)
        for path in paths:
            row = dict(kind="time", **time_attention(path, batch=batch, heads=heads, seq=seq, d=d, dtype=dtype,
                                                     **bench))
            rows.append(row)
            emit(row)

        x = make_inputs(batch=batch * heads, seq=seq, d=d, dtype=dtype)
        dq, dk, dv = torch.empty_like(x.q), torch.empty_like(x.k), torch.empty_like(x.v)
        delta = torch.empty_like(x.delta)
        dq_acc = torch.empty(x.q.shape, device="cuda", dtype=torch.float32)
        lse2 = torch.empty_like(x.lse)  # the atomic kernel's L in base 2, as the prep kernel writes it
        ft.launch_bwd_prep(x.o, x.do, x.lse, delta, lse2, dq_acc)

        def split():
            ft.launch_dq(x.q, x.k, x.v, x.o, x.do, x.lse, delta, dq, True)
            ft.launch_dkdv(x.q, x.k, x.v, x.do, x.lse, delta, dk, dv, True)

        def atomic():
            ft.launch_backward_atomic(x.q, x.k, x.v, x.o, x.do, x.lse, delta, dq_acc, dq, dk, dv, True)

        tma = ft.tma_usable(x.q, x.k, x.v, x.o, x.do)
        o, lse = torch.empty_like(x.o), torch.empty_like(x.lse)

        # each Gluon kernel where the public backward would run it, else the TMA kernel again
        gluon = {kernel: ft.FlashVariant(backward="gluon").backward_gluon(kernel, x.q, x.k, x.v, x.o, x.do)
                 for kernel in ("dq", "dkdv")}
        atomic_gluon = ft.FlashVariant(backward="atomic").atomic_gluon(x.q, x.k, x.v, x.o, x.do)

        def part_dq_tma(use_gluon: bool = False):
            ft.launch_dq(x.q, x.k, x.v, x.o, x.do, x.lse, delta, dq, True, tma=tma, gluon=use_gluon)

        def part_dkdv_tma(use_gluon: bool = False):
            ft.launch_dkdv(x.q, x.k, x.v, x.do, x.lse, delta, dk, dv, True, tma=tma, gluon=use_gluon)

        def split_tma(use_gluon: dict[str, bool] = dict.fromkeys(gluon, False)):
            part_dq_tma(use_gluon["dq"])
            part_dkdv_tma(use_gluon["dkdv"])

        # and each launch on its own (the atomic kernel re-adds into dq_acc: the sums grow, the time does not)
        closures = {
            "kernels_split": split, "kernels_atomic": atomic, "kernels_tma": split_tma,
            "kernels_gluon": lambda: split_tma(gluon),
            "part_dq": lambda: ft.launch_dq(x.q, x.k, x.v, x.o, x.do, x.lse, delta, dq, True),
            "part_dkdv": lambda: ft.launch_dkdv(x.q, x.k, x.v, x.do, x.lse, delta, dk, dv, True),
            "part_prep": lambda: ft.launch_bwd_prep(x.o, x.do, x.lse, delta, lse2, dq_acc),
            "part_atomic": lambda: ft.launch_atomic(x.q, x.k, x.v, x.do, lse2, delta, dk, dv, dq_acc, True),
            "part_atomic_gluon": lambda: ft.launch_atomic(x.q, x.k, x.v, x.do, lse2, delta, dk, dv, dq_acc, True,
                                                          gluon=atomic_gluon),
            "part_cast": lambda: torch.mul(dq_acc, d ** -0.5, out=dq),
            "part_fwd": lambda: ft.launch_forward(x.q, x.k, x.v, o, lse, True),
            "part_fwd_tma": lambda: ft.launch_forward(x.q, x.k, x.v, o, lse, True, tma=tma),
            "part_dq_tma": part_dq_tma, "part_dq_gluon": lambda: part_dq_tma(gluon["dq"]),
            "part_dkdv_tma": part_dkdv_tma, "part_dkdv_gluon": lambda: part_dkdv_tma(gluon["dkdv"]),
        }
        wanted = [KERNEL_ROWS[p][0] for p in paths if p in KERNEL_ROWS]
        wanted += [part for p in paths if p in KERNEL_ROWS for part in KERNEL_ROWS[p][1]]
        for name in wanted:
            fn = closures[name]
            row = dict(kind="time", **point, impl=name, status="ok")
            pass_ = "fwd" if name.startswith("part_fwd") else "bwd"
            row.update({f"{pass_}_{stat}": val for stat, val in _bench(fn, **bench).items()})  # fwd_ms, fwd_p10_ms, ...
            if name.startswith("kernels_"):
                row["bwd_tflops"] = bwd_flops / (row["bwd_ms"] * 1e-3) / 1e12
            if name.endswith("_tma"):
                row["tma"] = tma  # False: the pointer kernels ran (the inputs cannot take descriptors)
            if name.endswith("_gluon"):
                row["gluon"] = gluon  # per kernel, False: the Triton TMA (or pointer) kernel ran instead
            rows.append(row)
            emit(row)
        x = dq = dk = dv = delta = dq_acc = o = lse = None
        release_memory()
    return rows


def stored_plans() -> list[dict]:
    """The kernels' chosen configs so far, one row per (kernel, dtype, autotune key)."""
    from systems.attention.flash_triton import tuned_plans

    return [dict(kind="plan", **row) for row in tuned_plans()]


def compare_table(rows: list[dict]) -> str:
    """Text table: per shape and pass, each path's median ms and its ratio to SDPA cuDNN's
    (below 1: faster than cuDNN); then per path and pass the geometric mean over the batch-1
    points of cuDNN ms / path ms (the sweep target's direction: above 1 is faster)."""
    import math

    timed = [r for r in rows if r.get("kind") == "time" and r.get("status") == "ok"]
    shapes = sorted({(r["batch"], r["heads"], r["seq"], r["d"]) for r in timed},
                    key=lambda s: (s[0] * s[1] == 1, s[3], s[2]))
    by = {(r["batch"], r["heads"], r["seq"], r["d"], r["impl"]): r for r in timed}
    present = {r["impl"] for r in timed}
    impls = [i for i in (*COMPARE_PATHS, *(k for k, _ in KERNEL_ROWS.values())) if i in present]
    lines = [f"{'shape (b,h,seq,d)':>22} {'pass':>4} " + " ".join(f"{i:>22}" for i in impls)]
    parts = sorted({r["impl"] for r in timed if r["impl"].startswith("part_")})
    speedups: dict = {}
    for shape in shapes:
        for p in PASS_NAMES:
            base = by.get((*shape, "sdpa_cudnn"), {}).get(f"{p}_ms")
            cells = []
            for impl in impls:
                ms = by.get((*shape, impl), {}).get(f"{p}_ms")
                if ms is None:
                    cells.append(f"{'-':>22}")
                    continue
                ratio = f"{ms / base:5.2f}x" if base else "  n/a "
                cells.append(f"{ms:10.3f} ms {ratio:>8}")
                if base and shape[0] * shape[1] == 1:
                    speedups.setdefault((impl, p), []).append(base / ms)
            lines.append(f"{str(shape):>22} {p:>4} " + " ".join(cells))
        if parts:  # the backward's launches one by one
            lines.append(f"{'':>22} bwd launches: " + ", ".join(
                f"{i[5:]} {by[(*shape, i)].get('bwd_ms') or by[(*shape, i)].get('fwd_ms'):.3f} ms"
                for i in parts if (*shape, i) in by))
    lines.append("geometric mean over the batch-1 points of cuDNN ms / path ms (> 1: faster than cuDNN):")
    for (impl, p), vals in sorted(speedups.items()):
        gm = math.exp(sum(math.log(x) for x in vals) / len(vals))
        lines.append(f"  {impl:>16} {p:>4}: {gm:.3f} over {len(vals)} points")
    return "\n".join(lines)


def compare_backwards(*, shapes=COMPARE_SHAPES, dtype: str = "bf16", check: bool = True, warmup_ms: float = 25,
                      rep_ms: float = 100, out_path: str | None = None,
                      paths: tuple[str, ...] = COMPARE_PATHS) -> list[dict]:
    """check_backwards (unless ``check`` is False), then time_backwards and stored_plans, each row
    written to ``out_path`` as it is produced; prints compare_table at the end."""
    writer = ResultWriter(out_path) if out_path else None
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if writer is not None:
            writer.write(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    if check:
        for row in check_backwards(dtype=dtype, paths=tuple(p for p in paths if p in KERNEL_ROWS)):
            emit(row)
    time_backwards(shapes=shapes, dtype=dtype, warmup_ms=warmup_ms, rep_ms=rep_ms, emit=emit, paths=paths)
    for row in stored_plans():
        emit(row)
    print(compare_table(rows), flush=True)
    return rows


def best_configs(rows: list[dict]) -> dict:
    """(kernel, batch, seq, d) -> the fastest candidate's (block_m, block_n, warps, stages[, meta]) and ms."""
    best: dict = {}
    for r in rows:
        if r.get("impl") != "triton" or r.get("status") != "ok":
            continue
        key = (r["kernel"], r["batch"], r["seq"], r["d"])
        if key not in best or r["ms"] < best[key][1]:
            extra = (r["meta"],) if r.get("meta") else ()
            best[key] = ((r["block_m"], r["block_n"], r["warps"], r["stages"], *extra), r["ms"])
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=out_file_argument, default=f"{DEFAULT_OUT_ROOT}/flash/06_flash_attention_tuning.jsonl")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                        help="fp32: the exploration times FP32_CANDIDATES with the default (tf32x3) dots")
    parser.add_argument("--rep-ms", type=float, default=30)
    parser.add_argument("--host-overhead", action="store_true",
                        help="only measure the host time per call of each path (see host_overhead)")
    parser.add_argument("--compare-backward", action="store_true",
                        help="check and time the Triton variants (split, atomic, TMA) against SDPA (compare_backwards)")
    parser.add_argument("--no-check", action="store_true", help="--compare-backward without the correctness check")
    parser.add_argument("--paths", default=",".join(COMPARE_PATHS),
                        help=f"comma-separated paths --compare-backward checks and times, of {list(COMPARE_PATHS)}")
    parser.add_argument("--shape", action="append", type=shape_argument("B,H,SEQ,D"), metavar="B,H,SEQ,D",
                        help="a point to measure (repeatable); default: COMPARE_SHAPES for --compare-backward, "
                             "SHAPES for the exploration (where B x H is the batch)")
    parser.add_argument("--schedule", action="store_true",
                        help="time only the loop-schedule options (SCHEDULE_CANDIDATES) beside the same tiles "
                             "without them")
    parser.add_argument("--launch-order", action="store_true",
                        help="time each 16-bit config of the tuning tables under each launch-order head group "
                             "(launch_order_candidates) and print the ratios to one head a group")
    parser.add_argument("--kernels", default=None,
                        help=f"comma-separated kernels whose candidates the exploration times, of {list(CANDIDATES)} "
                             f"(fp32: of {list(FP32_CANDIDATES)}); default: all")
    args = parser.parse_args(argv)
    if (args.schedule or args.launch_order) and args.dtype == "fp32":
        parser.error("--schedule and --launch-order time 16-bit candidates; drop --dtype fp32")
    if args.schedule and args.launch_order:
        parser.error("--schedule and --launch-order are two explorations; give one")
    if not torch.cuda.is_available():
        parser.error("the exploration times GPU kernels and needs CUDA")
    if args.compare_backward:
        paths = tuple(args.paths.split(","))
        unknown = sorted(set(paths) - set(COMPARE_PATHS))
        if unknown:
            parser.error(f"unknown paths {unknown}; choose from {list(COMPARE_PATHS)}")
        compare_backwards(shapes=args.shape or COMPARE_SHAPES, dtype=args.dtype, check=not args.no_check,
                          rep_ms=args.rep_ms, out_path=args.out, paths=paths)
        return 0
    if args.host_overhead:
        writer = ResultWriter(args.out)
        for row in host_overhead(dtype=args.dtype):
            writer.write(row)
            print(f"{row['path']:>20} seq {row['seq']:6d} d {row['d']:3d}: host {row['host_us_per_call']:8.1f} us, "
                  f"wall {row['wall_us_per_call']:8.1f} us per call")
        return 0
    if args.schedule:
        table = {kernel: schedule_candidates(kernel) for kernel in SCHEDULE_CANDIDATES}
    elif args.launch_order:
        table = {kernel: launch_order_candidates(kernel) for kernel in LAUNCH_ORDER_KERNELS}
    else:
        table = FP32_CANDIDATES if args.dtype == "fp32" else CANDIDATES
    kernels = args.kernels.split(",") if args.kernels else list(table)
    unknown = sorted(set(kernels) - set(table))
    if unknown:
        parser.error(f"unknown kernels {unknown} for {args.dtype}; choose from {list(table)}")
    shapes = [(b * h, seq, d) for b, h, seq, d in args.shape] if args.shape else SHAPES
    rows = explore(shapes=shapes, candidates={k: table[k] for k in kernels}, dtype=args.dtype,
                   out_path=args.out, rep_ms=args.rep_ms)
    for (kernel, batch, seq, d), (cfg, ms) in sorted(best_configs(rows).items(),
                                                     key=lambda kv: (kv[0][0], kv[0][3], kv[0][1], kv[0][2])):
        print(f"best {kernel:5s} batch {batch:2d} seq {seq:6d} d {d:3d}: {cfg} {ms:.4f} ms")
    if args.launch_order:
        for r in head_group_ratios(rows):
            used = f" (= {r['group_used']})" if r["group"] == "rule" else ""
            print(f"head_group {r['kernel']:8s} ({r['batch']}, {r['seq']}, {r['d']}) {r['tile']:>10s} "
                  f"{r['group']!s:>4s}{used}: {r['ms']:.4f} ms ({r['ratio']:.3f}x one head a group)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

