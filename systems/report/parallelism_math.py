"""Notebook 09 (parallelism on paper): its figures, tables and answers, every number computed by
``systems.analysis.parallel_math`` and, where a link bandwidth enters, shown for the datasheet's
link and for the all-reduce bandwidth measured by notebook 07 and the committed runs."""

from __future__ import annotations

import math
from typing import Callable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import sympy as sp

from systems.analysis import parallel_math as pm
from systems.config import get_config, size_label
from systems.report.distributed import FIT_LEAST_SQUARES, fit_alpha_beta
from systems.report.notebook import param_count

GB = pm.GB
latex = sp.latex


def mark_crossover(ax, x: float, label: str, *, color: str = "k") -> None:
    """A dashed vertical line at the crossover, labelled along it."""
    ax.axvline(x, color=color, ls="--", lw=1)
    ax.annotate(label, xy=(x, 0.5), xycoords=("data", "axes fraction"), rotation=90, va="center", ha="right",
                fontsize=8, color=color)


def crossover_panel(ax, *, compute: Callable[[float], float], comm: Callable[[float], float], bound: float,
                    n_max: float, title: str, n_points: int, comm_label: str = "communication") -> np.ndarray:
    """Compute and communication time (ms per layer) against device count N, crossover marked."""
    ns = np.linspace(1, n_max, n_points)
    ax.plot(ns, [compute(n) * 1e3 for n in ns], label="compute")
    ax.plot(ns, [comm(n) * 1e3 for n in ns], label=comm_label)
    mark_crossover(ax, bound, f"N = {bound:.1f}")
    ax.set(title=title, xlabel="devices N", ylabel="ms per layer", yscale="log")
    ax.legend(fontsize=8)
    return ns


def bucket_overhead_figure(*, total_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float,
                           title: str, n_points: int):
    """Bucketed-DDP exposed overhead against bucket size, with the model's optimum marked."""
    sizes_mb = np.geomspace(0.1, total_bytes / 1e6, n_points)
    over = [pm.ddp_bucket_overhead(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                   per_call_overhead_s=per_call_overhead_s, n_buckets=total_bytes / (mb * 1e6)) * 1e3
            for mb in sizes_mb]
    best = pm.optimal_bucket_bytes(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                   per_call_overhead_s=per_call_overhead_s) / 1e6
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sizes_mb, over)
    mark_crossover(ax, best, f"optimum {best:,.0f} MB")
    ax.set(xscale="log", yscale="log", xlabel="bucket size (MB)", ylabel="overhead after backward (ms)", title=title)
    return fig


# ----------------------------------------------------------------------------------------------
# the measured link
# ----------------------------------------------------------------------------------------------

def measured_link(rows: pd.DataFrame) -> dict | None:
    """What the all-reduce measurements say about a GPU link, from NCCL rows (``rows`` as
    ``systems.report.distributed.read_allreduce`` labels them).

    ``W``: the handout's per-device egress, which is the bus bandwidth of the largest message
    (ring all-reduce time = 2(N-1)/N S/W, and busbw = algbw 2(N-1)/N), the median over every
    world size and file that measured that size. ``o`` and ``w`` for the bucket model: a fit of
    t = o + S/w over the sizes of one (file, world size 2) series: the one with the most sizes,
    this run's on a tie (``distributed.fit_alpha_beta``, with its fallbacks).
    """
    ok = rows[(rows["status"] == "ok") & (rows["backend"] == "nccl")] if len(rows) else rows
    if not len(ok):
        return None
    largest = ok[ok["size_bytes"] == ok["size_bytes"].max()]
    two = ok[ok["world_size"] == 2]
    counts = two.groupby("source")["size_bytes"].nunique()
    if not len(counts) or counts.max() < 2:
        return None
    source = max(counts.index, key=lambda s: (counts[s], s == "this run"))
    series = two[two["source"] == source]
    # notebook 07's fit, with its fallbacks where noise leaves no positive intercept or slope
    fit = fit_alpha_beta(series, backend="nccl", world_size=2, source=source)
    o, w = fit["per_call_overhead_s"], fit["bandwidth_bytes_per_s"]
    return {"W": float(largest["busbw_GBps"].median() * GB), "W_min": float(largest["busbw_GBps"].min() * GB),
            "W_max": float(largest["busbw_GBps"].max() * GB), "W_size_mb": float(largest["size_bytes"].iloc[0] / 1e6),
            "W_rows": len(largest), "W_sources": ", ".join(sorted(set(largest["source"]))),
            "machines": ", ".join(sorted(set(largest["machine"]))),
            "gpus": sorted(set(largest["gpu"].dropna())) if "gpu" in largest else [],  # as the rows' environments name them
            "o": o, "w": w, "fit_how": fit["how"], "fit_source": source,
            "fit_machine": series["machine"].iloc[0], "fit_commit": series["commit"].iloc[0],
            "fit_sizes": int(series["size_bytes"].nunique())}


