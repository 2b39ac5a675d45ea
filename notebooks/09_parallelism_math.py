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
# sharded to fit, and at what batch is a TPU v5p mesh compute-bound (2025 handout,
# `communication_accounting`)? For one SwiGLU FFN layer, how many devices can data, fully
# sharded, tensor and 2D (FSDP + TP) parallelism use before communication outlasts computation
# (2026 handout §8)? And how large should DDP gradient buckets be? Every number below is computed
# in this run by `systems.analysis.parallel_math` (closed forms, derived again with sympy and checked
# against brute-force counts in `tests/test_parallel_math.py`); nothing here needs a GPU.

# %% tags=["parameters"]
profile = "smoke"        # "smoke" and "full" give the same answers; "full" draws finer sweeps
out_dir = "build/smoke"  # the runner injects this
allreduce_results = None  # default: results/07_distributed_allreduce.jsonl (measured by notebook 07)
ddp_per_call_overhead_s = 50e-6  # assumed fixed cost of one NCCL all-reduce call (launch + latency)
example_n = 8            # device count at which per-device FLOPs and comm times are tabulated

# %%
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import sympy as sp
import torch

from systems.report import notebook as nb
from systems.analysis import parallel_math as pm
from systems.report.parallelism_math import bucket_overhead_figure, crossover_panel, mark_crossover
from systems.config import get_config
from systems.measure.env import REPO_ROOT
from systems.measure.results import ResultWriter, read_results

ctx = nb.setup(name="09_parallelism_math", profile=profile, out_dir=out_dir, needs_gpu_for_full=False)
n_points = 2000 if ctx.full else 300
GB = pm.GB
latex = sp.latex


# %% [markdown]
# ## Hardware and conventions
#
# `GB` is $10^9$ bytes. A matmul $(A,B)(B,C)$ costs $2ABC$ FLOPs. With $N$ devices and $W$
# bytes/s of egress each, a ring all-gather or reduce-scatter of an $S$-byte tensor takes
# $\frac{N-1}{N}\frac{S}{W}$ and an all-reduce twice that. Device parameters are named
# dataclasses in `systems.analysis.parallel_math` (H100's compute peak comes from `systems.measure.hardware`):

# %%
hardware = pd.DataFrame([dict(device=a.name, C_TFLOPs=a.flops_per_s / 1e12, W_GBps=a.link_bytes_per_s / GB,
                              memory_GB=a.memory_bytes / GB, alpha_C_over_W=a.alpha) for a in (pm.TPU_V5P, pm.H100)])
nb.show(hardware, caption="C: dense bf16 peak; W: per-device egress (TPU: W_ici = 2 x 9e10 B/s per mesh axis)")

# %% [markdown]
# ## 2025 · communication_accounting (XXL)
#
# XXL is `n_blocks` blocks of two bias-free linears, $d_\text{model}\to d_\text{ff}\to d_\text{model}$
# (no activation, attention, embeddings or head). Activations and gradient communication are
# BF16; master weights, accumulated gradients and both AdamW moments are FP32, so the model state
# costs $4+4+8 = 16$ bytes per parameter. No activation checkpointing.
#
# ### (a) Memory of the model state and of the saved activations

# %%
xxl = pm.XXL
state = pm.model_state_bytes(xxl)
act_tok = pm.activation_bytes_per_token(xxl)
mesh, tpu, h100 = pm.HANDOUT_MESH, pm.TPU_V5P, pm.H100
b_star = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu)
batch_c = math.ceil(b_star) * mesh.n_devices  # the overall batch of part (c), used as an example here
nb.show(pd.DataFrame([
    dict(item="master weights (FP32)", GB=state["master_weights"] / GB),
    dict(item="accumulated gradients (FP32)", GB=state["gradients"] / GB),
    dict(item="AdamW m and v (FP32)", GB=state["optimizer_state"] / GB),
    dict(item="total model state", GB=state["total"] / GB),
    dict(item="saved activations per token (BF16)", GB=act_tok / GB),
    dict(item=f"saved activations for {batch_c:,} tokens", GB=act_tok * batch_c / GB),
]).assign(h100_80GB_equivalents=lambda d: d.GB * GB / h100.memory_bytes), caption="XXL memory")
nb.md(f"""**(a)** XXL has $P = 2 \\cdot {xxl.n_blocks} \\cdot {xxl.d_model} \\cdot {xxl.d_ff} = {xxl.n_params:.4g}$
parameters, so the FP32 master weights, gradients and AdamW state take $16P = {state['total'] / GB:,.0f}$ GB,
**{pm.devices_worth(state['total'], h100):.1f} H100-80GB** worth before a single activation. Each linear saves its
BF16 input for the weight gradient, so backward keeps $2\\,n_\\text{{blocks}}(d_\\text{{model}} + d_\\text{{ff}})$ =
**{act_tok / 1e6:.2f} MB per token** ({pm.devices_worth(act_tok * 1000, h100):.2f} H100s per thousand tokens; at the
{batch_c:,}-token batch of part (c) that is {act_tok * batch_c / GB:,.0f} GB, another
{pm.devices_worth(act_tok * batch_c, h100):.1f} H100s).""")

