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
# # 02 · Kernel profiling: where the time goes
# Which kernels does a forward pass and a full training step of the Transformer LM spend their
# time in (handout question `nsys_profile` (a)-(e))? Each configuration runs under `torch.profiler`
# after the harness's warm-up, with named ranges for forward / backward / optimizer step and,
# inside naive attention, attention scores / softmax / final matmul. Kernels are tied to ranges
# through the trace's launch correlation ids, grouped into an Nsight-style kernel summary and
# into categories (matmul, elementwise, reduction/softmax, copy/memset, optimizer, other). On a
# machine without CUDA (smoke profile) the same tables are built from CPU operators.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" (CPU, < 60 s) or "full" (GPU, < 5 min on one H100)
out_dir = "build/smoke"  # the runner injects this

# %%
import pandas as pd

from systems.report import notebook as nb
from systems.bench import profile as bench_profile
from systems.measure import flops
from systems.measure import profiler as profiling
from systems.report import kernel_profiling
from systems.bench.benchmark import BenchmarkConfig
from systems.measure.results import ResultWriter

ctx = nb.setup(name="02_kernel_profiling", profile=profile, out_dir=out_dir)
if not ctx.full:
    import torch

    # the smoke model's operators are tiny: on a shared 2-core CPU, OpenMP threads spin-waiting on
    # each other cost more than the arithmetic (a sweep ran ~6x slower with 2 threads than with 1)
    torch.set_num_threads(1)

if ctx.full:
    # two handout sizes, three power-of-two contexts above 128; fp32 as in the handout
    SIZES = {"small": ("small", {}), "medium": ("medium", {})}
    CONTEXTS = [256, 512, 1024]
    BATCH, WARMUP, MEASURE, PROFILE_STEPS = 4, 3, 5, 3
else:
    # CPU smoke: the tiny debug model and a wider variant, short contexts, few steps
    SIZES = {"debug": ("debug", {}), "debug-wide": ("debug", {"d_model": 128, "d_ff": 384})}
    CONTEXTS = [32, 64, 128]
    BATCH, WARMUP, MEASURE, PROFILE_STEPS = 2, 1, 2, 1
MODES = ["forward", "train_step"]

configs = [(label, BenchmarkConfig(model=model, model_overrides=over, context_length=c, batch_size=BATCH,
                                   warmup=WARMUP, steps=MEASURE, mode=mode))
           for label, (model, over) in SIZES.items() for c in CONTEXTS for mode in MODES]
timeline_key = (list(SIZES)[0], CONTEXTS[0], "train_step")
summary, results = bench_profile.profile_sweep(
    configs, profile_steps=PROFILE_STEPS, writer=ResultWriter(ctx.result_path("summary")),
    keep_trace=timeline_key, trace_dir=ctx.out_dir / "traces")
ok = summary[summary["status"] == "ok"].copy()
device_word = "GPU kernels" if ctx.device == "cuda" else "CPU operators"
nb.md(f"Profiled {len(ok)} of {len(summary)} configurations ({device_word}); "
      f"out of memory: {int((summary['status'] == 'oom').sum())}.")

# %% [markdown]
# ## (a) Forward time under the profiler against the harness
# `harness` is `run_benchmark`'s forward mean (no profiler). The profiling loop is the harness's
# step with named ranges; it times the same model first without the profiler (`plain`) and then
# under it (`profiled`), so `profiled / plain - 1` is the profiler's overhead. `profiled span` is
# read from the trace: from the start of the `forward` range to the end of its last kernel (the
# range closes after the synchronise).

# %%
a = ok.assign(
    harness_ms=ok["harness_forward_s"] * 1e3, harness_std_ms=ok["harness_forward_std_s"] * 1e3,
    plain_ms=ok["plain_forward_s"] * 1e3, profiled_ms=ok["profiled_forward_s"] * 1e3,
    profiled_span_ms=ok["profiled_forward_span_s"] * 1e3, kernel_ms=ok["forward_kernel_s"] * 1e3,
)[["label", "context_length", "mode", "harness_ms", "harness_std_ms", "plain_ms", "profiled_ms", "profiler_overhead",
   "profiled_span_ms", "span_vs_harness", "kernel_ms", "agrees_within_overhead"]]
nb.show(a, caption="forward pass: harness vs profiler")

# %%
fa = a[a["mode"] == "forward"]
n_agree = int(fa["agrees_within_overhead"].sum())
worst = fa.loc[fa["span_vs_harness"].abs().idxmax()]
nb.md(
    f"**(a)** Forward only, the profiled forward span differs from the harness's number by "
    f"{fa['span_vs_harness'].abs().min():.1%} to {fa['span_vs_harness'].abs().max():.1%} "
    f"(largest: {worst['label']} at {worst['context_length']} tokens, {worst['profiled_span_ms']:.2f} ms against "
    f"{worst['harness_ms']:.2f} ms). The profiler's measured overhead (same model and loop, with "
    f"against without it) is "
    f"{fa['profiler_overhead'].median():+.1%} (median; range {fa['profiler_overhead'].min():+.1%} to "
    f"{fa['profiler_overhead'].max():+.1%}). In {n_agree} of {len(fa)} configurations the profiled span lies "
    f"within that overhead (plus two standard deviations of the timing noise: the harness's spread and "
    f"that of the two loops the overhead comes from) of the harness's number. "
    f"Kernel time alone is {(fa['kernel_ms'] / fa['profiled_span_ms']).median():.0%} of the span (median): "
    f"the rest is time with no {'kernel' if ctx.device == 'cuda' else 'operator'} running "
    f"(launch gaps, Python, the synchronise)."
)

