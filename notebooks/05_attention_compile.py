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
# the naive attention function (batch 8, no head dimension) over head dim x sequence length,
# doubling the length until the device runs out of memory, account for the memory of the
# smallest configuration that fails, fit how saved memory grows with sequence length, and then
# compare compiled against eager: first the attention function alone, then the whole Transformer.

# %% tags=["parameters"]
profile = "smoke"        # "smoke": CPU, tiny sizes, simulated memory limit; "full": one GPU (< 9 min on an H100)
out_dir = "build/smoke"  # the runner injects this
attn_iters = None        # timed forward and backward passes per point (default: 100 full, 10 smoke)
model_sizes = None       # whole-model comparison (default: the handout sizes full, ["debug"] smoke)
model_budget_s = 150     # wall-clock budget for the *compiled* whole-model points (full profile)
compile_scope = "blocks" # "blocks" (each Transformer block compiled) or "model" (torch.compile of the model)
smoke_limit_mib = 8      # smoke only: simulated device capacity that makes a CPU point "run out of memory"

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from systems.report import notebook as nb
from systems.bench.attention import (AttentionPoint, AttentionSweepConfig, attention_memory_accounting,
                                     flash_attention_accounting, model_compile_table, ratio_table,
                                     run_attention_point, run_attention_sweep, run_model_compile_sweep,
                                     saved_memory_fits, fit_power_law, sdpa_one_head, simulated_memory_limit,
                                     smallest_oom, sweep_table)
from systems.config import handout_sizes
from systems.measure.results import ResultWriter

ctx = nb.setup(name="05_attention_compile", profile=profile, out_dir=out_dir)
GIB = 2**30
if ctx.full:
    attn_cfg = AttentionSweepConfig(n_forward=attn_iters or 100, n_backward=attn_iters or 100, device=ctx.device)
    fail_if, limit_note = None, "real device memory"
    compile_backend = "inductor"
else:
    # CPU: tiny sizes; an OOM is injected where the accounting's peak exceeds a simulated capacity
    attn_cfg = AttentionSweepConfig(head_dims=(16, 32), seq_lens=(64, 128), max_seq_len=1024,
                                    n_forward=attn_iters or 10, n_backward=attn_iters or 10, warmup=1, device="cpu")
    fail_if = simulated_memory_limit(smoke_limit_mib * 2**20, dtype=attn_cfg.dtype)
    limit_note = f"a simulated {smoke_limit_mib} MiB capacity (injected allocation failure; smoke profile)"
    # Inductor's CPU code generation takes tens of seconds per shape: smoke traces with aot_eager,
    # which exercises the compiled path but generates no new code, so its ratios mean nothing
    compile_backend = "aot_eager"
nb.md(f"Attention sweep: batch {attn_cfg.batch_size}, {attn_cfg.dtype}, d ∈ {list(attn_cfg.head_dims)}, "
      f"seq ∈ {list(attn_cfg.seq_lens)} then ×2 up to {attn_cfg.max_seq_len:,} until out of memory "
      f"({limit_note}); {attn_cfg.warmup} warm-up forward+backward, then {attn_cfg.n_forward} timed forward "
      f"and {attn_cfg.n_backward} timed backward passes per point (CUDA events on a GPU), TF32 "
      f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}.")

# %% [markdown]
# ## (a) Naive attention: time, memory before backward, and the out-of-memory point
#
# Forward passes run with autograd on (as in training) and drop their output each pass. The
# memory before backward is `torch.cuda.memory_allocated()` after one forward with its graph
# alive; "saved" is that minus what was allocated before the forward (on a CPU, the bytes autograd
# saves, counted with saved-tensor hooks). A point that runs out of memory is a row with status
# `oom` and the phase it failed in; longer listed lengths of that head dim are then `skipped`.

# %%
# On a GPU each sweep runs in a child process: an OOM inside backward() can leave the failed
# graph's buffers allocated, which would distort every later measurement in this kernel.
eager_rows = run_attention_sweep(attn_cfg, out_path=ctx.result_path("attention_eager"), fail_if=fail_if,
                                 isolate=ctx.full)
nb.show(sweep_table(eager_rows), caption=f"naive attention, eager, on {ctx.gpu}")

