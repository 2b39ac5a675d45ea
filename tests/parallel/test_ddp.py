"""DDP wrappers: 2 gloo ranks on CPU must train exactly like one process on the full batch."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from systems.parallel.ddp import (DDPBucketed, DDPIndividualParameters, assign_buckets,
                                     make_ddp)
from systems.parallel.launch import DistributedRunError, spawn

WORLD_SIZE = 2
STEPS = 4
BATCH = 8  # global batch; each rank gets BATCH // WORLD_SIZE rows


class FrozenToy(nn.Module):
    """An MLP whose middle layer is frozen, plus a parameter no step ever uses."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(16, 4)
        self.unused = nn.Parameter(torch.ones(3))  # must keep grad None, as in the reference

    def forward(self, x):
        return self.fc2(torch.relu(self.frozen(torch.relu(self.fc1(x)))))


class TiedToy(nn.Module):
    """Embedding and output head share one weight, used twice per forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.mix = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens)))).flatten(0, 1)


# (variant name, constructor kwargs): bucket sizes give one bucket per parameter (tiny cap),
# several buckets, and everything in one bucket
VARIANTS = [
    ("naive", {}),
    ("flat", {}),
    ("overlap", {}),
    ("bucketed", {"bucket_size_mb": 1e-9}),
    ("bucketed", {"bucket_size_mb": 0.0005}),
    ("bucketed", {"bucket_size_mb": 100}),
    ("bucketed", {"bucket_size_mb": 100, "last_bucket_mb": 1e-9}),
]


def _make(kind: str, seed: int):
    torch.manual_seed(seed)
    return FrozenToy() if kind == "frozen" else TiedToy()


def _data(kind: str, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "frozen":
        return torch.randn(BATCH, 10, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    tokens = torch.randint(0, 12, (BATCH, 5), generator=g)
    return tokens, torch.randint(0, 12, (BATCH * 5,), generator=g)


def _train(model, kind, *, ddp=None, rank=0, world_size=1, optimizer_name="sgd"):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if optimizer_name == "sgd"
           else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    local = BATCH // world_size
    runner = ddp if ddp is not None else model
    for step in range(STEPS):
        x, y = _data(kind, step)
        x = x[rank * local:(rank + 1) * local]
        y = y[rank * local * (y.numel() // BATCH):(rank + 1) * local * (y.numel() // BATCH)]
        # alternate both ways of zeroing: set_to_none=False exercises the bucket-view fast path
        opt.zero_grad(set_to_none=step % 2 == 0)
        if ddp is not None:
            ddp.on_train_batch_start()
        loss = nn.functional.cross_entropy(runner(x), y)
        loss.backward()
        if ddp is not None:
            ddp.finish_gradient_synchronization()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp_worker(ctx, kinds, optimizer_name):
    """Each (model, variant): rank-dependent init (the broadcast must fix it), then STEPS steps."""
    out = {}
    for kind in kinds:
        for i, (name, kwargs) in enumerate(VARIANTS):
            model = _make(kind, seed=ctx.rank + 17)  # ranks start different on purpose
            ddp = make_ddp(name, model, **kwargs)
            state = _train(model, kind, ddp=ddp, rank=ctx.rank, world_size=ctx.world_size,
                           optimizer_name=optimizer_name)
            info = {"tied": model.head.weight is model.embed.weight} if kind == "tied" else {}
            if isinstance(ddp, DDPBucketed):
                info["n_buckets"] = ddp.n_buckets
            ddp.remove_hooks()
            out[(kind, i)] = (state, info)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def distributed_states():
    # one spawn for every case: process start-up dominates the cost on a 2-core CPU
    results = spawn(_ddp_worker, WORLD_SIZE, "gloo", args=(("frozen", "tied"), "sgd"),
                    timeout_s=60, deadline_s=120)
    return results


def _reference(kind: str, optimizer_name: str = "sgd"):
    return _train(_make(kind, seed=0 + 17), kind, optimizer_name=optimizer_name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["frozen", "tied"])
@pytest.mark.parametrize("case", range(len(VARIANTS)), ids=[f"{n}{k.get('bucket_size_mb', '')}" for n, k in VARIANTS])
def test_variant_matches_single_process(distributed_states, kind, case):
    reference = _reference(kind)  # rank 0's initial weights, full batch, one process
    initial = _make(kind, seed=17).state_dict()
    for rank in range(WORLD_SIZE):
        state, info = distributed_states[rank][(kind, case)]
        assert state.keys() == reference.keys()
        for key in reference:
            # fp32: the ranks' averaged half-batch gradients differ from the full-batch gradient
            # only by summation order (~1e-7 relative); after 4 SGD steps that stays below 1e-5
            torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank} {kind} {VARIANTS[case]} {key}")
        if kind == "frozen":
            torch.testing.assert_close(state["frozen.weight"], initial["frozen.weight"])
            torch.testing.assert_close(state["unused"], initial["unused"])
        else:
            assert info["tied"]
    # the other rank started from different weights: equality proves the broadcast happened
    assert not torch.equal(_make(kind, seed=18).state_dict()["fc1.weight" if kind == "frozen" else "mix.weight"],
                           initial["fc1.weight" if kind == "frozen" else "mix.weight"])


@pytest.mark.slow
def test_bucket_counts(distributed_states):
    # FrozenToy trainable: fc1 (w, b), fc2 (w, b), unused -> 5 params; tiny cap -> one bucket each
    state, info = distributed_states[0][("frozen", 3)]
    assert info["n_buckets"] == 5
    state, info = distributed_states[0][("frozen", 5)]
    assert info["n_buckets"] == 1
    state, info = distributed_states[0][("frozen", 6)]  # the first parameter alone in the last bucket
    assert info["n_buckets"] == 2


def test_assign_buckets_reverse_order_and_cap():
    sizes = [400, 100, 100, 300, 50]
    assert assign_buckets(sizes, 400) == [[4, 3], [2, 1], [0]]
    assert assign_buckets(sizes, 10_000) == [[4, 3, 2, 1, 0]]
    # a parameter over the cap sits alone; every index appears exactly once
    assert assign_buckets(sizes, 200) == [[4], [3], [2, 1], [0]]
    assert assign_buckets(sizes, 1) == [[4], [3], [2], [1], [0]]
    assert assign_buckets([], 100) == []


def test_assign_buckets_separate_cap_for_the_last_bucket():
    """The last bucket (first parameters, reduced after backward) gets its own cap, at least one
    parameter; the rest are packed with the main cap as before."""
    sizes = [400, 100, 100, 300, 50]
    assert assign_buckets(sizes, 10_000, last_bucket_bytes=1) == [[4, 3, 2, 1], [0]]
    assert assign_buckets(sizes, 10_000, last_bucket_bytes=500) == [[4, 3, 2], [1, 0]]
    assert assign_buckets(sizes, 400, last_bucket_bytes=600) == [[4, 3], [2, 1, 0]]
    assert assign_buckets(sizes, 400, last_bucket_bytes=10_000) == [[4, 3, 2, 1, 0]]
    # the last bucket does not mix keys (dtype, device) either
    assert assign_buckets([1, 1, 1], 10, keys=["a", "b", "b"], last_bucket_bytes=10) == [[2, 1], [0]]
    with pytest.raises(ValueError, match="last bucket size must be positive"):
        assign_buckets(sizes, 400, last_bucket_bytes=0)
    with pytest.raises(ValueError, match="negative"):  # also where the negative size is in the last bucket
        assign_buckets([-5, 10], 100, last_bucket_bytes=100)


def test_assign_buckets_splits_on_key_change():
    assert assign_buckets([10, 10, 10, 10], 1000, keys=["a", "a", "b", "b"]) == [[3, 2], [1, 0]]


@pytest.mark.parametrize("bad", [0, -5])
def test_assign_buckets_rejects_bad_cap(bad):
    with pytest.raises(ValueError, match="bucket size must be positive"):
        assign_buckets([1, 2], bad)


def test_wrappers_need_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        DDPIndividualParameters(nn.Linear(2, 2))


def test_unknown_variant():
    with pytest.raises(ValueError, match="unknown DDP variant"):
        make_ddp("nope", nn.Linear(2, 2))


class SometimesExtra(nn.Module):
    """A layer the forward uses only when ``use_extra`` is set (on one rank, in one step)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.extra = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.use_extra = False

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if self.use_extra:
            h = h + self.extra(h)
        return self.head(h)