# %% [markdown]
# ### (b) Sharding the state and half the activations over $N_\text{FSDP}$
#
# With $A$ the activations of a device's own tokens, weights, gradients and optimizer state and
# every second layer's activations split $N_\text{FSDP}$ ways:
# $$M(N_\text{FSDP}) = \frac{16P + A/2}{N_\text{FSDP}} + \frac{A}{2} < 95\ \text{GB}
# \iff N_\text{FSDP} > \frac{16P + A/2}{95\ \text{GB} - A/2}.$$

# %%
token_grid = [0, 256, math.ceil(b_star), 1024, 4096, 8192]
nmin = pd.DataFrame([dict(tokens_per_device=t, activations_GB=pm.activation_bytes(xxl, tokens=t) / GB,
                          min_N_FSDP=pm.min_fsdp_degree(xxl, accelerator=tpu, tokens_per_device=t),
                          GB_per_device_at_min=pm.fsdp_bytes_per_device(
                              xxl, n_fsdp=pm.min_fsdp_degree(xxl, accelerator=tpu, tokens_per_device=t),
                              tokens_per_device=t) / GB) for t in token_grid])
nb.show(nmin, caption=f"smallest N_FSDP that fits a {tpu.name} ({tpu.memory_bytes / GB:.0f} GB)")
max_tokens = 2 * tpu.memory_bytes / act_tok
nb.md(f"""**(b)** Per device $M(N) = (16P + A/2)/N + A/2$. The state alone needs
$N_\\text{{FSDP}} > {state['total'] / GB:,.0f}/{tpu.memory_bytes / GB:.0f}$, i.e. **at least
{pm.min_fsdp_degree(xxl, accelerator=tpu)} v5p chips**; with the {math.ceil(b_star)} tokens per device of part (c)
it is {pm.min_fsdp_degree(xxl, accelerator=tpu, tokens_per_device=math.ceil(b_star))}. The unsharded half of the
activations caps a device at {max_tokens:,.0f} tokens whatever $N_\\text{{FSDP}}$ is.""")

# %% [markdown]
# ### (c) When is the forward pass compute-bound on an X = 16 (FSDP) by Y = 4 (TP) v5p mesh?
#
# Scaling Book sharding: activations $\text{In}[B_X, D_Y]$, weights $W_\text{in}[D_X, F_Y]$ and
# $W_\text{out}[F_Y, D_X]$. An axis that spans $M$ physical mesh axes has $M\,W_\text{ici}$ of
# bandwidth. Per block and device, with $b = B/(XY)$ tokens per device (the (n-1)/n ring
# factor dropped, as the Scaling Book does):

# %%
sym25 = pm.symbolic_mesh_2025()
nb.md(f"""$$T_\\text{{math}} = {latex(sym25['t_math'])},\\quad T_\\text{{FSDP}} = {latex(sym25['t_fsdp'])},
\\quad T_\\text{{TP}} = {latex(sym25['t_tp'])}.$$
The two axes use different links, so their collectives overlap each other and the math: the block is
compute-bound when $T_\\text{{math}} \\ge \\max(T_\\text{{FSDP}}, T_\\text{{TP}})$, i.e.
$$b \\ge {latex(sym25['b_star'])} \\quad\\text{{and}}\\quad Y \\le {latex(sym25['y_max'])}.$$""")

# %%
y_limit = pm.mesh_tp_limit(xxl, mesh=mesh, accelerator=tpu)
b_ring = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu, ring_factor=True)
b_grid = np.linspace(1, 3 * b_star, n_points)
times = pd.DataFrame([pm.mesh_forward_block_times(xxl, mesh=mesh, accelerator=tpu, tokens_per_device=b)
                      for b in b_grid]).assign(b=b_grid)
fig, ax = plt.subplots(figsize=(7, 4))
for col, label in [("math", "compute"), ("fsdp", "FSDP all-gathers (X axis)"), ("tp", "TP gather/scatter (Y axis)")]:
    ax.plot(times.b, times[col] * 1e3, label=label)
