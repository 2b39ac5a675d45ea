"""Activation checkpointing applied from outside the model: every runner gives the plain model's
gradients, and a checkpointed model's ``layers`` stay the real blocks, so compiling them
(``compile_blocks``) and grouping their parameters (``block_groups``) work on it."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import Counter

import pytest
import torch

from systems.config import get_config
from systems.model import TransformerLM
from systems.optim import cross_entropy
from systems.parallel import checkpoint as checkpointing
from systems.parallel.compile import compile_blocks
from systems.train import OptimizerSpec, StepSpec, TrainStep, block_groups, build_optimizer


def _grads(model, inputs, targets):
    model.zero_grad(set_to_none=True)
    cross_entropy(model(inputs), targets).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _model_and_batch(n_layers: int = 5, device: str = "cpu"):
    cfg = get_config("debug", n_layers=n_layers)
    torch.manual_seed(0)
    model = TransformerLM(cfg, device=device)
    inputs = torch.randint(0, cfg.vocab_size, (2, 16), device=device)
    targets = torch.randint(0, cfg.vocab_size, (2, 16), device=device)
    return cfg, model, inputs, targets


@pytest.mark.parametrize("how", ["group1", "group2", "group3", "nested2", "nested3", "chain"])
def test_checkpointing_gives_the_plain_gradients(how):
    cfg, model, inputs, targets = _model_and_batch()
    ref = _grads(model, inputs, targets)
    names = [n for n, _ in model.named_parameters()]
    if how.startswith("group"):
        checkpointing.apply_activation_checkpointing(model, int(how[-1]))
    elif how.startswith("nested"):
        checkpointing.apply_nested_checkpointing(model, branching=int(how[-1]))
    else:
        checkpointing.apply_chain_checkpointing(model)
    assert [n for n, _ in model.named_parameters()] == names  # parameters keep their names
    with checkpointing.count_block_forwards(model) as calls:
        got = _grads(model, inputs, targets)
    # recomputation runs the same ops on the same inputs, so the gradients are bitwise equal
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=0)
    assert sum(calls.values()) > cfg.n_layers  # each block ran again in the backward
    checkpointing.remove_activation_checkpointing(model)
    with checkpointing.count_block_forwards(model) as calls:
        _grads(model, inputs, targets)
    assert sum(calls.values()) == cfg.n_layers


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that reach it: a selective checkpoint's saved ops are answered from its
    cache during the recompute, below this mode, so they are counted once."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def test_saving_attention_skips_its_recompute_and_keeps_the_gradients():
    cfg, model, inputs, targets = _model_and_batch(n_layers=3)
    model = TransformerLM(dataclasses.replace(cfg, attn_impl="sdpa"))
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # SDPA's CPU kernel
    with _CountOps() as plain_ops:
        ref = _grads(model, inputs, targets)
    counts = {}
    for save in ("none", "attention"):
        checkpointing.apply_activation_checkpointing(model, 1, save=save)
        with _CountOps() as ops:
            got = _grads(model, inputs, targets)
        counts[save] = ops.calls
        # the saved outputs are the ones the recompute would give: gradients bitwise equal
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=0, msg=f"{save}: {n}")
    assert plain_ops.calls[attention] == cfg.n_layers  # one forward kernel per block
    assert counts["none"][attention] == 2 * cfg.n_layers  # run again in each block's recompute
    assert counts["attention"][attention] == cfg.n_layers  # kept from the forward
    # everything else is still recomputed: the projections' matmuls run as often as under full checkpointing
    mm = torch.ops.aten.mm.default
    assert counts["attention"][mm] == counts["none"][mm] > plain_ops.calls[mm]


def test_unknown_checkpoint_save_is_refused():
    _, model, _, _ = _model_and_batch(n_layers=2)
    with pytest.raises(ValueError, match="checkpoint save must be one of none, attention"):
        checkpointing.apply_activation_checkpointing(model, 1, save="everything")


def test_chain_recomputes_every_prefix():
    cfg, model, inputs, targets = _model_and_batch(n_layers=6)
    checkpointing.apply_chain_checkpointing(model)
    with checkpointing.count_block_forwards(model) as calls:
        _grads(model, inputs, targets)
    n = cfg.n_layers
    # the forward runs every block once; the backward of block i recomputes blocks 0..i
    assert sum(calls.values()) == n + n * (n + 1) // 2
    assert [calls[i] for i in range(n)] == [1 + n - i for i in range(n)]


def test_checkpointing_rejects_bad_group_size():
    model = TransformerLM(get_config("debug"))
    with pytest.raises(ValueError, match="group_size"):
        checkpointing.apply_activation_checkpointing(model, 3)
    with pytest.raises(ValueError, match="branching"):
        checkpointing.apply_nested_checkpointing(model, branching=1)
    with pytest.raises(ValueError, match="TransformerLM"):
        checkpointing.apply_chain_checkpointing(torch.nn.Linear(2, 2))


def test_a_checkpointed_model_keeps_its_real_blocks():
    _, model, _, _ = _model_and_batch()
    blocks = list(model.layers)
    checkpointing.apply_activation_checkpointing(model, 2)
    assert list(model.layers) == blocks and isinstance(model.layers, torch.nn.ModuleList)
    # one group per real block, then one per module that owns parameters outside them
    groups = block_groups(model, blocks=model.layers)
    assert [set(map(id, g)) for g in groups[:len(blocks)]] == [set(map(id, b.parameters())) for b in blocks]
    assert sum(len(g) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("how", ["group2", "chain"])
def test_optimizer_in_backward_over_block_groups_of_a_checkpointed_model(how):
    """Non-reentrant checkpointing runs one backward, so each group's hook fires once: the update
    inside the backward equals a plain AdamW step on the unchecked model."""
    _, model, inputs, targets = _model_and_batch()
    plain = copy.deepcopy(model)
    TrainStep(plain, optimizer=build_optimizer(plain, OptimizerSpec()))(inputs, targets)
    if how == "chain":
        checkpointing.apply_chain_checkpointing(model)
    else:
        checkpointing.apply_activation_checkpointing(model, 2)
    in_backward = build_optimizer(model, OptimizerSpec(in_backward=True))
    TrainStep(model, spec=StepSpec(), optimizer=in_backward)(inputs, targets)
    # same gradients (recomputation is exact) and the same AdamW arithmetic per tensor: bitwise equal
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("how", ["group2", "nested2"])
def test_compiled_blocks_of_a_checkpointed_model_give_the_plain_gradients(how, monkeypatch):
    # aot_eager: Dynamo and AOTAutograd trace each block (graph breaks, recompiles and the
    # checkpoint interplay are exercised) without Inductor's code generation, minutes on a CPU
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    _, model, inputs, targets = _model_and_batch(n_layers=4)
    ref = _grads(model, inputs, targets)
    if how == "group2":
        checkpointing.apply_activation_checkpointing(model, 2)
    else:
        checkpointing.apply_nested_checkpointing(model, branching=2)
    compile_blocks(model.layers)
    assert all(block._compiled_call_impl is not None for block in model.layers)
    got = _grads(model, inputs, targets)
    # AOTAutograd may decompose ops into others (e.g. rsqrt, softmax), so the sums round
    # differently: fp32 agreement to a few ulps of the gradients' scale, not bitwise
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Inductor's Triton kernels)")
def test_inductor_compiled_blocks_of_a_checkpointed_model_on_a_gpu():
    torch._dynamo.reset()
    _, model, inputs, targets = _model_and_batch(n_layers=4, device="cuda")
    ref = _grads(model, inputs, targets)
    checkpointing.apply_activation_checkpointing(model, 2)
    compile_blocks(model.layers)
    got = _grads(model, inputs, targets)
    # Inductor fuses the pointwise ops and may reorder reductions: fp32 agreement, not bitwise
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
