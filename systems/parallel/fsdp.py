"""Fully sharded data parallelism, applied from outside the model: ``FSDP(module, compute_dtype=None)``.

What is sharded: the parameters of every ``Linear`` and ``Embedding`` (ours and torch's). They are
grouped into *units*; each unit's weights are flattened into one vector, padded to a multiple of
the world size, and each rank keeps only its 1/world_size slice as an fp32 ``nn.Parameter`` (the
master weights). Every other trainable parameter (the RMSNorm gains) is replicated; its
gradient is averaged with one all-reduce.

Units (``units=``): ``"layers"`` (default) makes each child of an ``nn.ModuleList`` (a Transformer
block) one unit and every Linear/Embedding outside such lists (embedding, LM head) a unit of its
own, like wrapping each block with FSDP2; ``"modules"`` makes every Linear/Embedding its own unit.

One training step, per unit:

- forward pre-hook: start the all-gathers of the next ``prefetch`` units in forward order (at
  most two: no gather starts more than two layers before its layer runs), wait for this unit's
  gather (started earlier by a prefetch, or now), and hand each module a view of the gathered
  buffer as its weight (a fresh autograd leaf per step);
- forward post-hook: free the gathered buffer (its storage is resized to zero; the views that
  autograd saved for backward keep pointing at the same storage) and put an autograd hook on the
  unit's output;
- that hook fires when the output's gradient is ready, i.e. just before the unit's backward: it
  prefetches the next units in backward order and re-gathers this unit into the same storage;
- each weight's post-accumulate-grad hook copies its gradient into the unit's flat gradient
  buffer; when all have arrived the buffer is freed of weights and reduce-scattered
  asynchronously (pre-divided by the world size: the average) into this rank's slice;
- ``finish_gradient_synchronization()`` waits for the reduce-scatters, adds each result (as fp32)
  to the shard's ``.grad``, and all-reduces the replicated gradients.

The collectives are asynchronous (``async_op=True``). On NCCL they run on the process group's own
stream, which is the side stream: the compute stream only waits for it at ``handle.wait()``
(which does not block the CPU), so a prefetched gather overlaps the previous layers' kernels.

``compute_dtype`` (e.g. bf16 or fp16): the fp32 shard is cast before the all-gather, so both the
communication and the layer's compute run in it; gradients are reduce-scattered in
``reduce_dtype`` (default: ``compute_dtype``, as FSDP2 does) and accumulated into the fp32 shard
gradients; the optimizer updates the fp32 shards. Replicated parameters are cast for compute too.

The optimizer sees only shards: ``FSDP(...).parameters()`` yields the flat fp32 shards and the
replicated fp32 parameters, nothing else (``shard_parameters()`` / ``replicated_parameters()``
split them). Works with any ``torch.optim`` optimizer and ``systems.optim.AdamW``: their updates
are elementwise, and the padding stays zero (zero gradient, zero weight).

Limits: every rank must run the same units in the same order (collectives are matched by order);
one parameter shared by two modules (tied weights) is rejected; activation checkpointing that
re-runs a unit's forward inside backward is not supported.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from systems.config import check_choice
from systems.model import Embedding, Linear

SHARDED_TYPES = (Linear, Embedding, nn.Linear, nn.Embedding)
UNIT_POLICIES = ("layers", "modules")
FREE, GATHERING, READY = "free", "gathering", "ready"


def _quiet_collective_warnings() -> None:
    # torch 2.13 marks all_gather_into_tensor / reduce_scatter_tensor deprecated in favour of
    # *_single names that older torch (2.11 on the GPU hosts) lacks; the old names work on both
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated",
                            category=FutureWarning)


@dataclass
class _Weight:
    module: nn.Module
    attr: str  # parameter name on module
    fqn: str  # name relative to the wrapped module, as in its state_dict
    shape: torch.Size
    offset: int  # into the unit's flat vector
    numel: int


@dataclass
class _Unit:
    index: int
    fqn: str
    root: nn.Module  # the module whose forward hooks gather / free
    weights: list[_Weight]
    numel: int
    padded: int
    shard: nn.Parameter  # this rank's fp32 slice of the flat vector
    full: torch.Tensor | None = None  # gathered flat buffer (compute dtype); storage freed when unused
    state: str = FREE
    handle: Any = None
    gather_src: torch.Tensor | None = None
    leaves: list = field(default_factory=list)
    grad_flat: torch.Tensor | None = None
    grads_in: int = 0
    grads_seen: set = field(default_factory=set)
    reduced: bool = False

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()


@dataclass
class _Replicated:
    module: nn.Module
    attr: str
    fqn: str
    param: nn.Parameter  # fp32 master, averaged gradient after finish
    grad: torch.Tensor | None = None  # this step's local gradient (fp32), summed over uses


class FSDP(nn.Module):
    """Shard ``module``'s Linear/Embedding weights over the ranks; see the module docstring."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, *,
                 reduce_dtype: torch.dtype | None = None, units: str = "layers", prefetch: int = 1,
                 process_group: dist.ProcessGroup | None = None, sync_module_states: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised process group "
                               "(systems.parallel.launch.spawn or run_from_env)")
        check_choice("units", units, UNIT_POLICIES)
        if not (isinstance(prefetch, int) and 0 <= prefetch <= 2):
            raise ValueError(f"prefetch must be 0, 1 or 2 units ahead, got {prefetch!r}")
        for name, dt in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise ValueError(f"{name} must be a floating-point torch.dtype or None, got {dt!r}")
        _quiet_collective_warnings()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype or compute_dtype
        self.prefetch = prefetch
        self.units_policy = units
        self._check_no_tied_parameters()
        if sync_module_states:
            self._broadcast_from_rank0()

        self._units: list[_Unit] = []
        self._replicated: list[_Replicated] = []
        self._build_units()
        self._build_replicated()
        self.flat_shards = nn.ParameterList([u.shard for u in self._units])
        self.replicated = nn.ParameterList([r.param for r in self._replicated])

        # execution orders seen in the previous step guide prefetching; before the first step the
        # registration order (and its reverse for backward) is the guess
        self._fwd_order = [u.index for u in self._units]
        self._bwd_order = self._fwd_order[::-1]
        self._fwd_record: list[int] = []
        self._bwd_record: list[int] = []
        self._in_backward = False
        self._pending_reduce: list[tuple[_Unit, Any, torch.Tensor, torch.Tensor]] = []
        self._hooks = []
        for unit in self._units:
            self._hooks.append(unit.root.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._hooks.append(unit.root.register_forward_hook(self._make_post_forward(unit)))
        for module_ in {id(r.module): r.module for r in self._replicated}.values():
            self._hooks.append(module_.register_forward_pre_hook(self._make_replicated_pre_forward(module_)))

    # ---- construction -------------------------------------------------------------------------

    def _check_no_tied_parameters(self) -> None:
        seen: dict[int, str] = {}
        for mname, m in self.module.named_modules(remove_duplicate=False):
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                fqn = f"{mname}.{pname}" if mname else pname
                if id(p) in seen and seen[id(p)] != fqn:
                    raise ValueError(f"FSDP does not support tied parameters: {seen[id(p)]} and {fqn} are "
                                     "the same nn.Parameter; untie them or use DDP")
                seen[id(p)] = fqn

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for t in [*self.module.parameters(), *self.module.buffers()]:
            dist.broadcast(t.data, src=src, group=self.process_group)

    def _unit_roots(self) -> dict[str, nn.Module]:
        """fqn -> unit root module, outermost first (children of ModuleLists, for "layers")."""
        roots: dict[str, nn.Module] = {}
        if self.units_policy == "layers":
            for mname, m in self.module.named_modules():
                if isinstance(m, nn.ModuleList):
                    for cname, child in m.named_children():
                        fqn = f"{mname}.{cname}" if mname else cname
                        if any(isinstance(x, SHARDED_TYPES) for x in child.modules()) and \
                                not any(fqn.startswith(r + ".") for r in roots):
                            roots[fqn] = child
        return roots

    @torch.no_grad()
    def _build_units(self) -> None:
        roots = self._unit_roots()
        members: dict[str, list[tuple[str, nn.Module]]] = {}
        order: list[str] = []
        for mname, m in self.module.named_modules():
            if not isinstance(m, SHARDED_TYPES) or not any(p is not None and p.requires_grad
                                                          for p in m._parameters.values()):
                continue
            root = next((r for r in roots if mname == r or mname.startswith(r + ".")), mname)
            if root not in members:
                members[root] = []
                order.append(root)
            members[root].append((mname, m))
        for index, root_fqn in enumerate(order):
            weights, pieces, offset = [], [], 0
            dtypes = set()
            for mname, m in members[root_fqn]:
                for pname, p in list(m._parameters.items()):
                    if p is None or not p.requires_grad:  # frozen weights stay put, replicated and unsynced
                        continue
                    fqn = f"{mname}.{pname}" if mname else pname
                    weights.append(_Weight(m, pname, fqn, p.shape, offset, p.numel()))
                    pieces.append(p.detach().reshape(-1))
                    dtypes.add(p.dtype)
                    offset += p.numel()
            if len(dtypes) != 1:
                raise ValueError(f"unit {root_fqn or '<root>'} mixes parameter dtypes {dtypes}")
            numel = offset
            padded = -(-numel // self.world_size) * self.world_size
            flat = torch.cat(pieces)
            flat = torch.nn.functional.pad(flat, (0, padded - numel))
            n = padded // self.world_size
            shard = nn.Parameter(flat[self.rank * n:(self.rank + 1) * n].clone())
            for w in weights:  # the module forgets its full weight; the unit hands it a view per step
                del w.module._parameters[w.attr]
                setattr(w.module, w.attr, None)
            root = self.module.get_submodule(root_fqn) if root_fqn else self.module
            unit = _Unit(index=index, fqn=root_fqn, root=root, weights=weights, numel=numel,
                         padded=padded, shard=shard)
            cdtype = self.compute_dtype or shard.dtype
            unit.full = torch.empty(padded, dtype=cdtype, device=shard.device)
            unit.full.untyped_storage().resize_(0)
            self._units.append(unit)

    def _build_replicated(self) -> None:
        for mname, m in self.module.named_modules():
            for pname, p in list(m._parameters.items()):
                if p is None or not p.requires_grad:
                    continue
                fqn = f"{mname}.{pname}" if mname else pname
                del m._parameters[pname]
                setattr(m, pname, None)
                self._replicated.append(_Replicated(m, pname, fqn, p))

    # ---- the parameters the optimizer sees ------------------------------------------------------

    def shard_parameters(self) -> list[nn.Parameter]:
        return list(self.flat_shards)

    def replicated_parameters(self) -> list[nn.Parameter]:
        return list(self.replicated)

    def shard_layout(self) -> list[dict]:
        """Per unit: its name, the weights in its flat vector (name, shape, offset), sizes."""
        return [{"unit": u.fqn, "numel": u.numel, "padded": u.padded, "shard_numel": u.shard_numel,
                 "weights": [(w.fqn, tuple(w.shape), w.offset) for w in u.weights]} for u in self._units]

    # ---- gather / free --------------------------------------------------------------------------

    @torch.no_grad()
    def _start_gather(self, unit: _Unit) -> None:
        if unit.state != FREE:
            return
        storage = unit.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(unit.padded * unit.full.element_size())
        src = unit.shard.detach()
        if self.compute_dtype is not None and src.dtype != self.compute_dtype:
            src = src.to(self.compute_dtype)  # cast before communication: half the bytes in bf16
        unit.gather_src = src
        unit.handle = dist.all_gather_into_tensor(unit.full, src, group=self.process_group, async_op=True)
        unit.state = GATHERING

    def _wait_gather(self, unit: _Unit) -> None:
        if unit.state == FREE:
            self._start_gather(unit)
        if unit.state == GATHERING:
            unit.handle.wait()
            unit.handle = unit.gather_src = None
            unit.state = READY

    def _free(self, unit: _Unit) -> None:
        if unit.state == GATHERING:
            self._wait_gather(unit)
        unit.full.untyped_storage().resize_(0)
        unit.state = FREE

    def _prefetch(self, order: list[int], current: int) -> None:
        if self.prefetch == 0 or current not in order:
            return
        pos = order.index(current)
        for index in order[pos + 1:pos + 1 + self.prefetch]:
            self._start_gather(self._units[index])

    # ---- hooks ----------------------------------------------------------------------------------

    def _make_pre_forward(self, unit: _Unit):
        def hook(module, args):
            self._fwd_record.append(unit.index)
            self._start_gather(unit)  # own gather first: the communication stream runs them in issue order
            self._prefetch(self._fwd_order, unit.index)
            self._wait_gather(unit)
            unit.leaves = []
            grad_on = torch.is_grad_enabled()
            for i, w in enumerate(unit.weights):
                # .data: a view with its own version counter, so re-filling the buffer for backward
                # does not trip autograd's check on the tensors it saved
                leaf = unit.full[w.offset:w.offset + w.numel].view(w.shape).data
                if grad_on:
                    leaf.requires_grad_(True)
                    leaf.register_post_accumulate_grad_hook(self._make_grad_hook(unit, i))
                setattr(w.module, w.attr, leaf)
                unit.leaves.append(leaf)
        return hook

    def _make_post_forward(self, unit: _Unit):
        def hook(module, args, output):
            tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
            backward_follows = torch.is_grad_enabled() and bool(tensors)
            # the unit that runs last in forward is the first in backward: keep it gathered
            if not (backward_follows and self._fwd_order and unit.index == self._fwd_order[-1]):
                self._free(unit)
            if backward_follows:
                pre_backward = self._make_pre_backward(unit)
                if len(tensors) == 1:
                    tensors[0].register_hook(lambda grad: pre_backward())
                else:
                    torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: pre_backward(),
                                                                  mode="any")
        return hook

    def _make_pre_backward(self, unit: _Unit):
        def pre_backward():
            if not self._in_backward:
                self._in_backward = True
                self._bwd_record = []
            self._bwd_record.append(unit.index)
            self._start_gather(unit)
            self._prefetch(self._bwd_order, unit.index)
            self._wait_gather(unit)
        return pre_backward

    def _make_grad_hook(self, unit: _Unit, i: int):
        @torch.no_grad()
        def hook(leaf: torch.Tensor):
            w = unit.weights[i]
            rdtype = self.reduce_dtype or unit.shard.dtype
            if unit.grad_flat is None:
                unit.grad_flat = torch.empty(unit.padded, dtype=rdtype, device=unit.shard.device)
                if unit.padded > unit.numel:
                    unit.grad_flat[unit.numel:].zero_()
                unit.grads_in = 0
                unit.grads_seen = set()
            unit.grad_flat[w.offset:w.offset + w.numel].copy_(leaf.grad.reshape(-1))
            leaf.grad = None
            unit.grads_in += 1
            unit.grads_seen.add(i)
            if unit.grads_in == len(unit.weights):
                self._free(unit)  # this unit's backward is done with the gathered weights
                self._reduce_scatter(unit)
        return hook

    @torch.no_grad()
    def _reduce_scatter(self, unit: _Unit) -> None:
        flat, unit.grad_flat = unit.grad_flat, None
        flat.div_(self.world_size)  # sum of grad/world_size: the average (gloo has no AVG); exact for 2^k
        out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
        handle = dist.reduce_scatter_tensor(out, flat, group=self.process_group, async_op=True)
        unit.reduced = True
        self._pending_reduce.append((unit, handle, out, flat))
        # at most one reduce-scatter's buffers wait in flight besides the newest (memory stays at
        # about two units' gradients); wait() only makes the compute stream wait on NCCL, and the
        # older reduce-scatter has had a whole unit's backward to finish
        while len(self._pending_reduce) > 1:
            self._complete_reduce(self._pending_reduce.pop(0))

    @staticmethod
    @torch.no_grad()
    def _complete_reduce(item) -> None:
        unit, handle, out, _ = item
        handle.wait()
        out = out.to(unit.shard.dtype)
        if unit.shard.grad is None:
            unit.shard.grad = out
        else:
            unit.shard.grad.add_(out)

    def _make_replicated_pre_forward(self, module: nn.Module):
        entries = [r for r in self._replicated if r.module is module]

        def hook(mod, args):
            grad_on = torch.is_grad_enabled()
            for r in entries:
                leaf = r.param.detach()
                if self.compute_dtype is not None:
                    leaf = leaf.to(self.compute_dtype)
                if grad_on:
                    leaf.requires_grad_(True)
                    leaf.register_post_accumulate_grad_hook(self._make_replicated_grad_hook(r))
                setattr(mod, r.attr, leaf)
        return hook

    @staticmethod
    def _make_replicated_grad_hook(r: _Replicated):
        @torch.no_grad()
        def hook(leaf: torch.Tensor):
            g = leaf.grad.to(r.param.dtype)
            r.grad = g if r.grad is None else r.grad.add_(g)
            leaf.grad = None
        return hook

    # ---- the public step interface --------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._pending_reduce or any(u.grads_in for u in self._units):
            self.finish_gradient_synchronization()  # a previous backward was not finished
        if self._fwd_record:
            self._fwd_order = self._fwd_record
        self._fwd_record = []
        self._in_backward = False
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient reductions; afterwards each shard's ``.grad`` holds its slice of the
        averaged gradient and each replicated parameter's ``.grad`` the averaged gradient."""
        for unit in self._units:  # units with some weights unused this step: send what they have
            if unit.grad_flat is not None and not unit.reduced:
                for i, w in enumerate(unit.weights):
                    if i not in unit.grads_seen:
                        unit.grad_flat[w.offset:w.offset + w.numel].zero_()
                self._free(unit)
                self._reduce_scatter(unit)
        while self._pending_reduce:
            self._complete_reduce(self._pending_reduce.pop(0))
        for unit in self._units:
            if unit.state != FREE:
                self._free(unit)  # prefetched but not used
            unit.grads_in, unit.reduced, unit.leaves = 0, False, []
            unit.grads_seen = set()
        with_grad = [r for r in self._replicated if r.grad is not None]
        if with_grad:
            flat = torch.cat([r.grad.reshape(-1) for r in with_grad]).div_(self.world_size)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            offset = 0
            for r in with_grad:
                g = flat[offset:offset + r.grad.numel()].view_as(r.param)
                offset += r.grad.numel()
                r.param.grad = g.clone() if r.param.grad is None else r.param.grad.add_(g)
                r.grad = None
        if self._in_backward and self._bwd_record:
            self._bwd_order = self._bwd_record
        self._in_backward = False

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter in full (fp32 masters), by its name in the wrapped module.

        A collective: all ranks must call it. Frozen parameters are included as they are."""
        out: dict[str, torch.Tensor] = {}
        for unit in self._units:
            full = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
            dist.all_gather_into_tensor(full, unit.shard.detach(), group=self.process_group)
            for w in unit.weights:
                out[w.fqn] = full[w.offset:w.offset + w.numel].view(w.shape).clone()
        for r in self._replicated:
            out[r.fqn] = r.param.detach().clone()
        for name, p in self.module.named_parameters():
            out.setdefault(name, p.detach().clone())
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