mark_crossover(ax, b_star, f"b* = {b_star:.0f} tokens")
ax.set(xlabel="tokens per device b", ylabel="ms per block (forward)",
       title=f"XXL forward on a {mesh.x}x{mesh.y} {tpu.name} mesh (M_X={mesh.m_x}, M_Y={mesh.m_y})")
ax.legend()
nb.save_figure(fig, ctx, "mesh_batch_crossover")
nb.md(f"""**(c)** With $\\alpha = C/W_\\text{{ici}} = {tpu.alpha:,.0f}$: the TP condition
$Y \\le M_Y F/\\alpha = {y_limit:.1f}$ holds for $Y = {mesh.y}$ at every batch, so the FSDP all-gathers decide:
$b \\ge \\alpha/(M_X Y) = {b_star:.1f}$. The forward pass is **compute-bound from {math.ceil(b_star)} tokens per
device**, an **overall batch of {math.ceil(b_star) * mesh.n_devices:,} tokens** on the {mesh.n_devices} chips
(keeping the ring's $(X-1)/X$ factor lowers it to {b_ring:.1f} per device).""")

# %% [markdown]
# ### (d) Smaller batches that stay compute-bound

# %%
opt = pm.optimal_mesh_tokens_per_device(xxl, accelerator=tpu, m_x=mesh.m_x, m_y=mesh.m_y)
fp8 = pm.MixedPrecision(comm_bytes=1)
b_fp8 = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu, precision=fp8)
mesh_3ax = pm.TPUMesh(x=mesh.x, y=mesh.y, m_x=3, m_y=mesh.m_y)
b_mx3 = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh_3ax, accelerator=tpu)
nb.md(f"""**(d)** Part (c)'s limit $b \\ge p\\,\\alpha/(2 M_X Y)$ says each device must do enough math per byte
of gathered weights. A smaller batch stays compute-bound only if the bytes per FLOP fall, the links get faster,
or devices are added on an axis whose traffic does not grow with them:

* **Pick the split, not X=16, Y=4.** Raising Y to its own limit $M_Y F/\\alpha$ makes both conditions tight:
  $b \\ge \\alpha^2/(M_X M_Y F) = {opt['tokens_per_device']:.1f}$ tokens per device (at $Y \\approx {opt['y']:.1f}$),
  {b_star / opt['tokens_per_device']:.1f}x below part (c) [Austin et al. 2025, Part 5, "FSDP + TP"].
* **More links per axis.** Spreading FSDP over all three torus axes ($M_X = 3$) gives
  $b \\ge {b_mx3:.1f}$ [Scaling Book, Parts 2 and 5].
* **Fewer bytes per weight.** Gathering FP8 weights (and reduce-scattering low-precision gradients) halves
  $p$: $b \\ge p\\,\\alpha/(2 M_X Y) = {b_fp8:.1f}$ [ZeRO++, Wang et al. 2023; FP8 formats, Micikevicius et al. 2022].
* **Pipeline parallelism** adds devices whose only traffic is activations between stages, $2\\,b\\,D$ bytes per
  microbatch against $4\\,b\\,D F\\,L/P$ FLOPs for $L/P$ layers, so it needs no larger batch per FLOP; its cost is the
  bubble $(P-1)/(m+P-1)$ for $m$ microbatches [GPipe, Huang et al. 2019; Megatron-LM PTD-P, Narayanan et al. 2021;
  zero-bubble schedules, Qi et al. 2023].
* **Overlap everything.** The bound assumes collectives hidden under math; prefetching the next layer's
  all-gather (FSDP) and overlapping TP collectives with independent GEMMs keeps it true
  [ZeRO, Rajbhandari et al. 2020; Megatron sequence parallelism, Korthikanti et al. 2022].
* **Wider layers.** The optimal-split threshold scales as $1/F$, so a larger $d_\\text{{ff}}$ (or MoE with expert
  parallelism, where each expert's tokens see fewer bytes per FLOP) lowers it.""")

# %% [markdown]
# ## 2026 · §8 Analysing parallelism strategies (one SwiGLU FFN layer)
#
# $x_1 = xW_1,\ x_2 = xW_2,\ z = f(x_1) * x_2,\ y = zW_3$ with $x$ of shape $(B, D)$, $W_1, W_2$
# $(D, D_\text{FF})$, $W_3$ $(D_\text{FF}, D)$; FP16 everywhere ($p = 2$ bytes), non-matmul work ignored,
# $C$ FLOP/s and $W$ bytes/s egress per device; computation and communication overlap, so a strategy
# is communication-bound once comm time exceeds compute time. The expressions below are derived by
# sympy from the matmul shapes and the ring formulas (`pm.symbolic_2026()`).

