"""The one FLOP convention, against counts taken from the model's own layers and a brute-force
count of the (query, key) pairs a causal mask keeps."""

import pytest
import torch

from systems.config import get_config
from systems.measure import flops
from systems.model import Linear, TransformerLM


@pytest.mark.parametrize("n_q, n_k", [(1, 1), (5, 5), (3, 8), (16, 64)])
def test_causal_pairs_match_the_mask(n_q, n_k):
    # the bottom-right-aligned mask: query i sees keys j <= i + (n_k - n_q)
    mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
    assert flops.attention_pairs(n_q, n_k, causal=True) == int(mask.sum())
    assert flops.attention_pairs(n_q, n_k, causal=False) == n_q * n_k


def test_causal_with_more_queries_than_keys_is_refused():
    with pytest.raises(ValueError, match="more queries"):
        flops.attention_pairs(8, 4, causal=True)


def test_model_flops_count_every_matmul_and_causal_attention_once():
    """Forward FLOPs equal a count over the model's Linear layers plus Q K^T and P V over the
    T (T + 1) / 2 pairs causal attention keeps; the backward is twice the forward."""
    cfg = get_config("debug")
    b, t = 2, 32
    with torch.device("meta"):
        model = TransformerLM(cfg)
    linear = sum(2 * b * t * m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    attention = cfg.n_layers * 2 * (2 * b * cfg.n_heads * (t * (t + 1) // 2) * cfg.d_head)
    assert flops.model_flops(cfg, batch=b, seq=t) == linear + attention
    assert flops.train_step_flops(cfg, batch=b, seq=t) == 3 * (linear + attention)
    assert flops.model_flops(cfg, batch=b, seq=t, pass_="bwd") == 2 * (linear + attention)


def test_attention_flops_executed_counts_the_full_matrix():
    shape = dict(batch=2, heads=3, n_q=64, n_k=64, d=16)
    full = 2 * 2 * 2 * 3 * 64 * 64 * 16
    assert flops.attention_flops(**shape, causal=False) == full
    assert flops.attention_flops(**shape, causal=True, executed=True) == full
    assert flops.attention_flops(**shape, causal=True) == full * (64 * 65 // 2) // (64 * 64)
    assert flops.attention_flops(**shape, causal=False, pass_="fwd_bwd") == 3 * full
    with pytest.raises(ValueError, match="pass must be"):
        flops.attention_flops(**shape, causal=False, pass_="both")
