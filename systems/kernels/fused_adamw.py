"""Fused AdamW: one Triton kernel launch updates a whole bucket of parameters in one pass.

Layout of this module: helpers (constants, split masters' halves, buckets, launch tables, the
PyTorch fallback), the kernel, then the optimizer classes ``FusedAdamW`` and ``MasterWeightAdamW``.

The update is ``systems.optim.AdamW``'s, operation for operation (decoupled decay first,
torch's lerp for the first moment, sqrt and divisions rounded to nearest as torch's are):

    p *= 1 - lr * wd;  m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Per element the kernel reads p, g, m, v once and writes p, m, v (and optionally a bf16/fp16
copy of the new p) once, in fp32 registers whatever the storage dtypes; the unfused optimizer
makes eight passes. A split fp32 master (``MasterWeightAdamW(split_masters=True)``) is read and
written as its two 16-bit halves, the model's bf16 weight and an int16 low part. One launch
covers every parameter of a bucket (same device, group, step count and dtypes): a table of
their addresses is passed to the kernel, and each program finds its tensor and block through a
block -> tensor map (multi-tensor apply, as apex and torch's fused optimizers do), so a model of
hundreds of tensors costs a launch or two, not hundreds. CPU tensors (outside
TRITON_INTERPRET=1) take a torch._foreach_* fallback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import triton
import triton.language as tl

from systems.kernels.blocks import load, load_f32, store_as
from systems.measure.devices import triton_interpreting
from systems.optim import AdamW, adamw_foreach_, advance_state, closure_loss

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # parameter and gradient dtypes the kernel takes
COPY_DTYPES = (torch.bfloat16, torch.float16)  # low-precision copies
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Elements per program and warps: 4 elements per thread, one 16-byte vector of each fp32 tensor and
# an 8-byte one of each 16-bit tensor. On one H200 the split-master update ran at 4.14 TB/s
# against 3.63 with 8 per thread (2048 x 8 warps) and 4.28 for a copy of the same bytes
# (docs/training_step_notes.md, entry 22; ``python -m systems.bench.fused --adamw-tiles ...``).
BLOCK = 1024
NUM_WARPS = 8
ALIGN_BYTES = 16  # the kernel tells the compiler addresses are 16-byte aligned when they all are
# columns of the address table: param, grad, exp_avg, exp_avg_sq, the copy or, for a split
# master, its low half (0 when neither; a split master's param column holds its bf16 high half),
# and a gradient addend (0 without one; ``FusedAdamW.fold_gradients``)
N_POINTERS = 6
LOW_BITS = "master_low_bits"  # the state key of a split master's low half (int16)
# the kernels' views of the two (jit'ed code reads module globals only as constexprs)
_ALIGN_BYTES = tl.constexpr(ALIGN_BYTES)
_N_POINTERS = tl.constexpr(N_POINTERS)


# ----------------------------------------------------------------------------- helpers


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 tensor as (its bf16 rounding to nearest even, the int16 rest): the bit patterns
    satisfy ``bits(master) = (bits(high) << 16) + low`` (new contiguous tensors), except that a
    tie rounded down (low 16 bits 0x8000, even high half), whose rest 0x8000 is one past int16,
    keeps 0x7FFF: the master one fp32 ulp smaller in magnitude, with the same rounding. The
    kernel's ``_split_bits`` is the same arithmetic."""
    bits = master.contiguous().view(torch.int32)
    # rounding acts on the magnitude bits, laid out for a negative value as for a positive one
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    low = (bits - (high << 16)).clamp_max_(0x7FFF)
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join_master(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor whose halves ``split_master`` gave (a new tensor)."""
    bits = (high.view(torch.int16).to(torch.int32) << 16) + low.to(torch.int32)
    return bits.view(torch.float32)


@dataclass(frozen=True)
class _Scalars:
    """One bucket's step scalars, computed in Python doubles as systems.optim.AdamW does."""

    decay: float  # 1 - lr * wd
    lerp_weight: float  # 1 - beta1
    beta2: float
    one_minus_beta2: float
    step_size: float  # lr / (1 - beta1^t)
    bias_correction2_sqrt: float  # sqrt(1 - beta2^t)
    eps: float

    def as_tensor(self) -> torch.Tensor:
        """The kernel's ``Scalars`` (capturable optimizers), rounded to fp32 as scalar arguments are."""
        return torch.tensor([self.decay, self.lerp_weight, self.beta2, self.one_minus_beta2, self.step_size,
                             self.bias_correction2_sqrt, self.eps], dtype=torch.float32)

    @classmethod
    def of(cls, group: dict, step: int) -> "_Scalars":
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        return cls(decay=1 - lr * wd, lerp_weight=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                   step_size=lr / (1 - beta1**step), bias_correction2_sqrt=math.sqrt(1 - beta2**step), eps=eps)


@dataclass
class _Bucket:
    """Parameters updated by one launch (or one round of foreach calls)."""

    group: dict  # the param group: lr, betas, eps, weight_decay
    step: int
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    copies: list[torch.Tensor] | None  # all or none: whether a copy is written is a compile-time flag
    lows: list[torch.Tensor] | None  # split masters (all or none): their low halves; params are the high halves
    addends: list[torch.Tensor] | None = None  # all or none: the update reads grad_scale * (grad + addend)
    grad_scale: float = 1.0
    slot: tuple = ()  # what identifies the bucket from step to step: its key without the step count


def _kernel_applies(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    copy: torch.Tensor | None, low: torch.Tensor | None, addend: torch.Tensor | None = None) -> bool:
    # the kernel indexes flat memory, so every tensor must be dense and in row-major order,
    # and it reads the moments in the master's dtype: the parameter's, or fp32 for a split one
    master_dtype = p.dtype if low is None else torch.float32
    tensors = [t for t in (p, g, m, v, copy, low, addend) if t is not None]
    return ((p.is_cuda or triton_interpreting()) and p.dtype in KERNEL_DTYPES and g.dtype in KERNEL_DTYPES
            and m.dtype == v.dtype == master_dtype and all(t.is_contiguous() for t in tensors))


@dataclass(frozen=True)
class _BlockMap:
    """Which tensor and which block of it each program updates (depends on the numels only)."""

    numels: torch.Tensor  # (tensors,) int64
    first_block: torch.Tensor  # (tensors,) int64: the program that starts each tensor
    block_tensor: torch.Tensor  # (programs,) int32: the tensor of each program
    n_blocks: int


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _DeviceTables:
    """Moves the kernel's launch tables (host tensors) to the device. Outside a CUDA-graph capture
    each is copied at once, from pinned memory without blocking (a pageable copy would make the
    host wait for the queued backward). Inside one no host-to-device copy is issued (its host
    buffer would have to outlive the graph): each table is a slice of an arena reserved before
    the capture (``reserve``) and is written by ``fill()`` once the capture has ended. Not a
    tensor of the graph's own pool: the pool hands a capture blocks that earlier captured kernels
    used and freed, and a replay would run those kernels over the table before reading it."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._arena: torch.Tensor | None = None  # int64 slots on the device
        self._used = 0

    def reserve(self, slots: int, device: torch.device) -> None:
        self._arena, self._used = torch.empty(slots, dtype=torch.int64, device=device), 0

    def __call__(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return host
        if _capturing():
            slots = -(-host.numel() * host.element_size() // 8)
            if self._arena is None or self._used + slots > self._arena.numel():
                raise RuntimeError("FusedAdamW: the captured step's launch tables do not fit the room reserved for "
                                   "them: call prepare_capture() right before capturing, after an eager step of the "
                                   "same parameters")
            out = self._arena[self._used:self._used + slots].view(host.dtype)[:host.numel()].view(host.shape)
            self._used += slots
            self.pending.append((out, host))
            return out
        return host.pin_memory().to(device, non_blocking=True)

    def fill(self) -> None:
        for out, host in self.pending:
            out.copy_(host)
        self.pending, self._arena = [], None  # the tables keep their slices of the arena alive


def _block_map(numels: tuple[int, ...], device: torch.device, to_device: _DeviceTables, block: int) -> _BlockMap:
    blocks = torch.tensor([triton.cdiv(n, block) for n in numels], dtype=torch.int64)
    first_block = torch.cumsum(blocks, 0) - blocks
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    return _BlockMap(numels=to_device(torch.tensor(numels, dtype=torch.int64), device),
                     first_block=to_device(first_block, device), block_tensor=to_device(block_tensor, device),
                     n_blocks=int(blocks.sum()))


def _address_table(addresses: tuple[int, ...], device: torch.device, to_device: _DeviceTables) -> torch.Tensor:
    return to_device(torch.tensor(addresses, dtype=torch.int64).view(-1, N_POINTERS), device)


def _foreach_step(bucket: _Bucket) -> None:
    """The PyTorch fallback: systems.optim.AdamW's multi-tensor update, then the copies (or, for
    split masters, the update of masters joined for the step, split back into their halves)."""
    split = bucket.lows is not None
    masters = [join_master(p, low) for p, low in zip(bucket.params, bucket.lows)] if split else bucket.params
    grads = bucket.grads
    if bucket.addends is not None:  # summed in fp32, as the kernel does, then scaled
        grads = [(g.float() + a.float()) * bucket.grad_scale for g, a in zip(grads, bucket.addends)]
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(masters, grads)]
    adamw_foreach_(masters, grads, bucket.exp_avgs, bucket.exp_avg_sqs, group=bucket.group, step=bucket.step)
    if split:
        halves = [split_master(master) for master in masters]
        torch._foreach_copy_(bucket.params, [high for high, _ in halves])
        torch._foreach_copy_(bucket.lows, [low for _, low in halves])
    if bucket.copies is not None:
        torch._foreach_copy_(bucket.copies, bucket.params)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _pointer(address, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = address.to(tl.pointer_type(DTYPE))
    if ALIGNED:  # lets full blocks use 16-byte vector loads and stores
        ptr = tl.multiple_of(ptr, _ALIGN_BYTES)
    return ptr


@triton.jit
def _join_bits(high, low):
    """split_master's inverse on int16 halves: the fp32 whose bits are (high << 16) + low."""
    return ((high.to(tl.int32) << 16) + low.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _split_bits(x):
    """split_master's arithmetic on a block: (bf16 rounding to nearest even, rest) as int16 bits.
    Integer arithmetic, not a conversion: the interpreter's fp32 -> bf16 truncates."""
    bits = x.to(tl.int32, bitcast=True)
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # the rest is in [-0x8000, 0x8000]; 0x8000 (a tie rounded down) keeps 0x7FFF, one ulp less
    low = tl.minimum(bits - (high << 16), 0x7FFF)
    return high.to(tl.int16), low.to(tl.int16)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, a_ptr, offs, numel, grad_scale,
                 decay, lerp_weight, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps,
                 HAS_COPY: tl.constexpr, SPLIT: tl.constexpr, HAS_ADDEND: tl.constexpr, MASKED: tl.constexpr):
    if SPLIT:
        p = _join_bits(load(p_ptr, offs, numel, MASKED), load(c_ptr, offs, numel, MASKED))
    else:
        p = load_f32(p_ptr, offs, numel, MASKED)
    g = load_f32(g_ptr, offs, numel, MASKED)
    if HAS_ADDEND:  # the other ranks' gradients, summed here instead of in a pass of their own
        g = (g + load_f32(a_ptr, offs, numel, MASKED)) * grad_scale
    m = load_f32(m_ptr, offs, numel, MASKED)
    v = load_f32(v_ptr, offs, numel, MASKED)
    p = p * decay  # decoupled decay acts on the pre-update weights
    # torch's lerp(m, g, w): m + w (g - m) for w < 0.5, else g - (g - m)(1 - w) (exact at w = 1)
    m = tl.where(lerp_weight < 0.5, m + lerp_weight * (g - m), g - (g - m) * (1.0 - lerp_weight))
    v = v * beta2 + one_minus_beta2 * g * g
    # sqrt and divisions rounded to nearest as torch's (tl.sqrt and / may be approximate on GPUs)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    if SPLIT:
        high, low = _split_bits(p)
        store_as(p_ptr, high, offs, numel, MASKED)
        store_as(c_ptr, low, offs, numel, MASKED)
    else:
        store_as(p_ptr, p, offs, numel, MASKED)
    store_as(m_ptr, m, offs, numel, MASKED)
    store_as(v_ptr, v, offs, numel, MASKED)
    if HAS_COPY:
        store_as(c_ptr, p, offs, numel, MASKED)