# %%
sym = pm.symbolic_2026()
layer = pm.leaderboard_ffn()
cfg8b = get_config("8B")
nb.md(f"""**Alternate ring all-reduce.** Each of the $N-1$ steps ships a *whole* input ($S$ bytes) from every
device, so it takes $T = {latex(sym['alternate_ring_all_reduce'])}$: never splitting the payload makes it
$N/2$ times the reduce-scatter + all-gather ring, ${latex(sym['ring_all_reduce'])}$
({pm.alternate_ring_all_reduce_time(size_bytes=1, n=example_n, link_bytes_per_s=1) / pm.ring_all_reduce_time(size_bytes=1, n=example_n, link_bytes_per_s=1):.0f}x at $N = {example_n}$).

| problem | part | answer |
|---|---|---|
| data_parallel_calcs | (a) backward FLOPs / device | ${latex(sym['dp_backward_flops'])}$: six matmuls of $2BDD_{{FF}}$ on $B/N$ rows |
| | (b) backward comm | ${latex(sym['dp_backward_comm'])}$: one all-reduce of $dW_{{1,2,3}}$, $6DD_{{FF}}$ bytes, independent of $B$ |
| | (c) bound | $N_{{DP}} \\le {latex(sym['dp_max_n'])}$ |
| fsdp_calcs | (a) forward / backward FLOPs | ${latex(sym['fsdp_forward_flops'])}$ / ${latex(sym['fsdp_backward_flops'])}$: DP's math on a batch shard |
| | (b) forward / backward comm | ${latex(sym['fsdp_forward_comm'])}$ (all-gather $W$) / ${latex(sym['fsdp_backward_comm'])}$ (all-gather $W$ again + reduce-scatter $dW$) |
| | (c) bounds | forward $N_{{FSDP}} \\le {latex(sym['fsdp_max_n_forward'])}$, backward $N_{{FSDP}} \\le {latex(sym['fsdp_max_n_backward'])}$ |
| tp_calcs | (b) forward / backward FLOPs | ${latex(sym['tp_forward_flops'])}$ / ${latex(sym['tp_backward_flops'])}$: all rows, $D_{{FF}}/N$ of the width |
| | (c) forward / backward comm | ${latex(sym['tp_forward_comm'])}$ (all-reduce $y$) / ${latex(sym['tp_backward_comm'])}$ (all-reduce $dx$) |
| | (d) bounds | forward $N_{{TP}} \\le {latex(sym['tp_max_n_forward'])}$, backward $N_{{TP}} \\le {latex(sym['tp_max_n_backward'])}$ |
| fsdp_tp_calcs | (a) forward FLOPs | ${latex(sym['fsdp_tp_forward_flops'])}$ |
| | (b) forward comm | $\\max\\left({latex(sym['fsdp_tp_comm_fsdp_axis'])},\\ {latex(sym['fsdp_tp_comm_tp_axis'])}\\right)$ |
| | (c) overlapped axes | $N \\le {latex(sym['fsdp_tp_max_n_overlapped'])} \\approx {latex(sym['fsdp_tp_max_n_overlapped_leading'])}$ at $N_{{FSDP}} = {latex(sym['fsdp_tp_overlapped_n_fsdp'])}$, $N_{{TP}} = {latex(sym['fsdp_tp_overlapped_n_tp'])}$ |
| | (d) serial collectives | $N \\le {latex(sym['fsdp_tp_max_n_serial'])} \\approx {latex(sym['fsdp_tp_max_n_serial_leading'])}$ at $N_{{FSDP}} = {latex(sym['fsdp_tp_serial_n_fsdp'])}$, $N_{{TP}} = {latex(sym['fsdp_tp_serial_n_tp'])}$ |

DP's and FSDP's limits depend on the batch (the bytes are fixed, the math shrinks as $B/N$); TP's on the model
width (the bytes shrink with the batch too). The backward TP bound is looser because it does twice the math for
the same $(B, D)$ all-reduce.

**Numbers.** For the 2026 leaderboard model's FFN ('8B' preset: $D = {cfg8b.d_model}$,
$D_{{FF}} = {cfg8b.d_ff}$) at its batch of {pm.LEADERBOARD_BATCH_SIZE} x {cfg8b.context_length:,} =
$B = {layer.batch_tokens:,.0f}$ tokens; the table at the end has every value.""")

