"""Fused LM head + cross-entropy: the loss and both gradients without the (tokens, vocab) logits.

Layout of this module: helpers (constants, validation, chunk size, the PyTorch fallback of the
row kernel), the Triton row kernel and its launcher, the chunked forward, the
autograd.Function, then the public function ``linear_cross_entropy``.

How it works (the approach of Liger-Kernel's fused linear cross-entropy, written afresh):
the tokens are processed in chunks of rows. For one chunk the forward
1. computes logits = h_chunk @ W^T in the compute dtype (the autocast dtype under autocast),
2. runs one row kernel that takes the fp32 log-sum-exp of every row, writes the row's loss
   and overwrites the logits *in place* with d loss / d logits = (softmax - onehot) * scale
   (scale = 1/n_valid for "mean", 1 for "sum"),
3. multiplies that gradient straight away: grad_hidden[chunk] = dlogits @ W and
   grad_weight += dlogits^T @ h_chunk (accumulated in fp32),
and drops the chunk. The backward has nothing left to compute: it scales the two stored
gradients by grad_output. Memory: one chunk of logits (see ``default_chunk_size``) instead
of (tokens, vocab) logits, their fp32 copy and their gradient; what is kept for the backward
is grad_hidden (tokens, d) and grad_weight (vocab, d), the sizes of the inputs.

Targets equal to ``ignore_index`` (default -100, as torch's cross_entropy) contribute no loss
and no gradient, and "mean" divides by the number of the other targets.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from systems.config import check_choice
from systems.kernels.blocks import load_f32, store_as
from systems.measure.devices import triton_interpreting

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)

REDUCTIONS = ("mean", "sum")
DEFAULT_IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default
TARGET_DTYPES = (torch.int64, torch.int32)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # logits the Triton row kernel takes

# One chunk's logits take at most about this many bytes in the compute dtype. At vocab 50k in
# bf16 that is ~2.6k rows: the chunk GEMMs (rows x d x vocab) are still large enough to run
# near the tensor-core peak, and more chunks would add launches and re-reads of W for no
# memory that matters: 256 MiB is the size of the (vocab, d) weight copies and gradients
# this loss needs anyway, while the unfused loss holds the full logits of 16k tokens (1.6 GB
# in bf16) plus their fp32 copy and their gradient. The CPU fallback adds one fp32 copy of
# the chunk for 16-bit logits.
CHUNK_LOGITS_BYTES = 256 * 2**20
CHUNK_ROW_MULTIPLE = 128  # chunk rows are rounded up to whole GEMM tiles (when above one tile)

# Row kernel: one program per token row walks the vocabulary in blocks of at most this many
# columns (fp32 registers: 16 values per thread at 8 warps).
MAX_BLOCK_V = 4096
INTERPRETER_MAX_BLOCK_V = 64  # several blocks and a ragged tail at the tests' small vocabularies
ROW_KERNEL_WARPS = 8


# ----------------------------------------------------------------------------- helpers



def _row_kernel_applies(logits: torch.Tensor) -> bool:
    # float64 logits stay with the PyTorch path: the kernel computes in fp32
    return logits.dtype in KERNEL_DTYPES and (logits.is_cuda or triton_interpreting())


def default_chunk_size(n_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk: chunks of equal size whose logits take about ``CHUNK_LOGITS_BYTES``.

    Equal chunks (rather than full chunks and a small remainder) keep every chunk GEMM
    large; rounding up to ``CHUNK_ROW_MULTIPLE`` rows adds at most one tile of rows.
    """
    if n_tokens <= 0:
        return 1
    element_bytes = torch.finfo(dtype).bits // 8
    max_rows = max(1, CHUNK_LOGITS_BYTES // (vocab * element_bytes))
    n_chunks = math.ceil(n_tokens / max_rows)
    rows = math.ceil(n_tokens / n_chunks)
    if rows > CHUNK_ROW_MULTIPLE:
        rows = math.ceil(rows / CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE
    return min(rows, n_tokens)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``hidden @ weight.T`` would compute in: autocast's dtype when it is on."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype outside "
                         "autocast, as hidden @ weight.T requires; enable autocast or cast one of them")
    return hidden.dtype


def _validate(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
              chunk_size: int | None) -> None:
    check_choice("reduction", reduction, REDUCTIONS)
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (vocab, d), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., d) must end in weight's d={weight.shape[1]}, got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    check_choice("targets", targets.dtype, TARGET_DTYPES)
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"hidden, weight and targets must be on one device, got "
                         f"{hidden.device}, {weight.device}, {targets.device}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _check_target_range(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    # one device sync: an out-of-range target would make the row kernel read outside its row
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        example = int(targets[bad].flatten()[0])
        raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}; found {example}")