# %%
ok = [r for r in eager_rows if r["status"] == "ok"]
oom = smallest_oom(eager_rows)
largest = max(ok, key=lambda r: (r["seq"], r["d"])) if ok else None
lines = []
if largest:
    lines.append(f"The largest point that ran, d={largest['d']} seq={largest['seq']:,}, takes "
                 f"{largest['forward_ms_median']:.3g} ms forward and {largest['backward_ms_median']:.3g} ms backward "
                 f"(median of {largest['n_forward']}; {largest['forward_tflops']:.3g} / "
                 f"{largest['backward_tflops']:.3g} TFLOP/s).")
if oom:
    lines.append(f"The first out-of-memory point is **d={oom['d']}, seq={oom['seq']:,}** (it failed in the "
                 f"`{oom['oom_phase']}` phase).")
else:
    lines.append(f"No point ran out of memory up to seq {attn_cfg.max_seq_len:,}.")
nb.md("**Answer (a), timing.** " + " ".join(lines))

# %% [markdown]
# ## Memory accounting for the smallest out-of-memory configuration
#
# Computed from the shapes in `systems.attention.naive` (see `attention_memory_accounting`),
# against the free memory `torch.cuda.mem_get_info()` reported just before that point ran.

# %%
if oom:
    free = oom.get("cuda_free_bytes") or (smoke_limit_mib * 2**20 if not ctx.full else None)
    acct = attention_memory_accounting(batch=oom["batch_size"], seq=oom["seq"], d=oom["d"], dtype=oom["dtype"],
                                       free_bytes=free)
    a = acct.attrs
    nb.show(acct[["tensor", "GiB", "when"]], caption=f"naive attention, batch {a['batch']}, seq {a['seq']:,}, "
            f"d {a['d']}, {a['dtype']}")
    free_txt = ("unknown free memory" if free is None else
                f"{free / GIB:.4g} GiB free" + (" (simulated)" if not ctx.full else " (torch.cuda.mem_get_info)"))
    verdict = lambda fits: "(no free-memory figure)" if fits is None else ("fits" if fits else "does **not** fit")
    # cross-check: the accounting's peak for the largest point that ran against its measured peak
    check = ""
    ran = [r for r in ok if r.get("peak_bytes")]
    if ran:
        big = max(ran, key=lambda r: (r["seq"], r["d"]))
        pred = attention_memory_accounting(batch=big["batch_size"], seq=big["seq"], d=big["d"], dtype=big["dtype"])
        check = (f" Cross-check on the largest point that ran (d={big['d']}, seq={big['seq']:,}): accounting peak "
                 f"{pred.attrs['peak_bytes'] / GIB:.4g} GiB, measured peak {big['peak_bytes'] / GIB:.4g} GiB; memory "
                 f"before backward predicted {pred.attrs['before_backward_bytes'] / GIB:.4g} GiB, measured "
                 f"{big['mem_before_backward_bytes'] / GIB:.4g} GiB.")
    nb.md(f"**Answer (a), accounting.** One score-sized (batch × seq × seq) tensor is "
          f"{a['score_matrix_bytes'] / GIB:.4g} GiB at d={a['d']}, seq={a['seq']:,}, against {free_txt}. "
          f"The forward pass peaks at {a['forward_peak_bytes'] / GIB:.4g} GiB (inputs plus two score-sized tensors: "
          f"the product and its scaled copy, then the scaled scores and the softmax output) and "
          f"{verdict(a.get('forward_fits'))}; autograd then keeps the softmax output "
          f"({a['saved_bytes'] / GIB:.4g} GiB saved, {a['before_backward_bytes'] / GIB:.4g} GiB in use before backward); "
          f"the backward pass needs three score-sized tensors at once (P, dP and the softmax gradient), "
          f"{a['backward_peak_bytes'] / GIB:.4g} GiB, which {verdict(a.get('backward_fits'))}. "
          f"The measured failure was in the `{oom['oom_phase']}` phase." + check)
else:
    nb.md("No out-of-memory point, so there is nothing to account for; raise `max_seq_len`.")

# %% [markdown]
# ## How saved memory scales with sequence length
#
# A least-squares line through log(saved bytes) against log(seq), per head dim, over the points
# that ran.

