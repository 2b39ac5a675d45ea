"""FlashAttention-2 in Triton (systems/attention/flash_triton/) against a direct float64 reference.

CPU: the kernels (both backwards, split and atomic, and the TMA-descriptor forward and split pair)
under TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is imported, and
must not leak into other tests); the fp32 dot precision reaching the kernels; the atomic, TMA and
tf32x3 kernels compiled for an H100; errors; the choice between the direct and the public launch,
and persisted plans launched without autotuning.
GPU (marked gpu, skipped without CUDA): bf16/fp16/fp32 at larger shapes, against SDPA too; fp32
through tf32x3 dots; the direct and the public launch against each other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from systems.testing import REPO, have_triton, interpreting, relative_error, run_interpreter_cases
from tests.attention.reference import reference, run_and_compare

INTERPRETING = interpreting()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pointer_and_tma(q, k, v, do, is_causal):
    """(O, dQ, dK, dV) through the pointer kernels, then the same through the TMA kernels."""
    from systems.attention.flash_triton import FlashVariant, flash_attention_triton

    results = []
    for variant in (FlashVariant(forward="pointer", backward="split"), FlashVariant(forward="tma", backward="tma")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention_triton(*leaves, is_causal, variant=variant)
        results.append((out, *torch.autograd.grad(out, leaves, do)))
    return results


# ----------------------------------------------------------------------------- Triton, CPU


@pytest.mark.skipif(not have_triton() or INTERPRETING or torch.cuda.is_available(),
                    reason="checks the CPU-tensor error outside the interpreter, without a GPU")
def test_triton_rejects_cpu_tensors():
    from systems.attention import FlashAttentionTriton

    x = torch.zeros(1, 16, 16)
    with pytest.raises(ValueError, match="CUDA"):
        FlashAttentionTriton.apply(x, x, x, False)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="spawns the interpreter run itself")
def test_triton_kernels_in_interpreter_subprocess():
    """Runs this file's test_interp_* cases with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_cases(__file__, min_passed=len(INTERP_CASES) * (len(INTERP_BACKWARDS) + 2) + 5)


# small sizes with 16-row tiles: several tiles, diagonal tiles, ragged ends, d padding (24)
INTERP_CASES = [
    ((2, 37, 16), 37, torch.float32, True),
    ((2, 20, 24), 70, torch.float32, True),
    ((3, 70, 32), 33, torch.float32, False),
    ((1, 2, 48, 16), 48, torch.float16, True),
    ((2, 33, 16), 65, torch.float16, False),
]


INTERP_BACKWARDS = ("split", "atomic")
# the kernels the TMA variant runs, as tuned_plans names them
TMA_KERNELS = {"fwd_tma", "dq_tma", "dkdv_tma"}


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("backward", INTERP_BACKWARDS)
@pytest.mark.parametrize("shape_q,n_k,dtype,causal", INTERP_CASES)
def test_interp_triton_matches_reference(shape_q, n_k, dtype, causal, backward):
    from systems.attention import FlashAttentionTriton
    from systems.attention.flash_triton import FlashVariant

    # the interpreter's dots are numpy: fp32 is exact to rounding; fp16 inputs and P/dS cast to
    # fp16 before the dots give ~1e-3 relative error. The atomic backward's dQ sums the same
    # products in fp32 in another order (one add per key tile), which is within the same bounds.
    # The pointer forward with both (the default, TMA, has its own test below).
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    variant = FlashVariant(forward="pointer", backward=backward)
    run_and_compare(lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c, variant),
                    shape_q, n_k, dtype, causal, "cpu", tol=tol)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("defer", [True, False], ids=["deferred-add", "immediate-add"])
@pytest.mark.parametrize("shape_q,n_k,causal,tiles", [
    ((2, 45, 24), 77, True, (32, 16)),  # query tiles taller than key tiles: a key tile's diagonal in one
    ((2, 50, 16), 37, False, (32, 16)),  # a ragged last key tile (37 = 2 x 16 + 5) meets every query
    ((1, 64, 16), 64, True, (16, 64)),  # one key tile spans four query tiles of its diagonal
])
def test_interp_atomic_backward_other_tiles(shape_q, n_k, causal, tiles, defer):
    """The atomic backward launched with explicit tiles, unlike the one config the public path runs
    under the interpreter, with its dQ add deferred by one query tile or not, against the split
    backward's dQ, dK, dV."""
    from systems.attention import flash_triton as ft

    gen = torch.Generator().manual_seed(n_k)
    shape_k = (*shape_q[:-2], n_k, shape_q[-1])
    q, k, v, do = (torch.randn(s, generator=gen) for s in (shape_q, shape_k, shape_k, shape_q))
    o, lse = ft.flash_forward_triton(q, k, v, causal)
    want = ft.flash_backward_triton(q, k, v, o, lse, do, causal, variant=ft.FlashVariant(backward="split"))
    delta = torch.empty_like(lse)
    dq_acc = torch.empty_like(q)  # fp32 inputs: the accumulator is dQ itself
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    config = dict(BLOCK_M3=tiles[0], BLOCK_N3=tiles[1], DEFER_DQ_ADD=defer, num_warps=4, num_stages=1)
    ft.launch_backward_atomic(q, k, v, o, do, lse, delta, dq_acc, dq_acc, dk, dv, causal, config=config)
    torch.testing.assert_close(delta, (o * do).sum(-1), rtol=0, atol=1e-5)  # the prep kernel's D
    # fp32 throughout: the two backwards sum the same products in different orders
    for got, ref in zip((dq_acc, dk, dv), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_prep_kernel_writes_d_l_in_base_2_and_zeros():
    """The atomic backward's prologue over three heads of 70 rows (a ragged last row tile: 64 + 6):
    D = rowsum(O * dO), L in base 2 for the atomic kernels (L log2(e), one fp32 multiply as torch's,
    so within an ulp), and a zeroed dQ buffer, every row of each written (NaN before)."""
    from systems.attention import flash_triton as ft
    from systems.attention.flash_triton.kernels import LOG2E

    gen = torch.Generator().manual_seed(70)
    o, do = (torch.randn(3, 70, 16, generator=gen) for _ in range(2))
    lse = torch.randn(3, 70, generator=gen) * 10
    delta, lse2 = torch.full_like(lse, float("nan")), torch.full_like(lse, float("nan"))
    dq_acc = torch.full_like(o, float("nan"))
    ft.launch_bwd_prep(o, do, lse, delta, lse2, dq_acc)
    torch.testing.assert_close(delta, (o * do).sum(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(lse2, lse * LOG2E, rtol=1.2e-7, atol=0)
    assert torch.equal(dq_acc, torch.zeros_like(o))


def _split_pass(q, k, v, do, causal, *, tma, tiles, fwd_options, bwd_options, head_group=None):
    """(O, L, dQ, dK, dV) through the forward and the split backward launched with explicit
    ``tiles`` (fwd rows x cols, dQ rows x cols, dK/dV rows x cols, warps, stages), options and
    launch-order head group."""
    from systems.attention import flash_triton as ft

    (bm, bn), (bm2, bn2), (bm1, bn1), warps, stages = tiles
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device=q.device)
    ft.launch_forward(q, k, v, o, lse, causal, tma=tma, head_group=head_group,
                      config=dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **fwd_options))
    delta, dq, dk, dv = torch.empty_like(lse), torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ft.launch_dq(q, k, v, o, do, lse, delta, dq, causal, tma=tma, head_group=head_group,
                 config=dict(BLOCK_M2=bm2, BLOCK_N2=bn2, num_warps=warps, num_stages=stages, **bwd_options))
    ft.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, tma=tma, head_group=head_group,
                   config=dict(BLOCK_M1=bm1, BLOCK_N1=bn1, num_warps=warps, num_stages=stages, **bwd_options))
    return o, lse, dq, dk, dv


def _schedule_pair(shape_q, n_k, causal, *, tma, dtype, device, tiles):
    """_split_pass with every loop-schedule option off, then on (WS only where tma)."""
    gen = torch.Generator(device=device).manual_seed(n_k)
    shape_k = (*shape_q[:-2], n_k, shape_q[-1])
    q, k, v, do = (torch.randn(s, generator=gen, device=device).to(dtype) for s in (shape_q, shape_k, shape_k, shape_q))
    off, on = {"WS": False} if tma else {}, {"WS": True} if tma else {}
    base = _split_pass(q, k, v, do, causal, tma=tma, tiles=tiles, fwd_options=dict(FMA_SOFTMAX=False, **off),
                       bwd_options=dict(EARLY_DP=False, **off))
    scheduled = _split_pass(q, k, v, do, causal, tma=tma, tiles=tiles, fwd_options=dict(FMA_SOFTMAX=True, **on),
                            bwd_options=dict(EARLY_DP=True, **on))
    return scheduled, base


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("shape_q,n_k,causal", [((2, 45, 24), 77, True), ((2, 50, 16), 37, False)])
def test_interp_schedule_options_keep_the_results(shape_q, n_k, causal, tma):
    """The loop-schedule options (FMA_SOFTMAX, EARLY_DP, WS) against the same tiles without them.
    EARLY_DP only moves a product earlier and WS only how warps are assigned, so those are exact;
    FMA_SOFTMAX takes the row max before the scale, exact too for a positive scale (the interpreter
    does not fuse the multiply-add, so its roundings are the same)."""
    scheduled, base = _schedule_pair(shape_q, n_k, causal, tma=tma, dtype=torch.float32, device="cpu",
                                     tiles=((16, 32), (32, 16), (16, 32), 4, 1))
    for got, want in zip(scheduled, base):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("causal", [True, False])