def with_measured_link(gpu: pm.Accelerator, link: dict | None) -> pm.Accelerator | None:
    """``gpu`` with the measured W, named with the GPUs that measured it (they may be another model
    with the same NVLink, e.g. H200s for an H100)."""
    if link is None:
        return None
    models = sorted({name.removeprefix("NVIDIA ") for name in link["gpus"]})
    where = f"measured on {', '.join(models)}" if models else "measured (machine not recorded)"
    return gpu.with_link(link["W"], name=f"{gpu.name.split(' ')[0]} with the NCCL W {where}")


def link_text(link: dict | None, gpu: pm.Accelerator) -> str:
    if link is None:
        return ("No NCCL all-reduce rows were found (notebook 07's full profile and the committed results/13_* runs "
                f"write them), so only the datasheet's W = {gpu.link_bytes_per_s / GB:.0f} GB/s is used.")
    return (f"Measured W: the NCCL bus bandwidth of {link['W_size_mb']:,.0f} MB all-reduces, median "
            f"{link['W'] / GB:.0f} GB/s over {link['W_rows']} rows ({link['W_min'] / GB:.0f}-{link['W_max'] / GB:.0f} GB/s; "
            f"{link['machines']}; {link['W_sources']}), against the datasheet's {gpu.link_bytes_per_s / GB:.0f} GB/s "
            f"({gpu.name}'s datasheet NVLink, {2 * gpu.link_bytes_per_s / GB:.0f} GB/s counting both directions). Fitted to the 2-rank series of "
            f"{link['fit_source']} ({link['fit_machine']}, commit {link['fit_commit']}, {link['fit_sizes']} sizes): per-call "
            f"overhead o = {link['o'] * 1e6:.3g} us and algorithm bandwidth w = {link['w'] / GB:.0f} GB/s"
            + (f" ({link['fit_how']})." if link["fit_how"] != FIT_LEAST_SQUARES else "."))


def hardware_table(accelerators: list[pm.Accelerator]) -> pd.DataFrame:
    return pd.DataFrame([dict(device=a.name, C_TFLOPs=a.flops_per_s / 1e12, W_GBps=a.link_bytes_per_s / GB,
                              memory_GB=a.memory_bytes / GB, alpha_C_over_W=a.alpha) for a in accelerators])


# ----------------------------------------------------------------------------------------------
# 2025: communication_accounting (XXL) and the bucket model
# ----------------------------------------------------------------------------------------------

def xxl_memory_table(xxl: pm.StackedFFN, *, tokens: int, gpu: pm.Accelerator) -> pd.DataFrame:
    state, act = pm.model_state_bytes(xxl), pm.activation_bytes_per_token(xxl)
    rows = [("master weights (FP32)", state["master_weights"]), ("accumulated gradients (FP32)", state["gradients"]),
            ("AdamW m and v (FP32)", state["optimizer_state"]), ("total model state", state["total"]),
            ("saved activations per token (BF16)", act), (f"saved activations for {tokens:,} tokens", act * tokens)]
    return pd.DataFrame([{"item": item, "GB": b / GB, f"{gpu.name} equivalents": b / gpu.memory_bytes} for item, b in rows])