# %% [markdown]
# ### tp_calcs (a): the TP backward pass, written out and executed
#
# $W_1^{(i)}, W_2^{(i)}$ are column shards $(D, D_\text{FF}/N_\text{TP})$, $W_3^{(i)}$ a row shard. Because
# $y$ was all-reduced, every device holds all of $dy$:
# $$\begin{aligned}
# dz^{(i)} &= dy\,W_3^{(i)\top} & dW_3^{(i)} &= z^{(i)\top} dy\\
# dx_2^{(i)} &= dz^{(i)} * f(x_1^{(i)}) & dW_2^{(i)} &= x^\top dx_2^{(i)}\\
# dx_1^{(i)} &= dz^{(i)} * f'(x_1^{(i)}) * x_2^{(i)} & dW_1^{(i)} &= x^\top dx_1^{(i)}\\
# dx^{(i)} &= dx_1^{(i)} W_1^{(i)\top} + dx_2^{(i)} W_2^{(i)\top} & dx &= \text{all-reduce}_i\big(dx^{(i)}\big)
# \end{aligned}$$
# The weight gradients stay on their device (each is the full gradient of that shard); the one collective is the
# $(B, D)$ all-reduce of $dx$. `pm.tp_ffn_forward_backward` runs exactly these equations; below it is compared with
# autograd on the unsharded layer.

# %%
g = torch.Generator().manual_seed(0)
B_, D_, F_, n_tp_check = 8, 16, 24, 4
x = torch.randn(B_, D_, generator=g, dtype=torch.float64)
w1, w2 = (torch.randn(D_, F_, generator=g, dtype=torch.float64) / D_**0.5 for _ in range(2))
w3 = torch.randn(F_, D_, generator=g, dtype=torch.float64) / F_**0.5
dy = torch.randn(B_, D_, generator=g, dtype=torch.float64)
leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
y_ref = (torch.nn.functional.silu(leaves[0] @ leaves[1]) * (leaves[0] @ leaves[2])) @ leaves[3]
y_ref.backward(dy)
tp_out = pm.tp_ffn_forward_backward(x, dy, list(w1.chunk(n_tp_check, 1)), list(w2.chunk(n_tp_check, 1)),
                                    list(w3.chunk(n_tp_check, 0)))
errors = {"y": (tp_out["y"] - y_ref).abs().max().item(), "dx": (tp_out["dx"] - leaves[0].grad).abs().max().item(),
          "dW1": (torch.cat(tp_out["dW1"], 1) - leaves[1].grad).abs().max().item(),
          "dW2": (torch.cat(tp_out["dW2"], 1) - leaves[2].grad).abs().max().item(),
          "dW3": (torch.cat(tp_out["dW3"], 0) - leaves[3].grad).abs().max().item()}
nb.md(f"Sharded over $N_{{TP}} = {n_tp_check}$ in float64, the largest difference from autograd is "
      f"{max(errors.values()):.1e} (" + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + ").")


# %% [markdown]
# ### Compute vs communication as the device count grows

# %%
for hw_kind, stem in [("dp", "dp_crossover"), ("tp", "tp_crossover")]:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, hw in zip(axes, (h100, tpu)):
        c, w = hw.flops_per_s, hw.link_bytes_per_s
        if hw_kind == "dp":
            bound = pm.dp_max_devices(layer, accelerator=hw)
            crossover_panel(ax, compute=lambda n: pm.dp_backward_flops(layer, n_dp=n) / c,
                            comm=lambda n: pm.dp_backward_comm_time(layer, n_dp=n, link_bytes_per_s=w), bound=bound,
                            n_max=3 * bound, title=f"DP / FSDP backward, {hw.name}", n_points=n_points)
        else:
            bounds = pm.tp_max_devices(layer, accelerator=hw)
            crossover_panel(ax, compute=lambda n: pm.tp_forward_flops(layer, n_tp=n) / c,
                            comm=lambda n: pm.tp_forward_comm_time(layer, n_tp=n, link_bytes_per_s=w),
                            bound=bounds["forward"], n_max=3 * bounds["backward"],
                            title=f"TP forward and backward, {hw.name}", n_points=n_points,
                            comm_label="communication (TP: fwd = bwd)")
            ns = np.linspace(1, 3 * bounds["backward"], n_points)
            ax.plot(ns, [pm.tp_backward_flops(layer, n_tp=n) / c * 1e3 for n in ns], ":", label="compute (backward)")
            mark_crossover(ax, bounds["backward"], f"backward N = {bounds['backward']:.1f}", color="tab:red")
            ax.legend(fontsize=8)
    fig.suptitle(f"8B FFN, B = {layer.batch_tokens:,.0f} tokens")
    nb.save_figure(fig, ctx, stem)