# %%
fits = saved_memory_fits(eager_rows)
nb.show(fits, caption="saved memory ∝ seq^exponent (log-log least squares)")
fig, ax = plt.subplots(figsize=(6.5, 4))
df_ok = pd.DataFrame(ok)
for (d, g), marker in zip(df_ok.groupby("d"), "osD^v"):
    g = g.sort_values("seq")
    line, = ax.loglog(g["seq"], g["saved_bytes"] / GIB, marker, mfc="none", label=f"d={d}")
    if g["seq"].nunique() > 1:
        f = fit_power_law(g["seq"], g["saved_bytes"])
        xs = np.geomspace(g["seq"].min(), g["seq"].max(), 50)
        ax.loglog(xs, f.predict(xs) / GIB, "-", color=line.get_color(), alpha=0.6)
if oom and free:
    ax.axhline(free / GIB, color="k", ls=":", label="free memory" if ctx.full else "simulated capacity")
ax.set_xlabel("sequence length")
ax.set_ylabel("saved by the forward (GiB)")
ax.set_title(f"Naive attention, batch {attn_cfg.batch_size} ({ctx.gpu})")
ax.legend(fontsize=8)
nb.save_figure(fig, ctx, "saved_memory")

# %%
if not fits.empty:
    all_ok = df_ok[df_ok["saved_bytes"].notna()]
    pooled = fit_power_law(all_ok["seq"], all_ok["saved_bytes"])  # all head dims together
    per_d = ", ".join(f"d={int(r.d)}: {r.exponent:.3f}" for r in fits.itertuples())
    low = fits["exponent"].min() < 1.97
    nb.md(f"**Answer (a), scaling.** Saved memory grows as seq^{pooled.exponent:.2f} (pooled fit over "
          f"{pooled.n} points, R² {pooled.r2:.4f}; per head dim {per_d}): quadratic, because what the forward "
          f"leaves behind is dominated by the softmax output P, batch × seq × seq, whatever d is."
          + (" Exponents below 2 come from the batch × seq × d output counted in the measured bytes, a linear "
             "term that matters at short lengths and large d." if low else ""))

# %% [markdown]
# ## What removes that cost
#
# FlashAttention never materialises P: it tiles Q and K/V into blocks that live in on-chip
# memory, keeps a running row max and sum (online softmax), saves only the output O and the row
# logsumexp L, and recomputes each P tile in the backward pass from Q, K and L. Below, its
# accounting for the same configuration, and a measurement of torch's fused SDPA (memory-efficient
# or flash kernel, given the inputs as one head) at that configuration.

# %%
if oom:
    fa = flash_attention_accounting(batch=oom["batch_size"], seq=oom["seq"], d=oom["d"], dtype=oom["dtype"])
    n_check = 5 if ctx.full else 3
    sdpa = run_attention_point(AttentionPoint(oom["batch_size"], oom["seq"], oom["d"], oom["dtype"]), fn=sdpa_one_head,
                               device=ctx.device, n_forward=n_check, n_backward=n_check, warmup=1, count_saved=True)
    sdpa["fn"] = "sdpa (one head)"
    ResultWriter(ctx.result_path("sdpa_at_oom")).write(sdpa)
    if sdpa["status"] == "ok":
        measured = (f"torch SDPA at the same configuration **runs**: {sdpa['forward_ms_median']:.3g} ms forward, "
                    f"{sdpa['backward_ms_median']:.3g} ms backward (median of {n_check}), saving "
                    f"{sdpa['saved_tensor_bytes'] / GIB:.4g} GiB (saved-tensor hooks)"
                    + (f", {sdpa['mem_before_backward_bytes'] / GIB:.4g} GiB in use before backward, peak "
                       f"{sdpa['peak_bytes'] / GIB:.4g} GiB." if sdpa.get("peak_bytes") else "."))
    else:
        measured = f"torch SDPA at the same configuration also failed ({sdpa['status']}: {sdpa['error']})."
    nb.md(f"**Answer (a), the fix.** At d={oom['d']}, seq={oom['seq']:,} naive attention saves "
          f"{fa['naive_saved_bytes'] / GIB:.4g} GiB (P); FlashAttention saves O and L, "
          f"{fa['flash_saved_bytes'] / GIB:.4g} GiB, {fa['saving_factor']:,.0f}× less, so saved memory grows "
          f"linearly in seq instead of quadratically. With {fa['block_q']}×{fa['block_k']} blocks (a parameter of "
          f"the accounting) the score matrix exists only as {fa['score_tile_bytes'] / 1024:.0f} KiB tiles in on-chip "
          f"memory, {fa['n_tiles']:,} of them per pass, never written to HBM. The price is recomputation: one extra "
          f"Q K^T in the backward pass, {fa['recompute_flops'] / 1e12:.3g} TFLOP, "
          f"{fa['recompute_fraction_of_backward']:.0%} on top of the backward's matmul FLOPs, in exchange for not "
          f"writing and re-reading seq × seq tensors. Measured: {measured}")

