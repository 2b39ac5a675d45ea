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
- ``compile_mode``: torch.compile's mode for the blocks; ``"reduce-overhead"`` replays each
  block's forward and backward as CUDA graphs, for sizes whose step waits on kernel launches;
- ``optimizer_in_backward``: that optimizer, one per block (and per module outside the blocks),
  stepped inside the backward on a side CUDA stream as soon as the group's gradients exist
  (``systems.train``), so the memory-bound update overlaps the compute-bound backward;
  ``measure`` then runs the steps on a high-priority stream (``priority_stream``), so the
  backward's kernels get the SMs first and the updates fill what they leave idle.

Timing: CUDA events around each phase of every step (no synchronisation inside a step), then
medians and 10th/90th percentiles over the timed steps; the first step's wall time is reported
separately (it includes compilation and autotuning). Each row is written as soon as it exists.
With ``optimizer_in_backward`` the updates run during the backward, so the "backward" phase holds
the backward plus whatever the overlapped updates slow it down by, and the "optimizer" phase is
only the tail: the updates of the last groups to get their gradients (the first block, the
embeddings) and the wait for the side stream. The step time is the number to compare.

    python -m systems.bench.train_step --model 2.7B --variants hf_llama ours_eager ours_fast ours_master ours_master_overlap
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.profiler import record_function

from systems.bench.benchmark import PHASE_RANGES, STEP_RANGE, compile_blocks
from systems.config import ModelConfig, get_config
from systems.measure.devices import DeviceMarks, is_oom, median_p10_p90, release_memory, resolve_device, sync
from systems.measure.results import ResultWriter

GIB = 2**30


@dataclass(frozen=True)
class Variant:
    impl: str  # "hf" or "ours"
    compile_blocks: bool = False
    fused_loss: bool = False
    optimizer: str = "ours"  # "ours", "fused" or "torch_fused"
    optimizer_in_backward: bool = False  # per-block optimizer steps overlapped with the backward
    master_weights: bool = False  # bf16 matmul weights in the model, fp32 masters in the optimizer
    compile_mode: str | None = None  # torch.compile mode of the blocks (with compile_blocks)

    def __post_init__(self) -> None:
        if self.master_weights and (self.impl != "ours" or self.optimizer != "fused"):
            raise ValueError("master_weights needs impl='ours' and optimizer='fused' (MasterWeightAdamW)")
        if self.compile_mode is not None and not self.compile_blocks:
            raise ValueError("compile_mode applies to compiled blocks: set compile_blocks=True")


VARIANTS: dict[str, Variant] = {
    "hf_llama": Variant(impl="hf", optimizer="torch_fused"),
    "ours_eager": Variant(impl="ours"),
    "ours_compiled": Variant(impl="ours", compile_blocks=True),
    "ours_fused": Variant(impl="ours", fused_loss=True, optimizer="fused"),
    "ours_fast": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused"),
    "ours_overlap": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                            optimizer_in_backward=True),
    "ours_fused_master": Variant(impl="ours", fused_loss=True, optimizer="fused", master_weights=True),
    "ours_master": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                           master_weights=True),
    "ours_master_overlap": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                   master_weights=True, optimizer_in_backward=True),
    "ours_graphs": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                           master_weights=True, compile_mode="reduce-overhead"),
    "ours_graphs_overlap": Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused",
                                   master_weights=True, compile_mode="reduce-overhead", optimizer_in_backward=True),
}


@dataclass
class StepConfig:
    model: str = "2.7B"
    batch_size: int = 4
    context_length: int = 512
    variant: str = "ours_fast"
    warmup: int = 3
    steps: int = 10
    lr: float = 1e-4
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.batch_size < 1 or self.context_length < 2:
            raise ValueError(f"need batch_size >= 1 and context_length >= 2, got {self.batch_size}, "
                             f"{self.context_length}")
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"need warmup >= 1 and steps >= 1, got {self.warmup} and {self.steps}")

    def model_config(self) -> ModelConfig:
        return get_config(self.model, context_length=self.context_length, attn_impl="sdpa")


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


