"""systems/kernels/rope_qkv.py against the model's PyTorch path (split, heads, ``rotate_pairs``).

The Triton passes run under TRITON_INTERPRET=1 in a subprocess (the variable must be set before
triton is imported), in fp32 and fp16 (the interpreter's bf16 is not the GPU's), at head dims that
fill the padded block (64) and that do not (80, the 2.7B preset's), with more rows than one program
takes, and with gradients in the strides attention's backward may hand back. Both passes compute
in fp32 the same products and sums as the reference and round once to the input's dtype, so fp32
agrees to a few ulps (the interpreter's numpy may contract a multiply-add the reference rounds
twice: atol/rtol 1e-6) and fp16 to one rounding of the result (its ulp, 1e-3 relative). The
compiled kernels, and the model compiled with ``qkv_rope_kernel`` in bf16, run on a GPU only.
"""

from __future__ import annotations

import pytest
import torch

from systems.config import get_config
from systems.testing import compile_ptx_for_h100, have_triton, interpreting, relative_error, run_interpreter_cases

INTERPRETING = interpreting()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (batch, seq, heads, d_head): one program's rows and more (4096 // 64 = 64 rows a program), and
# a head dim the block pads (80 -> 128)
SHAPES = [(2, 5, 3, 64), (3, 37, 2, 80), (1, 40, 4, 16)]
# bf16 (GPU only): both sides round the same fp32 value once, but the GPU contracts multiply-adds
# the reference rounds twice, which can move a result across a rounding boundary: one bf16 ulp
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def _reference(qkv, cos, sin, n_heads):
    from systems.model import qkv_heads

    return qkv_heads(qkv, cos, sin, n_heads=n_heads)  # the model's PyTorch path


def _tables(seq, d_head, device="cpu"):
    from systems.model import RotaryEmbedding

    rope = RotaryEmbedding(d_head, context_length=2 * seq, device=device)
    return rope.tables(torch.arange(seq, device=device) + 3)  # positions need not start at 0


def _case(shape, dtype, device="cpu", seed=0):
    b, seq, h, d_head = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(b, seq, 3 * h * d_head, generator=gen, device=device).to(dtype)
    grads = [torch.randn(b, h, seq, d_head, generator=gen, device=device).to(dtype) for _ in range(3)]
    return qkv, grads, *_tables(seq, d_head, device)


def _check(shape, dtype, *, device="cpu", grad_layout="contiguous"):
    from systems.kernels.rope_qkv import rope_qkv

    b, seq, h, d_head = shape
    qkv, grads, cos, sin = _case(shape, dtype, device)
    ref_in = qkv.clone().requires_grad_(True)
    ours_in = qkv.clone().requires_grad_(True)
    ref = _reference(ref_in, cos, sin, h)
    ours = rope_qkv(ours_in, cos, sin, n_heads=h)
    for a, r in zip(ours, ref):
        assert a.shape == (b, h, seq, d_head) and a.dtype == dtype
        torch.testing.assert_close(a, r, **TOL[dtype])
    # v is handed on as a view of the (contiguous) row, not copied
    assert ours[2].untyped_storage().data_ptr() == ours_in.untyped_storage().data_ptr()
    if grad_layout == "seq-major":  # (b, seq, h, d) storage seen as (b, h, seq, d): what SDPA may return
        grads = [g.transpose(1, 2).contiguous().transpose(1, 2) for g in grads]
    elif grad_layout == "strided-d":  # every other element of a wider buffer: a stride of 2 in d_head
        grads = [torch.stack((g, torch.full_like(g, float("nan"))), dim=-1)[..., 0] for g in grads]
    torch.autograd.backward(ref, grads)
    torch.autograd.backward(ours, grads)
    torch.testing.assert_close(ours_in.grad, ref_in.grad, **TOL[dtype])


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"d{s[3]}x{s[0] * s[1] * s[2]}rows" for s in SHAPES])
def test_interp_matches_the_pytorch_path(shape, dtype):
    _check(shape, dtype)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("layout", ["seq-major", "strided-d"])
def test_interp_backward_reads_gradients_in_any_strides(layout):
    _check((2, 9, 3, 80), torch.float32, grad_layout=layout)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_an_output_without_gradient_counts_as_zeros():
    from systems.kernels.rope_qkv import rope_qkv

    qkv, _, cos, sin = _case((1, 6, 2, 16), torch.float32)
    qkv.requires_grad_(True)
    q, k, v = rope_qkv(qkv, cos, sin, n_heads=2)
    v.sum().backward()  # q and k unused: their part of the gradient is zero, v's is ones
    d = 2 * 16
    assert torch.equal(qkv.grad[..., :2 * d], torch.zeros_like(qkv.grad[..., :2 * d]))
    assert torch.equal(qkv.grad[..., 2 * d:], torch.ones_like(qkv.grad[..., 2 * d:]))


