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
# # 07 · Data parallelism: all-reduce cost, and naive / flat / overlapped / bucketed DDP
#
# What does an all-reduce cost as the tensor, the number of ranks and the backend change, and how
# much of a data-parallel training step of the handout's xl model goes to gradient communication
# when it is done naively after the backward, flattened into one call, overlapped per parameter or
# in buckets, against torch's `DistributedDataParallel` in the same run? The full profile runs NCCL
# on the visible GPUs (two or more); the smoke profile runs the same code on two gloo CPU processes
# with the debug model. All-reduce runs committed from larger machines are shown beside this run's.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, gloo, < 90 s) or "full" (NCCL on two or more GPUs)
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # "2025" or "2026": which handout's questions and xl model
ddp_world_size = 2       # ranks for the DDP benchmark (global batch 4 -> 2 per rank)
allreduce_archives = "results/13_allreduce_*.jsonl"  # committed all-reduce runs on other machines

# %%
import torch

from systems.bench import allreduce as allreduce_bench
from systems.bench import ddp as ddp_bench
from systems.config import size_and_preset
from systems.measure.results import read_results
from systems.report import distributed as report
from systems.report import notebook as nb

# the ranks own the GPUs: this process makes no CUDA context of its own
ctx = nb.setup(name="07_distributed", profile=profile, out_dir=out_dir, handout=handout, gpus_in_ranks=True)
n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
backend = "nccl" if ctx.full else "gloo"

# %% [markdown]
# ## All-reduce: time and bandwidth against size, world size and backend
#
# fp32 tensors of 1 MB to 1 GB on 2, 4 and 6 ranks: 5 warm-up calls, then timed calls between a
# barrier and a device synchronisation; every rank's times are gathered and an iteration counts
# as long as its slowest rank. algbw = bytes / time; busbw = algbw x 2(n-1)/n, the traffic on each
# link of a ring, the number to compare across world sizes. Sizes or world sizes this machine
# cannot run are recorded as not run; the committed runs (their machine and commit in the first
# table) measured them.

# %%
plan, budget = allreduce_bench.notebook_plan(profile=ctx.profile, n_gpus=n_gpus)
allreduce_bench.run_benchmark(plan, ctx.result_path("allreduce"), existing="replace", **budget)
allreduce = report.allreduce_rows(ctx.result_path("allreduce"), archives=allreduce_archives)
nb.show(report.allreduce_sources(allreduce), caption="where each all-reduce row comes from")
nb.show(report.allreduce_table(allreduce), caption="all-reduce of fp32 tensors, every measured case")
nb.save_figure(report.plot_allreduce(allreduce, title="All-reduce, fp32 (solid: this run; dashed: committed runs)"),
               ctx, "allreduce")
nb.answer(ctx, "distributed_communication_single_node", "", report.allreduce_answer(allreduce))

# %% [markdown]
# ## The wrappers against one process
#
# `systems.parallel.ddp` holds the four wrappers. Each trains a small Transformer on two gloo
# ranks, each on half of every batch, beside the same training in one process on the whole batch.

# %%
ddp_bench.check_against_single_process(ctx.result_path("correctness"))
check = read_results(ctx.result_path("correctness"))
nb.answer(ctx, "naive_ddp", "", report.correctness_answer(check, "naive", what="DDPNaive"))
nb.answer(ctx, "ddp_overlap_individual_parameters", "",
          report.correctness_answer(check, "overlap", what="DDPIndividualParameters"))
if ctx.handout == "2025":
    nb.answer(ctx, "ddp_overlap_bucketed", "", report.correctness_answer(check, "bucketed", what="DDPBucketed"))

# %% [markdown]
# ## DDP variants against torch DDP
#
# One model, our AdamW, global batch 4 split over the ranks. `nosync` skips communication and is
# the computation-only baseline: a variant's communication overhead is its step time minus the
# `nosync` step of the same setting (for torch DDP too, whose waiting happens inside backward);
# `sync_wait_ms` is the time from the end of the backward to the end of the gradient sync.
# `bucketed_tail:<MiB>/<last MiB>` caps the last bucket (the embedding, whose gradient comes last)
# separately; `bucketed_lp` all-reduces in bf16. A *setting* is a precision, eager or with every
# block compiled (`+compile`, CUDA graphs): eager bf16 is host-bound, so overlap is judged on the
# compiled one. The last setting, `bf16-master+compile`, holds the matmul weights in bf16 with
# their fp32 masters in the fused AdamW (the fast single-GPU step's arithmetic, notebook 10), one
# optimizer per block: gradients are bf16 from the backward on, so there is half as much to send
# and nothing to convert; there `bucketed_update` makes one bucket per block and updates each
# block as soon as its all-reduce has landed, while the later blocks' all-reduces still run (its
# `sync_wait_ms` holds those updates). `peer_update` sends no all-reduce: the GPUs' copy engines
# copy each block's gradients into the other rank's memory as soon as the backward has produced
# them (no SM moves a byte), and each block's fused update reads its own and the received
# gradients and averages them in the same pass (`systems.parallel.peer`); `peer_update:read` (two
# GPUs) copies nothing: after the backward each block's update reads the other GPU's gradients over
# NVLink from where its backward left them (`systems.parallel.peer_memory`), between two barriers.
# Every wrapper agrees with the other ranks on which gradients it reduces (`grad_check_ms`, a CPU
# round trip per step). Each variant's steps run in one
# block after the previous variant's, so a machine whose speed drifts moves the difference between
# two blocks; in the master-weights setting, rounds that alternate `nosync`, the fastest of our
# variants and torch DDP (ABC then CBA, a fresh warm-up each) then give the overhead over no sync and
# the step over torch DDP's within each round.

