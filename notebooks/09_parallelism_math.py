# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Parallelism on paper: XXL accounting and the DP / FSDP / TP / 2D limits
#
# How much memory does a 220B-parameter stack of feed-forward blocks need, how far must it be
# sharded, and at what batch is a TPU v5p mesh compute-bound (2025 handout,
# `communication_accounting`)? How large should DDP gradient buckets be (2025)? For one SwiGLU FFN
# layer, how many devices can data, fully sharded, tensor and 2D parallelism use before
# communication outlasts computation (2026 handout §8)? Every closed form is derived by sympy and
# every number computed in this run by `systems.analysis.parallel_math` (checked against brute-force
# counts in its tests). Where a link bandwidth enters, the datasheet's stands beside the one the
# all-reduce runs measured (notebook 07 and the committed `results/13_*` runs).

# %% tags=["parameters"]
profile = "smoke"        # "smoke" and "full" give the same answers; "full" draws finer curves
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": which handout's questions
allreduce_results = None  # committed all-reduce rows to measure W from (globs); None: 07's and 13_*; "": this run's only
example_n = 8            # device count at which per-device FLOPs and communication times are evaluated

# %%
import math

from systems.analysis import parallel_math as pm
from systems.config import get_config
from systems.measure.results import ResultWriter
from systems.report import distributed as allreduce_report
from systems.report import notebook as nb
from systems.report import parallelism_math as report

ctx = nb.setup(name="09_parallelism_math", profile=profile, out_dir=out_dir, handout=handout, needs_gpu_for_full=False)
n_points = 2000 if ctx.full else 300
xxl, mesh, tpu, h100 = pm.XXL, pm.HANDOUT_MESH, pm.TPU_V5P, pm.H100
paths = allreduce_report.archived("results/07_distributed_allreduce.jsonl results/13_allreduce_*.jsonl"
                                  if allreduce_results is None else allreduce_results)
rows = allreduce_report.read_allreduce([ctx.results / "07_distributed_allreduce.jsonl", *paths])
link = report.measured_link(rows)
measured = report.with_measured_link(h100, link)
gpus = [h100] + ([measured] if measured else [])

# %% [markdown]
# ## Hardware and conventions
#
# `GB` is $10^9$ bytes; a matmul $(A,B)(B,C)$ costs $2ABC$ FLOPs; with $N$ devices and $W$ bytes/s
# of egress each, a ring all-gather or reduce-scatter of an $S$-byte tensor takes
# $\frac{N-1}{N}\frac{S}{W}$ and an all-reduce twice that, so NCCL's bus bandwidth is this $W$.

# %%
nb.show(report.hardware_table([tpu, *gpus]), caption="C: dense bf16 peak; W: per-device egress (TPU: W_ici x 2 directions)")
nb.md(report.link_text(link, h100))

# %% [markdown]
# ## 2025 · communication_accounting (XXL) and the bucket model
#
# XXL: `n_blocks` blocks of two bias-free linears $d_\text{model}\to d_\text{ff}\to d_\text{model}$; BF16
# activations and gradient communication; FP32 master weights, gradients and AdamW moments (16 bytes
# per parameter); no activation checkpointing. (c) uses Scaling Book sharding on an X = 16 (FSDP) by
# Y = 4 (TP) v5p mesh: activations $[B_X, D_Y]$, weights $W_\text{in}[D_X, F_Y]$, $W_\text{out}[F_Y, D_X]$.

