"""FusedAdamW against systems.optim.AdamW.

CPU: the torch._foreach_* fallback (the same operations as AdamW, so bit-identical), the
low-precision copies, state-dict interchange, errors. The Triton kernel runs under
TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is imported, and
must not leak into other tests). GPU (marked gpu, skipped without CUDA): the compiled kernel.
"""

from __future__ import annotations

import io
import re
from collections import Counter

import pytest
import torch

from systems.testing import compile_ptx_for_h100, have_triton, interpreting, run_interpreter_cases
from systems.kernels.fused_adamw import BLOCK, LOW_BITS, FusedAdamW, MasterWeightAdamW
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
             shapes=SHAPES, skip=None, capturable=False):
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
    opt = FusedAdamW(groups(ours), weight_decay=weight_decay, **HYPER, low_precision_copies=copies,
                     capturable=capturable)
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
    for block, num_warps in ((1000, 8), (1024, 6), (128, 8), (1024, 0)):  # not powers of two; under a thread each
        with pytest.raises(ValueError, match="powers of two with block >= 32 \\* num_warps"):
            FusedAdamW(p, block=block, num_warps=num_warps)
    assert MasterWeightAdamW(p, low_precision=[], block=2048, num_warps=16).block == 2048


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


def run_fold_pair(*, device="cpu", steps=3, grad_dtype=torch.float32, scale=0.5, master=False):
    """AdamW fed ``scale * (g + a)`` (summed in fp32), against FusedAdamW (or, with ``master``,
    MasterWeightAdamW over bf16 model weights and one fp32 gain) fed ``g`` with ``a`` folded in
    (``fold_gradients``): the addends stay the same tensors, rewritten in place every step, as a
    data-parallel wrapper's receive buffers are. Returns (reference params, ours, our optimizer)."""
    gen = torch.Generator(device=device).manual_seed(2)
    shapes = ((7, 13), (2 * BLOCK + 5,), (5,))
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = AdamW(ref, weight_decay=0.1, **HYPER)
    if master:
        opt = MasterWeightAdamW(ours, weight_decay=0.1, **HYPER, low_precision=ours[:2], split_masters=True)
    else:
        opt = FusedAdamW(ours, weight_decay=0.1, **HYPER)
    if grad_dtype != torch.float32 and not master:
        if not hasattr(ours[0], "grad_dtype"):
            pytest.skip("this torch cannot give fp32 parameters grads of another dtype")
        for b in ours:
            b.grad_dtype = grad_dtype
    addends = {p: torch.zeros(p.shape, dtype=grad_dtype if not master else p.dtype, device=device) for p in ours}
    opt.fold_gradients(addends, scale)
    for _ in range(steps):
        for a, b in zip(ref, ours):
            dtype = b.dtype if master else grad_dtype
            b.grad = torch.randn(a.shape, generator=gen, device=device).to(dtype)
            addends[b].copy_(torch.randn(a.shape, generator=gen, device=device))
            a.grad = (b.grad.float() + addends[b].float()) * scale
        opt_ref.step()
        opt.step()
    return ref, ours, opt


@pytest.mark.skipif(INTERPRETING, reason="the fallback runs for CPU tensors outside the interpreter")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fallback_folds_the_addends(grad_dtype):
    # the fallback sums in fp32 and scales, then runs AdamW's own operations: bit-identical
    ref, ours, opt = run_fold_pair(grad_dtype=grad_dtype)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


@pytest.mark.skipif(INTERPRETING, reason="the fallback runs for CPU tensors outside the interpreter")
def test_fold_is_keyed_by_the_model_parameters_of_split_masters():
    # addends are given for the model's bf16 parameters, whose split masters the optimizer updates
    ref, ours, opt = run_fold_pair(master=True)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(opt.master_of(b), a.detach(), atol=0, rtol=0)


