"""Memory of one attention call, in closed form: naive attention (``systems.attention.naive``) as
the pytorch_attention harness runs it, and FlashAttention-2's tiling for comparison.

Naive attention on (batch, seq, d) inputs, with ``mat`` = batch x seq x seq and ``vec`` =
batch x seq x d elements, in the order the code allocates:

- forward: ``q @ k^T`` (mat), divided by sqrt(d) into a new mat (the product is then freed),
  softmax's output P (mat, while the scaled scores are still referenced), ``P @ V`` = O (vec).
  Autograd keeps P (softmax saves its output; ``P @ V`` saves P and V) and the inputs.
- backward: dP = dO V^T (mat) and dV = P^T dO (vec) from ``P @ V``'s node; then softmax's
  backward. On CUDA its kernel first writes ``grad * output`` into a temporary of the same size
  (aten/src/ATen/native/cuda/SoftMax.cu, ``softmax_backward_cuda_out``) and then dS, so P, dP,
  that temporary and dS are alive together: four score-sized tensors. The CPU kernel needs no
  temporary: three. Then dS / sqrt(d) and the products' gradients, all smaller peaks.

The harness allocates q, k, v and the output gradient dO before the forward, and O stays alive
through the backward, so the vec-sized tensors at the backward's peak are q, k, v, dO, O and dV.
"""

from __future__ import annotations

import math

import pandas as pd

from systems.config import check_choice
from systems.measure.devices import dtype_of
from systems.measure.flops import attention_flops

DEVICES = ("cuda", "cpu")


def _element_size(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=dtype_of(dtype)).element_size()


# The score-sized tensors naive attention's backward holds at once, per device's kernels, as the
# answers name them: CUDA's softmax backward allocates a temporary the CPU kernel does not need (the
# module's docstring says where). Their count, and whether the accounting lists the temporary, come
# from these names.
SOFTMAX_BACKWARD_TEMPORARY = "the dP·P temporary that CUDA softmax backward allocates"
BACKWARD_SCORE_TENSORS = {"cuda": ("P", "dP", SOFTMAX_BACKWARD_TEMPORARY, "dS"), "cpu": ("P", "dP", "dS")}


def backward_score_tensor_names(device: str) -> tuple[str, ...]:
    """The score-sized tensors alive together at the backward's peak on ``device``'s kernels."""
    check_choice("device", device, DEVICES)
    return BACKWARD_SCORE_TENSORS[device]


def attention_memory_accounting(*, batch: int, seq: int, d: int, dtype: str = "fp32", device: str = "cuda",
                                free_bytes: int | None = None) -> pd.DataFrame:
    """What naive attention allocates for (batch, seq, d) in the harness, term by term.

    ``attrs`` carries the totals: ``forward_peak_bytes``, ``saved_bytes`` (P),
    ``before_backward_bytes`` (what is allocated when the backward starts), ``backward_peak_bytes``,
    ``peak_bytes``, the counts behind them, the names of the score-sized tensors at the backward's
    peak (``backward_score_tensor_names``), and, given ``free_bytes``, whether each phase fits.
    """
    e = _element_size(dtype)
    vec = batch * seq * d * e
    mat = batch * seq * seq * e
    back_names = backward_score_tensor_names(device)
    n_back = len(back_names)
    terms = [
        ("inputs q, k, v and output gradient dO", 4 * vec, "made before the forward; q, k, v saved by the matmuls"),
        ("scores Q K^T", mat, "forward: freed once the scaled copy exists"),
        ("scaled scores / sqrt(d)", mat, "forward: alive until the call returns"),
        ("softmax output P", mat, "saved for backward (softmax and P @ V)"),
        ("output O = P V", vec, "alive through the backward"),
        ("dP = dO V^T", mat, "backward: input of softmax's backward"),
        ("dV = P^T dO", vec, "backward: becomes v.grad"),
    ]
    if SOFTMAX_BACKWARD_TEMPORARY in back_names:
        terms.append(("dP * P (CUDA softmax backward's temporary)", mat, "backward: inside the softmax kernel"))
    terms += [("dS (softmax backward)", mat, "backward: then scaled by 1/sqrt(d)"),
              ("dQ, dK", 2 * vec, "backward: after the score-sized peak")]
    df = pd.DataFrame(terms, columns=["tensor", "bytes", "when"])
    df["GiB"] = df["bytes"] / 2**30
    forward_peak = 5 * vec + 2 * mat  # inputs, dO, O and two score-sized tensors
    before_backward = 5 * vec + mat  # inputs, dO, O and P
    backward_peak = 6 * vec + n_back * mat  # ... and dV, with P, dP, (temporary,) dS
    df.attrs.update(batch=batch, seq=seq, d=d, dtype=dtype, device=device, element_bytes=e, score_matrix_bytes=mat,
                    vector_bytes=vec, saved_bytes=mat, forward_peak_bytes=forward_peak,
                    before_backward_bytes=before_backward, backward_peak_bytes=backward_peak,
                    peak_bytes=max(forward_peak, backward_peak), backward_score_tensors=n_back,
                    backward_score_tensor_names=back_names, backward_vectors=6, free_bytes=free_bytes)
    if free_bytes is not None:
        df.attrs["forward_fits"] = forward_peak <= free_bytes
        df.attrs["backward_fits"] = backward_peak <= free_bytes
    return df


