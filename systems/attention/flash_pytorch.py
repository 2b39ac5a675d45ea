"""FlashAttention-2 in plain PyTorch: a tiled forward with an online softmax, and the
handout's recompute backward (equations 13-19) from the saved logsumexp L.

This is the readable reference for the Triton kernels in ``flash_triton``: the same
tiling, the same saved tensors (Q, K, V, O and one L of shape (batch..., n_queries)),
the same causal convention and the same -1e6 for masked scores.

Causal convention (shared with ``naive_attention``): queries are the *last* n_queries
positions of the key sequence, so query i sees keys j <= i + (n_keys - n_queries).
With n_queries > n_keys the first queries would see no key at all; that is rejected.
"""

from __future__ import annotations

import math

import torch

MASKED_SCORE = -1e6  # the handout's value for masked scores; exp(-1e6 - m) underflows to 0
TILE_Q = 32  # query rows per tile (the handout asks for tiles of at least 16 x 16)
TILE_K = 32  # key rows per tile


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, *,
                 dtypes: tuple[torch.dtype, ...]) -> None:
    """Shape / dtype validation shared by the PyTorch and Triton versions."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be shaped (..., seq, d), got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} has dtype {t.dtype}; allowed dtypes are {allowed}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must share leading (batch) dims, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"empty sequence: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if is_causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(
            f"causal attention with more queries ({q.shape[-2]}) than keys ({k.shape[-2]}) leaves the "
            "first queries with no visible key (queries are aligned to the end of the keys)")


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


_compiled_backward = None
_compile_failed = False


def backward_reference(q, k, v, o, lse, do, is_causal: bool):
    """The backward through torch.compile on CUDA, eager elsewhere or if compiling fails.

    CPU stays eager on purpose: inductor's C++ build costs tens of seconds per shape, which
    would dominate the small CPU tests this path serves there.
    """
    global _compiled_backward, _compile_failed
    if q.is_cuda and not _compile_failed:
        try:
            if _compiled_backward is None:
                _compiled_backward = torch.compile(flash_backward, dynamic=True)
            return _compiled_backward(q, k, v, o, lse, do, is_causal)
        except Exception as exc:  # a missing compiler toolchain must not break training
            import warnings

            warnings.warn(f"torch.compile of the flash backward failed ({type(exc).__name__}: {exc}); "
                          "using eager PyTorch")
            _compile_failed = True
    return flash_backward(q, k, v, o, lse, do, is_causal)


class FlashAttentionPytorch(torch.autograd.Function):
    """``FlashAttentionPytorch.apply(q, k, v, is_causal=False)`` on (..., seq, d) inputs."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_inputs(q, k, v, is_causal, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
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