def test_fold_gradients_validates_and_resets():
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    opt = FusedAdamW([p], **HYPER)
    with pytest.raises(ValueError, match="not updated by this optimizer"):
        opt.fold_gradients({q: torch.zeros(3)}, 0.5)
    with pytest.raises(ValueError, match="parameter's shape"):
        opt.fold_gradients({p: torch.zeros(4)}, 0.5)
    opt.fold_gradients({p: torch.zeros(3, dtype=torch.bfloat16)}, 0.5)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="in the gradients' dtype"):
        opt.step()
    # None goes back to the plain gradient: the same update as an optimizer that never folded
    opt.fold_gradients(None)
    other = torch.nn.Parameter(torch.randn(3))
    other.data.copy_(p.data)
    plain = FusedAdamW([other], **HYPER)
    other.grad = torch.ones(3)
    opt.step()
    plain.step()
    torch.testing.assert_close(p, other, atol=0, rtol=0)


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
    with pytest.raises(ValueError, match="split_masters needs dtype=torch.bfloat16"):
        MasterWeightAdamW([p], low_precision=[p], dtype=torch.float16, split_masters=True)
    assert p.dtype == torch.float32  # nothing was cast by the refused calls


# ----------------------------------------------------------------------------- split masters


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (as integers), so that -0.0 and 0.0, equal as values, differ."""
    return t.detach().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    assert actual.dtype == expected.dtype and torch.equal(bits(actual), bits(expected)), msg


def rounds_down_from_a_tie(master: torch.Tensor) -> torch.Tensor:
    """Where an fp32 lies halfway between two bf16 values and rounding to nearest even goes down:
    its low 16 bits are 0x8000 and the bf16 bits above them are even."""
    b = bits(master)
    return ((b & 0xFFFF) == 0x8000) & (((b >> 16) & 1) == 0)


def near_zero_values(gen: torch.Generator, device: str) -> torch.Tensor:
    """Signed zeros, the smallest subnormals, subnormals and tiny normals, of either sign."""
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, -1.17e-38], device=device)
    scaled = [torch.randn(20, generator=gen, device=device) * s for s in (1e-40, 1e-38, 1e-30)]
    return torch.cat([edges, *scaled])


# matmul weights below one kernel block, of whole blocks and ragged (a masked tail); sizes fixed
# whatever BLOCK is, since SPLIT_SEEDS counts the ties of their random data. run_split_pair adds
# a weight of values at and near zero and a norm gain left in fp32
SPLIT_SHAPES = ((7, 13), (2048,), (4101,))
assert 7 * 13 < BLOCK and 2048 % BLOCK == 0 and 4101 % BLOCK


def run_split_pair(*, device="cpu", shapes=SPLIT_SHAPES, steps=4, seed=0):
    """MasterWeightAdamW with fp32 masters (the reference) and with split masters, on the same
    weights and gradients (weight decay on); checks after construction and after every step that
    the split run is the reference bit for bit: its model weights are the reference masters
    rounded to nearest even (``Tensor.to``), and ``master_of`` is the reference master, except one
    fp32 ulp smaller in magnitude where that master is a tie rounded down (the reference master is
    then set to the split one, so that both runs go on from the same values). The near-zero
    weight has zero gradients in half its elements, which so stay tiny, only decayed.
    Returns (the number of such ties, the split optimizer)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    init = [torch.randn(s, generator=gen, device=device) for s in shapes]
    init += [near_zero_values(gen, device), torch.randn(5, generator=gen, device=device)]
    n_low = len(init) - 1
    runs = []
    for split in (False, True):
        model = [torch.nn.Parameter(x.clone()) for x in init]
        opt = MasterWeightAdamW(model, weight_decay=0.1, **HYPER, low_precision=model[:n_low], split_masters=split)
        runs.append((model, opt))
    (ref_model, ref_opt), (model, opt) = runs
    assert not opt._copies and all(a is b for a, b in zip(opt.param_groups[0]["params"], model))  # no fp32 masters
    ties = 0
    for step in range(steps + 1):
        if step > 0:
            for i, (a, b) in enumerate(zip(ref_model, model)):
                g = torch.randn(a.shape, generator=gen, device=device)
                if i == n_low - 1:
                    g[::2] = 0.0
                a.grad, b.grad = g.to(a.dtype), g.to(b.dtype)
            ref_opt.step()
            opt.step()
        for i, (a, b) in enumerate(zip(ref_model, model)):
            master = ref_opt.master_of(a).detach()
            tie = rounds_down_from_a_tie(master) if i < n_low else torch.zeros_like(master, dtype=torch.bool)
            expected = torch.where(tie, torch.nextafter(master, torch.zeros_like(master)), master)
            msg = f"step {step}, parameter {i}"
            assert_same_bits(opt.master_of(b), expected, msg)
            assert_same_bits(b, master.to(b.dtype), msg)  # the same rounding with or without the tie's ulp
            # and the reference's own bf16 copies, but where the interpreter truncates those
            # (test_interp_kernel_bf16_copy_within_one_ulp)
            if not INTERPRETING:
                assert_same_bits(b, a, msg)
            ties += int(tie.sum())
            master.copy_(expected)
    return ties, opt


