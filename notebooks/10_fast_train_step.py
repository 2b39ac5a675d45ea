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
# # 10 · A fast full training step
# How fast can one full training step of the 2.7B model (batch 4 × context 512, bf16 autocast over
# fp32 master weights: forward, cross-entropy, backward, AdamW) run on one GPU, and what does each
# lever buy? Hugging Face transformers' `LlamaForCausalLM` (the same architecture, SDPA attention,
# torch's fused AdamW) is the baseline in the same run; our model runs eager, with its blocks
# compiled, with the fused kernels of `systems/kernels/` (an LM head + cross-entropy that never
# materialises the logits; an AdamW that updates p, m and v in one Triton pass), with all of
# them (`ours_fast`), then with three more levers on top:
# - **bf16 weights with fp32 masters in the optimizer** (`ours_master`): the model holds its
#   matmul weights in bf16 and `MasterWeightAdamW` the fp32 masters and moments, writing the
#   rounded master back into the model in the same pass. Autocast then casts no weight in the
#   forward and the gradients stay bf16 in the backward; the matmuls see the same bf16 values, so
#   the arithmetic is autocast's (bit-identical on a CPU, `tests/test_train_step.py`).
# - **CUDA graphs** (`ours_graphs`): the blocks compiled with `mode="reduce-overhead"`, so each
#   block's forward and backward replay as CUDA graphs, for sizes whose step waits on the host.
# - **the optimizer inside the backward** (`*_overlap`): each block's AdamW update runs as soon as
#   its gradients exist, on a side CUDA stream of lower priority than the backward's, so the
#   memory-bound update can overlap the compute-bound backward; the "optimizer" phase is then
#   only the tail the backward could not hide.
#
# The variants are data in `systems.bench.train_step.VARIANTS`, the lever comparisons in `LEVERS`.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, debug model, < 60 s) or "full" (GPU, < 6 min on one H100)
out_dir = "build/smoke"  # the runner injects this
peak_tflops = 680.0      # bf16 dense-matmul rate MFU is relative to: measured on our H100 (shared/device/README.md)

# %%
import pandas as pd
import torch

from systems.report import notebook as nb
from systems.bench import profile as bench_profile
from systems.measure import flops
from systems.measure import profiler as profiling
from systems.report import kernel_profiling
from systems.bench import train_step as ts
from systems.report import fast_train_step as fast_report
from systems.bench import leaderboard as lbd
from systems.measure.results import ResultWriter, read_records

ctx = nb.setup(name="10_fast_train_step", profile=profile, out_dir=out_dir)
if ctx.full:
    # targets (issue: fast full training step): 2.7B <= 105 ms, xl <= 75 ms per step on one H100
    PLAN = {"2.7B": ["hf_llama", "ours_eager", "ours_compiled", "ours_fused", "ours_fast", "ours_master",
                     "ours_master_overlap"],
            "xl-2025": ["hf_llama", "ours_eager", "ours_fast", "ours_master", "ours_graphs", "ours_graphs_overlap"]}
    TARGET_MS = {"2.7B": 105.0, "xl-2025": 75.0}
    STEP = dict(batch_size=4, context_length=512, warmup=5, steps=20)
    TRACE = ("2.7B", "ours_master_overlap")  # its timeline shows whether the side-stream updates overlap the backward
else:
    # CPU: the debug model; compiled variants are left out (inductor's CPU compile dominates a
    # smoke run and needs a C++ toolchain)
    PLAN = {"debug": ["hf_llama", "ours_eager", "ours_fused", "ours_fused_master"]}
    TARGET_MS = {}
    STEP = dict(batch_size=2, context_length=64, warmup=1, steps=3)
    TRACE = ("debug", "ours_fused")
