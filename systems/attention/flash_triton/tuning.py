"""Which tiles the kernels run with: the config tables, their pruners, the autotuners around the jit
kernels of kernels.py, and the persisted store that spares a new process the autotuning its
predecessors did.

Tile sizes and warps are autotuned per (sequence-length bucket, head dim, causal, dtype): the
autotune key. A key's chosen config (its plan, launch.py) is persisted per (GPU name, Triton
version, source hash of the kernels and of these tables) in a JSON file under ``cache_dir()``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.testing

from systems.measure.devices import triton_interpreting
from systems.attention.flash_triton import kernels

# read once: TRITON_INTERPRET is fixed before triton is imported, and the config tables below
# are chosen from it at import anyway; the per-call checks then cost no environment lookup
INTERPRETING = triton_interpreting()


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


# ----------------------------------------------------------------------------- autotune configs


# The two tile sizes of each kernel, in the order the tables below give them: (rows, cols). For
# dK/dV the rows are the streamed query tile and the cols the resident key tile; for dQ the rows
# are the resident query tile. A *_tma kernel takes its pointer twin's names.
TILE_NAMES = {"fwd": ("BLOCK_M", "BLOCK_N"), "dkdv": ("BLOCK_M1", "BLOCK_N1"), "dq": ("BLOCK_M2", "BLOCK_N2"),
              "atomic": ("BLOCK_M3", "BLOCK_N3")}
# Options every config of a kernel carries unless told otherwise: a base name's entry holds for its
# *_tma twin too, which adds its own (the atomic entry below says why it defers; kernels.py's loops
# say what FMA_SOFTMAX, EARLY_DP and WS do). Notes entry 13 measured them on the H100 and H200:
# FMA_SOFTMAX took 1-4% off the TMA forward at three of four points (d = 64 and 128), so it is on;
# EARLY_DP and WS are on only in the configs below that measured faster with them.
OPTIONS = {"atomic": {"DEFER_DQ_ADD": True}, "fwd": {"FMA_SOFTMAX": True}, "dkdv": {"EARLY_DP": False},
           "dq": {"EARLY_DP": False}, "fwd_tma": {"WS": False}, "dkdv_tma": {"WS": False}, "dq_tma": {"WS": False}}


def kernel_options(kernel: str) -> dict:
    """The OPTIONS a config of ``kernel`` carries by default: its base name's, then its own."""
    return {**OPTIONS.get(kernel.removesuffix("_tma"), {}), **OPTIONS.get(kernel, {})}


def tile_config(kernel: str, rows: int, cols: int, *, warps: int, stages: int, **options) -> triton.Config:
    """One config of ``kernel``: its two tiles (TILE_NAMES), the kernel's options (kernel_options)
    overridden by ``options``, and its warps and pipeline stages."""
    base = kernel.removesuffix("_tma")
    if base not in TILE_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {sorted(TILE_NAMES)} (or their *_tma twins)")
    row_name, col_name = TILE_NAMES[base]
    return triton.Config({row_name: rows, col_name: cols, **kernel_options(kernel), **options}, num_warps=warps,
                         num_stages=stages)


def _table(tiles: dict[str, dict[str, list[tuple]]]) -> dict[str, dict[str, list[triton.Config]]]:
    """(rows, cols, num_warps, num_stages[, options]) per kernel and dtype family, as triton.Configs."""
    return {kernel: {family: [tile_config(kernel, m, n, warps=warps, stages=stages, **(extra or [{}])[0])
                              for m, n, warps, stages, *extra in table]
                     for family, table in families.items()}
            for kernel, families in tiles.items()}


def autotuning() -> bool:
    """False under the interpreter, or with FLASH_TRITON_AUTOTUNE=0 (one default config each:
    no benchmarking, few compiles; what quick GPU tests want)."""
    return not INTERPRETING and os.environ.get("FLASH_TRITON_AUTOTUNE", "1") != "0"