def xxl_answers(*, xxl: pm.StackedFFN, mesh: pm.TPUMesh, tpu: pm.Accelerator, gpu: pm.Accelerator) -> dict[str, str]:
    """communication_accounting (a)-(d), keyed by part."""
    state, act = pm.model_state_bytes(xxl), pm.activation_bytes_per_token(xxl)
    k = pm.HANDOUT_PRECISION.state_bytes_per_param  # bytes of model state per parameter
    b_star = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu)
    b_ring = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu, ring_factor=True)
    batch_c = math.ceil(b_star) * mesh.n_devices
    sym = pm.symbolic_mesh_2025()
    opt = pm.optimal_mesh_tokens_per_device(xxl, accelerator=tpu, m_x=mesh.m_x, m_y=mesh.m_y)
    b_fp8 = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu, precision=pm.MixedPrecision(comm_bytes=1))
    b_mx3 = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=pm.TPUMesh(x=mesh.x, y=mesh.y, m_x=3, m_y=mesh.m_y),
                                                    accelerator=tpu)
    a = (f"XXL has $P = 2 \\cdot {xxl.n_blocks} \\cdot {xxl.d_model} \\cdot {xxl.d_ff} = {xxl.n_params:.4g}$ parameters, so "
         f"the FP32 master weights, gradients and AdamW state take ${k}P = {state['total'] / GB:,.0f}$ GB, "
         f"**{pm.devices_worth(state['total'], gpu):.1f} {gpu.name}** worth before a single activation. Each linear saves "
         f"its BF16 input for the weight gradient, so backward keeps $2\\,n_\\text{{blocks}}(d_\\text{{model}} + "
         f"d_\\text{{ff}})$ = **{act / 1e6:.2f} MB per token** ({pm.devices_worth(act * 1000, gpu):.2f} {gpu.name} per thousand "
         f"tokens; at the {batch_c:,}-token batch of part (c), {act * batch_c / GB:,.0f} GB, another "
         f"{pm.devices_worth(act * batch_c, gpu):.1f} {gpu.name}).")
    max_tokens = 2 * tpu.memory_bytes / act
    b = (f"Per device $M(N) = ({k}P + A/2)/N + A/2$ ($A$: the activations of the device's tokens; every second layer's "
         f"are sharded). The state alone needs $N_\\text{{FSDP}} > {state['total'] / GB:,.0f}/{tpu.memory_bytes / GB:.0f}$, "
         f"i.e. **at least {pm.min_fsdp_degree(xxl, accelerator=tpu)} v5p chips**; with the {math.ceil(b_star)} tokens per "
         f"device of part (c) it is {pm.min_fsdp_degree(xxl, accelerator=tpu, tokens_per_device=math.ceil(b_star))}. The "
         f"unsharded half of the activations caps a device at {max_tokens:,.0f} tokens whatever $N_\\text{{FSDP}}$ is.")
    c = (f"$T_\\text{{math}} = {latex(sym['t_math'])}$, $T_\\text{{FSDP}} = {latex(sym['t_fsdp'])}$, "
         f"$T_\\text{{TP}} = {latex(sym['t_tp'])}$; the two axes use different links, so the block is compute-bound when "
         f"$T_\\text{{math}} \\ge \\max(T_\\text{{FSDP}}, T_\\text{{TP}})$: $b \\ge {latex(sym['b_star'])}$ and "
         f"$Y \\le {latex(sym['y_max'])}$. With $\\alpha = C/W_\\text{{ici}} = {tpu.alpha:,.0f}$ the TP condition "
         f"$Y \\le {pm.mesh_tp_limit(xxl, mesh=mesh, accelerator=tpu):.1f}$ holds for $Y = {mesh.y}$, so the FSDP "
         f"all-gathers decide: $b \\ge \\alpha/(M_X Y) = {b_star:.1f}$. Compute-bound from **{math.ceil(b_star)} tokens "
         f"per device**, an **overall batch of {batch_c:,} tokens** on the {mesh.n_devices} chips (keeping the ring's "
         f"$(X-1)/X$ factor: {b_ring:.1f} per device).")
    d = (f"Part (c)'s limit $b \\ge p\\,\\alpha/(2 M_X Y)$ asks for enough math per gathered byte. Smaller batches "
         "stay compute-bound if the bytes per FLOP fall, the links get faster, or devices join on an axis whose traffic "
         "does not grow with them:\n\n"
         f"* **Pick the split, not X=16, Y=4.** Raising Y to its limit $M_Y F/\\alpha$ makes both conditions tight: "
         f"$b \\ge \\alpha^2/(M_X M_Y F) = {opt['tokens_per_device']:.1f}$ tokens per device (at $Y \\approx {opt['y']:.1f}$), "
         f"{b_star / opt['tokens_per_device']:.1f}x below part (c) [Austin et al. 2025, Part 5, \"FSDP + TP\"].\n"
         f"* **More links per axis.** FSDP over all three torus axes ($M_X = 3$): $b \\ge {b_mx3:.1f}$ [Scaling Book, "
         "Parts 2 and 5].\n"
         f"* **Fewer bytes per weight.** FP8 weights gathered (and low-precision gradients reduce-scattered) halve $p$: "
         f"$b \\ge {b_fp8:.1f}$ [ZeRO++, Wang et al. 2023; FP8 formats, Micikevicius et al. 2022].\n"
         "* **Pipeline parallelism** adds devices whose only traffic is activations between stages, $2\\,b\\,D$ bytes per "
         "microbatch against $4\\,b\\,D F\\,L/P$ FLOPs for $L/P$ layers; its cost is the bubble $(P-1)/(m+P-1)$ for $m$ "
         "microbatches [GPipe, Huang et al. 2019; Megatron-LM PTD-P, Narayanan et al. 2021; zero-bubble schedules, "
         "Qi et al. 2023].\n"
         "* **Overlap everything.** The bound assumes collectives hidden under math: prefetch the next layer's "
         "all-gather and overlap TP collectives with independent GEMMs [ZeRO, Rajbhandari et al. 2020; Megatron "
         "sequence parallelism, Korthikanti et al. 2022].\n"
         "* **Wider layers.** The optimal-split threshold scales as $1/F$: a larger $d_\\text{ff}$ (or MoE with expert "
         "parallelism) lowers it.")
    return {"a": a, "b": b, "c": c, "d": d}


