"""FusedAdamW against systems.optim.AdamW.

CPU: the torch._foreach_* fallback (the same operations as AdamW, so bit-identical), the
low-precision copies, state-dict interchange, errors. The Triton kernel runs under
TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is imported, and
must not leak into other tests). GPU (marked gpu, skipped without CUDA): the compiled kernel.
"""

from __future__ import annotations


import pytest
import torch

from systems.testing import compile_ptx_for_h100, have_triton, interpreting, run_interpreter_cases
from systems.kernels.fused_adamw import BLOCK, FusedAdamW, MasterWeightAdamW
from systems.optim import AdamW

INTERPRETING = interpreting()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# sizes below, at and above one kernel block, a ragged multi-block one, 0-d and empty tensors
SHAPES = [(33,), (7, 13), (BLOCK,), (2 * BLOCK + 5,), (3, 4, 5), (), (0, 4)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
# the kernel against torch's fp32 kernels: the same operations, but torch's vectorised CPU
# kernels fuse some multiply-adds (and GPUs contract them), so moments differ by an ulp or so
# and each update (of size ~lr) by ~1e-7 relative: atol 1e-6 / rtol 1e-5 (as test_optim)
KERNEL_TOL = dict(atol=1e-6, rtol=1e-5)


def run_pair(*, device="cpu", steps=4, weight_decay=0.1, grad_dtype=torch.float32, copy_dtype=None,
             shapes=SHAPES, skip=None):
    """Steps AdamW and FusedAdamW on the same parameters and gradients.

    Two param groups (the second with its own lr and no decay). ``skip=(step, index)`` leaves
    that parameter without a gradient at that step, so its step count falls behind the others'.
    Returns (reference params, fused params, copies (fused param -> copy) or None, AdamW, FusedAdamW).
    """
    gen = torch.Generator(device=device).manual_seed(len(shapes))
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    half = len(shapes) // 2

    def groups(params):
        return [{"params": params[:half]}, {"params": params[half:], "lr": 3e-3, "weight_decay": 0.0}]

    if grad_dtype != torch.float32:
        # fp32 parameters hold bf16 grads only where torch has Tensor.grad_dtype (recent releases)
        if not hasattr(ours[0], "grad_dtype"):
            pytest.skip("this torch cannot give fp32 parameters grads of another dtype")
        for b in ours:
            b.grad_dtype = grad_dtype
    copies = ({p: torch.empty(p.shape, dtype=copy_dtype, device=device) for p in ours}
              if copy_dtype is not None else None)
    opt_ref = AdamW(groups(ref), weight_decay=weight_decay, **HYPER)
    opt = FusedAdamW(groups(ours), weight_decay=weight_decay, **HYPER, low_precision_copies=copies)
    for step in range(steps):
        for i, (a, b) in enumerate(zip(ref, ours)):
            if skip == (step, i):
                a.grad = b.grad = None
                continue
            g = torch.randn(a.shape, generator=gen, device=device).to(grad_dtype)
            b.grad = g
            a.grad = g.to(a.dtype)  # AdamW needs grads of the parameter's dtype; same values
        opt_ref.step()
        opt.step()
    return ref, ours, copies, opt_ref, opt


def assert_copies_exact(ours, copies):
    for p in ours:
        assert copies[p].dtype in (torch.bfloat16, torch.float16)
        torch.testing.assert_close(copies[p], p.detach().to(copies[p].dtype), atol=0, rtol=0)


# ----------------------------------------------------------------------------- foreach fallback, CPU


@pytest.mark.skipif(INTERPRETING, reason="the fallback runs for CPU tensors outside the interpreter")
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fallback_matches_adamw_exactly(weight_decay, grad_dtype):
    # the same torch operations in the same order: bit-identical
    ref, ours, _, _, opt = run_pair(weight_decay=weight_decay, grad_dtype=grad_dtype, skip=(1, 2))
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert not opt._tables  # nothing went through the kernel


@pytest.mark.skipif(INTERPRETING, reason="the fallback runs for CPU tensors outside the interpreter")
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_fallback_copies_equal_param_cast(copy_dtype):
    _, ours, copies, _, _ = run_pair(copy_dtype=copy_dtype)
    assert_copies_exact(ours, copies)


def test_state_dict_moves_between_adamw_and_fused():
    # same state layout: AdamW's state continues in FusedAdamW (and back)
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(40))
    b.data.copy_(a.data)
    opt_a, opt_b = AdamW([a], **HYPER), AdamW([b], **HYPER)
    grads = [torch.randn(40) for _ in range(4)]
    for g in grads[:2]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    fused = FusedAdamW([b], **HYPER)
    fused.load_state_dict(opt_b.state_dict())
    for g in grads[2:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        fused.step()
    torch.testing.assert_close(b, a, **KERNEL_TOL)
    assert fused.state[b]["step"] == 4
    opt_b.load_state_dict(fused.state_dict())
    assert opt_b.state[b]["step"] == 4


def test_attach_copy_writes_immediately_and_validates():
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = FusedAdamW([p], **HYPER)
    copy = torch.zeros(5, 3, dtype=torch.bfloat16)
    opt.attach_copy(p, copy)
    assert torch.equal(copy, p.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.attach_copy(torch.nn.Parameter(torch.randn(5, 3)), copy)
    with pytest.raises(ValueError, match="dtype"):
        opt.attach_copy(p, torch.zeros(5, 3))
    with pytest.raises(ValueError, match="shape"):
        opt.attach_copy(p, torch.zeros(3, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        opt.attach_copy(p, torch.zeros(3, 5, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match="not in this optimizer"):
        FusedAdamW([p], low_precision_copies={torch.nn.Parameter(torch.randn(2)): torch.zeros(2, dtype=torch.float16)})


def test_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdamW(p, lr=-1)
    with pytest.raises(ValueError, match="betas"):
        FusedAdamW(p, betas=(1.0, 0.9))


def test_float64_params_take_the_fallback():
    # the kernel computes in fp32; float64 parameters stay exact through the foreach path
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    opt_p, opt_q = AdamW([p], **HYPER), FusedAdamW([q], **HYPER)
    for _ in range(3):
        g = torch.randn(10, dtype=torch.float64)
        p.grad, q.grad = g.clone(), g.clone()
        opt_p.step()
        opt_q.step()
    torch.testing.assert_close(q, p, atol=0, rtol=0)


def run_master_pair(*, device="cpu", steps=3, dtype=torch.bfloat16, shapes=((7, 13), (2 * BLOCK + 5,), (5,))):
    """AdamW on fp32 parameters fed the bf16 gradients, against MasterWeightAdamW on a model
    whose first two parameters are held in ``dtype`` (the third, e.g. a norm gain, stays fp32).
    Returns (reference params, model params, MasterWeightAdamW)."""
    gen = torch.Generator(device=device).manual_seed(1)
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device)) for s in shapes]
    model = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = AdamW(ref, weight_decay=0.1, **HYPER)
    opt = MasterWeightAdamW(model, weight_decay=0.1, **HYPER, low_precision=model[:2], dtype=dtype)
    for _ in range(steps):
        for a, b in zip(ref, model):
            # the backward of a low-precision parameter gives a gradient of its dtype
            b.grad = torch.randn(a.shape, generator=gen, device=device).to(b.dtype)
            a.grad = b.grad.float()
        opt_ref.step()
        opt.step()
        opt.zero_grad()
    return ref, model, opt


@pytest.mark.skipif(INTERPRETING, reason="the fallback runs for CPU tensors outside the interpreter")
def test_master_weights_follow_adamw_and_round_into_the_model():
    ref, model, opt = run_master_pair()
    assert [p.dtype for p in model] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for a, b in zip(ref, model):
        # the same foreach operations on the same fp32 values: the masters are bit-identical
        torch.testing.assert_close(opt.master_of(b), a.detach(), atol=0, rtol=0)
        # and the model holds the master rounded to its dtype (the fp32 gain is its own master)
        torch.testing.assert_close(b.detach(), a.detach().to(b.dtype), atol=0, rtol=0)
        assert b.grad is None  # zero_grad reached the model's parameters, not only the masters


def test_master_weights_validate_their_input():
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="not in params"):
        MasterWeightAdamW([p], low_precision=[q])
    with pytest.raises(ValueError, match="must start in fp32"):
        half = torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))
        MasterWeightAdamW([half], low_precision=[half])
    with pytest.raises(ValueError, match="dtype must be one of"):
        MasterWeightAdamW([p], low_precision=[p], dtype=torch.float32)
    with pytest.raises(ValueError, match="flat list"):
        MasterWeightAdamW([{"params": [p]}], low_precision=[p])
    assert p.dtype == torch.float32  # nothing was cast by the refused calls


