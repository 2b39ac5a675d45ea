"""Data-parallel wrappers: naive, flat, overlapped per-parameter, and bucketed gradient all-reduce.

Every wrapper
- broadcasts rank 0's parameters and buffers at construction, so all replicas start equal;
- runs the wrapped module in ``forward``;
- leaves each trainable parameter's ``.grad`` equal to the average over ranks of the local
  gradients once ``finish_gradient_synchronization()`` returns (call it after ``backward()`` and
  before ``optimizer.step()``).

Frozen parameters (``requires_grad=False``) are broadcast but never communicated. Tied parameters
(one ``nn.Parameter`` used by several modules) are one entry of ``module.parameters()``; autograd
sums both uses into its single ``.grad`` and fires its post-accumulate hook once, so each is
reduced once. Parameters that get no gradient in a step stay ``None``. As with torch's DDP, every
rank must use the same parameters in a step (the collectives are matched by order).

Averaging: gradients are pre-scaled by 1/world_size and then summed, because gloo has no AVG
reduction; for a power-of-two world size the pre-scaling is exact.

One backward per step: call ``finish_gradient_synchronization()`` after every backward (gradient
accumulation without synchronisation is not supported by these wrappers).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

MiB = 1024 * 1024


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    # module.parameters() already drops repeats of a tied parameter (remove_duplicate=True)
    return list(module.parameters())


class _DDPBase(nn.Module):
    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("initialise a process group first (systems.parallel.launch.spawn "
                               "or run_from_env)")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._hooks: list = []
        self.broadcast_from_rank0()

    @property
    def grad_params(self) -> list[nn.Parameter]:
        return [p for p in _unique_params(self.module) if p.requires_grad]

    @torch.no_grad()
    def broadcast_from_rank0(self) -> None:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for t in [*_unique_params(self.module), *self.module.buffers()]:
            dist.broadcast(t.data, src=src, group=self.process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        """Call before each step's forward (only the bucketed wrapper keeps per-step state)."""

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Detach this wrapper's autograd hooks (to wrap the same module differently afterwards)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _all_reduce_(self, tensor: torch.Tensor, *, async_op: bool):
        tensor.div_(self.world_size)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=async_op)


class DDPNaive(_DDPBase):
    """After backward: one blocking all-reduce per parameter gradient."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        for p in self.grad_params:
            if p.grad is not None:
                self._all_reduce_(p.grad, async_op=False)


class DDPFlat(_DDPBase):
    """After backward: the gradients flattened into one buffer per dtype, one all-reduce each."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for p in self.grad_params:
            if p.grad is not None:
                by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            self._all_reduce_(flat, async_op=False)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)


