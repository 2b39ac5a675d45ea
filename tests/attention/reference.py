"""The direct float64 attention the attention tests compare every backend with, and the forward +
backward comparison they share (not a test module: pytest collects test_*.py only)."""

from __future__ import annotations

import math

import torch


def reference(q, k, v, is_causal):
    """Direct float64 attention: O and the natural-log logsumexp L of the scaled scores."""
    q, k, v = (t.double() for t in (q, k, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:  # query i sees keys j <= i + (n_k - n_q), as naive_attention
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def run_and_compare(apply, shape_q, n_k, dtype, is_causal, device, tol):
    """Forward + backward through `apply`; returns max abs errors of O, L, dQ, dK, dV against
    float64 autograd of `reference`, each divided by max(1, max |reference|)."""
    gen = torch.Generator(device=device).manual_seed(sum(shape_q) + n_k)
    shape_k = (*shape_q[:-2], n_k, shape_q[-1])
    q = torch.randn(shape_q, generator=gen, device=device).to(dtype).requires_grad_()
    k = torch.randn(shape_k, generator=gen, device=device).to(dtype).requires_grad_()
    v = torch.randn(shape_k, generator=gen, device=device).to(dtype).requires_grad_()
    do = torch.randn(shape_q, generator=gen, device=device).to(dtype)
    out = apply(q, k, v, is_causal)
    saved = out.grad_fn.saved_tensors
    # exactly one saved tensor has the logsumexp's shape (batch..., n_queries)
    lse = [t for t in saved if t.shape == shape_q[:-1]]
    assert len(saved) == 5 and len(lse) == 1, [tuple(t.shape) for t in saved]
    out.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_o, ref_l = reference(q64, k64, v64, is_causal)
    ref_grads = torch.autograd.grad(ref_o, (q64, k64, v64), do.double())
    errors = {}
    for name, got, want in [("O", out, ref_o), ("L", lse[0], ref_l), ("dQ", q.grad, ref_grads[0]),
                            ("dK", k.grad, ref_grads[1]), ("dV", v.grad, ref_grads[2])]:
        assert got.shape == want.shape and got.dtype in (dtype, torch.float32), (name, got.shape, got.dtype)
        assert torch.isfinite(got).all(), name
        errors[name] = ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()
    bad = {n: e for n, e in errors.items() if e > tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errors})"
    return errors
