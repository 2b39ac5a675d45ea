"""Attention backends behind one switch: ``attention(q, k, v, is_causal, impl=...)``.

Every backend takes q shaped (..., n_queries, d_head) and k, v shaped (..., n_keys, d_head), and
returns (..., n_queries, d_head). Every backend checks its inputs the same way
(``systems.attention.inputs.check_inputs``: one-line ValueErrors) and masks causally the same way
(bottom-right aligned: with fewer queries than keys the queries are the last positions), so the
backends give one result for one input.
"""

from __future__ import annotations

from typing import Callable

import torch

from systems.attention.flash_pytorch import FlashAttentionPytorch, flash_attention_pytorch
from systems.attention.inputs import check_inputs
from systems.attention.naive import naive_attention, sdpa_attention

AttentionFn = Callable[..., torch.Tensor]


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """The Triton FlashAttention-2 backend, through its custom ops (flash_triton/op.py: opaque to
    torch.compile, and nameable by a selective checkpoint); imported on first use so a machine
    without triton can still import systems.attention (and use the other backends)."""
    from systems.attention.flash_triton.op import flash_attention_op

    return flash_attention_op(q, k, v, is_causal=is_causal)


__all__ = ["BACKENDS", "AttentionFn", "FlashAttentionPytorch", "attention", "check_inputs",
           "flash_attention_pytorch", "flash_attention_triton", "get_backend", "naive_attention",
           "sdpa_attention"]

BACKENDS: dict[str, AttentionFn] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash_pytorch": flash_attention_pytorch,
    "flash_triton": flash_attention_triton,
}


def __getattr__(name: str):
    # FlashAttentionTriton lives behind a lazy import: `import triton` is slow and optional
    if name == "FlashAttentionTriton":
        from systems.attention.flash_triton import FlashAttentionTriton

        return FlashAttentionTriton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_backend(impl: str) -> AttentionFn:
    if impl not in BACKENDS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[impl]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *, impl: str = "naive") -> torch.Tensor:
    return get_backend(impl)(q, k, v, is_causal=is_causal)