def build(cfg: StepConfig, *, device: torch.device):
    """(model, optimizer, loss_fn); loss_fn(model, tokens, targets) -> scalar loss."""
    from systems.model import TransformerLM
    from systems.optim import cross_entropy

    variant = VARIANTS[cfg.variant]
    mcfg = cfg.model_config()
    if variant.impl == "hf":
        model = hf_llama(mcfg, device=device)

        def loss_fn(m, x, y):
            return cross_entropy(m(input_ids=x).logits, y)
    else:
        with torch.device(device):
            model = TransformerLM(mcfg)
        if variant.fused_loss:
            from systems.kernels.fused_linear_ce import linear_cross_entropy

            def loss_fn(m, x, y):
                # the targets are generated in range: skip the range check's device sync
                return linear_cross_entropy(m.hidden_states(x), m.lm_head.weight, y, check_targets=False)
        else:
            def loss_fn(m, x, y):
                return cross_entropy(m(x), y)
    blocks = model.model.layers if variant.impl == "hf" else model.layers
    if variant.master_weights:
        make_optimizer = functools.partial(_master_weight_optimizer, lr=cfg.lr,
                                           low_precision={id(p) for p in matmul_weights_of(model)})
    else:
        make_optimizer = functools.partial(_optimizer, variant.optimizer, lr=cfg.lr)
    if variant.optimizer_in_backward:
        from systems.train import OptimizerInBackward, block_groups

        opt = OptimizerInBackward(block_groups(model, blocks=blocks), make_optimizer=make_optimizer)
    else:
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    if variant.compile_blocks:  # after the optimizer, which may change the parameters' dtypes
        compile_blocks(blocks, mode=variant.compile_mode)
    return model, opt, loss_fn


