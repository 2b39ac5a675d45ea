"""wgrad_adamw against the weight gradient computed in float64 and systems.optim's AdamW arithmetic
on the joined fp32 master.

The kernel runs under TRITON_INTERPRET=1 in a subprocess (fp16 activations: the interpreter's
bf16 tl.dot is wrong in some Triton releases, and its fp32 -> bf16 conversion truncates) and on
a GPU (marked gpu: bf16, the training step's dtype). The autograd Function (GPU only: it
multiplies in bf16): its dx against autograd's, and the weight it leaves against the same reference.
"""

from __future__ import annotations

import pytest
import torch

from systems.kernels.fused_adamw import join_master, split_master, step_scalars
from systems.optim import adamw_foreach_
from systems.testing import compile_ptx_for_h100, have_triton, interpreting, run_interpreter_cases

INTERPRETING = interpreting()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GROUP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def reference_step(dy, x, high, low, m, v, step):
    """The split master after one step with the gradient the autocast matmul returns: dy^T x
    (float64), rounded to the activations' dtype; AdamW on the joined fp32 master."""
    g = (dy.double().T @ x.double()).to(dy.dtype).float()
    master = join_master(high, low)
    m, v = m.clone(), v.clone()
    adamw_foreach_([master], [g], [m], [v], group=GROUP, step=step)
    high, low = split_master(master)
    return high, low, m, v, g


def exact_operands(shape, gen):
    """Multiples of 1/8 in [-2, 2]: every product and every partial sum of a few thousand of them
    is exact in fp32, so the kernel's gradient, summed in whatever order, is the float64 one, and
    its rounding to bf16 / fp16 the reference's."""
    return torch.randint(-16, 17, shape, generator=gen).float() / 8


# the same operations as the reference but for multiply-adds contracted on GPUs (and by the
# interpreter's numpy as it pleases): as tests/kernels/test_fused_adamw.py's KERNEL_TOL
KERNEL_TOL = dict(atol=1e-6, rtol=1e-5)


def run_kernel_case(*, tokens, n_out, n_in, tile, dtype, device, steps=2):
    from systems.kernels.wgrad_adamw import WeightUpdate, wgrad_adamw_

    gen = torch.Generator(device="cpu").manual_seed(tokens + n_out + n_in)
    high, low = split_master(torch.randn(n_out, n_in, generator=gen) * 0.1)
    m = torch.randn(n_out, n_in, generator=gen).abs() * 1e-3
    v = torch.rand(n_out, n_in, generator=gen) * 1e-5
    ours = [t.to(device) for t in (high, low, m, v)]
    for step in range(1, steps + 1):
        dy = exact_operands((tokens, n_out), gen).to(dtype)
        x = exact_operands((tokens, n_in), gen).to(dtype)
        high, low, m, v, g = reference_step(dy, x, high, low, m, v, step)
        update = WeightUpdate(low=ours[1], exp_avg=ours[2], exp_avg_sq=ours[3],
                              scalars=step_scalars(GROUP, step).to(device), tile=tile)
        wgrad_adamw_(dy.to(device), x.to(device), ours[0], update)
    got_master = join_master(ours[0].cpu(), ours[1].cpu())
    torch.testing.assert_close(ours[2].cpu(), m, **KERNEL_TOL)
    torch.testing.assert_close(ours[3].cpu(), v, **KERNEL_TOL)
    torch.testing.assert_close(got_master, join_master(high, low), **KERNEL_TOL)
    # the model's weight is its master rounded to nearest even, exactly
    assert torch.equal(ours[0].cpu(), got_master.to(torch.bfloat16))


def _tiles():
    from systems.kernels.wgrad_adamw import WgradTile

    return {"even": (WgradTile(block_out=16, block_in=32, block_k=16, num_warps=1, group=2), 64, 48, 64),
            "ragged": (WgradTile(block_out=32, block_in=16, block_k=16, num_warps=1, group=3), 40, 50, 35)}


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1 (test_interpreter_cases)")
@pytest.mark.parametrize("case", ["even", "ragged"])
def test_interp_kernel_fp16(case):
    tile, tokens, n_out, n_in = _tiles()[case]
    run_kernel_case(tokens=tokens, n_out=n_out, n_in=n_in, tile=tile, dtype=torch.float16, device="cpu")


@pytest.mark.skipif(INTERPRETING, reason="spawns the interpreter run")
@pytest.mark.skipif(not have_triton(), reason="needs Triton")
def test_interpreter_cases():
    run_interpreter_cases(__file__, min_passed=2)


