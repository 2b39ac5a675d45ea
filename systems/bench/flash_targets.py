"""Our FlashAttention-2 against its speed targets (issue #25), measured side by side in one process.

The targets are the project's, not the handout's; each is a ratio of our time to a baseline's at
named shapes (batch x heads, seq, d), causal:

- the leaderboard shape (16, 16384, 64) in bf16, forward + backward: at most 1.00x cuDNN (SDPA's
  cuDNN backend), then at most 0.95x;
- the backward, bf16, at every shape of the table with seq >= 4096: at most 1.05x cuDNN;
- a short sequence, (1, 1024, 64) bf16, forward + backward: at most 1.3x cuDNN;
- fp32 at seq >= 1024: no slower than naive PyTorch fp32 end to end.

**Protocol.** A call at seq 1k-4k takes 15-200 us, and the host's speed drifts over seconds
(docs/flash_attention_notes.md, entry 8), so one timing per implementation says more about the
moment than about the kernels. Here every (shape, implementation) is timed once per round by
``systems.bench.flash.time_attention`` (do_bench medians, p10/p90), the implementations of a shape
back to back and in a rotated order each round; a ratio is taken within a round, and the table
gives the median over rounds with the lowest and highest round. Rows are written as they are
measured, so an interrupted run keeps its rounds.

**Agreement.** A timing says nothing about the outputs, and a run can time kernels the tests never
ran at these shapes (notes entry 19: a tile the autotuner had never been allowed to try). So after
the rounds, under the same tuned plans, each Triton implementation's O, dQ, dK and dV at every shape
are compared with the baseline's (cuDNN for bf16, naive for fp32) on the same inputs; a difference
past ``AGREE_TOL`` is printed and makes the command exit 1.

    python -m systems.bench.flash_targets --out build/flash/flash_targets.jsonl
    python -m systems.bench.flash_targets --rounds 5 --no-prewarm
    python -m systems.bench.flash_targets --from results/experiments/06_flash_targets_44e6f94.jsonl

``--from`` prints the tables of a rows file an earlier run wrote, on any machine, without measuring.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from systems.bench.config import DEFAULT_OUT_ROOT, out_file_argument, shape_argument
from systems.measure.results import ResultWriter, machine_of, read_records

# (batch x heads, seq, d): the table of issue #25
BF16_SHAPES = ((16, 16384, 64), (16, 16384, 128), (1, 65536, 64), (1, 65536, 128), (1, 4096, 128), (1, 1024, 64))
FP32_SHAPES = tuple((1, seq, d) for d in (64, 128) for seq in (1024, 2048, 4096, 8192, 16384))
IMPLS = {"bf16": ("triton", "sdpa_cudnn", "sdpa_flash"), "fp32": ("triton", "naive")}
PASSES = ("fwd", "bwd", "e2e")
AGREE_BASELINE = {"bf16": "sdpa_cudnn", "fp32": "naive"}
# the largest |ours - baseline| over max(1, max |baseline|) allowed per output: the GPU tests hold
# each implementation to 3e-2 (bf16) and 1e-4 (fp32) of float64 on that scale (GPU_TOL in
# tests/attention/test_flash_triton.py), so two of them may differ by twice that
AGREE_TOL = {"bf16": 6e-2, "fp32": 2e-4}


@dataclass(frozen=True)
class Target:
    """ours / ``baseline`` at most ``limit`` for ``pass_`` at every shape of ``dtype`` in ``shapes``
    (all of the dtype's shapes when empty) with seq >= ``min_seq``."""
    name: str
    dtype: str
    pass_: str
    baseline: str
    limit: float
    shapes: tuple[tuple[int, int, int], ...] = ()
    min_seq: int = 0

    def covers(self, dtype: str, shape: tuple[int, int, int]) -> bool:
        return dtype == self.dtype and (not self.shapes or shape in self.shapes) and shape[1] >= self.min_seq


LEADERBOARD = (16, 16384, 64)
TARGETS = (
    Target("leaderboard fwd+bwd", "bf16", "e2e", "sdpa_cudnn", 1.00, shapes=(LEADERBOARD,)),
    Target("leaderboard fwd+bwd, stretch", "bf16", "e2e", "sdpa_cudnn", 0.95, shapes=(LEADERBOARD,)),
    Target("backward at seq >= 4096", "bf16", "bwd", "sdpa_cudnn", 1.05, min_seq=4096),
    Target("short sequence fwd+bwd", "bf16", "e2e", "sdpa_cudnn", 1.30, shapes=((1, 1024, 64),)),
    Target("fp32 fwd+bwd at seq >= 1024", "fp32", "e2e", "naive", 1.00, min_seq=1024),
)


def _rotated(items: tuple, k: int) -> tuple:
    k %= len(items)
    return items[k:] + items[:k]


def measure(*, rounds: int = 3, bf16_shapes=BF16_SHAPES, fp32_shapes=FP32_SHAPES, impls=IMPLS,
            warmup_ms: float = 25, rep_ms: float = 100, writer: ResultWriter | None = None,
            timer: Callable | None = None, device: str = "cuda", progress: Callable[[str], None] | None = print
            ) -> list[dict]:
    """Every (round, dtype, shape, implementation) timed once, implementations in a rotated order
    each round; each row carries its round. ``timer`` is time_attention's signature (tests pass a
    fake one)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if timer is None:
        from systems.bench.flash import time_attention as timer
    points = [("bf16", s) for s in bf16_shapes] + [("fp32", s) for s in fp32_shapes]
    rows = []
    start = time.perf_counter()
    for r in range(rounds):
        for dtype, (bh, seq, d) in points:
            for impl in _rotated(tuple(impls[dtype]), r):
                row = timer(impl, batch=1, heads=bh, seq=seq, d=d, dtype=dtype, is_causal=True,
                            warmup_ms=warmup_ms, rep_ms=rep_ms, device=device)
                row = {**row, "round": r, "shape": [bh, seq, d]}
                if writer is not None:
                    writer.write(row)
                rows.append(row)
        if progress is not None:
            progress(f"round {r + 1}/{rounds} done at {time.perf_counter() - start:.0f} s")
    return rows


def outputs(impl: str, *, bh: int, seq: int, d: int, dtype: str, device: str = "cuda") -> tuple:
    """O, dQ, dK, dV of ``impl`` (causal) on seeded inputs shaped as time_attention's, (1, bh, seq, d)."""
    import torch

    from systems.bench.flash import get_impl, outputs_and_grads
    from systems.measure.devices import DTYPES

    gen = torch.Generator(device=device).manual_seed(bh + seq + d)
    q, k, v, do = (torch.randn(1, bh, seq, d, generator=gen, device=device).to(DTYPES[dtype]) for _ in range(4))
    return outputs_and_grads(get_impl(impl), q, k, v, do, True)[0]


def agreement(*, impls=IMPLS, bf16_shapes=BF16_SHAPES, fp32_shapes=FP32_SHAPES, run: Callable | None = None,
              writer: ResultWriter | None = None) -> list[dict]:
    """Per (dtype, shape, Triton implementation): the largest difference of each output from
    AGREE_BASELINE's, over max(1, max |baseline|), and whether all are within AGREE_TOL. ``run``
    is outputs' signature (tests pass a fake one)."""
    from systems.bench.flash import TRITON_VARIANTS, scaled_errors

    run = run or outputs
    rows = []
    for dtype, shapes in (("bf16", bf16_shapes), ("fp32", fp32_shapes)):
        ours = [i for i in impls[dtype] if i in TRITON_VARIANTS]
        for bh, seq, d in shapes if ours else ():
            want = run(AGREE_BASELINE[dtype], bh=bh, seq=seq, d=d, dtype=dtype)
            for impl in ours:
                got = run(impl, bh=bh, seq=seq, d=d, dtype=dtype)
                errors = scaled_errors(got, want)
                row = dict(kind="agreement", impl=impl, baseline=AGREE_BASELINE[dtype], dtype=dtype,
                           shape=[bh, seq, d], **errors, worst=max(errors.values()), tol=AGREE_TOL[dtype])
                row["agrees"] = row["worst"] <= row["tol"]
                if writer is not None:
                    writer.write(row)
                rows.append(row)
    return rows


def format_agreement(rows: list[dict]) -> str:
    lines = ["agreement (largest |ours - baseline| / max(1, max |baseline|) over O, dQ, dK, dV):"]
    for r in rows:
        lines.append(f"  {r['dtype']:>5} {str(tuple(r['shape'])):>20} {r['impl']} vs {r['baseline']}: "
                     f"{r['worst']:.2e} (<= {r['tol']:.0e}: {'ok' if r['agrees'] else 'DIFFERENT'})")
    return "\n".join(lines)


def ratios(rows: list[dict], *, ours: str = "triton") -> list[dict]:
    """Per (dtype, shape, baseline, pass): ``ours`` / baseline within each round, and the median,
    lowest and highest over rounds (None where the two did not both run in any round)."""
    by = {(r["round"], r["dtype"], tuple(r["shape"]), r["impl"]): r for r in rows}
    keys = list(dict.fromkeys((r["dtype"], tuple(r["shape"])) for r in rows))  # the order they ran
    out = []
    for dtype, shape in keys:
        here = [r["impl"] for r in rows if (r["dtype"], tuple(r["shape"])) == (dtype, shape)]
        baselines = [i for i in dict.fromkeys(here) if i != ours]
        for base in baselines:
            for p in PASSES:
                per_round = []
                for rnd in sorted({r["round"] for r in rows}):
                    a, b = by.get((rnd, dtype, shape, ours)), by.get((rnd, dtype, shape, base))
                    if a and b and a.get(f"{p}_ms") and b.get(f"{p}_ms"):
                        per_round.append(a[f"{p}_ms"] / b[f"{p}_ms"])
                ms = [by[k][f"{p}_ms"] for k in by if k[1:] == (dtype, shape, ours) and by[k].get(f"{p}_ms")]
                out.append(dict(dtype=dtype, shape=shape, ours=ours, baseline=base, pass_=p, rounds=len(per_round),
                                ratio=statistics.median(per_round) if per_round else None,
                                low=min(per_round, default=None), high=max(per_round, default=None),
                                ours_ms=statistics.median(ms) if ms else None))
    return out


def verdicts(table: list[dict], targets=TARGETS) -> list[dict]:
    """Per target: its shapes' median ratios, the worst of them, and whether it is met (every shape
    measured and within the limit)."""
    out = []
    for t in targets:
        cells = [c for c in table if c["pass_"] == t.pass_ and c["baseline"] == t.baseline
                 and t.covers(c["dtype"], c["shape"])]
        measured = [c for c in cells if c["ratio"] is not None]
        worst = max(measured, key=lambda c: c["ratio"], default=None)
        out.append(dict(target=t.name, limit=t.limit, baseline=t.baseline, pass_=t.pass_, shapes=len(cells),
                        measured=len(measured), worst=worst["ratio"] if worst else None,
                        worst_shape=worst["shape"] if worst else None,
                        met=bool(cells) and len(measured) == len(cells) and worst["ratio"] <= t.limit))
    return out


def _cell(c: dict | None) -> str:
    if c is None or c["ratio"] is None:
        return f"{'-':>17}"
    return f"{c['ratio']:5.2f} ({c['low']:.2f}-{c['high']:.2f})"


def format_table(table: list[dict], verdict_rows: list[dict]) -> str:
    """The issue's table (ours / baseline per pass, median over rounds, lowest-highest round in
    brackets), then each target with its worst shape and whether it is met."""
    lookup = {(c["dtype"], c["shape"], c["baseline"], c["pass_"]): c for c in table}
    shapes = list(dict.fromkeys((c["dtype"], c["shape"]) for c in table))
    head = (f"{'dtype':>5} {'shape (bh, seq, d)':>20} {'ours e2e ms':>11} "
            + " ".join(f"{name:>17}" for name in ("fwd / cuDNN", "bwd / cuDNN", "e2e / cuDNN", "e2e / SDPA-flash",
                                                   "e2e / naive")))
    lines = [head]
    for dtype, shape in shapes:
        e2e = next((c for c in table if (c["dtype"], c["shape"], c["pass_"]) == (dtype, shape, "e2e")), None)
        ms = f"{e2e['ours_ms']:11.3f}" if e2e and e2e["ours_ms"] else f"{'-':>11}"
        cells = [lookup.get((dtype, shape, b, p)) for b, p in (("sdpa_cudnn", "fwd"), ("sdpa_cudnn", "bwd"),
                                                               ("sdpa_cudnn", "e2e"), ("sdpa_flash", "e2e"),
                                                               ("naive", "e2e"))]
        lines.append(f"{dtype:>5} {str(shape):>20} {ms} " + " ".join(_cell(c) for c in cells))
    lines.append("targets (ours / baseline, the median over rounds; ours, not the handout's):")
    for v in verdict_rows:
        rule = f"  {v['target']:<30} <= {v['limit']:.2f}x {v['baseline']} ({v['pass_']}): "
        if not v["shapes"]:  # a --shape run without any of its shapes: no verdict either way
            lines.append(rule + "not run (none of its shapes in this run)")
            continue
        got = (f"worst {v['worst']:.2f}x at {v['worst_shape']}" if v["worst"] is not None else "not measured")
        lines.append(rule + f"{got}, {v['measured']}/{v['shapes']} shapes: {'met' if v['met'] else 'NOT met'}")
    return "\n".join(lines)


def format_also(table: list[dict], also: list[str]) -> str:
    """Ours over each ``also`` implementation per shape and pass (median over rounds,
    lowest-highest round in brackets), from ``ratios``' table."""
    lines = [f"{'dtype':>5} {'shape (bh, seq, d)':>20} {'ours / ':>7}" + " ".join(f"{p:>17}" for p in PASSES)]
    for impl in also:
        for dtype, shape in dict.fromkeys((c["dtype"], c["shape"]) for c in table if c["baseline"] == impl):
            cells = {c["pass_"]: c for c in table if (c["dtype"], c["shape"], c["baseline"]) == (dtype, shape, impl)}
            lines.append(f"{dtype:>5} {str(shape):>20} {impl} " + " ".join(_cell(cells.get(p)) for p in PASSES))
    return "\n".join(lines)


def read_rows(path: Path) -> tuple[list[dict], list[dict], dict]:
    """An earlier run's rows file: its timing rows, its agreement rows, and the environment it
    recorded (the first row's). ValueError, in one line, where the file is not such a file."""
    if not path.is_file():
        raise ValueError(f"cannot read {path}: no such file")
    try:
        rows = read_records(path)
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON lines ({exc}): give a rows file flash_targets wrote") from None
    timings = [r for r in rows if r.get("kind") != "agreement" and "round" in r]
    if not timings:
        raise ValueError(f"{path} holds no flash_targets timing rows (rows with a 'round'): give a rows file "
                         "flash_targets wrote")
    return timings, [r for r in rows if r.get("kind") == "agreement"], timings[0].get("env", {})


def also_in(rows: list[dict]) -> list[str]:
    """The implementations timed beside the table's own (``--also``), in the order they ran."""
    own = {impl for names in IMPLS.values() for impl in names}
    return list(dict.fromkeys(r["impl"] for r in rows if r["impl"] not in own))


def report(rows: list[dict], checked: list[dict], also: list[str]) -> str:
    """The printed tables: ratios and verdicts, ours over each ``also`` implementation, agreement."""
    table = ratios(rows)
    parts = [format_table(table, verdicts(table))]
    if also:
        parts.append(format_also(table, also))
    if checked:
        parts.append(format_agreement(checked))
    return "\n".join(parts)


def warm_calls(*, bf16_shapes=BF16_SHAPES, fp32_shapes=FP32_SHAPES) -> list:
    """The Triton calls whose kernels systems.bench.flash.prewarm compiles before round one."""
    from systems.bench.flash import WarmCall, distinct_warm_calls

    return distinct_warm_calls(WarmCall("triton", dtype, (1, bh, seq, d), seq, True)
                               for dtype, shapes in (("bf16", bf16_shapes), ("fp32", fp32_shapes))
                               for bh, seq, d in shapes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.flash_targets", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--no-prewarm", action="store_true", help="compile in this process as the rounds need it")
    parser.add_argument("--stored-plans", action="store_true",
                        help="launch the tuned plans earlier processes persisted instead of tuning afresh")
    parser.add_argument("--out", type=out_file_argument, default=f"{DEFAULT_OUT_ROOT}/flash/flash_targets.jsonl")
    parser.add_argument("--shape", action="append", type=shape_argument("BH,SEQ,D"), metavar="BH,SEQ,D",
                        help="a bf16 shape to time instead of the table's (repeatable; no fp32 shapes then): a "
                             "target none of whose shapes ran is reported as not run")
    parser.add_argument("--from", dest="from_rows", type=Path, metavar="ROWS",
                        help="print the tables of a rows file an earlier run wrote, without measuring")
    parser.add_argument("--also", action="append", default=[], metavar="IMPL",
                        help="another implementation timed in every round beside the others (repeatable; e.g. "
                             "triton_per_head, the launch order before head groups); ours / it is printed after "
                             "the table")
    args = parser.parse_args(argv)
    if args.from_rows is not None:
        try:
            rows, checked, env = read_rows(args.from_rows)
        except ValueError as exc:
            parser.error(str(exc))
        print(f"rows of {args.from_rows}: {machine_of(env)}, commit {env.get('git_commit', '?')}, "
              f"{env.get('date', '?')}")
        print(report(rows, checked, also_in(rows)))
        return 1 if any(not r["agrees"] for r in checked) else 0
    from systems.bench.flash import get_impl

    for impl in args.also:
        try:
            get_impl(impl)
        except ValueError as exc:
            parser.error(f"--also: {exc}")
    impls = {dtype: (*names, *(i for i in args.also if i not in names)) for dtype, names in IMPLS.items()}
    shapes = dict(bf16_shapes=tuple(args.shape), fp32_shapes=()) if args.shape else {}
    import tempfile

    import torch

    from systems.attention.flash_triton.tuning import CACHE_ENV
    from systems.measure.env import environ_set

    if not torch.cuda.is_available():
        parser.error("the targets compare GPU kernels (SDPA's cuDNN backend among them); run on a CUDA GPU")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not args.no_prewarm:
        from systems.bench.flash import prewarm

        done = prewarm(warm_calls(**shapes))
        print(f"prewarm: {done['calls']} calls in {done['workers']} workers, {done['seconds']:.0f} s"
              + (f"; {len(done['failed'])} failed" if done["failed"] else ""), flush=True)
    writer = ResultWriter(args.out)
    with tempfile.TemporaryDirectory(prefix="flash_plans_") as fresh:
        # a key (sequence bucket, head dim, ...) is tuned at its first call and the plan persists, and a
        # bucket spans a (batch, head) of 4k to sixteen of 16k: plans stored by an earlier process
        # (notebook 06's sweep calls small shapes first) would time these shapes with tiles picked
        # for others (notes entry 13). By default each key is tuned here, at the table's first shape.
        with environ_set({} if args.stored_plans else {CACHE_ENV: fresh}):
            rows = measure(rounds=args.rounds, impls=impls, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                           writer=writer, progress=lambda s: print(s, flush=True), **shapes)
            checked = agreement(impls=impls, writer=writer, **shapes)  # under the plans just timed
    print(report(rows, checked, args.also))
    print(f"rows: {writer.path}")
    different = [r for r in checked if not r["agrees"]]
    if different:
        print(f"error: {len(different)} implementation-shape pairs differ from their baseline past the "
              f"tolerance (above): fix the kernels before reading the times", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
