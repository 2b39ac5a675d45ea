"""The reference paths (systems/attention/naive.py): naive attention is the handout's formula;
both it and SDPA check their inputs as the flash backends do, and SDPA masks causally with the
bottom-right convention when the query and key lengths differ."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from systems.attention.naive import naive_attention, sdpa_attention
from tests.attention.reference import reference


def test_naive_attention_matches_formula():
    q, k, v = (torch.randn(4, 7, 8, dtype=torch.float64) for _ in range(3))
    out = naive_attention(q, k, v, is_causal=False)
    torch.testing.assert_close(out, torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v)


@pytest.mark.parametrize("fn", [naive_attention, sdpa_attention], ids=["naive", "sdpa"])
@pytest.mark.parametrize("n_q,n_k", [(5, 9), (9, 9), (1, 6)])
def test_causal_is_bottom_right_aligned(fn, n_q, n_k):
    # float64 on both sides: only summation order differs
    gen = torch.Generator().manual_seed(n_q * 100 + n_k)
    q = torch.randn(2, 3, n_q, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 3, n_k, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(fn(q, k, v, True), reference(q, k, v, True)[0], atol=1e-12, rtol=1e-12)


def test_sdpa_keeps_its_is_causal_fast_path_at_equal_lengths(monkeypatch):
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    x = torch.zeros(1, 6, 8)
    sdpa_attention(x, x, x, True)
    sdpa_attention(x[:, :2], x, x, False)
    assert calls == [dict(is_causal=True), dict(is_causal=False)]


@pytest.mark.parametrize("fn", [naive_attention, sdpa_attention], ids=["naive", "sdpa"])
@pytest.mark.parametrize("q,k,match", [
    (torch.zeros(2, 10, 16), torch.zeros(2, 10, 8), "share the head dim"),  # was a matmul's shape error
    (torch.zeros(2, 10, 16, dtype=torch.int64), torch.zeros(2, 10, 16, dtype=torch.int64), "allowed dtypes"),
    (torch.zeros(2, 10, 0), torch.zeros(2, 10, 0), "head dim must be at least 1"),
])
def test_bad_inputs_are_value_errors(fn, q, k, match):
    with pytest.raises(ValueError, match=match):
        fn(q, k, k, False)


@pytest.mark.parametrize("fn", [naive_attention, sdpa_attention], ids=["naive", "sdpa"])
def test_causal_with_more_queries_than_keys_is_refused(fn):
    # naive attention returned NaN rows here (a softmax over no visible key); the flash backends refuse
    q, k = torch.zeros(1, 12, 16), torch.zeros(1, 10, 16)
    with pytest.raises(ValueError, match="more queries"):
        fn(q, k, k, True)
