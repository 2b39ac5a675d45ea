# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Memory: snapshots, timelines, activations and checkpointing
# Where does the memory of a training step go? For the 2.7B model (d_model 2560, d_ff 10240,
# 32 layers, 32 heads) at contexts 128–2048 we record CUDA allocator snapshots, render them
# offline as "Active memory timelines", tabulate peak memory for forward and train step (fp32
# and bf16 autocast), find the residual stream and the largest allocations in the snapshot,
# account for the tensors one block saves for backward, and then trade compute for memory
# with activation checkpointing.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, < 60 s) or "full" (GPU, < 5 min on one H100)
out_dir = "build/smoke"  # the runner injects this

# %%
import contextlib
import math

import matplotlib.pyplot as plt
import pandas as pd
import torch
from tqdm.auto import tqdm

from systems.bench import memory as bench_memory
from systems.measure import memory
from systems.parallel import checkpoint as checkpointing
from systems.report import notebook as nb
from systems.bench.benchmark import BenchmarkConfig, run_benchmark
from systems.config import get_config
from systems.measure.devices import release_memory
from systems.model import TransformerBlock, TransformerLM
from systems.optim import AdamW
from systems.measure.results import ResultWriter

ctx = nb.setup(name="04_memory", profile=profile, out_dir=out_dir)
dev = ctx.device if ctx.full else "cpu"
if ctx.full:
    MODEL, CONTEXTS, BATCH = "2.7B", [128, 256, 512, 2048], 4
    CKPT_MODEL, CKPT_OVERRIDES, CKPT_BATCH, CKPT_CONTEXT = "2.7B", {}, 4, 2048
    NESTED_OVERRIDES, NESTED_BATCH, NESTED_CONTEXT = {"n_layers": 16}, 8, 256
else:  # the debug model on the CPU: same code, memory from LiveTensorTracker and the profiler
    MODEL, CONTEXTS, BATCH = "debug", [32, 128], 2
    CKPT_MODEL, CKPT_OVERRIDES, CKPT_BATCH, CKPT_CONTEXT = "debug", {"n_layers": 4}, 2, 32
    NESTED_OVERRIDES, NESTED_BATCH, NESTED_CONTEXT = {"n_layers": 8}, 2, 32
WARMUP, MEASURE = 1, 1  # memory is deterministic step to step: one warm-up (creates AdamW state) is enough
CKPT_WARMUP = WARMUP if ctx.full else 0  # smoke: the CPU run only checks the code path
PRECISIONS, MODES = ["fp32", "bf16"], ["forward", "train_step"]
model_cfg = get_config(MODEL)
snap_dir = ctx.out_dir / "snapshots"
memory_source = ("torch.cuda.max_memory_allocated" if dev == "cuda" else
                 "LiveTensorTracker: tensors created during the measured step, parameters and optimizer state excluded")
nb.md(f"Model **{MODEL}** ({model_cfg.d_model}/{model_cfg.d_ff}/{model_cfg.n_layers}/{model_cfg.n_heads}), "
      f"batch {BATCH}, contexts {CONTEXTS}, device `{dev}`; peak memory from {memory_source}."
      + ("" if dev == "cuda" else " CUDA snapshots are not available on a CPU: every snapshot below is derived "
         "from torch.profiler's memory profile in the same format, so the renderer and the analysis run "
         "unchanged; allocator-specific effects (block rounding, caching) are absent."))

# %% [markdown]
# ## Peak memory sweep (forward and train step, fp32 and bf16 autocast)
# Each point runs through the benchmark harness with the snapshot recorder around the measured
# step only (warm-up left out) and a step marker after it. OOM is recorded as a row.

# %%
# CUDA: every fp32 point records a snapshot (cheap); the CPU profiler is slow, so on a CPU only the
# largest context does, and peaks come from LiveTensorTracker (tensors created in the measured step)
SNAPSHOT_CONTEXTS = CONTEXTS if dev == "cuda" else CONTEXTS[-1:]


