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

That contract is checked: before a step's gradients are waited for (and, for naive and flat,
before any is sent), the ranks agree on which parameters got a gradient and in which order their
reductions were issued, with one small all-reduce (MAX over each rank's signature and its
negation: 2 int32 per parameter) on a gloo group of their own, whose call order the gradient
collectives cannot disturb. A parameter used on some ranks only, or gradients issued in
different orders, raise a RuntimeError naming the parameter and the ranks instead of pairing the
wrong gradients (a hang, gloo's "Connection reset by peer", or silently wrong averages). It costs
one CPU round trip per step (``check_seconds`` accumulates it; the DDP benchmark reports it per
step); ``check_gradients=False`` turns it off. ``_start_check`` and ``_complete_check`` split it for
a wrapper that can queue its GPU work in between (``systems.parallel.peer``).

Averaging: gradients are pre-scaled by 1/world_size and then summed, because gloo has no AVG
reduction; for a power-of-two world size the pre-scaling is exact.

One backward per step: call ``finish_gradient_synchronization()`` after every backward (gradient
accumulation without synchronisation is not supported by these wrappers).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

MiB = 1024 * 1024


@torch.no_grad()
def broadcast_optimizer_state(optimizer, process_group: dist.ProcessGroup | None = None) -> None:
    """Rank 0's optimizer tensors (its parameters, e.g. fp32 masters, and every state tensor) to
    every rank. The wrappers broadcast the module's parameters; an optimizer built before the
    wrapper (the grouped one a bucket-per-group or peer wrapper steps) may hold tensors taken from
    each rank's own initial weights: ``MasterWeightAdamW``'s masters or split low halves.
    ``optimizer``: a torch optimizer, or a ``GroupedOptimizer`` (its ``optimizers``)."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    for opt in getattr(optimizer, "optimizers", [optimizer]):
        for group in opt.param_groups:
            for p in group["params"]:
                tensors = [p.data] + [t for t in opt.state.get(p, {}).values() if torch.is_tensor(t) and t.dim()]
                for t in tensors:  # as bytes: NCCL has no int16 (a split master's low half)
                    dist.broadcast(t.view(-1).view(torch.uint8), src=src, group=process_group)


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    # module.parameters() already drops repeats of a tied parameter (remove_duplicate=True)
    return list(module.parameters())


class _DDPBase(nn.Module):
    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 check_gradients: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("initialise a process group first (systems.parallel.launch.spawn "
                               "or run_from_env)")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._hooks: list = []
        self.broadcast_from_rank0()
        names = {id(p): name for name, p in module.named_parameters()}
        self._params = self.grad_params
        self._names = [names[id(p)] for p in self._params]
        self._position = {id(p): i for i, p in enumerate(self._params)}
        # the agreement runs on a group of its own: after a mismatch the gradient collectives'
        # call order differs between ranks, and a check issued on the same group would pair with
        # the wrong call. new_group is collective: every rank of the default group builds it.
        self._check_group = None
        if check_gradients:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self._check_group = dist.new_group(ranks=ranks, backend="gloo")
        self.check_seconds = 0.0  # time spent agreeing, summed over steps
        self.check_calls = 0

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
        """Call before each step's forward (wrappers with per-step state reset it here)."""

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

    def _issue_order(self) -> list[int]:
        """Per trainable parameter: -1 if it got no gradient this step, else the position at which
        its reduction is (or will be) issued among the step's collectives. Ranks must agree."""
        return [0 if p.grad is not None else -1 for p in self._params]

    def _order_proposal(self) -> list[int]:
        """Integers this rank sends with the check for the ranks to adopt alike (``_adopt``): a
        wrapper whose ranks must issue their work in one fixed order proposes the order it saw."""
        return []

    def _adopt(self, proposal: list[int]) -> None:
        """Called on every rank once every rank made the same ``_order_proposal()`` (never where
        they differ, so every rank adopts it at the same step or none does)."""

    def _check_same_gradients(self) -> None:
        """Raise, on every rank, if the ranks disagree on ``_issue_order()``."""
        self._complete_check(self._start_check())

    def _start_check(self) -> tuple | None:
        """Send this rank's ``_issue_order()`` to the agreement without waiting for the other ranks;
        ``_complete_check`` waits and raises on a mismatch. In between, a wrapper may queue GPU work
        that does not block the host (a wait for the others' hosts then overlaps the GPU's work)."""
        if self._check_group is None:
            return None
        start = time.perf_counter()
        mine, proposal = self._issue_order(), self._order_proposal()
        signature = torch.tensor(mine + [-x for x in mine] + proposal + [-x for x in proposal], dtype=torch.int32)
        work = dist.all_reduce(signature, op=dist.ReduceOp.MAX, group=self._check_group, async_op=True)
        self.check_seconds += time.perf_counter() - start
        return mine, proposal, signature, work

    def _complete_check(self, pending: tuple | None) -> None:
        if pending is None:
            return
        start = time.perf_counter()
        mine, proposal, signature, work = pending
        work.wait()
        n, m, agreed = len(mine), len(proposal), signature.tolist()
        # max == -max(-x) == min only where every rank holds the same value
        mismatched = [i for i in range(n) if agreed[i] != -agreed[n + i]]
        self.check_seconds += time.perf_counter() - start
        self.check_calls += 1
        if proposal and not mismatched and all(agreed[2 * n + j] == -agreed[2 * n + m + j] for j in range(m)):
            self._adopt(proposal)
        if mismatched:  # the failure path only: every rank's order, to name who differs
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=self._check_group)
            # a parameter missing on some ranks is the cause; the positions after it shift with it
            missing = [i for i in mismatched if len({order[i] >= 0 for order in everyone}) > 1]
            raise RuntimeError(self._mismatch_message((missing or mismatched)[0], everyone,
                                                      n_more=len(mismatched) - 1))

    def _mismatch_message(self, i: int, everyone: list[list[int]], *, n_more: int) -> str:
        name, wrapper = self._names[i], type(self).__name__
        with_grad = [r for r, order in enumerate(everyone) if order[i] >= 0]
        more = f" ({n_more} more parameter(s) disagree too)" if n_more else ""
        if 0 < len(with_grad) < self.world_size:
            without = [r for r in range(self.world_size) if r not in with_grad]
            what = (f"parameter {name!r} got a gradient on rank(s) {with_grad} but not on rank(s) {without} "
                    "in this step")
        else:
            where = ", ".join(f"rank {r}: {order[i]}" for r, order in enumerate(everyone))
            what = f"the reduction of parameter {name!r} is issued at different positions on the ranks ({where})"
        return (f"{wrapper}: {what}{more}. Every rank must use the same parameters, in the same order, in "
                "every step: the gradient all-reduces are matched by their order, so they would pair "
                "different gradients (a hang, or wrong averages). Use the parameter on every rank "
                "(multiplied by zero where it is not needed) or freeze it (requires_grad=False).")


