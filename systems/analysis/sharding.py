"""Optimizer-state sharding and FSDP accounting: bytes per rank and per step, from the parameter count.

The handout's accounting questions (optimizer_state_sharding_accounting, fsdp_accounting), next
to which notebook 08 sets the allocator's measurements.
"""

from __future__ import annotations


def computed_breakdown(n_params: int, world_size: int, *, sharded_optimizer: bool,
                       bytes_per_param: int = 4, adam_states: int = 2) -> dict:
    """Bytes per rank from the parameter count: fp32 params and grads, AdamW's two moments."""
    state = adam_states * bytes_per_param * n_params
    return {"params_computed": bytes_per_param * n_params, "grads_computed": bytes_per_param * n_params,
            "opt_state_computed": state / world_size if sharded_optimizer else state}


def communication_per_step(n_params: int, world_size: int, bytes_per_param: int = 4) -> list[dict]:
    """Bytes each rank sends per step (ring algorithms; (N-1)/N of the data per pass).

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


def memory_per_rank(n_params: int, world_size: int, bytes_per_param: int = 4) -> list[dict]:
    """Persistent bytes per rank (no activations): fp32 params, grads, AdamW moments."""
    P = n_params * bytes_per_param
    N = world_size
    return [
        {"scheme": "DDP", "params": P, "grads": P, "opt_state": 2 * P},
        {"scheme": "ShardedOptimizer", "params": P, "grads": P, "opt_state": 2 * P / N},
        {"scheme": "ZeRO-1 (grads freed after reduce-scatter)", "params": P, "grads": P, "opt_state": 2 * P / N},
        {"scheme": "FSDP / ZeRO-3", "params": P / N, "grads": P / N, "opt_state": 2 * P / N},
    ]