def test_interp_head_groups_keep_the_results(causal, tma):
    """The launch order's head group only changes which program takes which (tile, head), so every
    group gives the same bits: five heads of three query tiles and two key tiles, in groups of 1,
    2 (the last group holds one head), 3, and 5 or more (one group)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(5, 45, 24, generator=gen) for _ in range(4))
    tiles = ((16, 32), (16, 32), (16, 32), 4, 1)
    ws = {"WS": False} if tma else {}
    options = dict(fwd_options=dict(FMA_SOFTMAX=True, **ws), bwd_options=dict(EARLY_DP=False, **ws))
    want = _split_pass(q, k, v, do, causal, tma=tma, tiles=tiles, head_group=1, **options)
    for group in (2, 3, 5, 8):
        got = _split_pass(q, k, v, do, causal, tma=tma, tiles=tiles, head_group=group, **options)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"head_group {group}: {m}")


def _tma_kernels_ran(dtype) -> set[str]:
    from systems.attention.flash_triton import tuned_plans

    return {row["kernel"] for row in tuned_plans() if row["dtype"] == str(dtype) and row["kernel"].endswith("_tma")}


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("shape_q,n_k,dtype,causal", INTERP_CASES)
def test_interp_tma_matches_reference(shape_q, n_k, dtype, causal):
    """The TMA-descriptor forward and split backward: rows past the sequence and columns past d
    come from the descriptors' zero fill instead of masks, so the ragged and padded cases matter."""
    from systems.attention.flash_triton import FlashVariant, flash_attention_triton, tma_usable

    assert tma_usable(torch.zeros(*shape_q[-2:], dtype=dtype))  # every case here takes descriptors
    tol = 1e-5 if dtype == torch.float32 else 5e-3  # as the pointer kernels: the same arithmetic
    variant = FlashVariant(forward="tma", backward="tma")
    run_and_compare(lambda q, k, v, c: flash_attention_triton(q, k, v, c, variant=variant),
                    shape_q, n_k, dtype, causal, "cpu", tol=tol)
    assert _tma_kernels_ran(dtype) == TMA_KERNELS


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("shape_q,n_k,dtype,causal", INTERP_CASES)
def test_interp_tma_equals_pointer_kernels(shape_q, n_k, dtype, causal):
    """Under the interpreter both variants run the same tiles in the same order: a descriptor load
    must give exactly the masked pointer load, zeros included."""
    gen = torch.Generator().manual_seed(n_k)
    shape_k = (*shape_q[:-2], n_k, shape_q[-1])
    q, k, v, do = (torch.randn(s, generator=gen).to(dtype) for s in (shape_q, shape_k, shape_k, shape_q))
    for pointer, tma in zip(*pointer_and_tma(q, k, v, do, causal)):
        torch.testing.assert_close(tma, pointer, rtol=0, atol=0)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_default_takes_tma_above_its_threshold():
    """The default variants read through descriptors only past TMA_MIN_SEQ and for 16-bit inputs
    (where TMA was measured faster on an H100); the short sequences the interpreter can afford
    run the pointer kernels."""
    from systems.attention import flash_triton as ft

    default = ft.FlashVariant()
    assert (default.forward, default.backward) == ("auto", "auto")
    short = torch.zeros(1, ft.TMA_MIN_SEQ, 16, dtype=torch.float16)
    long = torch.zeros(1, ft.TMA_MIN_SEQ + 1, 16, dtype=torch.float16)
    for wants_tma in (default.forward_tma, default.backward_tma):
        assert not wants_tma(short, short) and wants_tma(short, long)
        assert not wants_tma(short.float(), long.float())  # fp32: not measured, pointers
    assert ft.FlashVariant(forward="tma").forward_tma(short) and not ft.FlashVariant(forward="pointer").forward_tma(long)
    assert ft.FlashVariant(backward="tma").backward_tma(short)
    assert not any(ft.FlashVariant(backward=b).backward_tma(long) for b in ("split", "atomic", "pytorch"))
    ft.clear_tuned_plans()
    run_and_compare(ft.FlashAttentionTriton.apply, (2, 37, 16), 37, torch.float32, True, "cpu", tol=1e-5)
    assert not _tma_kernels_ran(torch.float32)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_tma_falls_back_where_descriptors_cannot_read():
    """d = 20 in fp16 is 40 bytes a row, not a multiple of 16: no descriptor can step through it,
    so the TMA variants run the pointer kernels and still give the right answer."""
    from systems.attention import flash_triton as ft

    assert not ft.tma_usable(torch.zeros(2, 33, 20, dtype=torch.float16))
    ft.clear_tuned_plans()
    variant = ft.FlashVariant(forward="tma", backward="tma")
    run_and_compare(lambda q, k, v, c: ft.flash_attention_triton(q, k, v, c, variant=variant),
                    (2, 33, 20), 33, torch.float16, True, "cpu", tol=5e-3)
    assert not _tma_kernels_ran(torch.float16)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_triton_pytorch_backward_path():
    from systems.attention.flash_triton import FlashVariant, flash_attention_triton

    variant = FlashVariant(backward="pytorch")
    run_and_compare(lambda q, k, v, c: flash_attention_triton(q, k, v, c, variant=variant),
                    (2, 40, 16), 40, torch.float32, True, "cpu", tol=1e-5)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("forward,backward,kernels", [
    ("pointer", "split", {"fwd", "dq", "dkdv"}),
    ("pointer", "atomic", {"fwd", "atomic"}),  # prep: no autotuner
    ("tma", "tma", TMA_KERNELS),
])
def test_interp_second_call_launches_the_stored_plan(forward, backward, kernels):
    """The second call launches the jit'ed kernels with the plan's config through kernel[grid](...):
    the public launch, which is all the interpreter has (launch_path says so)."""
    from systems.attention import flash_triton as ft

    assert not ft.launch_path().direct and "interpreter" in ft.launch_path().reason
    variant = ft.FlashVariant(forward=forward, backward=backward)

    def run():
        q, k, v = (torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(3))
        out = ft.flash_attention_triton(q, k, v, is_causal=True, variant=variant)
        out.backward(torch.ones_like(out))
        return out.detach(), q.grad, k.grad, v.grad

    first = run()  # through the autotuner, which stores each kernel's choice
    key = dict(dtype=str(torch.float32), SEQ_BUCKET=256, HEAD_DIM=24, IS_CAUSAL=True, INPUT_PRECISION="ieee")
    names = {row["kernel"] for row in ft.tuned_plans() if key.items() <= row.items()}
    assert kernels <= names
    second = run()  # straight to the jit'ed kernels with the stored meta-parameters
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ft.launch_recipes() == []  # recipes bind direct launches only


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_specialisation_separates_what_triton_compiles_separately():
    # a compiled kernel is reused only under an equal key, so every property Triton specialises
    # on (for these argument types) must change the key: alignment, divisibility by 16, == 1, width
    from systems.attention.flash_triton.launch import specialisation

    buf = torch.zeros(1024)
    aligned, misaligned = buf[:512], buf[1:513]  # 4-byte offset: not 16-byte aligned
    base = specialisation((aligned, 1024, 0.5))
    assert base == specialisation((buf[4:516], 2048, 0.25))  # 16-byte offset, another multiple of 16, any float
    for other in [(misaligned, 1024, 0.5), (aligned, 1000, 0.5), (aligned, 1, 0.5), (aligned, 2**31, 0.5),
                  (aligned.half(), 1024, 0.5)]:
        assert specialisation(other) != base, other


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_recipe_key_separates_what_the_launch_choices_read():
    # a call replays a recipe only under an equal key, so everything the kernel choice, the plans
    # and the specialisation read must change it; values and the exact addresses must not
    from systems.attention.flash_triton import FlashVariant
    from systems.attention.flash_triton.launch import recipe_key

    buf = torch.zeros(4 * 64 * 32 + 4)
    q, k = buf[:2048].view(64, 32), buf[2048:4096].view(64, 32)
    base = recipe_key("fwd", FlashVariant(), True, q, k)
    assert base == recipe_key("fwd", FlashVariant(), True, buf[4096:6144].view(64, 32), torch.ones(64, 32))
    others = [recipe_key("bwd", FlashVariant(), True, q, k), recipe_key("fwd", FlashVariant(backward="split"), True, q, k),
              recipe_key("fwd", FlashVariant(), False, q, k), recipe_key("fwd", FlashVariant(), True, q[:32], k),
              recipe_key("fwd", FlashVariant(), True, q, k[:32]), recipe_key("fwd", FlashVariant(), True, q.half(), k),
              recipe_key("fwd", FlashVariant(), True, buf[1:2049].view(64, 32), k)]  # 4 bytes past a boundary
    assert all(other != base for other in others) and len(set(others)) == len(others)
    # fp32_dot "auto" follows torch's TF32 switch per call (dot_precision): the key must too
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not before
        assert recipe_key("fwd", FlashVariant(), True, q, k) != base
        assert recipe_key("fwd", FlashVariant(), True, q.half(), k) == others[5]  # 16-bit inputs ignore it
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_recipes_replay_the_launch_with_its_other_arguments(monkeypatch):
    from systems.attention.flash_triton import launch

    calls = []
    tensors = (torch.zeros(2), torch.ones(3))
    run = launch._bound(lambda *args: calls.append(args), (*tensors, 1000, 2, 0.125), ("tail", 64))
    new = (torch.full((2,), 5.0), torch.full((3,), 6.0))
    run(*new)
    assert calls[0][:2] == new and calls[0][2:] == (1000, 2, 0.125, "tail", 64)
    monkeypatch.setattr(launch, "_RECIPES", {})
    launch._keep_recipe(("fwd", "partly public"), False, (run, None))  # a public launch: nothing to replay
    assert launch._RECIPES == {}
    monkeypatch.setattr(launch, "_MAX_RECIPES", 2)
    for i in range(3):
        launch._keep_recipe(("fwd", i), False, (run,))
    assert list(launch._RECIPES) == [("fwd", 2)]  # full: started over
    # a call with a kept key replays its launches on its own tensors; an unknown key runs nothing
    assert launch._replay(("fwd", 2), new) and calls[-1][:2] == new and len(calls) == 2
    assert not launch._replay(("fwd", 0), new) and len(calls) == 2


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_launch_order_variant_picks_the_head_group():
    from systems.attention.flash_triton import FlashVariant

    assert FlashVariant().head_group is None  # the rule's
    assert FlashVariant(launch_order="per_head").head_group == 1
    with pytest.raises(ValueError, match="launch_order"):
        FlashVariant(launch_order="heads")


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_head_group_rule():
    from systems.attention.flash_triton.launch import _tile_grid, head_group, resolve_head_group

    assert _tile_grid(1000, "BLOCK_M", 6)({"BLOCK_M": 64}) == (96, 1)  # 16 tiles x 6 heads, one dimension

    h100 = dict(sms=132, l2_bytes=50 * 2**20)
    # the leaderboard shape: 256 tiles of 64 rows a head, about 2 x 132: one head a group
    assert head_group(n_bh=16, n_rows=16384, d=64, itemsize=2, **h100) == 1
    assert head_group(n_bh=32, n_rows=8192, d=128, itemsize=2, **h100) == 2  # 128 tiles a head
    assert head_group(n_bh=16, n_rows=4096, d=64, itemsize=2, **h100) == 4  # 64 tiles
    assert head_group(n_bh=32, n_rows=2048, d=128, itemsize=2, **h100) == 8  # 32 tiles
    assert head_group(n_bh=128, n_rows=512, d=64, itemsize=2, **h100) == 33  # 8 tiles
    assert head_group(n_bh=4, n_rows=512, d=64, itemsize=2, **h100) == 4  # at most every head
    # at most as many heads as have K and V in half of L2: 6 MiB a head at 4k fp32, d = 192
    assert head_group(n_bh=16, n_rows=4096, d=192, itemsize=4, **h100) == 4
    assert head_group(n_bh=16, n_rows=4096, d=192, itemsize=4, sms=264, l2_bytes=50 * 2**20) == 4
    assert head_group(n_bh=16, n_rows=4096, d=64, itemsize=2, sms=264, l2_bytes=50 * 2**20) == 8
    assert head_group(n_bh=1, n_rows=65536, d=128, itemsize=2, **h100) == 1
    assert head_group(n_bh=8, n_rows=2**20, d=128, itemsize=2, **h100) == 1  # nothing fits: still 1
    x = torch.zeros(6, 100, 16)
    assert resolve_head_group(x, x, None) == 1  # not on a GPU: the order within each head
    assert resolve_head_group(x, x, 4) == 4 and resolve_head_group(x, x, 9) == 6  # at most the 6 heads
    with pytest.raises(ValueError, match="at least 1"):
        resolve_head_group(x, x, 0)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_triton_rejects_bad_inputs():
    from systems.attention import FlashAttentionTriton

    x = torch.zeros(1, 16, 16)
    with pytest.raises(ValueError, match="dtype"):
        FlashAttentionTriton.apply(x, x, x.half(), False)
    with pytest.raises(ValueError, match="head dim"):
        y = torch.zeros(1, 16, 8)
        FlashAttentionTriton.apply(y, y, y, False)
    from systems.attention.flash_triton import FlashVariant, flash_backward_triton

    with pytest.raises(ValueError, match="backward must be one of auto, split, tma, gluon, atomic, pytorch"):
        FlashVariant(backward="cuda-graphs")
    with pytest.raises(ValueError, match="forward must be one of auto, pointer, tma"):
        FlashVariant(forward="triton_tma")  # an old forward= name, not a variant's
    with pytest.raises(ValueError, match="variant"):
        FlashAttentionTriton.apply(x, x, x, False, "cuda-graphs")  # a name, not a FlashVariant
    lse = torch.zeros(1, 16)
    with pytest.raises(ValueError, match="variant"):
        flash_backward_triton(x, x, x, x, lse, x, False, variant="triton")


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("backward,kernels", [("split", {"fwd", "dq", "dkdv"}), ("atomic", {"fwd", "atomic"})])
@pytest.mark.parametrize("fp32_dot", ["tf32x3", "tf32", "ieee"])
def test_interp_fp32_dot_reaches_the_kernels(fp32_dot, backward, kernels):
    """FlashVariant.fp32_dot is the INPUT_PRECISION every kernel of an fp32 call is launched (and
    autotuned) with; 16-bit inputs keep "ieee" whatever it says. The interpreter's dots are numpy
    fp32 whatever the precision, so the values stay exact to rounding (the codegen is checked by
    test_fp32_dot_precision_compiles_to_its_instructions)."""
    from systems.attention import flash_triton as ft

    ft.clear_tuned_plans()
    variant = ft.FlashVariant(forward="pointer", backward=backward, fp32_dot=fp32_dot)
    run_and_compare(lambda q, k, v, c: ft.flash_attention_triton(q, k, v, c, variant=variant),
                    (2, 37, 16), 37, torch.float32, True, "cpu", tol=1e-5)
    run_and_compare(lambda q, k, v, c: ft.flash_attention_triton(q, k, v, c, variant=variant),
                    (2, 33, 16), 33, torch.float16, True, "cpu", tol=5e-3)
    used = {(row["kernel"], row["dtype"], row["INPUT_PRECISION"]) for row in ft.tuned_plans()}
    assert used == ({(k, str(torch.float32), fp32_dot) for k in kernels}
                    | {(k, str(torch.float16), "ieee") for k in kernels}), used


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_dot_precision_follows_the_variant_and_torchs_setting():
    from systems.attention.flash_triton import FP32_DOTS, FlashVariant, dot_precision

    assert FlashVariant().fp32_dot == "auto"
    for choice in ("ieee", "tf32x3", "tf32"):
        assert dot_precision(torch.float32, choice) == choice
        assert dot_precision(torch.bfloat16, choice) == dot_precision(torch.float16, choice) == "ieee"
    # "auto": TF32 where torch's fp32 matmuls may use it, near-fp32 tf32x3 otherwise, and the
    # interpreter's numpy dots (or a GPU without TF32) get IEEE either way
    tf32_cores = not INTERPRETING and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    before = torch.backends.cuda.matmul.allow_tf32  # a torch global (no monkeypatch: it has no __dict__ entry)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert dot_precision(torch.float32) == ("tf32x3" if tf32_cores else "ieee")
        torch.backends.cuda.matmul.allow_tf32 = True
        assert dot_precision(torch.float32) == ("tf32" if tf32_cores else "ieee")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    with pytest.raises(ValueError, match="fp32_dot must be one of auto, ieee, tf32x3, tf32"):
        FlashVariant(fp32_dot="fp32")
    assert set(FP32_DOTS) == {"auto", "ieee", "tf32x3", "tf32"}


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
def test_fp32_dot_precision_compiles_to_its_instructions():
    """The fp32 forward compiled for sm_90 under each precision: "ieee" multiplies on the CUDA
    cores (scalar fp32 FMAs, no tensor-core instruction), "tf32" issues TF32 wgmma, and "tf32x3"
    three times as many (the high x high, high x low and low x high products of the split operands)."""
    from systems.attention.flash_triton import kernels
    from systems.testing import compile_ptx_for_h100

    fn = kernels.flash_fwd_kernel
    kinds = {"L": "*fp32", "n_q": "i32", "n_k": "i32", "head_group": "i32", "SEQ_BUCKET": "i32", "qk_scale": "fp32"}
    signature = {name: kinds.get(name, "*fp32" if name in "QKVO" else "constexpr") for name in fn.arg_names}
    counts = {}
    for precision in ("ieee", "tf32", "tf32x3"):
        constexprs = dict(HEAD_DIM=64, BLOCK_D=64, IS_CAUSAL=True, INPUT_PRECISION=precision, BLOCK_M=64, BLOCK_N=64)
        ptx = compile_ptx_for_h100(fn, signature=signature, constexprs=constexprs,
                                   aligned_args=tuple(range(7)), num_warps=4)
        counts[precision] = len(re.findall(r"wgmma\.mma_async\S*\.tf32", ptx)), ptx.count("fma.rn.f32")
    assert counts["ieee"][0] == 0 and counts["ieee"][1] > 10 * counts["tf32"][1], counts
    assert counts["tf32"][0] > 0 and counts["tf32x3"][0] == 3 * counts["tf32"][0], counts