def _one_rank_uses_a_parameter_worker(ctx, name, kwargs):
    torch.manual_seed(0)
    model = SometimesExtra()
    ddp = make_ddp(name, model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(ctx.rank)
    for step in range(3):
        model.use_extra = ctx.rank == 0 and step == 2
        opt.zero_grad(set_to_none=True)
        ddp.on_train_batch_start()
        nn.functional.cross_entropy(ddp(torch.randn(4, 6, generator=g)), torch.randint(0, 3, (4,), generator=g)).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs", [("naive", {}), ("flat", {}), ("overlap", {}),
                                          ("bucketed", {"bucket_size_mb": 1e-9}), ("bucketed", {"bucket_size_mb": 100})],
                         ids=["naive", "flat", "overlap", "bucketed_per_param", "bucketed_one"])
def test_a_parameter_used_on_one_rank_only_is_named(name, kwargs):
    """Before the check: naive and overlap failed in gloo ("Connection reset by peer"), bucketed
    returned with rank 0 and rank 1 holding different weights. Now every variant raises, on the
    step where rank 0 alone used extra, naming the parameter and the ranks."""
    with pytest.raises(DistributedRunError, match=r"parameter 'extra\.weight' got a gradient on rank\(s\) \[0\] "
                                                  r"but not on rank\(s\) \[1\]"):
        spawn(_one_rank_uses_a_parameter_worker, WORLD_SIZE, "gloo", args=(name, kwargs), timeout_s=30, deadline_s=90)


