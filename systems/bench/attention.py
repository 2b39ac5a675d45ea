"""The pytorch_attention sweep and the torch_compile comparisons (notebook 05).

Attention sweep: batch 8, no head dimension, head dim ``d`` x sequence length, and upward (x2)
from the largest listed length until the device runs out of memory. Each point warms up with
full forward + backward passes, then times ``n_forward`` forward passes and ``n_backward``
backward passes, each between two ``Marks`` (CUDA events on a GPU) and followed by a
synchronisation, as the handout asks. Memory comes from a ``MemoryProbe`` around the warm-up and
one more forward: what was allocated before the point, the peak, and what is in use before the
backward with the autograd graph alive; saved bytes from ``measure.memory.saved_tensors``. An
out-of-memory point becomes a row with ``status="oom"`` and the phase it ran out in, and the
sweep goes on with the next head dim. A sweep given a ``deadline`` records the points it has
no time left for as "skipped (budget)".

Also here: the whole-model compiled-vs-eager sweep on top of ``run_benchmark``, with a
compile-time budget. The accounting of these numbers is ``systems.analysis.attention_memory``;
tables and answers are ``systems.report.attention_compile``.

    run_attention_sweep(AttentionSweepConfig(...), out_path=...)       -> list of rows
    run_model_compile_sweep(sizes, out_path=..., budget_s=...)           -> list of harness records
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from systems.analysis.attention_memory import attention_memory_accounting
from systems.attention.naive import naive_attention
from systems.bench.budget import SKIPPED
from systems.bench.config import out_file_argument
from systems.measure.devices import catch_oom, dtype_of, release_memory, resolve_device, sync
from systems.measure.flops import attention_flops
from systems.measure.memory import MemoryProbe, saved_tensors
from systems.measure.results import ResultWriter, read_records
from systems.measure.timer import Marks, median_p10_p90


# A point listed but not run: one past an out-of-memory point (a longer length of that head dim, or
# the compiled twin of an eager point that ran out of memory: neither can fit), or one past the time
# budget (``budget.SKIPPED``). ``is_skipped`` is the one test of either.
SKIPPED_PAST_OOM = "skipped"
SKIP_STATUSES = (SKIPPED_PAST_OOM, SKIPPED)


def is_skipped(row: dict) -> bool:
    """Whether a row (an attention point or a whole-model record) is a point that was not run."""
    return row.get("status") in SKIP_STATUSES


def sdpa_one_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """torch SDPA on (batch, seq, d) inputs given one explicit head, (batch, 1, seq, d):
    the fused CUDA kernels (flash / memory-efficient) only accept 4-D inputs and would otherwise
    fall back to the math path, which materialises the score matrix like the naive code."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(-3), k.unsqueeze(-3), v.unsqueeze(-3), is_causal=is_causal)  # (b, s, d) -> (b, 1, s, d)
    return out.squeeze(-3)  # (b, 1, s, d) -> (b, s, d)


# ----------------------------------------------------------------------------- one point


@dataclass(frozen=True)
class AttentionPoint:
    """One configuration of the sweep; what a ``fail_if`` predicate receives."""
    batch: int
    seq: int
    d: int
    dtype: str = "fp32"
    compiled: bool = False


def _timed(n: int, device: torch.device, run: Callable[[int], None], before: Callable[[int], None] | None = None
           ) -> dict[str, float]:
    """``run(i)`` n times, each between two marks and followed by a synchronisation (outside the
    marks); ``before(i)`` runs untimed ahead of each. Median and p10 / p90 in ms."""
    marks = Marks(device)
    for i in range(n):
        if before is not None:
            before(i)
        marks.mark(f"start{i}")
        run(i)
        marks.mark(f"end{i}")
        sync(device)
    median, p10, p90 = median_p10_p90([marks.ms(f"start{i}", f"end{i}") for i in range(n)])
    return {"ms_median": median, "ms_p10": p10, "ms_p90": p90}


