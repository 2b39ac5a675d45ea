"""Reference attention paths: the handout's annotated naive implementation and torch SDPA.

Both check their inputs as the FlashAttention backends do (``systems.attention.inputs``) and
share their causal convention: the mask is aligned to the bottom-right corner of the score
matrix, so with fewer queries than keys the queries are the last positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from systems.attention.inputs import check_inputs


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V on inputs shaped (..., seq, d).

    The three steps carry named ranges so profiles (torch.profiler, or NVTX under
    nsys via emit_nvtx) can attribute kernels to them.
    """
    check_inputs(q, k, v, is_causal)
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    with record_function("attention scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (..., n_q, n_k)
        if is_causal:
            # queries are the last n_q positions when n_q < n_k (decoding convention)
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
            scores = scores.masked_fill(~mask, float("-inf"))
    with record_function("softmax"):
        probs = torch.softmax(scores, dim=-1)
    with record_function("final matmul"):
        return probs @ v  # (..., n_q, d)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """torch's fused scaled_dot_product_attention; it picks flash / cuDNN / efficient / math itself.

    torch's ``is_causal`` aligns the mask to the top-left corner; with n_queries != n_keys the
    bottom-right mask of the other backends is torch's lower-right causal bias instead. With equal
    lengths the two coincide and ``is_causal=True`` keeps SDPA's fast path.
    """
    check_inputs(q, k, v, is_causal)
    n_q, n_k = q.shape[-2], k.shape[-2]
    with record_function("sdpa"):
        if is_causal and n_q != n_k:
            from torch.nn.attention.bias import causal_lower_right

            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n_q, n_k))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