def _check_cost_worker(ctx):
    torch.manual_seed(0)
    model = SometimesExtra()
    ddp = make_ddp("overlap", model)
    for _ in range(5):
        ddp.on_train_batch_start()
        model(torch.randn(4, 6)).sum().backward()
        ddp.finish_gradient_synchronization()
    return ddp.check_calls, ddp.check_seconds


@pytest.mark.slow
def test_the_agreement_runs_once_per_step_and_is_timed():
    for calls, seconds in spawn(_check_cost_worker, WORLD_SIZE, "gloo", timeout_s=30, deadline_s=90):
        assert calls == 5 and 0 < seconds < 5  # a CPU round trip per step, well under a second each


def test_bucketed_rejects_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_size_mb must be positive"):
        DDPBucketed(nn.Linear(2, 2), bucket_size_mb=0)


def _reduce_dtype_worker(ctx, reduce_dtype):
    model = _make("frozen", seed=ctx.rank + 17)
    ddp = DDPBucketed(model, bucket_size_mb=0.0005, reduce_dtype=reduce_dtype)
    state = _train(model, "frozen", ddp=ddp, rank=ctx.rank, world_size=ctx.world_size)
    grad_dtypes = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    return state, grad_dtypes


@pytest.mark.slow
def test_bucketed_reduce_dtype_communicates_low_precision_and_keeps_fp32_grads():
    results = spawn(_reduce_dtype_worker, WORLD_SIZE, "gloo", args=(torch.bfloat16,), timeout_s=60)
    reference = _reference("frozen")
    for state, grad_dtypes in results:
        assert grad_dtypes == {"torch.float32"}  # the optimizer sees gradients in the weights' dtype
        for key in reference:
            # bf16 keeps 8 bits: each averaged gradient is off by up to 2^-9 relative; over 4 SGD
            # steps (lr 0.1, momentum 0.9) on O(1) gradients that moves the weights by ~1e-4
            torch.testing.assert_close(state[key], reference[key], rtol=0, atol=2e-3, msg=key)
        # ... and by more than fp32 communication would (its summation-order noise is ~1e-7)
        assert max((state[k] - reference[k]).abs().max().item() for k in reference) > 1e-5


def test_bucketed_rejects_an_integer_reduce_dtype():
    with pytest.raises(ValueError, match="reduce_dtype"):
        DDPBucketed(nn.Linear(2, 2), bucket_size_mb=1, reduce_dtype=torch.int32)


