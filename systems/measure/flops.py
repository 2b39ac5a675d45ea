"""The one FLOP convention of the workbook (model FLOPs, as MFU counts them).

- A multiply-add is 2 FLOPs, and only matrix products are counted: elementwise work, softmax
  and norms are a few percent of a step and do not run on the tensor cores.
- Attention counts Q K^T and P V over the (query, key) pairs its mask keeps. Causal attention
  keeps the bottom-right-aligned triangle (query i of n_q sees keys j <= i + n_k - n_q), so T
  queries over T keys keep T (T + 1) / 2 pairs: about half of the T^2 products. Kernels that skip
  the masked tiles do about that much work; a naive implementation that computes the full
  matrix and masks it afterwards does more than is counted (``executed`` below counts that).
- The backward pass costs ``BACKWARD_FACTOR`` = 2 forward passes: each product's gradient is
  two products of the same size, one per input. Recomputation is not counted, neither
  activation checkpointing's second forward nor FlashAttention's recomputed Q K^T in its
  backward: a step's FLOPs are the same whatever it recomputes, and MFU divides them by time.
"""

from __future__ import annotations

from systems.config import ModelConfig, check_choice

FLOPS_PER_MAC = 2
BACKWARD_FACTOR = 2
PASSES = ("fwd", "bwd", "fwd_bwd")
SOFTMAX_FLOPS_PER_ELEMENT = 5  # a row softmax: max, subtract, exp, sum, divide


def attention_pairs(n_q: int, n_k: int, *, causal: bool) -> int:
    """(query, key) pairs attention computes products for, per (batch, head)."""
    if not causal:
        return n_q * n_k
    if n_q > n_k:
        raise ValueError(f"causal attention with more queries ({n_q}) than keys ({n_k}) leaves queries "
                         "with no visible key")
    offset = n_k - n_q  # query i sees keys 0 .. i + offset
    return n_q * (offset + 1) + n_q * (n_q - 1) // 2


def pass_factor(pass_: str) -> int:
    """Forward passes' worth of FLOPs in a pass: fwd 1, bwd BACKWARD_FACTOR, fwd_bwd both."""
    check_choice("pass", pass_, PASSES)
    return {"fwd": 1, "bwd": BACKWARD_FACTOR, "fwd_bwd": 1 + BACKWARD_FACTOR}[pass_]


def attention_flops(*, batch: int, heads: int, n_q: int, n_k: int, d: int, causal: bool,
                    pass_: str = "fwd", executed: bool = False) -> int:
    """Q K^T and P V FLOPs of one attention call. ``executed=True`` counts every pair even when
    causal, as an implementation that masks the full score matrix computes them."""
    pairs = n_q * n_k if executed else attention_pairs(n_q, n_k, causal=causal)
    forward = 2 * FLOPS_PER_MAC * batch * heads * pairs * d
    return forward * pass_factor(pass_)


def softmax_flops(*, batch: int, heads: int, n_q: int, n_k: int) -> int:
    """FLOPs of a row softmax over the full (n_q, n_k) score matrix."""
    return SOFTMAX_FLOPS_PER_ELEMENT * batch * heads * n_q * n_k


def model_flops(cfg: ModelConfig, *, batch: int, seq: int, pass_: str = "fwd") -> int:
    """FLOPs of the Transformer LM on (batch, seq) tokens: the block projections (Q, K, V and
    output: 4 d^2; SwiGLU: 3 d d_ff per token), causal attention, and the LM head."""
    tokens = batch * seq
    d, f = cfg.d_model, cfg.d_ff
    projections = FLOPS_PER_MAC * tokens * (4 * d * d + 3 * d * f)
    attention = attention_flops(batch=batch, heads=cfg.n_heads, n_q=seq, n_k=seq, d=cfg.d_head, causal=True)
    head = FLOPS_PER_MAC * tokens * d * cfg.vocab_size
    return (cfg.n_layers * (projections + attention) + head) * pass_factor(pass_)


def train_step_flops(cfg: ModelConfig, *, batch: int, seq: int) -> int:
    """A training step's FLOPs: forward and backward (the optimizer's elementwise update is not counted)."""
    return model_flops(cfg, batch=batch, seq=seq, pass_="fwd_bwd")