def flash_attention_accounting(*, batch: int, seq: int, d: int, dtype: str = "fp32",
                               block_q: int = 128, block_k: int = 128) -> dict:
    """FlashAttention's alternative: tile Q and K/V into blocks, keep a running max and sum per
    query row, never store P. It saves O and the row logsumexp L (batch x seq) and recomputes each
    P tile in the backward pass from Q, K and L, at the cost of one extra Q K^T matmul."""
    e = _element_size(dtype)
    naive_saved = batch * seq * seq * e
    flash_saved = batch * seq * d * e + batch * seq * 4  # O, and L kept in fp32
    one_matmul = attention_flops(batch=batch, heads=1, n_q=seq, n_k=seq, d=d, causal=False) // 2  # Q K^T of the two
    backward = attention_flops(batch=batch, heads=1, n_q=seq, n_k=seq, d=d, causal=False, pass_="bwd")
    return {"naive_saved_bytes": naive_saved, "flash_saved_bytes": flash_saved,
            "saving_factor": naive_saved / flash_saved, "score_tile_bytes": block_q * block_k * 4,
            "n_tiles": math.ceil(seq / block_q) * math.ceil(seq / block_k) * batch,
            "block_q": block_q, "block_k": block_k, "recompute_flops": one_matmul,
            "recompute_fraction_of_backward": one_matmul / backward}


def peak_decomposition(row: dict, *, device: str) -> pd.DataFrame:
    """A measured point's peak, term by term: what was allocated before it, the score-sized and the
    (batch, seq, d) tensors the accounting puts at the backward's peak, and what is left over."""
    acct = attention_memory_accounting(batch=row["batch_size"], seq=row["seq"], d=row["d"], dtype=row["dtype"],
                                       device=device)
    a = acct.attrs
    n_mat, n_vec = a["backward_score_tensors"], a["backward_vectors"]
    parts = [("allocated before the point (cuBLAS workspaces, earlier points' leftovers)", 1, row["start_bytes"]),
             (f"score-sized tensors at the backward's peak ({', '.join(a['backward_score_tensor_names'])})", n_mat,
              n_mat * a["score_matrix_bytes"]),
             ("(batch, seq, d) tensors: q, k, v, dO, O, dV", n_vec, n_vec * a["vector_bytes"])]
    explained = sum(b for _, _, b in parts)
    parts.append(("measured peak − the above (allocator rounding, kernels' scratch)", None, row["peak_bytes"] - explained))
    df = pd.DataFrame(parts, columns=["term", "count", "bytes"])
    df["share of peak"] = df["bytes"] / row["peak_bytes"]
    return df
