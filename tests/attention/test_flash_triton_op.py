"""The FlashAttention-2 custom ops (systems/attention/flash_triton/op.py) against the
autograd.Function they wrap, which tests/attention/test_flash_triton.py checks against a float64
reference. Both launch the same kernels on the same contiguous inputs, so the outputs and
gradients must be bitwise equal (tolerance 0).

CPU: under TRITON_INTERPRET=1 in a subprocess (fp32): the op against the Function, inside
torch.compile as one graph, and kept by a selective checkpoint, with the blocks eager and with
them compiled by Inductor (the leaderboard's setting). GPU (marked gpu): bf16 the same.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from systems.testing import have_triton, interpreting, relative_error

INTERPRETING = interpreting()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    return q, k, v, do


def _through(fn, q, k, v, do, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, causal)
    return (out, *torch.autograd.grad(out, leaves, do))


def _op_equals_function(shape, dtype, device, *, compiled: bool = False):
    from systems.attention import FlashAttentionTriton
    from systems.attention.flash_triton.op import flash_attention_op

    q, k, v, do = _inputs(shape, dtype, device)
    # a transposed view, as the model passes (b, h, seq, d) out of (b, seq, h, d): the op makes it contiguous
    q = q.transpose(-2, -3).contiguous().transpose(-2, -3)
    op = torch.compile(flash_attention_op, backend="aot_eager", fullgraph=True) if compiled else flash_attention_op
    for causal in (True, False):
        want = _through(lambda *a: FlashAttentionTriton.apply(*a), q, k, v, do, causal)
        got = _through(op, q, k, v, do, causal)
        for name, w, g in zip(("o", "dq", "dk", "dv"), want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"causal={causal}: {name}")


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="spawns the interpreter run itself")
def test_op_in_interpreter_subprocess():
    from systems.testing import run_interpreter_cases

    run_interpreter_cases(__file__, min_passed=4)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_op_equals_the_function():
    _op_equals_function((2, 3, 37, 16), torch.float32, "cpu")


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_op_is_one_node_inside_torch_compile():
    # fullgraph=True fails on any graph break: the op must trace as an opaque node, fake shapes included
    _op_equals_function((1, 2, 33, 16), torch.float32, "cpu", compiled=True)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.name()] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_selective_checkpoint_keeps_our_attention():
    """checkpoint_save="attention" keeps the op's output: its forward runs once per block, not
    again in the recompute, and the gradients equal the plain model's bitwise."""
    from systems.config import get_config
    from systems.model import TransformerLM
    from systems.optim import cross_entropy
    from systems.parallel import checkpoint as checkpointing

    cfg = dataclasses.replace(get_config("debug", n_layers=2), attn_impl="flash_triton")
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    inputs, targets = (torch.randint(0, cfg.vocab_size, (2, 24)) for _ in range(2))

    def grads():
        model.zero_grad(set_to_none=True)
        with _CountOps() as ops:
            cross_entropy(model(inputs), targets).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, ops.calls

    ref, plain = grads()
    forward = "systems::flash_attention_forward"
    assert plain[forward] == cfg.n_layers and plain["systems::flash_attention_backward"] == cfg.n_layers
    for save, runs in (("none", 2 * cfg.n_layers), ("attention", cfg.n_layers)):
        checkpointing.apply_activation_checkpointing(model, 1, save=save)
        got, calls = grads()
        assert calls[forward] == runs, save
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=0, msg=f"{save}: {n}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_op_equals_the_function_bf16():
    _op_equals_function((2, 4, 1000, 64), torch.bfloat16, "cuda")
    _op_equals_function((1, 4, 2048, 128), torch.bfloat16, "cuda", compiled=True)


def _compiled_checkpointed_blocks_keep_our_attention(device: str, dtype: torch.dtype, atol: float):
    """Blocks compiled by Inductor inside selective checkpointing (the leaderboard's composition):
    the op's forward runs once per block with save="attention" and twice with save="none" (the
    recompute), counted where the op's implementation calls the kernels, which compiled code cannot
    skip; the gradients match the plain eager model's."""
    from systems.attention.flash_triton import op as op_module
    from systems.config import get_config
    from systems.model import TransformerLM
    from systems.optim import cross_entropy
    from systems.parallel import checkpoint as checkpointing
    from systems.parallel.compile import compile_blocks

    cfg = dataclasses.replace(get_config("debug", n_layers=2), attn_impl="flash_triton")
    torch.manual_seed(0)
    model = TransformerLM(cfg, device=device)
    inputs, targets = (torch.randint(0, cfg.vocab_size, (2, 32), device=device) for _ in range(2))
    forwards = []
    real_forward = op_module.flash_forward_triton

    def counting_forward(*args, **kwargs):
        forwards.append(1)
        return real_forward(*args, **kwargs)

    def grads():
        model.zero_grad(set_to_none=True)
        forwards.clear()
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            loss = cross_entropy(model(inputs), targets)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, len(forwards)

    torch._dynamo.reset()
    try:
        op_module.flash_forward_triton = counting_forward
        ref, plain = grads()
        assert plain == cfg.n_layers
        compile_blocks(model.layers)
        for save, runs in (("none", 2 * cfg.n_layers), ("attention", cfg.n_layers)):
            checkpointing.apply_activation_checkpointing(model, 1, save=save)
            for attempt in range(2):  # the first call compiles, the second runs the cached graphs
                got, calls = grads()
                assert calls == runs, (save, attempt, calls)
            # Inductor fuses the blocks' pointwise work and may reorder its reductions
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], rtol=atol, atol=atol, msg=f"{save}: {n}")
                # bf16's atol is as large as these gradients; as whole tensors they agree to its
                # rounding (about 1e-2 relative, eager against compiled bf16 on a CPU; fp32: orders
                # of magnitude less), which a backward returning zeros (1.0) cannot
                bound = 1e-4 if dtype == torch.float32 else 5e-2
                assert relative_error(got[n], ref[n]) < bound, (save, n, relative_error(got[n], ref[n]))
    finally:
        op_module.flash_forward_triton = real_forward
        torch._dynamo.reset()


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_compiled_checkpointed_blocks_keep_our_attention():
    _compiled_checkpointed_blocks_keep_our_attention("cpu", torch.float32, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_checkpointed_blocks_keep_our_attention_bf16():
    # bf16 autocast: a fused kernel rounds its intermediates once where eager rounds each op, so
    # gradients agree to bf16's resolution over the few ops between roundings, not bitwise
    _compiled_checkpointed_blocks_keep_our_attention("cuda", torch.bfloat16, atol=3e-2)