# With FLASH_TRITON_AUTOTUNE=0: one config per kernel and dtype family, which has no tuner to pass
# over a config that fails to launch, so each must fit every head dim up to 128 (BLOCK_D 128) within
# an H100's 227 KB of shared memory per block (tests/attention/test_flash_triton.py compiles each for
# sm_90 and reads its size). The atomic kernel's 32x64 tile needs 262,400 bytes in fp32 at BLOCK_D
# 128, twice _prune's estimate (which buffers Triton adds was not traced): fp32 takes 32x32 (131,328).
ONE_CONFIG_TILES = {"fwd": {"half": [(64, 64, 4, 2)], "fp32": []}, "dkdv": {"half": [(32, 64, 4, 2)], "fp32": []},
                    "dq": {"half": [(64, 32, 4, 2)], "fp32": []},
                    "atomic": {"half": [(32, 64, 4, 2)], "fp32": [(32, 32, 4, 2)]}}

# Per kernel: configs for 16-bit inputs and for fp32 inputs (fp32 tiles hold twice the bytes, so
# smaller tiles win and big ones spill or overflow shared memory). The lists are
# short on purpose: each config costs a compile per (head dim, dtype, causal). The 16-bit ones
# are the winners of systems.bench.flash_tuning's 8 candidates per kernel on an H100 (bf16, causal,
# seq 1k-64k x d 64/128 and the leaderboard shape; results/experiments/06_flash_attention_tuning.jsonl):
# 64-row tiles win up to 16k, 128-row query tiles (and 64x128 dK/dV tiles) at 64k with d=128.
# Under the interpreter there is one small config each: multi-config autotuning benchmarks
# on a GPU (it fails without a driver), and 16-row tiles exercise the tile loops at tiny sizes.
if INTERPRETING:
    CONFIGS = _table({"fwd": {"half": [(16, 16, 4, 1)], "fp32": []}, "dkdv": {"half": [(16, 32, 4, 1)], "fp32": []},
                      "dq": {"half": [(32, 16, 4, 1)], "fp32": []}, "atomic": {"half": [(16, 32, 4, 1)], "fp32": []}})
elif not autotuning():
    CONFIGS = _table(ONE_CONFIG_TILES)
