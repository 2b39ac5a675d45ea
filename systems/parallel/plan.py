"""Parallelism applied from outside the model, in one place and one fixed order.

``ParallelPlan`` says what to apply; ``apply(model, plan)`` applies it, always in this order:

1. activation checkpointing (the model's layer runner; ``systems.parallel.checkpoint``);
2. torch.compile, per block or of the whole model (``systems.parallel.compile``);
3. data parallelism: our DDP variants (``systems.parallel.ddp``; ``peer``: gradients copied into
   the other ranks' memory by copy engines and averaged inside the update, ``systems.parallel.peer``),
   torch's DDP, our FSDP (``systems.parallel.fsdp``) or torch's FSDP2 (``fully_shard`` per block
   and on the root).

Checkpointing goes first so that compiling a block compiles the block itself (the runner calls
the compiled blocks); data parallelism goes last because its hooks live on the parameters and
modules that the earlier steps leave in place. The optimizer is built afterwards over
``Parallelized.params_owner`` (FSDP trains its shards, not the model's parameters), except for
``update_per_bucket`` and ``peer``, whose units are the groups of an optimizer built first and
passed to ``apply``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from systems.config import check_choice
from systems.measure.devices import DTYPES
from systems.parallel.checkpoint import (CHECKPOINT_SAVES, apply_activation_checkpointing,
                                        apply_nested_checkpointing)
from systems.parallel.compile import COMPILE_SCOPES, apply_compile

DATA_PARALLEL = ("none", "naive", "flat", "overlap", "bucketed", "peer", "torch_ddp", "fsdp", "fsdp2")
OURS_DDP = ("naive", "flat", "overlap", "bucketed", "peer")
# data parallelism that updates the optimizer's groups itself: apply needs that optimizer
NEEDS_GROUPED_OPTIMIZER = ("peer",)
# data parallelism whose work happens in the wrapper's own forward or in module hooks on the root:
# a step must call the wrapper (the logits loss), not model.hidden_states (the fused loss)
FORWARD_WRAPPERS = ("torch_ddp", "fsdp", "fsdp2")


@dataclass(frozen=True)
class ParallelPlan:
    """What ``apply`` does to a model. Every field's default is "nothing"."""

    checkpoint_group: int = 0  # blocks per checkpointed group (one level); 0: no checkpointing
    checkpoint_save: str = "none"  # with checkpoint_group: ops whose outputs a group keeps (CHECKPOINT_SAVES)
    checkpoint_branching: int = 0  # nested checkpointing with this branching factor; 0: none
    compile: str = "none"  # none | blocks | model
    compile_mode: str | None = None  # torch.compile's mode, e.g. "reduce-overhead" (CUDA graphs)
    data_parallel: str = "none"  # see DATA_PARALLEL
    bucket_size_mb: float | None = None  # bucketed: the bucket cap
    last_bucket_mb: float | None = None  # bucketed: a separate cap for the last bucket (the embedding)
    reduce_dtype: str | None = None  # bucketed: all-reduce the gradients in this dtype ("bf16")
    # bucketed: one bucket per group of a GroupedOptimizer (apply's ``optimizer``), each group
    # updated as soon as its gradients are averaged, while later buckets are still in flight
    update_per_bucket: bool = False
    copy_streams: int = 1  # peer: side streams the groups' gradient copies take in turn (copy engines at once)
    # peer: each group's copies replayed as one CUDA graph while its gradients keep their addresses
    # (fewer host calls where the backward waits on the host: the default compile mode)
    copy_graphs: bool = False
    # peer: the hooks' copies, barriers and stream switches made by a worker thread, off the
    # thread that runs the backward (which waits on the host in the default compile mode)
    issue_thread: bool = False
    # peer: no hooks; every copy issued after the backward, each group's update waiting for its own
    defer_copies: bool = False
    # peer, 2 GPUs: no copies; each update reads the other rank's gradients over NVLink where they lie
    read_peers: bool = False
    param_dtype: str | None = None  # fsdp / fsdp2: compute (and communicate) in this dtype ("bf16")
    prefetch: int = 1  # fsdp: units whose all-gather runs ahead of the forward

    def __post_init__(self) -> None:
        if self.checkpoint_group < 0 or self.checkpoint_branching < 0:
            raise ValueError("checkpoint_group and checkpoint_branching must be >= 0 (0 turns them off)")
        if self.checkpoint_group and self.checkpoint_branching:
            raise ValueError("choose one checkpointing: checkpoint_group (one level) or checkpoint_branching (nested)")
        check_choice("checkpoint_save", self.checkpoint_save, CHECKPOINT_SAVES)
        if self.checkpoint_save != "none" and not self.checkpoint_group:
            raise ValueError(f"checkpoint_save={self.checkpoint_save!r} selects what checkpointed groups keep: "
                             "set checkpoint_group too")
        check_choice("compile", self.compile, COMPILE_SCOPES)
        if self.compile_mode is not None and self.compile == "none":
            raise ValueError("compile_mode needs compile='blocks' or 'model'")
        check_choice("data_parallel", self.data_parallel, DATA_PARALLEL)
        bucketed = self.data_parallel == "bucketed"
        if self.update_per_bucket:
            if self.bucket_size_mb is not None or self.last_bucket_mb is not None:
                raise ValueError("update_per_bucket makes one bucket per optimizer group: leave bucket_size_mb and "
                                 "last_bucket_mb unset")
        elif bucketed and not (self.bucket_size_mb or 0) > 0:
            raise ValueError("data_parallel='bucketed' needs a positive bucket_size_mb")
        for name in ("bucket_size_mb", "last_bucket_mb", "reduce_dtype", "update_per_bucket"):
            if getattr(self, name) not in (None, False) and not bucketed:
                raise ValueError(f"{name} applies to data_parallel='bucketed' only")
        if not (isinstance(self.copy_streams, int) and self.copy_streams >= 1):
            raise ValueError(f"copy_streams must be a positive integer, got {self.copy_streams!r}")
        if self.copy_streams != 1 and self.data_parallel != "peer":
            raise ValueError("copy_streams applies to data_parallel='peer' only")
        for name in ("copy_graphs", "issue_thread", "defer_copies", "read_peers"):
            if getattr(self, name) and self.data_parallel != "peer":
                raise ValueError(f"{name} applies to data_parallel='peer' only")
        if self.last_bucket_mb is not None and not self.last_bucket_mb > 0:
            raise ValueError(f"last_bucket_mb must be positive, got {self.last_bucket_mb!r}")
        for name in ("reduce_dtype", "param_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}; got {value!r}")
        if self.param_dtype is not None and self.data_parallel not in ("fsdp", "fsdp2"):
            raise ValueError("param_dtype applies to data_parallel='fsdp' or 'fsdp2' only")
        if self.data_parallel in ("torch_ddp", "fsdp", "fsdp2") and self.compile == "model":
            raise ValueError(f"compile='model' with data_parallel={self.data_parallel!r} is not supported: "
                             "use compile='blocks'")
        if not (isinstance(self.prefetch, int) and 0 <= self.prefetch <= 2):
            raise ValueError(f"prefetch must be 0, 1 or 2, got {self.prefetch!r}")

    @property
    def distributed(self) -> bool:
        """Whether applying this plan needs an initialised process group."""
        return self.data_parallel != "none"

    def check_loss(self, loss: str) -> None:
        """The fused loss calls model.hidden_states and skips the wrapper's forward: refuse it
        where that forward (or a hook on the root) does the work."""
        if loss == "fused" and (self.data_parallel in FORWARD_WRAPPERS or self.compile == "model"):
            raise ValueError(f"the fused loss bypasses the model's forward, which {self.data_parallel if self.compile != 'model' else 'compile=model'} "
                             "needs: use loss='logits'")


