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
# # 05 · Attention at scale and torch.compile (pytorch_attention, torch_compile)
#
# Where does naive attention run out of memory, why, and what does `torch.compile` buy? We time
# naive attention (batch 8, no head dimension) over head dim × sequence length, doubling the
# length until the device runs out of memory, account for the memory of the smallest failing
# configuration and check the accounting against the measured peaks, fit how saved memory grows
# with the length, and compare compiled against eager: the attention function, then the whole model.

# %% tags=["parameters"]
profile = "smoke"        # "smoke": CPU, tiny sizes, simulated memory limit; "full": one GPU (~7 min on an H100)
out_dir = "build/smoke"  # the runner injects this
handout = "2026"         # whose Table 1 sizes the whole-model comparison runs
attn_iters = None        # timed forward and backward passes per point (default: 100 full, 10 smoke)
model_sizes = None       # whole-model comparison (default: the handout's sizes full, ["debug"] smoke)
time_budget_s = 450      # full profile: the two attention sweeps get 27% and 53%, the whole model the rest
compile_floor_s = 90     # full profile: the least the whole model's compiled points get, whatever the sweeps took
compile_scope = "blocks" # "blocks" (each Transformer block compiled) or "model" (torch.compile of the model)
smoke_limit_mib = 8      # smoke only: simulated device capacity that makes a CPU point "run out of memory"

# %%
import time
from dataclasses import replace

import matplotlib.pyplot as plt
import torch

from systems.bench import attention as bench
from systems.config import handout_sizes
from systems.measure.results import ResultWriter
from systems.report import attention_compile as report
from systems.report import notebook as nb

ctx = nb.setup(name="05_attention_compile", profile=profile, out_dir=out_dir, handout=handout)
t0 = time.time()
if ctx.full:
    attn_cfg = bench.AttentionSweepConfig(n_forward=attn_iters or 100, n_backward=attn_iters or 100, device=ctx.device)
    fail_if, capacity, kernels, backend = None, None, ctx.device, "inductor"
else:  # tiny sizes; an OOM is injected where the CPU accounting's peak exceeds a simulated capacity
    attn_cfg = bench.AttentionSweepConfig(head_dims=(16, 32), seq_lens=(64, 128), max_seq_len=1024, warmup=1,
                                          n_forward=attn_iters or 10, n_backward=attn_iters or 10, device="cpu")
    # aot_eager traces what Inductor does (Dynamo + AOTAutograd) without its CPU codegen, tens of s a shape
    capacity, kernels, backend = smoke_limit_mib * 2**20, "cpu", "aot_eager"
    fail_if = bench.simulated_memory_limit(capacity, dtype=attn_cfg.dtype, device=kernels)
nb.md(f"Batch {attn_cfg.batch_size}, {attn_cfg.dtype}, d ∈ {list(attn_cfg.head_dims)}, seq ∈ {list(attn_cfg.seq_lens)} "
      f"then ×2 up to {attn_cfg.max_seq_len:,} until out of memory ("
      + ("device memory" if ctx.full else f"a simulated {smoke_limit_mib} MiB capacity") + f"); {attn_cfg.warmup} "
      f"warm-up forward + backward, then {attn_cfg.n_forward} timed forward and {attn_cfg.n_backward} timed backward "
      f"passes, each followed by a synchronisation; TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}.")

# %% [markdown]
# ## pytorch_attention (a): time, memory before backward, and the out-of-memory point
# Forward passes run with autograd on (as in training) and drop their output. An out-of-memory
# point is a row with the phase it failed in; longer lengths of that head dim are `skipped`. On a
# GPU each head dim runs in its own process, so no point runs after an OOM inside `backward()`.

# %%
eager = bench.run_attention_sweep(replace(attn_cfg, deadline=t0 + 0.27 * time_budget_s if ctx.full else None),
                                  out_path=ctx.result_path("attention_eager"), fail_if=fail_if, isolate=ctx.full)
nb.show(report.sweep_table(eager), caption=f"naive attention, eager, on {ctx.gpu} (ms: medians, p10 and p90)")

# %% [markdown]
# ### Accounting for the smallest configuration that runs out of memory, checked against the peaks
# Terms from the shapes in `systems.attention.naive` (`systems.analysis.attention_memory`), against
# the free memory `torch.cuda.mem_get_info()` reported just before the point ran.

# %%
oom = bench.smallest_oom(eager)
acct = report.oom_accounting(eager, device=kernels, free_bytes=capacity)
if acct is not None:
    nb.show(acct[["tensor", "GiB", "when"]], caption=f"naive attention, batch {oom['batch_size']}, seq {oom['seq']:,}, "
            f"d {oom['d']}, {oom['dtype']}, {kernels} kernels", formats={"GiB": "{:.4g}"})