# %% [markdown]
# ## (b) torch_compile: the attention function compiled vs eager
#
# The same sweep with `torch.compile(naive_attention)` (one compiled object; Dynamo recompiles
# for new shapes and then treats the changing sizes as dynamic). Ratios are eager / compiled:
# above 1 means compiled is faster or uses less memory. "first call s" includes compilation.

# %%
from dataclasses import replace

# smoke: dynamic=True traces once for all shapes (each trace costs seconds on a CPU)
comp_cfg = replace(attn_cfg, compiled=True, compile_backend=compile_backend, compile_dynamic=None if ctx.full else True)
comp_rows = run_attention_sweep(comp_cfg, out_path=ctx.result_path("attention_compiled"), fail_if=fail_if,
                                isolate=ctx.full)
ratios = ratio_table(eager_rows, comp_rows)
nb.show(ratios, caption=f"naive attention, eager vs torch.compile (backend {compile_backend}), on {ctx.gpu}")

# %%
both = ratios.dropna(subset=["fwd speedup", "bwd speedup"])
if not both.empty:
    top = both.sort_values(["seq", "d"]).iloc[-1]
    c_oom = smallest_oom(comp_rows)
    e_first = {r["d"]: r["seq"] for r in sorted(eager_rows, key=lambda r: -r["seq"]) if r["status"] == "oom"}
    c_first = {r["d"]: r["seq"] for r in sorted(comp_rows, key=lambda r: -r["seq"]) if r["status"] == "oom"}
    same = [d for d in c_first if e_first.get(d) == c_first[d]]
    oom_txt = (f"The compiled version first runs out of memory at d={c_oom['d']}, seq={c_oom['seq']:,} "
               f"(`{c_oom['oom_phase']}`); its first out-of-memory length equals eager's for "
               f"{len(same)} of {len(c_first)} head dims" if c_oom else "The compiled version did not run out of memory")
    mem = ratios["mem before bwd ratio"].dropna()
    mem_txt = (f" Memory before backward, eager / compiled: median {mem.median():.2f}×." if not mem.empty else "")
    smoke_note = ("" if ctx.full else " (smoke profile: backend aot_eager generates no kernels, so these "
                  "ratios only show that the path works)")
    nb.md(f"**Answer (b), attention.** Over {len(both)} points that ran both ways, compiled/eager speedup has "
          f"median {both['fwd speedup'].median():.2f}× forward (range {both['fwd speedup'].min():.2f}–"
          f"{both['fwd speedup'].max():.2f}) and {both['bwd speedup'].median():.2f}× backward (range "
          f"{both['bwd speedup'].min():.2f}–{both['bwd speedup'].max():.2f}); at the longest common point "
          f"(d={int(top['d'])}, seq={int(top['seq']):,}) {top['fwd speedup']:.2f}× / {top['bwd speedup']:.2f}×. "
          f"{oom_txt}.{mem_txt} Compilation fuses the scaling and softmax (and masking) into fewer passes over "
          f"the seq × seq matrix, but the matrix is still materialised and saved for backward, so memory stays "
          f"quadratic in seq{smoke_note}.")