trace_path = ctx.out_dir / "traces" / f"{ctx.name}_{TRACE[0]}_{TRACE[1]}.json"
writer = ResultWriter(ctx.result_path("steps"))
rows = []
for model, variants in PLAN.items():
    rows += ts.run_variants(model=model, variants=variants, writer=writer,
                            peak_flops=peak_tflops * 1e12 if ctx.full else None,  # a CPU has no such peak
                            trace_variant=TRACE[1] if model == TRACE[0] else None, trace_path=trace_path,
                            **STEP)
table = fast_report.step_table(rows)
nb.show(table, caption=f"Full training step, batch {STEP['batch_size']} x context {STEP['context_length']}, "
                       f"bf16 autocast, {STEP['steps']} timed steps after {STEP['warmup']} warm-up ({ctx.gpu}); "
                       f"MFU of {peak_tflops:g} TFLOP/s")

# %%
fig = fast_report.plot_phases(table, title=f"Where a step's time goes, per variant ({ctx.gpu})")
nb.save_figure(fig, ctx, "phases")

# %%
lines = []
ok = table[table["status"] == "ok"].set_index(["model", "variant"])
for model in PLAN:
    part = ok.loc[model] if model in ok.index.get_level_values(0) else None
    if part is None or part.empty:
        lines.append(f"- **{model}**: no variant ran.")
        continue
    best = part["step_ms"].idxmin()
    b = part.loc[best]
    text = (f"- **{model}**: the fastest variant is `{best}` at {b['step_ms']:.1f} ms per step "
            f"(p10–p90 {b['step_ms_p10']:.1f}–{b['step_ms_p90']:.1f}), {b['achieved_tflops']:.3g} TFLOP/s")
    if "mfu" in b and b["mfu"] == b["mfu"]:
        text += f", MFU {b['mfu']:.1%}"
    if "hf_llama" in part.index:
        text += f"; {b['speedup_vs_hf_llama']:.2f}x Hugging Face Llama's {part.loc['hf_llama', 'step_ms']:.1f} ms"
    if model in TARGET_MS:
        met = b["step_ms"] <= TARGET_MS[model]
        text += (f". Target <= {TARGET_MS[model]:g} ms: **{'met' if met else 'not met'}** "
                 f"({b['step_ms'] / TARGET_MS[model]:.2f}x the target)")
    lines.append(text + ".")
    if "ours_eager" in part.index and best.startswith("ours") and best != "ours_eager":
        e = part.loc["ours_eager"]
        deltas = ", ".join(f"{ph.removesuffix('_ms')} {e[ph]:.1f} -> {b[ph]:.1f} ms"
                           for ph in ("forward_ms", "backward_ms", "optimizer_ms"))
        lines.append(f"  - from `ours_eager` to `{best}`: {deltas}; first step (compilation, autotuning) "
                     f"{b['first_step_s']:.1f} s against {e['first_step_s']:.1f} s.")
nb.md("**Step time against the targets.**\n\n" + "\n".join(lines))

# %% [markdown]
# ## What each lever buys
# Each line compares two variants of the same run that differ by one lever (`LEVERS`): the step
# time saved, and how each phase's median changed (negative: faster). With the optimizer inside
# the backward the update's time moves from the optimizer phase into the backward's; what it
# saves overall is the overlap.

# %%
levers = fast_report.lever_table(table)
nb.show(levers, caption=f"Levers, each against the variant without it, same run ({ctx.gpu})")
if not levers.empty:
    by = levers.loc[levers.groupby("model")["saved_ms"].idxmax()]
    nb.md("**Largest single lever per model:** " + "; ".join(
        f"{r.model}: {r.lever} (`{r['from']}` -> `{r.to}`), {r.saved_ms:.1f} ms saved "
        f"({r.step_ms_from:.1f} -> {r.step_ms_to:.1f} ms)" for _, r in by.iterrows()) + ".")

# %% [markdown]
# ## One step of the fastest configuration, profiled
# `torch.profiler` over one warm step of the traced variant; kernels grouped into categories
# (`systems.measure.profiler`), phases shaded.