@contextlib.contextmanager
def measured(path, snapshot: bool, tracker):
    with contextlib.ExitStack() as stack:
        if snapshot:
            stack.enter_context(memory.record_snapshot(path) if dev == "cuda" else memory.record_cpu_snapshot(path))
        if tracker is not None:
            stack.enter_context(tracker)
        yield


writer = ResultWriter(ctx.result_path("peaks"))
rows, snapshots = [], {}
points = [(p, m, c) for p in PRECISIONS for m in MODES for c in CONTEXTS]
for precision, mode, context in tqdm(points, desc="peak memory"):
    cfg = BenchmarkConfig(model=MODEL, context_length=context, batch_size=BATCH, warmup=WARMUP,
                          steps=MEASURE, mode=mode, precision=precision, device=dev)
    path = snap_dir / f"{MODEL}_{mode}_{precision}_ctx{context}.pickle"
    path.unlink(missing_ok=True)
    want_snapshot = precision == "fp32" and context in SNAPSHOT_CONTEXTS
    tracker = memory.LiveTensorTracker() if dev == "cpu" else None
    rec = run_benchmark(cfg, around_measure=lambda: measured(path, want_snapshot, tracker),
                        on_step=memory.step_marker(dev))
    row = {"model": MODEL, "context_length": context, "mode": mode, "precision": precision,
           "status": rec["status"], "step_ms": (rec.get("step_median_s") or float("nan")) * 1e3,
           "snapshot": str(path) if path.exists() else None}
    tl = memory.build_timeline(path) if want_snapshot and path.exists() and rec["status"] == "ok" else None
    if dev == "cuda":
        row["peak_gib"] = rec.get("peak_memory_gib")
        for phase in ("forward", "backward", "optimizer"):
            row[f"peak_{phase}_gib"] = rec.get(f"peak_memory_{phase}_gib")
        row["timeline_peak_gib"] = tl.peak_bytes / 2**30 if tl else None  # cross-check: snapshot vs allocator
    elif rec["status"] == "ok":
        row["peak_gib"] = tracker.peak_bytes / 2**30
        if tl is not None:  # the profiler's view, parameters and optimizer state included
            row["timeline_peak_gib"] = tl.peak_bytes / 2**30
            for phase, peak in tl.phase_peaks().items():
                row[f"peak_{phase}_gib"] = peak / 2**30
    if tl is not None:
        snapshots[(mode, precision, context)] = path
    rows.append(writer.write(row))
    del rec, tl
    release_memory()
peaks = pd.DataFrame(rows).drop(columns=["env", "snapshot"])

# %% [markdown]
# ## (a) Active memory timelines, forward only and a full train step
# Rendered offline with matplotlib from the snapshot (no browser); the memory_viz HTML is
# written beside each PNG. The phases are found from the data: each allocation's stack names
# the model's `forward`, autograd's `backward` (allocations from the autograd engine's thread
# carry no Python frames and inherit the phase before them) or the optimizer's `step`.

# %%
ok_both = [c for c in CONTEXTS if all((m, "fp32", c) in snapshots for m in MODES)]
TIMELINE_CONTEXT = max(ok_both) if ok_both else None
timelines = {}
if TIMELINE_CONTEXT is None:
    nb.md("No context ran both modes in fp32 without OOM, so there is no timeline to draw.")
else:
    for mode in MODES:
        out_png = ctx.figures / f"{ctx.name}_timeline_{mode}.png"
        tl = memory.render_timeline(snapshots[(mode, "fp32", TIMELINE_CONTEXT)], out_png,
                                    title=f"{MODEL} {mode} fp32, batch {BATCH} x ctx {TIMELINE_CONTEXT}")
        timelines[mode] = tl
        spans = "; ".join(f"{p.name} events {p.start}–{p.end} (peak {p.peak_bytes / 2**30:.3f} GiB)" for p in tl.phases)
        nb.md(f"**{mode}** (ctx {TIMELINE_CONTEXT}): ![]({out_png.relative_to(ctx.out_dir)}) "
              f"[memory_viz HTML]({out_png.with_suffix('.html').relative_to(ctx.out_dir)})\n\n"
              f"Phases found: {spans or 'none'}. Peak {tl.peak_bytes / 2**30:.3f} GiB at event {tl.peak_index} "
              f"of {len(tl.x) - 1}, inside the **{next((p.name for p in tl.phases if p.start <= tl.peak_index <= p.end), 'unlabelled')}** "
              f"phase; {tl.baseline_bytes / 2**30:.3f} GiB was already allocated when recording began "
              f"(parameters{', gradients and AdamW state' if mode == 'train_step' else ''}).")