# %% [markdown]
# ## (b) torch_compile: the whole Transformer compiled vs eager
#
# Through the harness (`systems.bench.benchmark.run_benchmark`): context 512, batch 4, fp32 weights with
# TF32 matmuls allowed, 2 warm-up and 5 measured steps. "Compiled" compiles every Transformer
# block (`compile_scope` parameter, `"blocks"` by default): all blocks share one compiled graph, as
# in torchtitan, so compile time does not grow with depth (`torch.compile` of the whole model
# unrolls all layers into one graph: `compile_scope = "model"`); embedding, final norm and LM head
# stay eager. Each size compiles twice, not three times: the inference forward (`mode="forward"`)
# and the train step; forward+backward is the train step's separately synchronised forward and
# backward phases. Eager runs every size; compiled sizes run smallest first until
# `model_budget_s` would be exceeded (the skipped ones say so). Compile time = first warm-up
# step − steady-state median.

# %%
if ctx.full:
    sizes = model_sizes or list(handout_sizes("2025").values())
    model_rows = run_model_compile_sweep(sizes, context_length=512, batch_size=4, modes=("train_step", "forward"),
                                         tf32=True, device=ctx.device, budget_s=model_budget_s,
                                         compile_scope=compile_scope,
                                         out_path=ctx.result_path("model_compile"))
else:
    # Inductor's CPU compile of even the debug model takes tens of seconds: smoke runs eager only
    sizes = model_sizes or ["debug"]
    model_rows = run_model_compile_sweep(sizes, context_length=64, batch_size=4, modes=("train_step", "forward"),
                                         tf32=False, device="cpu", compile_scope=None, warmup=1, steps=2,
                                         out_path=ctx.result_path("model_compile"))
mtab = model_compile_table(model_rows)
nb.show(mtab, caption=f"whole model, eager vs torch.compile (scope: {compile_scope}), on {ctx.gpu}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
piv = mtab.pivot(index="size", columns="measurement", values="speedup").reindex(index=list(dict.fromkeys(mtab["size"])))
if piv.notna().any().any():
    piv.plot.bar(ax=ax1)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_ylabel("eager / compiled time")
    ax1.set_title("Speedup from torch.compile")
else:
    # nothing compiled (smoke): show the eager times that were measured
    mtab.pivot(index="size", columns="measurement", values="eager ms").plot.bar(ax=ax1)
    ax1.set_ylabel("ms")
    ax1.set_title("Eager time (no compiled runs in this profile)")
ct = (pd.DataFrame([{"size": r["model"], "mode": r["mode"], "compile s": r.get("first_step_overhead_s")}
                    for r in model_rows if r["compile"] and r["status"] == "ok"]))
if not ct.empty:
    ct.pivot(index="size", columns="mode", values="compile s").reindex(
        index=[s for s in dict.fromkeys(mtab["size"]) if s in set(ct["size"])]).plot.bar(ax=ax2)
else:
    ax2.text(0.5, 0.5, "no compiled runs in this profile", ha="center", va="center", transform=ax2.transAxes)
ax2.set_ylabel("seconds")
ax2.set_title("Compile time (first step − steady state)")
fig.suptitle(f"Whole Transformer, context 512 batch 4 ({ctx.gpu})" if ctx.full else "debug model, eager only (smoke)")
fig.tight_layout()
nb.save_figure(fig, ctx, "model_compile")

# %%
done = mtab.dropna(subset=["speedup"])
skipped = [r for r in model_rows if r["status"] == "skipped"]
eager_oom = sorted({r["model"] for r in model_rows if not r["compile"] and r["status"] == "oom"})
parts = []
if not done.empty:
    for meas, g in done.groupby("measurement", sort=False):
        parts.append(f"{meas}: " + ", ".join(f"{r.size} {r.speedup:.2f}×" for r in g.itertuples()))
    cts = [r for r in model_rows if r["compile"] and r["status"] == "ok"]
    parts.append("compile time: " + ", ".join(f"{r['model']} {r['mode']} {r['first_step_overhead_s']:.1f} s"
                                               for r in cts))
if skipped:
    parts.append("not compiled: " + ", ".join(f"{r['model']} {r['mode']} ({r['error']})" for r in skipped))
if eager_oom:
    parts.append(f"out of memory in eager: {', '.join(eager_oom)}")
if not ctx.full:
    parts.append("smoke profile: compile skipped (Inductor on a CPU takes tens of seconds per graph), eager "
                 "timings of the debug model only")
nb.md("**Answer (b), whole model.** Eager / compiled speedup per size — " + "; ".join(parts) + ".")
