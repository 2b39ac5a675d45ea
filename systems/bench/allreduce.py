"""distributed_communication_single_node: all-reduce latency and bandwidth vs size and world size.

For each (backend, world size) one group of ranks is started; it all-reduces fp32 tensors of each
size: warm-up calls and a synchronisation, then timed calls, each after a barrier (so ranks start
together) and timed to its completion (CUDA events on GPU, wall time on CPU). Every rank's times
are gathered on rank 0 with all_gather_object.

Bandwidths follow nccl-tests: algbw = size / time; busbw = algbw * 2 (n - 1) / n, the traffic
each link of a ring all-reduce carries, comparable across world sizes and with link peaks.

Rows go to the output file one by one, as rank 0 measures them, and nothing in it is ever
deleted: an interrupted run keeps every case it finished, and running the same command again
resumes, skipping the cases the file already holds for this machine (``--append`` measures them
again). The default file is under build/allreduce/, never the committed results/.

    python -m systems.bench.allreduce --backend gloo --world-sizes 2 --sizes-mb 1 10
    python -m systems.bench.allreduce --out results/13_allreduce_nccl_8xH200.jsonl   # on 8 GPUs
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from systems.bench.config import out_file_argument, run_cli
from systems.config import check_choice
from systems.measure.env import environment
from systems.measure.results import ResultWriter, read_records
from systems.measure.timer import Marks, slowest_rank_median
from systems.parallel.launch import DistContext, all_gather_objects, resolve_backend, spawn

MB = 1_000_000  # the handout's 1 MB ... 1 GB are decimal sizes
HANDOUT_SIZES_BYTES = (1 * MB, 10 * MB, 100 * MB, 1000 * MB)
HANDOUT_WORLD_SIZES = (2, 4, 6)
WARMUP = 5
DEFAULT_OUT = "build/allreduce/allreduce.jsonl"
EXISTING = ("resume", "append", "replace")


@dataclass(frozen=True)
class Case:
    backend: str
    world_size: int
    size_bytes: int


@dataclass
class Plan:
    """What a machine can run, and why the rest is left out."""

    run: list[Case]
    not_run: list[tuple[Case, str]]


def plan_cases(*, backends: Sequence[str], world_sizes: Sequence[int] = HANDOUT_WORLD_SIZES,
               sizes_bytes: Sequence[int] = HANDOUT_SIZES_BYTES, n_gpus: int | None = None,
               max_gloo_world_size: int | None = None, max_gloo_bytes: int | None = None) -> Plan:
    """Split the handout grid into runnable cases and (case, reason) pairs.

    nccl runs one process per GPU, so a world size above the GPU count is not run. gloo limits are
    the caller's budget for a CPU run (e.g. a 2-core smoke box); None means no limit.
    """
    if n_gpus is None:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = Plan(run=[], not_run=[])
    for backend in backends:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        for ws in world_sizes:
            for size in sizes_bytes:
                case = Case(backend, int(ws), int(size))
                reason = None
                if backend == "nccl" and ws > n_gpus:
                    reason = f"needs {ws} GPUs (one process per GPU), this machine has {n_gpus}"
                elif backend == "gloo" and max_gloo_world_size is not None and ws > max_gloo_world_size:
                    reason = f"gloo world size capped at {max_gloo_world_size} for this profile's CPU budget"
                elif backend == "gloo" and max_gloo_bytes is not None and size > max_gloo_bytes:
                    reason = f"gloo sizes capped at {max_gloo_bytes / MB:g} MB for this profile's CPU budget"
                if reason:
                    plan.not_run.append((case, reason))
                else:
                    plan.run.append(case)
    return plan


def notebook_plan(*, profile: str, n_gpus: int) -> tuple[Plan, dict]:
    """Notebook 07's cases and per-case budget. Full: NCCL at every handout world size the GPUs
    allow, and gloo on the host's CPU up to 100 MB (1 GB over gloo takes seconds per call); smoke:
    gloo on 2 CPU processes up to 10 MB. Committed runs on larger machines fill in the rest."""
    if profile == "full":
        return (plan_cases(backends=["nccl", "gloo"], n_gpus=n_gpus, max_gloo_bytes=100 * MB),
                dict(budget_s=0.5, min_iters=5, max_iters=50))
    return (plan_cases(backends=["gloo"], n_gpus=0, max_gloo_world_size=2, max_gloo_bytes=10 * MB),
            dict(budget_s=0.3, min_iters=3, max_iters=10))


def bus_bandwidth_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


def _iters_for(warm_s: float, *, budget_s: float, min_iters: int, max_iters: int) -> int:
    return int(max(min_iters, min(max_iters, budget_s / max(warm_s, 1e-9))))


def _bench_worker(ctx: DistContext, sizes_bytes: list[int], budget_s: float, min_iters: int,
                  max_iters: int, out_path: str) -> list[dict]:
    """One rank: every size at this world size. Rank 0 appends each row to ``out_path`` as soon as
    it is measured, and returns them ([] on the other ranks)."""
    writer = ResultWriter(out_path, overwrite=False) if ctx.is_main else None
    rows = []
    for size in sizes_bytes:
        numel = size // 4
        data = torch.full((numel,), float(ctx.rank + 1), dtype=torch.float32, device=ctx.device)
        ctx.barrier()
        start = time.perf_counter()
        for _ in range(WARMUP):
            dist.all_reduce(data)
        ctx.sync()
        # iteration count from the slowest rank's warm-up, so every rank runs the same number
        warm = torch.tensor([(time.perf_counter() - start) / WARMUP], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(warm, op=dist.ReduceOp.MAX)
        iters = _iters_for(warm.item(), budget_s=budget_s, min_iters=min_iters, max_iters=max_iters)
        # refilled before each call so values stay finite; the last call is checked against the
        # known sum 1 + 2 + ... + n
        data.fill_(float(ctx.rank + 1))
        times = []
        for _ in range(iters):
            ctx.barrier()
            times.append(_timed_all_reduce(data, ctx))
            data.fill_(float(ctx.rank + 1))
        dist.all_reduce(data)
        expected = ctx.world_size * (ctx.world_size + 1) / 2
        ok = bool(torch.allclose(data[:: max(1, numel // 1024)], torch.tensor(expected, device=ctx.device)))
        gathered = all_gather_objects({"rank": ctx.rank, "times": times, "ok": ok})
        del data
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        if ctx.is_main:
            rows.append(writer.write(summarise(gathered, backend=ctx.backend, device=_device_name(ctx),
                                               world_size=ctx.world_size, size_bytes=size)))
    return rows


def _timed_all_reduce(data: torch.Tensor, ctx: DistContext) -> float:
    """Seconds one all-reduce takes on this rank.

    GPU: CUDA events on the current stream around the call (the blocking all_reduce makes the
    stream wait for NCCL's), so CPU launch and synchronisation latency, tens of microseconds and
    comparable to a 1 MB NVLink all-reduce, stay out. CPU: wall time, gloo runs synchronously.
    """
    marks = Marks(ctx.device)  # CUDA events on a GPU, perf_counter on a CPU
    marks.mark("start")
    dist.all_reduce(data)
    marks.mark("end")
    ctx.sync()
    return marks.ms("start", "end") / 1e3


def _device_name(ctx: DistContext) -> str:
    return torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"


def summarise(gathered: list[dict], *, backend: str, device: str, world_size: int, size_bytes: int) -> dict:
    """One row from every rank's per-iteration times.

    The collective ends for everyone only when the slowest rank is done, so each iteration's time
    is the maximum over ranks; time_ms is the median of those. Spread: the 10th-90th percentile of
    that per-iteration time, and the median gap between the fastest and slowest rank.
    """
    per_rank = [g["times"] for g in gathered]
    n_iters = min(len(t) for t in per_rank)
    gap = [max(t[i] for t in per_rank) - min(t[i] for t in per_rank) for i in range(n_iters)]
    median_s, p10_s, p90_s = slowest_rank_median(per_rank)
    algbw = size_bytes / median_s / 1e9
    return {
        "backend": backend, "device": device, "world_size": world_size, "size_bytes": size_bytes,
        "size_mb": size_bytes / MB, "dtype": "fp32", "iters": n_iters, "warmup": WARMUP,
        "time_ms": median_s * 1e3, "time_ms_p10": p10_s * 1e3, "time_ms_p90": p90_s * 1e3,
        "time_ms_min": min(min(t) for t in per_rank) * 1e3, "time_ms_max": max(max(t) for t in per_rank) * 1e3,
        "rank_spread_ms": statistics.median(gap) * 1e3,
        "algbw_GBps": algbw, "busbw_GBps": algbw * bus_bandwidth_factor(world_size),
        "correct": all(g["ok"] for g in gathered), "status": "ok",
    }


def not_run_row(case: Case, reason: str) -> dict:
    return {"backend": case.backend, "device": "cuda" if case.backend == "nccl" else "cpu",
            "world_size": case.world_size, "size_bytes": case.size_bytes, "size_mb": case.size_bytes / MB,
            "dtype": "fp32", "time_ms": None, "algbw_GBps": None, "busbw_GBps": None,
            "status": "not_run", "reason": reason}


def machine_key(env: dict) -> tuple:
    """What makes two rows' machines the same for resuming: host, GPU model and count, CPU."""
    return tuple(env.get(k) for k in ("hostname", "gpu", "gpu_count", "cpu"))


def recorded_cases(out_path: str | Path, env: dict, *, measured_only: bool) -> set[tuple[str, int, int]]:
    """(backend, world size, size) of the rows ``out_path`` already holds for this machine (with
    ``measured_only``, of its measured rows: a case recorded as not run may run now)."""
    mine = machine_key(env)
    return {(r["backend"], int(r["world_size"]), int(r["size_bytes"])) for r in read_records(out_path)
            if machine_key(r.get("env") or {}) == mine and (r.get("status") == "ok" or not measured_only)}


def run_benchmark(plan: Plan, out_path: str | Path, *, existing: str = "resume", budget_s: float = 2.0,
                  min_iters: int = 5, max_iters: int = 50, timeout_s: float = 300.0,
                  progress: bool = True) -> list[dict]:
    """Run a plan: one spawn per (backend, world size); rank 0 appends each row as it measures it.

    ``existing``: what to do with the rows ``out_path`` already holds: "resume" skips the cases
    recorded for this machine (an interrupted run picks up where it stopped), "append" measures
    everything again below them, "replace" starts a new file (a notebook's own output). Returns
    this call's rows.
    """
    check_choice("existing", existing, EXISTING)
    out_path = Path(out_path)
    if existing == "replace":
        out_path.unlink(missing_ok=True)
    resume = existing == "resume"
    done = recorded_cases(out_path, environment(), measured_only=True) if resume else set()
    noted = recorded_cases(out_path, environment(), measured_only=False) if resume else set()
    key = lambda case: (case.backend, case.world_size, case.size_bytes)  # noqa: E731
    writer = ResultWriter(out_path, overwrite=False)
    rows = [writer.write(not_run_row(case, reason)) for case, reason in plan.not_run if key(case) not in noted]
    groups: dict[tuple[str, int], list[int]] = {}
    for case in plan.run:
        if key(case) not in done:
            groups.setdefault((case.backend, case.world_size), []).append(case.size_bytes)
    skipped = sum(key(case) in done for case in plan.run)
    if progress and skipped:
        print(f"all-reduce: {skipped} case(s) already in {out_path} for this machine, skipped", flush=True)
    for (backend, ws), sizes in groups.items():
        if progress:
            print(f"all-reduce: {backend} world size {ws}, sizes {[s / MB for s in sizes]} MB", flush=True)
        per_rank = spawn(_bench_worker, ws, backend,
                         args=(sorted(sizes), budget_s, min_iters, max_iters, str(out_path)), timeout_s=timeout_s)
        rows += per_rank[0]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", nargs="+", default=["auto"], help="gloo, nccl or auto")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=list(HANDOUT_WORLD_SIZES))
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=[s / MB for s in HANDOUT_SIZES_BYTES])
    parser.add_argument("--max-gloo-world-size", type=int, default=None)
    parser.add_argument("--max-gloo-mb", type=float, default=None)
    parser.add_argument("--out", type=out_file_argument, default=DEFAULT_OUT,
                        help=f"rows are appended here, one per case as it is measured (default {DEFAULT_OUT})")
    parser.add_argument("--append", action="store_true",
                        help="measure cases the file already holds for this machine again (default: skip them)")
    args = parser.parse_args(argv)
    try:
        backends = [resolve_backend(b) for b in args.backend]
    except ValueError as exc:
        parser.error(str(exc))
    for option, values in (("--world-sizes", args.world_sizes), ("--sizes-mb", args.sizes_mb)):
        if not all(v > 0 for v in values):
            parser.error(f"{option} must all be positive, got {values}")
    plan = plan_cases(backends=backends, world_sizes=args.world_sizes,
                      sizes_bytes=[int(m * MB) for m in args.sizes_mb],
                      max_gloo_world_size=args.max_gloo_world_size,
                      max_gloo_bytes=None if args.max_gloo_mb is None else int(args.max_gloo_mb * MB))
    rows = run_benchmark(plan, args.out, existing="append" if args.append else "resume")
    print(f"rows in {args.out}", flush=True)
    for row in rows:
        if row["status"] == "ok":
            print(f"{row['backend']} n={row['world_size']} {row['size_mb']:>7g} MB: {row['time_ms']:9.3f} ms  "
                  f"algbw {row['algbw_GBps']:7.2f} GB/s  busbw {row['busbw_GBps']:7.2f} GB/s")
        else:
            print(f"{row['backend']} n={row['world_size']} {row['size_mb']:>7g} MB: not run ({row['reason']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
