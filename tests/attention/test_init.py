"""The backend switch (systems/attention/__init__.py): every backend is registered, the model
attends through the configured one, and every backend gives one result and one error for one
input, whatever the query and key lengths."""

from __future__ import annotations

import pytest
import torch

from systems.attention import BACKENDS, attention, get_backend

# the Triton backend needs a GPU or the interpreter: tests/attention/test_flash_triton.py
CPU_BACKENDS = [name for name in BACKENDS if name != "flash_triton"]


def test_backends_registered_and_model_uses_flash_pytorch():
    from systems.config import get_config
    from systems.model import TransformerLM

    assert {"naive", "sdpa", "flash_pytorch", "flash_triton"} <= set(BACKENDS)
    torch.manual_seed(0)
    model = TransformerLM(get_config("debug", attn_impl="naive"))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40))
    want = model(tokens)
    for layer in model.layers:
        layer.attn.attn_impl = "flash_pytorch"
    got = model(tokens)
    got.sum().backward()  # the flash backward runs through the model's (b, h, seq, d) layout
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert get_backend("flash_pytorch") is BACKENDS["flash_pytorch"]


def test_attention_backends_agree():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 16) for _ in range(3))
    ref = get_backend("naive")(q, k, v, is_causal=True)
    for name in CPU_BACKENDS:
        torch.testing.assert_close(get_backend(name)(q, k, v, is_causal=True), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_q,n_k", [(7, 20), (20, 20), (1, 33)])
@pytest.mark.parametrize("causal", [True, False])
def test_one_result_whatever_the_lengths(n_q, n_k, causal):
    # with n_q != n_k SDPA's own is_causal masks top-left; the switch's SDPA masks bottom-right as
    # the others do. float64: the backends differ by summation order only
    gen = torch.Generator().manual_seed(n_q + n_k)
    q = torch.randn(2, 3, n_q, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 3, n_k, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    outs = {name: attention(q, k, v, causal, impl=name) for name in CPU_BACKENDS}
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["naive"], atol=1e-12, rtol=1e-12, msg=name)


@pytest.mark.parametrize("impl", CPU_BACKENDS)
@pytest.mark.parametrize("q,k,causal,match", [
    (torch.zeros(1, 10, 16), torch.zeros(1, 10, 8), False, "share the head dim"),
    (torch.zeros(1, 10, 16, dtype=torch.int32), torch.zeros(1, 10, 16, dtype=torch.int32), False, "allowed dtypes"),
    (torch.zeros(1, 12, 16), torch.zeros(1, 10, 16), True, "more queries"),
    (torch.zeros(1, 10, 0), torch.zeros(1, 10, 0), False, "head dim must be at least 1"),
])
def test_one_error_whatever_the_backend(impl, q, k, causal, match):
    with pytest.raises(ValueError, match=match):
        attention(q, k, k, causal, impl=impl)