# ----------------------------------------------------------------------------- Triton kernel, CPU



@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="spawns the interpreter run itself")
def test_triton_kernel_in_interpreter_subprocess():
    """Runs this file's test_interp_* cases with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_cases(__file__, min_passed=N_INTERP_TESTS)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
@pytest.mark.parametrize("grad", ["fp32", "bf16"])
@pytest.mark.parametrize("has_copy", [True, False])
def test_kernel_compiles_for_h100(grad, has_copy):
    import triton.language as tl

    from systems.kernels.fused_adamw import NUM_WARPS, _adamw_kernel

    scalars = ("decay", "lerp_weight", "beta2", "one_minus_beta2", "step_size", "bias_correction2_sqrt", "eps")
    flags = ("PARAM_DTYPE", "GRAD_DTYPE", "COPY_DTYPE", "HAS_COPY", "ALIGNED", "BLOCK")
    signature = {"Addresses": "*i64", "Numels": "*i64", "FirstBlock": "*i64", "BlockTensor": "*i32",
                 **{k: "fp32" for k in scalars}, **{k: "constexpr" for k in flags}}
    constexprs = dict(PARAM_DTYPE=tl.float32, GRAD_DTYPE=tl.bfloat16 if grad == "bf16" else tl.float32,
                      COPY_DTYPE=tl.bfloat16, HAS_COPY=has_copy, ALIGNED=True, BLOCK=BLOCK)
    ptx = compile_ptx_for_h100(_adamw_kernel, signature=signature, constexprs=constexprs,
                               aligned_args=(0, 1, 2, 3), num_warps=NUM_WARPS)
    assert "ld.global.v4" in ptx  # aligned full blocks move 16-byte vectors
    assert "sqrt.rn" in ptx and "sqrt.approx" not in ptx  # rounded as torch's sqrt


INTERP_CASES = [(0.1, torch.float32, None), (0.0, torch.bfloat16, None), (0.1, torch.float32, (1, 2))]
N_INTERP_TESTS = len(INTERP_CASES) + 3


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("weight_decay,grad_dtype,skip", INTERP_CASES,
                         ids=["fp32-grads", "bf16-grads-no-decay", "one-param-skips-a-step"])
def test_interp_kernel_matches_adamw(weight_decay, grad_dtype, skip):
    ref, ours, _, opt_ref, opt = run_pair(weight_decay=weight_decay, grad_dtype=grad_dtype, skip=skip)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **KERNEL_TOL)
        for key in ("exp_avg", "exp_avg_sq"):  # the moments too
            torch.testing.assert_close(opt.state[b][key], opt_ref.state[a][key], **KERNEL_TOL)
        assert opt.state[b]["step"] == opt_ref.state[a]["step"]
    # every parameter went through the kernel: one address table per (group, step count) bucket
    n_buckets = 2 + (skip is not None)
    assert len(opt._tables) == n_buckets


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_kernel_fp16_copy_exact():
    # fp32 -> fp16 rounds to nearest in the interpreter as on a GPU: exact equality
    ref, ours, copies, _, _ = run_pair(copy_dtype=torch.float16)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **KERNEL_TOL)
    assert_copies_exact(ours, copies)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_kernel_bf16_copy_within_one_ulp():
    # the interpreter (numpy) truncates fp32 -> bf16 where a GPU rounds to nearest (the GPU
    # test checks exact equality): here the copy is one of the two bf16 neighbours of p
    _, ours, copies, _, _ = run_pair(copy_dtype=torch.bfloat16)
    for p in ours:
        p32, c32 = p.detach(), copies[p].float()
        ulp = p32.abs() * 2.0**-7  # bf16 keeps 8 significant bits: neighbours are <= 2^-7 |p| apart
        assert ((c32 - p32).abs() <= ulp).all()


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_master_weights_through_the_kernel():
    # fp16 model weights: the interpreter rounds fp32 -> fp16 to nearest as a GPU does (bf16 it truncates)
    ref, model, opt = run_master_pair(dtype=torch.float16)
    assert opt._tables  # the kernel ran: fp32 master, fp16 gradient, fp16 copy into the model
    for a, b in zip(ref, model):
        torch.testing.assert_close(opt.master_of(b), a.detach(), **KERNEL_TOL)
        torch.testing.assert_close(b.detach(), opt.master_of(b).to(b.dtype), atol=0, rtol=0)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_adamw(grad_dtype):
    shapes = SHAPES + [(50304, 768), (768, 3072), (3 * BLOCK - 1,)]  # a GPT-2 head, an MLP weight, ragged
    ref, ours, copies, _, opt = run_pair(device="cuda", steps=5, grad_dtype=grad_dtype, copy_dtype=torch.bfloat16,
                                      shapes=shapes, skip=(2, 1))
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **KERNEL_TOL)
    assert_copies_exact(ours, copies)  # a GPU converts fp32 -> bf16 rounding to nearest, as torch
    assert opt._tables  # the kernel ran


@pytest.mark.gpu
@needs_cuda
def test_gpu_unaligned_views_and_reused_tables():
    # parameters that are views into one flat buffer at odd offsets: the unaligned kernel variant
    flat = torch.randn(3 * 1001 + 1, device="cuda")
    views = [flat[1 + i * 1001: 1 + (i + 1) * 1001] for i in range(3)]
    ours = [torch.nn.Parameter(v) for v in views]
    ref = [torch.nn.Parameter(v.detach().clone()) for v in views]
    opt, opt_ref = FusedAdamW(ours, **HYPER), AdamW(ref, **HYPER)
    for _ in range(3):
        for a, b in zip(ref, ours):
            g = torch.randn(1001, device="cuda")
            a.grad, b.grad = g.clone(), g.clone()
        opt_ref.step()
        opt.step()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **KERNEL_TOL)


@pytest.mark.gpu
@needs_cuda
def test_gpu_master_weights_match_adamw():
    ref, model, opt = run_master_pair(device="cuda", steps=4, shapes=((50304, 768), (768, 3072), (768,)))
    for a, b in zip(ref, model):
        torch.testing.assert_close(opt.master_of(b), a.detach(), **KERNEL_TOL)
        torch.testing.assert_close(b.detach(), opt.master_of(b).to(b.dtype), atol=0, rtol=0)
