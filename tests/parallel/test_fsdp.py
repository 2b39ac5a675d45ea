"""FSDP on 2 gloo ranks: training equals non-parallel training; gradients land on the right shards.

Exactness: every rank also trains an unwrapped reference model in the same process (same thread
count, so the same CPU kernels), on the two half batches one after the other, summing their
gradients and halving them. That is the arithmetic FSDP does, in the same order: a sum of two
terms is commutative and halving is exact in binary floating point, so fp32 results must be
bit-identical, not merely close.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from systems.config import get_config
from systems.parallel.fsdp import FSDP
from systems.parallel.launch import spawn
from systems.model import Embedding, Linear, RMSNorm, TransformerLM
from systems.optim import AdamW, cross_entropy

WORLD_SIZE = 2
STEPS = 3
BATCH = 4  # global; 2 rows per rank
SEQ = 8


class OddToy(nn.Module):
    """Every weight has an odd element count, so each flat shard needs padding on 2 ranks."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding(13, 5)
        self.norm = RMSNorm(5)
        self.up = Linear(5, 7)
        self.down = Linear(7, 13)

    def forward(self, tokens):
        return self.down(torch.tanh(self.up(self.norm(self.embed(tokens)))))


def _lm_config():
    return get_config("debug", d_model=32, d_ff=48, n_heads=2, vocab_size=97, context_length=SEQ)


def _make(kind: str):
    torch.manual_seed(0)
    return OddToy() if kind == "toy" else TransformerLM(_lm_config())