# %% [markdown]
# ## (b) The top kernel of the forward pass

# %%
def largest(mode):
    """The biggest (size, context) profiled in `mode`: the one the detailed tables show."""
    return max((k for k in results if k[2] == mode), key=lambda k: (list(SIZES).index(k[0]), k[1]))


big, big_train = largest("forward"), largest("train_step")
nb.show(results[big].kernels(ranges="forward", top=10).drop(columns="name"),
        caption=f"forward kernels, {big[0]} @ {big[1]} tokens (per step = per forward pass)")
b = ok[ok["mode"] == "forward"][["label", "context_length", "top_forward_kernel", "top_forward_category",
                                 "top_forward_share", "top_forward_per_pass", "top_forward_name"]]
bt = ok[ok["mode"] == "train_step"][["label", "context_length", "top_fwd_bwd_kernel", "top_fwd_bwd_share",
                                     "top_fwd_bwd_name"]]
b = b.merge(bt, on=["label", "context_length"], how="left")
# the same kernel (full name) leads inference's forward pass and the train step's forward+backward
b["stays_on_top"] = b["top_fwd_bwd_name"] == b["top_forward_name"]
nb.show(b.drop(columns=["top_forward_name", "top_fwd_bwd_name"]),
        caption="top kernel by cumulative time: forward only, and forward+backward in a train step")

# %%
top_counts = b["top_forward_kernel"].value_counts()
top_name = top_counts.index[0]
rows_top = b[b["top_forward_kernel"] == top_name]
per_pass = rows_top.groupby("label", sort=False)["top_forward_per_pass"].agg(lambda x: sorted(set(x)))
moved = b[~b["stays_on_top"]]
nb.md(
    f"**(b)** The kernel with the most cumulative forward time is `{top_name}` in {top_counts.iloc[0]} of {len(b)} "
    f"configurations ({rows_top['top_forward_category'].iloc[0]}; {rows_top['top_forward_share'].min():.0%}–"
    f"{rows_top['top_forward_share'].max():.0%} of forward kernel time)"
    + ("" if len(top_counts) == 1 else
       "; elsewhere it is " + ", ".join(f"`{k}`" for k in top_counts.index[1:]))
    + ". It is launched "
    + ", ".join(f"{'/'.join(f'{n:g}' for n in v)} times per forward pass for {lbl}" for lbl, v in per_pass.items())
    + f". The same kernel also leads forward+backward in a train step in {int(b['stays_on_top'].sum())} of "
    f"{len(b)} configurations"
    + ("." if moved.empty else
       "; where it does not, the leader is " + ", ".join(
           f"`{r.top_fwd_bwd_kernel}` ({r.label}, {r.context_length})" for r in moved.itertuples()) + ".")
)

# %% [markdown]
# ## (c) What besides matrix multiplies takes forward time

# %%
fwd_big = results[big].kernels(ranges="forward")
non_mm = fwd_big[fwd_big["category"] != "matmul"].head(12).drop(columns="name")
nb.show(non_mm, caption=f"non-matmul forward kernels, {big[0]} @ {big[1]} tokens (share of all forward kernel time)")
cat_fwd = pd.DataFrame([{"label": k[0], "context_length": k[1],
                         **{c.category: c.share for c in r.categories(ranges="forward").itertuples()}}
                        for k, r in results.items() if k[2] == "forward"])
nb.show(cat_fwd, caption="forward: share of kernel time by category")

# %%
non_mm_share = 1 - fwd_big[fwd_big["category"] == "matmul"]["share"].sum()
lead = non_mm.iloc[0] if len(non_mm) else None
nb.md(
    f"**(c)** For {big[0]} at {big[1]} tokens, kernels other than matrix multiplies take {non_mm_share:.1%} of "
    f"forward kernel time"
    + (f"; the largest is `{lead['kernel']}` ({lead['category']}, {lead['share']:.1%}, "
       f"{lead['instances_per_step']:.0f} launches per pass), followed by "
       + ", ".join(f"`{r.kernel}` ({r.share:.1%})" for r in non_mm.iloc[1:5].itertuples()) + "."
       if lead is not None else ".")
    + f" Across configurations the non-matmul share of the forward pass runs from "
    f"{(1 - cat_fwd['matmul']).min():.1%} to {(1 - cat_fwd['matmul']).max():.1%}."
)

# %% [markdown]
# ## (d) Matmul share: inference against a full training step

# %%
cats = list(profiling.CATEGORIES)
d = ok[["label", "context_length", "mode"] + [f"share_{c}" for c in cats]].rename(
    columns={f"share_{c}": c for c in cats})
