"""Triton helpers the fused kernels share: a block of elements loaded (as stored, or as fp32) and
stored back in the pointer's own dtype, masked only where the block can run past the end (a
compile-time choice)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load(ptr, offs, numel, MASKED: tl.constexpr):
    """A block in the element type ``ptr`` points to (integers too: lanes past the end read 0)."""
    if MASKED:
        x = tl.load(ptr + offs, mask=offs < numel, other=0)
    else:
        x = tl.load(ptr + offs)
    return x


@triton.jit
def load_f32(ptr, offs, numel, MASKED: tl.constexpr):
    return load(ptr, offs, numel, MASKED).to(tl.float32)


@triton.jit
def store_as(ptr, x, offs, numel, MASKED: tl.constexpr):
    """Store ``x`` in the element type ``ptr`` points to."""
    if MASKED:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=offs < numel)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty))
