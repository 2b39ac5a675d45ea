"""Fused AdamW: one Triton kernel launch updates a whole bucket of parameters in one pass.

Layout of this module: helpers (constants, buckets, launch tables, the PyTorch fallback),
the kernel, then the optimizer class ``FusedAdamW``.

The update is ``systems.optim.AdamW``'s, operation for operation (decoupled decay first,
torch's lerp for the first moment, sqrt and divisions rounded to nearest as torch's are):

    p *= 1 - lr * wd;  m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Per element the kernel reads p, g, m, v once and writes p, m, v (and optionally a bf16/fp16
copy of the new p) once, in fp32 registers whatever the storage dtypes; the unfused optimizer
makes eight passes. One launch covers every parameter of a bucket (same device, group,
step count and dtypes): a table of their addresses is passed to the kernel, and each program
finds its tensor and block through a block -> tensor map (multi-tensor apply, as apex and
torch's fused optimizers do), so a model of hundreds of tensors costs a launch or two, not
hundreds. CPU tensors (outside TRITON_INTERPRET=1) take a torch._foreach_* fallback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import triton
import triton.language as tl

from systems.kernels.blocks import load_f32, store_as
from systems.measure.devices import triton_interpreting
from systems.optim import AdamW, adamw_foreach_, advance_state, closure_loss

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # parameter and gradient dtypes the kernel takes
COPY_DTYPES = (torch.bfloat16, torch.float16)  # low-precision copies
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Elements per program: 8 per thread at 8 warps, i.e. two 16-byte fp32 vectors per tensor.
BLOCK = 2048
NUM_WARPS = 8
ALIGN_BYTES = 16  # the kernel tells the compiler addresses are 16-byte aligned when they all are
N_POINTERS = 5  # columns of the address table: param, grad, exp_avg, exp_avg_sq, copy (0 when none)
# the kernels' views of the two (jit'ed code reads module globals only as constexprs)
_ALIGN_BYTES = tl.constexpr(ALIGN_BYTES)
_N_POINTERS = tl.constexpr(N_POINTERS)


# ----------------------------------------------------------------------------- helpers



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


def _kernel_applies(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    copy: torch.Tensor | None) -> bool:
    # the kernel indexes flat memory, so every tensor must be dense and in row-major order,
    # and it reads the moments with the parameter's dtype
    tensors = (p, g, m, v) if copy is None else (p, g, m, v, copy)
    return ((p.is_cuda or triton_interpreting()) and p.dtype in KERNEL_DTYPES and g.dtype in KERNEL_DTYPES
            and m.dtype == v.dtype == p.dtype and all(t.is_contiguous() for t in tensors))


@dataclass(frozen=True)
class _BlockMap:
    """Which tensor and which block of it each program updates (depends on the numels only)."""

    numels: torch.Tensor  # (tensors,) int64
    first_block: torch.Tensor  # (tensors,) int64: the program that starts each tensor
    block_tensor: torch.Tensor  # (programs,) int32: the tensor of each program
    n_blocks: int


def _block_map(numels: tuple[int, ...], device: torch.device) -> _BlockMap:
    blocks = torch.tensor([triton.cdiv(n, BLOCK) for n in numels], dtype=torch.int64)
    first_block = torch.cumsum(blocks, 0) - blocks
    block_tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), blocks)
    return _BlockMap(numels=torch.tensor(numels, dtype=torch.int64).to(device), first_block=first_block.to(device),
                     block_tensor=block_tensor.to(device), n_blocks=int(blocks.sum()))


def _address_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    table = torch.tensor(addresses, dtype=torch.int64).view(-1, N_POINTERS)
    if device.type != "cuda":
        return table
    # pinned + non_blocking: a pageable copy would make the host wait for the queued backward
    return table.pin_memory().to(device, non_blocking=True)


def _foreach_step(bucket: _Bucket) -> None:
    """The PyTorch fallback: systems.optim.AdamW's multi-tensor update, then the copies."""
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(bucket.params, bucket.grads)]
    adamw_foreach_(bucket.params, grads, bucket.exp_avgs, bucket.exp_avg_sqs, group=bucket.group, step=bucket.step)
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
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, numel,
                 decay, lerp_weight, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps,
                 HAS_COPY: tl.constexpr, MASKED: tl.constexpr):
    p = load_f32(p_ptr, offs, numel, MASKED)
    g = load_f32(g_ptr, offs, numel, MASKED)
    m = load_f32(m_ptr, offs, numel, MASKED)
    v = load_f32(v_ptr, offs, numel, MASKED)
    p = p * decay  # decoupled decay acts on the pre-update weights
    # torch's lerp(m, g, w): m + w (g - m) for w < 0.5, else g - (g - m)(1 - w) (exact at w = 1)
    m = tl.where(lerp_weight < 0.5, m + lerp_weight * (g - m), g - (g - m) * (1.0 - lerp_weight))
    v = v * beta2 + one_minus_beta2 * g * g
    # sqrt and divisions rounded to nearest as torch's (tl.sqrt and / may be approximate on GPUs)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    store_as(p_ptr, p, offs, numel, MASKED)
    store_as(m_ptr, m, offs, numel, MASKED)
    store_as(v_ptr, v, offs, numel, MASKED)
    if HAS_COPY:
        store_as(c_ptr, p, offs, numel, MASKED)