# %% [markdown]
# ## (b) Peak memory per context: forward and full train step (fp32)
# The per-phase columns are high-water marks up to the end of each phase.

# %%
def peak_table(precision: str) -> pd.DataFrame:
    sub = peaks[peaks.precision == precision]
    wide = sub.pivot_table(index="context_length", columns="mode", values="peak_gib", aggfunc="first", dropna=False)
    status = sub.pivot_table(index="context_length", columns="mode", values="status", aggfunc="first", dropna=False)
    table = pd.DataFrame(index=sorted(sub.context_length.unique()))
    for mode in MODES:
        table[f"{mode} peak GiB"] = [wide.get(mode, {}).get(c) if status.get(mode, {}).get(c) == "ok" else None
                                     for c in table.index]
        table[f"{mode} status"] = [status.get(mode, {}).get(c) for c in table.index]
    table.index.name = "context"
    return table


fp32_table = peak_table("fp32")
nb.show(fp32_table, caption=f"{MODEL} batch {BATCH}, fp32: peak memory ({memory_source})")
phase_cols = [c for c in peaks.columns if c.startswith("peak_") and c.endswith("_gib") and c != "peak_gib"]
nb.show(peaks[(peaks.precision == "fp32") & (peaks["mode"] == "train_step")]
        [["context_length", "status", "peak_gib", *phase_cols]].set_index("context_length"),
        caption="train step, fp32: peak per phase")
oom = peaks[peaks.status == "oom"]
nb.md("Out of memory: " + (", ".join(f"{r.mode} {r.precision} ctx {r.context_length}" for r in oom.itertuples())
                           if len(oom) else "none of the points."))

# %% [markdown]
# ## (c) The same under bf16 autocast
# Autocast keeps fp32 master weights, gradients and optimizer state; it only changes the dtype of
# the activations it casts (matmul inputs and outputs), and adds bf16 copies of the weights.

# %%
bf16_table = peak_table("bf16")
nb.show(bf16_table, caption=f"{MODEL} batch {BATCH}, bf16 autocast: peak memory")
cmp_rows = []
for mode in MODES:
    for c in CONTEXTS:
        a, b = fp32_table.loc[c, f"{mode} peak GiB"], bf16_table.loc[c, f"{mode} peak GiB"]
        if a is not None and b is not None and a == a and b == b:
            cmp_rows.append({"mode": mode, "context": c, "fp32 GiB": a, "bf16 GiB": b, "bf16 / fp32": b / a})
cmp = pd.DataFrame(cmp_rows)
if len(cmp):
    nb.show(cmp, caption="bf16 autocast vs fp32")
    for mode in MODES:
        m = cmp[cmp["mode"] == mode]
        if len(m):
            lo, hi = m["bf16 / fp32"].min(), m["bf16 / fp32"].max()
            verdict = "materially lower" if hi < 0.85 else ("higher" if lo > 1.05 else "not materially different")
            nb.md(f"**{mode}:** bf16 autocast peak is {lo:.2f}–{hi:.2f}x the fp32 peak across contexts "
                  f"{m.context.tolist()}: {verdict}.")
else:
    nb.md("No context ran in both precisions, so there is nothing to compare.")

# %% [markdown]
# ## (d) One residual-stream activation, derived and found in the snapshot

