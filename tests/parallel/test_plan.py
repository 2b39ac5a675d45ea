"""ParallelPlan's checks: a plan that cannot work fails when it is made, with a message saying what to set."""

from __future__ import annotations

import pytest
import torch.nn as nn

from systems.parallel.plan import ParallelPlan, apply


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel="bucketed"), "needs a positive bucket_size_mb"),
    (dict(data_parallel="overlap", bucket_size_mb=10), "applies to data_parallel='bucketed' only"),
    (dict(data_parallel="overlap", update_per_bucket=True), "applies to data_parallel='bucketed' only"),
    (dict(data_parallel="bucketed", bucket_size_mb=10, update_per_bucket=True), "leave bucket_size_mb"),
    (dict(data_parallel="bucketed", reduce_dtype="int8", bucket_size_mb=1), "reduce_dtype must be one of"),
    (dict(checkpoint_save="attention"), "set checkpoint_group too"),
    (dict(compile_mode="reduce-overhead"), "needs compile='blocks' or 'model'"),
    (dict(data_parallel="bucketed", bucket_size_mb=1, copy_streams=2), "applies to data_parallel='peer' only"),
    (dict(data_parallel="peer", copy_streams=0), "positive integer"),
])
def test_bad_plans_are_refused_with_what_to_set(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelPlan(**kwargs)


@pytest.mark.parametrize("plan", [ParallelPlan(data_parallel="torch_ddp"), ParallelPlan(data_parallel="fsdp"),
                                  ParallelPlan(compile="model")])
def test_the_fused_loss_is_refused_where_the_forward_does_work(plan):
    # the fused loss calls model.hidden_states, skipping the wrapper's (or compiled model's)
    # forward: refused before anything is applied or any process group is needed
    with pytest.raises(ValueError, match="use loss='logits'"):
        apply(nn.Linear(2, 2), plan, loss="fused")
    plan.check_loss("logits")  # the logits loss goes through the forward: fine
    ParallelPlan(data_parallel="bucketed", bucket_size_mb=1).check_loss("fused")  # hooks do the work: fine


def test_update_per_bucket_needs_the_grouped_optimizer_before_anything_is_applied():
    plan = ParallelPlan(data_parallel="bucketed", update_per_bucket=True)
    assert plan.bucket_size_mb is None
    # refused before the process-group check: the message names the missing optimizer
    with pytest.raises(ValueError, match="OptimizerSpec\\(grouped=True"):
        apply(nn.Linear(2, 2), plan)


def test_peer_needs_a_grouped_fused_optimizer_before_anything_is_applied():
    import torch

    from systems.train import GroupedOptimizer

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="kind='fused'"):
        apply(model, ParallelPlan(data_parallel="peer"))
    # grouped, but of an optimizer that cannot fold: refused too, naming the ones that can
    sgd = GroupedOptimizer([list(model.parameters())], make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="FusedAdamW or MasterWeightAdamW"):
        sgd.fold_gradients({model.weight: torch.zeros(2, 2)}, 0.5)