# %% [markdown]
# ### And as the batch grows, at a fixed device count

# %%
fig, ax = plt.subplots(figsize=(7, 4))
batches = np.linspace(256, 4 * layer.batch_tokens, n_points)
c, w = h100.flops_per_s, h100.link_bytes_per_s
ax.plot(batches, [pm.dp_backward_flops(pm.FFNLayer(batch_tokens=b, d_model=layer.d_model, d_ff=layer.d_ff),
                                       n_dp=example_n) / c * 1e3 for b in batches], label="DP compute (backward)")
ax.plot(batches, [pm.dp_backward_comm_time(layer, n_dp=example_n, link_bytes_per_s=w) * 1e3] * len(batches),
        label="DP all-reduce (fixed)")
ax.plot(batches, [pm.tp_forward_comm_time(pm.FFNLayer(batch_tokens=b, d_model=layer.d_model, d_ff=layer.d_ff),
                                          n_tp=example_n, link_bytes_per_s=w) * 1e3 for b in batches],
        label="TP all-reduce (grows with B)")
b_cross = (example_n - 1) * c / w  # N_DP - 1 = B W / C solved for B
mark_crossover(ax, b_cross, f"DP compute-bound above B = {b_cross:,.0f}")
ax.set(xlabel="batch tokens B", ylabel="ms per layer", title=f"N = {example_n} on {h100.name}")
ax.legend(fontsize=8)
nb.save_figure(fig, ctx, "batch_crossover")

# %% [markdown]
# ### fsdp_tp_calcs: which $(N_\text{FSDP}, N_\text{TP})$ stay compute-bound?
#
# Dividing each axis's forward comm time by the compute time $6BDD_\text{FF}/(N_\text{FSDP}N_\text{TP}C)$ cancels
# the product: $\frac{N_\text{FSDP}-1}{a}$ and $\frac{N_\text{TP}-1}{b}$ with $a = BW/C$, $b = 3D_\text{FF}W/(2C)$.
# **Overlapped** axes need each $\le 1$, so the largest $N$ is $(1+a)(1+b)$ at $N_\text{FSDP} = 1+a$,
# $N_\text{TP} = 1+b$. **Serial** collectives need the sum $\le 1$; maximising
# $(1+u)(1+v)$ on $u/a + v/b = 1$ gives $N_\text{FSDP} = \frac{a+b+ab}{2b}$, $N_\text{TP} = \frac{a+b+ab}{2a}$ and
# $N \le \frac{(a+b+ab)^2}{4ab} \approx \frac{ab}{4}$: each axis gets half its budget, a quarter of the devices.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
for ax, hw in zip(axes, (h100, tpu)):
    ov = pm.fsdp_tp_max_devices_overlapped(layer, accelerator=hw)
    se = pm.fsdp_tp_max_devices_serial(layer, accelerator=hw)
    nf = np.linspace(1, 1.5 * ov["n_fsdp"], 200 if ctx.full else 80)
    nt = np.linspace(1, 1.5 * ov["n_tp"], 200 if ctx.full else 80)
    ratio_ov = np.empty((len(nt), len(nf)))
    ratio_se = np.empty_like(ratio_ov)
    for i, t in enumerate(nt):
        for j, f in enumerate(nf):
            comp = pm.fsdp_tp_forward_flops(layer, n_fsdp=f, n_tp=t) / hw.flops_per_s
            tt = pm.fsdp_tp_forward_comm_times(layer, n_fsdp=f, n_tp=t, link_bytes_per_s=hw.link_bytes_per_s)
            ratio_ov[i, j], ratio_se[i, j] = tt["overlapped"] / comp, tt["serial"] / comp
    mesh_f, mesh_t = np.meshgrid(nf, nt)
    im = ax.pcolormesh(mesh_f, mesh_t, np.log2(np.maximum(ratio_se, 2.0**-4)), cmap="RdBu_r", vmin=-3, vmax=3, shading="auto")
    ax.contour(mesh_f, mesh_t, ratio_ov, levels=[1.0], colors="k", linestyles="--")
    ax.contour(mesh_f, mesh_t, ratio_se, levels=[1.0], colors="k")
    for n_target, style in [(ov["n"], "--"), (se["n"], "-")]:
        ax.plot(nf, n_target / nf, color="tab:green", ls=style, lw=1)
    ax.plot(ov["n_fsdp"], ov["n_tp"], "k*", ms=12, label=f"overlapped optimum N = {ov['n']:.0f}")
    ax.plot(se["n_fsdp"], se["n_tp"], "ko", ms=7, label=f"serial optimum N = {se['n']:.0f}")
    ax.set(xlabel="N_FSDP", ylabel="N_TP", ylim=(1, nt[-1]), title=f"{hw.name}: comm/compute (serial), log2")
    ax.legend(fontsize=8, loc="upper right")