def _measure_point(point: AttentionPoint, fn: Callable, *, device: torch.device, n_forward: int,
                   n_backward: int, warmup: int, seed: int, count_saved: bool,
                   fail_if: Callable[[AttentionPoint], bool] | None, state: dict) -> dict:
    """Everything that allocates lives in this frame, so it is gone once an OOM has propagated."""
    rec: dict = {}
    shape = (point.batch, point.seq, point.d)
    gen = torch.Generator(device=device).manual_seed(seed)
    # memory first, with the probe (on a CPU its tracker would slow the timed passes down)
    with MemoryProbe(device) as probe:
        rec["start_bytes"] = probe.allocated()
        state["phase"] = "inputs"
        dtype = dtype_of(point.dtype)
        q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
        grad_out = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        state["phase"] = "warm-up forward"
        if fail_if is not None and fail_if(point):
            raise torch.OutOfMemoryError(f"injected allocation failure for {point}")
        # full forward + backward passes: an OOM anywhere shows before any timed pass (and a
        # compiled function compiles both graphs here)
        for i in range(warmup):
            t0 = time.perf_counter()
            state["phase"] = "warm-up forward"
            out = fn(q, k, v)
            state["phase"] = "warm-up backward"
            out.backward(grad_out)
            del out
            q.grad = k.grad = v.grad = None
            sync(device)
            if i == 0:
                rec["first_call_s"] = time.perf_counter() - t0
        rec["peak_bytes"] = probe.peak()
        # in use before the backward: one forward with its graph (the saved tensors) and output alive
        state["phase"] = "forward"
        before = probe.allocated()
        out = fn(q, k, v)
        rec["mem_before_backward_bytes"] = probe.allocated()
        rec["activation_bytes"] = rec["mem_before_backward_bytes"] - before
        del out
    rec["peak_rise_bytes"] = rec["peak_bytes"] - rec["start_bytes"]

    # forward: autograd on (as in training), the output dropped each pass so at most one graph lives
    rec.update({f"forward_{k_}": v_ for k_, v_ in _timed(n_forward, device, lambda i: fn(q, k, v)).items()})
    # each timed backward consumes a fresh graph, as in training (retain_graph would keep P alive
    # through the backward, and compiled backwards with donated buffers refuse it)
    state["phase"] = "backward"
    graph: dict = {}

    def forward_untimed(i: int) -> None:
        q.grad = k.grad = v.grad = None
        graph["out"] = fn(q, k, v)

    def backward(i: int) -> None:
        graph.pop("out").backward(grad_out)

    rec.update({f"backward_{k_}": v_ for k_, v_ in _timed(n_backward, device, backward, forward_untimed).items()})
    q.grad = k.grad = v.grad = None
    if count_saved:
        rec["saved_tensor_bytes"] = saved_tensors(fn, q, k, v, exclude=(q, k, v)).total_bytes()
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
    Memory columns are a ``MemoryProbe``'s: absolute on CUDA, since the probe's start on a CPU.
    """
    for name, value in (("n_forward", n_forward), ("n_backward", n_backward), ("warmup", warmup)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    dtype_of(point.dtype)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    fn = fn or naive_attention
    count_saved = (not point.compiled) if count_saved is None else count_saved
    row = {**{("batch_size" if k == "batch" else k): v for k, v in asdict(point).items()},
           "device": str(dev), "tf32": torch.backends.cuda.matmul.allow_tf32, "n_forward": n_forward,
           "n_backward": n_backward, "warmup": warmup, "status": "ok", "error": None, "oom_phase": None}
    if dev.type == "cuda":
        release_memory(dev)  # a clean allocator for each point (on a CPU refcounting is enough)
        row["cuda_free_bytes"], row["cuda_total_bytes"] = torch.cuda.mem_get_info(dev)
    state = {"phase": "start"}
    with catch_oom() as oom:
        row.update(_measure_point(point, fn, device=dev, n_forward=n_forward, n_backward=n_backward,
                                  warmup=warmup, seed=seed, count_saved=count_saved, fail_if=fail_if, state=state))
    if oom:
        # after the with block: the traceback, and the tensors its frames hold, are released
        row.update(status="oom", error=oom.message, oom_phase=state["phase"])
        if dev.type == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        release_memory(dev)
        return row
    for phase, pass_ in (("forward", "fwd"), ("backward", "bwd")):
        flops = attention_flops(batch=point.batch, heads=1, n_q=point.seq, n_k=point.seq, d=point.d, causal=False,
                                pass_=pass_)
        row[f"{phase}_tflops"] = flops / (row[f"{phase}_ms_median"] / 1e3) / 1e12
    # what the exponent fit uses: saved-tensor hooks where they ran, else the allocator's delta
    row["saved_bytes"] = row.get("saved_tensor_bytes") or row.get("activation_bytes")
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
    dtype: str = "fp32"
    device: str = "auto"
    compiled: bool = False  # torch.compile the attention function
    compile_backend: str = "inductor"  # "aot_eager" traces without code generation (fast CPU smoke runs)
    compile_dynamic: bool | None = None  # torch.compile's default: static first, then dynamic sizes on recompile
    seed: int = 0
    deadline: float | None = None  # time.time() after which no point starts: its row says "skipped (budget)"

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
        dtype_of(self.dtype)
        resolve_device(self.device)


def attention_function(cfg: AttentionSweepConfig) -> Callable:
    """The function a sweep times: naive attention, compiled when asked (one compiled object for
    the whole sweep; Dynamo recompiles for new shapes and then marks the changing dims dynamic)."""
    if not cfg.compiled:
        return naive_attention
    torch._dynamo.reset()  # start from an empty cache so the sweep's first point pays the compile
    return torch.compile(naive_attention, backend=cfg.compile_backend, dynamic=cfg.compile_dynamic)


def _run_isolated(cfg: AttentionSweepConfig, out_path: Path, progress: bool, append: bool) -> list[dict]:
    """Each head dim's series in its own child process (see ``run_attention_sweep``)."""
    if not append:
        out_path.unlink(missing_ok=True)
    for d in cfg.head_dims:
        child = json.dumps(asdict(replace(cfg, head_dims=(d,))))
        cmd = [sys.executable, "-m", "systems.bench.attention", "--config-json", child, "--out", str(out_path),
               "--append"] + ([] if progress else ["--no-progress"])
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"attention sweep child process (d={d}) failed with exit code "
                               f"{proc.returncode}; rows written so far are in {out_path}")
    return read_records(out_path)