else:
    CONFIGS = _table({
        # fp32 (tf32x3 dots by default): two searches of systems.bench.flash_tuning --dtype fp32 on an
        # H100, d = 128 at seq 2k-16k and d = 64 / 128 at 4k, d = 64 at 16k
        # (results/experiments/06_flash_fp32_tuning*.jsonl, notes entry 9). Small query tiles win: a
        # batch-1 head at 4k has too few 64-row tiles to fill 132 SMs. Each list holds the winners:
        # the forward's 32x64 (2 and 3 stages: d = 128 long, d = 64) and 16x64 (d = 128 at 4k: 0.19 ms
        # against the 64x32 it had, 0.69); dK/dV's 32x32 (d = 128 long), 64x32 over 8 warps (4k) and
        # over 4 (d = 64 at 16k); dQ's 16x64 (4k), 32x64 (d = 64 long) and 32x32 (d = 128 long).
        # 64x64 fp32 tiles run out of shared memory at d = 128.
        "fwd": {"half": [(64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4)],
                "fp32": [(32, 64, 4, 2), (32, 64, 4, 3), (16, 64, 4, 2)]},
        "dkdv": {"half": [(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3)],
                 "fp32": [(32, 32, 4, 2), (64, 32, 8, 2), (64, 32, 4, 2)]},
        "dq": {"half": [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)],
               "fp32": [(16, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2)]},
        # The atomic backward's key tile (BLOCK_N3) sets its atomic traffic: every key tile adds
        # n_q x d fp32 into dQ, so a head moves about n_q * n_k / 2 / BLOCK_N3 * d * 4 bytes of
        # atomics when causal. Hence no 16-bit config below 64 keys. On an H100 at the
        # leaderboard shape (notes entry 4) 64x128/8 warps and 64x64/4 warps led; 32-row query
        # tiles (whose dQ dot runs on mma.sync: wgmma needs 64 rows) ran 1.2-1.3x slower and
        # 128-row ones 1.3-2x; deferring the dQ add by one query tile took 3% and 7% off the
        # two leaders, so every config here defers it (OPTIONS).
        "atomic": {"half": [(64, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 4)], "fp32": [(32, 64, 4, 2), (32, 32, 4, 2)]},
        # The TMA kernels: the streamed tiles are copied into shared memory by the TMA engine instead
        # of by every thread's address arithmetic and loads, which leaves registers for larger tiles.
        # systems.bench.flash_tuning's search over 8 candidates each on an H100 (leaderboard shape, notes
        # entry 5, results/experiments/06_flash_tma_tuning.jsonl) found the larger ones slower: 128x128 over 8
        # warps lost by 9% (fwd), 12% (dK/dV) and 12% (dQ) to 64-row tiles with 4 warps. So each list
        # held two: the search's winner at the leaderboard shape, and the pointer kernel's 128-row
        # (or 128-key) tile that wins at 64k with d=128 (every config is one more compile per head
        # dim and dtype in notebook 06's sweep, which has to fit its time budget). The same search
        # at d = 128 ((16, 16384, 128) and (1, 65536, 128), notes entry 11,
        # results/experiments/06_flash_tma_d128_tuning.jsonl) added the forward's 128x128 over 8 warps
        # (7-8% faster there than the 128x64 before it) and dQ's 128x64 over 8 warps and 64x128 over 4
        # (12% and 6% faster than 64x64), in place of the 128x32 dQ tile, the slowest there.
        # Entry 13 added the forward's 128x128 over 8 warps with warp specialisation (8% faster than
        # without at (1, 65536, 128), even at (16, 16384, 128); it does not compile over 4 warps) and
        # put dQ's 128x64 over 8 warps on EARLY_DP (2-4% faster at d = 128, 1% at the leaderboard shape),
        # and dK/dV's 64x64 over 4 warps (1.5% faster at the leaderboard shape in two H100 runs, level on
        # an H200; at d = 128 it spills, 30% slower, where the autotuner keeps 64x128 over 8 warps).
        "fwd_tma": {"half": [(64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 3, {"WS": True})],
                    "fp32": [(64, 64, 4, 3), (64, 32, 4, 2)]},
        "dkdv_tma": {"half": [(64, 64, 4, 3, {"EARLY_DP": True}), (64, 128, 8, 3)],
                     "fp32": [(32, 64, 4, 2), (32, 32, 4, 2)]},
        "dq_tma": {"half": [(64, 64, 4, 3), (128, 64, 8, 3, {"EARLY_DP": True}), (64, 128, 4, 3)],
                   "fp32": [(64, 32, 4, 2), (32, 32, 4, 2)]},
    })

if not autotuning():  # one config each: the TMA kernels run their pointer twins' tiles, with their own options
    CONFIGS.update({f"{k}_tma": {family: [tile_config(f"{k}_tma", *(c.kwargs[name] for name in TILE_NAMES[k]),
                                                      warps=c.num_warps, stages=c.num_stages) for c in configs]
                                 for family, configs in CONFIGS[k].items()}
                    for k in ("fwd", "dkdv", "dq")})

# (kernel family, option) -> the widest head dim (BLOCK_D) a config with the option is tried at.
# dK/dV's EARLY_DP holds dP^T beside S^T: at d = 128 its 64x64/4 tile spilled and ran 30% slower
# (notes entry 13). A key is tuned on its first call, and a bucket spans shapes from one
# (batch, head) of 4k to sixteen of 16k, so a small first call could otherwise pick it for them
# all: the first H100 run with it in the table picked it at d = 128 and the backward at
# (16, 16384, 128) took 8.8 ms instead of 6.4.
_OPTION_MAX_BLOCK_D = {("dkdv", "EARLY_DP"): 64}