def matmul_weights_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights autocast casts to bf16 for every use: those of our Linear layers (LM head
    included). The embedding table is indexed, not multiplied, and the norm gains scale fp32
    activations, so those stay fp32."""
    from systems.model import Linear

    return [m.weight for m in model.modules() if isinstance(m, Linear) and m.weight.requires_grad]


def _master_weight_optimizer(params: list[torch.nn.Parameter], *, lr: float, low_precision: set[int]):
    from systems.kernels.fused_adamw import MasterWeightAdamW

    return MasterWeightAdamW(params, lr=lr, low_precision=[p for p in params if id(p) in low_precision])


def _optimizer(kind: str, params: list[torch.nn.Parameter], *, lr: float) -> torch.optim.Optimizer:
    if kind == "torch_fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if kind == "fused":
        from systems.kernels.fused_adamw import FusedAdamW

        return FusedAdamW(params, lr=lr)
    if kind == "ours":
        from systems.optim import AdamW

        return AdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {kind!r}; choose one of ours, fused, torch_fused")


# ----------------------------------------------------------------------------- timing


PHASES = ("forward", "backward", "optimizer")


@contextlib.contextmanager
def _phase(name: str, *, device: torch.device, marks: DeviceMarks | None, sync_phases: bool):
    """A named profiler range; closed after a device sync when ``sync_phases`` (so a profile's CPU
    range holds its kernels), followed by a time mark of the same name."""
    with record_function(PHASE_RANGES[name]):
        yield
        if sync_phases:
            sync(device)
    if marks is not None:
        marks.mark(name)


def train_step(model, opt, loss_fn, x, y, *, device: torch.device, marks: DeviceMarks | None = None,
               sync_phases: bool = False) -> torch.Tensor:
    """forward + loss, backward, optimizer step, each a named range (and a mark in ``marks``,
    after a "start" mark); the timed steps run with ``sync_phases`` off."""
    phase = functools.partial(_phase, device=device, marks=marks, sync_phases=sync_phases)
    with record_function(STEP_RANGE):
        if marks is not None:
            marks.mark("start")
        with phase("forward"), torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model, x, y)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return loss


def measure(cfg: StepConfig, *, peak_flops: float | None = None, trace_path: str | Path | None = None) -> dict:
    """One row: step time (median, p10, p90), per-phase medians, first-step time, MFU, peak memory.

    ``trace_path``: also profile one step after the timed ones and export its Chrome trace.
    Out of memory gives a row with status "oom".
    """
    device = resolve_device(cfg.device)
    mcfg = cfg.model_config()
    tokens = cfg.batch_size * cfg.context_length
    flops = 3 * mcfg.forward_flops(cfg.batch_size, cfg.context_length)  # forward + backward (2x)
    row: dict = dict(**asdict(cfg), tokens=tokens, n_params=mcfg.n_params, step_flops=flops, status="ok",
                     **asdict(VARIANTS[cfg.variant]))
    model = opt = step = None
    if VARIANTS[cfg.variant].compile_blocks:
        # each compiled variant starts from empty compile caches (and CUDA-graph pools): its
        # first step then shows its own compile time, and no earlier variant's graphs stay alive
        torch._dynamo.reset()
    try:
        with _step_stream(VARIANTS[cfg.variant], device=device):
            torch.manual_seed(cfg.seed)
            model, opt, loss_fn = build(cfg, device=device)
            gen = torch.Generator(device=device).manual_seed(cfg.seed)
            x = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, cfg.context_length), device=device, generator=gen)
            y = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, cfg.context_length), device=device, generator=gen)
            step = functools.partial(train_step, model, opt, loss_fn, x, y, device=device)
            t0 = time.perf_counter()
            loss = step()
            sync(device)
            row["first_step_s"] = time.perf_counter() - t0
            for _ in range(cfg.warmup - 1):
                step()
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            steps = []
            for _ in range(cfg.steps):
                marks = DeviceMarks(device)
                loss = step(marks=marks)
                steps.append(marks)
                if device.type != "cuda":
                    sync(device)
            sync(device)  # the events are read once every step has finished
            starts = ("start", *PHASES[:-1])
            for phase, start in zip(PHASES, starts):
                row[f"{phase}_ms"] = statistics.median([m.ms(start, phase) for m in steps])
            row["step_ms"], row["step_ms_p10"], row["step_ms_p90"] = median_p10_p90(
                [m.ms("start", PHASES[-1]) for m in steps])
            row["loss"] = float(loss.detach())
            row["tokens_per_s"] = tokens / (row["step_ms"] * 1e-3)
            row["achieved_tflops"] = flops / (row["step_ms"] * 1e-3) / 1e12
            if peak_flops:
                row["mfu"] = flops / (row["step_ms"] * 1e-3) / peak_flops
            if device.type == "cuda":
                row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
            if trace_path is not None:
                row["trace"] = str(profile_one_step(step, device=device, trace_path=trace_path))
    except Exception as exc:  # noqa: BLE001 - an OOM point is a row; anything else propagates
        if not is_oom(exc):
            raise
        row["status"] = "oom"
    finally:
        model = opt = step = None  # step holds both: all three go before the cache is emptied
        release_memory()
    return row


def _step_stream(variant: Variant, *, device: torch.device):
    """The stream the steps run on: a high-priority one when the optimizer runs inside the backward
    (the backward's kernels then get the SMs before the side stream's updates), else the current one."""
    if not variant.optimizer_in_backward:
        return contextlib.nullcontext()
    from systems.train import priority_stream

    return priority_stream(device)


def profile_one_step(step, *, device: torch.device, trace_path: str | Path) -> Path:
    """Profile one (warm) ``step(sync_phases=True)`` with torch.profiler and export its Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=acts) as prof:
        step(sync_phases=True)
        sync(device)
    prof.export_chrome_trace(str(trace_path))
    return trace_path


def run_variants(*, model: str, variants: list[str], writer: ResultWriter | None = None,
                 peak_flops: float | None = None, trace_variant: str | None = None,
                 trace_path: str | Path | None = None, progress: bool = True, **step_kw) -> list[dict]:
    """Every variant of one model size, one row each, written as it is produced."""
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(variants, desc=f"train step ({model})", disable=not progress)
    for name in bar:
        bar.set_postfix_str(name)
        cfg = StepConfig(model=model, variant=name, **step_kw)
        row = measure(cfg, peak_flops=peak_flops, trace_path=trace_path if name == trace_variant else None)
        if writer is not None:
            writer.write(row)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- tables and figures