nb.show(d.sort_values(["label", "context_length", "mode"]), caption="share of a step's kernel time by category")
nb.show(results[big_train].range_totals(), caption=f"train step ranges, {big_train[0]} @ {big_train[1]} tokens")
nb.show(results[big_train].kernels(ranges="optimizer step", top=8).drop(columns="name"),
        caption="optimizer-step kernels (our AdamW)")

# %%
pair = d.pivot_table(index=["label", "context_length"], columns="mode", values=cats)
mm_inf, mm_train = pair[("matmul", "forward")], pair[("matmul", "train_step")]
delta = {c: (pair[(c, "train_step")] - pair[(c, "forward")]).median() for c in cats if c != "matmul"}
grow = max(delta, key=delta.get)
nb.md(
    f"**(d)** Matrix multiplies take {mm_inf.min():.1%}–{mm_inf.max():.1%} of kernel time in inference (forward "
    f"only) and {mm_train.min():.1%}–{mm_train.max():.1%} in a full train step (median change "
    f"{(mm_train - mm_inf).median():+.1%} points). Among the rest, the median change in share from inference "
    f"to train step is " + ", ".join(f"{c} {v:+.1%} points" for c, v in delta.items())
    + f"; `{grow}` grows most. The optimizer step launches "
    f"{ok.loc[ok['mode'] == 'train_step', 'optimizer_kernels_per_step'].max():.0f} {device_word.split()[1]} per step "
    f"at most (our AdamW batches its updates into multi-tensor `_foreach` kernels on CUDA), and by name "
    f"{ok.loc[ok['mode'] == 'train_step', 'optimizer_elementwise_share'].median():.0%} of its time (median) is "
    f"elementwise kernels."
)

# %% [markdown]
# ## (e) Softmax against the two attention matmuls
# FLOPs are analytic: each of QKᵀ and PV costs 2·B·H·T²·d_head per layer; the softmax
# `flops.SOFTMAX_FLOPS_PER_ELEMENT` FLOPs per score element (max, subtract, exp, sum, divide).
# Runtime is the kernel time in the forward pass's `softmax` range against the matmul kernels in
# the `attention scores` and `final matmul` ranges.

# %%
e = ok[ok["mode"] == "forward"].assign(
    softmax_ms=lambda x: x["softmax_s"] * 1e3,
    attn_matmuls_ms=lambda x: (x["attention_scores_matmul_s"] + x["final_matmul_matmul_s"]) * 1e3,
    scores_range_ms=lambda x: x["attention_scores_s"] * 1e3,
)[["label", "context_length", "softmax_ms", "attn_matmuls_ms", "scores_range_ms", "softmax_to_matmul_time",
   "softmax_to_matmul_flops"]]
e["time_over_flop_ratio"] = e["softmax_to_matmul_time"] / e["softmax_to_matmul_flops"]
nb.show(e, caption="forward: softmax vs the attention matmuls (all layers, per pass)")

# %%
nb.md(
    f"**(e)** The softmax performs {e['softmax_to_matmul_flops'].min():.2%}–{e['softmax_to_matmul_flops'].max():.2%} "
    f"of the two attention matmuls' FLOPs but takes {e['softmax_to_matmul_time'].min():.3g}–"
    f"{e['softmax_to_matmul_time'].max():.3g}× their runtime: per FLOP the softmax takes "
    f"{e['time_over_flop_ratio'].min():.3g}–{e['time_over_flop_ratio'].max():.3g}× as long as the matmuls. "
    f"The matmuls reuse each loaded element d_head times; the softmax reads and writes the whole B·H·T² score "
    f"tensor for a handful of FLOPs per element, so memory bandwidth, not arithmetic, sets its time."
)

# %% [markdown]
# ## One train step over time
# Rendered from the exported Chrome trace (open it in `chrome://tracing` or Perfetto for detail).

# %%
trace = ctx.out_dir / "traces" / f"{timeline_key[0]}_{timeline_key[1]}_{timeline_key[2]}.json.gz"
fig = kernel_profiling.plot_step_timeline(trace, title=f"one train step, {timeline_key[0]} @ {timeline_key[1]} tokens: "
                                                f"{device_word} by category")
nb.save_figure(fig, ctx, "train_step_timeline")

# %% [markdown]
# ## Nsight Systems
# Where `nsys` is on PATH, the same train step runs under `nsys profile --capture-range=nvtx` and
# `nsys stats --report cuda_gpu_kern_sum` is parsed into the same table.

# %%
if ctx.full and profiling.nsys_available():
    label, (model, over) = next(iter(SIZES.items()))
    nsys_cfg = BenchmarkConfig(model=model, model_overrides=over, context_length=CONTEXTS[0], batch_size=BATCH,
                               warmup=WARMUP, mode="train_step")
    nsys_table = bench_profile.run_nsys(nsys_cfg, ctx.out_dir / "traces" / "nsys", steps=PROFILE_STEPS)
    nb.show(nsys_table.head(10).drop(columns="name"), caption="nsys cuda_gpu_kern_sum, one train step")
else:
    nb.md("`nsys` is not on PATH here (or this is the smoke profile): the Nsight path was skipped.")
