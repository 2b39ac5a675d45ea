"""Our AdamW and cross-entropy against torch's."""

import pytest
import torch
import torch.nn.functional as F

from systems.optim import AdamW, cross_entropy


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch(weight_decay, foreach):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(ours.state_dict())
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt_ours, opt_ref = AdamW(ours.parameters(), foreach=foreach, **kw), torch.optim.AdamW(ref.parameters(), **kw)
    for _ in range(20):
        x, y = torch.randn(32, 8), torch.randn(32, 4)
        for model, opt in ((ours, opt_ours), (ref, opt_ref)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    # same update order as torch's; differences are fp32 rounding of the algebra only
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_adamw_foreach_equals_loop_with_frozen_and_late_params():
    """The multi-tensor path is the loop's arithmetic batched: bitwise equal on CPU, also when a
    group gains parameters later (different step counts) and some parameters get no gradient."""
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 3, 4)]
    base = [torch.randn(s) for s in shapes]
    runs = {}
    for foreach in (False, True):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        opt = AdamW(params[:2], lr=1e-2, weight_decay=0.1, foreach=foreach)
        gen = torch.Generator().manual_seed(1)
        for step in range(6):
            if step == 3:
                opt.add_param_group({"params": [params[2]]})
            for i, p in enumerate(params):
                p.grad = None if i == 1 and step % 2 else torch.randn(p.shape, generator=gen)
            opt.step()
        runs[foreach] = params
    for a, b in zip(runs[False], runs[True]):
        assert torch.equal(a, b)


def test_adamw_rejects_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError):
        AdamW(p, lr=-1)
    with pytest.raises(ValueError):
        AdamW(p, betas=(1.0, 0.9))


def test_cross_entropy_matches_torch():
    logits, targets = torch.randn(3, 5, 11) * 4, torch.randint(0, 11, (3, 5))
    torch.testing.assert_close(cross_entropy(logits, targets), F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    # large logits: log-sum-exp must not overflow
    big = torch.tensor([[1000.0, 0.0]])
    torch.testing.assert_close(cross_entropy(big, torch.tensor([1])), torch.tensor(1000.0))