def run_attention_sweep(cfg: AttentionSweepConfig, *, out_path: str | Path | None = None,
                        fail_if: Callable[[AttentionPoint], bool] | None = None, progress: bool = True,
                        fn: Callable | None = None, isolate: bool = False, append: bool = False) -> list[dict]:
    """Every head dim x listed length, then doubling past the last length until out of memory.

    For each head dim the lengths run in increasing order; once a point runs out of memory the
    larger listed lengths of that head dim are recorded as ``status=SKIPPED_PAST_OOM`` (they cannot
    fit) and the sweep goes on with the next head dim. Rows are written as they are produced.

    ``isolate=True`` runs each head dim's series in its own child process, so that no point runs
    in a process where another one ran out of memory inside ``backward()`` (on an H100 such an
    OOM left tens of GiB allocated for the rest of the process).
    """
    from tqdm.auto import tqdm

    if isolate:
        if fail_if is not None or fn is not None:
            raise ValueError("isolate=True cannot carry fail_if or fn into the child process")
        if out_path is None:
            raise ValueError("isolate=True needs out_path: the child process writes its rows there")
        return _run_isolated(cfg, Path(out_path), progress, append)

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

    def point(seq: int, d: int) -> dict:
        base = {"batch_size": cfg.batch_size, "seq": seq, "d": d, "dtype": cfg.dtype, "compiled": cfg.compiled,
                "device": str(device)}
        if cfg.deadline is not None and time.time() > cfg.deadline:
            return emit({**base, "status": SKIPPED, "error": "the sweep's time budget was spent"})
        bar.set_postfix_str(f"d={d} seq={seq}")
        return emit(run_attention_point(AttentionPoint(cfg.batch_size, seq, d, cfg.dtype, cfg.compiled), fn=fn,
                                        device=device, n_forward=cfg.n_forward, n_backward=cfg.n_backward,
                                        warmup=cfg.warmup, seed=cfg.seed, fail_if=fail_if))

    for d in cfg.head_dims:
        hit_oom = False
        for seq in cfg.seq_lens:
            if hit_oom:
                emit({"batch_size": cfg.batch_size, "seq": seq, "d": d, "dtype": cfg.dtype, "compiled": cfg.compiled,
                      "device": str(device), "status": SKIPPED_PAST_OOM, "error": "longer than an out-of-memory point"})
                continue
            hit_oom = point(seq, d)["status"] == "oom"
        seq = cfg.seq_lens[-1] * 2
        while cfg.grow_until_oom and not hit_oom and seq <= cfg.max_seq_len:
            bar.total += 1
            row = point(seq, d)
            hit_oom = row["status"] in ("oom", SKIPPED)
            seq *= 2
    bar.close()
    return rows


