"""Fused LM head + cross-entropy against ``systems.optim.cross_entropy(hidden @ weight.T, targets)``.

CPU: the PyTorch row path (fp32, float64, CPU autocast bf16), chunking, memory (no full logits
saved or allocated), ignore_index, errors. The Triton row kernel runs under TRITON_INTERPRET=1
in a subprocess (the variable must be set before triton is imported, and must not leak into
other tests). GPU (marked gpu, skipped without CUDA): fp32 and bf16 autocast on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from systems.testing import compile_ptx_for_h100, have_triton, interpreting, run_interpreter_cases
from systems.kernels.fused_linear_ce import default_chunk_size, linear_cross_entropy
from systems.optim import cross_entropy

INTERPRETING = interpreting()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# fp32: the fused path sums the same products in another order (chunked GEMMs, grad_weight
# summed over chunks, sum-then-scale instead of mean), so results differ by a few fp32 ulps
# times the length of the sums: ~1e-6 relative to the largest entry; 1e-5 leaves headroom.
FP32_TOL = 1e-5
# bf16 (8 significant bits, 2^-8 = 4e-3 per rounding): both sides round the logits and their
# gradient to bf16 once; the fused grad_weight also rounds each chunk's partial sum to bf16.
BF16_TOL = 2e-2


def make_inputs(lead, vocab, d, *, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(*lead, d, generator=gen, device=device).to(dtype).requires_grad_()
    # a trained head's logits span a few units; std 1/sqrt(d) keeps them O(1) here
    weight = (torch.randn(vocab, d, generator=gen, device=device) / math.sqrt(d)).requires_grad_()
    targets = torch.randint(0, vocab, lead, generator=gen, device=device)
    return hidden, weight, targets


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error divided by max(|want|) (a tiny floor for all-zero references)."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30)).item()


def compare(hidden, weight, targets, *, reduction="mean", chunk_size=None, tol=FP32_TOL, autocast_dtype=None):
    """Loss and grads of hidden and weight: fused against the unfused reference, under the same
    autocast (or none). Returns the three relative errors."""
    device_type = hidden.device.type

    def autocast():
        return torch.autocast(device_type=device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None)

    with autocast():
        loss = linear_cross_entropy(hidden, weight, targets, reduction=reduction, chunk_size=chunk_size)
    grads = torch.autograd.grad(loss, (hidden, weight))
    with autocast():
        ref = cross_entropy(hidden @ weight.T, targets)
        if reduction == "sum":
            ref = ref * targets.numel()
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    assert loss.dtype == torch.float32 and loss.shape == ()
    for got, want, inp in zip(grads, ref_grads, (hidden, weight)):
        assert got.shape == inp.shape and got.dtype == want.dtype == inp.dtype
    errors = {"loss": abs(loss.item() - ref.item()) / abs(ref.item()),
              "grad_hidden": rel_err(grads[0], ref_grads[0]), "grad_weight": rel_err(grads[1], ref_grads[1])}
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errors})"
    return errors


# (leading shape of hidden, vocab, d): a chunk size of 16 divides 64 tokens but not 37 or 3*11
SHAPES = [((64,), 50, 16), ((37,), 300, 24), ((3, 11), 129, 32)]
CHUNK_SIZES = [None, 1, 16, 1000]


# ----------------------------------------------------------------------------- PyTorch path, CPU


@pytest.mark.parametrize("lead,vocab,d", SHAPES)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_reference_fp32(lead, vocab, d, chunk_size, reduction):
    compare(*make_inputs(lead, vocab, d), reduction=reduction, chunk_size=chunk_size)


def test_float64_is_exact_to_rounding():
    # float64 throughout (cross_entropy's .float() would round the reference to fp32): only the
    # summation order differs
    hidden, weight, targets = make_inputs((40,), 70, 16)
    hidden, weight = (t.detach().double().requires_grad_() for t in (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    ref = F.cross_entropy(hidden @ weight.T, targets)
    assert loss.dtype == torch.float64 and abs(loss.item() - ref.item()) <= 1e-12 * ref.item()
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    assert all(rel_err(g, r) <= 1e-12 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_cpu_autocast_bf16_matches_autocast_reference(hidden_dtype):
    # fp32 master weight; activations fp32 or already bf16, as in a bf16-autocast model
    hidden, weight, targets = make_inputs((2, 24), 200, 32, dtype=hidden_dtype)
    compare(hidden, weight, targets, chunk_size=20, tol=BF16_TOL, autocast_dtype=torch.bfloat16)


def test_ignore_index_matches_torch():
    hidden, weight, targets = make_inputs((50,), 60, 16)
    targets = targets.clone()
    targets[::3] = -100
    for reduction in ("mean", "sum"):
        loss = linear_cross_entropy(hidden, weight, targets, reduction=reduction, chunk_size=16)
        grads = torch.autograd.grad(loss, (hidden, weight))
        ref = F.cross_entropy(hidden @ weight.T, targets, reduction=reduction, ignore_index=-100)
        ref_grads = torch.autograd.grad(ref, (hidden, weight))
        assert abs(loss.item() - ref.item()) <= FP32_TOL * abs(ref.item())
        for got, want in zip(grads, ref_grads):
            assert rel_err(got, want) <= FP32_TOL
        assert grads[0][::3].abs().max() == 0  # ignored tokens get no gradient


def test_default_chunk_size():
    # small problems: one chunk; large ones: equal chunks of whole tiles, ~CHUNK_LOGITS_BYTES each
    assert default_chunk_size(100, 50, torch.float32) == 100
    rows = default_chunk_size(16384, 50304, torch.bfloat16)
    assert rows % 128 == 0 and 1000 < rows < 4096
    assert math.ceil(16384 / rows) * rows - 16384 < rows  # no chunk is empty
    assert default_chunk_size(0, 50, torch.float32) == 1


# ----------------------------------------------------------------------------- memory


def test_no_full_logits_saved_for_backward():
    lead, vocab, d = (4, 16), 50, 8  # 64 tokens x 50 = 3200 logits; everything saved is smaller
    hidden, weight, targets = make_inputs(lead, vocab, d)
    n_tokens = math.prod(lead)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    assert sorted(saved) == sorted([(n_tokens, d), (vocab, d)]), saved  # grad_hidden and grad_weight only
    assert all(math.prod(s) < n_tokens * vocab for s in saved)
    loss.backward()


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op returns (what the forward allocates)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_forward_never_allocates_full_logits():
    n_tokens, vocab, d, chunk = 64, 50, 8, 16
    hidden, weight, targets = make_inputs((n_tokens,), vocab, d)
    with _LargestOutput() as mode:
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
    # the largest buffers: one chunk of logits, grad_weight, grad_hidden; never (tokens, vocab)
    assert mode.largest == max(chunk * vocab, vocab * d, n_tokens * d) < n_tokens * vocab
    loss.backward()


def test_second_backward_fails_loudly():
    hidden, weight, targets = make_inputs((10,), 20, 8)
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):  # the stored gradients were scaled in place
        loss.backward()


def test_no_grad_and_frozen_inputs():
    hidden, weight, targets = make_inputs((30,), 40, 8)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=7)
    ref = cross_entropy(hidden @ weight.T, targets)
    assert abs(loss.item() - ref.item()) <= FP32_TOL * ref.item() and loss.grad_fn is None
    frozen = weight.detach()
    (grad_h,) = torch.autograd.grad(linear_cross_entropy(hidden, frozen, targets), (hidden,))
    (ref_h,) = torch.autograd.grad(cross_entropy(hidden @ frozen.T, targets), (hidden,))
    assert rel_err(grad_h, ref_h) <= FP32_TOL


def test_backward_scales_by_grad_output():
    hidden, weight, targets = make_inputs((20,), 30, 8)
    (3.0 * linear_cross_entropy(hidden, weight, targets, chunk_size=6)).backward()
    got = hidden.grad.clone()
    hidden.grad = None
    (3.0 * cross_entropy(hidden @ weight.T, targets)).backward()
    assert rel_err(got, hidden.grad) <= FP32_TOL


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("change,match", [
    (dict(reduction="none"), "reduction"),
    (dict(hidden=torch.zeros(4, 7)), "d=8"),
    (dict(weight=torch.zeros(20, 8, 1)), "weight must be"),
    (dict(targets=torch.zeros(5, dtype=torch.int64)), "leading shape"),
    (dict(targets=torch.zeros(4)), "targets must be one of"),
    (dict(targets=torch.tensor([0, 1, 20, 3])), r"\[0, 20\)"),
    (dict(targets=torch.tensor([0, -1, 2, 3])), "ignore_index"),
    (dict(hidden=torch.zeros(4, 8, dtype=torch.int32)), "floating point"),
    (dict(hidden=torch.zeros(4, 8, dtype=torch.float64)), "share a dtype"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
])
def test_rejects_bad_inputs(change, match):
    args = dict(hidden=torch.zeros(4, 8), weight=torch.zeros(20, 8), targets=torch.tensor([0, 1, 2, 19]),
                reduction="mean", chunk_size=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(args["hidden"], args["weight"], args["targets"], reduction=args["reduction"],
                             chunk_size=args["chunk_size"])


# ----------------------------------------------------------------------------- Triton kernel, CPU



@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="spawns the interpreter run itself")
def test_triton_kernel_in_interpreter_subprocess():
    """Runs this file's test_interp_* cases with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_cases(__file__, min_passed=len(INTERP_CASES) + 2)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernel (not the interpreter's)")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_row_kernel_compiles_for_h100(dtype):
    from systems.kernels.fused_linear_ce import MAX_BLOCK_V, ROW_KERNEL_WARPS, _ce_rows_kernel

    signature = {"Logits": f"*{dtype}", "Targets": "*i64", "Losses": "*fp32", "Scale": "*fp32",
                 "stride_row": "i32", "n_cols": "i32", "ignore_index": "i32",
                 "BLOCK_V": "constexpr", "WRITE_GRAD": "constexpr"}
    ptx = compile_ptx_for_h100(_ce_rows_kernel, signature=signature,
                               constexprs={"BLOCK_V": MAX_BLOCK_V, "WRITE_GRAD": True},
                               aligned_args=(0, 1, 2, 3, 4, 5), num_warps=ROW_KERNEL_WARPS)
    # rows of a vocabulary that is a multiple of 16 load full blocks as 16-byte vectors
    assert "ld.global.v4" in ptx