def min_fsdp_table(xxl: pm.StackedFFN, *, tpu: pm.Accelerator, tokens: list[int]) -> pd.DataFrame:
    rows = []
    for t in tokens:
        n = pm.min_fsdp_degree(xxl, accelerator=tpu, tokens_per_device=t)
        rows.append(dict(tokens_per_device=t, activations_GB=pm.activation_bytes(xxl, tokens=t) / GB, min_N_FSDP=n,
                         GB_per_device_at_min=pm.fsdp_bytes_per_device(xxl, n_fsdp=n, tokens_per_device=t) / GB))
    return pd.DataFrame(rows)


def mesh_batch_figure(xxl: pm.StackedFFN, *, mesh: pm.TPUMesh, tpu: pm.Accelerator, n_points: int):
    b_star = pm.mesh_compute_bound_tokens_per_device(xxl, mesh=mesh, accelerator=tpu)
    b = np.linspace(1, 3 * b_star, n_points)
    times = pd.DataFrame([pm.mesh_forward_block_times(xxl, mesh=mesh, accelerator=tpu, tokens_per_device=x) for x in b])
    fig, ax = plt.subplots(figsize=(7, 4))
    for col, label in [("math", "compute"), ("fsdp", "FSDP all-gathers (X axis)"), ("tp", "TP gather/scatter (Y axis)")]:
        ax.plot(b, times[col] * 1e3, label=label)
    mark_crossover(ax, b_star, f"b* = {b_star:.0f} tokens")
    ax.set(xlabel="tokens per device b", ylabel="ms per block (forward)",
           title=f"XXL forward on a {mesh.x}x{mesh.y} {tpu.name} mesh (M_X={mesh.m_x}, M_Y={mesh.m_y})")
    ax.legend()
    return fig


def bucket_answer(*, link: dict | None, gpu: pm.Accelerator, model: str = "xl-2025") -> tuple[str, float, float]:
    """ddp_bucketed_benchmarking (b): the overhead equation and the optimal bucket, evaluated for
    the handout's xl with the measured o and w (or, without measurements, w = the datasheet link
    and no o). Returns (text, w, o) for the figure."""
    symb = pm.symbolic_ddp_bucket()
    n_params = get_config(model).n_params
    s = n_params * 4  # fp32 gradients
    text = (f"$n_b$ equal buckets of $s/n_b$ bytes; an all-reduce costs $o + s/(n_b w)$; computing a bucket's "
            "gradients takes as long as sending it ($c = s/(n_b w)$, the call overhead exists only on the communication "
            "stream). Bucket $k$ is ready at $kc$ and the all-reduces run back to back, so the last ends at "
            "$c + n_b(o + c)$ while the backward ends at $n_b c$:\n\n"
            f"$$\\text{{overhead}}(n_b) = {latex(symb['overhead'])},\\qquad n_b^* = {latex(symb['n_star'])},\\qquad "
            f"\\text{{bucket}}^* = \\frac{{s}}{{n_b^*}} = {latex(symb['bucket_star'])},\\qquad \\text{{overhead}}^* = "
            f"{latex(symb['overhead_star'])}.$$\n\n")
    if link is None:
        return text + "Without a measured all-reduce there is no per-call overhead $o$ to evaluate it with.", gpu.link_bytes_per_s, 0.0
    w, o = link["w"], link["o"]
    n_star = pm.optimal_n_buckets(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o)
    best = pm.optimal_bucket_bytes(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o)
    flat = pm.ddp_bucket_overhead(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o, n_buckets=1)
    at_best = pm.ddp_bucket_overhead(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o, n_buckets=n_star)
    return (text + f"For the 2025 {size_label(model, '2025')} ({param_count(n_params)} parameters, $s$ = {s / 1e6:,.0f} MB of FP32 "
            f"gradients) with the measured $w$ = {w / GB:.0f} GB/s and $o$ = {o * 1e6:.3g} us ({link['fit_source']}, "
            f"{link['fit_machine']}), the best bucket is **{best / 1e6:,.0f} MB** ({n_star:.1f} buckets), leaving "
            f"{at_best * 1e3:.2f} ms after the backward against {flat * 1e3:.1f} ms for one flat all-reduce; with the "
            f"datasheet's link as $w$ ({gpu.link_bytes_per_s / GB:.0f} GB/s) it would be "
            f"{pm.optimal_bucket_bytes(total_bytes=s, bandwidth_bytes_per_s=gpu.link_bytes_per_s, per_call_overhead_s=o) / 1e6:,.0f} MB. "
            "Notebook 07 sets this model against the measured bucket sweep."), w, o


