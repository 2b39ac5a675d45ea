"""Activation checkpointing, applied from outside the model.

The model's blocks stay where they are: ``model.layers`` remains a ModuleList of the real
TransformerBlocks (same modules, same parameter names), so compiling the blocks or grouping
their parameters sees real modules. What changes is how the model runs them: its
``layer_runner`` (None: one after the other) becomes a runner that calls groups of blocks under
``torch.utils.checkpoint`` (non-reentrant), which stores only each group's input and runs the
group's forward again in the backward.

- ``apply_activation_checkpointing(model, group_size, save="none")``: one level, ``group_size``
  consecutive blocks per checkpointed group. ``save="attention"`` makes it selective: the outputs
  of the attention kernels (SDPA's, and our Triton op's) are kept from the forward (``SAVED_OPS``),
  so the backward recomputes everything in the group except attention, the most expensive op per
  byte it produces (the 8B leaderboard block, context 32,768: 256 MiB of bf16 output for 8.8 of the
  block's 22 forward TFLOP, the rest its GEMMs). Attention that is not one op (naive, the
  FlashAttentionTriton autograd.Function called directly) is recomputed as before.
- ``apply_nested_checkpointing(model, branching=2, leaf_size=1)``: recursive: the blocks split
  into ``branching`` checkpointed chunks, each split again, down to ``leaf_size`` blocks:
  O(log N) stored boundaries for O(N log N) block forwards (branching 2).
- ``apply_chain_checkpointing(model)``: the least memory, whatever the compute: only the first
  block's input is kept, and the backward of each block recomputes every block before it from
  that input. One block's residuals and O(1) boundaries at any time, N (N + 1) / 2 extra block
  forwards.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

from systems.config import check_choice

# the ops whose outputs a selective checkpoint keeps, by qualified name. "attention":
# F.scaled_dot_product_attention's kernels, by backend (cuDNN, flash, memory-efficient, and the
# CPU's flash kernel that the tests run), and our Triton FlashAttention-2's forward op
# (attention/flash_triton/op.py); each returns the output and the log-sum-exp its backward needs.
# Names, not op objects: matching needs neither triton imported nor every kernel in this build
SAVED_OPS = {"attention": frozenset({"aten::_scaled_dot_product_cudnn_attention",
                                     "aten::_scaled_dot_product_flash_attention",
                                     "aten::_scaled_dot_product_efficient_attention",
                                     "aten::_scaled_dot_product_flash_attention_for_cpu",
                                     "systems::flash_attention_forward"})}  # flash_triton/op.py's FORWARD_OP
# what a checkpointed group keeps from its forward besides its input: "none" (full recompute) or
# one of SAVED_OPS
CHECKPOINT_SAVES = ("none", *SAVED_OPS)


def _policy(save: str, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op.name() in SAVED_OPS[save] else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(save: str):
    """The ``context_fn`` of torch.utils.checkpoint that keeps ``save``'s ops' outputs."""
    if save == "none":
        return noop_context_fn
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, save))


def _run_plain(blocks: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x, positions)
    return x


@dataclass(frozen=True)
class GroupCheckpointing:
    """Runs the blocks in checkpointed groups of ``group_size``, keeping the outputs of ``save``'s
    ops (``CHECKPOINT_SAVES``) besides each group's input."""

    group_size: int
    save: str = "none"

    def __call__(self, layers: nn.ModuleList, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        context_fn = _context_fn(self.save)
        for lo in range(0, len(layers), self.group_size):
            x = checkpoint(_run_plain, layers[lo:lo + self.group_size], x, positions, use_reentrant=False,
                           context_fn=context_fn)
        return x


@dataclass(frozen=True)
class NestedCheckpointing:
    """Splits the blocks into ``branching`` checkpointed chunks, recursively, down to chunks of
    ``leaf_size`` blocks that run plainly. With branching 2 the depth is log2 N."""

    branching: int
    leaf_size: int = 1

    def __call__(self, layers: nn.ModuleList, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._run(list(layers), x, positions)

    def _run(self, blocks: list[nn.Module], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if len(blocks) <= self.leaf_size:
            return _run_plain(blocks, x, positions)
        n_chunks = min(self.branching, len(blocks))
        bounds = [round(i * len(blocks) / n_chunks) for i in range(n_chunks + 1)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            x = checkpoint(self._run, blocks[lo:hi], x, positions, use_reentrant=False)
        return x


def _run_chain(blocks: list[nn.Module], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if len(blocks) > 1:
        # every block before the last, checkpointed again: only x is kept, and this inner region is
        # recomputed from x when the backward reaches it, after the last block's backward is done
        x = checkpoint(_run_chain, blocks[:-1], x, positions, use_reentrant=False)
    return blocks[-1](x, positions)


@dataclass(frozen=True)
class ChainCheckpointing:
    """Keeps only the input of the first block. The backward of the outer region recomputes
    blocks 1..N (blocks 1..N-1 inside an inner region that stores only x again), runs the backward
    of block N, then the inner region does the same for N-1 blocks, and so on: at any time one
    block's residuals, its input gradient and x are alive (O(1) in N), for
    N + N (N + 1) / 2 block forwards in all (O(N^2))."""

    def __call__(self, layers: nn.ModuleList, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return checkpoint(_run_chain, list(layers), x, positions, use_reentrant=False)


def _n_blocks(model: nn.Module) -> int:
    if not isinstance(getattr(model, "layers", None), nn.ModuleList) or not hasattr(model, "layer_runner"):
        raise ValueError(f"expected a TransformerLM (a .layers ModuleList and a .layer_runner), "
                         f"got {type(model).__name__}")
    return len(model.layers)


def apply_activation_checkpointing(model: nn.Module, group_size: int, *, save: str = "none") -> nn.Module:
    """One level of checkpointing over groups of ``group_size`` consecutive blocks, in place,
    keeping the outputs of ``save``'s ops (see ``CHECKPOINT_SAVES``)."""
    n = _n_blocks(model)
    if not isinstance(group_size, int) or not 1 <= group_size <= n:
        raise ValueError(f"group_size must be an integer in 1..{n} (the number of blocks), got {group_size!r}")
    check_choice("checkpoint save", save, CHECKPOINT_SAVES)
    model.layer_runner = GroupCheckpointing(group_size, save)
    return model


def apply_nested_checkpointing(model: nn.Module, *, branching: int = 2, leaf_size: int = 1) -> nn.Module:
    """Recursive checkpointing, in place (see ``NestedCheckpointing``)."""
    n = _n_blocks(model)
    if not isinstance(branching, int) or branching < 2:
        raise ValueError(f"branching must be an integer >= 2, got {branching!r}")
    if not isinstance(leaf_size, int) or not 1 <= leaf_size <= n:
        raise ValueError(f"leaf_size must be an integer in 1..{n}, got {leaf_size!r}")
    model.layer_runner = NestedCheckpointing(branching, leaf_size)
    return model


def apply_chain_checkpointing(model: nn.Module) -> nn.Module:
    """Constant-memory checkpointing at quadratic recompute, in place (see ``ChainCheckpointing``)."""
    _n_blocks(model)
    model.layer_runner = ChainCheckpointing()
    return model


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    _n_blocks(model)
    model.layer_runner = None
    return model


@contextlib.contextmanager
def count_block_forwards(model: nn.Module) -> Iterator[Counter]:
    """Counts forward calls of each block (recomputation included): the compute side of checkpointing."""
    counter: Counter = Counter()
    handles = [block.register_forward_pre_hook(lambda m, args, i=i: counter.update([i]))
               for i, block in enumerate(model.layers)]
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()


def sqrt_group_size(n_layers: int) -> int:
    """The one-level group size that balances stored boundaries (N/k) against one group's recompute (k)."""
    return max(1, round(math.sqrt(n_layers)))