def test_tile_parse_and_errors():
    from systems.kernels.wgrad_adamw import WgradTile

    tile = WgradTile.parse("128x64x32/4w2s")
    assert (tile.block_out, tile.block_in, tile.block_k, tile.num_warps, tile.num_stages) == (128, 64, 32, 4, 2)
    assert WgradTile.parse(tile.label()) == tile
    with pytest.raises(ValueError, match="OUTxINxK"):
        WgradTile.parse("128x64")
    with pytest.raises(ValueError, match="power of two"):
        WgradTile(block_out=96)
    with pytest.raises(ValueError, match="at least 16"):
        WgradTile(block_k=8)


def test_launch_errors():
    from systems.kernels.wgrad_adamw import WeightUpdate, wgrad_adamw_

    high, low = split_master(torch.zeros(8, 4))
    update = WeightUpdate(low=low, exp_avg=torch.zeros(8, 4), exp_avg_sq=torch.zeros(8, 4),
                          scalars=step_scalars(GROUP, 1))
    with pytest.raises(ValueError, match="share a dtype"):
        wgrad_adamw_(torch.zeros(2, 8), torch.zeros(2, 4), high, update)
    with pytest.raises(ValueError, match="bf16 weight"):
        wgrad_adamw_(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 5, dtype=torch.bfloat16), high, update)
    bad = WeightUpdate(low=low, exp_avg=torch.zeros(8, 4, dtype=torch.bfloat16), exp_avg_sq=torch.zeros(8, 4),
                       scalars=step_scalars(GROUP, 1))
    with pytest.raises(ValueError, match="int16 and its moments fp32"):
        wgrad_adamw_(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.bfloat16), high, bad)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
@pytest.mark.parametrize("even", [True, False])
def test_kernel_compiles_for_h100(even):
    """The sm_90 build uses the tensor cores' asynchronous warpgroup MMA for the matmul."""
    from systems.kernels.wgrad_adamw import TILE, _wgrad_adamw_kernel

    signature = {"DY": "*bf16", "X": "*bf16", "W": "*i16", "Low": "*i16", "M": "*fp32", "V": "*fp32",
                 "Scalars": "*fp32", "n_tokens": "i32", "n_out": "i32", "n_in": "i32", "BLOCK_OUT": "constexpr",
                 "BLOCK_IN": "constexpr", "BLOCK_K": "constexpr", "GROUP": "constexpr", "EVEN": "constexpr"}
    constexprs = {"BLOCK_OUT": TILE.block_out, "BLOCK_IN": TILE.block_in, "BLOCK_K": TILE.block_k,
                  "GROUP": TILE.group, "EVEN": even}
    ptx = compile_ptx_for_h100(_wgrad_adamw_kernel, signature=signature, constexprs=constexprs,
                               aligned_args=(0, 1, 2, 3, 4, 5, 6), num_warps=TILE.num_warps)
    assert "wgmma.mma_async" in ptx


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(2048, 256, 384), (1000, 200, 136)], ids=["even", "ragged"])
def test_kernel_bf16_gpu(shape):
    from systems.kernels.wgrad_adamw import TILE

    tokens, n_out, n_in = shape
    run_kernel_case(tokens=tokens, n_out=n_out, n_in=n_in, tile=TILE, dtype=torch.bfloat16, device="cuda", steps=3)


@pytest.mark.gpu
@needs_cuda
def test_linear_with_update_gpu():
    """Under bf16 autocast over an fp32 input: dx as autograd's through the autocast matmul (the
    same cuBLAS call), the weight as the reference step's, no .grad."""
    from systems.kernels.wgrad_adamw import WeightUpdate, linear_with_update

    gen = torch.Generator().manual_seed(2)
    high, low = split_master(torch.randn(256, 128, generator=gen) * 0.1)
    m, v = torch.zeros(256, 128), torch.zeros(256, 128)
    x = exact_operands((4, 64, 128), gen).cuda().requires_grad_()
    dy = exact_operands((4, 64, 256), gen).to(torch.bfloat16).cuda()
    weight = torch.nn.Parameter(high.cuda())
    update = WeightUpdate(low=low.cuda(), exp_avg=m.cuda(), exp_avg_sq=v.cuda(), scalars=step_scalars(GROUP, 1).cuda())
    x_ref = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = x_ref @ weight.detach().T
        y = linear_with_update(x, weight, update)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    y_ref.backward(dy)
    y.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=0, rtol=0)
    assert weight.grad is None
    want = reference_step(dy.reshape(-1, 256).cpu(), x.detach().reshape(-1, 128).to(torch.bfloat16).cpu(),
                          high, low, m, v, 1)
    got_master = join_master(weight.detach().cpu(), update.low.cpu())
    torch.testing.assert_close(got_master, join_master(want[0], want[1]), **KERNEL_TOL)