# ----------------------------------------------------------------------------- launch path, persisted plans


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_launch_path_decision():
    """The direct launch only inside pyproject.toml's GPU-tested versions, unless forced; never
    under the interpreter or where this Triton lacks what it reads."""
    from systems.attention.flash_triton.launch import choose_launch_path, gpu_tested_versions, version_in_range

    tested = gpu_tested_versions()
    assert set(tested) == {"torch", "triton"}, tested
    assert version_in_range("3.6.0", ">=3.6,<3.7") and version_in_range("2.11.0+cu130", ">=2.11,<2.12")
    assert not version_in_range("3.7.0rc1", ">=3.6,<3.7") and not version_in_range("3.5.1", ">=3.6,<3.7")
    inside = {"torch": "2.11.0+cu130", "triton": "3.6.0"}
    newer = {"torch": "2.11.0+cu130", "triton": "3.8.0"}

    def choose(versions=inside, force=None, missing=(), interpreting=False, table=tested):
        return choose_launch_path(interpreting=interpreting, force=force, versions=versions, tested=table,
                                  missing=list(missing))

    assert choose().direct
    outside = choose(newer)
    assert not outside.direct and "triton 3.8.0" in outside.reason
    assert choose(newer, force="1").direct  # forced past the tested versions
    assert not choose(force="0").direct
    assert not choose(force="1", missing=["CompiledKernel[grid]"]).direct  # nothing to launch it with
    assert not choose(force="1", interpreting=True).direct
    assert not choose(table=None).direct  # no pyproject.toml beside the package: the public launch
    with pytest.raises(ValueError, match="must be 0, 1 or unset"):
        choose(force="yes")