fig.colorbar(im, ax=axes, label="log2(serial comm / compute)")
nb.save_figure(fig, ctx, "fsdp_tp_region")
ov_h, se_h = pm.fsdp_tp_max_devices_overlapped(layer, accelerator=h100), pm.fsdp_tp_max_devices_serial(layer, accelerator=h100)
nb.md(f"""Black lines: the compute-bound boundary (dashed overlapped, solid serial); green: the hyperbolas
$N_\\text{{FSDP}}N_\\text{{TP}} = N_\\max$ that touch them. On {h100.name} the 8B FFN stays compute-bound up to
**N = {ov_h['n']:.0f}** devices with overlapped axes ($N_\\text{{FSDP}} = {ov_h['n_fsdp']:.1f}$,
$N_\\text{{TP}} = {ov_h['n_tp']:.1f}$) but only **N = {se_h['n']:.0f}** when the collectives share the links
($N_\\text{{FSDP}} = {se_h['n_fsdp']:.1f}$, $N_\\text{{TP}} = {se_h['n_tp']:.1f}$), against
{pm.dp_max_devices(layer, accelerator=h100):.1f} for FSDP alone and {pm.tp_max_devices(layer, accelerator=h100)['forward']:.1f}
for TP alone.""")

# %% [markdown]
# ## 2025 · ddp_bucketed_benchmarking (b): the bucketed-DDP overhead model
#
# $s$ bytes of gradients in $n_b$ equal buckets; one all-reduce costs $o + \frac{s}{n_b w}$ ($w$ the algorithm
# bandwidth, $o$ a fixed per-call cost). Computing a bucket's gradients takes as long as *transferring* it,
# $c = \frac{s}{n_b w}$; the call overhead $o$ exists only on the communication stream. Bucket $k$ is ready at
# $kc$, the all-reduces run back to back (each is longer than $c$), so the last ends at $c + n_b(o + c)$ while the
# backward ends at $n_b c$:

# %%
symb = pm.symbolic_ddp_bucket()
xl = get_config("xl-2025")
grad_bytes = xl.n_params * 4  # FP32 gradients of the handout's XL model
w_assumed = h100.link_bytes_per_s  # a 2-GPU ring's algbw equals the link's egress
nstar = pm.optimal_n_buckets(total_bytes=grad_bytes, bandwidth_bytes_per_s=w_assumed,
                             per_call_overhead_s=ddp_per_call_overhead_s)
bucket_star = pm.optimal_bucket_bytes(total_bytes=grad_bytes, bandwidth_bytes_per_s=w_assumed,
                                      per_call_overhead_s=ddp_per_call_overhead_s)
nb.md(f"""$$\\text{{overhead}}(n_b) = {latex(symb['overhead'])},\\qquad
n_b^* = {latex(symb['n_star'])},\\qquad \\text{{bucket}}^* = \\frac{{s}}{{n_b^*}} = {latex(symb['bucket_star'])},
\\qquad \\text{{overhead}}^* = {latex(symb['overhead_star'])}.$$
For the XL model ({xl.n_params / 1e9:.2f}B parameters, $s$ = {grad_bytes / 1e6:,.0f} MB of FP32 gradients) with
$w$ = {w_assumed / GB:.0f} GB/s and an assumed $o$ = {ddp_per_call_overhead_s * 1e6:.0f} µs (a notebook parameter),
the best bucket is **{bucket_star / 1e6:,.0f} MB** ({nstar:.1f} buckets), leaving
{pm.ddp_bucket_overhead(total_bytes=grad_bytes, bandwidth_bytes_per_s=w_assumed, per_call_overhead_s=ddp_per_call_overhead_s, n_buckets=nstar) * 1e3:.2f} ms
exposed after backward, against {pm.ddp_bucket_overhead(total_bytes=grad_bytes, bandwidth_bytes_per_s=w_assumed, per_call_overhead_s=ddp_per_call_overhead_s, n_buckets=1) * 1e3:.1f} ms
for one flat all-reduce.""")


# %%
def bucket_figure(w, label):
    return bucket_overhead_figure(total_bytes=grad_bytes, bandwidth_bytes_per_s=w,
                                  per_call_overhead_s=ddp_per_call_overhead_s, n_points=n_points,
                                  title=f"Bucketed DDP, XL gradients, {label}")


