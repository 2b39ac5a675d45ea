"""FlashAttention-2 in plain PyTorch: a tiled forward with an online softmax, and the
handout's recompute backward (equations 13-19) from the saved logsumexp L.

This is the readable reference for the Triton kernels in ``flash_triton``: the same
tiling, the same saved tensors (Q, K, V, O and one L of shape (batch..., n_queries)),
the same causal convention and the same -1e6 for masked scores.

Causal convention (every backend's, ``systems.attention.inputs``): queries are the *last*
n_queries positions of the key sequence, so query i sees keys j <= i + (n_keys - n_queries).
With n_queries > n_keys the first queries would see no key at all; that is rejected.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from systems.attention.inputs import FLOAT_DTYPES, check_inputs

MASKED_SCORE = -1e6  # the handout's value for masked scores; exp(-1e6 - m) underflows to 0
TILE_Q = 32  # query rows per tile (the handout asks for tiles of at least 16 x 16)
TILE_K = 32  # key rows per tile


def causal_mask(q_idx: torch.Tensor, k_idx: torch.Tensor, offset: int) -> torch.Tensor:
    """True where query q_idx may attend to key k_idx (bottom-right aligned)."""
    return k_idx[None, :] <= q_idx[:, None] + offset


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    # half inputs accumulate in fp32 (as the Triton kernels do); float64 stays float64 for tests
    return torch.float64 if dtype == torch.float64 else torch.float32


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                  tile_q: int = TILE_Q, tile_k: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward (handout Algorithm 1), vectorised over the leading dims.

    Returns O (..., n_q, d) in the input dtype and L (..., n_q) in fp32 (float64 for float64 inputs).
    """
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    acc_t = _accum_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    offset = n_k - n_q
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=acc_t)
    for q0 in range(0, n_q, tile_q):
        q1 = min(q0 + tile_q, n_q)
        q_tile = q[..., q0:q1, :].to(acc_t)
        q_idx = torch.arange(q0, q1, device=q.device)
        m = torch.full(q_tile.shape[:-1], -math.inf, device=q.device, dtype=acc_t)
        l = torch.zeros_like(m)
        acc = torch.zeros(q_tile.shape, device=q.device, dtype=acc_t)
        # causal: key tiles entirely after the last query's horizon contribute nothing; skip them
        k_end = min(n_k, q1 + offset) if is_causal else n_k
        for k0 in range(0, k_end, tile_k):
            k1 = min(k0 + tile_k, n_k)
            s = q_tile @ k[..., k0:k1, :].to(acc_t).transpose(-2, -1) * scale
            if is_causal and k1 - 1 > q0 + offset:  # only tiles touching the diagonal need the mask
                keep = causal_mask(q_idx, torch.arange(k0, k1, device=q.device), offset)
                s = s.masked_fill(~keep, MASKED_SCORE)
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old max
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ v[..., k0:k1, :].to(acc_t)
            m = m_new
        out[..., q0:q1, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., q0:q1] = m + torch.log(l)
    return out, lse


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute backward, handout equations 13-19 (untiled; torch.compile fuses it on GPU).

    S = Q K^T / sqrt(d); P = exp(S - L); dV = P^T dO; dP = dO V^T; D = rowsum(O * dO);
    dS = P * (dP - D); dQ = dS K / sqrt(d); dK = dS^T Q / sqrt(d).
    """
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    acc_t = _accum_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    qf, kf, vf, of, dof = (t.to(acc_t) for t in (q, k, v, o, do))
    s = qf @ kf.transpose(-2, -1) * scale
    if is_causal:
        keep = causal_mask(torch.arange(n_q, device=q.device), torch.arange(n_k, device=q.device), n_k - n_q)
        s = s.masked_fill(~keep, MASKED_SCORE)
    p = torch.exp(s - lse[..., None].to(acc_t))
    dv = p.transpose(-2, -1) @ dof
    dp = dof @ vf.transpose(-2, -1)
    delta = (of * dof).sum(dim=-1, keepdim=True)  # D = rowsum(O * dO) = rowsum(P * dP)
    ds = p * (dp - delta)
    dq = ds @ kf * scale
    dk = ds.transpose(-2, -1) @ qf * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@dataclass
class _Compiled:
    """The compiled backward, made at its first CUDA call; ``failed`` once compiling has failed."""
    fn: Callable | None = None
    failed: bool = False


_BACKWARD = _Compiled()


def backward_reference(q, k, v, o, lse, do, is_causal: bool):
    """The backward through torch.compile on CUDA, eager elsewhere or if compiling fails.

    CPU stays eager on purpose: inductor's C++ build costs tens of seconds per shape, which
    would dominate the small CPU tests this path serves there.
    """
    if q.is_cuda and not _BACKWARD.failed:
        try:
            if _BACKWARD.fn is None:
                _BACKWARD.fn = torch.compile(flash_backward, dynamic=True)
            return _BACKWARD.fn(q, k, v, o, lse, do, is_causal)
        except Exception as exc:  # a missing compiler toolchain must not break training
            warnings.warn(f"torch.compile of the flash backward failed ({type(exc).__name__}: {exc}); "
                          "using eager PyTorch")
            _BACKWARD.failed = True
    return flash_backward(q, k, v, o, lse, do, is_causal)


class FlashAttentionPytorch(torch.autograd.Function):
    """``FlashAttentionPytorch.apply(q, k, v, is_causal=False)`` on (..., seq, d) inputs."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_inputs(q, k, v, is_causal, dtypes=FLOAT_DTYPES)
        o, lse = flash_forward(q, k, v, bool(is_causal))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward_reference(q, k, v, o, lse, do, ctx.is_causal)
        return dq, dk, dv, None


def flash_attention_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Backend entry point: softmax(Q K^T / sqrt(d)) V through the tiled PyTorch FlashAttention."""
    return FlashAttentionPytorch.apply(q, k, v, is_causal)