@pytest.mark.skipif(not have_triton() or INTERPRETING or torch.cuda.is_available(),
                    reason="this CPU machine's Triton, outside the interpreter")
def test_launch_path_finds_the_internals_in_this_triton():
    # the check runs at the first launch; here it reads this Triton's classes without launching
    from systems.attention.flash_triton import launch

    assert launch.missing_internals() == [], "Triton changed what the direct launch reads"


@pytest.fixture
def fresh_plans():
    from systems.attention.flash_triton import clear_tuned_plans

    clear_tuned_plans()
    yield
    clear_tuned_plans()  # the next test starts from the interpreter's own configs


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_persisted_plans_spare_the_autotuner(tmp_path, monkeypatch, fresh_plans):
    """A process that finds its keys' plans persisted launches the jit kernels with them and never
    calls an autotuner, and gets the same outputs as the process that tuned them."""
    from systems.attention import flash_triton as ft
    from systems.attention.flash_triton import tuning

    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "first"))
    variant = ft.FlashVariant(forward="pointer", backward="split")
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 37, 16, generator=gen) for _ in range(4))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ft.flash_attention_triton(*leaves, True, variant=variant)
        return [out, *torch.autograd.grad(out, leaves, do)]

    tuned = run()
    assert {(r["kernel"], r["origin"]) for r in ft.tuned_plans()} == {("fwd", "tuned"), ("dq", "tuned"),
                                                                     ("dkdv", "tuned")}
    assert len(list((tmp_path / "first").glob("plans-*.json"))) == 1
    # a new process: its own plans empty, the file read afresh (a copy, which no store has read yet)
    ft.clear_tuned_plans()
    shutil.copytree(tmp_path / "first", tmp_path / "second")
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "second"))

    def no_tuning(*args, **kwargs):
        raise AssertionError("an autotuner ran although the plan was persisted")

    for kernel in tuning.TUNED.values():
        monkeypatch.setattr(kernel.autotuner, "run", no_tuning)
    stored = run()
    assert {(r["kernel"], r["origin"]) for r in ft.tuned_plans()} == {("fwd", "stored"), ("dq", "stored"),
                                                                     ("dkdv", "stored")}
    for a, b in zip(tuned, stored):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="the autotuned config tables exist outside the interpreter")
def test_pruners_keep_each_kernels_own_configs_that_fit():
    # each autotuner prunes to its own kernel's list for the input's dtype family; at d = 64 every
    # listed tile fits shared memory, while at d = 512 (far past any real head) the largest ones do not
    from systems.attention.flash_triton import tuning

    if not tuning.autotuning():
        pytest.skip("FLASH_TRITON_AUTOTUNE=0: one config per kernel, nothing to prune")
    for name in ("fwd", "fwd_tma", "dkdv", "dkdv_tma", "dq", "dq_tma"):
        kernel = tuning.TUNED[name].autotuner
        for dtype, family in ((torch.bfloat16, "half"), (torch.float32, "fp32")):
            listed = tuning.CONFIGS[name][family]
            q = torch.empty(1, 1, 1, dtype=dtype)
            kept = kernel.early_config_prune(kernel.configs, {"Q": q, "BLOCK_D": 64})
            assert [id(c) for c in kept] == [id(c) for c in listed], (name, family)
            big = kernel.early_config_prune(kernel.configs, {"Q": q, "BLOCK_D": 512})
            assert big and len(big) < len(listed) or len(listed) == 1, (name, family)
    # at d = 128 in 16 bits every TMA forward and dQ tile is tried: the largest (224 KB by the
    # pruner's count) fit an H100's 227 KB and are that head dim's fastest (notes entry 19)
    for name in ("fwd_tma", "dq_tma"):
        kernel, q = tuning.TUNED[name].autotuner, torch.empty(1, 1, 1, dtype=torch.bfloat16)
        kept = kernel.early_config_prune(kernel.configs, {"Q": q, "BLOCK_D": 128})
        assert [id(c) for c in kept] == [id(c) for c in tuning.CONFIGS[name]["half"]], name
    # an option measured to spill past a head dim is not tried there (tuning._OPTION_MAX_BLOCK_D)
    for (family_name, option), limit in tuning._OPTION_MAX_BLOCK_D.items():
        for name in (family_name, f"{family_name}_tma"):
            kernel, q = tuning.TUNED[name].autotuner, torch.empty(1, 1, 1, dtype=torch.bfloat16)
            wide = kernel.early_config_prune(kernel.configs, {"Q": q, "BLOCK_D": 2 * limit})
            assert wide and not any(c.kwargs.get(option) for c in wide), (name, option)
            at_limit = kernel.early_config_prune(kernel.configs, {"Q": q, "BLOCK_D": limit})
            assert [id(c) for c in at_limit] == [id(c) for c in tuning.CONFIGS[name]["half"]], name


_ARG_KINDS = {"n_q": "i32", "n_k": "i32", "head_group": "i32", "SEQ_BUCKET": "i32", "qk_scale": "fp32",
              "sm_scale": "fp32", "L": "*fp32", "L2": "*fp32", "Delta": "*fp32", "DQ_ACC": "*fp32"}


def _h100_signature(fn, constexprs: dict, dtype: str) -> dict:
    """A flash kernel's argument kinds as its launcher passes them, read from its own argument list:
    sizes i32, scales fp32, the log-sum-exp, D and the dQ accumulator fp32 pointers, the other
    tensors ``dtype`` pointers, and ``constexprs``' names constexpr."""
    return {name: "constexpr" if name in constexprs else _ARG_KINDS.get(name, f"*{dtype}") for name in fn.arg_names}


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
@pytest.mark.parametrize("defer", [True, False])
def test_atomic_kernel_compiles_for_h100(defer):
    """The atomic kernel at the leaderboard shape's tiles compiled for sm_90: its dQ adds are
    relaxed (no acq_rel fences) 16-byte fp32 adds (Triton 3.9 writes red, 3.6 atom with the
    result unused), the dots run on wgmma, and nothing spills to local memory."""
    from systems.attention.flash_triton.kernels import flash_bwd_atomic_kernel
    from systems.testing import compile_ptx_for_h100

    constexprs = dict(HEAD_DIM=64, BLOCK_D=64, IS_CAUSAL=True, INPUT_PRECISION="ieee", BLOCK_M3=64, BLOCK_N3=128,
                      DEFER_DQ_ADD=defer)
    signature = _h100_signature(flash_bwd_atomic_kernel, constexprs, "bf16")
    n_ptr = sum(kind.startswith("*") for kind in signature.values())
    ptx = compile_ptx_for_h100(flash_bwd_atomic_kernel, signature=signature, constexprs=constexprs,
                               aligned_args=tuple(range(n_ptr)) + (n_ptr, n_ptr + 1), num_warps=8)
    adds = [line for line in ptx.splitlines() if ".add" in line and ("red.global" in line or "atom.global" in line)]
    assert adds and all("relaxed" in a and ".v4.f32" in a for a in adds), adds[:4]
    assert "wgmma.mma_async" in ptx
    assert "st.local" not in ptx


H100_SHARED_PER_BLOCK = 232_448  # 227 KB: the opt-in limit of an H100 or H200 block, as a launch reports it


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
@pytest.mark.parametrize("family", ["fp32", "half"])
@pytest.mark.parametrize("name", ["fwd", "dkdv", "dq", "atomic"])
def test_one_config_tiles_fit_shared_memory_at_head_dim_128(name, family):
    """FLASH_TRITON_AUTOTUNE=0 runs one config per kernel, with no tuner to pass over one that does
    not launch: compiled for sm_90 at BLOCK_D 128 (the widest head dim) and the family's dtype, each
    fits an H100 block's shared memory. The atomic kernel's 32x64 fp32 tile did not (262,400 bytes:
    an OutOfResources on an H200 at d = 80)."""
    from systems.attention.flash_triton import kernels, tuning
    from systems.testing import compile_for_h100

    rows, cols, warps, stages = (tuning.ONE_CONFIG_TILES[name][family] or tuning.ONE_CONFIG_TILES[name]["half"])[0]
    config = tuning.tile_config(name, rows, cols, warps=warps, stages=stages)
    constexprs = dict(HEAD_DIM=128, BLOCK_D=128, IS_CAUSAL=True,
                      INPUT_PRECISION="tf32x3" if family == "fp32" else "ieee", **config.kwargs)
    fn = getattr(kernels, "flash_fwd_kernel" if name == "fwd" else f"flash_bwd_{name}_kernel")
    signature = _h100_signature(fn, constexprs, "fp32" if family == "fp32" else "bf16")
    n_ptr = sum(kind.startswith("*") for kind in signature.values())
    compiled = compile_for_h100(fn, signature=signature, constexprs=constexprs,
                                aligned_args=tuple(range(n_ptr)), num_warps=warps, num_stages=stages)
    assert compiled.metadata.shared <= H100_SHARED_PER_BLOCK, (name, family, compiled.metadata.shared)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
@pytest.mark.parametrize("kernel,tiles", [
    ("flash_fwd_tma_kernel", dict(BLOCK_M=128, BLOCK_N=128)),
    ("flash_bwd_dq_tma_kernel", dict(BLOCK_M2=128, BLOCK_N2=64)),
    ("flash_bwd_dkdv_tma_kernel", dict(BLOCK_M1=64, BLOCK_N1=128)),
])
def test_tma_kernels_compile_for_h100(kernel, tiles):
    """The TMA kernels at their largest leaderboard tiles (8 warps) compiled for sm_90: they build
    descriptors in the kernel (tensormap), their streamed loads are TMA bulk copies, the dots run
    on wgmma, and nothing spills to local memory."""
    from systems.attention.flash_triton import kernels
    from systems.testing import compile_ptx_for_h100

    fn = getattr(kernels, kernel)
    constexprs = dict(HEAD_DIM=64, BLOCK_D=64, IS_CAUSAL=True, INPUT_PRECISION="ieee",
                      **{name: False for name in ("FMA_SOFTMAX", "EARLY_DP", "WS") if name in fn.arg_names}, **tiles)
    signature = _h100_signature(fn, constexprs, "bf16")
    n_ptr = sum(kind.startswith("*") for kind in signature.values())
    ptx = compile_ptx_for_h100(fn, signature=signature, constexprs=constexprs,
                               aligned_args=tuple(range(n_ptr)) + (n_ptr, n_ptr + 1), num_warps=8)
    assert "tensormap" in ptx and "cp.async.bulk.tensor" in ptx, kernel
    assert "wgmma.mma_async" in ptx
    assert "st.local" not in ptx


