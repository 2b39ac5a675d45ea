"""FlashAttention-2 in Triton: one forward and two backwards (split, or one kernel with atomic dQ),
each forward and split kernel also reading through TMA descriptors.

The package reads in this order:
- kernels.py: the @triton.jit helpers, program bodies and kernels (what makes them fast is in
  its docstring);
- tuning.py: the config tables and pruners, the autotuners around the kernels, and the store
  that persists their choices across processes;
- launch.py: the variant choice (FlashVariant), the plan cache and the direct launch of compiled
  kernels, the launchers, and the forward and backward passes;
- function.py: the autograd.Function, FlashAttentionTriton;
- op.py: the same passes as torch.library custom ops, which models call (torch.compile and
  selective checkpointing see an op, not a Function's launches).

``flash_attention_triton`` is the entry point; the other names are for the tools and tests that
time or check the kernels one by one (systems.bench.flash_tuning).
"""

from __future__ import annotations

import torch

from systems.attention.flash_triton.function import FlashAttentionTriton
from systems.attention.flash_triton.launch import (
    DEFAULT_VARIANT,
    FP32_DOTS,
    TMA_MIN_SEQ,
    FlashVariant,
    LaunchPath,
    auto_prefers_tma,
    clear_tuned_plans,
    dot_precision,
    flash_backward_triton,
    flash_forward_triton,
    launch_atomic,
    launch_backward_atomic,
    launch_bwd_prep,
    launch_dkdv,
    launch_dq,
    launch_forward,
    launch_path,
    launch_recipes,
    tma_usable,
    tuned_plans,
)


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                           variant: FlashVariant = DEFAULT_VARIANT) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V with the Triton FlashAttention-2 kernels; inputs (..., seq, d).
    ``variant``: which forward and backward kernels run (FlashVariant; the default is the fastest
    measured)."""
    return FlashAttentionTriton.apply(q, k, v, is_causal, variant)


__all__ = ["FP32_DOTS", "FlashAttentionTriton", "FlashVariant", "LaunchPath", "TMA_MIN_SEQ", "auto_prefers_tma",
           "clear_tuned_plans",
           "dot_precision", "flash_attention_triton", "flash_backward_triton", "flash_forward_triton", "launch_atomic",
           "launch_backward_atomic", "launch_bwd_prep", "launch_dkdv", "launch_dq", "launch_forward", "launch_path",
           "launch_recipes", "tma_usable", "tuned_plans"]
