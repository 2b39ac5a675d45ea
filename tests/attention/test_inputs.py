"""The one input check of every attention backend (systems/attention/inputs.py): each rule gives a
one-line error that names what is allowed, and valid inputs pass."""

from __future__ import annotations

import pytest
import torch

from systems.attention.inputs import FLOAT_DTYPES, check_inputs


def _qkv(n_q=10, n_k=10, d=16, dtype=torch.float32):
    return torch.zeros(2, n_q, d, dtype=dtype), torch.zeros(2, n_k, d, dtype=dtype), torch.zeros(2, n_k, d, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_valid_inputs_pass(dtype):
    check_inputs(*_qkv(dtype=dtype), True)
    check_inputs(*_qkv(n_q=4, n_k=9, dtype=dtype), True)  # fewer queries than keys: the last 4 positions
    check_inputs(*_qkv(n_q=9, n_k=4, dtype=dtype), False)  # more queries: fine without a mask


@pytest.mark.parametrize("change,error,match", [
    (dict(q="not a tensor"), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(16)), ValueError, r"shaped \(\.\.\., seq, d\)"),
    (dict(q=torch.zeros(2, 10, 16, dtype=torch.int64)), ValueError, "allowed dtypes are float32"),
    (dict(v=torch.zeros(2, 10, 16, dtype=torch.float64)), ValueError, "share one dtype"),
    (dict(v=torch.zeros(2, 11, 16)), ValueError, "same shape"),
    (dict(q=torch.zeros(3, 10, 16)), ValueError, "leading"),
    (dict(q=torch.zeros(2, 10, 8)), ValueError, "share the head dim"),
    (dict(q=torch.zeros(2, 10, 0), k=torch.zeros(2, 10, 0), v=torch.zeros(2, 10, 0)), ValueError,
     "head dim must be at least 1"),
    (dict(q=torch.zeros(2, 0, 16)), ValueError, "empty sequence"),
    (dict(q=torch.zeros(2, 12, 16), causal=True), ValueError, "more queries"),
])
def test_each_rule_is_a_one_line_error(change, error, match):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, causal=False)
    args.update(change)
    with pytest.raises(error, match=match) as info:
        check_inputs(args["q"], args["k"], args["v"], args["causal"])
    assert "\n" not in str(info.value)


def test_dtypes_narrow_what_is_allowed():
    with pytest.raises(ValueError, match="allowed dtypes are float16, bfloat16"):
        check_inputs(*_qkv(dtype=torch.float64), False, dtypes=(torch.float16, torch.bfloat16))