# ----------------------------------------------------------------------------- GPU

GPU_CASES = [
    ((2, 3, 1000, 64), 1000, True),
    ((2, 1024, 128), 1024, True),
    ((1, 4, 300, 80), 777, True),  # d padded to 128, fewer queries than keys
    ((3, 513, 32), 250, False),
    ((4, 256, 16), 256, True),
]
# tolerances relative to max(1, max|ref|): bf16 has 8 mantissa bits (~4e-3 per rounding), and the
# kernels round P and dS to the input dtype before the tensor-core dots; fp32 runs tf32x3 dots by
# default (near-fp32: test_gpu_fp32_tf32x3_is_near_fp32 says why it holds the same bound as ieee).
GPU_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


# every shape in bf16; fp16 and fp32 on two of them (each new head dim / dtype compiles kernels)
GPU_PARAMS = ([(*case, torch.bfloat16) for case in GPU_CASES]
              + [(*GPU_CASES[i], dt) for i in (0, 2) for dt in (torch.float16, torch.float32)])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape_q,n_k,causal,dtype", GPU_PARAMS)
def test_gpu_triton_matches_reference(shape_q, n_k, causal, dtype):
    from systems.attention import FlashAttentionTriton
    from systems.attention.flash_triton import FlashVariant

    # the pointer kernels (what the default runs at these lengths); test_gpu_triton_tma_matches_reference
    # runs the same cases through the TMA kernels
    variant = FlashVariant(forward="pointer", backward="split")
    run_and_compare(lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c, variant),
                    shape_q, n_k, dtype, causal, "cuda", tol=GPU_TOL[dtype])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backward", ["split", "atomic"])
def test_gpu_fp32_tf32x3_is_near_fp32(backward):
    """fp32 inputs through tf32x3 dots against float64. Each operand is split into a TF32 high part
    (10 mantissa bits) and a TF32 low part; the three products kept drop only low x low (~2^-22
    relative) and the low part's own rounding (~2^-22), so each product is within a few fp32 ulps
    and the errors stay inside the IEEE fp32 bound (GPU_TOL, 1e-4 relative to max(1, |ref|)). One
    TF32 product (2^-11 relative) is far coarser, which the last assertion checks the test can see."""
    from systems.attention.flash_triton import FlashVariant, flash_attention_triton

    errors = {}
    for fp32_dot in ("ieee", "tf32x3", "tf32"):  # ieee: the default before tf32x3, still selectable
        variant = FlashVariant(forward="pointer", backward=backward, fp32_dot=fp32_dot)
        errors[fp32_dot] = max(run_and_compare(
            lambda q, k, v, c: flash_attention_triton(q, k, v, c, variant=variant),
            (2, 2, 1000, 64), 1000, torch.float32, True, "cuda", tol=1.0 if fp32_dot == "tf32"
            else GPU_TOL[torch.float32]).values())
    assert errors["tf32"] > 4 * errors["tf32x3"], errors


# the atomic backward on the same shapes in bf16, and in fp32 on the one whose d is padded
ATOMIC_GPU_PARAMS = [(*case, torch.bfloat16) for case in GPU_CASES] + [(*GPU_CASES[2], torch.float32)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape_q,n_k,causal,dtype", ATOMIC_GPU_PARAMS)
def test_gpu_triton_atomic_backward_matches_reference(shape_q, n_k, causal, dtype):
    from systems.attention.flash_triton import FlashVariant, flash_attention_triton

    # the same bounds as the split backward: dQ's fp32 sum only runs in another order
    variant = FlashVariant(backward="atomic")
    run_and_compare(lambda q, k, v, c: flash_attention_triton(q, k, v, c, variant=variant),
                    shape_q, n_k, dtype, causal, "cuda", tol=GPU_TOL[dtype])


# the TMA variant on the same shapes in bf16 (d 16, 32, 64, 80 and 128: every one a multiple of 8,
# so all take descriptors), and in fp32 and fp16 on the one whose d is padded to 128 by zero fill
TMA_GPU_PARAMS = ([(*case, torch.bfloat16) for case in GPU_CASES]
                  + [(*GPU_CASES[2], dt) for dt in (torch.float32, torch.float16)])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape_q,n_k,causal,dtype", TMA_GPU_PARAMS)
def test_gpu_triton_tma_matches_reference(shape_q, n_k, causal, dtype):
    from systems.attention import flash_triton as ft

    # the same bounds as the pointer kernels: the same arithmetic, only the loads differ
    variant = ft.FlashVariant(forward="tma", backward="tma")
    run_and_compare(lambda q, k, v, c: ft.flash_attention_triton(q, k, v, c, variant=variant),
                    shape_q, n_k, dtype, causal, "cuda", tol=GPU_TOL[dtype])
    assert _tma_kernels_ran(dtype) == TMA_KERNELS  # and not the pointer fallback


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_tma_close_to_pointer_kernels_bf16():
    """Leaderboard-like shape with the autotuned (larger) TMA tiles against the pointer kernels:
    two tilings of the same bf16 computation, so a few bf16 roundings apart."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, 4096, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    for pointer, tma in zip(*pointer_and_tma(q, k, v, do, True)):
        torch.testing.assert_close(tma, pointer, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_repeated_calls_launch_compiled_kernels_for_their_own_arguments(fresh_plans):
    # one autotuning key (bucket 1024, d 64, bf16, causal) under arguments Triton specialises apart:
    # lengths divisible by 16 or not, base pointers 16-byte aligned or not. Each is called four
    # times (autotune or jit dispatch, the stored compiled kernel, then the call's recipe) and must
    # stay correct, to the bit across the routes.
    from systems.attention import flash_triton as ft

    def inputs(n, misaligned):
        gen = torch.Generator(device="cuda").manual_seed(n + misaligned)
        q, k, v = (torch.randn(2, n, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        if misaligned:  # the same values from a base 2 bytes past a 16-byte boundary
            q, k, v = (torch.empty(t.numel() + 1, device="cuda", dtype=t.dtype)[1:].view(t.shape).copy_(t)
                       for t in (q, k, v))
        return q, k, v

    def rel_err(got, want):
        return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()

    for n, misaligned in [(1024, False), (1000, False), (1024, True), (1024, False)]:
        q, k, v = inputs(n, misaligned)
        assert (q.data_ptr() % 16 == 0) != misaligned
        do = torch.randn_like(q)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        want = reference(q64, k64, v64, True)[0]
        want_grads = torch.autograd.grad(want, (q64, k64, v64), do.double())
        for t in (q, k, v):
            t.requires_grad_()
        runs = []
        for _ in range(4):  # the forward and both backward kernels each take all four routes
            got = ft.flash_attention_triton(q, k, v, is_causal=True)
            grads = torch.autograd.grad(got, (q, k, v), do)
            errors = [rel_err(got, want)] + [rel_err(g, w) for g, w in zip(grads, want_grads)]
            assert max(errors) < GPU_TOL[torch.bfloat16], (n, misaligned, errors)
            runs.append((got, *grads))
        for later in runs[1:]:  # one compiled kernel per launch behind every route: the same bits
            for a, b in zip(runs[0], later):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
    direct = ft.launch_path().direct  # outside the GPU-tested versions every call went through Triton's dispatch
    for name in ("fwd", "dq", "dkdv"):
        plans = [row for row in ft.tuned_plans()
                 if row["kernel"] == name and (row["dtype"], row["SEQ_BUCKET"]) == (str(torch.bfloat16), 1024)]
        assert plans and (plans[0]["compiled"] >= 3 if direct else plans[0]["compiled"] == 0), name
        # (direct: aligned/1024, aligned/1000, misaligned/1024)
    # direct: each pass's second call bound its launches into a recipe, which the later calls
    # replayed (routes: autotuner or stored plan, jit dispatch, compiled kernel, recipe); the
    # misaligned inputs have recipes of their own
    recipes = [(r["pass_name"], r["q_shape"], r["launches"]) for r in ft.launch_recipes()
               if r["dtype"] == str(torch.bfloat16) and r["q_shape"][-1] == 64]
    per_inputs = [[("fwd", (2, n, 64), 1), ("bwd", (2, n, 64), 2)] for n in (1024, 1000, 1024)]
    assert sorted(recipes) == (sorted(sum(per_inputs, [])) if direct else []), recipes


# Both variants of the split path, at a length divisible by 16 and one that is not, three calls
# each (the first of each plan goes through Triton's dispatch, the later ones straight to the
# compiled kernel where the launch is direct); outputs, launch path and plans to argv[1].
BOTH_PATHS_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from systems.attention import flash_triton as ft

    gen = torch.Generator(device="cuda").manual_seed(0)
    outputs = {}
    for n in (1000, 1024):
        q, k, v, do = (torch.randn(2, 2, n, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        for name, variant in (("pointer", ft.FlashVariant(forward="pointer", backward="split")),
                              ("tma", ft.FlashVariant(forward="tma", backward="tma"))):
            for call in range(3):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out = ft.flash_attention_triton(*leaves, True, variant=variant)
                outputs[f"{name}_{n}_{call}"] = [out.detach(), *torch.autograd.grad(out, leaves, do)]
    path = ft.launch_path()
    torch.save(dict(outputs=outputs, direct=path.direct, reason=path.reason, plans=ft.tuned_plans()), sys.argv[1])
""")


