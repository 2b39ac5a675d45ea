"""AdamW (decoupled weight decay, bias correction) and the cross-entropy loss."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch


def advance_state(state: dict, p: torch.Tensor) -> dict:
    """AdamW's per-parameter state (zero moments on first use), its step count advanced by one.
    The layout torch.optim.AdamW uses, shared by every AdamW here so their state dicts load
    into each other."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    return state


def closure_loss(closure: Callable | None):
    """The loss of an optimizer step's optional closure, evaluated with gradients on (the
    torch.optim contract: step() itself runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class AdamW(torch.optim.Optimizer):
    """Loshchilov & Hutter's AdamW, written to match torch.optim.AdamW's update order."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, foreach: bool | None = None):
        """``foreach``: update all of a group's tensors with multi-tensor (``torch._foreach_*``) ops,
        a handful of kernel launches per group instead of about ten per parameter. None picks it
        for CUDA parameters, where a large model's per-parameter launches make the step CPU-bound."""
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                advance_state(self.state[p], p)
            foreach = group["foreach"]
            if foreach is None:
                foreach = all(p.is_cuda for p in params)
            if foreach:
                self._update_foreach(group, params)
            else:
                for p in params:
                    self._update_one(group, p)
        return loss

    def _update_one(self, group: dict, p: torch.Tensor) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state = self.state[p]
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        p.mul_(1 - lr * wd)  # decoupled decay acts on the pre-update weights
        m.lerp_(p.grad, 1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        step_size = lr / (1 - beta1**t)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)

    def _update_foreach(self, group: dict, params: list[torch.Tensor]) -> None:
        """The same arithmetic in the same order as _update_one, batched over tensors that share
        a step count (parameters added at different times are updated in separate batches)."""
        by_step: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_step.setdefault(self.state[p]["step"], []).append(p)
        for t, ps in by_step.items():
            adamw_foreach_(ps, [p.grad for p in ps], [self.state[p]["exp_avg"] for p in ps],
                           [self.state[p]["exp_avg_sq"] for p in ps], group=group, step=t)


def adamw_foreach_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], *, group: dict, step: int) -> None:
    """AdamW._update_one's arithmetic, in its order, as multi-tensor ops over tensors at one step count."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, math.sqrt(1 - beta2**step))
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-lr / (1 - beta1**step))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over all positions; logits (..., vocab), targets (...)."""
    logits = logits.float()  # log-sum-exp in fp32: bf16 logits lose the small terms
    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_z - target_logit).mean()
