"""FlashAttention-2 in PyTorch (systems/attention/flash_pytorch.py): the tiled forward and the
recompute backward against the direct float64 formula, on shapes that are not multiples of the
tile, with n_queries != n_keys, causal and not; its input errors."""

from __future__ import annotations

import pytest
import torch

from systems.attention import FlashAttentionPytorch, flash_attention_pytorch
from systems.attention.flash_pytorch import flash_forward
from tests.attention.reference import run_and_compare

# shapes: (q shape, n_keys, causal); non-powers of two, n_q != n_k, extra leading dims
CPU_CASES = [
    ((2, 64, 16), 64, False),
    ((2, 37, 16), 37, True),
    ((3, 45, 32), 77, True),  # fewer queries than keys: they are the last 45 positions
    ((2, 70, 24), 33, False),  # more queries than keys (non-causal only)
    ((2, 3, 50, 64), 50, True),  # (batch, heads, seq, d)
]


@pytest.mark.parametrize("shape_q,n_k,causal", CPU_CASES)
def test_pytorch_matches_reference(shape_q, n_k, causal):
    # fp32 tiles vs float64: errors are a few ulp of fp32 times the number of tiles
    run_and_compare(FlashAttentionPytorch.apply, shape_q, n_k, torch.float32, causal, "cpu", tol=1e-5)


def test_pytorch_float64_is_exact():
    # in float64 the only difference to the direct formula is summation order
    run_and_compare(FlashAttentionPytorch.apply, (2, 40, 16), 40, torch.float64, True, "cpu", tol=1e-12)


def test_pytorch_forward_tiles_do_not_matter():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 50, 32, generator=gen) for _ in range(3))
    o16, l16 = flash_forward(q, k, v, True, tile_q=16, tile_k=16)
    o48, l48 = flash_forward(q, k, v, True, tile_q=48, tile_k=32)
    torch.testing.assert_close(o16, o48, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(l16, l48, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(k=torch.zeros(2, 10, 8), v=torch.zeros(2, 10, 8)), "head dim"),
    (dict(v=torch.zeros(2, 11, 16)), "same shape"),
    (dict(q=torch.zeros(3, 10, 16)), "leading"),
    (dict(k=torch.zeros(2, 10, 16, dtype=torch.float64)), "one dtype"),
    (dict(q=torch.zeros(2, 12, 16), causal=True), "more queries"),
    (dict(q=torch.zeros(2, 10, 16, dtype=torch.int32)), "dtype"),
])
def test_pytorch_rejects_bad_inputs(bad, match):
    args = dict(q=torch.zeros(2, 10, 16), k=torch.zeros(2, 10, 16), v=torch.zeros(2, 10, 16), causal=False)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        FlashAttentionPytorch.apply(args["q"], args["k"], args["v"], args["causal"])


def test_head_dim_zero_is_a_value_error():
    # 1 / sqrt(0) raised ZeroDivisionError from inside the forward before the shared check
    empty = torch.zeros(2, 10, 0)
    with pytest.raises(ValueError, match="head dim must be at least 1"):
        flash_attention_pytorch(empty, empty, empty, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pytorch_flash_matches_reference():
    run_and_compare(FlashAttentionPytorch.apply, (2, 2, 300, 64), 300, torch.float32, True, "cuda", tol=1e-4)
