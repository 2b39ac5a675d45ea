"""One full training step, made fast, against Hugging Face's Llama in the same run.

Every variant trains the same architecture (pre-norm RMSNorm, RoPE, SwiGLU, untied head) on
batch x context random tokens with bf16 autocast over fp32 master weights: forward, mean
cross-entropy, backward, AdamW. Variants are data (``VARIANTS``), each a combination of:

- ``impl``: ``hf`` (transformers' LlamaForCausalLM, SDPA attention) or ``ours`` (TransformerLM,
  SDPA attention);
- ``compile_blocks``: torch.compile every transformer block (one compile serves all of them:
  same code, same shapes), which fuses RMSNorm, RoPE, SwiGLU's gate and the residual adds;
- ``fused_loss``: ``systems.kernels.fused_linear_ce`` instead of full logits + cross-entropy;
- ``optimizer``: ``torch_fused`` (torch.optim.AdamW(fused=True)), ``ours`` (systems.optim.AdamW)
  or ``fused`` (systems.kernels.fused_adamw.FusedAdamW, one Triton pass over p, g, m, v);
- ``master_weights``: the model holds its matmul weights in bf16 and the optimizer
  (``systems.kernels.fused_adamw.MasterWeightAdamW``) the fp32 masters, so autocast casts no
  weight in the forward and no gradient in the backward; the arithmetic stays autocast's;
- ``split_masters``: with master weights, the optimizer keeps no fp32 master, only its low 16
  bits beside the model's bf16 weight (its high half): 26 bytes of update traffic per parameter
  instead of 28, the same arithmetic (``MasterWeightAdamW(split_masters=True)`` says where a
  rounding tie moves a master by one fp32 ulp);
- ``compile_mode``: torch.compile's mode for the blocks; ``"reduce-overhead"`` replays each
  block's forward and backward as CUDA graphs, for sizes whose step waits on kernel launches;
- ``optimizer_in_backward``: that optimizer, one per block (and per module outside the blocks),
  stepped inside the backward on a side CUDA stream as soon as the group's gradients exist
  (``systems.train``), so the memory-bound update overlaps the compute-bound backward;
  ``measure`` then runs the steps on a high-priority stream (``priority_stream``), so the
  backward's kernels get the SMs first and the updates fill what they leave idle;
- ``fused_projections``: the model computes Q, K, V as one GEMM and SwiGLU's W1, W3 as another
  (``ModelConfig.fused_projections``): fewer, larger matmuls, the same arithmetic. One seed gives
  it other initial FFN weights than the unfused model, so the two rows' losses differ slightly.

Each variant is data: an implementation and its projections' layout (the model config), a
``ParallelPlan`` (compiled blocks), an ``OptimizerSpec`` and a ``StepSpec`` (bf16, the fused or the
logits loss), run by the one training step (``systems.train.TrainStep``).

Timing: CUDA events at each phase's end (``Marks``; no synchronisation inside a step), then
medians and 10th/90th percentiles over the timed steps, and ``step_ms_span``, the timed steps'
whole span over their count (host gaps between steps included); the first step's wall time is
reported separately (it includes compilation and autotuning). Each row is written as soon as it
exists.
With ``optimizer_in_backward`` the updates run during the backward, so the "backward" phase holds
the backward plus whatever the overlapped updates slow it down by, and the "optimizer" phase is
only the tail: the updates of the last groups to get their gradients (the first block, the
embeddings) and the wait for the side stream. The step time is the number to compare.

    python -m systems.bench.train_step --model 2.7B --variants hf_llama ours_eager ours_master ours_master_fusedproj
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from systems.bench.config import DEFAULT_OUT_ROOT, RunConfig, model_argument, out_file_argument
from systems.config import ModelConfig
from systems.measure.devices import catch_oom, release_memory, sync
from systems.measure.flops import train_step_flops
from systems.measure.profiler import export_trace, profiler_activities
from systems.measure.results import ResultWriter
from systems.measure.timer import Marks, median_p10_p90
from systems.parallel.plan import ParallelPlan, apply
from systems.train import (MARKS, GraphedStep, OptimizerSpec, StepSpec, TrainStep, build_optimizer, phase_ms,
                           priority_stream)

GIB = 2**30
PHASES = ("forward", "backward", "optimizer")
GRAPH_EAGER_STEPS = 2  # GraphedStep's eager steps before the capture (within the warm-up)


@dataclass(frozen=True)
class Variant:
    impl: str  # "hf" or "ours"
    compile_blocks: bool = False
    fused_loss: bool = False
    optimizer: str = "ours"  # "ours", "fused" or "torch_fused"
    optimizer_in_backward: bool = False  # per-block optimizer steps overlapped with the backward
    master_weights: bool = False  # bf16 matmul weights in the model, fp32 masters in the optimizer
    compile_mode: str | None = None  # torch.compile mode of the blocks (with compile_blocks)
    fused_projections: bool = False  # QKV and SwiGLU's W1/W3 as one GEMM each (ModelConfig.fused_projections)
    split_masters: bool = False  # the fp32 masters as the model's bf16 weight + 16 low bits (with master_weights)
    # with fused_projections: q, k, v split and q, k rotated by one Triton pass each way
    # (ModelConfig.qkv_rope_kernel, systems.kernels.rope_qkv)
    qkv_rope_kernel: bool = False
    sm_carveout: int = 0  # SMs the backward's matmuls leave to the updates (with optimizer_in_backward)
    # the whole step (forward, backward, updates) captured as one CUDA graph (systems.train.GraphedStep)
    graph_step: bool = False

    def __post_init__(self) -> None:
        if self.impl not in ("hf", "ours"):
            raise ValueError(f"impl must be 'hf' or 'ours', got {self.impl!r}")
        if self.master_weights and (self.impl != "ours" or self.optimizer != "fused"):
            raise ValueError("master_weights needs impl='ours' and optimizer='fused' (MasterWeightAdamW)")
        if self.split_masters and not self.master_weights:
            raise ValueError("split_masters splits the fp32 masters of master_weights: set master_weights=True")
        if self.qkv_rope_kernel and not self.fused_projections:
            raise ValueError("qkv_rope_kernel rotates the fused QKV projection's output: set fused_projections=True")
        if self.sm_carveout and not self.optimizer_in_backward:
            raise ValueError("sm_carveout leaves SMs to the updates inside the backward: set optimizer_in_backward=True")
        if self.compile_mode is not None and not self.compile_blocks:
            raise ValueError("compile_mode applies to compiled blocks: set compile_blocks=True")
        if self.graph_step and (self.optimizer != "fused" or self.compile_mode is not None):
            raise ValueError("graph_step captures the whole step: it needs optimizer='fused' (capturable) and blocks "
                             "compiled without CUDA graphs of their own (compile_mode=None)")
        if self.impl == "hf" and (self.compile_blocks or self.fused_loss or self.optimizer_in_backward
                                  or self.fused_projections):
            raise ValueError("the hf baseline runs as transformers builds it: no compiled blocks, fused loss, "
                             "optimizer in the backward or fused projections")

    def plan(self) -> ParallelPlan:
        return ParallelPlan(compile="blocks" if self.compile_blocks else "none", compile_mode=self.compile_mode)

    def optimizer_spec(self, *, lr: float) -> OptimizerSpec:
        kind = {"ours": "ours", "fused": "fused", "torch_fused": "torch_fused"}[self.optimizer]
        return OptimizerSpec(kind=kind, lr=lr, master_weights=self.master_weights,
                             split_masters=self.split_masters, in_backward=self.optimizer_in_backward,
                             capturable=self.graph_step)

    def step_spec(self) -> StepSpec:
        loss = "hf_logits" if self.impl == "hf" else ("fused" if self.fused_loss else "logits")
        return StepSpec(precision="bf16", loss=loss, sm_carveout=self.sm_carveout)


VARIANTS: dict[str, Variant] = {
    "hf_llama": Variant(impl="hf", optimizer="torch_fused"),
    "ours_eager": Variant(impl="ours"),
    "ours_compiled": Variant(impl="ours", compile_blocks=True),
    "ours_fused": Variant(impl="ours", fused_loss=True, optimizer="fused"),
    "ours_fast": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused"),
    "ours_overlap": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                            optimizer_in_backward=True),
    "ours_fused_master": Variant(impl="ours", fused_loss=True, optimizer="fused", master_weights=True),
    "ours_fused_master_fusedproj": Variant(impl="ours", fused_loss=True, optimizer="fused", master_weights=True,
                                           fused_projections=True),
    "ours_fused_master_split": Variant(impl="ours", fused_loss=True, optimizer="fused", master_weights=True,
                                       split_masters=True),
    "ours_master": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                           master_weights=True),
    "ours_master_split": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                 master_weights=True, split_masters=True),
    "ours_master_fusedproj": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                     master_weights=True, fused_projections=True),
    "ours_master_overlap": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                   master_weights=True, optimizer_in_backward=True),
    "ours_graphs": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                           master_weights=True, compile_mode="reduce-overhead"),
    "ours_graphs_fusedproj": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                     master_weights=True, compile_mode="reduce-overhead", fused_projections=True),
    "ours_graphs_split": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                 master_weights=True, compile_mode="reduce-overhead", split_masters=True),
    "ours_graphs_overlap": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                   master_weights=True, compile_mode="reduce-overhead", optimizer_in_backward=True),
    # the two best levers of each size with split masters on top
    "ours_graphs_overlap_split": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                         master_weights=True, compile_mode="reduce-overhead",
                                         optimizer_in_backward=True, split_masters=True),
    "ours_master_overlap_sm16_split": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                              master_weights=True, optimizer_in_backward=True, sm_carveout=16,
                                              split_masters=True),
    # inductor's max-autotune: every GEMM of a block (forward and backward) timed against Triton
    # templates, the fastest kept, pointwise neighbours fused into a Triton GEMM's epilogue where
    # one wins; the blocks replayed as CUDA graphs, as with reduce-overhead. Measured on an H100:
    # no gain, 150-210 s of compiling (docs/training_step_notes.md, entry 15), so not in FULL_PLAN
    "ours_autotune_split": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                   master_weights=True, compile_mode="max-autotune", split_masters=True),
    **{f"ours_master_overlap_sm{sms}": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                               master_weights=True, optimizer_in_backward=True, sm_carveout=sms)
       for sms in (16, 32)},
}
# Each of these is the variant it is named after with one lever changed: the fastest variants of
# each size with the fused projections on top; and the fused-projection variants with the QKV
# split and RoPE as one Triton pass each way instead of Inductor's concatenation kernel
# (docs/training_step_notes.md, entries 17 and 19)
FUSEDPROJ_OF = ("ours_graphs_overlap_split", "ours_master_overlap_sm16_split")
VARIANTS.update({f"{n}_fusedproj": dataclasses.replace(VARIANTS[n], fused_projections=True) for n in FUSEDPROJ_OF})
QKVROPE_OF = ("ours_graphs_fusedproj", *(f"{n}_fusedproj" for n in FUSEDPROJ_OF))
VARIANTS.update({f"{n}_qkvrope": dataclasses.replace(VARIANTS[n], qkv_rope_kernel=True) for n in QKVROPE_OF})
# The whole step as one CUDA graph (GraphedStep), in place of no graphs or of one graph per block:
# ours_stepgraph_X is ours_master_X (blocks compiled without graphs of their own) captured whole
# (_smN: N SMs carved out of the backward's matmuls for the updates)
# (in_backward, SMs carved out, fused projections with the QKV + RoPE kernel)
STEPGRAPH_LEVERS = ((False, 0, False), (True, 0, False), *((True, sms, False) for sms in (8, 16, 24, 32)),
                    (True, 0, True), *((True, sms, True) for sms in (8, 16)))


def _stepgraph_name(in_backward: bool, sms: int, fused: bool) -> str:
    return (f"ours_stepgraph{'_overlap' if in_backward else ''}{f'_sm{sms}' if sms else ''}_split"
            f"{'_fusedproj_qkvrope' if fused else ''}")


VARIANTS.update({_stepgraph_name(*levers): dataclasses.replace(
    VARIANTS["ours_master_split"], optimizer_in_backward=levers[0], sm_carveout=levers[1],
    fused_projections=levers[2], qkv_rope_kernel=levers[2], graph_step=True) for levers in STEPGRAPH_LEVERS})

# (lever, variant without it, variant with it): notebook 10 credits each lever with the
# difference between the two, measured in the same run
LEVERS: tuple[tuple[str, str, str], ...] = (
    ("compiled blocks", "ours_eager", "ours_compiled"),
    ("fused LM head + loss, fused AdamW", "ours_eager", "ours_fused"),
    ("compiled blocks + fused kernels", "ours_eager", "ours_fast"),
    ("bf16 weights, fp32 masters in the optimizer", "ours_fused", "ours_fused_master"),
    ("bf16 weights, fp32 masters in the optimizer", "ours_fast", "ours_master"),
    ("CUDA graphs (per block)", "ours_master", "ours_graphs"),
    ("QKV and W1/W3 as one GEMM each", "ours_fused_master", "ours_fused_master_fusedproj"),
    ("QKV and W1/W3 as one GEMM each", "ours_master", "ours_master_fusedproj"),
    ("QKV and W1/W3 as one GEMM each", "ours_graphs", "ours_graphs_fusedproj"),
    *(("QKV and W1/W3 as one GEMM each", n, f"{n}_fusedproj") for n in FUSEDPROJ_OF),
    *(("the QKV split and RoPE in one Triton pass each way", n, f"{n}_qkvrope") for n in QKVROPE_OF),
    ("split fp32 masters (bf16 weight + 16 low bits)", "ours_fused_master", "ours_fused_master_split"),
    ("split fp32 masters (bf16 weight + 16 low bits)", "ours_master", "ours_master_split"),
    ("split fp32 masters (bf16 weight + 16 low bits)", "ours_graphs", "ours_graphs_split"),
    ("optimizer inside the backward", "ours_fast", "ours_overlap"),
    ("optimizer inside the backward", "ours_master", "ours_master_overlap"),
    ("optimizer inside the backward", "ours_graphs", "ours_graphs_overlap"),
    ("split fp32 masters (bf16 weight + 16 low bits)", "ours_graphs_overlap", "ours_graphs_overlap_split"),
    ("split fp32 masters (bf16 weight + 16 low bits)", "ours_master_overlap_sm16", "ours_master_overlap_sm16_split"),
    ("16 SMs carved out of the backward's matmuls for the updates", "ours_master_overlap", "ours_master_overlap_sm16"),
    ("32 SMs carved out of the backward's matmuls for the updates", "ours_master_overlap", "ours_master_overlap_sm32"),
    ("the whole step as one CUDA graph", "ours_master_split", "ours_stepgraph_split"),
    ("the whole step as one CUDA graph", "ours_master_overlap_sm16_split", "ours_stepgraph_overlap_sm16_split"),
    ("the whole step as one CUDA graph", "ours_master_overlap_sm16_split_fusedproj_qkvrope",
     "ours_stepgraph_overlap_sm16_split_fusedproj_qkvrope"),
    ("one CUDA graph per step instead of one per block", "ours_graphs_split", "ours_stepgraph_split"),
    ("one CUDA graph per step instead of one per block", "ours_graphs_overlap_split", "ours_stepgraph_overlap_split"),
    ("one CUDA graph per step instead of one per block", "ours_graphs_overlap_split_fusedproj_qkvrope",
     "ours_stepgraph_overlap_split_fusedproj_qkvrope"),
)

# The project's own step-time targets on one H100 (not the handout's, which sets none for these
# sizes): batch 4 x context 512, bf16 autocast over fp32 master weights, forward to AdamW. They are
# issue #26's (62% MFU at 2.7B); docs/training_step_notes.md says what has been tried against them.
OUR_TARGETS_MS = {"2.7B": 100.0, "xl-2025": 65.0}
OUR_TARGETS_GPU = "H100"  # a run on another GPU is reported against them, not judged


@dataclass(frozen=True)
class Plan:
    """What notebook 10 runs: the variants of each preset, the step's shape and counts, and which
    (preset, variant) it profiles."""
    variants: dict[str, tuple[str, ...]]
    step: dict
    trace: tuple[str, str]


# GPU: the 2.7B preset (the 2026 handout's xl) and the 2025 handout's xl; the overlap variant's
# timeline shows whether the side-stream updates overlap the backward
FULL_PLAN = Plan(
    variants={"2.7B": ("hf_llama", "ours_eager", "ours_compiled", "ours_fused", "ours_fast", "ours_master",
                       "ours_master_fusedproj", "ours_master_split", "ours_master_overlap", "ours_master_overlap_sm16",
                       "ours_master_overlap_sm32", "ours_master_overlap_sm16_split",
                       "ours_master_overlap_sm16_split_fusedproj", "ours_master_overlap_sm16_split_fusedproj_qkvrope",
                       "ours_graphs", "ours_graphs_split", "ours_stepgraph_split", "ours_stepgraph_overlap_sm16_split"),
              "xl-2025": ("hf_llama", "ours_eager", "ours_fast", "ours_master", "ours_graphs", "ours_graphs_fusedproj",
                          "ours_graphs_fusedproj_qkvrope", "ours_graphs_split", "ours_graphs_overlap",
                          "ours_graphs_overlap_split", "ours_graphs_overlap_split_fusedproj",
                          "ours_graphs_overlap_split_fusedproj_qkvrope", "ours_stepgraph_split",
                          "ours_stepgraph_overlap_split_fusedproj_qkvrope")},
    step=dict(batch_size=4, context_length=512, warmup=5, steps=20), trace=("2.7B", "ours_master_overlap"))
# CPU: the debug model; compiled variants are left out (inductor's CPU compile dominates a smoke run
# and needs a C++ toolchain)
SMOKE_PLAN = Plan(variants={"debug": ("hf_llama", "ours_eager", "ours_fused", "ours_fused_master",
                                       "ours_fused_master_fusedproj", "ours_fused_master_split")},
                  step=dict(batch_size=2, context_length=64, warmup=1, steps=3), trace=("debug", "ours_fused"))




@dataclass
class StepConfig(RunConfig):
    model: str = "2.7B"
    variant: str = "ours_fast"
    warmup: int = 3
    lr: float = 1e-4

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.warmup < 1:
            raise ValueError(f"need warmup >= 1 (the first step compiles), got {self.warmup}")
        if self.variant in VARIANTS and VARIANTS[self.variant].graph_step and self.warmup <= GRAPH_EAGER_STEPS:
            raise ValueError(f"{self.variant} captures its graph after {GRAPH_EAGER_STEPS} eager steps: need warmup >= "
                             f"{GRAPH_EAGER_STEPS + 1}, so the capture is not timed; got {self.warmup}")
        for lever in ("fused_projections", "qkv_rope_kernel"):
            if lever in self.model_overrides:
                raise ValueError(f"{lever} is a variant's lever: choose a *_fusedproj or *_qkvrope variant instead of "
                                 f"model_overrides={{'{lever}': ...}}")
        super().__post_init__()

    def model_config(self) -> ModelConfig:
        # every variant attends through SDPA (HF's attn_implementation="sdpa" as well); the variant
        # alone sets the projections' layout, so each row's variant says which one it measured
        variant = VARIANTS[self.variant]
        return dataclasses.replace(super().model_config(), attn_impl="sdpa", context_length=self.context_length,
                                   fused_projections=variant.fused_projections,
                                   qkv_rope_kernel=variant.qkv_rope_kernel)


# ----------------------------------------------------------------------------- building


def hf_llama(cfg: ModelConfig, *, device: torch.device) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with our config's shapes (no bias, untied head, MHA)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ImportError("the hf_llama baseline needs transformers: pip install transformers") from exc
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_heads, max_position_embeddings=cfg.context_length,
                         rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
                         attention_bias=False, mlp_bias=False, use_cache=False, attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(hf_cfg)


def build(cfg: StepConfig, *, device: torch.device) -> tuple[torch.nn.Module, object, TrainStep]:
    """(model, optimizer, step) of the config's variant."""
    from systems.model import TransformerLM

    variant = VARIANTS[cfg.variant]
    mcfg = cfg.model_config()
    if variant.impl == "hf":
        model = hf_llama(mcfg, device=device)
    else:
        with torch.device(device):
            model = TransformerLM(mcfg)
    # the optimizer first: master weights change the model's weight dtypes, which compiling sees
    opt = build_optimizer(model, variant.optimizer_spec(lr=cfg.lr))
    spec = variant.step_spec()
    par = apply(model, variant.plan(), device=device, loss=spec.loss)
    step = TrainStep(model, spec=spec, optimizer=opt, forward=par.forward)
    return model, opt, (GraphedStep(step, eager_steps=GRAPH_EAGER_STEPS) if variant.graph_step else step)