@pytest.mark.gpu
@needs_cuda
def test_gpu_direct_and_public_launches_agree(tmp_path):
    """The public launch (kernel[grid](...)) in one process autotunes and persists its plans; the
    direct launch in a second process loads them and must give bit-identical outputs."""
    results = {}
    for direct in ("0", "1"):
        env = {**os.environ, "FLASH_TRITON_DIRECT_LAUNCH": direct, "FLASH_TRITON_CACHE_DIR": str(tmp_path / "plans")}
        out = tmp_path / f"direct_{direct}.pt"
        proc = subprocess.run([sys.executable, "-c", BOTH_PATHS_SCRIPT, str(out)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        results[direct] = torch.load(out, weights_only=False)
    public, direct = results["0"], results["1"]
    assert not public["direct"] and direct["direct"], (public["reason"], direct["reason"])
    assert public["plans"] and all(r["origin"] == "tuned" and r["compiled"] == 0 for r in public["plans"])
    assert direct["plans"] and all(r["origin"] == "stored" and r["compiled"] >= 1 for r in direct["plans"])
    assert public["outputs"].keys() == direct["outputs"].keys()
    for name, want in public["outputs"].items():
        for a, b in zip(want, direct["outputs"][name]):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_schedule_options_keep_the_results(causal, tma):
    """As the interpreter test, compiled: on a GPU the fused multiply-add rounds once where the
    separate multiply and subtraction rounded twice, so P, and through it every output, may move
    by about one bf16 rounding (2^-8 relative); L is fp32. Eight warps: Triton 3.6's warp
    specialisation fails to compile these loops with four (notes entry 13)."""
    scheduled, base = _schedule_pair((2, 2, 1000, 64), 1000, causal, tma=tma, dtype=torch.bfloat16, device="cuda",
                                     tiles=((128, 128), (128, 64), (64, 128), 8, 3))
    for name, got, want in zip(("O", "L", "dQ", "dK", "dV"), scheduled, base):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * scale,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_pytorch_backward_path_matches():
    from systems.attention.flash_triton import FlashVariant, flash_attention_triton

    variant = FlashVariant(backward="pytorch")
    run_and_compare(lambda q, k, v, c: flash_attention_triton(q, k, v, c, variant=variant),
                    (2, 4, 512, 64), 512, torch.bfloat16, True, "cuda", tol=3e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_triton_close_to_sdpa_bf16(causal):
    import torch.nn.functional as F

    from systems.attention import FlashAttentionTriton

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 2048, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn_like(q)
    ours = FlashAttentionTriton.apply(q, k, v, causal)
    ours.backward(do)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    theirs.backward(do)
    # both are bf16 kernels with fp32 accumulation: they differ by a few bf16 roundings
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)
    for mine, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(mine, t.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_model_with_flash_triton_matches_sdpa():
    from systems.config import get_config
    from systems.model import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(get_config("debug", attn_impl="sdpa"), device="cuda")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 200), device="cuda")
    want = model(tokens)
    want.float().pow(2).mean().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for layer in model.layers:
        layer.attn.attn_impl = "flash_triton"
    got = model(tokens)
    got.float().pow(2).mean().backward()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32 model: ieee dots
    for n, p in model.named_parameters():  # the backward too, as whole tensors: fp32 summed in another order
        assert relative_error(p.grad, want_grads[n]) < 1e-4, n


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_rejects_mismatched_inputs():
    from systems.attention import FlashAttentionTriton

    q = torch.zeros(1, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        FlashAttentionTriton.apply(q, q, q.half(), True)
    with pytest.raises(ValueError, match="device"):
        FlashAttentionTriton.apply(q, q, q.cpu(), True)


def test_auto_prefers_tma_only_for_long_16_bit_inputs():
    # one rule, shared by the launch path and notebook 06's prewarm plan
    from systems.attention.flash_triton import TMA_MIN_SEQ, auto_prefers_tma

    assert auto_prefers_tma(TMA_MIN_SEQ + 1, torch.bfloat16) and auto_prefers_tma(TMA_MIN_SEQ + 1, torch.float16)
    assert not auto_prefers_tma(TMA_MIN_SEQ, torch.bfloat16)
    assert not auto_prefers_tma(4 * TMA_MIN_SEQ, torch.float32)


# ----------------------------------------------------------------------------- the Gluon kernels


@pytest.mark.skipif(not have_triton(), reason="needs triton")
@pytest.mark.parametrize("kernel,head_dim,other", [("dkdv", 64, 128), ("dq", 128, 64), ("atomic_pp", 64, 128),
                                                  ("atomic_ws", 128, 64), ("fwd_ws", 64, 96), ("fwd_ws", 128, 256)])
def test_gluon_only_where_it_was_built_and_measured(kernel, head_dim, other):
    """kernels_gluon.py runs only with the GPU-tested Triton (its Gluon API changes between
    releases: 3.9 renamed the TMA copies), on sm_90 (wgmma), for 16-bit inputs, at the head dims
    where each kernel measured faster than its Triton twin (dK/dV d = 64, dQ d = 128, the atomic
    backward's two kernels d = 64 and d = 128, the forward both)."""
    from systems.attention.flash_triton.launch import gluon_allowed

    tested = {"torch": ">=2.11,<2.12", "triton": ">=3.6,<3.7"}

    def allowed(**change):
        args = dict(kernel=kernel, interpreting=False, triton_version="3.6.0", tested=tested, capability=(9, 0),
                    head_dim=head_dim, dtype=torch.bfloat16)
        return gluon_allowed(**{**args, **change})

    assert allowed() and allowed(dtype=torch.float16)
    assert not allowed(triton_version="3.9.0") and not allowed(tested=None) and not allowed(tested={"torch": ">=2"})
    assert not allowed(capability=(10, 0)) and not allowed(capability=(8, 0))
    assert not allowed(head_dim=other) and not allowed(head_dim=32)
    assert not allowed(dtype=torch.float32) and not allowed(interpreting=True)


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_gluon_backward_variant_is_the_tma_pair_where_gluon_cannot_run():
    from systems.attention.flash_triton import FlashVariant

    for d in (64, 128):
        q = torch.zeros(1, 8192, d, dtype=torch.bfloat16)  # CPU tensors: no Gluon kernel, whatever the Triton
        for kernel in ("dq", "dkdv", "atomic_pp", "atomic_ws"):
            assert not FlashVariant(backward="gluon").backward_gluon(kernel, q, q, q)
            assert not FlashVariant(backward="split").backward_gluon(kernel, q, q, q)
            assert not FlashVariant(backward="atomic").backward_gluon(kernel, q, q, q)
        assert FlashVariant(backward="gluon").backward_tma(q, q, q) == FlashVariant(backward="tma").backward_tma(q, q, q)
        assert not FlashVariant().forward_gluon(q, q, q)


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_gluon_launch_at_an_unmeasured_head_dim_says_where_it_runs():
    from systems.attention.flash_triton import launch

    q = torch.zeros(1, 64, 32, dtype=torch.bfloat16)
    lse = torch.zeros(1, 64)
    with pytest.raises(ValueError, match=r"the Gluon dq kernel runs at head dims \[128\], not 32"):
        launch.launch_dq(q, q, q, q, q, lse, lse, q, True, tma=True, gluon=True)
    with pytest.raises(ValueError, match=r"the Gluon dkdv kernel runs at head dims \[64\], not 32"):
        launch.launch_dkdv(q, q, q, q, lse, lse, q, q, True, tma=True, gluon=True)
    with pytest.raises(ValueError, match=r"the Gluon fwd_ws kernel runs at head dims \[64, 128\], not 32"):
        launch.launch_forward(q, q, q, q, lse, True, gluon=True)
    with pytest.raises(ValueError, match=r"the Gluon atomic_ws kernel runs at head dims \[128\], not 32"):
        launch.launch_atomic(q, q, q, q, lse, lse, q, q, q.float(), True, gluon="atomic_ws")
    with pytest.raises(ValueError, match=r"the Gluon atomic_pp kernel runs at head dims \[64\], not 32"):
        launch.launch_atomic(q, q, q, q, lse, lse, q, q, q.float(), True, gluon="atomic_pp")
    for name in ("dq", "atomic"):  # "atomic" was entry 18's one-partition kernel, removed
        with pytest.raises(ValueError, match=f"launch_atomic's gluon must be one of atomic_pp, atomic_ws; got '{name}'"):
            launch.launch_atomic(q, q, q, q, lse, lse, q, q, q.float(), True, gluon=name)


@pytest.mark.skipif(not have_triton(), reason="needs triton")
def test_routes_to_the_warp_specialised_kernels_where_they_run(monkeypatch):
    """On an H100 (simulated: every tensor TMA-readable, each Gluon kernel usable at its
    GLUON_TILES head dims): "auto" runs the five-product backward's warp-specialised kernels where
    the split pair would read descriptors (16-bit, past TMA_MIN_SEQ), atomic_pp at d = 64 and
    atomic_ws at d = 128, and the pair everywhere else; "atomic" takes the same Gluon kernels; "gluon"
    stays the pair.
    The forward: "auto" takes the warp-specialised Gluon forward in the same places, "tma" never."""
    from systems.attention.flash_triton import TMA_MIN_SEQ, FlashVariant, launch
    from systems.attention.flash_triton.tuning import GLUON_TILES

    monkeypatch.setattr(launch, "tma_usable", lambda *tensors: True)
    monkeypatch.setattr(launch, "gluon_usable",
                        lambda kernel, *tensors: tensors[0].shape[-1] in GLUON_TILES[kernel]
                        and tensors[0].dtype != torch.float32)

    def tensors(seq, d, dtype=torch.bfloat16):
        return (torch.empty(1, seq, d, dtype=dtype),) * 3

    long, short = TMA_MIN_SEQ + 64, TMA_MIN_SEQ
    auto, atomic, gluon = FlashVariant(), FlashVariant(backward="atomic"), FlashVariant(backward="gluon")
    for d, kernel in ((64, "atomic_pp"), (128, "atomic_ws")):
        assert auto.forward_gluon(*tensors(long, d))
        assert not FlashVariant(forward="tma").forward_gluon(*tensors(long, d))
        assert auto.atomic_gluon(*tensors(long, d)) == kernel and auto.runs_atomic(*tensors(long, d))
        assert auto.backward_gluon(kernel, *tensors(long, d))
        assert not auto.backward_gluon("dq", *tensors(long, d)) and not auto.backward_gluon("dkdv", *tensors(long, d))
        assert atomic.atomic_gluon(*tensors(short, d)) == kernel
    for args in (tensors(short, 128), tensors(short, 64), tensors(long, 96), tensors(long, 128, torch.float32)):
        assert auto.atomic_gluon(*args) is None and not auto.runs_atomic(*args) and not auto.forward_gluon(*args)
    assert gluon.backward_gluon("dkdv", *tensors(long, 64))
    assert atomic.atomic_gluon(*tensors(short, 32)) is None and atomic.runs_atomic(*tensors(short, 32))
    assert gluon.atomic_gluon(*tensors(long, 128)) is None and gluon.backward_gluon("dq", *tensors(long, 128))
    for backward in ("split", "tma", "pytorch"):
        assert not FlashVariant(backward=backward).runs_atomic(*tensors(long, 128))


def _gluon_in_tested_range() -> bool:
    import triton

    from systems.attention.flash_triton.launch import gpu_tested_versions, version_in_range

    return version_in_range(triton.__version__, gpu_tested_versions()["triton"])


# the types of each Gluon kernel's non-constexpr arguments, in order
_ATOMIC_ARG_KINDS = ["*bf16"] * 4 + ["*fp32"] * 2 + ["*bf16"] * 2 + ["*fp32"] + ["i32"] * 3 + ["fp32"] * 2
_GLUON_ARG_KINDS = {
    "dkdv": ["*bf16"] * 4 + ["*fp32"] * 2 + ["*bf16"] * 2 + ["i32"] * 3 + ["fp32"] * 2,
    "dq": ["*bf16"] * 5 + ["*fp32"] * 2 + ["*bf16"] + ["i32"] * 3 + ["fp32"] * 2,
    "atomic_ws": _ATOMIC_ARG_KINDS,  # the atomic kernel's two forms take the same arguments
    "atomic_pp": _ATOMIC_ARG_KINDS,
    "fwd_ws": ["*bf16"] * 4 + ["*fp32"] + ["i32"] * 3 + ["fp32"],
}


# the atomic backward's Gluon kernel at each head dim where one runs
_ATOMIC_GLUON_AT = {64: "atomic_pp", 128: "atomic_ws"}
# each Gluon kernel and head dim tuning.GLUON_TILES runs it at
_GLUON_BUILT = [("dkdv", 64), ("dq", 128), ("atomic_pp", 64), ("atomic_ws", 128), ("fwd_ws", 64), ("fwd_ws", 128)]


def _gluon_ptx_for_h100(kernel: str, head_dim: int, causal: bool) -> str:
    """The PTX of kernels_gluon.py's ``kernel`` (a key of _GLUON_ARG_KINDS) for sm_90 at ``head_dim``,
    with its tiles there (tuning.GLUON_TILES)."""
    if not _gluon_in_tested_range():
        pytest.skip("the Gluon kernels are written for the GPU-tested Triton only (pyproject.toml)")
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from systems.attention.flash_triton import kernels_gluon
    from systems.attention.flash_triton.tuning import GLUON_TILES

    fn = {"dq": kernels_gluon.flash_bwd_dq_gluon_kernel, "dkdv": kernels_gluon.flash_bwd_dkdv_gluon_kernel,
          "atomic_ws": kernels_gluon.flash_bwd_atomic_ws_gluon_kernel,
          "atomic_pp": kernels_gluon.flash_bwd_atomic_pp_gluon_kernel,
          "fwd_ws": kernels_gluon.flash_fwd_ws_gluon_kernel}[kernel]
    kinds = _GLUON_ARG_KINDS[kernel]
    signature = {name: kinds[i] if i < len(kinds) else "constexpr" for i, name in enumerate(fn.arg_names)}
    tiles = dict(GLUON_TILES[kernel][head_dim])
    warps = tiles.pop("num_warps")
    src = GluonASTSource(fn, signature, dict(HEAD_DIM=head_dim, IS_CAUSAL=causal, **tiles))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the Gluon kernel (not the interpreter's)")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel,head_dim", _GLUON_BUILT)
def test_gluon_kernels_compile_for_h100(kernel, head_dim, causal):
    """kernels_gluon.py compiled for sm_90 with the Triton it is written for: every kernel's products
    are asynchronous (a wgmma wait that leaves one group in flight) and nothing spills to local
    memory. dK/dV: K and V feed wgmma from registers in the S^T and dP^T products, L and D arrive
    on the tiles' barriers through cp.async. dQ: Q and dO as register A operands, K and V through
    TMA. Atomic: each query tile's dS K added into the fp32 dQ buffer by one TMA bulk reduce-add
    (no per-element atomics), issued by a worker warp, with a read-wait that leaves the newer of
    the two staging buffers' reduces in flight; the two worker warps drop to 24 registers so the
    consumer warpgroups rise to 240 (setmaxnreg), where a single-partition kernel spills at d = 128
    (atomic_pp: the same, its second consumer a worker partition too). Every kernel: ptxas keeps
    the products asynchronous (no C7512 note).
    The forward: K and V through TMA, P as a register A operand of O's product, the worker
    consumer warpgroups at 240 registers (160 for three) and the loader warp at 24."""
    from systems.attention.flash_triton.tuning import GLUON_TILES

    assert sorted(GLUON_TILES[kernel]) == sorted(d for k, d in _GLUON_BUILT if k == kernel)  # every one compiled
    ptx = _gluon_ptx_for_h100(kernel, head_dim, causal)
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "st.local" not in ptx
    # an A operand in braces (registers), then a shared-memory descriptor
    register_a = re_count(r"wgmma\.mma_async\S* \{[^}]*\}, \{[^}]*\}, %rd", ptx)
    if kernel == "dkdv":
        assert "cp.async.mbarrier.arrive.noinc" in ptx and "cp.async.bulk.tensor" in ptx
        assert register_a > 0
    if kernel == "dq":
        assert "cp.async.bulk.tensor" in ptx and register_a > 0
    if kernel == "fwd_ws":  # two consumers at 240 registers, three (192 rows, d = 64) at 160
        consumer_regs = "240" if GLUON_TILES[kernel][head_dim]["BLOCK_M"] == 128 else "160"
        assert {"24", consumer_regs} <= set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx))
        assert "cp.async.bulk.tensor" in ptx and register_a > 0
        # P packed two at a time (kernels_gluon._to_16bit_pairs), not by a cvt per element
        assert "cvt.rn.bf16x2.f32" in ptx
    if kernel in ("atomic_ws", "atomic_pp"):
        assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in ptx
        assert re_count(r"cp\.async\.bulk\.wait_group\.read\s+1;", ptx) > 0
        assert re_count(r"\b(?:atom|red)\.global", ptx) == 0
        assert {"24", "240"} <= set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx))
        assert "cp.async.mbarrier.arrive.noinc" in ptx and "cp.async.bulk.tensor" in ptx
    # ptxas keeps the products asynchronous: when it cannot (C7512, e.g. a wgmma left in flight
    # across a loop's back edge in a worker partition, notes entry 26) it serialises every wgmma
    assert "C7512" not in _ptxas_log(ptx)


