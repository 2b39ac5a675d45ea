"""ShardedOptimizer on 2 gloo ranks equals the unsharded optimizer exactly; assignment is balanced.

Every rank computes the gradient of the same full batch, so gradients are identical on all ranks
without a DDP wrapper, and the only difference from the reference is who runs each parameter's
update. The optimizers update each parameter independently, so the results must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from systems.parallel.launch import all_gather_objects, spawn
from systems.parallel.sharded_optimizer import ShardedOptimizer, balanced_assignment
from systems.optim import AdamW

WORLD_SIZE = 2
STEPS = 4


class FrozenTiedToy(nn.Module):
    """Embedding tied to the output head, a frozen layer, sizes that differ a lot."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.embed(tokens))) * self.gain
        return self.head(torch.relu(self.frozen(h)))


def _data(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 16, (4 * 6,), generator=g)


def _train(opt_factory, late_group: bool):
    torch.manual_seed(0)
    model = FrozenTiedToy()
    extra = nn.Parameter(torch.randn(5))  # joins through add_param_group after the first step
    opt = opt_factory([p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        if late_group and step == 1:
            opt.add_param_group({"params": [extra], "lr": 5e-3})
        x, y = _data(step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y) + (extra ** 2).sum() * (step >= 1)
        loss.backward()
        opt.step()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state["extra"] = extra.detach().clone()
    return state, opt


OPTIMIZERS = {
    "ours": (AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "torch_adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "torch_sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def _worker(ctx):
    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        ref, _ = _train(lambda ps: cls(ps, **kwargs), late_group=True)
        sharded, opt = _train(lambda ps: ShardedOptimizer(ps, cls, **kwargs), late_group=True)
        params = [p for g in opt.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        out[name] = {
            "ref": ref, "sharded": sharded,
            "owners": [opt.owner[p] for p in params], "sizes": [p.numel() for p in params],
            "loads": list(opt.loads),
            "state_ids": sorted(index[id(p)] for p in opt.state),
            "owned_ids": sorted(index[id(p)] for p in opt.owned_parameters()),
            "state_bytes": opt.state_bytes(),
            "inner_lrs": [g["lr"] for g in opt.optimizer.param_groups],
        }
    out["everyone"] = all_gather_objects({k: v["owners"] for k, v in out.items()})
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_worker, WORLD_SIZE, "gloo", timeout_s=60, deadline_s=120)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_equals_unsharded_exactly(runs, name):
    for rank_out in runs:
        r = rank_out[name]
        for key, ref in r["ref"].items():
            assert torch.equal(r["sharded"][key], ref), f"{name}: {key}"
    # every rank ends with the same weights
    for key in runs[0][name]["sharded"]:
        assert torch.equal(runs[0][name]["sharded"][key], runs[1][name]["sharded"][key])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_only_for_own_shard(runs, name):
    owned = [set(r[name]["owned_ids"]) for r in runs]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(range(len(runs[0][name]["sizes"])))
    for r in runs:
        # state exists only for owned parameters (SGD keeps a momentum buffer, AdamW two moments)
        assert set(r[name]["state_ids"]) <= set(r[name]["owned_ids"])
        assert r[name]["state_ids"]
        assert r[name]["inner_lrs"][-1] == 5e-3  # the late group kept its own options


def test_assignment_is_balanced_and_agreed(runs):
    everyone = runs[0]["everyone"]
    assert everyone[0] == everyone[1]  # all ranks agree on the owners
    r = runs[0]["ours"]
    loads = [sum(s for s, o in zip(r["sizes"], r["owners"]) if o == rank) for rank in range(WORLD_SIZE)]
    assert loads == r["loads"]
    # the late group went to the rank that was lighter after the first groups
    assert max(loads) - min(loads) <= max(r["sizes"])


def test_balanced_assignment_greedy():
    # largest first onto the lightest rank: 10 -> r0, 6 -> r1, 5 -> r1, 4 -> r0 ... loads 15/15
    owners = balanced_assignment([4, 10, 5, 6, 1, 4], 2)
    loads = [sum(s for s, o in zip([4, 10, 5, 6, 1, 4], owners) if o == r) for r in range(2)]
    assert sorted(loads) == [15, 15]
    # continuing from existing loads: a later group fills the lighter rank first
    loads = [100, 0, 50]
    assert balanced_assignment([30, 30], 3, loads) == [1, 1] and loads == [100, 60, 50]
    with pytest.raises(ValueError):
        balanced_assignment([1], 0)


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        ShardedOptimizer([nn.Parameter(torch.ones(2))], AdamW, lr=1e-3)