# ----------------------------------------------------------------------------- timing


def measure(cfg: StepConfig, *, peak_flops: float | None = None, trace_path: str | Path | None = None) -> dict:
    """One row: step time (median, p10, p90), per-phase medians, first-step time, MFU, peak memory.

    ``trace_path``: also profile one step after the timed ones and export its Chrome trace.
    Out of memory gives a row with status "oom".
    """
    device = cfg.resolved_device()
    mcfg = cfg.model_config()
    variant = VARIANTS[cfg.variant]
    tokens = cfg.batch_size * cfg.context_length
    flops = train_step_flops(mcfg, batch=cfg.batch_size, seq=cfg.context_length)
    row: dict = dict(**asdict(cfg), tokens=tokens, n_params=mcfg.n_params, step_flops=flops, status="ok",
                     **asdict(variant))
    model = opt = step = None
    if variant.compile_blocks:
        # each compiled variant starts from empty compile caches (and CUDA-graph pools): its
        # first step then shows its own compile time, and no earlier variant's graphs stay alive
        torch._dynamo.reset()
    with catch_oom() as oom, _step_stream(variant, device=device):
        torch.manual_seed(cfg.seed)
        model, opt, step = build(cfg, device=device)
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        x = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, cfg.context_length), device=device, generator=gen)
        y = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, cfg.context_length), device=device, generator=gen)
        t0 = time.perf_counter()
        loss = step(x, y)
        sync(device)
        row["first_step_s"] = time.perf_counter() - t0
        for _ in range(cfg.warmup - 1):
            step(x, y)
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        steps = []
        for _ in range(cfg.steps):
            marks = Marks(device)
            loss = step(x, y, marks=marks)
            steps.append(marks)
            if device.type != "cuda":
                sync(device)
        sync(device)  # the events are read once every step has finished
        phases = [phase_ms(m) for m in steps]
        for phase in (*PHASES, "replay"):
            if all(phase in p for p in phases):
                row[f"{phase}_ms"] = statistics.median(p[phase] for p in phases)
        row["step_ms"], row["step_ms_p10"], row["step_ms_p90"] = median_p10_p90([p["step"] for p in phases])
        # the timed steps' whole span over their count: what a step costs with the host's gaps
        # between steps included, which the per-step marks leave out
        last = next(name for name in reversed(MARKS) if name in steps[-1])
        row["step_ms_span"] = steps[-1].ms_since(steps[0], "start", last) / cfg.steps
        row["loss"] = float(loss)
        row["tokens_per_s"] = tokens / (row["step_ms"] * 1e-3)
        row["achieved_tflops"] = flops / (row["step_ms"] * 1e-3) / 1e12
        if peak_flops:
            row["mfu"] = flops / (row["step_ms"] * 1e-3) / peak_flops
            row["mfu_peak_tflops"] = peak_flops / 1e12  # what MFU divides by, named beside it
        if device.type == "cuda":
            row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
        if trace_path is not None:
            # a graphed step is profiled as one replay (its kernels, no phase ranges)
            profiled = step if isinstance(step, GraphedStep) else TrainStep(
                model, spec=dataclasses.replace(step.spec, sync_phases=True), optimizer=opt, forward=step.forward)
            row["trace"] = str(profile_one_step(lambda: profiled(x, y), device=device, trace_path=trace_path))
    if oom:
        row["status"] = "oom"
        row["error"] = oom.message
    model = opt = step = profiled = None  # they hold the weights: gone before the cache is emptied
    release_memory()
    return row


