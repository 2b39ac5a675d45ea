"""torch.compile applied from outside the model: per block, or the whole model."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn

from systems.config import check_choice

COMPILE_SCOPES = ("none", "blocks", "model")


def compile_blocks(blocks: Iterable[nn.Module], *, mode: str | None = None) -> None:
    """torch.compile each block in place. One compiled graph serves all blocks (same code, same
    shapes; parameters are graph inputs), so compile time does not grow with depth; hooks on the
    parameters (DDP's, the optimizer-in-backward's) stay outside the graphs."""
    for block in blocks:
        block.compile(mode=mode)


def apply_compile(model: nn.Module, *, scope: str, mode: str | None = None) -> Callable:
    """What to call for the model's forward: the model itself with its blocks compiled in place
    ("blocks"), a compiled whole model ("model": one graph per mode, whose compile time grows
    with depth), or the model unchanged ("none")."""
    check_choice("compile scope", scope, COMPILE_SCOPES)
    if scope == "blocks":
        compile_blocks(model.layers, mode=mode)
    elif scope == "model":
        return torch.compile(model, mode=mode)
    return model