def re_count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def _ptxas_log(ptx: str) -> str:
    """What the ptxas bundled with Triton says assembling ``ptx`` for sm_90a (-v: its notes)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([get_ptxas(90).path, "--gpu-name", "sm_90a", "-v", path, "-o", path + ".cubin"],
                             capture_output=True, text=True, check=True)
    return run.stdout + run.stderr


def _gluon_runs_here() -> bool:
    if not torch.cuda.is_available() or INTERPRETING:
        return False
    from systems.attention.flash_triton.launch import gluon_usable

    return gluon_usable("dkdv", torch.zeros(1, 64, 64, device="cuda", dtype=torch.bfloat16))


needs_gluon = pytest.mark.skipif(not _gluon_runs_here() if torch.cuda.is_available() else True,
                                 reason="needs an sm_90 GPU and the GPU-tested Triton")


def _gpu_backward_inputs(shape, n_k: int, causal: bool, dtype: torch.dtype):
    """Q, K, V, dO (random, seeded by the shape) and O, L from our forward: what both backward
    kernels read."""
    from systems.attention.flash_triton import launch

    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + n_k)
    q, do = (torch.randn(shape, generator=gen, device="cuda").to(dtype) for _ in range(2))
    k, v = (torch.randn(shape[0], n_k, shape[2], generator=gen, device="cuda").to(dtype) for _ in range(2))
    o, lse = launch.flash_forward_triton(q, k, v, causal)
    return q, k, v, do, o, lse


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("shape,n_k,causal,dtype", [
    ((2, 1000, 64), 1000, True, torch.bfloat16),
    ((3, 777, 64), 777, False, torch.bfloat16),
    ((2, 640, 64), 1280, True, torch.bfloat16),  # fewer queries than keys
    ((2, 1003, 64), 1003, True, torch.float16),  # ragged last tiles of both
    ((4, 4096, 64), 4096, True, torch.bfloat16),
    ((2, 2048, 64), 2048, False, torch.float16),
])
def test_gpu_gluon_dkdv_equals_the_triton_kernel(shape, n_k, causal, dtype):
    """The same L and D through both dK/dV kernels: the same products in the same order per key
    tile, so equal up to the fp32 accumulation order of wgmma (measured at most 3.4e-4 of the
    largest gradient on the H100; bounded here by one bf16 rounding, 2^-8)."""
    from systems.attention.flash_triton import launch

    q, k, v, do, o, lse = _gpu_backward_inputs(shape, n_k, causal, dtype)
    delta, dq = torch.empty_like(lse), torch.empty_like(q)
    launch.launch_dq(q, k, v, o, do, lse, delta, dq, causal, tma=True)
    got = {}
    for gluon in (False, True):
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        launch.launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, tma=True, gluon=gluon)
        got[gluon] = dk.float(), dv.float()
    for want, have in zip(got[False], got[True]):
        assert torch.isfinite(have).all()
        assert (have - want).abs().max() <= 2 ** -8 * want.abs().max()


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows,n_k,causal,dtype", [
    ((2, 1000), 1000, True, torch.bfloat16),
    ((3, 777), 777, False, torch.bfloat16),  # a ragged key tile meets every query: all masked
    ((2, 640), 1280, True, torch.bfloat16),  # fewer queries than keys
    ((2, 1280), 640, True, torch.bfloat16),  # more queries than keys
    ((2, 1003), 1003, True, torch.float16),  # ragged last tiles of both
    ((1, 65), 65, True, torch.bfloat16),  # a last query tile of one row
    ((2, 700), 333, False, torch.float16),
    ((4, 4096), 4096, True, torch.bfloat16),
])
def test_gpu_gluon_atomic_kernel_equals_the_triton_kernel(head_dim, rows, n_k, causal, dtype):
    """The same L through the atomic backward (prep, atomic kernel, cast) with Triton's kernel and
    with the warp-specialised Gluon kernel of the head dim: dK and dV from the same products per
    key tile, dQ summed over key tiles in another order (TMA reduce-adds against per-element
    atomics). Measured at most 1.8e-3 of the largest gradient against the split pair on the H100 at
    d = 128 (notes entry 23) and 1.2e-3 at d = 64 (entry 24); atomic_pp at most 3.9e-3 of
    atomic_ws's (entry 26); bounded here by one bf16 rounding, 2^-8."""
    from systems.attention.flash_triton import launch

    q, k, v, do, o, lse = _gpu_backward_inputs((*rows, head_dim), n_k, causal, dtype)
    kernel = launch.FlashVariant(backward="atomic").atomic_gluon(q, k, v)
    assert kernel == _ATOMIC_GLUON_AT[head_dim]
    got = {}
    for gluon in (None, kernel):
        delta = torch.empty_like(lse)
        dq_acc = torch.full(q.shape, float("nan"), device="cuda")  # the prep kernel zeroes it
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        launch.launch_backward_atomic(q, k, v, o, do, lse, delta, dq_acc, dq, dk, dv, causal, gluon=gluon)
        got[gluon] = dq.float(), dk.float(), dv.float()
    for want, have in zip(got[None], got[kernel]):
        assert torch.isfinite(have).all()
        assert (have - want).abs().max() <= 2 ** -8 * want.abs().max()


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows,n_k,causal,dtype", [
    ((2, 1000), 1000, True, torch.bfloat16),
    ((3, 777), 777, False, torch.bfloat16),  # a ragged last key tile, masked by the key bound
    ((2, 640), 1280, True, torch.bfloat16),  # fewer queries than keys
    ((2, 1280), 640, True, torch.bfloat16),  # more queries than keys: the first rows see no key
    ((2, 1003), 1003, True, torch.float16),  # ragged last tiles of both
    ((1, 65), 65, True, torch.bfloat16),  # one query tile, half its second warpgroup's rows past n_q
    ((2, 700), 333, False, torch.float16),
    ((4, 4096), 4096, True, torch.bfloat16),
])
def test_gpu_gluon_forward_equals_the_triton_kernel(head_dim, rows, n_k, causal, dtype):
    """The warp-specialised Gluon forward against Triton's forward (the default at these lengths,
    the pointer kernel) on the same inputs, on the rows that see a key (where a row sees none, both
    return what their tiles make of an all-masked row). O: both accumulate in fp32 but round P to
    16 bits against running maxima taken over different key tiles (128 keys against the Triton
    tile's); measured at most 4.7e-3 of the largest output on the H100 (notes entry 25), bounded
    by 2^-7. L: the same sums in another order, measured at most 2e-6."""
    from systems.attention.flash_triton import launch

    q, k, v, _, o_ref, l_ref = _gpu_backward_inputs((*rows, head_dim), n_k, causal, dtype)
    assert not launch.FlashVariant().forward_gluon(q, k, v)  # the reference is Triton's kernel
    o, lse = torch.full_like(q, float("nan")), torch.full_like(l_ref, float("nan"))
    launch.launch_forward(q, k, v, o, lse, causal, gluon=True)
    seen = torch.isfinite(l_ref)
    assert seen.float().mean() >= 0.5
    assert torch.isfinite(o[seen]).all() and torch.isfinite(lse[seen]).all()
    assert (o.float() - o_ref.float())[seen].abs().max() <= 2 ** -7 * o_ref.float()[seen].abs().max()
    assert (lse - l_ref)[seen].abs().max() <= 1e-4