# ----------------------------------------------------------------------------------------------
# 2026: section 8 for one SwiGLU FFN layer
# ----------------------------------------------------------------------------------------------

def _values(layer: pm.FFNLayer, hws: list[pm.Accelerator], fn: Callable[[pm.Accelerator], float], fmt: str) -> str:
    return "; ".join(f"{hw.name}: {fmt.format(fn(hw))}" for hw in hws)


def section8_answers(*, layer: pm.FFNLayer, hws: list[pm.Accelerator], example_n: int) -> dict[tuple[str, str], str]:
    """Every 2026 section-8 answer, keyed by (problem, part): the closed form sympy derived, its
    justification, and its value for ``layer`` on each accelerator in ``hws``."""
    sym, n = pm.symbolic_2026(), example_n
    w = lambda f: (lambda hw: f(hw.link_bytes_per_s))  # noqa: E731
    ring = pm.alternate_ring_all_reduce_time(size_bytes=1, n=n, link_bytes_per_s=1) / pm.ring_all_reduce_time(
        size_bytes=1, n=n, link_bytes_per_s=1)
    numbers = f"For the 8B FFN at $B$ = {layer.batch_tokens:,.0f} tokens and $N = {n}$"
    out = {
        ("alternate_ring_all_reduce", ""):
            f"$T = {latex(sym['alternate_ring_all_reduce'])}$: each of the $N-1$ steps ships a *whole* input ($S$ bytes) "
            f"from every device at $W$, never splitting the payload, so it is $N/2$ times the reduce-scatter + all-gather "
            f"ring's ${latex(sym['ring_all_reduce'])}$ ({ring:.0f}x at $N = {n}$).",
        ("data_parallel_calcs", "a"):
            f"${latex(sym['dp_backward_flops'])}$: the backward's six matmuls of $2BDD_{{FF}}$ FLOPs each run on "
            f"$B/N_{{DP}}$ rows. {numbers}: {pm.per_device_flops(layer, backward=True, n_dp=n) / 1e12:.3g} TFLOP per device.",
        ("data_parallel_calcs", "b"):
            f"${latex(sym['dp_backward_comm'])}$: one ring all-reduce of $dW_1, dW_2, dW_3$ ($6DD_{{FF}}$ bytes in FP16), "
            f"independent of $B$. {numbers}: "
            + _values(layer, hws, w(lambda W: pm.dp_backward_comm_time(layer, n_dp=n, link_bytes_per_s=W) * 1e3), "{:.3g} ms") + ".",
        ("data_parallel_calcs", "c"):
            f"$N_{{DP}} \\le {latex(sym['dp_max_n'])}$: setting the all-reduce time equal to the backward compute time "
            "and solving for $N_{DP}$; the bytes are fixed while the math shrinks as $B/N$. For the 8B FFN: "
            + _values(layer, hws, lambda hw: pm.dp_max_devices(layer, accelerator=hw), "{:.1f}") + ".",
        ("fsdp_calcs", "a"):
            f"Forward ${latex(sym['fsdp_forward_flops'])}$, backward ${latex(sym['fsdp_backward_flops'])}$: data "
            f"parallelism's math on a batch shard, the weights being gathered first. {numbers}: "
            f"{pm.per_device_flops(layer, n_fsdp=n) / 1e12:.3g} and {pm.per_device_flops(layer, backward=True, n_fsdp=n) / 1e12:.3g} "
            "TFLOP per device.",
        ("fsdp_calcs", "b"):
            f"Forward ${latex(sym['fsdp_forward_comm'])}$ (all-gather $W_1, W_2, W_3$), backward "
            f"${latex(sym['fsdp_backward_comm'])}$ (all-gather them again, then reduce-scatter their gradients). "
            f"{numbers}, forward: " + _values(layer, hws, w(lambda W: pm.fsdp_forward_comm_time(
                layer, n_fsdp=n, link_bytes_per_s=W) * 1e3), "{:.3g} ms") + ".",
        ("fsdp_calcs", "c"):
            f"Forward $N_{{FSDP}} \\le {latex(sym['fsdp_max_n_forward'])}$ and backward $N_{{FSDP}} \\le "
            f"{latex(sym['fsdp_max_n_backward'])}$: both double from forward to backward, so the bound is the same, and "
            "equals data parallelism's. For the 8B FFN: "
            + _values(layer, hws, lambda hw: pm.fsdp_max_devices(layer, accelerator=hw)["forward"], "{:.1f}") + ".",
        ("tp_calcs", "b"):
            f"Forward ${latex(sym['tp_forward_flops'])}$, backward ${latex(sym['tp_backward_flops'])}$: all $B$ rows, "
            f"$D_{{FF}}/N_{{TP}}$ of the hidden width in each of the three (forward) and six (backward) matmuls. "
            f"{numbers}: {pm.per_device_flops(layer, n_tp=n) / 1e12:.3g} and {pm.per_device_flops(layer, backward=True, n_tp=n) / 1e12:.3g} "
            "TFLOP per device.",
        ("tp_calcs", "c"):
            f"Forward ${latex(sym['tp_forward_comm'])}$ (all-reduce the partial sums $y^{{(i)}}$, one $(B, D)$ tensor), "
            f"backward ${latex(sym['tp_backward_comm'])}$ (all-reduce the partial $dx^{{(i)}}$; $dy$ needs none, $y$ was "
            f"all-reduced). {numbers}: "
            + _values(layer, hws, w(lambda W: pm.tp_forward_comm_time(layer, n_tp=n, link_bytes_per_s=W) * 1e3), "{:.3g} ms")
            + " each way.",
        ("tp_calcs", "d"):
            f"Backward $N_{{TP}} \\le {latex(sym['tp_max_n_backward'])}$, forward $N_{{TP}} \\le "
            f"{latex(sym['tp_max_n_forward'])}$: the same $(B, D)$ all-reduce against twice the math in the backward; no "
            "$B$, since the bytes shrink with the batch too: TP's limit is set by the model's width. For the 8B FFN, "
            "backward / forward: " + "; ".join(
                f"{hw.name}: {pm.tp_max_devices(layer, accelerator=hw)['backward']:.1f} / "
                f"{pm.tp_max_devices(layer, accelerator=hw)['forward']:.1f}" for hw in hws) + ".",
        ("fsdp_tp_calcs", "a"):
            f"${latex(sym['fsdp_tp_forward_flops'])}$: the batch split $N_{{FSDP}}$ ways, the hidden width $N_{{TP}}$ "
            f"ways. {numbers} on both axes: {pm.per_device_flops(layer, n_fsdp=n, n_tp=n) / 1e12:.3g} TFLOP per device.",
        ("fsdp_tp_calcs", "b"):
            f"$\\max\\left({latex(sym['fsdp_tp_comm_fsdp_axis'])},\\ {latex(sym['fsdp_tp_comm_tp_axis'])}\\right)$: the "
            "FSDP axis all-gathers each TP shard of the weights, the TP axis all-reduces $y$ for this FSDP shard's rows, and "
            f"the two overlap. {numbers} on both axes: " + _values(layer, hws, w(lambda W: pm.fsdp_tp_forward_comm_times(
                layer, n_fsdp=n, n_tp=n, link_bytes_per_s=W)["overlapped"] * 1e3), "{:.3g} ms") + ".",
    }
    budgets = ("Dividing each axis's time by the compute time $6BDD_{FF}/(N_{FSDP}N_{TP}C)$ cancels the product: "
               "$(N_{FSDP}-1)/a$ and $(N_{TP}-1)/b$ with $a = BW/C$, $b = 3D_{FF}W/(2C)$.")
    out[("fsdp_tp_calcs", "c")] = (
        f"$N \\le {latex(sym['fsdp_tp_max_n_overlapped'])} \\approx {latex(sym['fsdp_tp_max_n_overlapped_leading'])}$ at "
        f"$N_{{FSDP}} = {latex(sym['fsdp_tp_overlapped_n_fsdp'])}$, $N_{{TP}} = {latex(sym['fsdp_tp_overlapped_n_tp'])}$. "
        f"{budgets} Overlapped axes need each ratio $\\le 1$, so each axis takes its whole budget. For the 8B FFN: "
        + "; ".join(f"{hw.name}: N = {ov['n']:.0f} ({ov['n_fsdp']:.1f} x {ov['n_tp']:.1f})" for hw in hws
                    for ov in [pm.fsdp_tp_max_devices_overlapped(layer, accelerator=hw)]) + ".")
    out[("fsdp_tp_calcs", "d")] = (
        f"$N \\le {latex(sym['fsdp_tp_max_n_serial'])} \\approx {latex(sym['fsdp_tp_max_n_serial_leading'])}$ at "
        f"$N_{{FSDP}} = {latex(sym['fsdp_tp_serial_n_fsdp'])}$, $N_{{TP}} = {latex(sym['fsdp_tp_serial_n_tp'])}$. "
        f"{budgets} Collectives sharing the links add, so the sum must be $\\le 1$; maximising $(1+u)(1+v)$ on "
        "$u/a + v/b = 1$ gives each axis half its budget, about a quarter of the devices. For the 8B FFN: "
        + "; ".join(f"{hw.name}: N = {se['n']:.0f} ({se['n_fsdp']:.1f} x {se['n_tp']:.1f})" for hw in hws
                    for se in [pm.fsdp_tp_max_devices_serial(layer, accelerator=hw)]) + ".")
    return out