# kernels_gluon.py's kernels run with fixed tiles, not tuned, at the head dims where each measured
# faster than its Triton twin on the H100; at a head dim missing here the Triton kernel runs.
# dK/dV (notes entry 16): one warpgroup over 64 keys, 64 queries a step, Q and dO double-buffered
# (its 255 registers allow no wider tile without spilling); three stages and 128 keys over two
# warpgroups measured slower at (16, 16384, 64), and at d = 128 it spills. dQ (entry 17): 64x64
# tiles over one warpgroup, K and V double-buffered: at d = 128 0.97x and 0.95x the Triton kernel
# (16 x 16384 and 1 x 65536) in a first probe, 1.01x and 0.96x in a second; 1.04-1.13x at d = 64,
# where the Triton kernel keeps running. The atomic backward's kernel (entries 18, 23 and 24: the
# dK/dV loop plus dS K, added per query tile by a TMA reduce), warp-specialised: 64 queries a step
# over 128 keys, two consumer warpgroups at 240 registers, Q and dO double-buffered; at d = 128
# 0.79-0.80x the split pair's time at 16k-64k tokens and 0.69x at 16 x 4096; at d = 64 0.95x at
# 16k-64k. Entry 18's one-partition form was level with the pair at d = 64 and spilled at d = 128.
# At d = 64 its two consumers as two partitions that take turns with dQ's product (entry 26,
# atomic_pp) ran 0.96-0.99x its time, and 0.90-0.93x that with every product's A operand in
# registers (entry 27: K, V, and K^T for dQ's part computed transposed). The forward (entry 25):
# 128 query rows over two consumer warpgroups taking turns, 128-key tiles through a three-slot
# ring; at d = 128 0.82-0.86x the Triton TMA forward's time at 16k-64k tokens (64-key tiles
# 0.92-0.93x); at d = 64 192 rows over three consumers, 0.95-0.96x the 128-row form (two slots
# lose at both; Q in registers gained nothing at 128 rows, entry 27).
GLUON_TILES: dict[str, dict[int, dict[str, int]]] = {
    "dkdv": {64: dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4)},
    "dq": {128: dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, num_warps=4)},
    # two consumer warpgroups over 128 keys (num_warps), two worker warps besides; 214 KB of shared
    # memory
    "atomic_ws": {128: dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, num_warps=8)},
    # num_warps: consumer 0 (consumer 1 and the two worker warps are worker partitions); 146 KB of
    # shared memory. 0.96-0.99x atomic_ws's time at d = 64 (three slots; two 0.97-0.99x; notes entry
    # 26), then 0.90-0.93x that with its A operands in registers (entry 27)
    "atomic_pp": {64: dict(BLOCK_M=64, BLOCK_N=128, STAGES=3, num_warps=4)},
    # num_warps: consumer 0 (the other consumers and the loader are worker partitions); 224 KB of
    # shared memory at d = 128; 120 KB at d = 64, where 192 query rows over three consumer warpgroups
    # ran 0.95-0.96x the time of 128 over two (flash notes entry 25)
    "fwd_ws": {64: dict(BLOCK_M=192, BLOCK_N=128, STAGES=3, num_warps=4),
               128: dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, num_warps=4)},
}

# bytes of tiles a config may hold (_prune's estimate: the resident tiles, and the streamed ones
# once per stage). An H100 block may use 227 KB; the TMA forward's 128x128/8/3 tile at d = 128
# estimates 224 KB and runs (Triton adds about 1 KB of barriers), and it is that head dim's fastest
# forward by 9-10%, as dQ's 64x128/4/3 (224 KB) is among its dQ tiles (notes entries 11 and 19). A
# budget of 200 KB pruned both from every d = 128 tuning until entry 19. A config past the real
# limit fails to launch while tuning and the autotuner passes it over (OutOfResources).
_SMEM_BUDGET = 226 * 1024
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
    family = CONFIGS[kernel]["fp32" if fp32 else "half"] or CONFIGS[kernel]["half"]
    kept = []
    base = kernel.removesuffix("_tma")
    for c in configs:
        if not any(c is f for f in family):
            continue
        if any(c.kwargs.get(option) and meta["BLOCK_D"] > limit
               for (family_name, option), limit in _OPTION_MAX_BLOCK_D.items() if family_name == base):
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