def _rows_torch_(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, scale: torch.Tensor,
                 ignore_index: int, write_grad: bool) -> None:
    """PyTorch version of the row kernel (CPU, float64): same outputs, one extra fp32 chunk.

    In place: sub_, exp_, scatter_add_ and mul_ act on ``x``, which *is* ``logits`` for fp32
    logits; for 16-bit logits ``x`` is their fp32 copy, copied back into ``logits`` at the end.
    """
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0).unsqueeze(1)  # ignored rows gather column 0, then drop it
    lse = torch.logsumexp(x, dim=1)
    target_logit = x.gather(1, safe_targets).squeeze(1)
    losses.copy_(torch.where(valid, lse - target_logit, 0.0))
    if not write_grad:
        return
    x.sub_(lse.unsqueeze(1)).exp_()  # softmax
    x.scatter_add_(1, safe_targets, -valid.to(x.dtype).unsqueeze(1))  # minus the one-hot of valid targets
    x.mul_((scale * valid).to(x.dtype).unsqueeze(1))  # reduction factor; ignored rows become zero
    if x is not logits:
        logits.copy_(x)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _lse_update(m_i, l_i, x):
    """Online log-sum-exp in base 2: running max m_i and sum l_i of exp2(x - m_i)."""
    m_new = tl.maximum(m_i, tl.max(x, 0))
    l_new = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(x - m_new), 0)
    return m_new, l_new


@triton.jit
def _grad_block(row_ptr, cols, target, lse2, row_scale, n_cols, MASKED: tl.constexpr):
    """Overwrite one block of logits with (softmax - onehot) * row_scale."""
    x = load_f32(row_ptr, cols, n_cols, MASKED)
    p = tl.math.exp2(x * _LOG2E - lse2)
    g = (p - (cols == target).to(tl.float32)) * row_scale
    store_as(row_ptr, g, cols, n_cols, MASKED)


@triton.jit
def _ce_rows_kernel(Logits, Targets, Losses, Scale, stride_row, n_cols, ignore_index,
                    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr):
    """Grid (rows,). One program: one token's row of logits -> its loss and, in place, its gradient.

    Reads the row twice (log-sum-exp, then the gradient) and writes it once. Full blocks run
    without masks (so 16-byte-aligned rows load with vector instructions); the ragged tail masked.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_row
    target = tl.load(Targets + row)
    valid = target != ignore_index
    offs = tl.arange(0, BLOCK_V)
    n_full = (n_cols // BLOCK_V) * BLOCK_V

    # pass 1: fp32 log-sum-exp (base 2: log2(e) folded into the logits, exp2 in the loop)
    m_i = tl.full([], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_full, BLOCK_V):
        x = tl.load(row_ptr + start + offs).to(tl.float32) * _LOG2E
        m_i, l_i = _lse_update(m_i, l_i, x)
    if n_full < n_cols:
        cols = n_full + offs
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * _LOG2E
        m_i, l_i = _lse_update(m_i, l_i, x)
    lse2 = m_i + tl.math.log2(l_i)

    # loss = logsumexp - target logit (natural log); ignored rows read column 0 and store 0
    target_logit = tl.load(row_ptr + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(Losses + row, tl.where(valid, lse2 * _LN2 - target_logit, 0.0))

    # pass 2: the gradient, in place over the logits
    if WRITE_GRAD:
        row_scale = tl.where(valid, tl.load(Scale), 0.0)
        for start in range(0, n_full, BLOCK_V):
            _grad_block(row_ptr, start + offs, target, lse2, row_scale, n_cols, False)
        if n_full < n_cols:
            _grad_block(row_ptr, n_full + offs, target, lse2, row_scale, n_cols, True)


def _ce_rows_(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, scale: torch.Tensor, *,
              ignore_index: int, write_grad: bool) -> None:
    """Per-row losses into ``losses``; with ``write_grad`` the logits become d loss / d logits, in place.

    logits (rows, vocab) with unit column stride, targets (rows,) int64, losses (rows,) fp32,
    scale a 0-d fp32 tensor (a tensor, so "mean" needs no host sync for its 1/n_valid).
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    if not _row_kernel_applies(logits):
        _rows_torch_(logits, targets, losses, scale, ignore_index, write_grad)
        return
    max_block = INTERPRETER_MAX_BLOCK_V if triton_interpreting() else MAX_BLOCK_V
    block_v = min(max_block, triton.next_power_of_2(n_cols))
    _ce_rows_kernel[(n_rows,)](logits, targets, losses, scale, logits.stride(0), n_cols, ignore_index,
                               BLOCK_V=block_v, WRITE_GRAD=write_grad, num_warps=ROW_KERNEL_WARPS)


# ----------------------------------------------------------------------------- chunked forward