# %%
if TIMELINE_CONTEXT is not None:
    res_bytes = memory.residual_stream_bytes(batch_size=BATCH, context_length=TIMELINE_CONTEXT,
                                             d_model=model_cfg.d_model, dtype=torch.float32)
    match = memory.match_allocation_size(snapshots[("train_step", "fp32", TIMELINE_CONTEXT)], res_bytes)
    nb.md(f"Residual stream = batch x context x d_model x 4 bytes = {BATCH} x {TIMELINE_CONTEXT} x "
          f"{model_cfg.d_model} x 4 = {res_bytes:,} bytes = **{res_bytes / 2**20:.2f} MiB**. "
          f"The train-step snapshot holds **{match['n_matches']}** allocations of exactly that size "
          f"(by phase: {match['by_phase']}); the most common allocating lines: "
          + "; ".join(f"`{src}` x{n}" for src, n in match["top_sources"]) + ".")

# %% [markdown]
# ## (e) The largest allocations and where they come from

# %%
if TIMELINE_CONTEXT is not None:
    for mode in MODES:
        big = memory.largest_allocations(snapshots[(mode, "fp32", TIMELINE_CONTEXT)], k=8)
        nb.show(big.drop(columns=["size_bytes"]), caption=f"{mode}, ctx {TIMELINE_CONTEXT}: largest allocations")
    top = big.iloc[0]
    nb.md(f"In the train step the largest allocation is {top.size_mib:,.1f} MiB ({top['count']} times, "
          f"{top.phase} phase) from `{top.source}`.")

# %% [markdown]
# ## (f) What one TransformerBlock saves for backward
# `saved_tensors_hooks` sees every tensor packed for backward; walking the autograd graph then
# tells which grad_fn owns each one. Each storage is counted once, parameters are excluded.

# %%
sv_context = TIMELINE_CONTEXT or min(CONTEXTS)
torch.manual_seed(0)
block = TransformerBlock(model_cfg, device=dev)
x = torch.randn(BATCH, sv_context, model_cfg.d_model, device=dev)
rep = memory.saved_tensor_report(block, x, torch.arange(sv_context, device=dev))
res_bytes_sv = memory.residual_stream_bytes(batch_size=BATCH, context_length=sv_context, d_model=model_cfg.d_model)
attn_bytes = BATCH * model_cfg.n_heads * sv_context**2 * 4
nb.show(rep.by_op.drop(columns=["bytes"]), caption=f"one block, batch {BATCH} x ctx {sv_context}: top-5 saving ops")
expected_grad = memory.block_grad_bytes_expected(model_cfg.d_model, model_cfg.d_ff)
nb.md(f"Saved for backward: **{rep.total_mib:,.1f} MiB** in {rep.n_storages} storages from {rep.n_saved} pack calls "
      f"(= {rep.total_bytes / res_bytes_sv:.1f} residual-stream tensors of {res_bytes_sv / 2**20:.2f} MiB; one "
      f"(b, h, T, T) fp32 attention matrix is {attn_bytes / 2**20:.1f} MiB). The top five ops hold "
      f"{rep.by_op['share'].sum():.0%}. Weights saved by the matmuls ({rep.param_bytes_excluded / 2**20:.1f} MiB) "
      f"are parameters and not counted.\n\n"
      f"Gradient memory per block: measured {rep.grad_bytes / 2**20:.1f} MiB, expected "
      f"(4 d² + 3 d d_ff + 2 d) x 4 bytes = {expected_grad / 2**20:.1f} MiB: "
      f"{'match' if rep.grad_bytes == expected_grad else 'MISMATCH'}.")
del block, x, rep
release_memory()

# %% [markdown]
# ## Gradient checkpointing (a): the memory-optimal nested strategy
# Let a model have N blocks, each storing A bytes of activations and costing F to run forward.
#
# - **No checkpointing:** memory N·A, compute 1 forward + backward.
# - **One level, groups of k:** keep only the N/k group inputs (one residual each, size r), and
#   during backward recompute one group at a time: memory ≈ (N/k)·r + k·A, minimised at
#   k ≈ √(N·r/A), i.e. **O(√N)**, for one extra forward (**≈ 4/3** of a step's compute).
# - **Nested (recursive) checkpointing:** split the N blocks into b checkpointed chunks and apply
#   the same inside each chunk, down to single blocks. The depth is log_b N; at any time the
#   backward holds the b chunk boundaries of every level on the path plus one block's activations:
#   memory **O(b · log_b N)**, i.e. **O(log N)** for b = 2; each block is recomputed once per
#   level: compute **O(N log N)** forward work (1 + log_b N forwards per block). Binary recursion
#   is memory-optimal up to constants (Chen et al. 2016; Griewank's revolve gives the same
#   logarithmic bound). Below: the debug model with more layers, measured.