def _grouped_update_worker(ctx, kind):
    """DDPBucketed with one bucket per group and each group's SGD step run by on_synced: every
    group stepped once per step, in the order its all-reduce was issued, and the same training."""
    from systems.train import GroupedOptimizer

    model = _make(kind, seed=ctx.rank + 17)
    if kind == "frozen":
        # a group mixing dtypes: the (never used) float64 parameter gets a bucket of its own in fc2's group
        model.unused.data = model.unused.data.double()
        groups = [[model.fc1.weight, model.fc1.bias], [model.fc2.weight, model.fc2.bias, model.unused]]
    else:
        groups = [[model.embed.weight], [model.mix.weight]]
    opt = GroupedOptimizer(groups, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    synced = []

    def on_synced(params):
        synced.append(next(i for i, g in enumerate(groups) if g[0] is params[0]))
        opt.step_group(params)

    ddp = DDPBucketed(model, groups=opt.groups, on_synced=on_synced)
    local = BATCH // ctx.world_size
    for step in range(STEPS):
        x, y = _data(kind, step)
        per_row = y.numel() // BATCH
        opt.zero_grad(set_to_none=step % 2 == 0)
        ddp.on_train_batch_start()
        out = ddp(x[ctx.rank * local:(ctx.rank + 1) * local])
        nn.functional.cross_entropy(out, y[ctx.rank * local * per_row:(ctx.rank + 1) * local * per_row]).backward()
        ddp.finish_gradient_synchronization()
        opt.step()  # every group was stepped by on_synced: nothing is left
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, synced, ddp.n_buckets


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["frozen", "tied"])
def test_bucketed_groups_update_each_group_once_as_it_is_synced(kind):
    results = spawn(_grouped_update_worker, WORLD_SIZE, "gloo", args=(kind,), timeout_s=60, deadline_s=120)
    reference_model = _make(kind, seed=17)
    if kind == "frozen":
        reference_model.unused.data = reference_model.unused.data.double()
    reference = _train(reference_model, kind)
    for state, synced, n_buckets in results:
        # two groups per step, each once; the frozen toy's second group is two buckets (two dtypes)
        assert [sorted(synced[i:i + 2]) for i in range(0, len(synced), 2)] == [[0, 1]] * STEPS
        assert n_buckets == (3 if kind == "frozen" else 2)
        for key in reference:
            # the same fp32 tolerance as test_variant_matches_single_process (summation order)
            torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"{kind} {key}")


def test_bucketed_groups_are_checked_before_communicating():
    with pytest.raises(ValueError, match="either bucket_size_mb"):
        DDPBucketed(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="either bucket_size_mb"):
        DDPBucketed(nn.Linear(2, 2), bucket_size_mb=1, groups=[])
    with pytest.raises(ValueError, match="pass groups too"):
        DDPBucketed(nn.Linear(2, 2), bucket_size_mb=1, on_synced=print)


def _grouped_masters_worker(ctx):
    """A MasterWeightAdamW per group, built from each rank's own weights, then the plan's
    bucket-per-group DDP: the optimizer's split masters must end up rank 0's everywhere."""
    from systems.kernels.fused_adamw import MasterWeightAdamW
    from systems.parallel.plan import ParallelPlan, apply
    from systems.train import GroupedOptimizer

    model = _make("frozen", seed=17 + ctx.rank)
    weights = {id(model.fc1.weight), id(model.fc2.weight)}
    groups = [[model.fc1.weight, model.fc1.bias], [model.fc2.weight, model.fc2.bias, model.unused]]
    opt = GroupedOptimizer(groups, make_optimizer=lambda ps: MasterWeightAdamW(
        ps, low_precision=[p for p in ps if id(p) in weights], split_masters=True))
    apply(model, ParallelPlan(data_parallel="bucketed", update_per_bucket=True), optimizer=opt)
    return [opt.master_of(p).clone() for p in (model.fc1.weight, model.fc2.weight)]


@pytest.mark.slow
def test_update_per_bucket_broadcasts_the_optimizers_masters():
    # the module broadcast reaches the bf16 high halves only; the low halves live in the optimizer
    masters = spawn(_grouped_masters_worker, WORLD_SIZE, "gloo", timeout_s=30, deadline_s=90)
    initial = _make("frozen", seed=17)
    for ours, theirs, fp32 in zip(masters[0], masters[1], (initial.fc1.weight, initial.fc2.weight)):
        torch.testing.assert_close(theirs, ours, atol=0, rtol=0)
        torch.testing.assert_close(ours, fp32.detach(), atol=0, rtol=0)