class DDPNaive(_DDPBase):
    """After backward: one blocking all-reduce per parameter gradient."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        self._check_same_gradients()
        for p in self._params:
            if p.grad is not None:
                self._all_reduce_(p.grad, async_op=False)


class DDPFlat(_DDPBase):
    """After backward: the gradients flattened into one buffer per dtype, one all-reduce each."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        self._check_same_gradients()
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for p in self._params:
            if p.grad is not None:
                by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            self._all_reduce_(flat, async_op=False)
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)


class _AgreedOrder:
    """Lets a rank start a collective during backward only while this step's order of ready items
    (parameters, buckets) repeats the order every rank agreed on in the last checked step.

    The k-th collective a rank starts is then the agreed k-th item on every rank: ranks whose steps
    differ stop at their first difference instead of pairing different tensors (which hangs NCCL
    and aborts gloo in native code, before any check could name the parameter). What was held
    back is started in ``finish_gradient_synchronization`` once the check has passed, in the
    order checked. The first step has no agreed order, so it sends everything after backward;
    so does a step whose order changed on every rank alike. With the check off, items go at once.
    """

    def __init__(self, checked: bool):
        self.checked = checked
        self.agreed: list[int] | None = None
        self.order: list[int] = []  # this step's items, as they became ready
        self.following = not checked

    def start_step(self) -> None:
        self.order = []
        self.following = not self.checked or self.agreed is not None

    def ready(self, item: int) -> bool:
        """Record ``item`` as ready; True when its collective may start now."""
        k = len(self.order)
        self.order.append(item)
        if self.checked and self.following:
            self.following = k < len(self.agreed) and self.agreed[k] == item
        return self.following


