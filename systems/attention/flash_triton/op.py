"""The kernels as torch.library custom ops: ``torch.ops.systems.flash_attention_forward`` and
``..._backward``, tied together by ``register_autograd``.

The autograd.Function (function.py) is what the handout's tests call; these ops are what a model
inside torch.compile or a selective activation checkpoint calls. Both see only dispatcher ops: a
Function's Triton launches are invisible to them, so a checkpoint policy cannot keep its output
(it would recompute the whole attention in the backward) and Dynamo has to trace into it. An op is
one opaque node with a fake (shape-only) implementation, and a policy can name it.

The ops run the default FlashVariant, the fastest measured.
"""

from __future__ import annotations

import torch

from systems.attention.flash_triton.function import validate_inputs
from systems.attention.flash_triton.launch import flash_backward_triton, flash_forward_triton

# systems.parallel.checkpoint.SAVED_OPS names it too (without importing triton); the checkpoint test
# in tests/attention/test_flash_triton_op.py fails if the two part
FORWARD_OP = "systems::flash_attention_forward"


@torch.library.custom_op(FORWARD_OP, mutates_args=())
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (like q) and L (q's shape without its last dim, fp32) for contiguous q (..., n_q, d), k, v
    (..., n_k, d)."""
    validate_inputs(q, k, v, is_causal)
    return flash_forward_triton(q, k, v, is_causal)


@flash_attention_forward.register_fake
def _forward_fake(q, k, v, is_causal):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("systems::flash_attention_backward", mutates_args=())
def flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                             do: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (like q, k, v) from the forward's saved tensors and the output's gradient."""
    return flash_backward_triton(q, k, v, o, lse, do.to(q.dtype).contiguous(), is_causal)


@flash_attention_backward.register_fake
def _backward_fake(q, k, v, o, lse, do, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, is_causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal


def _backward(ctx, do, _dlse):
    # L is a by-product the loss never reads: its gradient (None or zeros) is ignored
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, ctx.is_causal)
    return dq, dk, dv, None


flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V through the custom ops; inputs (..., seq, d), output like q."""
    # made contiguous out here, so the forward's saved inputs are the tensors its kernels read
    return flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), bool(is_causal))[0]
