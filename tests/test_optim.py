"""Our AdamW and cross-entropy against torch's."""

import pytest
import torch
import torch.nn.functional as F

from systems.optim import AdamW, cross_entropy


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch(weight_decay):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(ours.state_dict())
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt_ours, opt_ref = AdamW(ours.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
    for _ in range(20):
        x, y = torch.randn(32, 8), torch.randn(32, 4)
        for model, opt in ((ours, opt_ours), (ref, opt_ref)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    # same update order as torch's; differences are fp32 rounding of the algebra only
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


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