# the interpreter's row kernel walks the vocabulary in 64-column blocks: vocab 300 gives four
# full blocks and a ragged tail, vocab 64 exactly one block, vocab 50 only a tail
INTERP_CASES = [((37,), 300, 24, 16, "mean"), ((64,), 64, 16, 20, "sum"), ((3, 11), 50, 8, None, "mean")]


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("lead,vocab,d,chunk_size,reduction", INTERP_CASES)
def test_interp_kernel_matches_reference(lead, vocab, d, chunk_size, reduction):
    # the interpreter computes in numpy fp32: the same tolerance as the PyTorch path
    compare(*make_inputs(lead, vocab, d), reduction=reduction, chunk_size=chunk_size)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_kernel_autocast_bf16_and_ignore_index():
    # bf16 logits through the kernel (the interpreter truncates fp32 -> bf16 where a GPU rounds
    # to nearest: still within the bf16 tolerance)
    compare(*make_inputs((2, 24), 200, 32), chunk_size=20, tol=BF16_TOL, autocast_dtype=torch.bfloat16)
    hidden, weight, targets = make_inputs((50,), 130, 16)
    targets = targets.clone()
    targets[::4] = -100
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16)
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    assert abs(loss.item() - ref.item()) <= FP32_TOL * abs(ref.item())
    assert all(rel_err(g, r) <= FP32_TOL for g, r in zip(grads, ref_grads))


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_kernel_agrees_with_pytorch_rows():
    from systems.kernels.fused_linear_ce import _ce_rows_, _rows_torch_

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 200, generator=gen) * 5
    targets = torch.randint(0, 200, (9,), generator=gen)
    targets[4] = -100
    scale = torch.tensor(0.25)
    outputs = []
    for run in (_ce_rows_, None):
        x, losses = logits.clone(), torch.empty(9)
        if run is None:
            _rows_torch_(x, targets, losses, scale, -100, True)
        else:
            run(x, targets, losses, scale, ignore_index=-100, write_grad=True)
        outputs.append((x, losses))
    (kx, kl), (tx, tl_) = outputs
    torch.testing.assert_close(kl, tl_, atol=1e-5, rtol=1e-6)  # fp32 LSE of 200 terms, two summation orders
    torch.testing.assert_close(kx, tx, atol=1e-7, rtol=1e-5)
    assert kx[4].abs().max() == 0 and kl[4] == 0


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("lead,vocab,d,chunk_size", [
    ((4, 512), 50304, 256, None),  # padded GPT-2 vocab: 16-byte aligned rows
    ((1000,), 32003, 128, 384),  # odd vocab (unaligned rows), ragged last chunk
])
def test_gpu_autocast_bf16_matches_reference(lead, vocab, d, chunk_size):
    compare(*make_inputs(lead, vocab, d, device="cuda"), chunk_size=chunk_size, tol=BF16_TOL,
            autocast_dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp32_matches_reference():
    # TF32 off (the default for matmul): fp32 kernels on both sides
    compare(*make_inputs((777,), 5000, 64, device="cuda"), chunk_size=256, tol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_gpu_peak_memory_below_full_logits():
    n_tokens, vocab, d, chunk = 8192, 50304, 256, 1024
    hidden, weight, targets = make_inputs((n_tokens,), vocab, d, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # bound: a bf16 chunk of logits, the bf16 weight copy, grad_weight (fp32, plus its bf16
    # partial), grad_hidden, and slack; the unfused bf16 logits alone are n_tokens*vocab*2 = 824 MB
    bound = chunk * vocab * 2 + vocab * d * (2 + 4 + 2 + 4) + n_tokens * d * 4 * 2 + 64 * 2**20
    assert extra < bound < n_tokens * vocab * 2, (extra, bound)