def _step_stream(variant: Variant, *, device: torch.device):
    """The stream the steps run on: a high-priority one when the optimizer runs inside the backward
    (the backward's kernels then get the SMs before the side stream's updates), else the current one."""
    if not variant.optimizer_in_backward:
        return contextlib.nullcontext()
    return priority_stream(device)


def profile_one_step(step, *, device: torch.device, trace_path: str | Path) -> Path:
    """Profile one (warm) call of ``step`` with torch.profiler and export its Chrome trace."""
    from torch.profiler import profile

    trace_path = Path(trace_path)
    with profile(activities=profiler_activities(device)) as prof:
        step()
        sync(device)
    export_trace(prof, trace_path)
    return trace_path


def run_variants(*, model: str, variants: list[str], writer: ResultWriter | None = None,
                 peak_flops: float | None = None, trace_variant: str | None = None,
                 trace_path: str | Path | None = None, progress: bool = True, **step_kw) -> list[dict]:
    """Every variant of one model size, one row each, written as it is produced."""
    return run_configs(step_configs(model=model, variants=variants, **step_kw), writer=writer, peak_flops=peak_flops,
                       trace_variant=trace_variant, trace_path=trace_path, progress=progress)


def step_configs(*, model: str, variants: list[str], **step_kw) -> list[StepConfig]:
    """Every variant's config, all checked before any of them runs."""
    return [StepConfig(model=model, variant=name, **step_kw) for name in variants]


