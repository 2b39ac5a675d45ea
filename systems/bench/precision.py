"""Mixed precision, measured: accumulation error, autocast dtypes, LayerNorm sensitivity, BF16 speed.

Four experiments for the handout's ``mixed_precision_accumulation`` and
``benchmarking_mixed_precision`` questions:

- ``accumulation_experiment()``: the handout's loops (sum 0.01 a thousand times) in fp32, fp16,
  fp32 += fp16 and fp32 += fp16-cast-to-fp32, plus the bf16 variants; absolute error vs 10.0.
- ``ToyModel`` and ``probe_autocast_dtypes()``: the dtypes a real forward and backward under
  autocast produce, read by module hooks, tensor hooks and a dispatch-level op recorder.
- ``layernorm_sensitivity()``: LayerNorm statistics computed in fp16 / bf16 / fp32 against an
  fp64 reference, across activation magnitudes (fp16 overflows and underflows; bf16 does not,
  but keeps 8 mantissa bits).
- ``precision_sweep_configs()``: the harness sweep of bf16 autocast against fp32 for forward,
  forward+backward and the train step.

Their tables, figures and answer text are ``systems.report.mixed_precision``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from systems.bench.benchmark import MODES, BenchmarkConfig
from systems.config import check_choice, get_config
from systems.measure.devices import dtype_name, dtype_of

# ----------------------------------------------------------------------------- 1. accumulation


@dataclass(frozen=True)
class AccumulationCase:
    """``s = tensor(0, accumulator); for _ in range(n): s += tensor(0.01, increment)[.to(cast_to)]``"""

    label: str
    accumulator: str
    increment: str
    cast_to: str | None = None  # cast the increment explicitly before adding


# The handout's four loops first, then the same shapes with bf16 in place of fp16.
ACCUMULATION_CASES: tuple[AccumulationCase, ...] = (
    AccumulationCase("fp32 += fp32", "fp32", "fp32"),
    AccumulationCase("fp16 += fp16", "fp16", "fp16"),
    AccumulationCase("fp32 += fp16", "fp32", "fp16"),
    AccumulationCase("fp32 += fp16.to(fp32)", "fp32", "fp16", cast_to="fp32"),
    AccumulationCase("bf16 += bf16", "bf16", "bf16"),
    AccumulationCase("fp32 += bf16", "fp32", "bf16"),
    AccumulationCase("fp32 += bf16.to(fp32)", "fp32", "bf16", cast_to="fp32"),
)


def accumulate(case: AccumulationCase, *, n: int = 1000, value: float = 0.01) -> float:
    """Run one loop exactly as the handout writes it (a fresh scalar tensor every iteration)."""
    s = torch.tensor(0, dtype=dtype_of(case.accumulator))
    for _ in range(n):
        x = torch.tensor(value, dtype=dtype_of(case.increment))
        if case.cast_to is not None:
            x = x.type(dtype_of(case.cast_to))
        s += x  # in-place: the sum stays in the accumulator's dtype whatever x is
    return float(s)


def accumulation_experiment(cases: Sequence[AccumulationCase] = ACCUMULATION_CASES, *, n: int = 1000,
                            value: float = 0.01) -> pd.DataFrame:
    """One row per loop: the result, its absolute error against n * value, and how much of that
    error the increment's own rounding explains (n * (stored increment - value))."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    target = n * value
    rows = []
    for case in cases:
        result = accumulate(case, n=n, value=value)
        stored = float(torch.tensor(value, dtype=dtype_of(case.increment)))
        rows.append({
            "loop": case.label,
            "accumulator": case.accumulator,
            "increment": case.increment,
            "explicit_cast": case.cast_to is not None,
            "stored_increment": stored,
            "result": result,
            "abs_error": abs(result - target),
            "error_from_increment_rounding": abs(n * (stored - value)),
        })
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- 2. autocast dtypes