@dataclass
class Parallelized:
    """A model after ``apply``: what the training step calls and synchronises."""

    model: nn.Module  # the model (checkpointing and compiled blocks applied in place)
    forward: Callable  # what computes the logits: the wrapper, a compiled model, or the model
    grad_sync: object | None = None  # a wrapper with finish_gradient_synchronization(), for the step
    wrapper: nn.Module | None = None  # the data-parallel wrapper, if any

    @property
    def params_owner(self) -> nn.Module:
        """The module whose parameters the optimizer updates (our FSDP's: its shards)."""
        from systems.parallel.fsdp import FSDP

        return self.wrapper if isinstance(self.wrapper, FSDP) else self.model

    def remove(self) -> None:
        """Detach the wrapper's hooks, so the same model can be wrapped differently next."""
        remove = getattr(self.wrapper, "remove_hooks", None)
        if remove is not None:
            remove()


def _data_parallel(model: nn.Module, plan: ParallelPlan, device: torch.device,
                   optimizer) -> tuple[nn.Module | None, object]:
    """(wrapper, grad_sync) for the plan's data parallelism."""
    kind = plan.data_parallel
    if kind == "peer":
        from systems.parallel.peer import DDPPeer

        ddp = DDPPeer(model, optimizer=optimizer, copy_streams=plan.copy_streams, copy_graphs=plan.copy_graphs,
                      issue_thread=plan.issue_thread, defer_copies=plan.defer_copies, read_peers=plan.read_peers)
        return ddp, ddp
    if kind in OURS_DDP:
        from systems.parallel.ddp import make_ddp

        options = {}
        if kind == "bucketed":
            options = {"bucket_size_mb": plan.bucket_size_mb, "last_bucket_mb": plan.last_bucket_mb,
                       "reduce_dtype": DTYPES[plan.reduce_dtype] if plan.reduce_dtype else None}
            if plan.update_per_bucket:
                options.update(groups=optimizer.groups, on_synced=optimizer.step_group)
        ddp = make_ddp(kind, model, **options)
        if plan.update_per_bucket:
            from systems.parallel.ddp import broadcast_optimizer_state

            # built before the wrapper's broadcast of the module: its masters are each rank's own
            broadcast_optimizer_state(optimizer, ddp.process_group)
        return ddp, ddp
    if kind == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), None
    if kind == "fsdp":
        from systems.parallel.fsdp import FSDP

        fsdp = FSDP(model, compute_dtype=DTYPES[plan.param_dtype] if plan.param_dtype else None,
                    prefetch=plan.prefetch)
        return fsdp, fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = DTYPES[plan.param_dtype] if plan.param_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return None, None