# %%
items, ranges = profiling.parse_trace(profiling.load_trace(trace_path))
items = profiling.attribute(items, ranges)
cats = profiling.category_table(items)
nb.show(cats, caption=f"{TRACE[0]} `{TRACE[1]}`: kernel time per category in one step ({ctx.gpu})")
nb.show(profiling.range_table(items, ranges), caption="per phase: wall time and kernel time in the step")
fig = kernel_profiling.plot_step_timeline(trace_path, title=f"{TRACE[0]} `{TRACE[1]}`, one step ({ctx.gpu})")
nb.save_figure(fig, ctx, "timeline")

# %%
top = cats.sort_values("ms_per_step", ascending=False).iloc[0]
busy = items["dur"].sum() / 1e3
phase = profiling.range_table(items, ranges).set_index("range")
step_wall = phase.loc["step", "wall_ms_per_step"]
timed = ok.loc[TRACE, "step_ms"]
nb.md(f"In the profiled step (each phase closed by a synchronisation, so its range holds its kernels) kernels "
      f"are busy {busy:.1f} ms of the step's {step_wall:.1f} ms ({busy / step_wall:.0%}); the timed steps of the "
      f"same variant took {timed:.1f} ms (median). The largest category is {top['category']} with "
      f"{top['ms_per_step']:.1f} ms ({top['share']:.0%} of kernel time) in {top['kernels_per_step']:.0f} kernels.")

# %% [markdown]
# ## The 2026 leaderboard configuration on two GPUs
# The 8B model (vocab 151,936, d 4096, d_ff 11,008, 34 layers, 32 heads), batch 2 x context
# 32,768, bf16 autocast over fp32 weights, summed cross-entropy, AdamW, timed with
# `triton.testing.do_bench` (`systems.bench.leaderboard`: one sequence per rank, bucketed
# DDP, ZeRO-1 sharded fused AdamW, every block checkpointed, the fused LM head + loss, SDPA's
# cuDNN attention). It needs two GPUs with enough memory each; on such a node this cell runs it,
# elsewhere it shows the last row of `results/12_leaderboard_8b.jsonl` with the machine and
# commit that produced it.

# %%
lb_path = ctx.results / "12_leaderboard_8b.jsonl"
gpus = [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]
if ctx.full and len(gpus) >= 2 and min(gpus[:2]) >= lbd.MIN_GPU_MEMORY_GIB:
    lbd.run_leaderboard(lbd.LeaderboardConfig(out_path=str(lb_path)), world_size=2)
    lb_source = "measured in this run"
else:
    lb_source = (f"not measured in this run ({len(gpus)} GPU(s) here; it needs 2 with at least "
                 f"{lbd.MIN_GPU_MEMORY_GIB:g} GiB each): the last committed row")
if lb_path.exists():
    lb_row = read_records(lb_path)[-1]
    lb_env = lb_row.get("env", {})
    nb.show(pd.DataFrame([{k: lb_row[k] for k in ("model", "world_size", "backend", "sdpa_backend", "checkpoint_group",
                                                  "step_s", "tflops_per_gpu", "tokens_per_s")}]),
            caption="8B leaderboard step")
    met = lb_row["step_s"] <= lbd.TARGET_STEP_S
    per_rank = ", ".join(f"{r['peak_memory_gib']:.1f}" for r in lb_row["per_rank"] if r.get("peak_memory_gib"))
    nb.md(f"**8B on {lb_row['world_size']} x {lb_env.get('gpu')}** ({lb_source}; commit {lb_env.get('git_commit')}, "
          f"{lb_env.get('date')}): **{lb_row['step_s']:.2f} s per step**, {lb_row['tflops_per_gpu']:.0f} TFLOP/s per "
          f"GPU of model FLOPs (recomputation not counted), peak memory per rank {per_rank} GiB. Target <= "
          f"{lbd.TARGET_STEP_S:g} s: **{'met' if met else 'not met'}**.")
else:
    nb.md(f"8B leaderboard step: {lb_source}; no row exists yet. Run `python -m systems.bench.leaderboard` "
          "on a node with two such GPUs.")