@pytest.mark.gpu
@needs_gluon
def test_gpu_atomic_variant_takes_the_gluon_kernel_at_its_head_dims():
    """On the H100: "atomic" takes a warp-specialised Gluon kernel at d = 64 (atomic_pp) and 128
    (atomic_ws); "auto" takes it there past TMA_MIN_SEQ only, and the Gluon forward with it."""
    from systems.attention import flash_triton as ft

    variant, auto = ft.FlashVariant(backward="atomic"), ft.FlashVariant(backward="auto")
    for d, expected in ((64, "atomic_pp"), (128, "atomic_ws"), (32, None)):
        q = torch.zeros(2, 1000, d, device="cuda", dtype=torch.bfloat16)
        assert variant.atomic_gluon(q, q, q) == expected
        assert auto.atomic_gluon(q, q, q) is None  # 1000 tokens: the pointer pair
    for d, expected in ((32, None), (64, "atomic_pp"), (128, "atomic_ws")):
        q = torch.zeros(1, ft.TMA_MIN_SEQ + 64, d, device="cuda", dtype=torch.bfloat16)
        assert auto.atomic_gluon(q, q, q) == expected
        assert auto.forward_gluon(q, q, q) == (expected is not None)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_default_backward_past_tma_min_seq_matches_reference(causal, head_dim):
    """The public function's default at d = 64 and 128 past TMA_MIN_SEQ runs the warp-specialised
    forward and five-product backward (bf16 and fp16 against float64 autograd, the tolerance of
    every GPU test here), with a ragged last tile."""
    from systems.attention import flash_triton as ft

    shape_q = (1, 2, ft.TMA_MIN_SEQ + 100, head_dim)
    q = torch.zeros(shape_q, device="cuda", dtype=torch.bfloat16)
    assert ft.FlashVariant().atomic_gluon(q, q, q) == _ATOMIC_GLUON_AT[head_dim]
    assert ft.FlashVariant().forward_gluon(q, q, q)
    for dtype in (torch.bfloat16, torch.float16):
        run_and_compare(ft.flash_attention_triton, shape_q, shape_q[-2], dtype, causal, "cuda", tol=GPU_TOL[dtype])


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape_q,gluon_kernel,triton_kernel", [((2, 3, 1000, 64), "dkdv", "dq"),
                                                                ((2, 2, 1000, 128), "dq", "dkdv")])
def test_gpu_gluon_backward_matches_reference(causal, shape_q, gluon_kernel, triton_kernel):
    """The public function with backward="gluon": at d = 64 the Gluon dK/dV kernel beside the
    Triton dQ kernel, at d = 128 the other way round."""
    from systems.attention import flash_triton as ft

    variant = ft.FlashVariant(forward="tma", backward="gluon")
    q = torch.zeros(shape_q, device="cuda", dtype=torch.bfloat16)
    assert variant.backward_gluon(gluon_kernel, q, q, q) and not variant.backward_gluon(triton_kernel, q, q, q)
    run_and_compare(lambda q, k, v, c: ft.flash_attention_triton(q, k, v, c, variant=variant),
                    shape_q, 1000, torch.bfloat16, causal, "cuda", tol=GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("shape,n_k,causal,dtype", [
    ((2, 1000, 128), 1000, True, torch.bfloat16),
    ((3, 777, 128), 777, False, torch.bfloat16),
    ((2, 640, 128), 1280, True, torch.bfloat16),  # fewer queries than keys
    ((2, 65, 128), 128, True, torch.bfloat16),  # a last query tile of one row: its diagonal call is one tile
    ((2, 1003, 128), 1003, True, torch.float16),  # ragged last tiles of both
    ((2, 2048, 128), 2048, False, torch.float16),  # the unmasked loop over many tiles
])
def test_gpu_gluon_dq_equals_the_triton_kernel(shape, n_k, causal, dtype):
    """The same L through both dQ kernels: D equal (the same row sums), dQ up to the fp32
    accumulation order of wgmma and the order of key tiles (the Gluon kernel takes the diagonal
    first; measured at most 2.3e-3 of the largest gradient on the H100, with fewer queries than
    keys; bounded here by one bf16 rounding, 2^-8)."""
    from systems.attention.flash_triton import launch

    q, k, v, do, o, lse = _gpu_backward_inputs(shape, n_k, causal, dtype)
    got = {}
    for gluon in (False, True):
        delta, dq = torch.full_like(lse, float("nan")), torch.full_like(q, float("nan"))
        launch.launch_dq(q, k, v, o, do, lse, delta, dq, causal, tma=True, gluon=gluon)
        got[gluon] = delta, dq.float()
    assert torch.isfinite(got[True][1]).all()
    assert (got[True][0] - got[False][0]).abs().max() <= 1e-5 * got[False][0].abs().max()
    assert (got[True][1] - got[False][1]).abs().max() <= 2 ** -8 * got[False][1].abs().max()
