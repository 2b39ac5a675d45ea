"""Launch helpers: results come back, a failing or stuck rank ends the run with its error, ports."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from systems.parallel import launch
from systems.parallel.launch import DistributedRunError, find_free_port, spawn


def _sum_ranks(ctx, offset):
    t = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(t)
    gathered = launch.all_gather_objects(ctx.rank)
    env = {k: os.environ.get(k) for k in launch.ENV_DEFAULTS}
    return {"rank": ctx.rank, "world_size": ctx.world_size, "sum": t.item(), "gathered": gathered,
            "device": str(ctx.device), "backend": ctx.backend, "env": env}


def _rank1_raises(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here forever without the failure handling
    return "unreachable"


def _rank1_hangs(ctx):
    if ctx.rank == 1:
        time.sleep(600)  # alive but never joins the collective
    dist.all_reduce(torch.ones(4))


@pytest.mark.slow
def test_spawn_returns_every_rank_result():
    results = spawn(_sum_ranks, 2, "gloo", args=(10,), timeout_s=60, deadline_s=120)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["sum"] == 10 + 11
        assert r["gathered"] == [0, 1]
        assert (r["world_size"], r["device"], r["backend"]) == (2, "cpu", "gloo")
        # children start with NVLink multicast off unless the caller chose otherwise
        assert r["env"] == {k: os.environ.get(k, v) for k, v in launch.ENV_DEFAULTS.items()}


@pytest.mark.slow
def test_failing_rank_ends_the_run_with_its_error():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="boom from rank 1") as info:
        spawn(_rank1_raises, 2, "gloo", timeout_s=120, deadline_s=90)
    # the failure is noticed when the process exits, not after the 120 s collective timeout
    assert time.monotonic() - start < 45
    assert info.value.rank == 1
    assert "ValueError" in str(info.value) and "_rank1_raises" in info.value.details


@pytest.mark.slow
def test_collective_timeout_ends_a_stuck_run():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank 0 of 2 failed") as info:
        # the timeout also bounds the rendezvous, so it leaves room for a loaded machine's slow
        # process start-up; the collective then fails after it, long before the deadline
        spawn(_rank1_hangs, 2, "gloo", timeout_s=10, deadline_s=90)
    assert time.monotonic() - start < 60
    assert info.value.rank == 0
    assert "_rank1_hangs" in info.value.details


def _rank1_dies(ctx, how):
    dist.barrier()
    if ctx.rank == 1:
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or kill -9 would
        os._exit(3)  # leaves without a Python exception
    dist.all_reduce(torch.ones(4))  # rank 0 loses its peer here: "Connection reset by peer"
    return "unreachable"


@pytest.mark.slow
@pytest.mark.parametrize("how, says", [("SIGKILL", "was killed by signal SIGKILL"), ("exit", "exited with code 3")])
def test_a_rank_that_dies_outside_python_is_named_not_its_survivor(how, says):
    with pytest.raises(DistributedRunError) as info:
        spawn(_rank1_dies, 2, "gloo", args=(how,), timeout_s=30, deadline_s=90)
    message = str(info.value)
    assert message.startswith(f"rank 1 of 2 {says} without raising a Python error"), message
    assert info.value.rank == 1
    # the survivor's error (its collective lost the peer) follows as a consequence
    assert "(then: rank 0" in message


def _both_sleep(ctx):
    time.sleep(600)


@pytest.mark.slow
def test_deadline_terminates_every_rank():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="deadline_s=12"):
        spawn(_both_sleep, 2, "gloo", timeout_s=60, deadline_s=12)
    assert time.monotonic() - start < 40


def test_find_free_port_is_bindable():
    port = find_free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # free right after it was picked


def test_spawn_rejects_functions_children_cannot_import():
    def local_fn(ctx):
        return ctx.rank

    with pytest.raises(ValueError, match="import by name"):
        spawn(local_fn, 2, "gloo")
    with pytest.raises(ValueError, match="import by name"):
        spawn(lambda ctx: None, 2, "gloo")


def test_spawn_validates_inputs():
    with pytest.raises(ValueError, match="backend must be one of"):
        spawn(_sum_ranks, 2, "mpi")
    with pytest.raises(ValueError, match="world_size"):
        spawn(_sum_ranks, 0, "gloo")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA GPUs"):
            spawn(_sum_ranks, 2, "nccl")


def test_run_from_env_needs_torchrun_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not launch.under_torchrun()
    with pytest.raises(RuntimeError, match="torchrun"):
        launch.run_from_env(_sum_ranks)