def tp_backward_answer(check: dict) -> str:
    """tp_calcs (a): the sharded backward as equations, and the executed check."""
    return ("$W_1^{(i)}, W_2^{(i)}$ are column shards $(D, D_{FF}/N_{TP})$, $W_3^{(i)}$ a row shard; $y$ was "
            "all-reduced, so every device holds all of $dy$:\n\n"
            "$$\\begin{aligned} dz^{(i)} &= dy\\,W_3^{(i)\\top} & dW_3^{(i)} &= z^{(i)\\top} dy\\\\ "
            "dx_2^{(i)} &= dz^{(i)} * f(x_1^{(i)}) & dW_2^{(i)} &= x^\\top dx_2^{(i)}\\\\ "
            "dx_1^{(i)} &= dz^{(i)} * f'(x_1^{(i)}) * x_2^{(i)} & dW_1^{(i)} &= x^\\top dx_1^{(i)}\\\\ "
            "dx^{(i)} &= dx_1^{(i)} W_1^{(i)\\top} + dx_2^{(i)} W_2^{(i)\\top} & dx &= \\text{all-reduce}_i\\big(dx^{(i)}\\big)"
            "\\end{aligned}$$\n\n"
            "The weight gradients stay on their device (each is the full gradient of its shard); the one collective is "
            f"the $(B, D)$ all-reduce of $dx$. Executed (`pm.tp_ffn_forward_backward`) on $N_{{TP}} = {check['n_tp']}$ "
            "shards in float64 against autograd on the unsharded layer, the largest difference is "
            f"{max(v for k, v in check.items() if k != 'n_tp'):.1e} ("
            + ", ".join(f"{k} {v:.1e}" for k, v in check.items() if k != "n_tp") + ").")


