"""A Linear whose weight is updated inside its weight-gradient matmul: dW = dy^T x and AdamW on W
in one Triton kernel, whose epilogue reads and writes the optimizer's state of the tile it has
just computed, so that dW is never written to memory.

Why: in a training step with fp32 masters the update is memory-bound (26 bytes per parameter
with split masters) and the weight-gradient matmuls are compute-bound; run one after the other
their times add up, and on a side stream the update hides only partly under the backward
(docs/training_step_notes.md, entries 4, 5 and 21: each stretches the other). Inside one kernel
a program's epilogue (memory) runs beside another program's main loop (tensor cores) on the same
SM, and the gradient's own write and read (4 bytes per parameter) are gone.

Layout: the kernel, its tiles, the launch (``wgrad_adamw_``), the ``autograd.Function``, then the
one public function the model's seam takes, ``linear_with_update``.

The arithmetic is the autocast step's with split fp32 masters (``MasterWeightAdamW(split_masters=
True)``): the matmul accumulates in fp32, its result is rounded to the activations' dtype (the
gradient autocast's bf16 matmul returns), then ``fused_adamw.adamw_math`` updates the fp32 master
joined from its halves (the bf16 weight and the int16 low bits) and splits it back. The step's
scalars (learning rate, bias corrections) are read from a device tensor laid out as
``fused_adamw.step_scalars`` makes it, so a captured step replays with each step's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from systems.kernels.fused_adamw import adamw_math, join_bits, split_bits

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _wgrad_adamw_kernel(DY, X, W, Low, M, V, Scalars, n_tokens, n_out, n_in,
                        BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP: tl.constexpr, EVEN: tl.constexpr):
    """Grid (tiles of the weight,). One program: a BLOCK_OUT x BLOCK_IN tile of dW = dy^T x
    (dy (n_tokens, n_out) and x (n_tokens, n_in), row-major), rounded to dy's dtype, then AdamW
    on that tile of the split master: W its bf16 high half (as int16), Low its int16 low half,
    M and V the fp32 moments, all (n_out, n_in) row-major. EVEN: every dimension is a multiple
    of its block (no masks)."""
    pid = tl.program_id(0)
    tiles_out = tl.cdiv(n_out, BLOCK_OUT)
    tiles_in = tl.cdiv(n_in, BLOCK_IN)
    # GROUP rows of tiles walked column by column: programs that run together share dy's and x's
    # blocks in L2
    per_group = GROUP * tiles_in
    first = (pid // per_group) * GROUP
    rows_here = tl.minimum(tiles_out - first, GROUP)
    pid_out = first + (pid % per_group) % rows_here
    pid_in = (pid % per_group) // rows_here
    rows = pid_out * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    cols = pid_in * BLOCK_IN + tl.arange(0, BLOCK_IN)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_OUT, BLOCK_IN), dtype=tl.float32)
    for k in range(0, n_tokens, BLOCK_K):
        tokens = k + ks
        dy_ptrs = DY + tokens[:, None] * n_out + rows[None, :]  # (BLOCK_K, BLOCK_OUT): dy^T's tile, transposed
        x_ptrs = X + tokens[:, None] * n_in + cols[None, :]  # (BLOCK_K, BLOCK_IN)
        if EVEN:
            a = tl.load(dy_ptrs)
            b = tl.load(x_ptrs)
        else:
            a = tl.load(dy_ptrs, mask=(tokens[:, None] < n_tokens) & (rows[None, :] < n_out), other=0.0)
            b = tl.load(x_ptrs, mask=(tokens[:, None] < n_tokens) & (cols[None, :] < n_in), other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    # the gradient the bf16 matmul under autocast would return, widened again for the update
    g = acc.to(DY.dtype.element_ty).to(tl.float32)
    offs = rows[:, None] * n_in + cols[None, :]  # (BLOCK_OUT, BLOCK_IN) into the weight
    mask = (rows[:, None] < n_out) & (cols[None, :] < n_in)
    if EVEN:
        p = join_bits(tl.load(W + offs), tl.load(Low + offs))
        m = tl.load(M + offs)
        v = tl.load(V + offs)
    else:
        p = join_bits(tl.load(W + offs, mask=mask, other=0), tl.load(Low + offs, mask=mask, other=0))
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
    p, m, v = adamw_math(p, g, m, v, tl.load(Scalars + 0), tl.load(Scalars + 1), tl.load(Scalars + 2),
                         tl.load(Scalars + 3), tl.load(Scalars + 4), tl.load(Scalars + 5), tl.load(Scalars + 6))
    high, low = split_bits(p)
    if EVEN:
        tl.store(W + offs, high)
        tl.store(Low + offs, low)
        tl.store(M + offs, m)
        tl.store(V + offs, v)
    else:
        tl.store(W + offs, high, mask=mask)
        tl.store(Low + offs, low, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)


# ----------------------------------------------------------------------------- tiles


@dataclass(frozen=True)
class WgradTile:
    """The kernel's tile of the weight (rows x columns), its step along the tokens, warps,
    pipeline stages and the rows of tiles walked together (L2 reuse)."""

    block_out: int = 128
    block_in: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8

    def __post_init__(self) -> None:
        for name in ("block_out", "block_in", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"WgradTile.{name} must be a power of two, got {value}")
        if min(self.block_out, self.block_in, self.block_k) < 16:
            raise ValueError(f"WgradTile's blocks must be at least 16 (the tensor cores' step), got {self}")
        if self.num_stages < 1 or self.group < 1:
            raise ValueError(f"WgradTile.num_stages and .group must be positive, got {self}")

    @classmethod
    def parse(cls, text: str) -> "WgradTile":
        """'128x128x64/8w3s' -> block_out x block_in x block_k, 8 warps, 3 stages."""
        try:
            blocks, rest = text.lower().split("/")
            block_out, block_in, block_k = (int(b) for b in blocks.split("x"))
            warps, stages = rest.rstrip("s").split("w")
            return cls(block_out=block_out, block_in=block_in, block_k=block_k, num_warps=int(warps),
                       num_stages=int(stages))
        except ValueError as exc:
            raise ValueError(f"a weight-gradient tile is OUTxINxK/<warps>w<stages>s, e.g. 128x128x64/8w3s; "
                             f"got {text!r} ({exc})") from None

    def label(self) -> str:
        return f"{self.block_out}x{self.block_in}x{self.block_k}/{self.num_warps}w{self.num_stages}s"


TILE = WgradTile()


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class WeightUpdate:
    """What the kernel updates besides the weight: its split master's low half (int16), the fp32
    moments, all of the weight's shape, and the step's scalars on the device
    (``fused_adamw.step_scalars``), which may be shared by many weights."""

    low: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    scalars: torch.Tensor
    tile: WgradTile = TILE


def wgrad_adamw_(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, update: WeightUpdate) -> None:
    """The weight-gradient matmul of ``y = x @ weight.T`` (dy and x: (tokens, out) and (tokens,
    in), bf16 or fp16) and the AdamW step of ``weight`` (bf16, (out, in), a split master's high
    half) with that gradient, in place, in one kernel launch on the current stream."""
    n_tokens, n_out = dy.shape
    n_in = x.shape[1]
    if dy.dtype not in ACTIVATION_DTYPES or x.dtype != dy.dtype:
        raise ValueError(f"wgrad_adamw_: dy and x must share a dtype among {ACTIVATION_DTYPES}, "
                         f"got {dy.dtype} and {x.dtype}")
    if x.shape[0] != n_tokens or tuple(weight.shape) != (n_out, n_in) or weight.dtype != torch.bfloat16:
        raise ValueError(f"wgrad_adamw_: dy (tokens, out), x (tokens, in) and a bf16 weight (out, in) expected, "
                         f"got {tuple(dy.shape)}, {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    state = (update.low, update.exp_avg, update.exp_avg_sq)
    if (update.low.dtype != torch.int16 or update.exp_avg.dtype != torch.float32
            or update.exp_avg_sq.dtype != torch.float32 or any(t.shape != weight.shape for t in state)):
        raise ValueError("wgrad_adamw_: the update's low half must be int16 and its moments fp32, each of the "
                         "weight's shape (MasterWeightAdamW(split_masters=True)'s state)")
    if not all(t.is_contiguous() for t in (dy, x, weight, *state)):
        raise ValueError("wgrad_adamw_: every tensor must be contiguous")
    if max(dy.numel(), x.numel(), weight.numel()) >= 2**31:
        raise ValueError("wgrad_adamw_: the kernel indexes with 32-bit offsets; a tensor has 2**31 elements or more")
    tile = update.tile
    even = n_tokens % tile.block_k == 0 and n_out % tile.block_out == 0 and n_in % tile.block_in == 0
    grid = (triton.cdiv(n_out, tile.block_out) * triton.cdiv(n_in, tile.block_in),)
    _wgrad_adamw_kernel[grid](dy, x, weight.view(torch.int16), update.low, update.exp_avg, update.exp_avg_sq,
                              update.scalars, n_tokens, n_out, n_in, BLOCK_OUT=tile.block_out,
                              BLOCK_IN=tile.block_in, BLOCK_K=tile.block_k, GROUP=tile.group, EVEN=even,
                              num_warps=tile.num_warps, num_stages=tile.num_stages)


# ----------------------------------------------------------------------------- autograd


class _LinearWithUpdate(torch.autograd.Function):
    """y = x @ W^T; the backward returns dx and updates W in place (no gradient for W)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, update: WeightUpdate) -> torch.Tensor:
        # the bf16 operand autocast would make of x; kept for the weight gradient
        x = x.to(weight.dtype)
        ctx.save_for_backward(x, weight)
        ctx.update = update
        return x @ weight.T

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dy = dy.to(weight.dtype)
        # dx first: it reads the weight before the update below rewrites it (same stream, in order)
        dx = dy @ weight
        wgrad_adamw_(dy.reshape(-1, dy.shape[-1]).contiguous(),  # (..., out) -> (tokens, out)
                     x.reshape(-1, x.shape[-1]).contiguous(),  # (..., in) -> (tokens, in)
                     weight, ctx.update)
        return dx, None, None


def linear_with_update(x: torch.Tensor, weight: torch.Tensor, update: WeightUpdate) -> torch.Tensor:
    """``x @ weight.T`` in ``weight``'s dtype, whose backward computes dx and, instead of the
    weight's gradient, applies the optimizer step ``update`` describes to ``weight`` (in place,
    during the backward). The weight gets no ``.grad``: a step that uses this must not also hand
    the weight to an optimizer, and must run one backward per forward."""
    return _LinearWithUpdate.apply(x, weight, update)