@triton.jit
def _adamw_kernel(Addresses, Numels, FirstBlock, BlockTensor,
                  decay, lerp_weight, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps,
                  PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, COPY_DTYPE: tl.constexpr,
                  HAS_COPY: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (blocks of all tensors,). One program: BLOCK elements of one tensor of the bucket."""
    pid = tl.program_id(0)
    t = tl.load(BlockTensor + pid).to(tl.int64)
    numel = tl.load(Numels + t)
    start = (pid - tl.load(FirstBlock + t)) * BLOCK
    row = Addresses + t * _N_POINTERS
    p_ptr = _pointer(tl.load(row + 0), PARAM_DTYPE, ALIGNED)
    g_ptr = _pointer(tl.load(row + 1), GRAD_DTYPE, ALIGNED)
    m_ptr = _pointer(tl.load(row + 2), PARAM_DTYPE, ALIGNED)
    v_ptr = _pointer(tl.load(row + 3), PARAM_DTYPE, ALIGNED)
    c_ptr = p_ptr
    if HAS_COPY:
        c_ptr = _pointer(tl.load(row + 4), COPY_DTYPE, ALIGNED)
    offs = start + tl.arange(0, BLOCK)
    # full blocks unmasked (the masks of a runtime numel would keep loads scalar), the tail masked
    if start + BLOCK <= numel:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, numel, decay, lerp_weight, beta2,
                     one_minus_beta2, step_size, bias_correction2_sqrt, eps, HAS_COPY, False)
    else:
        _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, numel, decay, lerp_weight, beta2,
                     one_minus_beta2, step_size, bias_correction2_sqrt, eps, HAS_COPY, True)


# ----------------------------------------------------------------------------- optimizer


class FusedAdamW(AdamW):
    """``systems.optim.AdamW`` with a fused Triton update, optionally writing low-precision copies.

    ``low_precision_copies`` maps parameters to bf16/fp16 tensors of their shape; after each
    step a copy holds ``param.to(copy.dtype)``, written by the same kernel pass (``attach_copy``
    adds one later). The state (``step``, ``exp_avg``, ``exp_avg_sq``) is laid out as AdamW's,
    so state dicts move between the two; the copies are not part of the state.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *,
                 low_precision_copies: dict[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._copies: dict[torch.Tensor, torch.Tensor] = {}
        # launch tables of the last step, reused while addresses and sizes stay the same
        self._tables: dict[tuple, torch.Tensor] = {}
        self._block_maps: dict[tuple, _BlockMap] = {}
        for param, copy in (low_precision_copies or {}).items():
            self.attach_copy(param, copy)

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy and pickle carry the optimizer's state only: no copies, empty caches
        super().__setstate__(state)
        self.__dict__.setdefault("_copies", {})
        self.__dict__.setdefault("_tables", {})
        self.__dict__.setdefault("_block_maps", {})

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
        copy.copy_(param)
        self._copies[param] = copy

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient the update of ``p`` reads (``MasterWeightAdamW`` reads another tensor's)."""
        return p.grad

    def _buckets(self) -> tuple[list[_Bucket], list[_Bucket]]:
        """Advance every stepped parameter's count; group them into (kernel buckets, foreach buckets)."""
        kernel, fallback = {}, {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                grad = self._grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("FusedAdamW does not support sparse gradients")
                state = advance_state(self.state[p], p)
                copy = self._copies.get(p)
                use_kernel = _kernel_applies(p, grad, state["exp_avg"], state["exp_avg_sq"], copy)
                key = (index, state["step"], p.device, p.dtype, grad.dtype,
                       copy.dtype if copy is not None else None)
                buckets = kernel if use_kernel else fallback
                if key not in buckets:
                    buckets[key] = _Bucket(group=group, step=state["step"], params=[], grads=[],
                                           exp_avgs=[], exp_avg_sqs=[], copies=[] if copy is not None else None)
                b = buckets[key]
                b.params.append(p)
                b.grads.append(grad)
                b.exp_avgs.append(state["exp_avg"])
                b.exp_avg_sqs.append(state["exp_avg_sq"])
                if copy is not None:
                    b.copies.append(copy)
        return list(kernel.values()), list(fallback.values())

    def _launch(self, bucket: _Bucket, tables: dict, block_maps: dict) -> None:
        p0 = bucket.params[0]
        copies = bucket.copies if bucket.copies is not None else [None] * len(bucket.params)
        addresses = tuple(a for p, g, m, v, c in zip(bucket.params, bucket.grads, bucket.exp_avgs,
                                                     bucket.exp_avg_sqs, copies)
                          for a in (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                                    c.data_ptr() if c is not None else 0))
        map_key = (p0.device, tuple(p.numel() for p in bucket.params))
        block_map = self._block_maps.get(map_key)
        if block_map is None:
            block_map = _block_map(map_key[1], p0.device)
        table = self._tables.get(addresses)
        if table is None:
            table = _address_table(addresses, p0.device)
        block_maps[map_key], tables[addresses] = block_map, table
        if block_map.n_blocks == 0:
            return
        s = _Scalars.of(bucket.group, bucket.step)
        copy_dtype = bucket.copies[0].dtype if bucket.copies is not None else torch.bfloat16  # unused without copies
        _adamw_kernel[(block_map.n_blocks,)](
            table, block_map.numels, block_map.first_block, block_map.block_tensor,
            s.decay, s.lerp_weight, s.beta2, s.one_minus_beta2, s.step_size, s.bias_correction2_sqrt, s.eps,
            PARAM_DTYPE=_TL_DTYPES[p0.dtype], GRAD_DTYPE=_TL_DTYPES[bucket.grads[0].dtype],
            COPY_DTYPE=_TL_DTYPES[copy_dtype], HAS_COPY=bucket.copies is not None,
            ALIGNED=all(a % ALIGN_BYTES == 0 for a in addresses), BLOCK=BLOCK, num_warps=NUM_WARPS)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = closure_loss(closure)
        kernel_buckets, fallback_buckets = self._buckets()
        # keep only this step's tables: the caches stay as small as the model
        tables, block_maps = {}, {}
        for bucket in kernel_buckets:
            self._launch(bucket, tables, block_maps)
        self._tables, self._block_maps = tables, block_maps
        for bucket in fallback_buckets:
            _foreach_step(bucket)
        return loss


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
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, low_precision: Iterable[torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16):
        if dtype not in COPY_DTYPES:
            raise ValueError(f"MasterWeightAdamW: dtype must be one of {COPY_DTYPES}, got {dtype}")
        params = list(params)
        if params and isinstance(params[0], dict):
            raise ValueError("MasterWeightAdamW takes a flat list of parameters, not param groups")
        chosen = {id(p): p for p in low_precision}
        unknown = set(chosen) - {id(p) for p in params}
        if unknown:
            raise ValueError(f"MasterWeightAdamW: {len(unknown)} of the low_precision tensors are not in params")
        masters: dict[torch.Tensor, torch.Tensor] = {}  # master -> the model's low-precision parameter
        tensors = []
        for p in params:
            if id(p) not in chosen:
                tensors.append(p)
                continue
            if p.dtype != torch.float32:
                raise ValueError(f"MasterWeightAdamW: a low-precision parameter must start in fp32 (its value "
                                 f"becomes the master), got {p.dtype} for shape {tuple(p.shape)}")
            master = p.detach().clone(memory_format=torch.contiguous_format)
            p.data = p.data.to(dtype)  # the model's parameter object stays (hooks, module references)
            masters[master] = p
            tensors.append(master)
        # each master's copy is the model's parameter: FusedAdamW's copy table is the one map kept
        super().__init__(tensors, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         low_precision_copies=masters)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        # a master's gradient is its model parameter's (the copy); other parameters carry their own
        return self._copies.get(p, p).grad

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a parameter held in low precision (the parameter itself otherwise)."""
        return next((master for master, p in self._copies.items() if p is param), param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p in self._copies.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