class DDPIndividualParameters(_DDPBase):
    """Overlap: each gradient's all-reduce starts, asynchronously, as soon as backward has
    accumulated it (post-accumulate-grad hook); finish waits for the outstanding ones."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None):
        super().__init__(module, process_group)
        self._handles: list = []
        for p in self.grad_params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._handles.append(self._all_reduce_(param.grad, async_op=True))

    def finish_gradient_synchronization(self) -> None:
        # wait() on NCCL only makes the current stream wait for the communication stream, so the
        # optimizer step queued next is ordered after the reduction without blocking the CPU
        for handle in self._handles:
            handle.wait()
        self._handles.clear()


def assign_buckets(sizes_bytes: Sequence[int], bucket_size_bytes: float,
                   keys: Sequence | None = None, *, last_bucket_bytes: float | None = None) -> list[list[int]]:
    """Group parameter indices into buckets for the bucketed all-reduce.

    Parameters are taken in reverse order (backward produces the last layers' gradients first);
    a bucket is closed when adding the next parameter would exceed ``bucket_size_bytes`` or
    when the next parameter's key (dtype, device) differs. A parameter larger than the cap gets a
    bucket of its own. Returns lists of indices into ``sizes_bytes``, each in reverse order.

    ``last_bucket_bytes`` caps the last bucket (the first parameters, whose gradients backward
    produces last) separately, at one parameter at least. That bucket's all-reduce cannot
    overlap any backward computation, so its size sets the communication left after backward;
    the other buckets keep the large cap and its few calls.
    """
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_size_bytes} bytes")
    if keys is not None and len(keys) != len(sizes_bytes):
        raise ValueError(f"keys has {len(keys)} entries for {len(sizes_bytes)} sizes")
    if last_bucket_bytes is not None and last_bucket_bytes <= 0:
        raise ValueError(f"last bucket size must be positive, got {last_bucket_bytes} bytes")
    negative = [i for i, size in enumerate(sizes_bytes) if size < 0]
    if negative:
        raise ValueError(f"size of parameter {negative[0]} is negative ({sizes_bytes[negative[0]]})")
    n_tail = 0  # the leading parameters that form the separately capped last bucket
    if last_bucket_bytes is not None and len(sizes_bytes):
        tail_bytes = sizes_bytes[0]
        n_tail = 1
        while (n_tail < len(sizes_bytes) and tail_bytes + sizes_bytes[n_tail] <= last_bucket_bytes
               and (keys is None or keys[n_tail] == keys[0])):
            tail_bytes += sizes_bytes[n_tail]
            n_tail += 1
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i in reversed(range(n_tail, len(sizes_bytes))):
        size = sizes_bytes[i]
        key_changed = bool(current) and keys is not None and keys[i] != keys[current[-1]]
        if current and (current_bytes + size > bucket_size_bytes or key_changed):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current:
        buckets.append(current)
    if n_tail:
        buckets.append(list(reversed(range(n_tail))))
    return buckets


class _Bucket:
    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype | None = None):
        self.params = params
        numels = [p.numel() for p in params]
        self.buffer = torch.zeros(sum(numels), dtype=dtype or params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p, n in zip(params, numels):
            self.views.append(self.buffer[offset:offset + n].view_as(p))
            offset += n
        self.index = {id(p): i for i, p in enumerate(params)}
        self.ready: set[int] = set()
        self.handle = None

    def reset(self) -> None:
        self.ready.clear()
        self.handle = None


class DDPBucketed(_DDPBase):
    """Overlap with fewer, larger messages: gradients are packed (in reverse parameter order) into
    buckets of at most ``bucket_size_mb`` MiB; a bucket's async all-reduce starts as soon as all of
    its gradients are ready.

    Each bucket owns a flat buffer. A gradient is copied into its slice when ready, unless the
    gradient already *is* that slice: after a synchronisation every ``.grad`` is set to its view of
    the bucket buffer, so with ``optimizer.zero_grad(set_to_none=False)`` backward accumulates
    straight into the buckets and no copy is made.

    ``last_bucket_mb`` caps the bucket of the first parameters (reduced last, after backward has
    finished) separately: the communication left after backward shrinks with it.

    ``reduce_dtype`` (e.g. torch.bfloat16) communicates the gradients in that dtype, halving the
    bytes sent from fp32 (FSDP2's ``reduce_dtype``); the averaged result is copied back into
    each parameter's own-dtype ``.grad``, so the sum over ranks is rounded to that dtype.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float,
                 process_group: dist.ProcessGroup | None = None, *, reduce_dtype: torch.dtype | None = None,
                 last_bucket_mb: float | None = None):
        if not bucket_size_mb > 0:  # before the constructor's broadcast: fail without communicating
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        if last_bucket_mb is not None and not last_bucket_mb > 0:
            raise ValueError(f"last_bucket_mb must be positive, got {last_bucket_mb!r}")
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")
        super().__init__(module, process_group)
        self.bucket_size_mb = bucket_size_mb
        params = self.grad_params
        groups = assign_buckets([p.numel() * p.element_size() for p in params], bucket_size_mb * MiB,
                                keys=[(p.dtype, p.device) for p in params],
                                last_bucket_bytes=None if last_bucket_mb is None else last_bucket_mb * MiB)
        self.buckets = [_Bucket([params[i] for i in group], reduce_dtype) for group in groups]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @property
    def n_buckets(self) -> int:
        return len(self.buckets)

    def on_train_batch_start(self) -> None:
        for bucket in self.buckets:
            bucket.reset()

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        i = bucket.index[id(param)]
        view = bucket.views[i]
        # scale by 1/world_size on the way into the bucket: one pass over the gradient instead of a
        # copy and then a division of the whole bucket (torch's DDP fuses the same way)
        if param.grad.data_ptr() != view.data_ptr():
            torch.mul(param.grad, 1.0 / self.world_size, out=view)
        else:
            view.mul_(1.0 / self.world_size)
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params) and bucket.handle is None:
            bucket.handle = self._launch(bucket)

    def _launch(self, bucket: _Bucket):
        return dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        # buckets whose parameters did not all get a gradient have not been sent: send them now,
        # in bucket order, with zeros standing in for the missing gradients
        for bucket in self.buckets:
            if bucket.handle is None:
                for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                    if i not in bucket.ready:
                        view.zero_()
                bucket.handle = self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                if i not in bucket.ready:
                    continue
                if view.dtype == p.dtype:
                    p.grad = view  # the averaged gradient, living in the bucket
                else:
                    p.grad.copy_(view)  # .grad keeps the parameter's dtype
            bucket.reset()


VARIANTS = {
    "naive": DDPNaive,
    "flat": DDPFlat,
    "overlap": DDPIndividualParameters,
    "bucketed": DDPBucketed,
}


def make_ddp(name: str, module: nn.Module, **kwargs) -> _DDPBase:
    """VARIANTS[name](module, **kwargs), with a readable error for an unknown name."""
    if name not in VARIANTS:
        raise ValueError(f"unknown DDP variant {name!r}; choose one of {', '.join(VARIANTS)}")
    return VARIANTS[name](module, **kwargs)
