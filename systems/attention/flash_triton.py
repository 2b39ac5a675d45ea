"""FlashAttention-2 in Triton: one forward kernel and two backwards (split, or one kernel with atomic dQ).

Layout of this module: helpers, autotune configs and pruning, kernels, the autograd.Function,
then the public function ``flash_attention_triton``.

Design notes (what makes it fast):
- softmax in base 2: log2(e) is folded into the score scale so the inner loops call exp2;
  the saved L is converted back to the natural-log logsumexp the handout asks for.
- causal attention skips every key tile above the diagonal, and splits the rest into an
  unmasked loop (off-diagonal tiles, no mask arithmetic, no bounds checks) and a short
  masked loop over the tiles that touch the diagonal or the ragged end of the sequence.
- causal query tiles are launched longest-first so the last wave is made of short programs.
- two backwards, chosen by ``backward=`` (table ``BACKWARDS``): "split" runs a dQ kernel
  that walks key tiles for one query tile, then a dK/dV kernel that walks query tiles for one key
  tile (no atomics, but both recompute S and dP: seven matmuls); "atomic" runs one kernel over
  key tiles that also adds each query tile's dS K into an fp32 dQ buffer with atomics (five
  matmuls), between a small kernel that writes D and zeroes that buffer and a cast of it.
- a TMA variant of the forward and of the split pair, the default for 16-bit inputs above TMA_MIN_SEQ
  (``forward=``/``backward="triton_tma"`` force it, ``"triton_pointer"``/``"triton_split"`` the
  pointer kernels; tables ``FORWARDS``/``BACKWARDS``): the same kernels, but the tiles streamed through the inner loops
  (K, V in the forward and dQ; Q, dO in dK/dV) are read through device-side tensor descriptors
  (Hopper's TMA engine; out-of-range rows and columns read as zeros), with its own tile lists.
- tile sizes and warps are autotuned per (sequence-length bucket, head dim, causal, dtype).

Causal convention (the same as ``naive_attention`` and ``flash_pytorch``): query i sees keys
j <= i + (n_keys - n_queries); causal with n_queries > n_keys is rejected.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
import triton.testing

from systems.measure.devices import triton_interpreting
from systems.attention.flash_pytorch import backward_reference, check_inputs

LOG2E = 1.4426950408889634  # scores are scaled by sm_scale * log2(e) so the kernels can use exp2
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)
_MASKED = tl.constexpr(-1e6)  # the handout's masked score (in base-2 units here; exp2 of it is 0)

# read once: TRITON_INTERPRET is fixed before triton is imported, and the config tables below
# are chosen from it at import anyway; the per-call checks then cost no environment lookup
_INTERPRETING = triton_interpreting()

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
# backward= of the public function -> the backward that runs: the Triton "split" pair (dQ kernel,
# then dK/dV kernel) reading through pointers or through TMA descriptors ("split_tma"), the Triton
# "atomic" kernel, or flash_pytorch's compiled reference. "triton" names the default Triton
# backward; docs/flash_attention_notes.md has the measurements that chose it (entries 4 and 5).
# Every Triton one stays selectable so they can be timed side by side.
BACKWARDS = {"triton": "split_auto", "triton_split": "split", "triton_atomic": "atomic", "triton_tma": "split_tma",
             "pytorch": "pytorch"}
BACKWARD_IMPLS = tuple(BACKWARDS)
# forward= of the public function -> the forward kernel: loads through pointers, or through TMA
# tensor descriptors (inputs no descriptor can read, and GPUs before Hopper, get the pointer kernel).
# The default, "auto", is TMA for 16-bit inputs above TMA_MIN_SEQ, pointers otherwise (notes entry 5).
FORWARDS = {"triton": "auto", "triton_pointer": "pointer", "triton_tma": "tma"}
FORWARD_IMPLS = tuple(FORWARDS)
# Longest sequence (max of queries, keys) the "auto" variants still run on the pointer kernels. On
# the H100 the TMA kernels were faster at 16k and 64k (d 64 and 128) but slower at 4k, d 64 (bare
# launches: fwd 0.048 against 0.037 ms, backward 0.127 against 0.094): building descriptors costs
# each program a fixed amount that a short key loop does not earn back. 4096 is that measured point.
TMA_MIN_SEQ = 4096


# ----------------------------------------------------------------------------- helpers



def seq_bucket(n: int) -> int:
    """Autotuning key for a sequence length: powers of 4 from 256 to 16384.

    Tuning per exact length would re-benchmark every config for every new length (a sweep
    over ten lengths would spend most of its time tuning); the best tile barely changes
    within a factor of four. Every bucket is a multiple of 16, so the unused kernel argument
    never changes Triton's integer specialisation (and never forces a recompile).
    """
    bucket = 256
    while bucket < n and bucket < 16384:
        bucket *= 4
    return bucket


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's global matmul setting (TF32 only when the user allowed it)
    if dtype == torch.float32 and not _INTERPRETING and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    check_inputs(q, k, v, is_causal, dtypes=SUPPORTED_DTYPES)
    if not q.is_cuda and not _INTERPRETING:
        raise ValueError(f"FlashAttentionTriton needs CUDA tensors, got device {q.device}; "
                         "set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is outside the supported range {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; masks only what can be out of range (all compile-time)."""
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether the TMA kernels can read these (batch, seq, d) contiguous tensors: a descriptor's base
    must be 16-byte aligned and its row stride a multiple of 16 bytes (so d * element size must be,
    which holds for every d that is a multiple of 8), and the TMA engine exists from Hopper on.
    Where it does not hold, the TMA variants run the pointer kernels instead."""
    for t in tensors:
        # (with d * element size a multiple of 16, every (batch, head)'s base stays aligned too)
        if t.data_ptr() % 16 or (t.shape[-1] * t.element_size()) % 16:
            return False
    if _INTERPRETING:
        return True
    return all(t.is_cuda for t in tensors) and _major_capability(tensors[0].device.index) >= 9


@functools.cache  # asked once per device: every call needs it
def _major_capability(index) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _wants_tma(variant: str, *tensors: torch.Tensor) -> bool:
    """Whether a variant name ("pointer", "tma", "auto"; the backward's without "split_") runs the
    TMA kernels on these (batch, seq, d) tensors."""
    if variant == "auto":
        # where TMA was measured faster: 16-bit inputs (fp32 was not measured) of long sequences
        long = max(t.shape[-2] for t in tensors) > TMA_MIN_SEQ
        variant = "tma" if long and tensors[0].dtype != torch.float32 else "pointer"
    return variant == "tma" and tma_usable(*tensors)


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # where the kernels write the descriptors they build (128 bytes each per program); torch's
    # caching allocator hands back the same block launch after launch
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_tma_allocator() -> None:
    """Give Triton an allocator for device-side descriptors unless this thread has one.

    Checked at every TMA launch, not once: Triton keeps the allocator in a ContextVar, which every
    thread starts without, and autograd runs the backward on a thread of its own. Never at import:
    importing this module must not change Triton's global state."""
    from triton.runtime import _allocation  # cached after the first call: a dict lookup

    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_tma_scratch)