def bounds_table(layer: pm.FFNLayer, hws: list[pm.Accelerator]) -> pd.DataFrame:
    rows = []
    for hw in hws:
        rows.append(dict(device=hw.name, W_GBps=hw.link_bytes_per_s / GB, max_N_DP=pm.dp_max_devices(layer, accelerator=hw),
                         max_N_TP_fwd=pm.tp_max_devices(layer, accelerator=hw)["forward"],
                         max_N_TP_bwd=pm.tp_max_devices(layer, accelerator=hw)["backward"],
                         max_N_2D_overlapped=pm.fsdp_tp_max_devices_overlapped(layer, accelerator=hw)["n"],
                         max_N_2D_serial=pm.fsdp_tp_max_devices_serial(layer, accelerator=hw)["n"]))
    return pd.DataFrame(rows)


def crossover_figure(kind: str, *, layer: pm.FFNLayer, hws: list[pm.Accelerator], n_points: int):
    """Compute against communication time over the device count: DP/FSDP backward (``kind="dp"``)
    or TP forward and backward (``"tp"``), one panel per accelerator."""
    if kind not in ("dp", "tp"):
        raise ValueError(f"kind must be 'dp' or 'tp', got {kind!r}")
    fig, axes = plt.subplots(1, len(hws), figsize=(5.5 * len(hws), 4), squeeze=False)
    for ax, hw in zip(axes[0], hws):
        c, w = hw.flops_per_s, hw.link_bytes_per_s
        if kind == "dp":
            bound = pm.dp_max_devices(layer, accelerator=hw)
            crossover_panel(ax, compute=lambda n: pm.per_device_flops(layer, backward=True, n_dp=n) / c,
                            comm=lambda n: pm.dp_backward_comm_time(layer, n_dp=n, link_bytes_per_s=w), bound=bound,
                            n_max=3 * bound, title=f"DP / FSDP backward, {hw.name}", n_points=n_points)
            continue
        bounds = pm.tp_max_devices(layer, accelerator=hw)
        ns = crossover_panel(ax, compute=lambda n: pm.per_device_flops(layer, n_tp=n) / c,
                             comm=lambda n: pm.tp_forward_comm_time(layer, n_tp=n, link_bytes_per_s=w),
                             bound=bounds["forward"], n_max=3 * bounds["backward"], title=f"TP forward and backward, {hw.name}",
                             n_points=n_points, comm_label="communication (TP: fwd = bwd)")
        ax.plot(ns, [pm.per_device_flops(layer, backward=True, n_tp=n) / c * 1e3 for n in ns], ":", label="compute (backward)")
        mark_crossover(ax, bounds["backward"], f"backward N = {bounds['backward']:.1f}", color="tab:red")
        ax.legend(fontsize=8)
    fig.suptitle(f"8B FFN, B = {layer.batch_tokens:,.0f} tokens")
    fig.tight_layout()
    return fig