# %%
if ctx.handout == "2025":
    answers = report.xxl_answers(xxl=xxl, mesh=mesh, tpu=tpu, gpu=h100)
    b_star = math.ceil(pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu))
    nb.show(report.xxl_memory_table(xxl, tokens=b_star * mesh.n_devices, gpu=h100), caption="XXL memory")
    nb.answer(ctx, "communication_accounting", "a", answers["a"])
    nb.show(report.min_fsdp_table(xxl, tpu=tpu, tokens=[0, 256, b_star, 1024, 4096, 8192]),
            caption=f"smallest N_FSDP that fits a {tpu.name} ({tpu.memory_bytes / 1e9:.0f} GB)")
    nb.answer(ctx, "communication_accounting", "b", answers["b"])
    nb.save_figure(report.mesh_batch_figure(xxl, mesh=mesh, tpu=tpu, n_points=n_points), ctx, "mesh_batch_crossover")
    nb.answer(ctx, "communication_accounting", "c", answers["c"])
    nb.answer(ctx, "communication_accounting", "d", answers["d"])
    text, w, o = report.bucket_answer(link=link, gpu=h100)
    nb.answer(ctx, "ddp_bucketed_benchmarking", "b", text)
    if o > 0:
        nb.save_figure(report.bucket_overhead_figure(
            total_bytes=get_config("xl-2025").n_params * 4, bandwidth_bytes_per_s=w, per_call_overhead_s=o,
            n_points=n_points, title=f"Bucketed DDP, 2025 xl, measured w = {w / 1e9:.0f} GB/s, o = {o * 1e6:.3g} us"),
            ctx, "ddp_buckets")
else:
    nb.md("This run answers the 2026 handout, which has neither the XXL accounting nor the bucket model.")

# %% [markdown]
# ## 2026 · §8 Analysing parallelism strategies (one SwiGLU FFN layer)
#
# $x_1 = xW_1,\ x_2 = xW_2,\ z = f(x_1) * x_2,\ y = zW_3$ with $x$ of shape $(B, D)$, $W_1, W_2$
# $(D, D_\text{FF})$, $W_3$ $(D_\text{FF}, D)$; FP16 everywhere ($p = 2$ bytes); non-matmul work
# ignored; computation and communication overlap, so a strategy is communication-bound once
# communication outlasts computation. Numbers: the 2026 leaderboard model's FFN ('8B' preset) at its
# batch of 2 x 32,768 tokens, on the datasheet H100, on the H100 with the measured $W$, and on a v5p.

# %%
if ctx.handout == "2026":
    layer = pm.leaderboard_ffn()
    hws = [*gpus, tpu]
    answers = report.section8_answers(layer=layer, hws=hws, example_n=example_n)
    nb.answer(ctx, "alternate_ring_all_reduce", "", answers[("alternate_ring_all_reduce", "")])
    for part in "abc":
        nb.answer(ctx, "data_parallel_calcs", part, answers[("data_parallel_calcs", part)])
    nb.save_figure(report.crossover_figure("dp", layer=layer, hws=hws, n_points=n_points), ctx, "dp_crossover")
    for part in "abc":
        nb.answer(ctx, "fsdp_calcs", part, answers[("fsdp_calcs", part)])
    nb.answer(ctx, "tp_calcs", "a", report.tp_backward_answer(pm.tp_backward_check()))
    for part in "bcd":
        nb.answer(ctx, "tp_calcs", part, answers[("tp_calcs", part)])
    nb.save_figure(report.crossover_figure("tp", layer=layer, hws=hws, n_points=n_points), ctx, "tp_crossover")
    nb.save_figure(report.batch_crossover_figure(layer=layer, hw=gpus[-1], example_n=example_n, n_points=n_points),
                   ctx, "batch_crossover")
    for part in "abcd":
        nb.answer(ctx, "fsdp_tp_calcs", part, answers[("fsdp_tp_calcs", part)])
    nb.save_figure(report.fsdp_tp_region_figure(layer=layer, hws=hws, n_points=200 if ctx.full else 80), ctx,
                   "fsdp_tp_region")
    nb.show(report.bounds_table(layer, hws), caption="8B FFN: the device bounds with each W")
else:
    nb.md("This run answers the 2025 handout, which has no §8 calculations.")

# %% [markdown]
# ## Every number, in one table (both handouts)

# %%
answers_table = pm.answers_table(layer=pm.leaderboard_ffn(), example_n=example_n, extra=tuple(gpus[1:]))
writer = ResultWriter(ctx.result_path("answers"))
for record in answers_table.to_dict("records"):
    writer.write(record)
nb.show(answers_table, caption="XXL on the handout's hardware; 2026 bounds for the 8B FFN")