def simulated_memory_limit(limit_bytes: int, *, dtype: str = "fp32",
                           device: str = "cuda") -> Callable[[AttentionPoint], bool]:
    """A ``fail_if`` predicate: the point "runs out of memory" when the accounting's peak (for
    ``device``'s kernels) exceeds ``limit_bytes``. Lets a CPU run show the OOM path at sizes a CPU
    can time."""
    def fail_if(point: AttentionPoint) -> bool:
        acct = attention_memory_accounting(batch=point.batch, seq=point.seq, d=point.d, dtype=point.dtype,
                                           device=device)
        return int(acct.attrs["peak_bytes"]) > limit_bytes
    return fail_if


def smallest_oom(rows: Sequence[dict]) -> dict | None:
    """The out-of-memory row with the fewest score-matrix elements (then the smallest d)."""
    ooms = [r for r in rows if r.get("status") == "oom"]
    return min(ooms, key=lambda r: (r["batch_size"] * r["seq"] ** 2, r["d"])) if ooms else None


# ----------------------------------------------------------------------------- whole model


def run_model_compile_sweep(sizes: Sequence[str], *, context_length: int = 512, batch_size: int = 4,
                            modes: Sequence[str] = ("forward", "train_step"), precision: str = "fp32",
                            tf32: bool = True, warmup: int = 2, steps: int = 5,
                            device: str = "auto", compile_scope: str | None = "model",
                            budget_s: float | None = None,
                            out_path: str | Path | None = None, progress: bool = True,
                            model_overrides: dict | None = None, bench_fn: Callable | None = None,
                            clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Eager for every size, then compiled, sizes in the order given, each point through ``run_benchmark``.

    Forward+backward comes from the train step's separately synchronised forward and backward
    phases, so each size compiles twice (the inference graph and the training graph) instead of
    three times. Compilation dominates the cost; with ``budget_s`` a compiled point is skipped
    (``status=SKIPPED``, the budget's mark) once the time spent on compiled points plus a prediction for this one
    (the last compiled point of the same mode) would exceed the budget; a compiled point whose eager
    twin ran out of memory is ``status=SKIPPED_PAST_OOM``. ``compile_scope=None`` runs
    the eager points only. With ``compile_scope="model"`` the prediction scales with layer count,
    since the whole model is traced into one graph; with ``"blocks"`` (BenchmarkConfig's per-block
    compile, one graph shared by every layer) compile cost stays flat with depth, so the last
    point's time is the prediction. ``bench_fn`` replaces ``run_benchmark`` and ``clock`` the wall
    clock (tests).
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
        skip = None  # (status, reason)
        compiled = cfg.compile != "none"
        if compiled and eager_status.get((cfg.model, cfg.mode)) == "oom":
            skip = (SKIPPED_PAST_OOM, "eager ran out of memory at this size")
        elif compiled and budget_s is not None and cfg.mode in last_compiled:
            layers, seconds = last_compiled[cfg.mode]
            predicted = seconds * (n_layers / layers if compile_scope == "model" else 1.0)
            if compiled_spent + predicted > budget_s:
                skip = (SKIPPED, f"compile-time budget: {compiled_spent:.0f} s spent + ~{predicted:.0f} s predicted "
                                 f"> {budget_s:.0f} s")
        if skip:
            rec = {**asdict(cfg), "model_overrides": None, "n_layers": n_layers, "status": skip[0], "error": skip[1]}
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


def main(argv: list[str] | None = None) -> int:
    """``python -m systems.bench.attention --config-json '{...}' --out rows.jsonl`` (used by isolate=True)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m systems.bench.attention")
    parser.add_argument("--config-json", required=True, help="AttentionSweepConfig fields as JSON")
    parser.add_argument("--out", type=out_file_argument, required=True, help="the .jsonl file the rows are written to")
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