TUNE_KEY = ["SEQ_BUCKET", "HEAD_DIM", "IS_CAUSAL", "INPUT_PRECISION"]


def _tune_bench(fn, quantiles=None, **_):
    # shorter than Triton's default 25 ms warm-up + 100 ms per config: a sweep meets many keys
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _autotune(configs, prune, restore_value=None):
    """restore_value: outputs the kernel accumulates into (atomics), which the autotuner copies
    before each benchmark run and puts back after it, so the real run adds to what it was given."""
    try:
        return triton.autotune(configs=configs, key=TUNE_KEY, do_bench=_tune_bench, restore_value=restore_value,
                               prune_configs_by={"early_config_prune": prune})
    except TypeError:  # a Triton without the do_bench hook: its default timing
        return triton.autotune(configs=configs, key=TUNE_KEY, restore_value=restore_value,
                               prune_configs_by={"early_config_prune": prune})


def config_meta(config: triton.Config) -> dict:
    """A config as the jit kernel takes it: its tiles and options, num_warps, num_stages (the
    tables above set nothing else)."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


@dataclass(frozen=True)
class TunedKernel:
    """One kernel under its name in CONFIGS, by which plans are cached and persisted: the jit
    function, launched with a known config, and the autotuner around it, launched on a key's
    first call."""
    name: str
    jit: triton.JITFunction
    autotuner: triton.runtime.Autotuner


def _tuned(name: str, jit, prune=None, restore_value=None) -> TunedKernel:
    configs = CONFIGS[name]["half"] + CONFIGS[name]["fp32"]
    return TunedKernel(name, jit, _autotune(configs, prune or _pruner(name), restore_value)(jit))


TUNED: dict[str, TunedKernel] = {t.name: t for t in (
    _tuned("fwd", kernels.flash_fwd_kernel),
    _tuned("fwd_tma", kernels.flash_fwd_tma_kernel),
    _tuned("dkdv", kernels.flash_bwd_dkdv_kernel),
    _tuned("dkdv_tma", kernels.flash_bwd_dkdv_tma_kernel),
    _tuned("dq", kernels.flash_bwd_dq_kernel),
    _tuned("dq_tma", kernels.flash_bwd_dq_tma_kernel),
    _tuned("atomic", kernels.flash_bwd_atomic_kernel, _prune_atomic, restore_value=["DQ_ACC"]),
)}


# ----------------------------------------------------------------------------- persisted plans

CACHE_ENV = "FLASH_TRITON_CACHE_DIR"
_STORE_FORMAT = 1


def cache_dir() -> Path | None:
    """Where tuned plans persist: $FLASH_TRITON_CACHE_DIR, else $XDG_CACHE_HOME/systems/flash_triton
    (~/.cache/... without XDG_CACHE_HOME). None, so that nothing is read or written, under the
    interpreter, inside a pytest run and with autotuning off, unless $FLASH_TRITON_CACHE_DIR is
    set: tests and quick runs leave the user's cache alone."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    if INTERPRETING or "PYTEST_CURRENT_TEST" in os.environ or not autotuning():
        return None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "systems" / "flash_triton"


def source_hash(kernel_source: str, configs: dict) -> str:
    """sha256 of the kernels' source, of the config lists the autotuners choose from and of the
    pruner's shared-memory budget: a plan tuned before any of them changed is not reused."""
    digest = hashlib.sha256(kernel_source.encode())
    digest.update(repr(_SMEM_BUDGET).encode())  # which configs the pruner lets the autotuner try
    for name in sorted(configs):
        for family in ("half", "fp32"):
            digest.update(repr([(name, family, config_meta(c)) for c in configs[name][family]]).encode())
    return digest.hexdigest()


@functools.cache  # read from disk at the first lookup, never at import
def current_source_hash() -> str:
    return source_hash(inspect.getsource(kernels), CONFIGS)


