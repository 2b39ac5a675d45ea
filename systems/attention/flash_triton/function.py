"""The autograd.Function around the kernels: ``FlashAttentionTriton.apply(q, k, v, is_causal=False,
variant=None)``."""

from __future__ import annotations

import torch

from systems.attention.inputs import check_inputs
from systems.attention.flash_triton.launch import DEFAULT_VARIANT, FlashVariant, flash_backward_triton, flash_forward_triton
from systems.attention.flash_triton.tuning import INTERPRETING

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    check_inputs(q, k, v, is_causal, dtypes=SUPPORTED_DTYPES)
    if not q.is_cuda and not INTERPRETING:
        raise ValueError(f"FlashAttentionTriton needs CUDA tensors, got device {q.device}; "
                         "set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is outside the supported range {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")


class FlashAttentionTriton(torch.autograd.Function):
    """``FlashAttentionTriton.apply(q, k, v, is_causal=False, variant=None)`` on (..., seq, d).

    Saves Q, K, V, O (contiguous, in the input's shape) and L of shape (..., n_queries). ``variant``:
    a FlashVariant naming the forward and backward kernels; None is the default, FlashVariant().

    No reshapes or views on the way: at short sequences the host's time per call, not the kernels',
    sets the speed, and a view of a custom Function's output costs autograd more than an allocation.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                variant: FlashVariant | None = None) -> torch.Tensor:
        validate_inputs(q, k, v, is_causal)
        variant = DEFAULT_VARIANT if variant is None else variant
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # copies only what is strided
        o, lse = flash_forward_triton(q, k, v, bool(is_causal), variant=variant)
        # L has the input's leading dims, (..., n_queries): the shape the handout's tests look for
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.variant = bool(is_causal), variant
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.to(q.dtype).contiguous()
        dq, dk, dv = flash_backward_triton(q, k, v, o, lse, do, ctx.is_causal, variant=ctx.variant)
        return dq, dk, dv, None, None