N_INTERP_TESTS = len(SHAPES) * 2 + 2 + 1


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="spawns the interpreter run itself")
def test_triton_passes_in_interpreter_subprocess():
    """Runs this file's test_interp_* cases with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_cases(__file__, min_passed=N_INTERP_TESTS)


def test_bad_shapes_and_tables_are_refused_with_what_to_pass():
    from systems.kernels.rope_qkv import rope_qkv

    qkv = torch.zeros(1, 4, 3 * 2 * 8)
    cos = sin = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"qkv must be \(batch, seq, 3 \* d_model\)"):
        rope_qkv(qkv[0], cos, sin, n_heads=2)
    with pytest.raises(ValueError, match=r"cos and sin must be \(seq, d_head\) = \(4, 8\)"):
        rope_qkv(qkv, cos[:3], sin[:3], n_heads=2)
    with pytest.raises(ValueError, match="float32 tables"):
        rope_qkv(qkv, cos.half(), sin.half(), n_heads=2)


def test_the_flag_needs_the_fused_projection():
    with pytest.raises(ValueError, match="set fused_projections=True"):
        get_config("debug", qkv_rope_kernel=True)
    get_config("debug", qkv_rope_kernel=True, fused_projections=True)


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="compiles the jit'ed kernels (not the interpreter's)")
@pytest.mark.parametrize("d_head", [64, 80])
def test_kernels_compile_for_h100(d_head):
    import triton

    from systems.kernels.rope_qkv import BLOCK_ELEMENTS, NUM_WARPS, _rope_qkv_bwd_kernel, _rope_qkv_fwd_kernel

    block_d = triton.next_power_of_2(d_head)
    shape = dict(H=25, D=d_head, BLOCK_ROWS=BLOCK_ELEMENTS // block_d, BLOCK_D=block_d)
    fwd = compile_ptx_for_h100(
        _rope_qkv_fwd_kernel, num_warps=NUM_WARPS, aligned_args=(0, 1, 2, 3, 4), constexprs=shape,
        signature={"QKV": "*bf16", "Cos": "*fp32", "Sin": "*fp32", "Q": "*bf16", "K": "*bf16",
                   "n_rows": "i32", "seq": "i32", **{k: "constexpr" for k in shape}})
    strides = [f"s{t}_{a}" for t in "qkv" for a in "bhsd"]
    bwd = compile_ptx_for_h100(
        _rope_qkv_bwd_kernel, num_warps=NUM_WARPS, aligned_args=(0, 1, 2, 3, 4, 5), constexprs=shape,
        signature={"dQ": "*bf16", "dK": "*bf16", "dV": "*bf16", "Cos": "*fp32", "Sin": "*fp32", "dQKV": "*bf16",
                   "n_rows": "i32", "seq": "i32", **{s: "i32" for s in strides}, **{k: "constexpr" for k in shape}})
    for ptx in (fwd, bwd):
        assert ".entry" in ptx and "ld.global" in ptx and "st.global" in ptx


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_match_the_pytorch_path_on_gpu(dtype):
    _check((4, 512, 25, 64), dtype, device="cuda")
    _check((2, 128, 32, 80), dtype, device="cuda", grad_layout="seq-major")


@needs_cuda
def test_the_model_compiled_with_the_kernel_matches_it_without():
    from systems.model import TransformerLM

    torch.manual_seed(0)
    cfg = get_config("debug", fused_projections=True, attn_impl="sdpa")
    ref = TransformerLM(cfg).cuda()
    ours = TransformerLM(cfg.with_(qkv_rope_kernel=True)).cuda()
    ours.load_state_dict(ref.state_dict())
    for block in ours.layers:
        block.compile()
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = ref(tokens), ours(tokens)
    torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)  # bf16 through two blocks
    a.float().square().mean().backward()
    b.float().square().mean().backward()
    for (name, pa), pb in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=3e-2, rtol=5e-2, msg=name)
        # that atol is as large as these gradients (at most ~1e-2), so it would pass a backward
        # returning zeros; as whole tensors they agree to bf16 rounding through two blocks (about
        # 1e-2 relative: eager against compiled bf16 on a CPU), which zeros (1.0) cannot
        assert relative_error(pb.grad, pa.grad) < 5e-2, name