nb.save_figure(bucket_figure(w_assumed, f"w = {w_assumed / GB:.0f} GB/s, o = {ddp_per_call_overhead_s * 1e6:.0f} µs"),
               ctx, "ddp_buckets")

# %% [markdown]
# ## Worked example with our measured all-reduce bandwidth
#
# In the handout's model $T = 2\frac{N-1}{N}\frac{S}{W}$, so the **bus bandwidth** NCCL benchmarks report,
# $\text{busbw} = \text{algbw}\cdot 2\frac{N-1}{N}$ with $\text{algbw} = S/T$, is exactly the $W$ of these
# formulas, and algbw is the $w$ of the bucket model.

# %%
measured_path = Path(allreduce_results) if allreduce_results else REPO_ROOT / "results" / "07_distributed_allreduce.jsonl"
measured = read_results(measured_path) if measured_path.exists() else pd.DataFrame()
needed = {"backend", "size_bytes", "busbw_GBps", "algbw_GBps"}
if not measured.empty and needed <= set(measured.columns):
    ok = measured[(measured.backend.str.lower() == "nccl")
                  & (measured.status.eq("ok") if "status" in measured.columns else True)].dropna(subset=["busbw_GBps"])
else:
    ok = pd.DataFrame()
if ok.empty:
    nb.md(f"Measured all-reduce bandwidth is **not available yet**: `{measured_path.relative_to(REPO_ROOT) if measured_path.is_relative_to(REPO_ROOT) else measured_path}` "
          "is missing or has no NCCL rows (notebook 07 writes it on the GPU machine). Re-run this notebook after it to see the "
          "bounds with our own $W$.")
else:
    largest = ok[ok.size_bytes == ok.size_bytes.max()]
    row = largest.loc[largest.busbw_GBps.idxmax()]
    world = int(row.get("world_size", 2)) if "world_size" in row else None
    w_meas, algbw_meas = float(row.busbw_GBps) * GB, float(row.algbw_GBps) * GB
    measured_hw = h100.with_link(w_meas, name="H100 + measured NCCL busbw")
    compare = []
    for hw in (h100, measured_hw, tpu):
        compare.append(dict(device=hw.name, W_GBps=hw.link_bytes_per_s / GB,
                            max_N_DP=pm.dp_max_devices(layer, accelerator=hw),
                            max_N_TP_fwd=pm.tp_max_devices(layer, accelerator=hw)["forward"],
                            max_N_TP_bwd=pm.tp_max_devices(layer, accelerator=hw)["backward"],
                            max_N_2D_overlapped=pm.fsdp_tp_max_devices_overlapped(layer, accelerator=hw)["n"],
                            max_N_2D_serial=pm.fsdp_tp_max_devices_serial(layer, accelerator=hw)["n"]))
    nb.show(pd.DataFrame(compare), caption="8B FFN bounds: datasheet vs measured W")
    best_meas = pm.optimal_bucket_bytes(total_bytes=grad_bytes, bandwidth_bytes_per_s=algbw_meas,
                                        per_call_overhead_s=ddp_per_call_overhead_s)
    nb.md(f"""With the measured NCCL bus bandwidth **{w_meas / GB:.1f} GB/s** (largest message,
{row.size_bytes / 1e6:,.0f} MB, world size {world}) instead of the datasheet's {h100.link_bytes_per_s / GB:.0f} GB/s,
DP stays compute-bound up to $N_{{DP}} \\le$ {pm.dp_max_devices(layer, accelerator=measured_hw):.1f} (datasheet:
{pm.dp_max_devices(layer, accelerator=h100):.1f}) and TP forward up to {pm.tp_max_devices(layer, accelerator=measured_hw)['forward']:.1f}
(datasheet: {pm.tp_max_devices(layer, accelerator=h100)['forward']:.1f}); the best DDP bucket at the measured
algbw {algbw_meas / GB:.1f} GB/s is {best_meas / 1e6:,.0f} MB.""")
    nb.save_figure(bucket_figure(algbw_meas, f"measured NCCL algbw {algbw_meas / GB:.0f} GB/s"), ctx, "ddp_buckets_measured")

# %% [markdown]
# ## Every answer

# %%
answers = pm.answers_table(layer=layer, example_n=example_n)
writer = ResultWriter(ctx.result_path("answers"))
for record in answers.to_dict("records"):
    writer.write(record)
with pd.option_context("display.max_colwidth", 80):
    nb.show(answers, caption=f"XXL on the handout's hardware; 2026 bounds for the 8B FFN at B = {layer.batch_tokens:,.0f}")
