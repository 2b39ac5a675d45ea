"""Optimizer state sharding (ZeRO stage 1 style): each rank keeps optimizer state for its shard only.

``ShardedOptimizer(params, optimizer_cls, **kwargs)`` wraps any ``torch.optim.Optimizer`` class:

- every parameter is owned by exactly one rank; ownership is assigned greedily by size (largest
  first, to the rank with the fewest elements so far), so the ranks' shares differ by at most one
  parameter's size. Groups added later with ``add_param_group`` continue from the same loads;
- the inner ``optimizer_cls`` instance sees only this rank's parameters (with the same group
  options), so its state (AdamW: two fp32 moments) covers 1/world_size of the model;
- ``step()`` runs the inner optimizer, then every owner broadcasts its updated parameters. Large
  parameters are broadcast in place; small ones (norm weights, biases) are packed per owner into
  flat buckets of at most ``bucket_mb`` MiB so they cost a few messages instead of one each. All
  broadcasts are issued asynchronously and waited for together.

Gradients must already be identical on all ranks (for instance synchronised by a DDP wrapper)
before ``step``; the wrapper does no gradient communication itself. Frozen parameters
(``requires_grad=False``) are assigned but never broadcast. Tied parameters are one
``nn.Parameter`` and so one entry. ``state_dict()`` is this rank's shard of the state.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from systems.optim import closure_loss

MiB = 1024 * 1024


def balanced_assignment(sizes: list[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """Owner rank of each size: largest first onto the least-loaded rank (ties: lowest rank).

    ``loads`` (elements already owned per rank) is updated in place, so later calls continue the
    balance. Deterministic, hence identical on every rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size if loads is None else loads
    if len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries for world_size {world_size}")
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """Shard ``optimizer_cls``'s state over the ranks of ``process_group`` (default: WORLD)."""

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], *,
                 process_group: dist.ProcessGroup | None = None, bucket_mb: float = 1.0, **kwargs: Any):
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialised process group "
                               "(systems.parallel.launch.spawn or run_from_env)")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, dict(kwargs)
        self.bucket_bytes = bucket_mb * MiB
        self.loads = [0] * self.world_size  # elements owned per rank
        self.owner: dict[torch.Tensor, int] = {}  # parameter -> owning rank
        self.optimizer: torch.optim.Optimizer | None = None
        self._plan: list | None = None
        # the base constructor calls self.add_param_group for every group, which assigns owners
        super().__init__(params, defaults=dict(kwargs))
        # the inner optimizer: one group per outer group (so schedulers that change the outer
        # groups' options reach it), holding only the parameters this rank owns
        inner_groups = [self._owned_group(g) for g in self.param_groups]
        self.optimizer = optimizer_cls(inner_groups, **kwargs)
        self.state = self.optimizer.state  # the only optimizer state this rank keeps

    # ---- assignment -------------------------------------------------------------------------

    def _owned_group(self, group: dict) -> dict:
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in group["params"] if self.owner[p] == self.rank]}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # validates, fills defaults, rejects duplicates
        group = self.param_groups[-1]
        owners = balanced_assignment([p.numel() for p in group["params"]], self.world_size, self.loads)
        for p, rank in zip(group["params"], owners):
            self.owner[p] = rank
        self._plan = None
        if self.optimizer is not None:  # a group added after construction
            self.optimizer.add_param_group(self._owned_group(group))

    def owned_parameters(self, rank: int | None = None) -> list[torch.Tensor]:
        rank = self.rank if rank is None else rank
        return [p for g in self.param_groups for p in g["params"] if self.owner[p] == rank]

    # ---- step -------------------------------------------------------------------------------

    def _sync_options(self) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    def _broadcast_plan(self) -> list[tuple[int, list[torch.Tensor]]]:
        """(owner, params) messages in a rank-independent order: one per large parameter, packed
        buckets for small ones (same owner, dtype and device)."""
        if self._plan is not None:
            return self._plan
        plan, open_buckets = [], {}
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                nbytes = p.numel() * p.element_size()
                if nbytes >= self.bucket_bytes or not p.is_contiguous():
                    plan.append((self.owner[p], [p]))
                    continue
                key = (self.owner[p], p.dtype, p.device)
                bucket = open_buckets.get(key)
                if bucket is None or bucket[0] + nbytes > self.bucket_bytes:
                    bucket = open_buckets[key] = [0, []]
                    plan.append((self.owner[p], bucket[1]))
                bucket[0] += nbytes
                bucket[1].append(p)
        self._plan = plan
        return plan

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every owner sends its parameters to the other ranks (async, then one wait for all)."""
        if self.world_size == 1:
            return
        pending = []
        for owner, params in self._broadcast_plan():
            src = dist.get_global_rank(self.process_group, owner) if self.process_group is not None else owner
            if len(params) == 1 and params[0].is_contiguous():
                pending.append((dist.broadcast(params[0].data, src=src, group=self.process_group,
                                               async_op=True), owner, None, None))
                continue
            if owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                                   device=params[0].device)
            pending.append((dist.broadcast(flat, src=src, group=self.process_group, async_op=True),
                            owner, flat, params))
        for handle, owner, flat, params in pending:
            handle.wait()
            if flat is not None and owner != self.rank:
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def step(self, closure: Callable | None = None, **kwargs):
        loss = closure_loss(closure)
        self._sync_options()
        self.optimizer.step(**kwargs)
        self.broadcast_parameters()
        return loss

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's inner-optimizer state dict (its shard); load it on the same rank."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.state = self.optimizer.state

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held on this rank."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t))