def _fused_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, reduction: str,
                   chunk_size: int, ignore_index: int, compute_dtype: torch.dtype, grad_hidden_needed: bool,
                   grad_weight_needed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """hidden (n, d), weight (vocab, d), targets (n,) int64 -> loss, grad_hidden, grad_weight.

    The gradients are those of the loss itself (grad_output = 1); grad_hidden has hidden's
    dtype, grad_weight weight's dtype (summed over chunks in fp32; a single chunk's GEMM output
    is the gradient as it is). Losses, the reduction and
    grad_weight's sum are fp32 (fp64 when computing in fp64).
    """
    n_tokens, d = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.promote_types(compute_dtype, torch.float32)
    h = hidden.to(compute_dtype)  # no copy when the dtypes already agree
    w = weight.to(compute_dtype)
    valid = targets != ignore_index
    if reduction == "mean":
        scale = valid.sum(dtype=acc_dtype).reciprocal()  # 1/0 = inf: no valid target gives a nan loss, as torch
    else:
        scale = torch.ones((), dtype=acc_dtype, device=hidden.device)
    losses = torch.empty(n_tokens, dtype=acc_dtype, device=hidden.device)
    grad_h = torch.empty(n_tokens, d, dtype=hidden.dtype, device=hidden.device) if grad_hidden_needed else None
    # one chunk needs no fp32 sum: its GEMM's output is the gradient (no zeroed buffer, no add)
    one_chunk = 0 < n_tokens <= chunk_size
    grad_w = None
    if grad_weight_needed and not one_chunk:
        grad_w = torch.zeros(vocab, d, dtype=acc_dtype, device=weight.device)
    write_grad = grad_hidden_needed or grad_weight_needed

    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        h_chunk = h[start:end]
        logits = h_chunk @ w.T  # (rows, vocab) in the compute dtype: the only chunk-sized buffer
        _ce_rows_(logits, targets[start:end], losses[start:end], scale, ignore_index=ignore_index,
                  write_grad=write_grad)
        # logits now holds d loss / d logits of these rows
        if grad_h is not None:
            if grad_h.dtype == compute_dtype:
                torch.mm(logits, w, out=grad_h[start:end])
            else:
                grad_h[start:end].copy_(logits @ w)
        if grad_weight_needed and one_chunk:
            grad_w = logits.T @ h_chunk
        elif grad_w is not None:
            if compute_dtype == acc_dtype:
                grad_w.addmm_(logits.T, h_chunk)
            else:  # the 16-bit GEMM accumulates in fp32 inside; its rounded output is summed in fp32
                grad_w.add_(logits.T @ h_chunk)
        del logits  # free this chunk before the next one is allocated (else two are alive at once)

    loss = losses.sum() * scale
    if grad_w is not None and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    return loss, grad_h, grad_w


# ----------------------------------------------------------------------------- autograd.Function


class LinearCrossEntropy(torch.autograd.Function):
    """``LinearCrossEntropy.apply(hidden2d, weight, targets1d, reduction, chunk_size, ignore_index,
    compute_dtype, grad_enabled)``: the forward computes the gradients too; the backward only
    scales them. ``grad_enabled`` is the caller's grad mode (inside forward it is always off,
    and ``ctx.needs_input_grad`` ignores it): under no_grad no gradient is computed."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                chunk_size: int, ignore_index: int, compute_dtype: torch.dtype, grad_enabled: bool) -> torch.Tensor:
        # autocast off inside: the dtypes are chosen explicitly (compute_dtype for the GEMMs, fp32 LSE)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            loss, grad_h, grad_w = _fused_forward(
                hidden, weight, targets, reduction=reduction, chunk_size=chunk_size, ignore_index=ignore_index,
                compute_dtype=compute_dtype, grad_hidden_needed=grad_enabled and ctx.needs_input_grad[0],
                grad_weight_needed=grad_enabled and ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        # in place: the stored gradients are not needed again. A second backward through the
        # same graph (retain_graph=True) then fails autograd's version check instead of
        # returning twice-scaled gradients.
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_output)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_output)
        return grad_h, grad_w, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         reduction: str = "mean", chunk_size: int | None = None,
                         ignore_index: int = DEFAULT_IGNORE_INDEX, check_targets: bool = True) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets``, never holding the full logits.

    hidden (..., d) any float dtype; weight (vocab, d) (the LM head's weight, fp32 master
    weights allowed under autocast); targets (...) int64 or int32. Returns a scalar: the mean
    (over targets != ignore_index) or the sum of the per-token losses, in fp32 (fp64 for fp64
    inputs). Under autocast the GEMMs run in the autocast dtype, as an autocast
    ``hidden @ weight.T`` would; the log-sum-exp is at least fp32 always. ``chunk_size`` rows
    of logits exist at a time (default:
    ``default_chunk_size``). ``check_targets`` validates the target range at the cost of one
    device sync; a tuned training loop with known-good data can turn it off.
    """
    _validate(hidden, weight, targets, reduction, chunk_size)
    compute_dtype = _compute_dtype(hidden, weight)
    vocab, d = weight.shape
    if check_targets:
        _check_target_range(targets, vocab, ignore_index)
    hidden2 = hidden.reshape(-1, d)
    targets1 = targets.reshape(-1).to(torch.int64).contiguous()
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden2.shape[0], vocab, compute_dtype)
    return LinearCrossEntropy.apply(hidden2, weight, targets1, reduction, chunk_size, ignore_index, compute_dtype,
                                    torch.is_grad_enabled())