# A tie rounded down has probability about 2^-17 per element and step: about 0.25 expected over
# SPLIT_SHAPES' ~6,400 elements x 5 (construction and 4 steps), not rare enough to ignore. Seed 1
# has none: the split masters are the fp32 ones bit for bit. Seed 0 has two: there the tie's
# one-ulp rule is met in random data, and everything else stays bit for bit.
SPLIT_SEEDS = [(1, 0), (0, 2)]  # (seed, ties rounded down)


@pytest.mark.skipif(INTERPRETING, reason="the fallback runs for CPU tensors outside the interpreter")
@pytest.mark.parametrize("seed,n_ties", SPLIT_SEEDS)
def test_split_masters_are_fp32_masters_bit_for_bit(seed, n_ties):
    ties, opt = run_split_pair(seed=seed)
    assert ties == n_ties
    assert not opt._tables  # the foreach fallback joined and split the masters


def tie_values(*, scale: float = 1.0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values halfway between two bf16 neighbours (low 16 bits 0x8000), of either sign:
    1 + 2^-8 rounds to nearest even down (to 1), 1 + 2^-7 + 2^-8 up (to 1 + 2^-6), times ``scale``
    (a power of two). Returns them and where the rounding goes up."""
    down, up = 1 + 2**-8, 1 + 2**-7 + 2**-8
    values = torch.tensor([down, up, -down, -up], device=device) * scale
    return values, torch.tensor([False, True, False, True], device=device)


def assert_tie_halves(opt: MasterWeightAdamW, p: torch.Tensor, values: torch.Tensor, up: torch.Tensor) -> None:
    """A tie rounded up fits (rest -0x8000): the stored master is exact. A tie rounded down would
    need +0x8000: the stored master is one ulp smaller in magnitude (rest 0x7FFF). The model's
    weight is both masters' rounding to nearest even."""
    assert_same_bits(p, values.to(torch.bfloat16))
    assert_same_bits(opt.master_of(p), torch.where(up, values, torch.nextafter(values, torch.zeros_like(values))))
    assert opt.state[p][LOW_BITS].tolist() == [-0x8000 if u else 0x7FFF for u in up.tolist()]


def check_tie_cases(device: str = "cpu") -> MasterWeightAdamW:
    """Ties met at construction (at three scales), and ties an update lands on exactly: with betas
    (0, 0), eps 0 and no decay the first step moves each element by lr * sign(gradient)."""
    for scale in (1.0, 2.0**-100, 2.0**100):
        values, up = tie_values(scale=scale, device=device)
        p = torch.nn.Parameter(values.clone())
        assert_tie_halves(MasterWeightAdamW([p], low_precision=[p], split_masters=True), p, values, up)
    values, up = tie_values(device=device)
    lr = 2.0**-9
    start = values + lr * values.sign()  # low 16 bits 0xC000, not a tie: exact, one step from one
    hyper = dict(lr=lr, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    ref, p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ref_opt = MasterWeightAdamW([ref], low_precision=[ref], **hyper)
    opt = MasterWeightAdamW([p], low_precision=[p], split_masters=True, **hyper)
    assert_same_bits(opt.master_of(p), start)
    ref.grad = p.grad = values.sign().to(torch.bfloat16)
    ref_opt.step()
    opt.step()
    assert_same_bits(ref_opt.master_of(ref), values)  # the exact fp32 update is the tie itself
    assert_tie_halves(opt, p, values, up)
    return opt


@pytest.mark.skipif(INTERPRETING, reason="the fallback runs for CPU tensors outside the interpreter")
def test_split_master_ties_round_to_nearest_even():
    check_tie_cases()


def test_split_masters_state_dict_round_trip():
    # a checkpoint is the model's bf16 weights and the optimizer's state (fp32 moments, low
    # halves): a new model and optimizer loaded from it take the same steps, bit for bit
    gen = torch.Generator().manual_seed(2)
    shapes = ((7, 13), (BLOCK + 3,), (5,))

    def build(seed):
        torch.manual_seed(seed)
        model = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        return model, MasterWeightAdamW(model, weight_decay=0.1, **HYPER, low_precision=model[:2], split_masters=True)

    def steps(pairs, n):
        for _ in range(n):
            grads = [torch.randn(s, generator=gen) for s in shapes]
            for model, opt in pairs:
                for p, g in zip(model, grads):
                    p.grad = g.to(p.dtype)
                opt.step()

    model, opt = build(0)
    steps([(model, opt)], 2)
    buffer = io.BytesIO()
    torch.save({"model": [p.detach() for p in model], "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed_model, resumed = build(1)  # other initial values: everything comes from the checkpoint
    for p, value in zip(resumed_model, saved["model"]):
        p.data.copy_(value)
    resumed.load_state_dict(saved["optimizer"])
    for p in resumed_model[:2]:  # torch would have cast these to the parameter's bf16
        state = resumed.state[p]
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype, state[LOW_BITS].dtype) == (
            torch.float32, torch.float32, torch.int16)
    steps([(model, opt), (resumed_model, resumed)], 2)
    for a, b in zip(model, resumed_model):
        assert_same_bits(b, a)
        assert_same_bits(resumed.master_of(b), opt.master_of(a))
        assert resumed.state[b]["step"] == opt.state[a]["step"] == 4
    # a checkpoint of split masters does not load into fp32 masters, nor the reverse
    unsplit_model = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    unsplit = MasterWeightAdamW(unsplit_model, **HYPER, low_precision=unsplit_model[:2])
    with pytest.raises(ValueError, match="build it with the split_masters it was saved with"):
        unsplit.load_state_dict(saved["optimizer"])
    with pytest.raises(ValueError, match="build it with the split_masters it was saved with"):
        resumed.load_state_dict(unsplit.state_dict())


def test_split_master_of_and_errors():
    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    assert not rounds_down_from_a_tie(values).any()
    w, gain = torch.nn.Parameter(values.clone()), torch.nn.Parameter(torch.ones(6))
    opt = MasterWeightAdamW([w, gain], **HYPER, low_precision=[w], split_masters=True)
    assert w.dtype == torch.bfloat16 and w.is_contiguous() and opt.state[w][LOW_BITS].shape == (4, 6)
    master = opt.master_of(w)
    # the value the parameter had (no tie among these), as a new tensor: writing it changes nothing
    assert_same_bits(master, values)
    master.zero_()
    assert_same_bits(opt.master_of(w), values)
    assert opt.master_of(gain) is gain  # an fp32 parameter is its own master
    with pytest.raises(ValueError, match="split master's high half"):
        opt.attach_copy(w, torch.empty(4, 6, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------- Triton kernel, CPU



@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="spawns the interpreter run itself")
def test_triton_kernel_in_interpreter_subprocess():
    """Runs this file's test_interp_* cases with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_cases(__file__, min_passed=N_INTERP_TESTS)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
@pytest.mark.parametrize("grad", ["fp32", "bf16"])
@pytest.mark.parametrize("fifth", ["copy", "none", "split", "split+addend"])
@pytest.mark.parametrize("scalars_in_memory", [False, True], ids=["scalar-args", "scalars-in-memory"])
def test_kernel_compiles_for_h100(grad, fifth, scalars_in_memory):
    import triton.language as tl

    from systems.kernels.fused_adamw import NUM_WARPS, _adamw_kernel

    scalars = ("grad_scale", "decay", "lerp_weight", "beta2", "one_minus_beta2", "step_size",
               "bias_correction2_sqrt", "eps")
    flags = ("PARAM_DTYPE", "GRAD_DTYPE", "COPY_DTYPE", "HAS_COPY", "SPLIT", "HAS_ADDEND", "ALIGNED",
             "SCALARS_IN_MEMORY", "BLOCK")
    signature = {"Addresses": "*i64", "Numels": "*i64", "FirstBlock": "*i64", "BlockTensor": "*i32",
                 "Scalars": "*fp32", **{k: "fp32" for k in scalars}, **{k: "constexpr" for k in flags}}
    addend = fifth == "split+addend"  # the data-parallel fold (DDPPeer): the other ranks' gradient sum
    fifth = fifth.removesuffix("+addend")
    constexprs = dict(PARAM_DTYPE=tl.float32, GRAD_DTYPE=tl.bfloat16 if grad == "bf16" else tl.float32,
                      COPY_DTYPE=tl.bfloat16, HAS_COPY=fifth == "copy", SPLIT=fifth == "split", HAS_ADDEND=addend,
                      ALIGNED=True, SCALARS_IN_MEMORY=scalars_in_memory, BLOCK=BLOCK)
    ptx = compile_ptx_for_h100(_adamw_kernel, signature=signature, constexprs=constexprs,
                               aligned_args=(0, 1, 2, 3), num_warps=NUM_WARPS)
    # aligned full blocks move each thread's BLOCK / (32 * NUM_WARPS) elements of a tensor in as
    # few vector accesses as the bytes allow: 16-byte (v4) ones, or one 8-byte (v2) one
    per_thread = BLOCK // (32 * NUM_WARPS)

    def vectors(itemsizes: list[int]) -> Counter:
        out = Counter()
        for size in itemsizes:
            nbytes = per_thread * size
            out.update({"v4": nbytes // 16} if nbytes >= 16 else {f"v{nbytes // 4}": 1})
        return out

    param = [2, 2] if fifth == "split" else [4]  # the two int16 halves of a split master, or fp32
    grads = [2 if grad == "bf16" else 4] * (1 + addend)  # g and its addend
    loads = vectors(param + grads + [4, 4])  # m, v
    stores = vectors(param + [4, 4] + [2] * (fifth == "copy"))  # p, m, v and the bf16 copy
    for kind in ("v4", "v2"):
        assert ptx.count(f"ld.global.{kind}") == loads[kind], (kind, per_thread)
        assert ptx.count(f"st.global.{kind}") == stores[kind], (kind, per_thread)
    assert "sqrt.rn" in ptx and "sqrt.approx" not in ptx  # rounded as torch's sqrt
    # unpredicated 32-bit loads: the program's tensor index, and the seven step scalars where they
    # are read from memory (the PTX spells them .b32 or .f32 by Triton version)
    scalar_loads = re.findall(r"^\s*ld\.global\.[bf]32 ", ptx, flags=re.MULTILINE)
    assert len(scalar_loads) == 1 + 7 * scalars_in_memory


INTERP_CASES = [(0.1, torch.float32, None), (0.0, torch.bfloat16, None), (0.1, torch.float32, (1, 2))]
N_INTERP_TESTS = len(INTERP_CASES) + 6 + len(SPLIT_SEEDS)


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
def test_interp_capturable_kernel_reads_the_same_scalars_from_memory():
    # the scalars written to device memory are the Python doubles rounded to fp32, as the scalar
    # arguments are: the same kernel arithmetic, bit for bit (a parameter skips a step, so two
    # buckets have different step counts and scalars)
    _, plain, _, _, opt_plain = run_pair(skip=(1, 2))
    _, ours, _, _, opt = run_pair(skip=(1, 2), capturable=True)
    assert opt._tables and len(opt._scalars) == 2  # through the kernel; a slot per (group, dtypes)
    for a, b in zip(plain, ours):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        assert opt.state[b]["step"] == opt_plain.state[a]["step"]


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_kernel_folds_the_addends():
    # the kernel sums and scales in fp32 registers, then AdamW's operations: KERNEL_TOL as above
    ref, ours, opt = run_fold_pair(grad_dtype=torch.float32)
    assert opt._tables  # through the kernel
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, **KERNEL_TOL)


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


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("seed,n_ties", SPLIT_SEEDS)
def test_interp_split_masters_through_the_kernel(seed, n_ties):
    # the kernel computes both runs' updates in fp32 with the same operations, so the masters
    # agree bit for bit (the ties as the fallback's: SPLIT_SEEDS); it rounds the split master's
    # bf16 half with integer arithmetic, so exactly to nearest even even here, where the
    # reference's bf16 copies truncate
    ties, opt = run_split_pair(seed=seed)
    assert ties == n_ties
    assert len(opt._tables) == 2  # both buckets through the kernel: the split masters', the gain's


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_split_master_ties_through_the_kernel():
    assert check_tie_cases()._tables


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
@pytest.mark.parametrize("split", [False, True], ids=["fp32", "split-masters"])
def test_gpu_captured_step_replays_with_each_steps_scalars(split):
    # one eager step, then the step captured in a CUDA graph and replayed five times with new
    # gradients written into the same tensors, the learning rate halved after the second replay:
    # a replay that froze the capture's bias corrections or learning rate would move each
    # element by a different multiple of lr, far outside KERNEL_TOL
    torch.manual_seed(0)
    shapes = ((1024, 256), (3 * BLOCK - 1,), (33,))
    ref = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    if split:
        opt = MasterWeightAdamW(ours, **HYPER, low_precision=ours[:2], split_masters=True, capturable=True)
        grads = [torch.empty(p.shape, device="cuda", dtype=p.dtype) for p in ours]
    else:
        opt = FusedAdamW(ours, **HYPER, capturable=True)
        grads = [torch.empty_like(p) for p in ours]
    opt_ref = AdamW(ref, **HYPER)
    for p, g in zip(ours, grads):
        p.grad = g  # the graph reads the gradients where they were at capture

    def new_gradients():
        for a, g in zip(ref, grads):
            g.copy_(torch.randn(a.shape, device="cuda"))
            a.grad = g.float().clone()

    new_gradients()
    opt.step()
    opt_ref.step()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    opt.prepare_capture()
    with torch.cuda.graph(graph, stream=stream):
        opt.step()
    opt.finish_capture()
    for replay in range(5):
        if replay == 2:
            for group in (*opt.param_groups, *opt_ref.param_groups):
                group["lr"] *= 0.5
        new_gradients()
        opt.prepare_replay()
        graph.replay()
        opt_ref.step()
    torch.cuda.synchronize()
    for a, b in zip(ref, ours):
        torch.testing.assert_close(opt.master_of(b) if split else b, a.detach(), **KERNEL_TOL)
    counts = {opt.state[p]["step"] for p in opt.param_groups[0]["params"]}
    assert counts == {6}


@pytest.mark.gpu
@needs_cuda
def test_gpu_capture_refuses_host_scalars():
    p = torch.nn.Parameter(torch.randn(64, device="cuda"))
    p.grad = torch.randn(64, device="cuda")
    opt = FusedAdamW([p], **HYPER)
    opt.step()  # eager: fine
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="capturable=True"):
                opt.step()
        finally:
            graph.capture_end()


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


@pytest.mark.gpu
@needs_cuda
def test_gpu_split_masters_are_fp32_masters():
    # ~40M elements: about 300 ties rounded down per step, each checked to be one ulp under the
    # fp32 master, everything else bit for bit (run_split_pair)
    ties, opt = run_split_pair(device="cuda", shapes=((50304, 768), (768, 3072), (3 * BLOCK - 1,)))
    assert ties > 0 and opt._tables


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("master", [False, True])
def test_gpu_kernel_folds_the_addends(master):
    # fp32 grads and addends, or a split master's bf16 ones: summed and scaled in fp32 registers
    ref, ours, opt = run_fold_pair(device="cuda", steps=4, master=master)
    assert opt._tables  # the kernel ran
    for a, b in zip(ref, ours):
        torch.testing.assert_close(opt.master_of(b) if master else b, a.detach(), **KERNEL_TOL)
