"""RoPE on the fused QKV projection's output, forward and backward, one Triton pass each.

With ``ModelConfig.fused_projections`` one GEMM computes q, k and v: its output row holds q's
features, then k's, then v's. Split, reshaped into heads and with q and k rotated by PyTorch ops,
a compiled block's backward computes that GEMM's input, the gradient of the whole row, as one
Inductor kernel that concatenates dq and dk (each through RoPE's backward) and dv with masked
loads over the three regions: 46-71 us a layer on an H100 at the 2025 xl's sizes, where its
40 MB of traffic take about 13 us (docs/training_step_notes.md, entry 17). Here the backward
reads dq, dk, dv once, in whatever strides attention's backward left them, and writes the row's
gradient once (16.9 us a layer on an H200, and 1.7 ms off that model's step: entry 19); the
forward reads q's and k's features once and writes them rotated, each laid out
(batch, seq, heads, d_head) and returned as (batch, heads, seq, d_head) views, the layout the
PyTorch path hands to attention, and v as a view of the row, as that path does.

The rotation is ``systems.model.rotate_pairs``: each adjacent pair (x[2i], x[2i+1]) turned by
its angle, computed as ``x * cos + swap(x) * sin`` with the tables ``RotaryEmbedding`` keeps
(each angle's cosine twice, the sine with alternating sign); its gradient is
``dy * cos + swap(dy * sin)``. Both passes compute in fp32 and store in the input's dtype, as the
PyTorch path does. ``ModelConfig.qkv_rope_kernel`` makes the model call ``rope_qkv`` on CUDA.

Layout of this module: the kernels, their launchers, the autograd.Function, then the public
function ``rope_qkv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# elements of a program's block (rows x padded head dim): a few per thread at 4 warps, enough
# loads in flight for a memory-bound pass; on an H200 at the 2025 xl's sizes each pass took
# 16.5-16.9 us here (2.3-2.4 TB/s) and 15.6-18.1 us across 2,048-8,192 elements at 4 or 8 warps
# (docs/training_step_notes.md, entry 19)
BLOCK_ELEMENTS = 4096
NUM_WARPS = 4


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _pairs(x, ROWS: tl.constexpr, D: tl.constexpr):
    # (rows, d) -> the even places and the odd places, each (rows, d/2): the swap as a register
    # shuffle; loading x at d ^ 1 instead defeats the vectorised loads (3x slower on an H200)
    return tl.split(tl.reshape(x, (ROWS, D // 2, 2)))


@triton.jit
def _rotate(x, cos, sin_at_even, sin_at_odd, ROWS: tl.constexpr, D: tl.constexpr):
    # x * cos + swap(x) * sin in fp32, in the PyTorch path's order: (rows, d) -> (rows, d)
    even, odd = _pairs(x.to(tl.float32), ROWS, D)
    return tl.reshape(tl.join(even * cos + odd * sin_at_even, odd * cos + even * sin_at_odd), (ROWS, D))


@triton.jit
def _rope_qkv_fwd_kernel(QKV, Cos, Sin, Q, K, n_rows, seq, H: tl.constexpr, D: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # rows: (batch, seq, head) flattened; q, k out: (batch, seq, head, d_head) contiguous
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (d < D)[None, :]
    token = rows // H  # batch * seq + position
    head = rows % H
    angle = (token % seq)[:, None] * D + d[None, :]
    cos, _ = _pairs(tl.load(Cos + angle, mask=mask, other=0.0), BLOCK_ROWS, BLOCK_D)  # each cosine twice
    sin_even, sin_odd = _pairs(tl.load(Sin + angle, mask=mask, other=0.0), BLOCK_ROWS, BLOCK_D)
    src = (token * 3 * H + head)[:, None] * D + d[None, :]  # q's features in qkv's (batch, seq, 3, H, D)
    dst = rows[:, None] * D + d[None, :]
    for j in tl.static_range(2):  # q, then k: rotated
        y = _rotate(tl.load(QKV + src + j * H * D, mask=mask, other=0.0), cos, sin_even, sin_odd, BLOCK_ROWS, BLOCK_D)
        if j == 0:
            tl.store(Q + dst, y.to(Q.dtype.element_ty), mask=mask)
        else:
            tl.store(K + dst, y.to(K.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qkv_bwd_kernel(dQ, dK, dV, Cos, Sin, dQKV, n_rows, seq,
                         sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                         H: tl.constexpr, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # rows: (batch, seq, head) flattened; dq, dk, dv in: (batch, head, seq, d_head) with any strides;
    # dqkv out: (batch, seq, 3, head, d_head) contiguous
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (d < D)[None, :]
    token = rows // H
    head = rows % H
    batch = token // seq
    pos = token % seq
    angle = pos[:, None] * D + d[None, :]
    cos, _ = _pairs(tl.load(Cos + angle, mask=mask, other=0.0), BLOCK_ROWS, BLOCK_D)
    sin_even, sin_odd = _pairs(tl.load(Sin + angle, mask=mask, other=0.0), BLOCK_ROWS, BLOCK_D)
    dst = (token * 3 * H + head)[:, None] * D + d[None, :]
    # dq then dk: the gradient of x * cos + swap(x) * sin is dy * cos + swap(dy * sin), the same
    # rotation with each sine taken from the pair's other place
    q_at = dQ + (batch * sq_b + head * sq_h + pos * sq_s)[:, None] + d[None, :] * sq_d
    dx = _rotate(tl.load(q_at, mask=mask, other=0.0), cos, sin_odd, sin_even, BLOCK_ROWS, BLOCK_D)
    tl.store(dQKV + dst, dx.to(dQKV.dtype.element_ty), mask=mask)
    k_at = dK + (batch * sk_b + head * sk_h + pos * sk_s)[:, None] + d[None, :] * sk_d
    dx = _rotate(tl.load(k_at, mask=mask, other=0.0), cos, sin_odd, sin_even, BLOCK_ROWS, BLOCK_D)
    tl.store(dQKV + dst + H * D, dx.to(dQKV.dtype.element_ty), mask=mask)
    v_at = dV + (batch * sv_b + head * sv_h + pos * sv_s)[:, None] + d[None, :] * sv_d
    tl.store(dQKV + dst + 2 * H * D, tl.load(v_at, mask=mask, other=0.0).to(dQKV.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch


def _blocks(n_rows: int, d_head: int) -> tuple[int, int, int]:
    """(rows per program, padded head dim, programs)."""
    block_d = triton.next_power_of_2(d_head)
    block_rows = max(1, BLOCK_ELEMENTS // block_d)
    return block_rows, block_d, triton.cdiv(n_rows, block_rows)


def _forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int):
    b, seq, three_d = qkv.shape
    d_head = three_d // (3 * n_heads)
    qkv = qkv.contiguous()
    q, k = [torch.empty(b, seq, n_heads, d_head, device=qkv.device, dtype=qkv.dtype) for _ in range(2)]
    n_rows = b * seq * n_heads
    block_rows, block_d, programs = _blocks(n_rows, d_head)
    _rope_qkv_fwd_kernel[(programs,)](qkv, cos, sin, q, k, n_rows, seq, H=n_heads, D=d_head,
                                      BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=NUM_WARPS)
    # v is not rotated: handed on as a view of the row, as the PyTorch path does, not copied
    v = qkv.unflatten(-1, (3, n_heads, d_head))[:, :, 2]  # (b, seq, 3 d) -> (b, seq, h, d_head)
    # (b, seq, h, d_head) -> (b, h, seq, d_head) views
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    b, n_heads, seq, d_head = dq.shape
    dqkv = torch.empty(b, seq, 3 * n_heads * d_head, device=dq.device, dtype=dtype)
    n_rows = b * seq * n_heads
    block_rows, block_d, programs = _blocks(n_rows, d_head)
    _rope_qkv_bwd_kernel[(programs,)](dq, dk, dv, cos, sin, dqkv, n_rows, seq, *dq.stride(), *dk.stride(),
                                      *dv.stride(), H=n_heads, D=d_head, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
                                      num_warps=NUM_WARPS)
    return dqkv


# ----------------------------------------------------------------------------- autograd


class RopeQKV(torch.autograd.Function):
    """``rope_qkv`` through the two Triton passes (CUDA, or CPU tensors under the interpreter)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = qkv.dtype
        return _forward(qkv, cos, sin, n_heads)

    @staticmethod
    def backward(ctx, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None):
        cos, sin = ctx.saved_tensors
        present = [t for t in (dq, dk, dv) if t is not None][0]  # an output no loss reached has no gradient
        dq, dk, dv = [t if t is not None else torch.zeros_like(present) for t in (dq, dk, dv)]
        return _backward(dq, dk, dv, cos, sin, ctx.dtype), None, None, None


# ----------------------------------------------------------------------------- public


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
             n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k rotated, and v, from the fused projection's output ``qkv`` (batch, seq, 3 d_model),
    each (batch, heads, seq, d_head); ``cos``, ``sin``: fp32 (seq, d_head) tables as
    ``RotaryEmbedding.tables`` gives them. CUDA tensors (CPU ones under the Triton interpreter)."""
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * n_heads):
        raise ValueError(f"qkv must be (batch, seq, 3 * d_model) with d_model divisible by n_heads={n_heads}, "
                         f"got shape {tuple(qkv.shape)}")
    d_head = qkv.shape[-1] // (3 * n_heads)
    if cos.shape != (qkv.shape[1], d_head) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be (seq, d_head) = {(qkv.shape[1], d_head)}, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32 tables, got {cos.dtype} and {sin.dtype}")
    return RopeQKV.apply(qkv, cos.contiguous(), sin.contiguous(), n_heads)