class ToyModel(nn.Module):
    """The handout's toy model: fc1 -> ReLU -> LayerNorm -> fc2, from torch.nn layers."""

    def __init__(self, in_features: int, out_features: int, hidden: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        return self.fc2(x)


class _OpRecorder:
    """Records (module label, aten op, input dtypes, output dtypes) for every op dispatched.

    A TorchDispatchMode sits below the autocast dispatch key, so it sees the ops autocast
    actually runs: the casts it inserts and the dtypes the matmul and layer_norm kernels get.
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self
        self.label: str | None = None
        self.ops: list[dict] = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outs = out if isinstance(out, (tuple, list)) else (out,)
                recorder.ops.append({
                    "module": recorder.label,
                    "op": func.overloadpacket.__name__,
                    "inputs": [dtype_name(a.dtype) for a in args if isinstance(a, torch.Tensor)],
                    "outputs": [dtype_name(o.dtype) for o in outs if isinstance(o, torch.Tensor)],
                })
                return out

        self.mode = _Mode()

    def first(self, module: str, op: str) -> dict | None:
        return next((r for r in self.ops if r["module"] == module and r["op"] == op), None)


def autocast_device() -> str:
    """'cuda' when a GPU is present, else 'cpu' (CPU autocast has its own op lists)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def probe_autocast_dtypes(autocast_dtype: str = "bf16", *, device: str | None = None, batch: int = 8,
                          in_features: int = 20, out_features: int = 5, seed: int = 0) -> pd.DataFrame:
    """One forward and backward of ToyModel under autocast; the dtype of every quantity the
    handout asks about, each read from the tensors the run produced.

    Returns a tidy table: device, autocast, quantity, dtype, probe (how it was observed).
    An op the device's autocast cannot run in that dtype raises; callers decide how to report it.
    """
    if autocast_dtype not in ("bf16", "fp16"):
        raise ValueError(f"autocast_dtype must be 'bf16' or 'fp16', got {autocast_dtype!r}")
    device = device or autocast_device()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch.cuda.is_available() is False")
    torch.manual_seed(seed)
    model = ToyModel(in_features, out_features).to(device)
    x = torch.randn(batch, in_features, device=device)
    y = torch.randint(0, out_features, (batch,), device=device)

    seen: dict[str, torch.dtype] = {}
    recorder = _OpRecorder()
    handles = []
    for name in ("fc1", "relu", "ln", "fc2"):
        module = getattr(model, name)

        def pre(mod, args, name=name):
            recorder.label = name

        def post(mod, args, out, name=name):
            recorder.label = None
            seen[f"{name} output"] = out.dtype
            # a tensor hook on the activation: the dtype of the gradient flowing back into it
            if out.requires_grad:
                out.register_hook(lambda g, name=name: seen.__setitem__(f"grad of {name} output", g.dtype))

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    for pname, p in model.named_parameters():
        handles.append(p.register_hook(lambda g, pname=pname: seen.__setitem__(f"grad {pname} (hook)", g.dtype)))

    rows = []

    def row(quantity: str, dtype, probe: str) -> None:
        rows.append({"device": device, "autocast": autocast_dtype, "quantity": quantity,
                     "dtype": dtype if isinstance(dtype, str) or dtype is None else dtype_name(dtype),
                     "probe": probe})

    try:
        with torch.autocast(device_type=device, dtype=dtype_of(autocast_dtype)):
            for pname, p in model.named_parameters():
                row(f"parameter {pname}", p.dtype, "param.dtype read inside autocast")
            with recorder.mode:
                logits = model(x)
                loss = F.cross_entropy(logits, y)
        loss.backward()
    finally:
        for h in handles:
            h.remove()

    mm = recorder.first("fc1", "mm") or recorder.first("fc1", "addmm") or recorder.first("fc1", "linear")
    if mm is not None:
        row("fc1 matmul operands (x, weight)", "/".join(mm["inputs"][-2:]), f"dispatch: aten.{mm['op']} inputs")
    row("fc1 output", seen.get("fc1 output"), "forward hook")
    row("ReLU output", seen.get("relu output"), "forward hook")
    ln_op = recorder.first("ln", "native_layer_norm")
    if ln_op is not None:
        row("LayerNorm kernel input", ln_op["inputs"][0], "dispatch: aten.native_layer_norm input")
        # native_layer_norm returns (output, mean, rstd): the saved statistics show the
        # precision the kernel normalises in, whatever dtype it hands back
        if len(ln_op["outputs"]) == 3:
            row("LayerNorm saved mean / rstd", "/".join(ln_op["outputs"][1:]),
                "dispatch: aten.native_layer_norm outputs")
    row("LayerNorm output", seen.get("ln output"), "forward hook")
    row("logits (fc2 output)", logits.dtype, "returned tensor")
    row("loss", loss.dtype, "returned tensor")
    row("grad of logits", seen.get("grad of fc2 output"), "tensor hook")
    row("grad of fc1 output", seen.get("grad of fc1 output"), "tensor hook")
    for pname, p in model.named_parameters():
        row(f"grad {pname}", p.grad.dtype if p.grad is not None else None, "param.grad after backward")
    return pd.DataFrame(rows)


def probe_all(dtypes: Iterable[str] = ("fp16", "bf16"), *, device: str | None = None) -> pd.DataFrame:
    """probe_autocast_dtypes for each dtype; a dtype the device's autocast rejects becomes rows
    with dtype None and the error in 'probe' (what actually happened, not what was hoped)."""
    frames = []
    device = device or autocast_device()
    for dt in dtypes:
        try:
            frames.append(probe_autocast_dtypes(dt, device=device))
        except (RuntimeError, NotImplementedError) as exc:
            frames.append(pd.DataFrame([{"device": device, "autocast": dt, "quantity": "(whole probe)",
                                         "dtype": None, "probe": f"failed: {str(exc).splitlines()[0][:200]}"}]))
    return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------- 3. LayerNorm


FP16_MAX = float(torch.finfo(torch.float16).max)

# How the statistics are computed in the low-precision dtype:
# - "sum_sq": var = sum(x^2)/d - mean^2 with the sum stored in the dtype (a hand-written one-pass
#   kernel, or RMSNorm done naively): the sum of d squares overflows first.
# - "two_pass": var = mean((x - mean)^2), each intermediate in the dtype.
# - "torch_kernel": F.layer_norm on the low-precision tensor: the real kernel, which accumulates
#   in fp32 internally; only the input and output are rounded.
LN_METHODS = ("sum_sq", "two_pass", "torch_kernel")


def _layernorm_lowp(x: torch.Tensor, method: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised output, variance), every intermediate in x's dtype unless method says otherwise."""
    d = x.shape[-1]
    if method == "torch_kernel":
        # native_layer_norm also returns the statistics it normalised with (kept in fp32)
        y, _, rstd = torch.native_layer_norm(x, (d,), None, None, eps)
        return y, (rstd.double().pow(-2) - eps).squeeze(-1)
    mean = x.sum(dim=-1, keepdim=True) / d
    if method == "sum_sq":
        var = (x * x).sum(dim=-1, keepdim=True) / d - mean * mean
    elif method == "two_pass":
        var = ((x - mean) * (x - mean)).sum(dim=-1, keepdim=True) / d
    else:
        raise ValueError(f"method must be one of {LN_METHODS}, got {method!r}")
    y = (x - mean) / torch.sqrt(var + eps)
    return y, var.squeeze(-1)


def layernorm_sensitivity(*, scales: Sequence[float] | None = None, d: int = 1024, rows: int = 64,
                          mean_to_std: Sequence[float] = (0.0, 10.0), dtypes: Sequence[str] = ("fp16", "bf16", "fp32"),
                          methods: Sequence[str] = LN_METHODS, eps: float = 1e-5, seed: int = 0) -> pd.DataFrame:
    """LayerNorm statistics in low precision against an fp64 reference, across magnitudes.

    Activations x = scale * (z + mean_to_std) with z ~ N(0, 1), shape (rows, d), drawn in fp64 and
    rounded once into each dtype. Reported per (dtype, method, scale, mean_to_std):
    nonfinite_frac (rows whose variance or output holds inf/nan), var_rel_err (median over finite rows of
    |var - var_ref| / var_ref), out_max_err (max |y - y_ref| of the normalised output, inf when any
    is non-finite), and input_rel_err (the rounding of x itself, median |x - x_ref| / |x_ref|).
    """
    if scales is None:
        scales = [float(s) for s in np.logspace(-4, 4, 17)]
    for m in methods:
        check_choice("method", m, LN_METHODS)
    for dt in dtypes:
        dtype_of(dt)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    out = []
    for offset in mean_to_std:
        for scale in scales:
            x64 = scale * (z + offset)
            var_ref = x64.var(dim=-1, unbiased=False)
            y_ref = F.layer_norm(x64, (d,), eps=eps)
            for dt in dtypes:
                xl = x64.to(dtype_of(dt))
                input_err = ((xl.double() - x64).abs() / x64.abs().clamp_min(1e-300)).median().item()
                for method in methods:
                    y, var = _layernorm_lowp(xl, method, eps)
                    var, y = var.double(), y.double()
                    finite = torch.isfinite(var)
                    rel = ((var - var_ref).abs() / var_ref)[finite]
                    y_err = (y - y_ref).abs()
                    bad_rows = ~finite | ~torch.isfinite(y).all(dim=-1)
                    out.append({
                        "dtype": dt, "method": method, "scale": scale, "mean_to_std": offset, "d": d,
                        "max_abs_x": x64.abs().max().item(),
                        "ref_sum_sq": (x64 * x64).sum(dim=-1).max().item(),
                        "nonfinite_frac": bad_rows.double().mean().item(),
                        "var_rel_err": rel.median().item() if rel.numel() else float("inf"),
                        "out_max_err": y_err.max().item() if torch.isfinite(y_err).all() else float("inf"),
                        "input_rel_err": input_err,
                    })
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- 4. bf16 vs fp32 sweep


def precision_sweep_configs(sizes: Sequence[str], *, modes: Sequence[str] = MODES,
                            precisions: Sequence[str] = ("fp32", "bf16"), context_length: int = 512,
                            batch_size: int = 4, steps: dict[str, tuple[int, int]] | None = None,
                            default_steps: tuple[int, int] = (5, 10), device: str = "auto",
                            model_overrides: dict | None = None, attn_impl: str = "naive") -> list[BenchmarkConfig]:
    """The harness configurations for precision x mode x size, the sizes in the order given (the
    handouts' tables list them smallest first).

    ``steps`` maps a size to (warmup_steps, measure_steps), so the big sizes can take fewer;
    within a size and mode, fp32 and bf16 run back to back so they see the same machine state.
    Sizes that do not fit are left in: the harness records them as status 'oom'.
    """
    if not sizes:
        raise ValueError("sizes must name at least one model size")
    for m in modes:
        check_choice("mode", m, MODES)
    for size in sizes:
        get_config(size)  # unknown names fail here, before anything runs
    steps = steps or {}
    configs = []
    for size in sizes:
        warmup, measure = steps.get(size, default_steps)
        for mode in modes:
            for precision in precisions:
                configs.append(BenchmarkConfig(model=size, model_overrides=dict(model_overrides or {}),
                                               context_length=context_length, batch_size=batch_size,
                                               warmup=warmup, steps=measure, mode=mode,
                                               precision=precision, device=device, attn_impl=attn_impl))
    return configs


