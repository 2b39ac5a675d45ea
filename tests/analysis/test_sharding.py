"""Sharding accounting against counting the tensors each scheme keeps on a rank."""

from __future__ import annotations

import pytest
import torch

from systems.analysis import sharding


def _count_tensors(n_params: int, world_size: int, scheme: str) -> dict[str, int]:
    """Bytes of the tensors one rank would really allocate: fp32 weights, gradients, AdamW's
    exp_avg and exp_avg_sq, and the sqrt(exp_avg_sq) torch's foreach AdamW makes during the step."""
    shard = -(-n_params // world_size)  # a rank's share, rounded up as padding would
    weights = shard if scheme == "fsdp" else n_params
    updated = n_params if scheme == "ddp" else shard
    f = lambda n: torch.empty(n, dtype=torch.float32)  # noqa: E731
    return {"params": f(weights).nbytes, "grads": f(weights).nbytes,
            "optimizer_state": f(updated).nbytes + f(updated).nbytes, "optimizer_temporaries": f(updated).nbytes}


@pytest.mark.parametrize("scheme", ["ddp", "ddp_sharded", "zero1", "fsdp"])
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_per_rank_bytes_match_counted_tensors(scheme, world_size):
    n = 1_000_008  # divisible by 8: no padding, so the count and the formula agree exactly
    b = sharding.per_rank_bytes(n, world_size, scheme)
    counted = _count_tensors(n, world_size, scheme)
    assert (b.params, b.grads, b.optimizer_state, b.optimizer_temporaries) == pytest.approx(
        (counted["params"], counted["grads"], counted["optimizer_state"], counted["optimizer_temporaries"]))


def test_phase_bytes_and_expected_saving():
    """Measured on an H200 (xl-2025, 2 ranks, torch AdamW foreach): DDP holds 7,623 MiB of weights,
    15,245 of moments and 7,690 of step temporaries. The accounting's 16 bytes per parameter
    (+4 during the step) is what those allocations add up to."""
    n, acts = 1_998_235_200, 11.5 * 2**30
    ddp = sharding.phase_bytes(sharding.per_rank_bytes(n, 2, "ddp"), activations=acts)
    assert ddp["after_init"] == 4 * n
    assert ddp["before_step"] == 4 * n + 8 * n + acts
    assert ddp["optimizer_step"] == 20 * n and ddp["after_step"] == 16 * n
    vs_sharded = sharding.expected_saving(n, 2, frm="ddp_sharded", to="fsdp", activations=acts)
    # weights alone at the forward's end (no gradient yet); weights and gradients in the step
    assert vs_sharded["before_step"] == pytest.approx(2 * n)
    assert vs_sharded["optimizer_step"] == pytest.approx(4 * n)
    # both peaks are the forward's end here (activations > gradients + temporaries' difference)
    assert vs_sharded["peak"] == pytest.approx(2 * n)
    vs_ddp = sharding.expected_saving(n, 2, frm="ddp", to="fsdp", activations=acts)
    assert vs_ddp["optimizer_step"] == pytest.approx(10 * n)  # 20 bytes per parameter, halved


def test_sizes_table_and_bad_input():
    rows = sharding.sizes_table({"10B": 12_832_823_808}, 2, device_bytes=141e9)
    (r,) = rows
    assert r["ddp_bytes"] == pytest.approx(20 * 12_832_823_808) and not r["ddp_fits"]
    assert r["fsdp_bytes"] == pytest.approx(10 * 12_832_823_808) and r["fsdp_fits"]
    with pytest.raises(ValueError, match="scheme must be one of"):
        sharding.per_rank_bytes(10, 2, "zero3")
    with pytest.raises(ValueError, match="world_size"):
        sharding.per_rank_bytes(10, 0, "ddp")


def test_communication_per_step():
    comm = {r["scheme"].split(" ")[0]: r["bytes_per_rank"] for r in sharding.communication_per_step(1000, 4)}
    assert comm["DDP"] == pytest.approx(2 * 0.75 * 4000)
    assert comm["ShardedOptimizer"] == pytest.approx(comm["DDP"] + 0.75 * 4000)
    assert comm["ZeRO-1"] == pytest.approx(comm["DDP"])
    assert comm["FSDP"] == pytest.approx(3 * 0.75 * 4000)