# %%
nest_cfg = get_config("debug", **NESTED_OVERRIDES)
N = nest_cfg.n_layers
strategies = [("none", None), (f"one level, k = √N = {checkpointing.sqrt_group_size(N)}", ("group", checkpointing.sqrt_group_size(N))),
              ("nested, branching 2", ("nested", 2)), ("nested, branching 4", ("nested", 4))]
nest_writer = ResultWriter(ctx.result_path("nested_checkpointing"))
nest_rows = []
torch.manual_seed(0)
nest_model = TransformerLM(nest_cfg, device=dev)
inputs = torch.randint(0, nest_cfg.vocab_size, (NESTED_BATCH, NESTED_CONTEXT), device=dev)
targets = torch.randint(0, nest_cfg.vocab_size, (NESTED_BATCH, NESTED_CONTEXT), device=dev)
for label, how in strategies:
    checkpointing.remove_activation_checkpointing(nest_model)
    if how and how[0] == "group":
        checkpointing.apply_activation_checkpointing(nest_model, how[1])
    elif how:
        checkpointing.apply_nested_checkpointing(nest_model, branching=how[1])
    with checkpointing.count_block_forwards(nest_model) as calls:
        m = bench_memory.measure_train_step(nest_model, inputs, targets, warmup=0, steps=1)
    nest_rows.append(nest_writer.write({"strategy": label, "n_layers": N, "block_forwards": sum(calls.values()),
                                        "forwards_per_block": sum(calls.values()) / N,
                                        "peak_rise_mib": m["rise_mib"], "step_ms": m["step_s"] * 1e3}))
checkpointing.remove_activation_checkpointing(nest_model)
nested = pd.DataFrame(nest_rows).drop(columns=["env"])
nb.show(nested, caption=f"debug model with N = {N} blocks, batch {NESTED_BATCH} x ctx {NESTED_CONTEXT}: "
        "activation memory (peak rise above the step's start) and block forwards")
base = nested.iloc[0]
nb.md("Relative to no checkpointing: " + "; ".join(
    f"{r.strategy}: {r.peak_rise_mib / base.peak_rise_mib:.2f}x the activation memory for "
    f"{r.forwards_per_block:.1f} forwards per block" for r in nested.iloc[1:].itertuples())
    + f" (binary nesting depth log2 N = {math.log2(N):.0f}).")
del nest_model, inputs, targets
release_memory()

# %% [markdown]
# ## Gradient checkpointing (b): one level, every group size
# The model at batch 4 x context 2048 (smoke: the debug model), one `torch.utils.checkpoint`
# level (non-reentrant) over groups of k consecutive blocks, k = 1, 2, 4, ..., N; AdamW train step.
# TF32 matmuls are on to keep the sweep short: it changes time, not memory.

# %%
ck_cfg = get_config(CKPT_MODEL, **CKPT_OVERRIDES)
group_sizes = [2**i for i in range(int(math.log2(ck_cfg.n_layers)) + 1)]
if group_sizes[-1] != ck_cfg.n_layers:
    group_sizes.append(ck_cfg.n_layers)