def step_table(rows, *, baseline: str = "hf_llama"):
    """One line per (model, variant): times, MFU, memory, and speed-up over the baseline variant."""
    import pandas as pd

    df = pd.DataFrame(rows)
    cols = ["model", "variant", "status", "step_ms", "step_ms_p10", "step_ms_p90", "forward_ms", "backward_ms",
            "optimizer_ms", "first_step_s", "achieved_tflops", "mfu", "peak_memory_gib", "tokens_per_s"]
    df = df[[c for c in cols if c in df.columns]].copy()
    if "step_ms" in df.columns:
        base = df[df["variant"] == baseline].set_index("model")["step_ms"]
        df[f"speedup_vs_{baseline}"] = df["model"].map(base) / df["step_ms"]
    return df


# (lever, variant without it, variant with it): notebook 10 credits each lever with the
# difference between the two, measured in the same run
LEVERS: tuple[tuple[str, str, str], ...] = (
    ("compiled blocks", "ours_eager", "ours_compiled"),
    ("fused LM head + loss, fused AdamW", "ours_eager", "ours_fused"),
    ("compiled blocks + fused kernels", "ours_eager", "ours_fast"),
    ("bf16 weights, fp32 masters in the optimizer", "ours_fused", "ours_fused_master"),
    ("bf16 weights, fp32 masters in the optimizer", "ours_fast", "ours_master"),
    ("CUDA graphs (per block)", "ours_master", "ours_graphs"),
    ("optimizer inside the backward", "ours_fast", "ours_overlap"),
    ("optimizer inside the backward", "ours_master", "ours_master_overlap"),
    ("optimizer inside the backward", "ours_graphs", "ours_graphs_overlap"),
)


def lever_table(table, *, levers=LEVERS):
    """One line per (model, lever) whose two variants both ran: step and phase medians before and
    after, and the milliseconds the lever saved (negative: it cost time)."""
    import pandas as pd

    ok = table[table["status"] == "ok"].set_index(["model", "variant"])
    out = []
    for model in dict.fromkeys(table["model"]):
        for lever, before, after in levers:
            if (model, before) not in ok.index or (model, after) not in ok.index:
                continue
            b, a = ok.loc[(model, before)], ok.loc[(model, after)]
            line = {"model": model, "lever": lever, "from": before, "to": after,
                    "step_ms_from": b["step_ms"], "step_ms_to": a["step_ms"], "saved_ms": b["step_ms"] - a["step_ms"]}
            for phase in PHASES:
                line[f"{phase}_ms_change"] = a[f"{phase}_ms"] - b[f"{phase}_ms"]
            out.append(line)
    return pd.DataFrame(out)


def plot_phases(table, *, title: str):
    """Stacked per-phase medians per variant, one panel per model size."""
    import matplotlib.pyplot as plt

    ok = table[table["status"] == "ok"]
    models = list(dict.fromkeys(ok["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        part = ok[ok["model"] == model]
        left = [0.0] * len(part)
        for i, phase in enumerate(("forward_ms", "backward_ms", "optimizer_ms")):
            ax.barh(part["variant"], part[phase], left=left, color=f"C{i}", label=phase.removesuffix("_ms"))
            left = [a + b for a, b in zip(left, part[phase])]
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median of each phase)")
        ax.set_title(model)
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="2.7B")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bf16 matmul rate MFU is relative to (e.g. a measured ceiling)")
    parser.add_argument("--out", default=None, help="JSON-lines results file")
    args = parser.parse_args(argv)
    try:
        rows = run_variants(model=args.model, variants=args.variants,
                            writer=ResultWriter(args.out) if args.out else None,
                            peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                            batch_size=args.batch_size, context_length=args.context_length,
                            steps=args.steps, warmup=args.warmup)
    except ValueError as exc:
        parser.error(str(exc))
    for r in rows:
        extra = f"{r['step_ms']:.1f} ms/step" if r["status"] == "ok" else r["status"]
        print(f"{r['model']:>6} {r['variant']:>14}: {extra}")
    return 0 if all(r["status"] == "ok" for r in rows) else 3


if __name__ == "__main__":
    raise SystemExit(main())