class DDPIndividualParameters(_DDPBase):
    """Overlap: each gradient's all-reduce starts, asynchronously, as soon as backward has
    accumulated it (post-accumulate-grad hook); finish waits for the outstanding ones."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 check_gradients: bool = True):
        super().__init__(module, process_group, check_gradients=check_gradients)
        self._handles: list = []
        self._gate = _AgreedOrder(checked=check_gradients)
        for p in self._params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self._gate.ready(self._position[id(param)]):
            self._handles.append(self._all_reduce_(param.grad, async_op=True))

    def _issue_order(self) -> list[int]:
        order = [-1] * len(self._names)
        for k, i in enumerate(self._gate.order):
            order[i] = k
        return order

    def on_train_batch_start(self) -> None:
        self._gate.start_step()

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        try:
            self._check_same_gradients()
        except RuntimeError:
            self._handles.clear()
            self._gate.start_step()
            raise
        for i in self._gate.order[len(self._handles):]:  # held back: now in the order just agreed
            self._handles.append(self._all_reduce_(self._params[i].grad, async_op=True))
        self._gate.agreed = self._gate.order
        self._gate.start_step()
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

    ``groups`` (instead of ``bucket_size_mb``): the buckets are these lists of parameters (split
    by dtype where a group mixes them: a block's bf16 matmul weights and fp32 norm gains), and
    ``on_synced(group)`` is called with each group's parameters as soon as all of its gradients
    are averaged, in the order the all-reduces were issued: ``GroupedOptimizer.step_group`` there
    updates a block while the all-reduces of the blocks after it still run. The update's kernels
    queue behind that bucket's all-reduce on the current stream (``wait()`` does not block the
    host), so the last buckets' communication overlaps the first buckets' updates instead of
    delaying every update.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None,
                 process_group: dist.ProcessGroup | None = None, *, reduce_dtype: torch.dtype | None = None,
                 last_bucket_mb: float | None = None, groups: Sequence[Sequence[nn.Parameter]] | None = None,
                 on_synced: Callable[[list[nn.Parameter]], None] | None = None, check_gradients: bool = True):
        # checked before the constructor's broadcast: fail without communicating
        if (groups is None) == (bucket_size_mb is None):
            raise ValueError("give DDPBucketed either bucket_size_mb (size-capped buckets) or groups (one bucket "
                             "per group), not both or neither")
        if groups is None and not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        if groups is not None and last_bucket_mb is not None:
            raise ValueError("last_bucket_mb caps size-capped buckets; with groups the buckets are the groups")
        if on_synced is not None and groups is None:
            raise ValueError("on_synced is called per group: pass groups too")
        if last_bucket_mb is not None and not last_bucket_mb > 0:
            raise ValueError(f"last_bucket_mb must be positive, got {last_bucket_mb!r}")
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")
        super().__init__(module, process_group, check_gradients=check_gradients)
        self.bucket_size_mb = bucket_size_mb
        params = self.grad_params
        keys = [(p.dtype, p.device) for p in params]
        if groups is None:
            index_groups = assign_buckets([p.numel() * p.element_size() for p in params], bucket_size_mb * MiB,
                                          keys=keys,
                                          last_bucket_bytes=None if last_bucket_mb is None else last_bucket_mb * MiB)
            self._group_of, self._groups = [], []  # no groups: nothing to report per group
        else:
            index_groups, self._group_of, self._groups = self._split_groups(groups, params, keys)
        self._buckets_per_group = [self._group_of.count(g) for g in range(len(self._groups))]
        self.buckets = [_Bucket([params[i] for i in group], reduce_dtype) for group in index_groups]
        self.on_synced = on_synced
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._bucket_index = {id(b): k for k, b in enumerate(self.buckets)}
        self._gate = _AgreedOrder(checked=check_gradients)  # over bucket indices
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @staticmethod
    def _split_groups(groups, params, keys) -> tuple[list[list[int]], list[int], list[list[nn.Parameter]]]:
        """(buckets as indices into ``params``, each bucket's group, the groups) for explicit groups:
        each group split by (dtype, device), keeping its order."""
        position = {id(p): i for i, p in enumerate(params)}
        seen: set[int] = set()
        buckets, group_of = [], []
        for g, group in enumerate(groups):
            by_key: dict[tuple, list[int]] = {}
            for p in group:
                i = position.get(id(p))
                if i is None:
                    raise ValueError(f"group {g} has a parameter of shape {tuple(p.shape)} that is not a trainable "
                                     "parameter of the wrapped module")
                if i in seen:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two groups")
                seen.add(i)
                by_key.setdefault(keys[i], []).append(i)
            buckets += list(by_key.values())
            group_of += [g] * len(by_key)
        if len(seen) != len(params):
            missing = next(p for i, p in enumerate(params) if i not in seen)
            raise ValueError(f"{len(params) - len(seen)} trainable parameters (one of shape {tuple(missing.shape)}) "
                             "are in no group: the groups must cover every parameter that gets a gradient")
        return buckets, group_of, [list(group) for group in groups]

    @property
    def n_buckets(self) -> int:
        return len(self.buckets)

    def on_train_batch_start(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._gate.start_step()

    def _send_order(self) -> list[int]:
        """Bucket indices in the order their all-reduces are issued: the complete buckets as they
        became complete, then (in finish) the others in bucket order."""
        done = set(self._gate.order)
        return self._gate.order + [k for k in range(len(self.buckets)) if k not in done]

    def _issue_order(self) -> list[int]:
        """A parameter's position is its bucket's in ``_send_order``; -1 without a gradient."""
        slot = {k: pos for pos, k in enumerate(self._send_order())}
        order = [-1] * len(self._names)
        for k, b in enumerate(self.buckets):
            for i in b.ready:
                order[self._position[id(b.params[i])]] = slot[k]
        return order

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
        if len(bucket.ready) == len(bucket.params) and self._gate.ready(self._bucket_index[id(bucket)]):
            bucket.handle = self._launch(bucket)

    def _launch(self, bucket: _Bucket):
        return dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        try:
            self._check_same_gradients()  # before the held-back buckets are sent and any is waited for
        except RuntimeError:
            self.on_train_batch_start()
            raise
        order = self._send_order()
        # the rest in the agreed order: complete buckets held back, then those whose parameters did
        # not all get a gradient, with zeros standing in for the missing gradients
        for bucket in (self.buckets[k] for k in order):
            if bucket.handle is None:
                for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                    if i not in bucket.ready:
                        view.zero_()
                bucket.handle = self._launch(bucket)
        left = list(self._buckets_per_group)  # per group, its buckets not landed yet
        for k in order:  # the all-reduces finish in the order they were issued
            bucket = self.buckets[k]
            bucket.handle.wait()
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                if i not in bucket.ready:
                    continue
                if view.dtype == p.dtype:
                    p.grad = view  # the averaged gradient, living in the bucket
                else:
                    p.grad.copy_(view)  # .grad keeps the parameter's dtype
            bucket.reset()
            if self.on_synced is not None:
                group = self._group_of[k]
                left[group] -= 1
                if left[group] == 0:
                    self.on_synced(self._groups[group])
        self._gate.agreed = order
        self._gate.start_step()


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