ck_writer = ResultWriter(ctx.result_path("checkpoint_groups"))
ck_rows = []
prev_tf32 = torch.backends.cuda.matmul.allow_tf32
torch.backends.cuda.matmul.allow_tf32 = True
ck_model = opt = None
try:
    torch.manual_seed(0)
    ck_model = TransformerLM(ck_cfg, device=dev)
    opt = AdamW(ck_model.parameters(), lr=1e-4)
    ck_in = torch.randint(0, ck_cfg.vocab_size, (CKPT_BATCH, CKPT_CONTEXT), device=dev)
    ck_tg = torch.randint(0, ck_cfg.vocab_size, (CKPT_BATCH, CKPT_CONTEXT), device=dev)
    for k in tqdm(group_sizes, desc="checkpoint group size"):
        checkpointing.remove_activation_checkpointing(ck_model)
        checkpointing.apply_activation_checkpointing(ck_model, k)
        row = {"model": CKPT_MODEL, "batch_size": CKPT_BATCH, "context_length": CKPT_CONTEXT, "group_size": k,
               "n_groups": math.ceil(ck_cfg.n_layers / k), "status": "ok"}
        try:
            m = bench_memory.measure_train_step(ck_model, ck_in, ck_tg, optimizer=opt, warmup=CKPT_WARMUP, steps=MEASURE)
            row.update(peak_gib=m["peak_gib"], step_ms=m["step_s"] * 1e3)
        except torch.OutOfMemoryError as exc:
            row.update(status="oom", error=str(exc).splitlines()[0][:200])
        ck_rows.append(ck_writer.write(row))
        m = None
        release_memory()
except torch.OutOfMemoryError as exc:  # the model and AdamW state alone do not fit
    ck_rows.append(ck_writer.write({"model": CKPT_MODEL, "group_size": None, "status": "oom",
                                    "error": str(exc).splitlines()[0][:200]}))
finally:
    torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    del ck_model, opt
    release_memory()
ck = pd.DataFrame(ck_rows).drop(columns=["env"])
nb.show(ck.drop(columns=[c for c in ("error",) if c in ck.columns]),
        caption=f"{CKPT_MODEL} batch {CKPT_BATCH} x ctx {CKPT_CONTEXT}: one level of checkpointing")

# %%
fit = ck[ck.status == "ok"].dropna(subset=["peak_gib"]) if "peak_gib" in ck.columns else ck.iloc[0:0]
if len(fit):
    best = fit.loc[fit.peak_gib.idxmin()]
    fastest = fit.loc[fit.step_ms.idxmin()]
    i = group_sizes.index(int(best.group_size))
    neighbours = [g for g in group_sizes[max(0, i - 1):i + 2] if g != best.group_size]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(fit.group_size, fit.peak_gib, "o-", label="peak memory")
    ax.plot([best.group_size], [best.peak_gib], "r*", ms=14, label=f"lowest peak: k = {int(best.group_size)}")
    for g in ck[ck.status == "oom"].group_size.dropna():
        ax.axvline(g, color="red", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks per checkpoint group (k)")
    ax.set_ylabel(f"peak memory ({'GiB, allocator' if dev == 'cuda' else 'GiB, tensors created in the step'})")
    ax2 = ax.twinx()
    ax2.plot(fit.group_size, fit.step_ms, "s--", color="tab:orange", label="step time")
    ax2.set_ylabel("step time (ms)")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper center")
    ax.set_title(f"{CKPT_MODEL}, batch {CKPT_BATCH} x ctx {CKPT_CONTEXT}: one checkpoint level"
                 + (" (red dotted: OOM)" if (ck.status == "oom").any() else ""))
    nb.save_figure(fig, ctx, "checkpoint_groups")
    plt.show()
    nb_rows = fit[fit.group_size.isin([best.group_size, *neighbours])]
    nb.md(f"Lowest peak memory at **k = {int(best.group_size)}** ({best.peak_gib:.2f} GiB, "
          f"{best.step_ms:,.0f} ms per step; √N = {math.sqrt(ck_cfg.n_layers):.1f}). Neighbours: "
          + "; ".join(f"k = {int(r.group_size)}: {r.peak_gib:.2f} GiB, {r.step_ms:,.0f} ms"
                      for r in nb_rows.itertuples() if r.group_size != best.group_size)
          + f". Fastest group size that fits: k = {int(fastest.group_size)} ({fastest.step_ms:,.0f} ms). "
          + ("Out of memory at k = " + ", ".join(str(int(g)) for g in ck[ck.status == 'oom'].group_size.dropna())
             + "." if (ck.status == "oom").any() else "Every group size fits."))
else:
    nb.md(f"No group size fits: the {CKPT_MODEL} train step at batch {CKPT_BATCH} x ctx {CKPT_CONTEXT} runs out "
          f"of memory on {ctx.gpu} with every checkpoint group size tried ({group_sizes}).")