def run_configs(configs: list[StepConfig], *, writer: ResultWriter | None = None, peak_flops: float | None = None,
                trace_variant: str | None = None, trace_path: str | Path | None = None,
                progress: bool = True) -> list[dict]:
    """One row per config, written as it is produced."""
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(configs, desc=f"train step ({configs[0].model if configs else ''})", disable=not progress)
    for cfg in bar:
        bar.set_postfix_str(cfg.variant)
        row = measure(cfg, peak_flops=peak_flops, trace_path=trace_path if cfg.variant == trace_variant else None)
        if writer is not None:
            writer.write(row)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=model_argument, default="2.7B")
    # a metavar keeps the usage line short: argparse would spell every variant in it, twice
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT",
                        help=f"any of: {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bf16 matmul rate MFU is relative to (e.g. a measured ceiling; default: the GPU's "
                             "dense bf16 datasheet peak from systems.measure.hardware, where it is listed)")
    parser.add_argument("--out", type=out_file_argument, default=f"{DEFAULT_OUT_ROOT}/train_step/train_step.jsonl",
                        help="JSON-lines results file (default %(default)s)")
    parser.add_argument("--trace-variant", default=None, choices=list(VARIANTS), metavar="VARIANT",
                        help="profile one more step of this variant (one of --variants), export its Chrome trace "
                             "to --trace and print its kernel time per category and its top kernels")
    parser.add_argument("--trace", default="train_step_trace.json.gz", help="where --trace-variant's trace goes")
    args = parser.parse_args(argv)
    if args.trace_variant and args.trace_variant not in args.variants:
        parser.error(f"--trace-variant {args.trace_variant} is not among --variants {args.variants}")
    peak_tflops = args.peak_tflops
    if peak_tflops is None and torch.cuda.is_available():
        from systems.measure.hardware import lookup_peak

        sheet = lookup_peak(torch.cuda.get_device_name())
        peak_tflops = sheet.bf16_tflops if sheet else None
    try:
        # every variant's config is checked before the results file is started afresh (which moves
        # the last run's rows aside), so a bad option leaves that file as it was
        configs = step_configs(model=args.model, variants=args.variants, batch_size=args.batch_size,
                               context_length=args.context_length, steps=args.steps, warmup=args.warmup)
        rows = run_configs(configs, writer=ResultWriter(args.out), peak_flops=peak_tflops * 1e12 if peak_tflops else None,
                           trace_variant=args.trace_variant, trace_path=args.trace)
    except ValueError as exc:
        parser.error(str(exc))
    for r in rows:
        extra = r["status"]
        if r["status"] == "ok":
            extra = (f"{r['step_ms']:.1f} ms/step (p10-p90 {r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}), "
                     f"{r['achieved_tflops']:.3g} TFLOP/s"
                     + (f", MFU {r['mfu']:.1%} of {r['mfu_peak_tflops']:.0f} TFLOP/s" if r.get("mfu") else "")
                     + (f", peak {r['peak_memory_gib']:.1f} GiB" if r.get("peak_memory_gib") else ""))
        print(f"{r['model']:>6} {r['variant']:>14}: {extra}")
    print(f"rows in {args.out}")
    traced = [r for r in rows if r.get("trace")]
    if traced:
        print(trace_summary(traced[0]["trace"]))
    return 0 if all(r["status"] == "ok" for r in rows) else 3


def trace_summary(trace_path: str | Path, *, top: int = 15) -> str:
    """One profiled step as text: kernel time per category and per phase, and the top kernels."""
    import pandas as pd

    from systems.measure import profiler

    items, ranges = profiler.parse_trace(profiler.load_trace(trace_path))
    items = profiler.attribute(items, ranges)
    with pd.option_context("display.width", 160, "display.max_colwidth", 70):
        return "\n\n".join([
            f"trace: {trace_path}",
            profiler.category_table(items).to_string(index=False, float_format="%.3f"),
            profiler.range_table(items, ranges).to_string(index=False, float_format="%.3f"),
            profiler.kernel_table(items, top=top).drop(columns=["name"]).to_string(index=False, float_format="%.3f"),
        ])


if __name__ == "__main__":
    raise SystemExit(main())
