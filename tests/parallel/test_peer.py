"""DDPPeer: 2 and 3 gloo ranks on CPU (gradients all-gathered into the receive slots; the copy
engines need GPUs, tests marked gpu) must train like one process on the full batch, with the
sum folded into FusedAdamW's update."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from systems.kernels.fused_adamw import FusedAdamW
from systems.parallel.launch import DistributedRunError, spawn
from systems.parallel.peer import DDPPeer, _Layout, slot_of
from systems.train import GroupedOptimizer
from tests.parallel.test_ddp import FrozenToy, SometimesExtra, TiedToy

STEPS = 3
BATCH = 12  # divisible by 2 and 3 ranks
HYPER = dict(lr=1e-2, weight_decay=0.1)


def _make(kind: str, seed: int):
    torch.manual_seed(seed)
    return FrozenToy() if kind == "frozen" else TiedToy()  # "tied" and "tied_swapped"


def _groups(kind: str, model) -> list[list[nn.Parameter]]:
    if kind == "frozen":  # the frozen layer is no trainable parameter; `unused` never gets a gradient
        return [[model.fc1.weight, model.fc1.bias], [model.fc2.weight, model.fc2.bias, model.unused]]
    if kind == "tied_swapped":  # listed as block_groups lists a model: the embedding after the layer
        return [[model.mix.weight], [model.embed.weight]]
    return [[model.embed.weight], [model.mix.weight]]


def _batch(kind: str, step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(1000 + step)
    local = BATCH // world_size
    rows = slice(rank * local, (rank + 1) * local)
    if kind == "frozen":
        return torch.randn(BATCH, 10, generator=g)[rows], torch.randint(0, 4, (BATCH,), generator=g)[rows]
    tokens, targets = torch.randint(0, 12, (BATCH, 5), generator=g), torch.randint(0, 12, (BATCH, 5), generator=g)
    return tokens[rows], targets[rows].flatten()


def _train(kind: str, *, rank: int = 0, world_size: int = 1, seed: int = 17, late_check: bool = False,
           proposal: list[int] | None = None, check: bool = True, issue_thread: bool = False,
           defer_copies: bool = False):
    """STEPS steps of a GroupedOptimizer of FusedAdamW; with world_size > 1, through DDPPeer.
    ``late_check``: the agreement completed after the updates are queued, as with copy engines.
    ``proposal``: the group order this rank claims to have seen, whatever it saw."""
    model = _make(kind, seed)
    opt = GroupedOptimizer(_groups(kind, model), make_optimizer=lambda ps: FusedAdamW(ps, **HYPER))
    ddp = (DDPPeer(model, optimizer=opt, check_gradients=check, issue_thread=issue_thread, defer_copies=defer_copies)
           if world_size > 1 else None)
    if late_check:
        ddp.transport.host_collectives = False
    if proposal is not None:
        ddp._order_proposal = lambda: proposal
    orders = []
    for step in range(STEPS):
        orders.append(ddp.group_order if ddp is not None else None)
        x, y = _batch(kind, step, rank, world_size)
        opt.zero_grad(set_to_none=True)
        if ddp is not None:
            ddp.on_train_batch_start()
        nn.functional.cross_entropy(model(x), y).backward()
        if ddp is not None:
            ddp.finish_gradient_synchronization()
        opt.step()  # with DDPPeer every group was updated in finish: nothing left
    folded = [dict(o._addends) for o in opt.optimizers]
    checks = ddp.check_calls if ddp is not None else None
    thread = getattr(ddp, "issue", None)
    thread = getattr(thread, "_thread", None)
    timed = ddp is not None and (ddp.hook_seconds > 0) != defer_copies and (thread is None or ddp.issue.busy_seconds > 0)
    if ddp is not None:
        ddp.remove_hooks()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, {"checks": checks, "orders": orders, "folded_while_wrapped": [len(f) for f in folded],
                   "folded_after_removal": [len(o._addends) for o in opt.optimizers],
                   "tied": kind != "tied" or model.head.weight is model.embed.weight,
                   "timed": timed, "thread_left_running": thread is not None and thread.is_alive()}


def _peer_worker(ctx, kinds):
    return {kind: _train(kind, rank=ctx.rank, world_size=ctx.world_size, seed=17 + ctx.rank) for kind in kinds}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_peer_matches_single_process(world_size):
    # ranks start from different weights on purpose: the constructor's broadcast must fix them
    results = spawn(_peer_worker, world_size, "gloo", args=(("frozen", "tied"),), timeout_s=60, deadline_s=150)
    for kind in ("frozen", "tied"):
        reference, _ = _train(kind)  # rank 0's initial weights, the full batch, one process
        initial = _make(kind, seed=17).state_dict()
        for rank, states in enumerate(results):
            state, info = states[kind]
            for key in reference:
                # fp32: the average of the ranks' partial-batch gradients differs from the full
                # batch's by summation order (~1e-7 relative); AdamW's steps keep that under 1e-5
                torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6,
                                           msg=f"{world_size} ranks, rank {rank}, {kind}: {key}")
            assert info["tied"]
            # every trainable parameter was folded while wrapped; removal ends the fold
            assert sum(info["folded_while_wrapped"]) == (5 if kind == "frozen" else 2)
            assert info["folded_after_removal"] == [0, 0]
            if kind == "frozen":
                torch.testing.assert_close(state["frozen.weight"], initial["frozen.weight"], atol=0, rtol=0)
                torch.testing.assert_close(state["unused"], initial["unused"], atol=0, rtol=0)


def _options_worker(ctx, options):
    return {kind: _train(kind, rank=ctx.rank, world_size=ctx.world_size, seed=17 + ctx.rank, **options)
            for kind in ("frozen", "tied_swapped")}


ADOPTED = [[1, 0]] + [[0, 1]] * (STEPS - 1)  # the completion order, from the second step
KEPT = [[1, 0]] * STEPS  # the first order: deferred copies see no completion order


@pytest.mark.slow
@pytest.mark.parametrize("options, orders", [
    # the hooks' pushes and closes made on a worker thread, waited for in finish; with the late
    # check the all-gathers of finish pair while the worker may still be closing later groups
    (dict(issue_thread=True), ADOPTED), (dict(issue_thread=True, late_check=True), ADOPTED),
    # every group's gradients sent from finish (the frozen toy's `unused` never gets one, so the
    # gradients present must be found without hooks, with or without the ranks' agreement)
    (dict(defer_copies=True), KEPT), (dict(defer_copies=True, check=False), KEPT)])
def test_the_issue_thread_and_deferred_copies_train_like_one_process(options, orders):
    results = spawn(_options_worker, 2, "gloo", args=(options,), timeout_s=60, deadline_s=120)
    for kind in ("frozen", "tied_swapped"):
        reference, _ = _train(kind)
        for rank, states in enumerate(results):
            state, info = states[kind]
            # hook time with hooks only (none where deferred), the worker's time with a worker
            assert info["timed"] and not info["thread_left_running"], f"rank {rank}, {kind}"
            if kind == "tied_swapped":
                assert info["orders"] == orders
            for key in reference:  # tolerance as in test_peer_matches_single_process
                torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank}, {kind}: {key}")


class _FailingTransport:
    def __init__(self):
        self.calls = []

    def begin_step(self, after=None):
        self.calls.append("begin")

    def push(self, grads, after=None):
        raise RuntimeError("copy refused")

    def close_group(self, group, indices):
        self.calls.append(("close", group))

    def wait_group(self, group):
        self.calls.append(("wait", group))


def test_an_issue_threads_failure_is_raised_where_finish_waits_and_stops_its_work():
    from systems.parallel.peer import IssueThread

    transport = _FailingTransport()
    issue = IssueThread(transport, mark=lambda: "mark", device=torch.device("cpu"), timeout_s=5.0)
    issue.begin_step()
    issue.push([(0, torch.zeros(1))])
    issue.close_group(0, [0])
    with pytest.raises(RuntimeError, match="issue thread failed: RuntimeError\\('copy refused'\\)"):
        issue.wait_group(0)
    assert transport.calls == ["begin"]  # nothing after the failure ran, not even the group's close
    issue.stop()
    assert not issue._thread.is_alive()


def _late_check_worker(ctx):
    return _train("tied", rank=ctx.rank, world_size=ctx.world_size, seed=17 + ctx.rank, late_check=True)


@pytest.mark.slow
def test_the_agreement_may_complete_after_the_updates_are_queued():
    # the copy engines' order (start the check, queue the updates, then wait for it), run on gloo,
    # whose all-gathers then pair with the peer while the check's all-reduce is in flight on its
    # own group: the same training, and one completed check per step
    results = spawn(_late_check_worker, 2, "gloo", timeout_s=60, deadline_s=120)
    reference, _ = _train("tied")
    for rank, (state, info) in enumerate(results):
        assert info["checks"] == STEPS
        for key in reference:  # tolerance as in test_peer_matches_single_process
            torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")


def _order_worker(ctx, late_check, disagree, check):
    # rank 1 claims the groups completed in the static order (1, 0) while rank 0 saw (0, 1)
    proposal = [1, 0] if disagree and ctx.rank == 1 else None
    return _train("tied_swapped", rank=ctx.rank, world_size=ctx.world_size, seed=17 + ctx.rank,
                  late_check=late_check, proposal=proposal, check=check)


@pytest.mark.slow
@pytest.mark.parametrize("late_check, disagree, check", [(False, False, True), (True, False, True),
                                                         (False, True, True), (True, True, True),
                                                         (False, False, False)])
def test_the_groups_are_closed_in_the_order_the_backward_completes_them_once_the_ranks_agree(late_check, disagree,
                                                                                             check):
    # groups [mix], [embed]: the static order (reversed) is embed, mix, but the tied embedding's
    # gradient is complete only after the lookup's backward, the last: the ranks adopt (mix, embed)
    # from the second step, at once on every rank, and keep the static order where they disagree
    # or where no check runs (the order travels with it)
    results = spawn(_order_worker, 2, "gloo", args=(late_check, disagree, check), timeout_s=60, deadline_s=120)
    reference, _ = _train("tied_swapped")
    expected = [[1, 0]] * STEPS if disagree or not check else [[1, 0]] + [[0, 1]] * (STEPS - 1)
    for rank, (state, info) in enumerate(results):
        assert info["orders"] == expected, f"rank {rank}"
        for key in reference:  # tolerance as in test_peer_matches_single_process
            torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")


def _one_rank_uses_a_parameter_worker(ctx):
    torch.manual_seed(0)
    model = SometimesExtra()
    opt = GroupedOptimizer([list(model.parameters())], make_optimizer=lambda ps: FusedAdamW(ps, **HYPER))
    ddp = DDPPeer(model, optimizer=opt)
    g = torch.Generator().manual_seed(ctx.rank)
    for step in range(3):
        model.use_extra = ctx.rank == 0 and step == 2
        opt.zero_grad(set_to_none=True)
        ddp.on_train_batch_start()
        nn.functional.cross_entropy(model(torch.randn(4, 6, generator=g)),
                                    torch.randint(0, 3, (4,), generator=g)).backward()
        ddp.finish_gradient_synchronization()
        opt.step()


@pytest.mark.slow
def test_a_parameter_used_on_one_rank_only_is_named():
    # checked before any rank waits for its peers' gradients of it
    with pytest.raises(DistributedRunError, match=r"parameter 'extra\.weight' got a gradient on rank\(s\) \[0\] "
                                                  r"but not on rank\(s\) \[1\]"):
        spawn(_one_rank_uses_a_parameter_worker, 2, "gloo", timeout_s=30, deadline_s=90)


def _errors_worker(ctx):
    model = FrozenToy()
    messages = []
    for make in (lambda: DDPPeer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
                 lambda: DDPPeer(model, optimizer=GroupedOptimizer([[model.fc1.weight]],
                                                                   make_optimizer=lambda ps: FusedAdamW(ps))),
                 lambda: DDPPeer(model, copy_graphs=True, optimizer=GroupedOptimizer(
                     [[p for p in model.parameters() if p.requires_grad]], make_optimizer=lambda ps: FusedAdamW(ps))),
                 lambda: DDPPeer(model, read_peers=True, defer_copies=True, optimizer=GroupedOptimizer(
                     [[p for p in model.parameters() if p.requires_grad]], make_optimizer=lambda ps: FusedAdamW(ps))),
                 lambda: DDPPeer(model, read_peers=True, optimizer=GroupedOptimizer(
                     [[p for p in model.parameters() if p.requires_grad]], make_optimizer=lambda ps: FusedAdamW(ps)))):
        try:
            make()
        except ValueError as exc:
            messages.append(str(exc))
    dist.barrier()
    return messages


@pytest.mark.slow
def test_peer_refuses_optimizers_it_cannot_fold_into_and_uncovered_parameters():
    messages = spawn(_errors_worker, 2, "gloo", timeout_s=30, deadline_s=90)[0]
    assert len(messages) == 5
    assert "GroupedOptimizer of FusedAdamW" in messages[0]
    assert "in no optimizer group" in messages[1]
    assert "copy_graphs replays CUDA copies" in messages[2]
    assert "read_peers makes no copies: leave copy_streams" in messages[3]
    assert "read_peers maps the other GPU's memory (CUDA IPC): on CPU ranks (gloo) leave it off" in messages[4]


def _state_broadcast_worker(ctx):
    from systems.kernels.fused_adamw import MasterWeightAdamW

    model = _make("frozen", seed=17 + ctx.rank)  # different weights, so different masters, per rank
    weights = {id(model.fc1.weight), id(model.fc2.weight)}
    opt = GroupedOptimizer(_groups("frozen", model), make_optimizer=lambda ps: MasterWeightAdamW(
        ps, low_precision=[p for p in ps if id(p) in weights], split_masters=True))
    DDPPeer(model, optimizer=opt)
    return [opt.master_of(p).clone() for p in (model.fc1.weight, model.fc2.weight, model.fc2.bias)]


@pytest.mark.slow
def test_the_optimizers_masters_are_broadcast_too():
    # a split master's low half lives in the optimizer, built before the wrapper's broadcast of the
    # module: without broadcasting it the replicas' fp32 masters would differ in their low bits
    masters = spawn(_state_broadcast_worker, 2, "gloo", timeout_s=30, deadline_s=90)
    initial = _make("frozen", seed=17)
    for ours, theirs, fp32 in zip(masters[0], masters[1], (initial.fc1.weight, initial.fc2.weight, initial.fc2.bias)):
        torch.testing.assert_close(theirs, ours, atol=0, rtol=0)
        torch.testing.assert_close(ours, fp32.detach(), atol=0, rtol=0)  # rank 0's, exactly (split and joined)


def test_layout_aligns_every_gradient_and_slots_skip_the_receiver():
    params = [torch.zeros(3), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(()), torch.zeros(0)]
    layout = _Layout(params)
    assert layout.offsets == [0, 256, 512, 768]
    assert layout.slot_bytes == 768
    buffer = torch.zeros(2 * layout.slot_bytes, dtype=torch.uint8)
    view = layout.view(buffer, 1, 1, params[1])
    assert view.dtype == torch.bfloat16 and view.shape == (5,)
    view.fill_(1.0)
    assert buffer[768 + 256:768 + 256 + 10].view(torch.bfloat16).eq(1.0).all()
    assert [slot_of(s, 2) for s in (0, 1, 3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="no slot for its own"):
        slot_of(1, 1)


class _FakeGraph:
    def __init__(self, copy, log):
        self.copy, self.log = copy, log
        log.append("capture")

    def replay(self):
        self.log.append("replay")
        self.copy()


def test_copy_graphs_replay_while_the_gradients_stay_put_and_give_up_on_a_group_that_keeps_moving():
    from systems.parallel.peer import CopyGraphs

    log, copies = [], []
    graphs = CopyGraphs(max_captures=2, capture=lambda copy: _FakeGraph(copy, log))

    def copy():
        copies.append(1)

    graphs.run((0, 1), (100, 200), copy)  # first sight: captured, then replayed
    graphs.run((0, 1), (100, 200), copy)  # same addresses: replayed, not captured
    assert log == ["capture", "replay", "replay"] and len(copies) == 2
    graphs.run((2,), (300,), copy)  # another group: its own graph
    assert graphs.captures == {(0, 1): 1, (2,): 1}
    graphs.run((0, 1), (100, 999), copy)  # moved: captured again (the second and last time)
    assert log[-2:] == ["capture", "replay"] and len(copies) == 4
    graphs.run((0, 1), (100, 777), copy)  # moved again: copied one by one from now on
    assert log.count("capture") == 3 and len(copies) == 5
    assert graphs.captures[(0, 1)] == 2 and (0, 1) not in graphs.graphs
    log.clear()
    graphs.run((0, 1), (100, 200), copy)  # even at the first addresses: that group gave up
    assert log == [] and len(copies) == 6


def test_the_peer_wrappers_options_apply_to_it_only():
    from systems.parallel.plan import ParallelPlan

    for option in ("copy_graphs", "issue_thread", "defer_copies", "read_peers"):
        with pytest.raises(ValueError, match=f"{option} applies to data_parallel='peer' only"):
            ParallelPlan(data_parallel="bucketed", bucket_size_mb=10.0, **{option: True})
        assert getattr(ParallelPlan(data_parallel="peer", **{option: True}), option)


# ----------------------------------------------------------------------------- GPU (copy engines)


def _gpu_worker(ctx, copy_streams, copy_graphs=False, issue_thread=False, defer_copies=False, read_peers=False,
                delays=False):
    """The copy-engine path on the debug model: bf16 weights, split fp32 masters, one group a block.
    ``delays``: rank 1's GPU sleeps before its backward and rank 0's before its first update, so that
    a rank reading the other's gradients too early (no barrier after the backwards) or too late (no
    barrier after the updates: the other has begun its next step) would read other values."""
    from systems.config import get_config
    from systems.model import TransformerLM
    from systems.train import OptimizerSpec, build_optimizer

    torch.manual_seed(ctx.rank)
    model = TransformerLM(get_config("debug"), device=ctx.device)
    opt = build_optimizer(model, OptimizerSpec(kind="fused", lr=1e-3, master_weights=True, split_masters=True,
                                               grouped=True))
    ddp = DDPPeer(model, optimizer=opt, copy_streams=copy_streams, copy_graphs=copy_graphs, issue_thread=issue_thread,
                  defer_copies=defer_copies, read_peers=read_peers)
    # ~0.1 s at an H200's 1.98 GHz, far longer than a debug step; rank 0's update waits three times
    # as long, past the point where rank 1, unheld, would have written its next gradients
    sleep_cycles = 200_000_000
    if delays and ctx.rank == 0:
        step_group = opt.step_group
        first = opt.groups[0]

        def slow_step_group(params):
            if params[0] is first[0]:
                torch.cuda._sleep(3 * sleep_cycles)
            step_group(params)

        opt.step_group = slow_step_group
    g = torch.Generator().manual_seed(ctx.rank)
    vocab = model.cfg.vocab_size
    opens = []
    for _ in range(4):
        tokens = torch.randint(0, vocab, (2, 33), generator=g).to(ctx.device)
        opt.zero_grad(set_to_none=True)
        ddp.on_train_batch_start()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if delays and ctx.rank == 1:
            torch.cuda._sleep(sleep_cycles)
        loss.backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        if read_peers:
            opens.append(ddp.transport.peers.opens)
    ddp.remove_hooks()
    torch.cuda.synchronize()
    graphs = getattr(ddp.transport, "copy_graphs", None)
    captures = sum(graphs.captures.values()) if graphs is not None else None
    if read_peers:  # the segments this rank mapped, after each step
        captures = opens
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}, captures, len(ddp._groups)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("copy_streams,copy_graphs,issue_thread,defer_copies", [
    (1, False, False, False), (3, False, False, False), (1, True, False, False), (1, False, True, False),
    (1, True, True, False), (1, True, False, True), (2, False, False, True)])
def test_gpu_copy_engines_keep_the_replicas_equal(copy_streams, copy_graphs, issue_thread, defer_copies):
    # the ranks' own gradients differ (their halves of the batch): the replicas stay equal only if
    # each update read the other rank's gradient, and bit for bit because fp32 addition commutes
    # (rank 0 sums a + b, rank 1 b + a) and everything else is the same arithmetic
    (states0, captures, groups), (states1, _, _) = spawn(_gpu_worker, 2, "nccl",
                                                         args=(copy_streams, copy_graphs, issue_thread,
                                                               defer_copies),
                                                         timeout_s=120, deadline_s=300)
    for name in states0:
        torch.testing.assert_close(states1[name], states0[name], atol=0, rtol=0, msg=name)
    if copy_graphs:  # the gradients came back to their addresses: some of the 4 steps replayed a graph
        assert groups <= captures < 4 * groups


def _read_and_copy_worker(ctx):
    return _gpu_worker(ctx, 1, delays=True), _gpu_worker(ctx, 1, read_peers=True, delays=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_reading_the_peers_gradients_trains_as_the_copies_do():
    # the same arithmetic as the copies (each update reads its own gradient and the other rank's,
    # summed in fp32), only the other rank's is read where it lies: equal bit for bit, on both ranks
    ranks = spawn(_read_and_copy_worker, 2, "nccl", timeout_s=120, deadline_s=300)
    for rank, ((copied, _, _), (read, opens, _)) in enumerate(ranks):
        for name in copied:
            torch.testing.assert_close(read[name], copied[name], atol=0, rtol=0, msg=f"rank {rank}: {name}")
        # the gradients settle where the allocator put them once the optimizer's state exists:
        # no segment mapped after the second step
        assert opens[0] >= 1 and opens[1] == opens[3], (rank, opens)
    for name in ranks[0][1][0]:
        torch.testing.assert_close(ranks[1][1][0][name], ranks[0][1][0][name], atol=0, rtol=0, msg=name)
