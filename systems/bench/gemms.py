"""The matmuls of one transformer block's training step, each timed alone.

A block's Linear layers run three GEMMs each per step: the forward ``y = x W^T``, the input
gradient ``dx = dy W`` and the weight gradient ``dW = dy^T x``, in the layouts autograd hands to
cuBLAS. At a training step's few thousand tokens some of them are too small to fill a GPU (a
1600 x 1600 weight at 2,048 tokens is about one wave of tiles on an H100), so their rate, not the
chip's peak, is what a step's matmul time is made of. This times each one alone with CUDA events
(``systems.measure.timer.time_fn``, the L2 flushed before each call), with the fused projections
(QKV as one GEMM, W1/W3 as one: ``ModelConfig.fused_projections``) beside the separate ones, so a
step's matmul time can be read shape by shape and the fusion's GEMM-side gain told apart from
what the step around it makes of it (notebook 10).

    python -m systems.bench.gemms --model xl-2025 2.7B --tokens 2048
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

import torch

from systems.bench.config import DEFAULT_OUT_ROOT, model_argument, out_file_argument
from systems.config import ModelConfig, get_config
from systems.measure.flops import FLOPS_PER_MAC
from systems.measure.results import ResultWriter
from systems.measure.timer import time_fn

PASSES = ("forward", "input_grad", "weight_grad")


@dataclass(frozen=True)
class Projection:
    """One kind of Linear in a block: its name, in and out features, and how many a block has."""

    name: str
    d_in: int
    d_out: int
    per_block: int = 1


def block_projections(cfg: ModelConfig, *, fused: bool) -> list[Projection]:
    """The Linear layers of one block of ``cfg`` (``fused``: QKV and W1/W3 as one each)."""
    d, f = cfg.d_model, cfg.d_ff
    if fused:
        return [Projection("qkv_proj", d, 3 * d), Projection("output_proj", d, d),
                Projection("w13", d, 2 * f), Projection("w2", f, d)]
    return [Projection("q/k/v_proj", d, d, per_block=3), Projection("output_proj", d, d),
            Projection("w1/w3", d, f, per_block=2), Projection("w2", f, d)]


def gemm_operands(p: Projection, pass_: str, *, tokens: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands of ``pass_`` of projection ``p`` (random, never zeros: cuBLAS runs faster
    on zeros), laid out as autograd hands them to the matmul."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    if pass_ == "forward":
        return randn(tokens, p.d_in), randn(p.d_out, p.d_in).t()  # (T, in) @ (in, out): nn.Linear's x W^T
    if pass_ == "input_grad":
        return randn(tokens, p.d_out), randn(p.d_out, p.d_in)  # dy (T, out) @ W (out, in)
    if pass_ == "weight_grad":
        return randn(tokens, p.d_out).t(), randn(tokens, p.d_in)  # dy^T (out, T) @ x (T, in): W's layout
    raise ValueError(f"pass must be one of {', '.join(PASSES)}, got {pass_!r}")


def time_gemms(cfg: ModelConfig, *, tokens: int, fused: bool, device: torch.device | str,
               dtype: torch.dtype = torch.bfloat16, peak_tflops: float | None = None,
               writer: ResultWriter | None = None) -> list[dict]:
    """One row per (projection, pass): m x k x n, FLOPs, median / p10 / p90 ms, TFLOP/s (and the
    share of ``peak_tflops``), and ``block_ms``: the GEMM times the block's count of it. Each row
    is written as soon as it exists."""
    rows = []
    for p in block_projections(cfg, fused=fused):
        for pass_ in PASSES:
            a, b = gemm_operands(p, pass_, tokens=tokens, device=device, dtype=dtype)
            flops = FLOPS_PER_MAC * tokens * p.d_in * p.d_out
            t = time_fn(lambda: torch.mm(a, b), device=device)
            row = dict(model=cfg.name, device=torch.device(device).type, n_layers=cfg.n_layers, tokens=tokens,
                       dtype=str(dtype).removeprefix("torch."), projections="fused" if fused else "separate",
                       projection=p.name, per_block=p.per_block,
                       gemm=pass_, m=a.shape[0], k=a.shape[1], n=b.shape[1], flops=flops, **t,
                       tflops=flops / (t["median_ms"] * 1e-3) / 1e12, block_ms=p.per_block * t["median_ms"])
            if peak_tflops:
                row["of_peak"] = row["tflops"] / peak_tflops
            if writer is not None:
                writer.write(row)
            rows.append(row)
            del a, b
    return rows


def run_gemms(models: Sequence[str], *, tokens: int, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
              peak_tflops: float | None = None, writer: ResultWriter | None = None) -> list[dict]:
    """``time_gemms`` for every preset in ``models``, separate projections, then fused."""
    return [row for name in models for fused in (False, True)
            for row in time_gemms(get_config(name), tokens=tokens, fused=fused, device=device, dtype=dtype,
                                  peak_tflops=peak_tflops, writer=writer)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.gemms", description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", type=model_argument, default=["xl-2025", "2.7B"])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per step (batch x context)")
    parser.add_argument("--out", type=out_file_argument, default=f"{DEFAULT_OUT_ROOT}/gemms/gemms.jsonl",
                        help="JSON-lines results file (default %(default)s)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this times cuBLAS's bf16 GEMMs: it needs a CUDA GPU")
    if args.tokens < 1:
        parser.error(f"--tokens must be positive, got {args.tokens}")
    from systems.measure.hardware import measure_matmul_tflops

    peak = measure_matmul_tflops()
    print(f"bf16 matmul peak (8192^3): {peak:.0f} TFLOP/s")
    try:
        rows = run_gemms(args.model, tokens=args.tokens, device="cuda", peak_tflops=peak,
                         writer=ResultWriter(args.out))
    except (KeyError, ValueError) as exc:
        parser.error(str(exc))
    for r in rows:
        print(f"{r['model']:>8} {r['projection']:>12} {r['gemm']:>11}  {r['m']:>6} x {r['k']:>6} x {r['n']:>6}"
              f"  {r['median_ms'] * 1e3:7.1f} us  {r['tflops']:5.0f} TFLOP/s ({r['of_peak']:.0%})")
    print(f"rows in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
