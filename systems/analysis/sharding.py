"""Optimizer-state sharding and FSDP accounting: bytes per rank and per step, from the parameter count.

The handout's accounting questions (optimizer_state_sharding_accounting, fsdp_accounting), next to
which notebook 08 sets the allocator's measurements. One optimizer throughout, torch's AdamW in
its default (foreach) form, as the benchmark runs it: fp32 weights, gradients and two moments, and
one fp32 temporary for every parameter a rank updates (foreach AdamW materialises sqrt(v) for the
whole list before dividing), which exists only during the optimizer step.

Schemes, per rank of N:

- ``ddp``: everything replicated;
- ``ddp_sharded``: DDP with our ShardedOptimizer: the moments and the update (so the temporary)
  of 1/N of the parameters;
- ``zero1``: ZeRO stage 1 as the paper has it: the same memory as ``ddp_sharded`` while the full
  gradients live (it reduce-scatters them, then may free all but its shard);
- ``fsdp``: weights, gradients, moments and update all 1/N (gathered layers in flight not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.config import check_choice

FP32 = 4
ADAM_STATES = 2  # AdamW's first and second moments
FOREACH_TEMPORARIES = 1  # fp32 tensors per updated parameter during torch AdamW's foreach step
SCHEMES = ("ddp", "ddp_sharded", "zero1", "fsdp")


@dataclass(frozen=True)
class RankBytes:
    """Persistent and step-time bytes one rank holds (activations not included)."""

    params: float
    grads: float
    optimizer_state: float
    optimizer_temporaries: float

    @property
    def persistent(self) -> float:
        return self.params + self.grads + self.optimizer_state

    @property
    def step_peak(self) -> float:
        """Everything at once, as inside the optimizer step: the persistent parts and the update's temporaries."""
        return self.persistent + self.optimizer_temporaries


def per_rank_bytes(n_params: float, world_size: int, scheme: str, *, bytes_per_value: int = FP32) -> RankBytes:
    """What one rank holds of each part under ``scheme`` (see the module docstring)."""
    check_choice("scheme", scheme, SCHEMES)
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    p = n_params * bytes_per_value
    share = 1 / world_size
    sharded_state = scheme != "ddp"
    sharded_weights = scheme == "fsdp"
    return RankBytes(params=p * (share if sharded_weights else 1), grads=p * (share if sharded_weights else 1),
                     optimizer_state=ADAM_STATES * p * (share if sharded_state else 1),
                     optimizer_temporaries=FOREACH_TEMPORARIES * p * (share if sharded_state else 1))


def phase_bytes(parts: RankBytes, *, activations: float) -> dict[str, float]:
    """Allocated bytes at the handout's three points and at the optimizer step's peak between the
    last two, in steady state (the moments exist).

    - ``after_init``: the weights;
    - ``before_step``: the peak of forward + backward, at the end of the forward: weights,
      moments and the saved activations (the gradients were set to None before the forward and
      grow in the backward as the activations are freed, so the forward's end is the peak);
    - ``optimizer_step``: the peak inside the step: weights, gradients, moments and the update's
      temporaries;
    - ``after_step``: weights, gradients and moments.
    """
    return {"after_init": parts.params,
            "before_step": parts.params + parts.optimizer_state + activations,
            "optimizer_step": parts.step_peak,
            "after_step": parts.persistent}


def expected_saving(n_params: float, world_size: int, *, frm: str, to: str, activations: float) -> dict[str, float]:
    """Bytes ``to`` saves over ``frm`` per rank, at each point of ``phase_bytes`` and at the peak
    (the larger of the two peaks of each scheme)."""
    a = phase_bytes(per_rank_bytes(n_params, world_size, frm), activations=activations)
    b = phase_bytes(per_rank_bytes(n_params, world_size, to), activations=activations)
    out = {k: a[k] - b[k] for k in a}
    out["peak"] = max(a["before_step"], a["optimizer_step"]) - max(b["before_step"], b["optimizer_step"])
    return out


def communication_per_step(n_params: int, world_size: int, bytes_per_param: int = FP32) -> list[dict]:
    """Bytes each rank sends per step (ring algorithms; (N-1)/N of the data per pass), one row per
    scheme in the order of ``SCHEMES``.

    - DDP: all-reduce of the gradients = reduce-scatter + all-gather = 2 (N-1)/N * G;
    - ours (DDP + ShardedOptimizer): that all-reduce, then each owner broadcasts its updated
      parameters: every rank receives the (N-1)/N it does not own, so + (N-1)/N * P;
    - ZeRO stage 1: reduce-scatter the gradients (each rank only needs its shard's), update the
      shard, all-gather the parameters: (N-1)/N * G + (N-1)/N * P, the same as DDP.
    - FSDP (ZeRO-3): all-gather in forward, again in backward, reduce-scatter: 3 (N-1)/N * P.
    """
    f = (world_size - 1) / world_size
    g = p = n_params * bytes_per_param
    return [
        {"scheme": "DDP (all-reduce)", "bytes_per_rank": 2 * f * g},
        {"scheme": "ShardedOptimizer (all-reduce + broadcast)", "bytes_per_rank": 2 * f * g + f * p},
        {"scheme": "ZeRO-1 (reduce-scatter + all-gather)", "bytes_per_rank": f * g + f * p},
        {"scheme": "FSDP / ZeRO-3 (2 all-gathers + reduce-scatter)", "bytes_per_rank": 3 * f * p},
    ]


def memory_per_rank(n_params: int, world_size: int, bytes_per_param: int = FP32) -> list[dict]:
    """Persistent bytes per rank (no activations, no temporaries): fp32 params, grads, AdamW moments."""
    rows = []
    for scheme, label in (("ddp", "DDP"), ("ddp_sharded", "ShardedOptimizer"),
                          ("zero1", "ZeRO-1 (full gradients until the reduce-scatter)"), ("fsdp", "FSDP / ZeRO-3")):
        b = per_rank_bytes(n_params, world_size, scheme, bytes_per_value=bytes_per_param)
        rows.append({"scheme": label, "params": b.params, "grads": b.grads, "opt_state": b.optimizer_state})
    return rows


def sizes_table(sizes: dict[str, int], world_size: int, *, device_bytes: float) -> list[dict]:
    """Per model size: bytes per rank of weights, gradients, moments and the step's temporaries
    under each scheme, and whether that much alone fits a device of ``device_bytes`` (before any
    activation)."""
    rows = []
    for name, n_params in sizes.items():
        row = {"size": name, "params": n_params}
        for scheme in ("ddp", "ddp_sharded", "fsdp"):
            b = per_rank_bytes(n_params, world_size, scheme)
            total = b.step_peak
            row[f"{scheme}_bytes"] = total
            row[f"{scheme}_fits"] = bool(total < device_bytes)
        rows.append(row)
    return rows
