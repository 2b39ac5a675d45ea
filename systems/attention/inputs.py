"""The one input check every attention backend runs: ``check_inputs(q, k, v, is_causal)``.

Every backend of ``systems.attention.attention`` takes q shaped (..., n_queries, d) and k, v shaped
(..., n_keys, d) with the same leading dims, one floating dtype and one device, and returns
(..., n_queries, d). Bad input gets a one-line ValueError (TypeError for a non-tensor) that says
what is allowed, before any backend-specific error (a matmul's, a kernel launch's) could.

Causal convention (all backends): queries are the *last* n_queries positions of the key
sequence, so query i sees keys j <= i + (n_keys - n_queries) (the mask is aligned to the
bottom-right corner of the score matrix). With more queries than keys the first queries would
see no key at all (a softmax over nothing: NaN); that is refused.

The checks read shapes, dtypes and devices only (no tensor values), so they cost no device work
and no synchronisation on the hot path.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, *,
                 dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    """Raise a one-line error unless q, k, v are attention inputs ``dtypes`` allows (see the module)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be shaped (..., seq, d), got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} has dtype {t.dtype}; allowed dtypes are {_names(dtypes)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q and k must share leading (batch) dims, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-1] == 0:
        raise ValueError(f"the head dim must be at least 1, got shape {tuple(q.shape)}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"empty sequence: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if is_causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(
            f"causal attention with more queries ({q.shape[-2]}) than keys ({k.shape[-2]}) leaves the "
            "first queries with no visible key (queries are aligned to the end of the keys)")