def apply(model: nn.Module, plan: ParallelPlan, *, device: torch.device | None = None,
          optimizer=None, loss: str | None = None) -> Parallelized:
    """Apply ``plan`` to ``model`` (in place where it can), in the module docstring's order.
    ``loss``: the step's loss (``StepSpec.loss``), checked against the plan before anything is
    applied (the fused loss bypasses the forward that torch's DDP, FSDP and a compiled model need).
    ``optimizer``: with ``update_per_bucket``, the ``GroupedOptimizer`` (``systems.train``) over
    ``model`` whose groups become the buckets; build it first (``OptimizerSpec(grouped=True)``).
    With ``data_parallel="peer"`` the same, of fused optimizers (``OptimizerSpec(kind="fused",
    grouped=True)``), which average the ranks' gradients inside their update."""
    if loss is not None:
        plan.check_loss(loss)
    grouped = hasattr(optimizer, "groups") and hasattr(optimizer, "step_group")
    if plan.update_per_bucket and not grouped:
        raise ValueError("update_per_bucket needs the optimizer whose groups become the buckets: build "
                         "build_optimizer(model, OptimizerSpec(grouped=True, ...)) first and pass it as optimizer=")
    if plan.data_parallel in NEEDS_GROUPED_OPTIMIZER and not (grouped and hasattr(optimizer, "fold_gradients")):
        raise ValueError(f"data_parallel={plan.data_parallel!r} updates the optimizer's groups and folds the other "
                         "ranks' gradients into the update: build build_optimizer(model, OptimizerSpec(kind='fused', "
                         "grouped=True, ...)) first and pass it as optimizer=")
    if plan.distributed:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(f"data_parallel={plan.data_parallel!r} needs an initialised process group "
                               "(systems.parallel.launch.spawn, or torchrun)")
    device = device or next(model.parameters()).device
    if plan.checkpoint_group:
        apply_activation_checkpointing(model, plan.checkpoint_group, save=plan.checkpoint_save)
    elif plan.checkpoint_branching:
        apply_nested_checkpointing(model, branching=plan.checkpoint_branching)
    forward = apply_compile(model, scope=plan.compile, mode=plan.compile_mode)
    if plan.data_parallel == "none":
        return Parallelized(model=model, forward=forward)
    wrapper, grad_sync = _data_parallel(model, plan, device, optimizer)
    if plan.data_parallel in OURS_DDP:
        # our DDP wrappers work through parameter hooks; their forward only calls the module, so
        # the step calls the (possibly compiled) model directly
        return Parallelized(model=model, forward=forward, grad_sync=grad_sync, wrapper=wrapper)
    if plan.data_parallel == "fsdp2":  # fully_shard changed the model's own class and hooks
        return Parallelized(model=model, forward=model)
    return Parallelized(model=model, forward=wrapper, grad_sync=grad_sync, wrapper=wrapper)