# %%
ddp_config = ddp_bench.notebook_config(profile=ctx.profile, handout=ctx.handout)
ddp_config.out_path, ddp_config.overlap_path = str(ctx.result_path("ddp")), str(ctx.result_path("overlap"))
ddp_config.paired_path = str(ctx.result_path("paired"))
ddp_config.trace_dir = str(ctx.results / f"{ctx.name}_traces")
ddp_bench.run_ddp_benchmark(ddp_config, world_size=ddp_world_size, backend=backend)
ddp, overlap = read_results(ctx.result_path("ddp")), read_results(ctx.result_path("overlap"))
paired = read_results(ctx.result_path("paired"))
model_label = size_and_preset(ddp_config.model, ctx.handout)
nb.show(report.ddp_table(ddp), caption=f"{model_label} on {ddp_world_size} ranks ({backend}, {ctx.gpu}); "
                                       "vs_torch_ddp = step time / torch DDP's")
nb.save_figure(report.plot_ddp(ddp, title=f"Time per step: computation and communication overhead ({ctx.gpu})"),
               ctx, "ddp_variants")
fit = report.fit_alpha_beta(allreduce, backend=backend, world_size=ddp_world_size)
nb.answer(ctx, "naive_ddp_benchmarking", "", report.naive_answer(ddp, model_label=model_label))
nb.answer(ctx, "minimal_ddp_flat_benchmarking", "", report.flat_answer(ddp, fit=fit))
nb.answer(ctx, "ddp_overlap_individual_parameters_benchmarking", "a", report.overlap_answer(ddp))
nb.md("**Against torch DDP.**\n\n" + report.ddp_commentary(ddp, overlap))
if len(paired):
    nb.show(report.paired_table(paired), caption="rounds alternating nosync, the fastest of our variants and torch "
                                                  "DDP (master-weights setting); overhead = variant - nosync, "
                                                  "vs_torch_ddp = variant / torch DDP, within the round")

# %% [markdown]
# ## Overlap in the profiler traces
#
# Rank 0's `torch.profiler` trace of naive DDP, per-parameter overlap and the fastest of our
# variants, one whole step each: a GPU step runs from the first to the last kernel launched during
# it, on any stream and from any thread (autograd's thread launches the backward and the hooks'
# all-reduces). Exposed communication = time some communication runs while nothing else does.

# %%
nb.show(report.overlap_table(overlap), caption="per profiled step, from the traces")
nb.save_figure(report.plot_overlap(overlap, title=f"One profiled step per variant ({ctx.gpu})"), ctx, "overlap")
nb.answer(ctx, "ddp_overlap_individual_parameters_benchmarking", "b", report.trace_answer(overlap))
nb.md("**Against our own targets** (the project's, not the handout's):\n\n"
      + report.ddp_targets(report.ddp_table(ddp), overlap, paired))

# %% [markdown]
# ## Bucket sizes against the overhead model (2025 handout)
#
# The handout's model (notebook 09 derives it): $n_b$ equal buckets, each all-reduce $o + s/(n_b w)$,
# gradients computed as fast as they are sent, gives $s/(n_b w) + n_b o$ after the backward. The
# *paced* model keeps the queue but takes the backward's measured length and the real last bucket
# (`systems.analysis.parallel_math.ddp_bucket_overhead_paced`). $o$ and $w$ are fitted to this
# run's all-reduce times for the DDP benchmark's backend and world size.

# %%
if ctx.handout == "2025" and fit is not None:
    frame = report.bucket_model_frame(ddp, fit)
    nb.show(frame.drop(columns=["grad_bytes", "backward_ms"]), caption="bucketed DDP: measured against the models")
    nb.save_figure(report.plot_bucket_model(frame, fit), ctx, "bucket_model")
    nb.answer(ctx, "ddp_bucketed_benchmarking", "a", report.bucketed_answer(ddp, frame, fit))
elif ctx.handout == "2025":
    nb.not_run(ctx, "ddp_bucketed_benchmarking", "a",
               f"no {backend} all-reduce at {ddp_world_size} ranks with two sizes, so o and w cannot be fitted")
else:
    nb.md("The 2026 handout asks nothing about bucket sizes; the bucketed variants above are our fastest.")