def _batch(kind: str, step: int):
    vocab = 13 if kind == "toy" else 97
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _optimizer(name: str, params):
    if name == "ours":
        return AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "torch_adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference(kind: str, opt_name: str, world_size: int):
    """Non-parallel training; returns final weights and the first step's averaged gradients."""
    model = _make(kind)
    opt = _optimizer(opt_name, list(model.parameters()))
    local = BATCH // world_size
    first_grads = None
    for step in range(STEPS):
        x, y = _batch(kind, step)
        opt.zero_grad(set_to_none=True)
        for r in range(world_size):
            cross_entropy(model(x[r * local:(r + 1) * local]), y[r * local:(r + 1) * local]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.grad.mul_(1.0 / world_size)
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, first_grads


def _train_fsdp(ctx, kind, opt_name, compute_dtype, units, prefetch):
    model = _make(kind)
    fsdp = FSDP(model, compute_dtype=compute_dtype, units=units, prefetch=prefetch)
    opt = _optimizer(opt_name, list(fsdp.parameters()))
    local = BATCH // ctx.world_size
    first = None
    for step in range(STEPS):
        x, y = _batch(kind, step)
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(fsdp(x[ctx.rank * local:(ctx.rank + 1) * local]),
                             y[ctx.rank * local:(ctx.rank + 1) * local])
        loss.backward()
        fsdp.finish_gradient_synchronization()
        if first is None:
            first = {"shard_grads": [p.grad.clone() if p.grad is not None else None for p in fsdp.shard_parameters()],
                     "replicated_grads": {r.fqn: r.param.grad.clone() for r in fsdp._replicated},
                     "layout": fsdp.shard_layout()}
        opt.step()
    info = {"param_dtypes": sorted({str(p.dtype) for p in fsdp.parameters()}),
            "n_optimizer_params": sum(len(g["params"]) for g in opt.param_groups),
            "shard_numels": [p.numel() for p in fsdp.shard_parameters()]}
    return fsdp.gather_full_params(), first, info


CASES = {
    "toy_fp32_ours": ("toy", "ours", None, "modules", 2),
    "lm_fp32_torch_adamw": ("lm", "torch_adamw", None, "layers", 2),
    "lm_fp32_ours_prefetch1": ("lm", "ours", None, "layers", 1),
    "lm_fp16_sgd": ("lm", "sgd", torch.float16, "layers", 2),
}


def _fsdp_worker(ctx):
    out = {}
    for name, (kind, opt_name, cdtype, units, prefetch) in CASES.items():
        full, first, info = _train_fsdp(ctx, kind, opt_name, cdtype, units, prefetch)
        ref, ref_grads = _reference(kind, opt_name, ctx.world_size)
        out[name] = {"full": full, "first": first, "info": info, "ref": ref, "ref_grads": ref_grads}
    return out


@pytest.fixture(scope="module")
def runs():
    # one spawn for every case: process start-up dominates on a 2-core CPU
    return spawn(_fsdp_worker, WORLD_SIZE, "gloo", timeout_s=60, deadline_s=150)


@pytest.mark.parametrize("case", [c for c in CASES if "fp32" in c])
def test_fp32_training_equals_non_parallel_exactly(runs, case):
    for rank_out in runs:
        r = rank_out[case]
        assert set(r["full"]) == set(r["ref"])
        for name, ref in r["ref"].items():
            assert torch.equal(r["full"][name], ref), f"{case}: {name} differs by " \
                f"{(r['full'][name] - ref).abs().max().item():.3g}"
        assert r["info"]["param_dtypes"] == ["torch.float32"]


def test_fp16_compute_within_1e_4(runs):
    # fp16 keeps 11 significant bits (unit roundoff 2^-11 ~ 4.9e-4): the fp16 forward, backward and
    # reduce-scatter each perturb a gradient by a few times that, relative. The master weights
    # only ever receive lr * (momentum-summed) gradients, so their error is ~ lr * 3 steps *
    # |grad| * 1e-3 relative: with lr 0.1 and gradients below ~0.1 it stays under ~3e-5 (at
    # lr 0.5 we measured 1.8e-4, linear in lr as this predicts). A real bug (a wrong shard, a
    # missing average) moves weights by lr * |grad| ~ 1e-2, orders of magnitude above 1e-4.
    for rank_out in runs:
        r = rank_out["lm_fp16_sgd"]
        diffs = {n: (r["full"][n] - ref).abs().max().item() for n, ref in r["ref"].items()}
        assert max(diffs.values()) <= 1e-4, diffs
        assert max(diffs.values()) > 0  # fp16 was really used for compute
        assert r["info"]["param_dtypes"] == ["torch.float32"]  # master weights stay fp32


@pytest.mark.parametrize("case", ["toy_fp32_ours", "lm_fp32_torch_adamw"])
def test_gradients_land_on_the_right_shards(runs, case):
    for rank, rank_out in enumerate(runs):
        r = rank_out[case]
        first, ref_grads = r["first"], r["ref_grads"]
        for unit, grad in zip(first["layout"], first["shard_grads"]):
            flat = torch.cat([ref_grads[fqn].reshape(-1) for fqn, _, _ in unit["weights"]])
            flat = torch.nn.functional.pad(flat, (0, unit["padded"] - unit["numel"]))
            n = unit["shard_numel"]
            assert n * WORLD_SIZE == unit["padded"]
            assert torch.equal(grad, flat[rank * n:(rank + 1) * n]), unit["unit"]
        for fqn, grad in first["replicated_grads"].items():
            assert torch.equal(grad, ref_grads[fqn]), fqn


def test_optimizer_sees_only_shards(runs):
    for case, (kind, *_rest) in CASES.items():
        info = runs[0][case]["info"]
        model = _make(kind)
        n_total = sum(p.numel() for p in model.parameters())
        n_sharded = sum(p.numel() for m in model.modules() if isinstance(m, (Linear, Embedding))
                        for p in m.parameters())
        # each rank holds half of every (padded) flat vector, plus the replicated norms
        assert sum(info["shard_numels"]) * WORLD_SIZE >= n_sharded
        assert sum(info["shard_numels"]) * WORLD_SIZE - n_sharded < WORLD_SIZE * len(info["shard_numels"])
        n_norm = n_total - n_sharded
        assert info["n_optimizer_params"] == len(info["shard_numels"]) + sum(
            1 for m in model.modules() if isinstance(m, RMSNorm)), (case, n_norm)


class NormToy(nn.Module):
    """The project's Embedding, RMSNorm and Linear, as the handout's FSDP test uses them."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding(16, 8)
        self.norm = RMSNorm(8)
        self.linear1 = Linear(8, 12)
        self.linear2 = Linear(12, 16)

    def forward(self, tokens):
        return self.linear2(torch.relu(self.linear1(self.norm(self.embed(tokens)))))


GLOBAL_BATCH_19 = 20


def _batch_19(step: int):
    data = torch.randint(0, 16, (GLOBAL_BATCH_19, 7), generator=torch.Generator().manual_seed(10 + step))
    return data[:, :-1], data[:, 1:]


def _ulp_of_largest(t: torch.Tensor) -> float:
    """One unit in the last place of the tensor's largest magnitude (the normwise ulp)."""
    big = t.abs().max()
    return (torch.nextafter(big, torch.tensor(float("inf"))) - big).item()


def _train_single(batch_order: torch.Tensor, steps: int = 3) -> list[dict]:
    torch.manual_seed(0)
    model = NormToy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    for step in range(steps):
        x, y = _batch_19(step)
        opt.zero_grad()
        cross_entropy(model(x[batch_order]), y[batch_order]).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _fsdp_vs_single_process_worker(ctx, compute_dtype):
    """FSDP on this rank's half of the batch, per step, beside one process on all of it (trained
    here, in the same process, so both use the same CPU kernels and thread count), and beside one
    process on the same batch with its samples in reverse order."""
    torch.manual_seed(0)
    fsdp = FSDP(NormToy(), compute_dtype=compute_dtype)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.01)
    local = GLOBAL_BATCH_19 // ctx.world_size
    ours = []
    for step in range(3):
        x, y = _batch_19(step)
        opt.zero_grad()
        cross_entropy(fsdp(x[ctx.rank * local:(ctx.rank + 1) * local]), y[ctx.rank * local:(ctx.rank + 1) * local]).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        ours.append(fsdp.gather_full_params())
    grads = {}
    x, y = _batch_19(0)
    for name, rows in (("full", [slice(None)]), ("halves", [slice(r * local, (r + 1) * local) for r in range(2)])):
        torch.manual_seed(0)
        model = NormToy()
        for rows_ in rows:
            cross_entropy(model(x[rows_]), y[rows_]).backward()
        grads[name] = {n: p.grad / len(rows) for n, p in model.named_parameters()}
    order = torch.arange(GLOBAL_BATCH_19)
    return {"ours": ours, "single": _train_single(order), "reversed": _train_single(order.flip(0)), "grads": grads}