decomposition, check = report.decomposition_text(eager, device=kernels)
if decomposition is not None:
    nb.show(decomposition, caption="the largest point's measured peak, term by term")
fits = report.saved_memory_fits(eager)
nb.show(fits, caption="memory ∝ seq^exponent (log-log least squares)")
fig = report.saved_memory_figure(eager, capacity_bytes=oom.get("cuda_free_bytes") or capacity if oom else None,
                                 title=f"Naive attention, batch {attn_cfg.batch_size} ({ctx.gpu})")
nb.save_figure(fig, ctx, "saved_memory")
plt.show()

# %% [markdown]
# ### What removes the cost: FlashAttention's accounting, and torch's fused SDPA measured at that point

# %%
sdpa = None
if oom:
    n_check = 5 if ctx.full else 3
    sdpa = bench.run_attention_point(bench.AttentionPoint(oom["batch_size"], oom["seq"], oom["d"], oom["dtype"]),
                                     fn=bench.sdpa_one_head, device=ctx.device, n_forward=n_check,
                                     n_backward=n_check, warmup=1, count_saved=True)
    ResultWriter(ctx.result_path("sdpa_at_oom")).write({**sdpa, "fn": "sdpa (one head)"})
nb.answer(ctx, "pytorch_attention", "a", report.attention_answer(
    eager, acct=acct, check=check, fits=fits, sdpa=sdpa, max_seq_len=attn_cfg.max_seq_len,
    free_note="torch.cuda.mem_get_info" if ctx.full else "simulated"))

# %% [markdown]
# ## torch_compile (a): the attention function compiled against eager
# The same sweep with `torch.compile(naive_attention)`, one compiled object (Dynamo recompiles for
# new shapes, then treats the changing sizes as dynamic). Ratios are eager / compiled: above 1,
# compiled is faster or uses less memory. "first call s" includes compilation.

# %%
compiled_cfg = replace(attn_cfg, compiled=True, compile_backend=backend, compile_dynamic=None if ctx.full else True,
                       deadline=t0 + 0.80 * time_budget_s if ctx.full else None)
compiled = bench.run_attention_sweep(compiled_cfg, out_path=ctx.result_path("attention_compiled"), fail_if=fail_if,
                                     isolate=ctx.full)
ratios = report.ratio_table(eager, compiled)
nb.show(ratios, caption=f"naive attention, eager against torch.compile (backend {backend}), on {ctx.gpu}")
nb.answer(ctx, "torch_compile", "a",
          report.compile_attention_text(ratios, eager, compiled, device=kernels, smoke=not ctx.full))

# %% [markdown]
# ## torch_compile (b): the whole Transformer compiled against eager
# Through `run_benchmark`: context 512, batch 4, fp32 with TF32 matmuls, 2 warm-up and 5 measured
# steps. `compile_scope = "blocks"` compiles every block (one graph serves all, so compile time does
# not grow with depth; `"model"` traces the whole model). Forward + backward is the train step's
# synchronised phases; compiled sizes run in the order given, within the time left (at least
# `compile_floor_s`); compile time = first warm-up step − steady-state median.

# %%
if ctx.full:
    model_rows = bench.run_model_compile_sweep(model_sizes or list(handout_sizes(ctx.handout).values()),
                                               context_length=512, batch_size=4, modes=("train_step", "forward"),
                                               tf32=True, device=ctx.device, compile_scope=compile_scope,
                                               budget_s=max(compile_floor_s, 0.7 * (t0 + time_budget_s - time.time())),
                                               out_path=ctx.result_path("model_compile"))
else:  # Inductor's CPU compile of even the debug model takes tens of seconds: eager only
    model_rows = bench.run_model_compile_sweep(model_sizes or ["debug"], context_length=64, batch_size=4,
                                               modes=("train_step", "forward"), tf32=False, device="cpu",
                                               compile_scope=None, warmup=1, steps=2,
                                               out_path=ctx.result_path("model_compile"))
model_table = report.model_compile_table(model_rows, handout=ctx.handout)
nb.show(model_table, caption=f"whole model, eager against torch.compile (scope: {compile_scope}), on {ctx.gpu}")
nb.save_figure(report.model_compile_figure(model_table, title=f"Whole Transformer, context 512, batch 4 ({ctx.gpu})"
                                           if ctx.full else "debug model, eager only (smoke)"), ctx, "model_compile")
plt.show()
nb.answer(ctx, "torch_compile", "b", report.model_compile_text(model_table, model_rows, handout=ctx.handout,
                                                             smoke=not ctx.full))