def batch_crossover_figure(*, layer: pm.FFNLayer, hw: pm.Accelerator, example_n: int, n_points: int):
    """At a fixed device count: DP's compute grows with the batch, its all-reduce does not; TP's
    all-reduce grows with it."""
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = np.linspace(256, 4 * layer.batch_tokens, n_points)
    c, w = hw.flops_per_s, hw.link_bytes_per_s
    at = lambda b: pm.FFNLayer(batch_tokens=b, d_model=layer.d_model, d_ff=layer.d_ff)  # noqa: E731
    ax.plot(batches, [pm.per_device_flops(at(b), backward=True, n_dp=example_n) / c * 1e3 for b in batches], label="DP compute (backward)")
    ax.plot(batches, [pm.dp_backward_comm_time(layer, n_dp=example_n, link_bytes_per_s=w) * 1e3] * len(batches),
            label="DP all-reduce (fixed)")
    ax.plot(batches, [pm.tp_forward_comm_time(at(b), n_tp=example_n, link_bytes_per_s=w) * 1e3 for b in batches],
            label="TP all-reduce (grows with B)")
    b_cross = (example_n - 1) * c / w  # N_DP - 1 = B W / C solved for B
    mark_crossover(ax, b_cross, f"DP compute-bound above B = {b_cross:,.0f}")
    ax.set(xlabel="batch tokens B", ylabel="ms per layer", title=f"N = {example_n} on {hw.name}")
    ax.legend(fontsize=8)
    return fig


def fsdp_tp_region_figure(*, layer: pm.FFNLayer, hws: list[pm.Accelerator], n_points: int):
    """Per accelerator: log2(serial comm / compute) over (N_FSDP, N_TP), both compute-bound
    boundaries, and the hyperbolas N_FSDP N_TP = N_max that touch them."""
    fig, axes = plt.subplots(1, len(hws), figsize=(5.5 * len(hws), 4.5), squeeze=False)
    for ax, hw in zip(axes[0], hws):
        grid = pm.fsdp_tp_ratio_grid(layer, accelerator=hw, n_points=n_points)
        ov, se = (pm.fsdp_tp_max_devices_overlapped(layer, accelerator=hw), pm.fsdp_tp_max_devices_serial(layer, accelerator=hw))
        nf, nt = np.meshgrid(grid["n_fsdp"], grid["n_tp"])
        im = ax.pcolormesh(nf, nt, np.log2(np.maximum(grid["serial"], 2.0**-4)), cmap="RdBu_r", vmin=-3, vmax=3,
                           shading="auto")
        ax.contour(nf, nt, grid["overlapped"], levels=[1.0], colors="k", linestyles="--")
        ax.contour(nf, nt, grid["serial"], levels=[1.0], colors="k")
        for n_target, style in [(ov["n"], "--"), (se["n"], "-")]:
            ax.plot(grid["n_fsdp"], n_target / grid["n_fsdp"], color="tab:green", ls=style, lw=1)
        ax.plot(ov["n_fsdp"], ov["n_tp"], "k*", ms=12, label=f"overlapped optimum N = {ov['n']:.0f}")
        ax.plot(se["n_fsdp"], se["n_tp"], "ko", ms=7, label=f"serial optimum N = {se['n']:.0f}")
        ax.set(xlabel="N_FSDP", ylabel="N_TP", ylim=(1, grid["n_tp"][-1]))
        ax.set_title(f"{hw.name}\nserial comm / compute (log2)", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
    fig.colorbar(im, ax=axes, label="log2(serial comm / compute)")
    return fig