@pytest.fixture(scope="module")
def against_single_process():
    return {name: spawn(_fsdp_vs_single_process_worker, WORLD_SIZE, "gloo", args=(dtype,), timeout_s=60,
                        deadline_s=120)
            for name, dtype in (("fp32", None), ("fp16", torch.float16))}


@pytest.mark.slow
def test_fp32_fsdp_matches_single_process_training_within_one_ulp(against_single_process):
    """Issue item 19: 2 gloo ranks, each on half of a 20-sample batch, plain SGD (lr 0.01), 3 steps.

    Bit equality with one process on the whole batch is impossible: that process sums each
    weight gradient over all 20 samples in one reduction, FSDP sums over 10 on each rank and then
    adds the two sums, and float32 addition is not associative. The test shows this order at work
    twice: the full batch's gradient differs from the mean of its two halves' gradients (one
    process), and one process trained on the same batch with its samples reversed ends up off too,
    within the same bound. So it requires what rounding allows: after every step, every weight
    within one unit in the last place of its tensor's largest weight. (With FSDP's own reduction
    order the match is exact: test_fp32_training_equals_non_parallel_exactly.)"""
    for rank_out in against_single_process["fp32"]:
        grads = rank_out["grads"]
        assert any(not torch.equal(grads["full"][n], grads["halves"][n]) for n in grads["full"])
        assert any(not torch.equal(rank_out["reversed"][-1][n], w) for n, w in rank_out["single"][-1].items())
        for step, (ours, single, reversed_) in enumerate(zip(rank_out["ours"], rank_out["single"], rank_out["reversed"])):
            for name, w in single.items():
                for label, other in (("FSDP", ours), ("the reversed batch", reversed_)):
                    diff = (other[name] - w).abs().max().item()
                    assert diff <= _ulp_of_largest(w), f"step {step}: {label}'s {name} differs by {diff:.3g}"


@pytest.mark.slow
def test_fp16_fsdp_matches_single_process_training_within_1e_4(against_single_process):
    # fp16 compute rounds the gathered weights, activations and reduce-scattered gradients to 11
    # significant bits (relative 4.9e-4 each); SGD at lr 0.01 moves each weight by lr * grad per
    # step, so over 3 steps the fp32 masters drift by about 3 * 0.01 * |grad| * 1e-3, far below 1e-4
    for rank_out in against_single_process["fp16"]:
        for step, (ours, single) in enumerate(zip(rank_out["ours"], rank_out["single"])):
            for name, w in single.items():
                assert (ours[name] - w).abs().max().item() <= 1e-4, f"step {step}: {name}"


def test_bad_arguments_are_rejected():
    with pytest.raises(RuntimeError, match="process group"):
        FSDP(OddToy())