@dataclass(frozen=True)
class StoreKey:
    """What a persisted plan is valid for."""
    gpu: str  # torch.cuda.get_device_name, or the device type where the interpreter runs
    triton: str  # triton.__version__
    source: str  # source_hash

    def file_name(self) -> str:
        digest = hashlib.sha256("\0".join((self.gpu, self.triton, self.source)).encode()).hexdigest()
        return f"plans-{digest[:16]}.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_entry(entry) -> tuple[tuple, dict]:
    """(kernel, dtype name, *autotune key) and config of one persisted plan; ValueError unless the
    config is one the kernel's autotuner could have chosen for that dtype and key."""
    kernel, dtype, tune_key, config = entry["kernel"], entry["dtype"], tuple(entry["tune_key"]), entry["config"]
    if kernel not in CONFIGS or dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unknown kernel or dtype in {entry}")
    if [type(x) for x in tune_key] != [int, int, bool, str]:  # SEQ_BUCKET, HEAD_DIM, IS_CAUSAL, INPUT_PRECISION
        raise ValueError(f"malformed autotune key in {entry}")
    if config not in [config_meta(c) for c in CONFIGS[kernel]["half"] + CONFIGS[kernel]["fp32"]]:
        raise ValueError(f"a config the autotuner does not list in {entry}")
    return (kernel, dtype, *tune_key), config


class PlanStore:
    """The persisted plans of one StoreKey, one JSON file in ``directory``: read at the first
    lookup, rewritten after each new plan (merged with what another process wrote meanwhile).
    A corrupt or foreign file, or one that cannot be written, costs a warning, never an error."""

    def __init__(self, directory: Path, key: StoreKey):
        self.key = key
        self.path = Path(directory) / key.file_name()
        self._plans: dict | None = None
        self._writable = True

    def get(self, kernel: str, dtype: torch.dtype, tune_key: tuple) -> dict | None:
        if self._plans is None:
            self._plans = self._read()
        return self._plans.get((kernel, _dtype_name(dtype), *tune_key))

    def put(self, kernel: str, dtype: torch.dtype, tune_key: tuple, config: dict) -> None:
        plans = self._read(quiet=True)  # what other processes added since this one read the file
        plans.update(self._plans or {})
        plans[(kernel, _dtype_name(dtype), *tune_key)] = dict(config)
        self._plans = plans
        if self._writable:
            self._write()

    def _read(self, quiet: bool = False) -> dict:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("format") != _STORE_FORMAT:
                raise ValueError(f"not a plan file of format {_STORE_FORMAT}")
            written_for = StoreKey(**{name: data.get(name) for name in ("gpu", "triton", "source")})
            if written_for != self.key:
                raise ValueError(f"written for {written_for}, not for {self.key}")
            return dict(_check_entry(entry) for entry in data["plans"])
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            if not quiet:
                warnings.warn(f"ignoring the flash-attention plan cache {self.path}: {exc}", stacklevel=2)
            return {}

    def _write(self) -> None:
        data = dict(format=_STORE_FORMAT, gpu=self.key.gpu, triton=self.key.triton, source=self.key.source,
                    plans=[dict(kernel=kernel, dtype=dtype, tune_key=list(tune_key), config=config)
                           for (kernel, dtype, *tune_key), config in sorted(self._plans.items(), key=repr)])
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, self.path)  # readers see the old file or the new one, never a half
        except OSError as exc:
            self._writable = False
            warnings.warn(f"cannot write the flash-attention plan cache {self.path} ({exc}); "
                          "plans tuned from now on are kept in this process only", stacklevel=2)


_STORES: dict[tuple[Path, StoreKey], PlanStore] = {}


def plan_store(device: torch.device) -> PlanStore | None:
    """The persisted plans for ``device``'s GPU under this Triton and these kernels, or None
    where cache_dir() says nothing persists."""
    directory = cache_dir()
    if directory is None:
        return None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = StoreKey(gpu=gpu, triton=triton.__version__, source=current_source_hash())
    store = _STORES.get((directory, key))
    if store is None:
        store = _STORES[(directory, key)] = PlanStore(directory, key)
    return store