@triton.jit
def _load_tile(src, row0, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """A (rows, BLOCK_D) tile starting at row0: through a tensor descriptor (TMA, which zero-fills
    rows past n_rows and columns past HEAD_DIM by itself), or as _load_rows from a base pointer."""
    if TMA:
        x = src.load([row0, 0])
    else:
        x = _load_rows(src + rows[:, None] * HEAD_DIM + offs_d[None, :], rows, n_rows, offs_d, HEAD_DIM, BLOCK_D,
                       CHECK_ROWS)
    return x


@triton.jit
def _streamed(base, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
              TMA: tl.constexpr):
    """What an inner loop reads one (batch, head)'s (n_rows, d) operand through, for _load_tile: a
    tensor descriptor of it (TMA; rows past n_rows read as zeros), or its base pointer."""
    if TMA:
        src = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                        block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def _key_bounds(m0, n_k, offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For the query tile starting at row m0: where the key tiles every row sees in full end (the
    unmasked loop runs up to there), and where the keys any row sees end (the masked loop runs
    from the first to the second: the diagonal tiles and the ragged end)."""
    n_k_full = (n_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi_unmasked = tl.minimum(((m0 + offset + 1) // BLOCK_N) * BLOCK_N, n_k_full)
        hi = tl.minimum(m0 + BLOCK_M + offset, n_k)
    else:
        hi_unmasked = n_k_full
        hi = n_k
    return hi_unmasked, hi


@triton.jit
def _diagonal_query_tiles(n0, offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Causal, for the key tile starting at row n0: the query tiles [lo, hi) that see part of it
    (its diagonal; they need the mask). Query tiles from hi on see all of it."""
    lo = (tl.maximum(n0 - offset, 0) // BLOCK_M) * BLOCK_M
    last_partial = tl.maximum(n0 + BLOCK_N - 1 - offset, 0)
    hi = ((last_partial + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    return lo, hi


@triton.jit
def _store_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _atomic_add_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     CHECK_ROWS: tl.constexpr):
    """Add a (rows, BLOCK_D) fp32 tile into global memory with atomics, masked as _load_rows.

    relaxed: the adds only have to be atomic, not ordered against other memory operations (the
    buffer is read by the next launch), and acq_rel would fence around every one of them."""
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tl.atomic_add(ptrs, x, mask=rows[:, None] < n_rows, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    else:
        if HEAD_DIM == BLOCK_D:
            tl.atomic_add(ptrs, x, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")


# ----------------------------------------------------------------------------- autotune configs


def _cfg(**kw) -> triton.Config:
    warps, stages = kw.pop("warps"), kw.pop("stages")
    return triton.Config(kw, num_warps=warps, num_stages=stages)


def autotuning() -> bool:
    """False under the interpreter, or with FLASH_TRITON_AUTOTUNE=0 (one default config each:
    no benchmarking, few compiles; what quick GPU tests want)."""
    return not _INTERPRETING and os.environ.get("FLASH_TRITON_AUTOTUNE", "1") != "0"


# Per kernel: configs for 16-bit inputs and for fp32 inputs (fp32 tiles hold twice the bytes
# and its ieee dots run on CUDA cores, so smaller tiles win and big ones spill). The lists are
# short on purpose: each config costs a compile per (head dim, dtype, causal). The 16-bit ones
# are the winners of systems.bench.flash_tuning's 8 candidates per kernel on an H100 (bf16, causal,
# seq 1k-64k x d 64/128 and the leaderboard shape; results/06_flash_attention_tuning.jsonl):
# 64-row tiles win up to 16k, 128-row query tiles (and 64x128 dK/dV tiles) at 64k with d=128.
# Under the interpreter there is one small config each: multi-config autotuning benchmarks
# on a GPU (it fails without a driver), and 16-row tiles exercise the tile loops at tiny sizes.
if _INTERPRETING:
    _CONFIGS = {
        "fwd": {"half": [_cfg(BLOCK_M=16, BLOCK_N=16, warps=4, stages=1)], "fp32": []},
        "dkdv": {"half": [_cfg(BLOCK_M1=16, BLOCK_N1=32, warps=4, stages=1)], "fp32": []},
        "dq": {"half": [_cfg(BLOCK_M2=32, BLOCK_N2=16, warps=4, stages=1)], "fp32": []},
        "atomic": {"half": [_cfg(BLOCK_M3=16, BLOCK_N3=32, DEFER_DQ_ADD=True, warps=4, stages=1)], "fp32": []},
    }
elif not autotuning():
    # one config every dtype and head dim fits (fp32 included)
    _CONFIGS = {
        "fwd": {"half": [_cfg(BLOCK_M=64, BLOCK_N=64, warps=4, stages=2)], "fp32": []},
        "dkdv": {"half": [_cfg(BLOCK_M1=32, BLOCK_N1=64, warps=4, stages=2)], "fp32": []},
        "dq": {"half": [_cfg(BLOCK_M2=64, BLOCK_N2=32, warps=4, stages=2)], "fp32": []},
        "atomic": {"half": [_cfg(BLOCK_M3=32, BLOCK_N3=64, DEFER_DQ_ADD=True, warps=4, stages=2)], "fp32": []},
    }
else:
    _CONFIGS = {
        "fwd": {
            "half": [_cfg(BLOCK_M=64, BLOCK_N=128, warps=4, stages=3),
                     _cfg(BLOCK_M=128, BLOCK_N=64, warps=8, stages=3),
                     _cfg(BLOCK_M=64, BLOCK_N=64, warps=4, stages=4)],
            "fp32": [_cfg(BLOCK_M=64, BLOCK_N=64, warps=4, stages=3),
                     _cfg(BLOCK_M=64, BLOCK_N=32, warps=4, stages=2)],
        },
        "dkdv": {
            "half": [_cfg(BLOCK_M1=64, BLOCK_N1=64, warps=4, stages=3),
                     _cfg(BLOCK_M1=32, BLOCK_N1=64, warps=4, stages=3),
                     _cfg(BLOCK_M1=64, BLOCK_N1=128, warps=8, stages=3)],
            "fp32": [_cfg(BLOCK_M1=32, BLOCK_N1=64, warps=4, stages=2),
                     _cfg(BLOCK_M1=32, BLOCK_N1=32, warps=4, stages=2)],
        },
        "dq": {
            "half": [_cfg(BLOCK_M2=128, BLOCK_N2=64, warps=8, stages=3),
                     _cfg(BLOCK_M2=128, BLOCK_N2=32, warps=4, stages=3),
                     _cfg(BLOCK_M2=64, BLOCK_N2=64, warps=4, stages=3)],
            "fp32": [_cfg(BLOCK_M2=64, BLOCK_N2=32, warps=4, stages=2),
                     _cfg(BLOCK_M2=32, BLOCK_N2=32, warps=4, stages=2)],
        },
        # The atomic backward's key tile (BLOCK_N3) sets its atomic traffic: every key tile adds
        # n_q x d fp32 into dQ, so a head moves about n_q * n_k / 2 / BLOCK_N3 * d * 4 bytes of
        # atomics when causal. Hence no 16-bit config below 64 keys. On an H100 at the
        # leaderboard shape (notes entry 4) 64x128/8 warps and 64x64/4 warps led; 32-row query
        # tiles (whose dQ dot runs on mma.sync: wgmma needs 64 rows) ran 1.2-1.3x slower and
        # 128-row ones 1.3-2x; deferring the dQ add by one query tile took 3% and 7% off the
        # two leaders, so every config here defers it.
        "atomic": {
            "half": [_cfg(BLOCK_M3=64, BLOCK_N3=128, DEFER_DQ_ADD=True, warps=8, stages=3),
                     _cfg(BLOCK_M3=64, BLOCK_N3=64, DEFER_DQ_ADD=True, warps=4, stages=3),
                     _cfg(BLOCK_M3=64, BLOCK_N3=128, DEFER_DQ_ADD=True, warps=8, stages=4)],
            "fp32": [_cfg(BLOCK_M3=32, BLOCK_N3=64, DEFER_DQ_ADD=True, warps=4, stages=2),
                     _cfg(BLOCK_M3=32, BLOCK_N3=32, DEFER_DQ_ADD=True, warps=4, stages=2)],
        },
        # The TMA kernels: the streamed tiles are copied into shared memory by the TMA engine instead
        # of by every thread's address arithmetic and loads, which leaves registers for larger tiles.
        # systems.bench.flash_tuning's search over 8 candidates each on an H100 (leaderboard shape, notes
        # entry 5, results/06_flash_tma_tuning.jsonl) found the larger ones slower: 128x128 over 8
        # warps lost by 9% (fwd), 12% (dK/dV) and 12% (dQ) to 64-row tiles with 4 warps. So each list
        # holds two: the search's winner at the leaderboard shape, and the pointer kernel's 128-row
        # (or 128-key) tile that wins at 64k with d=128. Two, not more, because with the TMA
        # kernels beside the pointer ones every config is one more compile per head dim and dtype
        # in notebook 06's sweep, which has to fit its time budget.
        "fwd_tma": {
            "half": [_cfg(BLOCK_M=64, BLOCK_N=128, warps=4, stages=3),
                     _cfg(BLOCK_M=128, BLOCK_N=64, warps=8, stages=3)],
            "fp32": [_cfg(BLOCK_M=64, BLOCK_N=64, warps=4, stages=3),
                     _cfg(BLOCK_M=64, BLOCK_N=32, warps=4, stages=2)],
        },
        "dkdv_tma": {
            "half": [_cfg(BLOCK_M1=64, BLOCK_N1=64, warps=4, stages=3),
                     _cfg(BLOCK_M1=64, BLOCK_N1=128, warps=8, stages=3)],
            "fp32": [_cfg(BLOCK_M1=32, BLOCK_N1=64, warps=4, stages=2),
                     _cfg(BLOCK_M1=32, BLOCK_N1=32, warps=4, stages=2)],
        },
        "dq_tma": {
            "half": [_cfg(BLOCK_M2=64, BLOCK_N2=64, warps=4, stages=3),
                     _cfg(BLOCK_M2=128, BLOCK_N2=32, warps=4, stages=3)],
            "fp32": [_cfg(BLOCK_M2=64, BLOCK_N2=32, warps=4, stages=2),
                     _cfg(BLOCK_M2=32, BLOCK_N2=32, warps=4, stages=2)],
        },
    }

if not autotuning():  # one config each: the TMA kernels run their pointer twins' tiles
    _CONFIGS.update({f"{k}_tma": _CONFIGS[k] for k in ("fwd", "dkdv", "dq")})

_SMEM_BUDGET = 200 * 1024  # bytes; H100 allows 227 KB per block, the rest is Triton's scratch
# fp32 registers per thread the atomic kernel's dK and dV accumulators may take: a thread has at
# most 255, and the S^T, P^T, dP^T tiles and the dot operands need the rest (beyond this it spills)
_ACC_REGS_PER_THREAD = 128


def _prune(kernel, configs, named_args, resident_keys, streamed_keys, **kwargs):
    """Keep the configs of the input's dtype family whose tiles fit shared memory.

    resident_keys: block sizes of tiles held for the whole program;
    streamed_keys: block sizes of tiles multi-buffered over num_stages.
    """
    meta = {**named_args, **kwargs}
    fp32 = meta["Q"].dtype == torch.float32
    elt = 4 if fp32 else 2
    family = _CONFIGS[kernel]["fp32" if fp32 else "half"] or _CONFIGS[kernel]["half"]
    kept = []
    for c in configs:
        if not any(c is f for f in family):
            continue
        resident = sum(c.kwargs[key] for key in resident_keys) * meta["BLOCK_D"] * elt
        streamed = sum(c.kwargs[key] for key in streamed_keys) * meta["BLOCK_D"] * elt * max(c.num_stages, 1)
        if resident + streamed <= _SMEM_BUDGET:
            kept.append(c)
    if not kept:  # never return nothing: the family's smallest config
        kept = [min(family, key=lambda c: sum(c.kwargs.values()) * c.num_stages)]
    return kept


# Per kernel family: the block sizes of the tiles a program holds throughout, and of those it
# streams (multi-buffered over num_stages) through its loop. The TMA kernels hold and stream the
# same tiles as their pointer twins.
_TILE_ROLES = {
    "fwd": (["BLOCK_M"], ["BLOCK_N", "BLOCK_N"]),  # Q; K and V
    "dkdv": (["BLOCK_N1", "BLOCK_N1"], ["BLOCK_M1", "BLOCK_M1"]),  # K, V (dK, dV in registers); Q and dO
    "dq": (["BLOCK_M2", "BLOCK_M2"], ["BLOCK_N2", "BLOCK_N2"]),  # Q, dO; K and V
    "atomic": (["BLOCK_N3", "BLOCK_N3"], ["BLOCK_M3", "BLOCK_M3"]),  # K, V; Q and dO
}


def _pruner(kernel: str):
    """The config pruner of one kernel's autotuner: its own config lists, its family's tile roles."""
    resident, streamed = _TILE_ROLES[kernel.removesuffix("_tma")]
    return functools.partial(_prune, kernel, resident_keys=resident, streamed_keys=streamed)


def _prune_atomic(configs, named_args, **kwargs):
    # shared memory first, then the register rule: the dK and dV accumulators (2 x BLOCK_N3 x
    # BLOCK_D fp32, spread over the block's threads) must leave room for the rest
    kept = _pruner("atomic")(configs, named_args, **kwargs)
    block_d = {**named_args, **kwargs}["BLOCK_D"]

    def acc_regs(c):
        return 2 * c.kwargs["BLOCK_N3"] * block_d / (32 * c.num_warps)

    return [c for c in kept if acc_regs(c) <= _ACC_REGS_PER_THREAD] or [min(kept, key=acc_regs)]


_TUNE_KEY = ["SEQ_BUCKET", "HEAD_DIM", "IS_CAUSAL", "INPUT_PRECISION"]


def _tune_bench(fn, quantiles=None, **_):
    # shorter than Triton's default 25 ms warm-up + 100 ms per config: a sweep meets many keys
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _autotune(configs, prune, restore_value=None):
    """restore_value: outputs the kernel accumulates into (atomics), which the autotuner copies
    before each benchmark run and puts back after it, so the real run adds to what it was given."""
    try:
        return triton.autotune(configs=configs, key=_TUNE_KEY, do_bench=_tune_bench, restore_value=restore_value,
                               prune_configs_by={"early_config_prune": prune})
    except TypeError:  # a Triton without the do_bench hook: its default timing
        return triton.autotune(configs=configs, key=_TUNE_KEY, restore_value=restore_value,
                               prune_configs_by={"early_config_prune": prune})


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _fwd_key_loop(acc, m_i, l_i, q, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, lo, hi,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over key tiles [lo, hi). MASK=False is the hot off-diagonal loop.
    K_src, V_src: the (batch, head)'s base pointers, or its tensor descriptors when TMA."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = _load_tile(K_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # base-2 scores
        if MASK:
            keep = keys[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (keys[None, :] <= offs_m[:, None] + offset)
            s = tl.where(keep, s, _MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_program(Q, K, V, O, L, n_q, n_k, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """Grid (query tiles, batch). One program: one query tile against all (visible) key tiles.
    TMA: K and V stream through tensor descriptors (Q and O, touched once, stay pointer accesses)."""
    tile = tl.program_id(0)
    if IS_CAUSAL:
        tile = tl.num_programs(0) - 1 - tile  # longest (last) query tiles first
    bh = tl.program_id(1).to(tl.int64)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + bh * n_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                   offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    K_src = _streamed(K + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    V_src = _streamed(V + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    offset = n_k - n_q
    hi_unmasked, hi = _key_bounds(m0, n_k, offset, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, m_i, l_i = _fwd_key_loop(acc, m_i, l_i, q, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale,
                                  0, hi_unmasked, BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, INPUT_PRECISION, TMA)
    acc, m_i, l_i = _fwd_key_loop(acc, m_i, l_i, q, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale,
                                  hi_unmasked, hi,
                                  BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, INPUT_PRECISION, TMA)

    o = acc / l_i[:, None]
    _store_rows(O + bh * n_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                o.to(O.dtype.element_ty), offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # natural-log logsumexp of the (scaled) scores
    tl.store(L + bh * n_q + offs_m, lse, mask=offs_m < n_q)


# Each program body is one @triton.jit function behind two kernels, pointer and TMA: two kernel
# names give two autotuners with their own config lists and their own entries in _PLANS.
@_autotune(_CONFIGS["fwd"]["half"] + _CONFIGS["fwd"]["fp32"], _pruner("fwd"))
@triton.jit
def _flash_fwd_kernel(Q, K, V, O, L, n_q, n_k, qk_scale, SEQ_BUCKET,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _fwd_program(Q, K, V, O, L, n_q, n_k, qk_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                 False)


@_autotune(_CONFIGS["fwd_tma"]["half"] + _CONFIGS["fwd_tma"]["fp32"], _pruner("fwd_tma"))
@triton.jit
def _flash_fwd_tma_kernel(Q, K, V, O, L, n_q, n_k, qk_scale, SEQ_BUCKET,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _fwd_program(Q, K, V, O, L, n_q, n_k, qk_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL, INPUT_PRECISION, BLOCK_M, BLOCK_N,
                 True)


@triton.jit
def _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale, lo, hi,
                     BLOCK_M1: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAUSAL_MASK: tl.constexpr, CHECK_ROWS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     TMA: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), in transposed form (keys x queries).

    Query rows past n_q load as zeros (Q, dO, L, D), so their P is finite and their
    contribution to dV = P^T dO and dK = dS^T Q is exactly zero: no score mask is needed for them.
    Q_src, dO_src: base pointers, or tensor descriptors when TMA.
    """
    offs_mb = tl.arange(0, BLOCK_M1)
    for start_m in range(lo, hi, BLOCK_M1):
        rows = start_m + offs_mb
        q = _load_tile(Q_src, start_m, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS, TMA)
        do = _load_tile(dO_src, start_m, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS, TMA)
        if CHECK_ROWS:
            lse = tl.load(L_bh + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(D_bh + rows, mask=rows < n_q, other=0.0)
        else:
            lse = tl.load(L_bh + rows)
            delta = tl.load(D_bh + rows)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale  # S^T in base 2
        if CAUSAL_MASK:
            s_t = tl.where(offs_n[:, None] <= rows[None, :] + offset, s_t, _MASKED)
        p_t = tl.math.exp2(s_t - lse[None, :] * _LOG2E)  # P^T = exp(S - L) (eq. 13)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)  # dV += P^T dO (eq. 14)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # dP^T = V dO^T (eq. 15)
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T = P^T o (dP^T - D) (eq. 16)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)  # dK += dS^T Q (eq. 18)
    return dk, dv


@triton.jit
def _dkdv_program(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, qk_scale, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, TMA: tl.constexpr):
    """Grid (key tiles, batch). One program owns dK and dV of one key tile: no atomics.
    Runs after the dQ kernel, which wrote Delta. TMA: Q and dO stream through tensor descriptors."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n0 = tile * BLOCK_N1
    offs_n = n0 + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, BLOCK_D)
    kv_tile = bh * n_k * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = _load_rows(K + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    Q_src = _streamed(Q + bh * n_q * HEAD_DIM, n_q, HEAD_DIM, BLOCK_M1, BLOCK_D, TMA)
    dO_src = _streamed(dO + bh * n_q * HEAD_DIM, n_q, HEAD_DIM, BLOCK_M1, BLOCK_D, TMA)
    L_bh = L + bh * n_q
    D_bh = Delta + bh * n_q

    offset = n_k - n_q
    n_q_full = (n_q // BLOCK_M1) * BLOCK_M1
    if IS_CAUSAL:
        # query tiles that see part of this key tile (the diagonal), masked ...
        lo_diag, hi_diag = _diagonal_query_tiles(n0, offset, BLOCK_M1, BLOCK_N1)
        dk, dv = _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale,
                                  lo_diag, tl.minimum(hi_diag, n_q),
                                  BLOCK_M1, HEAD_DIM, BLOCK_D, True, True, INPUT_PRECISION, TMA)
    else:
        hi_diag = 0
    # ... then the query tiles that see all of it: unmasked, unchecked; then a ragged tail
    dk, dv = _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale,
                              hi_diag, n_q_full,
                              BLOCK_M1, HEAD_DIM, BLOCK_D, False, False, INPUT_PRECISION, TMA)
    dk, dv = _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale,
                              tl.maximum(hi_diag, n_q_full), n_q,
                              BLOCK_M1, HEAD_DIM, BLOCK_D, False, True, INPUT_PRECISION, TMA)

    dk = dk * sm_scale  # S = Q K^T * scale, so dK = dS^T Q * scale
    _store_rows(dK + kv_tile, dk.to(dK.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(dV + kv_tile, dv.to(dV.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)


@_autotune(_CONFIGS["dkdv"]["half"] + _CONFIGS["dkdv"]["fp32"], _pruner("dkdv"))
@triton.jit
def _flash_bwd_dkdv_kernel(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, qk_scale, sm_scale, SEQ_BUCKET,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                           INPUT_PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr):
    _dkdv_program(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                  INPUT_PRECISION, BLOCK_M1, BLOCK_N1, False)


@_autotune(_CONFIGS["dkdv_tma"]["half"] + _CONFIGS["dkdv_tma"]["fp32"], _pruner("dkdv_tma"))
@triton.jit
def _flash_bwd_dkdv_tma_kernel(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, qk_scale, sm_scale, SEQ_BUCKET,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                               INPUT_PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr):
    _dkdv_program(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                  INPUT_PRECISION, BLOCK_M1, BLOCK_N1, True)


@triton.jit
def _dq_key_loop(dq, q, do, lse2, delta, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, lo, hi,
                 BLOCK_N2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi). K_src, V_src: pointers or descriptors."""
    offs_nb = tl.arange(0, BLOCK_N2)
    for start_n in range(lo, hi, BLOCK_N2):
        keys = start_n + offs_nb
        k = _load_tile(K_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        v = _load_tile(V_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if MASK:
            keep = keys[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (keys[None, :] <= offs_m[:, None] + offset)
            s = tl.where(keep, s, _MASKED)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)  # dQ += dS K (eq. 17)
    return dq


@triton.jit
def _dq_program(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, qk_scale, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, TMA: tl.constexpr):
    """Grid (query tiles, batch). One program owns dQ of one query tile: no atomics.
    TMA: K and V stream through tensor descriptors.

    Its prologue computes D = rowsum(O * dO) (handout eq. 19's helper) for its rows and stores it
    for the dK/dV kernel, which runs next: one launch fewer than a separate D kernel."""
    tile = tl.program_id(0)
    if IS_CAUSAL:
        tile = tl.num_programs(0) - 1 - tile
    bh = tl.program_id(1).to(tl.int64)
    m0 = tile * BLOCK_M2
    offs_m = m0 + tl.arange(0, BLOCK_M2)
    offs_d = tl.arange(0, BLOCK_D)
    q_tile = bh * n_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = _load_rows(Q + q_tile, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(dO + q_tile, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    o = _load_rows(O + q_tile, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh * n_q + offs_m, delta, mask=offs_m < n_q)
    lse2 = tl.load(L + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0) * _LOG2E
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    K_src = _streamed(K + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N2, BLOCK_D, TMA)
    V_src = _streamed(V + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N2, BLOCK_D, TMA)

    offset = n_k - n_q
    hi_unmasked, hi = _key_bounds(m0, n_k, offset, BLOCK_M2, BLOCK_N2, IS_CAUSAL)
    dq = _dq_key_loop(dq, q, do, lse2, delta, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, 0, hi_unmasked,
                      BLOCK_N2, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, INPUT_PRECISION, TMA)
    dq = _dq_key_loop(dq, q, do, lse2, delta, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, hi_unmasked, hi,
                      BLOCK_N2, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, INPUT_PRECISION, TMA)
    dq = dq * sm_scale
    _store_rows(dQ + q_tile, dq.to(dQ.dtype.element_ty), offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)


@_autotune(_CONFIGS["dq"]["half"] + _CONFIGS["dq"]["fp32"], _pruner("dq"))
@triton.jit
def _flash_bwd_dq_kernel(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, qk_scale, sm_scale, SEQ_BUCKET,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    _dq_program(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                INPUT_PRECISION, BLOCK_M2, BLOCK_N2, False)


@_autotune(_CONFIGS["dq_tma"]["half"] + _CONFIGS["dq_tma"]["fp32"], _pruner("dq_tma"))
@triton.jit
def _flash_bwd_dq_tma_kernel(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, qk_scale, sm_scale, SEQ_BUCKET,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                             INPUT_PRECISION: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    _dq_program(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                INPUT_PRECISION, BLOCK_M2, BLOCK_N2, True)


@triton.jit
def _flash_bwd_prep_kernel(O, dO, Delta, DQ_ACC, n_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_P: tl.constexpr):
    """Grid (row tiles, batch). The atomic backward's prologue: D = rowsum(O * dO) for the atomic
    kernel, and zeros in the fp32 dQ buffer it adds into (one launch for both, no memset)."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    tile = bh * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    o = _load_rows(O + tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(dO + tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    tl.store(Delta + bh * n_q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < n_q)
    _store_rows(DQ_ACC + tile, tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32), rows, n_q, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _atomic_query_loop(dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k,
                       offset, qk_scale, lo, hi, BLOCK_M3: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
                       CHECK_ROWS: tl.constexpr, DEFER_DQ_ADD: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """_dkdv_query_loop's five matmuls over query tiles [lo, hi), plus dQ += dS K added into DQ_bh
    (fp32, unscaled) with atomics: each query tile's dQ gets one add per key tile that sees it.

    MASK: the causal mask (when IS_CAUSAL) and the key bound. Keys past n_k load as zeros, so
    their rows of dS K vanish, but their P = exp2(0 - L) can overflow to inf when L is very
    negative and inf * 0 is nan; the masked loop runs wherever such keys meet real queries.
    Query rows past n_q load as zeros (their dS is 0) and their atomics are masked off.

    DEFER_DQ_ADD: a tile's dQ part (dq_prev, rows_prev) is added at the next iteration, once that
    iteration's S^T dot is issued, instead of right after its own dot, which the adds would have
    to wait for. On an H100 this took 3-7% off (notes entry 4). The caller adds the last one."""
    offs_mb = tl.arange(0, BLOCK_M3)
    for start_m in range(lo, hi, BLOCK_M3):
        rows = start_m + offs_mb
        q_tile = rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = _load_rows(Q_bh + q_tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
        do = _load_rows(dO_bh + q_tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
        if CHECK_ROWS:
            lse = tl.load(L_bh + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(D_bh + rows, mask=rows < n_q, other=0.0)
        else:
            lse = tl.load(L_bh + rows)
            delta = tl.load(D_bh + rows)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        if DEFER_DQ_ADD:  # before s_t's first use, so the adds are issued while its dot runs
            _atomic_add_rows(DQ_bh + rows_prev[:, None] * HEAD_DIM + offs_d[None, :], dq_prev, rows_prev, n_q,
                             offs_d, HEAD_DIM, BLOCK_D, True)
        s_t = s_t * qk_scale  # S^T in base 2
        if MASK:
            keep = offs_n[:, None] < n_k
            if IS_CAUSAL:
                keep = keep & (offs_n[:, None] <= rows[None, :] + offset)
            s_t = tl.where(keep, s_t, _MASKED)
        p_t = tl.math.exp2(s_t - lse[None, :] * _LOG2E)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)  # dV += P^T dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # dP^T = V dO^T
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # dS^T, rounded once for both dots
        dk = tl.dot(ds_t, q, dk, input_precision=INPUT_PRECISION)  # dK += dS^T Q
        dq = tl.dot(tl.trans(ds_t), k, input_precision=INPUT_PRECISION)  # this key tile's part of dS K
        if DEFER_DQ_ADD:
            dq_prev = dq
            rows_prev = rows
        else:
            _atomic_add_rows(DQ_bh + q_tile, dq, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
    return dk, dv, dq_prev, rows_prev


@_autotune(_CONFIGS["atomic"]["half"] + _CONFIGS["atomic"]["fp32"], _prune_atomic, restore_value=["DQ_ACC"])
@triton.jit
def _flash_bwd_atomic_kernel(Q, K, V, dO, L, Delta, dK, dV, DQ_ACC, n_q, n_k, qk_scale, sm_scale, SEQ_BUCKET,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                             INPUT_PRECISION: tl.constexpr, BLOCK_M3: tl.constexpr, BLOCK_N3: tl.constexpr,
                             DEFER_DQ_ADD: tl.constexpr):
    """Grid (key tiles, batch). One program owns dK and dV of one key tile, as the dK/dV kernel,
    and adds its share of dQ into DQ_ACC (zeroed, with D written, by the prep kernel). Key tile 0
    sees the most query tiles when causal, so the natural order is already longest-first."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n0 = tile * BLOCK_N3
    offs_n = n0 + tl.arange(0, BLOCK_N3)
    offs_d = tl.arange(0, BLOCK_D)
    kv_tile = bh * n_k * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = _load_rows(K + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N3, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N3, BLOCK_D], dtype=tl.float32)
    # the deferred add's carry starts as a tile of rows past n_q: its add is masked off entirely
    dq_prev = tl.zeros([BLOCK_M3, BLOCK_D], dtype=tl.float32)
    rows_prev = n_q + tl.arange(0, BLOCK_M3)
    Q_bh = Q + bh * n_q * HEAD_DIM
    dO_bh = dO + bh * n_q * HEAD_DIM
    DQ_bh = DQ_ACC + bh * n_q * HEAD_DIM
    L_bh = L + bh * n_q
    D_bh = Delta + bh * n_q

    offset = n_k - n_q
    n_q_full = (n_q // BLOCK_M3) * BLOCK_M3
    if IS_CAUSAL:
        # the query tiles that see part of this key tile, masked (padding keys are never seen by
        # a real query past them, so the unmasked loops below need no key bound)
        lo_diag, lo = _diagonal_query_tiles(n0, offset, BLOCK_M3, BLOCK_N3)
        dk, dv, dq_prev, rows_prev = _atomic_query_loop(
            dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
            qk_scale, lo_diag, tl.minimum(lo, n_q),
            BLOCK_M3, HEAD_DIM, BLOCK_D, True, True, True, DEFER_DQ_ADD, INPUT_PRECISION)
    else:
        # a ragged last key tile meets every query: all of them through the masked loop
        lo = tl.where(n0 + BLOCK_N3 > n_k, n_q, 0)
        dk, dv, dq_prev, rows_prev = _atomic_query_loop(
            dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
            qk_scale, 0, lo,
            BLOCK_M3, HEAD_DIM, BLOCK_D, True, False, True, DEFER_DQ_ADD, INPUT_PRECISION)
    # the query tiles that see all of this key tile: unmasked, unchecked; then a ragged tail
    dk, dv, dq_prev, rows_prev = _atomic_query_loop(
        dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
        qk_scale, lo, n_q_full,
        BLOCK_M3, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, False, DEFER_DQ_ADD, INPUT_PRECISION)
    dk, dv, dq_prev, rows_prev = _atomic_query_loop(
        dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
        qk_scale, tl.maximum(lo, n_q_full), n_q,
        BLOCK_M3, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, True, DEFER_DQ_ADD, INPUT_PRECISION)
    if DEFER_DQ_ADD:  # the last query tile's add
        _atomic_add_rows(DQ_bh + rows_prev[:, None] * HEAD_DIM + offs_d[None, :], dq_prev, rows_prev, n_q,
                         offs_d, HEAD_DIM, BLOCK_D, True)

    dk = dk * sm_scale  # dQ's sm_scale is applied by the cast that follows this kernel
    _store_rows(dK + kv_tile, dk.to(dK.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(dV + kv_tile, dv.to(dV.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)


# ----------------------------------------------------------------------------- launchers

@dataclass
class _Plan:
    """What the autotuner chose for one (kernel, dtype, autotune key), and the kernels compiled for it."""
    kwargs: dict  # the autotune key's meta-parameters, the best config's tiles, num_warps, num_stages
    tail: tuple  # the kernel's parameters after the runtime arguments (SEQ_BUCKET, constexprs), in order
    compiled: dict = field(default_factory=dict)  # _specialisation(args) -> Triton's CompiledKernel


# (kernel, dtype, autotune key) -> its _Plan. The first call of a key autotunes; the first call of
# each argument specialisation then goes through Triton's jit dispatch, which returns the compiled
# kernel it launched; every later call launches that compiled kernel directly. Triton's per-call
# dispatch (the autotuner's, then the jit's: binding, specialising and hashing every argument) cost
# more host time than a short sequence's kernel takes on the GPU.
_PLANS: dict[tuple, _Plan] = {}


def _specialisation(args: tuple) -> tuple:
    """What Triton specialises a compiled kernel on, for the argument types these kernels take, or
    finer (so a cached kernel is never launched where Triton would have compiled another): a
    tensor's dtype, device and 16-byte alignment; an int's width, equality to 1 and divisibility
    by 16. Python floats always pass as fp32."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.get_device(), a.data_ptr() % 16 == 0))
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31))
    return tuple(key)


def _block_d(d: int) -> int:
    # the head dim padded to a power of two of at least 16 (tl.dot's smallest K); bit arithmetic,
    # as triton.next_power_of_2 is a jit-aware function that costs microseconds per call
    return max(16, 1 << (d - 1).bit_length())


def _common(d: int, n: int, dtype: torch.dtype, is_causal: bool) -> dict:
    """The constexprs every kernel of one call shares: head dim, causal, dot precision, and the
    autotuning bucket of the longer sequence ``n``."""
    return dict(HEAD_DIM=d, BLOCK_D=_block_d(d), IS_CAUSAL=bool(is_causal), INPUT_PRECISION=_dot_precision(dtype),
                SEQ_BUCKET=seq_bucket(n))


def _dims(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, n_q, n_k, d) of contiguous (..., seq, d) tensors. The kernels address a (batch,
    head)'s rows from the base pointer alone, so leading dims need no reshape into one batch dim."""
    n_q, d = q.shape[-2], q.shape[-1]
    return q.numel() // (n_q * d), n_q, k.shape[-2], d


def _launch(kernel, grid, args: tuple, meta: dict, config: dict | None) -> None:
    """The autotuned kernel, or with ``config`` (its tile sizes, num_warps and num_stages) the jit'ed
    kernel under it, bypassing the autotuner (what systems.bench.flash_tuning measures candidates with)."""
    if config is not None:
        kernel.fn[grid](*args, **meta, **config)
        return
    key = (kernel.fn.__name__, args[0].dtype, *(meta[k] for k in _TUNE_KEY))  # the autotuner's own key
    plan = _PLANS.get(key)
    if plan is None:
        kernel[grid](*args, **meta)  # autotunes on the first call of a key
        best = getattr(kernel, "best_config", None)
        if best is not None:
            kwargs = {**meta, **best.all_kwargs()}
            _PLANS[key] = _Plan(kwargs, tuple(kwargs[name] for name in kernel.fn.arg_names[len(args):]))
        return
    spec = _specialisation(args)
    compiled = plan.compiled.get(spec)
    if compiled is None:
        compiled = kernel.fn[grid](*args, **plan.kwargs)
        if compiled is not None and not _INTERPRETING:  # the interpreter compiles nothing
            plan.compiled[spec] = compiled
        return
    g = grid(plan.kwargs)
    compiled[(g[0], g[1], 1)](*args, *plan.tail)


def _contiguous(*tensors: torch.Tensor) -> None:
    # the kernels index (..., seq, d) tensors with the strides of the contiguous layout
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"flash_triton kernels take contiguous tensors, got strides {t.stride()}")


def _pick(pointer_kernel, tma_kernel, tma: bool):
    """The TMA kernel (after making sure this thread has a descriptor allocator) or the pointer one.
    The caller has checked tma_usable."""
    if not tma:
        return pointer_kernel
    if not _INTERPRETING:  # the interpreter builds descriptors on the host, without scratch
        _ensure_tma_allocator()
    return tma_kernel


# The launchers take contiguous tensors shaped (..., seq, d) (every leading dim is batch) and
# L, D shaped (..., n_q) fp32.

def launch_forward(q3, k3, v3, o, lse, is_causal: bool, *, config: dict | None = None, tma: bool = False) -> None:
    """Fill O (like Q) and L (Q's leading dims and n_q, fp32) from Q (..., n_q, d) and K, V
    (..., n_k, d). tma: the TMA kernel (the tensors must pass tma_usable)."""
    batch, n_q, n_k, d = _dims(q3, k3)

    def grid(meta):
        return (triton.cdiv(n_q, meta["BLOCK_M"]), batch)

    _launch(_pick(_flash_fwd_kernel, _flash_fwd_tma_kernel, tma), grid,
            (q3, k3, v3, o, lse, n_q, n_k, d ** -0.5 * LOG2E), _common(d, max(n_q, n_k), q3.dtype, is_causal),
            config)


def launch_dq(q3, k3, v3, o3, do3, lse, delta, dq, is_causal: bool, *, config: dict | None = None,
              meta: dict | None = None, tma: bool = False) -> None:
    """Fill dQ and D = rowsum(O * dO) (the dK/dV kernel's input), given L. ``meta``: ``_common``'s
    dict when the caller already has it."""
    batch, n_q, n_k, d = _dims(q3, k3)

    def grid(meta):
        return (triton.cdiv(n_q, meta["BLOCK_M2"]), batch)

    args = (q3, k3, v3, o3, do3, lse, delta, dq, n_q, n_k, d ** -0.5 * LOG2E, d ** -0.5)
    _launch(_pick(_flash_bwd_dq_kernel, _flash_bwd_dq_tma_kernel, tma), grid, args,
            meta or _common(d, max(n_q, n_k), q3.dtype, is_causal), config)


def launch_dkdv(q3, k3, v3, do3, lse, delta, dk, dv, is_causal: bool, *, config: dict | None = None,
                meta: dict | None = None, tma: bool = False) -> None:
    """Fill dK and dV, given L and D (written by launch_dq)."""
    batch, n_q, n_k, d = _dims(q3, k3)

    def grid(meta):
        return (triton.cdiv(n_k, meta["BLOCK_N1"]), batch)

    args = (q3, k3, v3, do3, lse, delta, dk, dv, n_q, n_k, d ** -0.5 * LOG2E, d ** -0.5)
    _launch(_pick(_flash_bwd_dkdv_kernel, _flash_bwd_dkdv_tma_kernel, tma), grid, args,
            meta or _common(d, max(n_q, n_k), q3.dtype, is_causal), config)


_PREP_ROWS = 64  # rows per program of the prep kernel: it is memory-bound, any tile that fills the GPU does


def launch_bwd_prep(o3, do3, delta, dq_acc) -> None:
    """Fill D = rowsum(O * dO) (..., n_q) and zero dq_acc (like O, fp32): the atomic kernel's inputs."""
    batch, n_q, _, d = _dims(o3, o3)
    _flash_bwd_prep_kernel[(triton.cdiv(n_q, _PREP_ROWS), batch)](
        o3, do3, delta, dq_acc, n_q, HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_P=_PREP_ROWS, num_warps=4)


def launch_atomic(q3, k3, v3, do3, lse, delta, dk, dv, dq_acc, is_causal: bool, *, config: dict | None = None,
                  meta: dict | None = None) -> None:
    """Fill dK and dV and add dS K (dQ before its sm_scale) into dq_acc, given L and D."""
    batch, n_q, n_k, d = _dims(q3, k3)

    def grid(meta):
        return (triton.cdiv(n_k, meta["BLOCK_N3"]), batch)

    args = (q3, k3, v3, do3, lse, delta, dk, dv, dq_acc, n_q, n_k, d ** -0.5 * LOG2E, d ** -0.5)
    _launch(_flash_bwd_atomic_kernel, grid, args, meta or _common(d, max(n_q, n_k), q3.dtype, is_causal), config)


def launch_backward_atomic(q3, k3, v3, o3, do3, lse, delta, dq_acc, dq, dk, dv, is_causal: bool, *,
                           config: dict | None = None, meta: dict | None = None) -> None:
    """The whole atomic backward: the prep kernel, the atomic kernel, then dQ = sm_scale * dq_acc
    written in dq's dtype (``dq`` may be ``dq_acc`` itself, for fp32 inputs)."""
    launch_bwd_prep(o3, do3, delta, dq_acc)
    launch_atomic(q3, k3, v3, do3, lse, delta, dk, dv, dq_acc, is_causal, config=config, meta=meta)
    torch.mul(dq_acc, q3.shape[-1] ** -0.5, out=dq)  # one elementwise kernel: scale and cast together


def flash_forward_triton(q3, k3, v3, is_causal: bool, *, variant: str = FORWARDS["triton"]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous Q (..., n_q, d), K, V (..., n_k, d) -> O (like Q), L (..., n_q) fp32. variant
    "pointer", "tma" (which runs the pointer kernel where tma_usable says no) or "auto" (tma for
    16-bit inputs above TMA_MIN_SEQ)."""
    if variant not in ("pointer", "tma", "auto"):
        raise ValueError(f"variant must be 'pointer', 'tma' or 'auto', got {variant!r}")
    _contiguous(q3, k3, v3)
    o = torch.empty_like(q3)
    lse = torch.empty(q3.shape[:-1], device=q3.device, dtype=torch.float32)
    launch_forward(q3, k3, v3, o, lse, is_causal, tma=_wants_tma(variant, q3, k3, v3))
    return o, lse


def flash_backward_triton(q3, k3, v3, o3, lse, do3, is_causal: bool, *, variant: str = BACKWARDS["triton"]):
    """dQ, dK, dV (like Q, K, V) from contiguous (..., seq, d) tensors and L (..., n_q). variant
    "split": the dQ kernel (which also writes D) then the dK/dV kernel; "split_tma": the same pair
    reading through TMA descriptors (the pointer pair where tma_usable says no); "split_auto":
    split_tma for 16-bit inputs above TMA_MIN_SEQ, split otherwise; "atomic": launch_backward_atomic."""
    if variant not in ("split", "split_tma", "split_auto", "atomic"):
        raise ValueError(f"variant must be 'split', 'split_tma', 'split_auto' or 'atomic', got {variant!r}")
    _contiguous(q3, k3, v3, o3, do3)
    delta = torch.empty_like(lse)
    dk, dv = torch.empty_like(k3), torch.empty_like(v3)
    meta = _common(q3.shape[-1], max(q3.shape[-2], k3.shape[-2]), q3.dtype, is_causal)  # one dict for every launch
    if variant == "atomic":
        dq_acc = torch.empty(q3.shape, device=q3.device, dtype=torch.float32)
        dq = dq_acc if q3.dtype == torch.float32 else torch.empty_like(q3)
        launch_backward_atomic(q3, k3, v3, o3, do3, lse, delta, dq_acc, dq, dk, dv, is_causal, meta=meta)
        return dq, dk, dv
    dq = torch.empty_like(q3)
    tma = _wants_tma(variant.removeprefix("split_"), q3, k3, v3, o3, do3)
    launch_dq(q3, k3, v3, o3, do3, lse, delta, dq, is_causal, meta=meta, tma=tma)
    launch_dkdv(q3, k3, v3, do3, lse, delta, dk, dv, is_causal, meta=meta, tma=tma)
    return dq, dk, dv


# ----------------------------------------------------------------------------- autograd.Function


class FlashAttentionTriton(torch.autograd.Function):
    """``FlashAttentionTriton.apply(q, k, v, is_causal=False, backward="triton", forward="triton")`` on
    (..., seq, d).

    Saves Q, K, V, O (contiguous, in the input's shape) and L of shape (..., n_queries). ``backward`` is a
    key of ``BACKWARDS``: "triton" (the default: the split pair, through TMA for 16-bit inputs above TMA_MIN_SEQ),
    "triton_split", "triton_atomic", "triton_tma", or "pytorch" (the torch.compile'd reference
    backward of ``flash_pytorch`` on the same saved tensors). ``forward`` is a key of ``FORWARDS``:
    "triton" (the default: TMA for 16-bit inputs above TMA_MIN_SEQ), "triton_pointer" or "triton_tma".

    No reshapes or views on the way: at short sequences the host's time per call, not the kernels',
    sets the speed, and a view of a custom Function's output costs autograd more than an allocation.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                backward: str = "triton", forward: str = "triton") -> torch.Tensor:
        _validate(q, k, v, is_causal)
        if backward not in BACKWARD_IMPLS:
            raise ValueError(f"backward must be one of {BACKWARD_IMPLS}, got {backward!r}")
        if forward not in FORWARD_IMPLS:
            raise ValueError(f"forward must be one of {FORWARD_IMPLS}, got {forward!r}")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # copies only what is strided
        o, lse = flash_forward_triton(q, k, v, bool(is_causal), variant=FORWARDS[forward])
        # L has the input's leading dims, (..., n_queries): the shape the handout's tests look for
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.backward_impl = bool(is_causal), backward
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.to(q.dtype).contiguous()
        impl = BACKWARDS[ctx.backward_impl]
        if impl == "pytorch":
            dq, dk, dv = backward_reference(q, k, v, o, lse, do, ctx.is_causal)
        else:
            dq, dk, dv = flash_backward_triton(q, k, v, o, lse, do, ctx.is_causal, variant=impl)
        return dq, dk, dv, None, None, None


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                           backward: str = "triton", forward: str = "triton") -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V with the Triton FlashAttention-2 kernels; inputs (..., seq, d).
    ``forward``/``backward``: keys of FORWARDS/BACKWARDS ("triton_tma" for the TMA kernels)."""
    return FlashAttentionTriton.apply(q, k, v, is_causal, backward, forward)