@triton.jit
def _adamw_kernel(Addresses, Numels, FirstBlock, BlockTensor, Scalars, grad_scale,
                  decay, lerp_weight, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps,
                  PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, COPY_DTYPE: tl.constexpr,
                  HAS_COPY: tl.constexpr, SPLIT: tl.constexpr, HAS_ADDEND: tl.constexpr, ALIGNED: tl.constexpr,
                  SCALARS_IN_MEMORY: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (blocks of all tensors,). One program: BLOCK elements of one tensor of the bucket.

    PARAM_DTYPE: the master's dtype, which the moments share. SPLIT (not with HAS_COPY): every
    master is fp32 split in two int16 halves, the bf16 high half in the param column and the low
    half in the copy column (``split_master``). HAS_ADDEND: the gradient is grad_scale * (grad +
    addend), the addend (in the gradient's dtype) in the sixth column. SCALARS_IN_MEMORY: the
    step's scalars (decay to eps) are read from ``Scalars`` (fp32, in that order) instead of the
    arguments, so that a CUDA graph which captured the launch sees each step's values
    (``FusedAdamW(capturable=True)``)."""
    if SCALARS_IN_MEMORY:
        decay = tl.load(Scalars + 0)
        lerp_weight = tl.load(Scalars + 1)
        beta2 = tl.load(Scalars + 2)
        one_minus_beta2 = tl.load(Scalars + 3)
        step_size = tl.load(Scalars + 4)
        bias_correction2_sqrt = tl.load(Scalars + 5)
        eps = tl.load(Scalars + 6)
    pid = tl.program_id(0)
    t = tl.load(BlockTensor + pid).to(tl.int64)
    numel = tl.load(Numels + t)
    start = (pid - tl.load(FirstBlock + t)) * BLOCK
    row = Addresses + t * _N_POINTERS
    g_ptr = _pointer(tl.load(row + 1), GRAD_DTYPE, ALIGNED)
    m_ptr = _pointer(tl.load(row + 2), PARAM_DTYPE, ALIGNED)
    v_ptr = _pointer(tl.load(row + 3), PARAM_DTYPE, ALIGNED)
    if SPLIT:
        p_ptr = _pointer(tl.load(row + 0), tl.int16, ALIGNED)
        c_ptr = _pointer(tl.load(row + 4), tl.int16, ALIGNED)
    else:
        p_ptr = _pointer(tl.load(row + 0), PARAM_DTYPE, ALIGNED)
        c_ptr = p_ptr
        if HAS_COPY:
            c_ptr = _pointer(tl.load(row + 4), COPY_DTYPE, ALIGNED)
    a_ptr = g_ptr
    if HAS_ADDEND:
        a_ptr = _pointer(tl.load(row + 5), GRAD_DTYPE, ALIGNED)
    offs = start + tl.arange(0, BLOCK)
    # full blocks unmasked (the masks of a runtime numel would keep loads scalar), the tail masked
    if start + BLOCK <= numel:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, a_ptr, offs, numel, grad_scale, decay, lerp_weight, beta2,
                     one_minus_beta2, step_size, bias_correction2_sqrt, eps, HAS_COPY, SPLIT, HAS_ADDEND, False)
    else:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, a_ptr, offs, numel, grad_scale, decay, lerp_weight, beta2,
                     one_minus_beta2, step_size, bias_correction2_sqrt, eps, HAS_COPY, SPLIT, HAS_ADDEND, True)


# ----------------------------------------------------------------------------- optimizer


class FusedAdamW(AdamW):
    """``systems.optim.AdamW`` with a fused Triton update, optionally writing low-precision copies.

    ``low_precision_copies`` maps parameters to bf16/fp16 tensors of their shape; after each
    step a copy holds ``param.to(copy.dtype)``, written by the same kernel pass (``attach_copy``
    adds one later). The state (``step``, ``exp_avg``, ``exp_avg_sq``) is laid out as AdamW's,
    so state dicts move between the two; the copies are not part of the state. A parameter whose
    state also holds ``LOW_BITS`` is the bf16 high half of a split fp32 master (fp32 moments):
    ``MasterWeightAdamW(split_masters=True)`` makes those.

    ``fold_gradients(addends, scale)``: from then on the update of a parameter with an addend
    reads the gradient ``scale * (grad + addend)``, summed in fp32 in the same kernel pass. A
    data-parallel wrapper that lands the other ranks' gradients in persistent buffers
    (``systems.parallel.peer.DDPPeer``) averages them here, with no pass of its own.

    ``capturable``: the step may be captured in a CUDA graph (``systems.train.GraphedStep``). The
    kernel then reads the step's scalars (learning rate, bias corrections) from device memory
    instead of its arguments, which a graph would freeze at their capture-time values: an eager
    step writes them before its launch; a captured step advances no step count and writes
    nothing, and ``prepare_replay()``, called before each replay, advances the counts of the
    parameters the captured step updates and writes their scalars (learning-rate changes in the
    param groups included). A step can be captured only after an eager one (the moments exist),
    and only through the kernel (CUDA tensors, contiguous).

    ``block``, ``num_warps``: the kernel's elements per program and warps (a power of two, at least
    one element per thread); the defaults are the fastest measured (``BLOCK``'s comment).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *,
                 low_precision_copies: dict[torch.Tensor, torch.Tensor] | None = None, capturable: bool = False,
                 block: int = BLOCK, num_warps: int = NUM_WARPS):
        if num_warps < 1 or block & (block - 1) or num_warps & (num_warps - 1) or block < 32 * num_warps:
            raise ValueError(f"FusedAdamW: block and num_warps must be powers of two with block >= 32 * num_warps "
                             f"(one element per thread at least), got block={block}, num_warps={num_warps}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.capturable = capturable
        self.block, self.num_warps = block, num_warps
        self._copies: dict[torch.Tensor, torch.Tensor] = {}
        # launch tables of the last step, reused while addresses and sizes stay the same
        self._tables: dict[tuple, torch.Tensor] = {}
        self._block_maps: dict[tuple, _BlockMap] = {}
        self._addends: dict[int, torch.Tensor] = {}  # id(the model's parameter) -> its gradient addend
        self._grad_scale = 1.0
        self._to_device = _DeviceTables()
        self._scalars: dict[tuple, torch.Tensor] = {}  # capturable: each bucket's scalars on the device
        # the captured step's buckets, and the launch tables its kernels read (kept alive with the graph)
        self._captured: list[_Bucket] | None = None
        self._captured_tables: tuple[dict, dict] = ({}, {})
        for param, copy in (low_precision_copies or {}).items():
            self.attach_copy(param, copy)

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy and pickle carry the optimizer's state only: no copies, empty caches
        super().__setstate__(state)
        self.__dict__.setdefault("_copies", {})
        self.__dict__.setdefault("_tables", {})
        self.__dict__.setdefault("_block_maps", {})
        self.__dict__.setdefault("_addends", {})
        self.__dict__.setdefault("_grad_scale", 1.0)
        self.__dict__.setdefault("capturable", False)
        self.__dict__.setdefault("block", BLOCK)
        self.__dict__.setdefault("num_warps", NUM_WARPS)
        self.__dict__.setdefault("_to_device", _DeviceTables())
        self.__dict__.setdefault("_scalars", {})
        self.__dict__.setdefault("_captured", None)
        self.__dict__.setdefault("_captured_tables", ({}, {}))

    @torch.no_grad()
    def attach_copy(self, param: torch.Tensor, copy: torch.Tensor) -> None:
        """From now on every step writes ``param.to(copy.dtype)`` into ``copy`` (written once now)."""
        if not any(p is param for group in self.param_groups for p in group["params"]):
            raise ValueError("attach_copy: the parameter is not in this optimizer's param_groups")
        if copy.dtype not in COPY_DTYPES:
            raise ValueError(f"attach_copy: the copy's dtype must be one of {COPY_DTYPES}, got {copy.dtype}")
        if copy.shape != param.shape or copy.device != param.device:
            raise ValueError(f"attach_copy: the copy must match the parameter's shape {tuple(param.shape)} and "
                             f"device {param.device}, got {tuple(copy.shape)} on {copy.device}")
        if not copy.is_contiguous():
            raise ValueError("attach_copy: the copy must be contiguous")
        if LOW_BITS in self.state.get(param, {}):
            raise ValueError("attach_copy: the parameter is a split master's high half, which has no copies; "
                             "copy the parameter itself")
        copy.copy_(param)
        self._copies[param] = copy

    def _model_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model's tensor behind ``p`` of the param groups, which carries the gradient
        (``MasterWeightAdamW``'s masters stand for the model's bf16 parameters)."""
        return p

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient the update of ``p`` reads."""
        return self._model_param(p).grad

    @torch.no_grad()
    def fold_gradients(self, addends: dict[torch.Tensor, torch.Tensor] | None, scale: float = 1.0) -> None:
        """From the next step on, update each parameter of ``addends`` (the model's parameters)
        with ``scale * (param.grad + addends[param])``; ``None`` goes back to plain gradients.
        The addends are read at every step: they must stay allocated (and be written before the
        step, on its stream) while folded. Each must match its parameter's shape and device, be
        contiguous, and share the gradient's dtype."""
        if addends is None:
            self._addends, self._grad_scale = {}, 1.0
            return
        mine = {id(self._model_param(p)) for group in self.param_groups for p in group["params"]}
        for param, addend in addends.items():
            if id(param) not in mine:
                raise ValueError(f"fold_gradients: a parameter of shape {tuple(param.shape)} is not updated by this "
                                 "optimizer")
            if addend.shape != param.shape or addend.device != param.device or not addend.is_contiguous():
                raise ValueError(f"fold_gradients: an addend must be a contiguous tensor of its parameter's shape "
                                 f"{tuple(param.shape)} on {param.device}, got {tuple(addend.shape)} on "
                                 f"{addend.device}")
        self._addends = {id(param): addend for param, addend in addends.items()}
        self._grad_scale = float(scale)

    def _buckets(self, *, advance: bool = True) -> tuple[list[_Bucket], list[_Bucket]]:
        """Advance every stepped parameter's count (unless ``advance`` is False: a captured step,
        whose counts ``prepare_replay`` advances); group them into (kernel buckets, foreach buckets)."""
        kernel, fallback = {}, {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("FusedAdamW does not support sparse gradients")
                addend = self._addends.get(id(self._model_param(p)))
                if addend is not None and addend.dtype != grad.dtype:  # before any state advances
                    raise ValueError(f"fold_gradients: an addend is {addend.dtype}, its gradient {grad.dtype}: "
                                     "give addends in the gradients' dtype")
                if advance:
                    state = advance_state(self.state[p], p)
                elif not self.state[p]:
                    raise RuntimeError("FusedAdamW: a step is captured only after an eager one (which creates the "
                                       "moments); run one step before capturing")
                else:
                    state = self.state[p]
                copy, low = self._copies.get(p), state.get(LOW_BITS)
                use_kernel = _kernel_applies(p, grad, state["exp_avg"], state["exp_avg_sq"], copy, low, addend)
                key = (index, state["step"], p.device, p.dtype, grad.dtype,
                       copy.dtype if copy is not None else None, low is not None, addend is not None)
                buckets = kernel if use_kernel else fallback
                if key not in buckets:
                    buckets[key] = _Bucket(group=group, step=state["step"], params=[], grads=[],
                                           exp_avgs=[], exp_avg_sqs=[], copies=[] if copy is not None else None,
                                           lows=[] if low is not None else None,
                                           addends=[] if addend is not None else None, grad_scale=self._grad_scale,
                                           slot=key[:1] + key[2:])
                b = buckets[key]
                b.params.append(p)
                b.grads.append(grad)
                b.exp_avgs.append(state["exp_avg"])
                b.exp_avg_sqs.append(state["exp_avg_sq"])
                if copy is not None:
                    b.copies.append(copy)
                if low is not None:
                    b.lows.append(low)
                if addend is not None:
                    b.addends.append(addend)
        return list(kernel.values()), list(fallback.values())

    def _launch(self, bucket: _Bucket, tables: dict, block_maps: dict, *, capturing: bool = False) -> None:
        p0 = bucket.params[0]
        # the fifth column: the copies or the split masters' low halves (address 0 for neither)
        fifth = bucket.copies if bucket.copies is not None else bucket.lows
        fifth = fifth if fifth is not None else [None] * len(bucket.params)
        sixth = bucket.addends if bucket.addends is not None else [None] * len(bucket.params)
        addresses = tuple(a for p, g, m, v, c, add in zip(bucket.params, bucket.grads, bucket.exp_avgs,
                                                          bucket.exp_avg_sqs, fifth, sixth)
                          for a in (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                                    c.data_ptr() if c is not None else 0, add.data_ptr() if add is not None else 0))
        map_key = (p0.device, tuple(p.numel() for p in bucket.params))
        block_map = self._block_maps.get(map_key)
        if block_map is None:
            block_map = _block_map(map_key[1], p0.device, self._to_device, self.block)
        table = self._tables.get(addresses)
        if table is None:
            table = _address_table(addresses, p0.device, self._to_device)
        block_maps[map_key], tables[addresses] = block_map, table
        if block_map.n_blocks == 0:
            return
        s = _Scalars.of(bucket.group, bucket.step)
        scalars = table  # any pointer: read only with SCALARS_IN_MEMORY
        if self.capturable:
            scalars = self._scalars.get(bucket.slot)
            if scalars is None:
                if capturing:  # allocated in the graph's pool, it could share a block with earlier kernels
                    raise RuntimeError("FusedAdamW: the captured step updates a bucket that no eager step has: "
                                       "capture only after an eager step of the same parameters")
                scalars = self._scalars[bucket.slot] = torch.empty(7, dtype=torch.float32, device=p0.device)
            if not capturing:  # a captured step's scalars are written by prepare_replay
                self._write_scalars(bucket, s)
        copy_dtype = bucket.copies[0].dtype if bucket.copies is not None else torch.bfloat16  # unused without copies
        _adamw_kernel[(block_map.n_blocks,)](
            table, block_map.numels, block_map.first_block, block_map.block_tensor, scalars, bucket.grad_scale,
            s.decay, s.lerp_weight, s.beta2, s.one_minus_beta2, s.step_size, s.bias_correction2_sqrt, s.eps,
            # the master's dtype is the moments' (a split master's param is its bf16 high half)
            PARAM_DTYPE=_TL_DTYPES[bucket.exp_avgs[0].dtype], GRAD_DTYPE=_TL_DTYPES[bucket.grads[0].dtype],
            COPY_DTYPE=_TL_DTYPES[copy_dtype], HAS_COPY=bucket.copies is not None, SPLIT=bucket.lows is not None,
            HAS_ADDEND=bucket.addends is not None, ALIGNED=all(a % ALIGN_BYTES == 0 for a in addresses),
            SCALARS_IN_MEMORY=self.capturable, BLOCK=self.block, num_warps=self.num_warps)

    def _write_scalars(self, bucket: _Bucket, scalars: _Scalars) -> None:
        host = scalars.as_tensor()
        device_scalars = self._scalars[bucket.slot]
        if device_scalars.is_cuda:
            host = host.pin_memory()  # ordered on the stream, without waiting for the queued work
        device_scalars.copy_(host, non_blocking=True)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = closure_loss(closure)
        capturing = _capturing()
        if capturing and not self.capturable:
            raise RuntimeError("FusedAdamW: this step is being captured in a CUDA graph, which would freeze its "
                               "learning rate and bias corrections: build the optimizer with capturable=True")
        kernel_buckets, fallback_buckets = self._buckets(advance=not capturing)
        if capturing and fallback_buckets:
            raise RuntimeError("FusedAdamW: a captured step runs only through the kernel; some parameters take the "
                               "PyTorch fallback (CPU, non-contiguous or float64 tensors)")
        # keep only this step's tables: the caches stay as small as the model
        tables, block_maps = {}, {}
        for bucket in kernel_buckets:
            self._launch(bucket, tables, block_maps, capturing=capturing)
        self._tables, self._block_maps = tables, block_maps
        if capturing:
            self._captured, self._captured_tables = kernel_buckets, (tables, block_maps)
        for bucket in fallback_buckets:
            _foreach_step(bucket)
        return loss

    def prepare_capture(self) -> None:
        """Right before a step is captured: reserve device memory, outside the graph's pool, for
        its launch tables (twice what the last eager step's took)."""
        if not self._tables:
            raise RuntimeError("FusedAdamW.prepare_capture: run an eager step through the kernel first")
        tensors = [*self._tables.values(),
                   *(t for m in self._block_maps.values() for t in (m.numels, m.first_block, m.block_tensor))]
        slots = sum(-(-t.numel() * t.element_size() // 8) for t in tensors)
        self._to_device.reserve(2 * slots + 64, next(iter(self._tables.values())).device)

    def finish_capture(self) -> None:
        """After the capture of a step has ended: write the launch tables it made."""
        self._to_device.fill()

    def prepare_replay(self) -> None:
        """Before each replay of the captured step: advance the step count of every parameter it
        updates and write each bucket's scalars, on the current stream (the replay's)."""
        if self._captured is None:
            raise RuntimeError("FusedAdamW.prepare_replay: no step of this optimizer was captured")
        for bucket in self._captured:
            bucket.step += 1
            for p in bucket.params:
                self.state[p]["step"] = bucket.step
            self._write_scalars(bucket, _Scalars.of(bucket.group, bucket.step))


class MasterWeightAdamW(FusedAdamW):
    """FusedAdamW over fp32 master copies of the parameters the model computes with in bf16.

    Under autocast over fp32 weights every step casts each matmul weight to bf16 in the forward
    (read 4 bytes, write 2 per parameter) and each bf16 weight gradient back to fp32 in the
    backward (read 2, write 4): about 12 bytes of memory traffic per parameter and step that
    change no value, since the rounded weight is what the matmul uses and the gradient comes
    out of the matmul in bf16. Here the model holds those weights in bf16
    itself, so autocast has nothing to cast and the gradients stay bf16, while this optimizer
    keeps the fp32 master weights and moments: one kernel pass reads the master, the bf16
    gradient and the moments, and writes the master, the moments and the master rounded to
    bf16 back into the model's parameter. The values the model computes with are the same
    bf16 roundings autocast would make, so training follows the autocast path's arithmetic.

    ``low_precision``: the parameters of ``params`` to hold in ``dtype`` (those that autocast
    would cast anyway: the weights of matmuls). On construction each gets an fp32 master (its
    current value, before rounding) in this optimizer's param groups, and is cast in place
    (``param.data``): build the optimizer before the first forward. Other parameters (norm
    gains, the embedding table) stay fp32 and are updated as FusedAdamW does.
    ``master_of(param)`` gives a parameter's master (for checkpoints); the state dict is
    FusedAdamW's, keyed by the masters' positions in the param groups.

    ``split_masters`` (bf16 only) keeps no fp32 master tensors. An fp32 master's bf16 rounding
    (to nearest even, as ``master.to(torch.bfloat16)``) is its high 16 bits give or take a carry,
    and the model's parameter holds it anyway: the optimizer keeps only the signed rest, an int16
    per element with ``bits(master) = (bits(param) << 16) + low``, in the parameter's state under
    ``LOW_BITS`` (so state dicts carry it); the param groups hold the model's parameters. The
    kernel reads the master as its two halves and writes both back: per element it reads 2 + 2
    (master) + 2 (bf16 gradient) + 8 (moments) bytes and writes 2 + 2 + 8, 26 bytes instead of
    28. The arithmetic is the fp32 master's, bit for bit, but for one case: a new master whose
    low 16 bits are 0x8000 and whose rounding goes down (a tie, even high half) would need a rest
    of +0x8000, one past int16, so it is stored one fp32 ulp smaller in magnitude (low bits
    0x7FFF), which rounds to the same bf16 value: the model's weight stays exactly the stored
    master rounded to nearest even, and the stored master is one ulp off the exact update (for
    about 2^-17 of the elements in a step). The halves come from each parameter's fp32 value at
    construction, so its state (fp32 moments and the rest) exists from then on; ``master_of``
    joins the halves into a new tensor.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, low_precision: Iterable[torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16, split_masters: bool = False, capturable: bool = False,
                 block: int = BLOCK, num_warps: int = NUM_WARPS):
        if dtype not in COPY_DTYPES:
            raise ValueError(f"MasterWeightAdamW: dtype must be one of {COPY_DTYPES}, got {dtype}")
        if split_masters and dtype != torch.bfloat16:
            raise ValueError(f"MasterWeightAdamW: split_masters needs dtype=torch.bfloat16 (the high half of "
                             f"an fp32), got {dtype}")
        params = list(params)
        if params and isinstance(params[0], dict):
            raise ValueError("MasterWeightAdamW takes a flat list of parameters, not param groups")
        chosen = {id(p): p for p in low_precision}
        unknown = set(chosen) - {id(p) for p in params}
        if unknown:
            raise ValueError(f"MasterWeightAdamW: {len(unknown)} of the low_precision tensors are not in params")
        for p in chosen.values():
            if p.dtype != torch.float32:
                raise ValueError(f"MasterWeightAdamW: a low-precision parameter must start in fp32 (its value "
                                 f"becomes the master), got {p.dtype} for shape {tuple(p.shape)}")
        masters: dict[torch.Tensor, torch.Tensor] = {}  # master -> the model's low-precision parameter
        lows: dict[torch.Tensor, torch.Tensor] = {}  # split: the model's parameter -> its master's low half
        tensors = []
        # the model's parameter objects stay (hooks, module references): only their data is replaced
        for p in params:
            if id(p) not in chosen:
                tensors.append(p)
            elif split_masters:
                p.data, lows[p] = split_master(p.detach())
                tensors.append(p)
            else:
                master = p.detach().clone(memory_format=torch.contiguous_format)
                p.data = p.data.to(dtype)
                masters[master] = p
                tensors.append(master)
        # each master's copy is the model's parameter: FusedAdamW's copy table is the one map kept
        super().__init__(tensors, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         low_precision_copies=masters, capturable=capturable, block=block, num_warps=num_warps)
        for p, low in lows.items():
            # the moments are the master's, fp32 (advance_state would make them in the parameter's bf16)
            self.state[p].update({"step": 0, "exp_avg": torch.zeros_like(low, dtype=torch.float32),
                                  "exp_avg_sq": torch.zeros_like(low, dtype=torch.float32), LOW_BITS: low})

    def _model_param(self, p: torch.Tensor) -> torch.Tensor:
        # a master's gradient is its model parameter's (the copy); other parameters carry their own
        return self._copies.get(p, p)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a parameter held in low precision (the parameter itself otherwise);
        a split master is joined from its halves into a new tensor."""
        low = self.state[param].get(LOW_BITS) if param in self.state else None
        if low is not None:
            return join_master(param.detach(), low)
        return next((master for master, p in self._copies.items() if p is param), param)

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        split = [LOW_BITS in self.state.get(p, {}) for p in params]
        if any(s != (LOW_BITS in state_dict["state"].get(i, {})) for s, i in zip(split, saved_ids)):
            raise ValueError("MasterWeightAdamW.load_state_dict: the state dict's masters are split where this "
                             "optimizer's are not, or the reverse: build it with the split_masters it was saved with")
        super().load_state_dict(state_dict)
        # torch casts floating-point state to its parameter's dtype, bf16 for a split master: its
        # fp32 moments and int16 low half are taken again from the saved state, in their own dtypes
        for p, i, is_split in zip(params, saved_ids, split):
            if is_split:
                saved = state_dict["state"][i]
                self.state[p].update({key: saved[key].to(device=p.device, copy=True)
                                      for key in ("exp_avg", "exp_avg_sq", LOW_BITS)})

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p in self._copies.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
