"""Launching the kernels: the variant choice (FlashVariant), the plan cache, the direct launch of
compiled kernels and its fallback, the launchers, and the forward and backward passes.

The direct launch: after a key's first call, each argument specialisation's first call goes
through Triton's jit dispatch, which returns the compiled kernel it launched; every later call
launches that compiled kernel directly. Triton's per-call dispatch (the autotuner's, then the
jit's: binding, specialising and hashing every argument) cost more host time than a short
sequence's kernel takes on the GPU (docs/flash_attention_notes.md, entry 6). It reads Triton
internals, so it runs only with the torch and Triton versions pyproject.toml's
[tool.systems.gpu-tested] names (it was run on an H100 with those); elsewhere every launch goes
through the public ``kernel[grid](...)``. ``launch_path()`` says which, decided once.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, get_args

import torch
import triton

from systems.attention.flash_pytorch import backward_reference
from systems.attention.flash_triton import kernels
from systems.attention.flash_triton.tuning import (
    GLUON_TILES,
    INTERPRETING,
    TUNE_KEY,
    TUNED,
    TunedKernel,
    config_meta,
    plan_store,
    seq_bucket,
)
from systems.config import check_choice

# ----------------------------------------------------------------------------- variants

Forward = Literal["auto", "pointer", "tma"]
Backward = Literal["auto", "split", "tma", "gluon", "atomic", "pytorch"]
Fp32Dot = Literal["auto", "ieee", "tf32x3", "tf32"]
LaunchOrder = Literal["auto", "per_head"]
FORWARDS: tuple[str, ...] = get_args(Forward)
BACKWARDS: tuple[str, ...] = get_args(Backward)
FP32_DOTS: tuple[str, ...] = get_args(Fp32Dot)
LAUNCH_ORDERS: tuple[str, ...] = get_args(LaunchOrder)
# Longest sequence (max of queries, keys) the "auto" variants still run on the pointer kernels. On
# the H100 the TMA kernels were faster at 16k and 64k (d 64 and 128) but slower at 4k, d 64 (bare
# launches: fwd 0.048 against 0.037 ms, backward 0.127 against 0.094): building descriptors costs
# each program a fixed amount that a short key loop does not earn back. 4096 is that measured point.
TMA_MIN_SEQ = 4096
# kernels_gluon.py's kernels of the atomic backward (launch_atomic's ``gluon`` names one), each at
# its own head dims (tuning.GLUON_TILES)
_ATOMIC_GLUON_KERNELS = ("atomic_pp", "atomic_ws")


@dataclass(frozen=True)
class FlashVariant:
    """Which kernels run, and how they multiply fp32 inputs. The default, "auto" for all four, is
    what measured fastest on the H100 (docs/flash_attention_notes.md: entries 4 and 5 for 16-bit
    inputs, entry 7 for fp32's tf32x3 dots); every other choice stays selectable so they can be
    timed side by side.

    forward: "pointer" (tiles loaded through pointers), "tma" (the streamed tiles read through TMA
    tensor descriptors; the pointer kernel where tma_usable says no), or "auto" (for 16-bit inputs
    longer than TMA_MIN_SEQ kernels_gluon.py's warp-specialised forward where ``forward_gluon`` says
    it runs (d = 64 and 128 on Hopper), else tma; pointer otherwise).
    backward: "split" (a dQ kernel, then a dK/dV kernel, through pointers), "tma" (the same pair
    through descriptors, as forward "tma"), "gluon" (as "tma", with each kernel of kernels_gluon.py
    where ``gluon_usable`` says it runs), "atomic" (five products in one kernel over key tiles,
    adding dQ across them: kernels_gluon.py's warp-specialised one, with TMA reduce-adds, where
    ``atomic_gluon`` names it, else Triton's with atomics), "auto" (where forward "auto" would read
    descriptors, the atomic backward's Gluon kernel where it runs (d = 64 and 128 on Hopper), else the pair
    through descriptors with the Gluon kernels where usable; the pointer pair elsewhere), or
    "pytorch" (flash_pytorch's compiled reference backward on the same saved tensors).
    fp32_dot: how the kernels' dots multiply fp32 inputs (16-bit inputs always run their own
    tensor-core dots): "ieee" (fp32 products on the CUDA cores), "tf32x3" (each operand split into
    a TF32 high and low part, three TF32 tensor-core products: near-fp32 accuracy), "tf32" (one
    TF32 product: 10 mantissa bits), or "auto" ("tf32" where torch.backends.cuda.matmul.allow_tf32
    is on, else "tf32x3"; "ieee" under the interpreter and before sm_80: ``dot_precision``).
    launch_order: the order the forward and split-backward programs start in (kernels._program_tile):
    "auto" (longest tile first over groups of heads, head_group's rule) or "per_head" (longest
    first within each head, one head after another: the order before groups, notes entry 14).
    """
    forward: Forward = "auto"
    backward: Backward = "auto"
    fp32_dot: Fp32Dot = "auto"
    launch_order: LaunchOrder = "auto"

    def __post_init__(self):
        check_choice("FlashVariant forward", self.forward, FORWARDS)
        check_choice("FlashVariant backward", self.backward, BACKWARDS)
        check_choice("FlashVariant fp32_dot", self.fp32_dot, FP32_DOTS)
        check_choice("FlashVariant launch_order", self.launch_order, LAUNCH_ORDERS)

    @property
    def head_group(self) -> int | None:
        """The launchers' head_group: None (the rule's) for "auto", 1 for "per_head"."""
        return 1 if self.launch_order == "per_head" else None

    def forward_tma(self, *tensors: torch.Tensor) -> bool:
        """Whether the forward reads these (..., seq, d) tensors through TMA descriptors."""
        return _wants_tma(self.forward, tensors)

    def forward_gluon(self, *tensors: torch.Tensor) -> bool:
        """Whether the forward on these tensors is kernels_gluon.py's warp-specialised one: for "auto"
        wherever it would read descriptors and the kernel is usable (on the H100 0.82-0.86x the
        Triton TMA forward's time at d = 128 and 16k-64k tokens, 0.86-0.96x at d = 64; notes entries 25
        and 26)."""
        return self.forward == "auto" and self.forward_tma(*tensors) and gluon_usable("fwd_ws", *tensors)

    def backward_tma(self, *tensors: torch.Tensor) -> bool:
        """Whether the split backward reads these tensors through TMA descriptors."""
        choice = "tma" if self.backward == "gluon" else self.backward
        return choice in ("auto", "tma") and _wants_tma(choice, tensors)

    def atomic_gluon(self, *tensors: torch.Tensor) -> str | None:
        """The kernels_gluon.py kernel the five-product (atomic) backward runs on these tensors, or
        None. A warp-specialised kernel, "atomic_pp" (d = 64) or "atomic_ws" (d = 128), wherever
        gluon_usable allows it: for "atomic" wherever TMA is usable, else None (Triton's atomic
        kernel); for "auto" wherever the split pair would read descriptors, where it replaces the
        pair (on the H100 0.69-0.80x its time at d = 128, notes entry 23; 0.95x at d = 64, entry
        24, then 0.96-0.99x that, entry 26, and 0.90-0.93x that with register A operands, entry
        27); else None."""
        if self.backward == "atomic":  # it reads Q, K, V, dO and adds into dQ through TMA descriptors
            wanted = tma_usable(*tensors)
        else:
            wanted = self.backward == "auto" and self.backward_tma(*tensors)
        return next((kernel for kernel in _ATOMIC_GLUON_KERNELS if wanted and gluon_usable(kernel, *tensors)), None)

    def runs_atomic(self, *tensors: torch.Tensor) -> bool:
        """Whether the backward on these tensors is the five-product one (launch_backward_atomic)."""
        return self.backward == "atomic" or self.atomic_gluon(*tensors) is not None

    def backward_gluon(self, kernel: str, *tensors: torch.Tensor) -> bool:
        """Whether the backward runs kernels_gluon.py's ``kernel`` on these tensors: "dq" or "dkdv" of
        the split pair, or the atomic backward's "atomic_pp" or "atomic_ws"."""
        if kernel in _ATOMIC_GLUON_KERNELS:
            return self.atomic_gluon(*tensors) == kernel
        return (self.backward in ("auto", "gluon") and self.backward_tma(*tensors) and gluon_usable(kernel, *tensors)
                and not self.runs_atomic(*tensors))


DEFAULT_VARIANT = FlashVariant()


def _check_variant(variant) -> None:
    if not isinstance(variant, FlashVariant):
        raise ValueError(f"variant must be a FlashVariant(forward=..., backward=...), got {variant!r}")


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether the TMA kernels can read these (batch, seq, d) contiguous tensors: a descriptor's base
    must be 16-byte aligned and its row stride a multiple of 16 bytes (so d * element size must be,
    which holds for every d that is a multiple of 8), and the TMA engine exists from Hopper on.
    Where it does not hold, the TMA variants run the pointer kernels instead."""
    for t in tensors:
        # (with d * element size a multiple of 16, every (batch, head)'s base stays aligned too)
        if t.data_ptr() % 16 or (t.shape[-1] * t.element_size()) % 16:
            return False
    if INTERPRETING:
        return True
    return all(t.is_cuda for t in tensors) and _major_capability(tensors[0].device.index) >= 9


@functools.cache  # asked once per device: every call needs it
def _major_capability(index) -> int:
    return torch.cuda.get_device_capability(index)[0]


def auto_prefers_tma(longest: int, dtype: torch.dtype) -> bool:
    """Whether "auto" picks the TMA kernels for inputs whose longest sequence is ``longest``: where
    TMA was measured faster, 16-bit inputs (fp32 was not measured) longer than TMA_MIN_SEQ."""
    return longest > TMA_MIN_SEQ and dtype != torch.float32


def _wants_tma(choice: str, tensors: tuple[torch.Tensor, ...]) -> bool:
    if choice == "auto":
        choice = "tma" if auto_prefers_tma(max(t.shape[-2] for t in tensors), tensors[0].dtype) else "pointer"
    return choice == "tma" and tma_usable(*tensors)


def gluon_allowed(*, kernel: str, interpreting: bool, triton_version: str, tested: dict[str, str] | None,
                  capability: tuple[int, int], head_dim: int, dtype: torch.dtype) -> bool:
    """The decision behind gluon_usable: kernels_gluon.py's ``kernel`` (a key of GLUON_TILES) is compiled
    by the GPU-tested Triton only (its Gluon API changes between releases), for Hopper's wgmma (sm_90
    exactly), on 16-bit inputs at the head dims where it measured faster (tuning.GLUON_TILES)."""
    return (not interpreting and capability[0] == 9 and head_dim in GLUON_TILES[kernel]
            and dtype in (torch.float16, torch.bfloat16) and bool(tested) and "triton" in tested
            and version_in_range(triton_version, tested["triton"]))


def gluon_usable(kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether kernels_gluon.py's ``kernel`` runs on these (..., seq, d) CUDA tensors (gluon_allowed),
    given that the TMA kernels do (tma_usable)."""
    q = tensors[0]
    if INTERPRETING or not q.is_cuda:
        return False
    return _gluon_allowed_on(kernel, q.device.index, q.shape[-1], q.dtype)


@functools.cache  # on every backward's host path
def _gluon_allowed_on(kernel: str, device_index: int, head_dim: int, dtype: torch.dtype) -> bool:
    return gluon_allowed(kernel=kernel, interpreting=INTERPRETING, triton_version=triton.__version__,
                         tested=gpu_tested_versions(), capability=torch.cuda.get_device_capability(device_index),
                         head_dim=head_dim, dtype=dtype)


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # where the kernels write the descriptors they build (128 bytes each per program); torch's
    # caching allocator hands back the same block launch after launch
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_tma_allocator() -> None:
    """Give Triton an allocator for device-side descriptors unless this thread has one.

    Checked at every TMA launch, not once: Triton keeps the allocator in a ContextVar, which every
    thread starts without, and autograd runs the backward on a thread of its own. Never at import:
    importing this package must not change Triton's global state."""
    from triton.runtime import _allocation  # cached after the first call: a dict lookup

    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_tma_scratch)


# ----------------------------------------------------------------------------- launch path

DIRECT_ENV = "FLASH_TRITON_DIRECT_LAUNCH"


@dataclass(frozen=True)
class LaunchPath:
    """direct: compiled kernels launched directly after their first call; otherwise every launch
    goes through the public kernel[grid](...). reason: why, in words."""
    direct: bool
    reason: str


def gpu_tested_versions(pyproject: Path | None = None) -> dict[str, str] | None:
    """The repository's pyproject.toml's [tool.systems.gpu-tested]: package -> version range
    (">=3.6,<3.7"), or None where the file or the table is missing (an installed copy without the
    repository's pyproject.toml)."""
    pyproject = pyproject or Path(__file__).resolve().parents[3] / "pyproject.toml"
    try:
        with open(pyproject, "rb") as f:
            return tomllib.load(f).get("tool", {}).get("systems", {}).get("gpu-tested")
    except (OSError, tomllib.TOMLDecodeError):
        return None


def _release(version: str) -> tuple[int, ...]:
    # the leading release numbers: (2, 11, 0) of "2.11.0+cu130", (3, 7, 0) of "3.7.0rc1"
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", version).group()))


def version_in_range(version: str, spec: str) -> bool:
    """Whether ``version`` meets every comma-separated clause of ``spec``, each ">=X" or "<Y"."""
    v = _release(version)
    for clause in (c.strip() for c in spec.split(",")):
        if clause.startswith(">="):
            ok = v >= _release(clause[2:])
        elif clause.startswith("<"):
            ok = v < _release(clause[1:])
        else:
            raise ValueError(f"a gpu-tested version clause is '>=X' or '<Y', got {clause!r}")
        if not ok:
            return False
    return True


def choose_launch_path(*, interpreting: bool, force: str | None, versions: dict[str, str],
                       tested: dict[str, str] | None, missing: list[str]) -> LaunchPath:
    """The decision behind launch_path(). force: $FLASH_TRITON_DIRECT_LAUNCH ("1" takes the direct
    launch outside the tested versions, "0" never takes it); missing: the Triton internals the
    direct launch reads that this Triton lacks (then it is never taken)."""
    if force not in (None, "", "0", "1"):
        raise ValueError(f"{DIRECT_ENV} must be 0, 1 or unset, got {force!r}")
    if interpreting:
        return LaunchPath(False, "the Triton interpreter compiles no kernel to launch")
    if force == "0":
        return LaunchPath(False, f"{DIRECT_ENV}=0")
    if missing:
        return LaunchPath(False, f"this Triton lacks what the direct launch reads: {', '.join(missing)}")
    if force == "1":
        return LaunchPath(True, f"{DIRECT_ENV}=1")
    if not tested:
        return LaunchPath(False, "pyproject.toml names no [tool.systems.gpu-tested] versions")
    outside = [f"{name} {versions.get(name)} (tested: {spec})" for name, spec in tested.items()
               if versions.get(name) is None or not version_in_range(versions[name], spec)]
    if outside:
        return LaunchPath(False, f"outside the GPU-tested versions: {'; '.join(outside)} ({DIRECT_ENV}=1 forces "
                                 "the direct launch)")
    return LaunchPath(True, "inside the GPU-tested versions: " + ", ".join(f"{n} {versions[n]}" for n in tested))


@functools.cache
def _compiled_kernel_class() -> type:
    from triton.compiler import CompiledKernel

    return CompiledKernel


def missing_internals() -> list[str]:
    """What the direct launch reads beyond Triton's public API, where this Triton lacks it: the
    CompiledKernel the jit launch returns, launched as compiled[grid](*arguments), and each jit
    kernel's arg_names (the order in which the launch appends the plan's parameters)."""
    missing = []
    try:
        if not callable(getattr(_compiled_kernel_class(), "__getitem__", None)):
            missing.append("CompiledKernel[grid]")
    except ImportError:
        missing.append("triton.compiler.CompiledKernel")
    for kernel in TUNED.values():
        fn = getattr(kernel.jit, "fn", None)
        if fn is None or list(getattr(kernel.jit, "arg_names", ())) != list(inspect.signature(fn).parameters):
            missing.append(f"{kernel.name}'s arg_names")
    return missing


@functools.cache  # decided at the first launch, for good
def launch_path() -> LaunchPath:
    """Whether this process launches compiled kernels directly (see the module's docstring)."""
    force = os.environ.get(DIRECT_ENV)
    path = choose_launch_path(interpreting=INTERPRETING, force=force,
                              versions={"torch": torch.__version__, "triton": triton.__version__},
                              tested=gpu_tested_versions(), missing=[] if INTERPRETING else missing_internals())
    if not path.direct and not INTERPRETING and force != "0":
        warnings.warn(f"flash attention launches its kernels through Triton's dispatch, which costs host time "
                      f"per call: {path.reason}", stacklevel=2)
    return path


# ----------------------------------------------------------------------------- plans


@dataclass
class _Plan:
    """What one (kernel, dtype, autotune key) runs with, and the kernels compiled for it."""
    config: dict  # the chosen tiles, num_warps and num_stages
    kwargs: dict  # the autotune key's meta-parameters and the config: what the jit launch takes
    origin: str  # "tuned" by this process's autotuner, or "stored" in the persisted plans
    tail: tuple | None  # the direct launch's parameters after the runtime arguments (SEQ_BUCKET,
    # constexprs), in order; None where every launch goes through kernel[grid](...)
    compiled: dict = field(default_factory=dict)  # specialisation(args) -> Triton's CompiledKernel


# (kernel name, dtype, autotune key) -> its _Plan. The first call of a key takes the persisted plan
# or autotunes; later calls launch the jit kernel with the plan's config, or directly (above).
_PLANS: dict[tuple, _Plan] = {}


def tuned_plans() -> list[dict]:
    """One row per (kernel, dtype, autotune key) launched so far in this process: the kernel (its
    name in tuning.CONFIGS), dtype, the autotune key, the chosen config, its origin ("tuned" by
    this process, or "stored" by an earlier one) and how many compiled kernels the direct launch
    holds for it (one per argument specialisation)."""
    return [dict(kernel=name, dtype=str(dtype), **dict(zip(TUNE_KEY, tune_key)), **plan.config,
                 origin=plan.origin, compiled=len(plan.compiled))
            for (name, dtype, *tune_key), plan in _PLANS.items()]


def clear_tuned_plans() -> None:
    """Forget this process's plans and the recipes bound to their kernels (the persisted plans
    stay): each key's next call starts over."""
    _PLANS.clear()
    _RECIPES.clear()


def specialisation(args: tuple) -> tuple:
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


def _new_plan(kernel: TunedKernel, n_args: int, meta: dict, config: dict, origin: str) -> _Plan:
    kwargs = {**meta, **config}
    tail = tuple(kwargs[name] for name in kernel.jit.arg_names[n_args:]) if launch_path().direct else None
    return _Plan(config, kwargs, origin, tail)


def _first_plan(kernel: TunedKernel, key: tuple, grid, args: tuple, meta: dict) -> _Plan | None:
    """A key's first call in this process: the persisted plan, returned for the caller to launch,
    or else the autotuner's choice, which it has launched itself (None)."""
    store = plan_store(args[0].device)
    stored = store.get(kernel.name, args[0].dtype, key[2:]) if store is not None else None
    if stored is not None:  # launched with this config by the caller: no benchmarking
        plan = _PLANS[key] = _new_plan(kernel, len(args), meta, stored, "stored")
        return plan
    kernel.autotuner[grid](*args, **meta)  # autotunes on the first call of a key
    best = getattr(kernel.autotuner, "best_config", None)
    if best is not None:
        config = config_meta(best)
        _PLANS[key] = _new_plan(kernel, len(args), meta, config, "tuned")
        if store is not None:
            store.put(kernel.name, args[0].dtype, key[2:], config)
    return None


def _launch(kernel: TunedKernel, grid, args: tuple, meta: dict, config: dict | None) -> Callable | None:
    """The kernel under its plan, or with ``config`` (its tile sizes, num_warps and num_stages) the
    jit kernel under it, bypassing plans and autotuner (what systems.bench.flash_tuning measures
    candidates with). Returns, where the launch was direct, the same launch bound to everything
    but its leading tensor arguments (``_bound``: what a call recipe replays), else None."""
    if config is not None:
        kernel.jit[grid](*args, **meta, **config)
        return None
    key = (kernel.name, args[0].dtype, *(meta[k] for k in TUNE_KEY))  # the autotuner's own key
    plan = _PLANS.get(key)
    if plan is None:
        plan = _first_plan(kernel, key, grid, args, meta)
        if plan is None:
            return None
    if plan.tail is None:
        kernel.jit[grid](*args, **plan.kwargs)
        return None
    spec = specialisation(args)
    compiled = plan.compiled.get(spec)
    if compiled is None:
        compiled = kernel.jit[grid](*args, **plan.kwargs)
        if isinstance(compiled, _compiled_kernel_class()):
            plan.compiled[spec] = compiled
        return None
    g = grid(plan.kwargs)
    run = compiled[(g[0], g[1], 1)]
    run(*args, *plan.tail)
    return _bound(run, args, plan.tail)


def _bound(run: Callable, args: tuple, tail: tuple) -> Callable:
    """``run`` (a compiled kernel at its grid) as a function of the launch's leading tensors: the
    arguments after them (lengths, head group, scales) and the plan's tail stay as in ``args``."""
    n_tensors = next((i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
    rest = (*args[n_tensors:], *tail)
    return lambda *tensors: run(*tensors, *rest)


# ----------------------------------------------------------------------------- call recipes

# A pass's launches as bound at its first direct call for a recipe key: what later calls with that
# key replay, after allocating their outputs, without choosing kernels, looking up plans or
# specialising arguments again (at (1, 4096, 128) that choosing cost about 45 of the backward's 124
# us of host time on the H100: notes entry 20). Keyed by everything those choices read; the compiled
# kernels' own specialisation (dtypes, devices, 16-byte alignment, the lengths) is a function of it,
# as the outputs are fresh allocations (aligned).
_RECIPES: dict[tuple, tuple[bool, tuple[Callable, ...]]] = {}
_MAX_RECIPES = 4096  # a process calling ever new shapes starts over rather than grow without bound


def recipe_key(pass_name: str, variant: FlashVariant, is_causal: bool, *tensors: torch.Tensor) -> tuple:
    """The call recipe a pass ("fwd" or "bwd") over ``tensors`` (Q and K first) replays: its
    variant, causality, shapes, dtype, device, each tensor's 16-byte alignment and, for fp32 inputs
    under fp32_dot "auto", torch's TF32 switch (dot_precision reads it)."""
    q, k = tensors[0], tensors[1]
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return (pass_name, variant, is_causal, q.shape, k.shape, q.dtype, q.device, tf32,
            tuple(t.data_ptr() % 16 == 0 for t in tensors))


def _keep_recipe(key: tuple, tma: bool, runs: tuple) -> None:
    """Keep the bound launches of a call for its key, where every launch of it was direct."""
    if any(run is None for run in runs):
        return
    if len(_RECIPES) >= _MAX_RECIPES:
        _RECIPES.clear()
    _RECIPES[key] = (tma, runs)


def _replay(key: tuple, *launch_tensors: tuple[torch.Tensor, ...]) -> bool:
    """Run the recipe kept for ``key``, each bound launch on its tuple of ``launch_tensors`` in
    order, and say whether there was one."""
    recipe = _RECIPES.get(key)
    if recipe is None:
        return False
    tma, runs = recipe
    if tma:  # the backward runs on autograd's thread, which may not have Triton's allocator yet
        _ensure_tma_allocator()
    for run, tensors in zip(runs, launch_tensors, strict=True):
        run(*tensors)
    return True


def launch_recipes() -> list[dict]:
    """One row per call recipe this process holds: the pass, shapes, dtype, causality and how many
    launches it replays."""
    return [dict(pass_name=key[0], q_shape=tuple(key[3]), k_shape=tuple(key[4]), dtype=str(key[5]),
                 causal=key[2], launches=len(runs)) for key, (_, runs) in _RECIPES.items()]


# ----------------------------------------------------------------------------- launchers


@functools.cache
def _has_tf32() -> bool:
    """Whether the current GPU's tensor cores take TF32 (compute capability 8.0 and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def dot_precision(dtype: torch.dtype, fp32_dot: str = "auto") -> str:
    """The input_precision the kernels' tl.dot calls get for inputs of ``dtype`` under
    FlashVariant.fp32_dot: 16-bit inputs "ieee" (ignored by their tensor-core dots); fp32 inputs
    ``fp32_dot``. "auto" is "tf32" where the user allowed TF32 for torch's fp32 matmuls
    (torch.backends.cuda.matmul.allow_tf32), else "tf32x3": near-fp32 products on the tensor cores,
    which notes entry 7 measured at 0.38x the time of "ieee" dots (a scalar FMA loop) with errors
    within 1.5x of theirs; "ieee" under the interpreter and on GPUs without TF32."""
    if dtype != torch.float32:
        return "ieee"
    if fp32_dot == "auto":
        if INTERPRETING or not _has_tf32():
            return "ieee"
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"
    check_choice("fp32_dot", fp32_dot, FP32_DOTS)
    return fp32_dot


def _block_d(d: int) -> int:
    # the head dim padded to a power of two of at least 16 (tl.dot's smallest K); bit arithmetic,
    # as triton.next_power_of_2 is a jit-aware function that costs microseconds per call
    return max(16, 1 << (d - 1).bit_length())


def _common(d: int, n: int, dtype: torch.dtype, is_causal: bool, fp32_dot: str = "auto") -> dict:
    """The constexprs every kernel of one call shares: head dim, causal, dot precision
    (``dot_precision``), and the autotuning bucket of the longer sequence ``n``."""
    return dict(HEAD_DIM=d, BLOCK_D=_block_d(d), IS_CAUSAL=bool(is_causal),
                INPUT_PRECISION=dot_precision(dtype, fp32_dot), SEQ_BUCKET=seq_bucket(n))


def _dims(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, n_q, n_k, d) of contiguous (..., seq, d) tensors. The kernels address a (batch,
    head)'s rows from the base pointer alone, so leading dims need no reshape into one batch dim."""
    n_q, d = q.shape[-2], q.shape[-1]
    return q.numel() // (n_q * d), n_q, k.shape[-2], d


def _contiguous(*tensors: torch.Tensor) -> None:
    # the kernels index (..., seq, d) tensors with the strides of the contiguous layout
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"flash_triton kernels take contiguous tensors, got strides {t.stride()}")


# (pointer kernel, TMA kernel) of the forward and the split pair, indexed by tma (a bool)
_FWD, _DQ, _DKDV = ((TUNED[name], TUNED[f"{name}_tma"]) for name in ("fwd", "dq", "dkdv"))


def _pick(twins: tuple[TunedKernel, TunedKernel], tma: bool) -> TunedKernel:
    """The TMA kernel (after making sure this thread has a descriptor allocator) or the pointer one.
    The caller has checked tma_usable."""
    if tma and not INTERPRETING:  # the interpreter builds descriptors on the host, without scratch
        _ensure_tma_allocator()
    return twins[tma]


def _tile_grid(n_rows: int, block: str, batch: int):
    """The grid of a kernel with one program per ``block`` rows of ``n_rows`` and per (batch,
    head): one dimension, in the order kernels._program_tile reads (a second of 1: the direct
    launch passes two)."""
    return lambda meta: (triton.cdiv(n_rows, meta[block]) * batch, 1)


# head_group's rule, in 64-row tiles (the tables' most common tile), fitted to one H100's
# measurements (notes entry 14). Longest-first within each head leaves a tail when a head has too
# few tiles: the last head's longest tile starts while too little work is left to run beside it.
# A head of at least twice as many tiles as the GPU has SMs is long enough (16 heads of 16k tokens
# ran 1-3% slower in groups, which stream several heads' operands at once). Shorter heads are
# grouped until the group has that many tiles: 16 heads of 4k tokens and 32 of 2k ran 15-30% faster
# in groups of 4 to 16. No more heads than have their two streamed operands (K and V, or Q and dO)
# within half of L2 (the other half for the rest).
_GROUP_TILE_ROWS = 64
_GROUP_TILES_PER_SM = 2


def head_group(*, n_bh: int, n_rows: int, d: int, itemsize: int, sms: int, l2_bytes: int) -> int:
    """How many of ``n_bh`` (batch, head)s a launch interleaves (kernels._program_tile), for a
    kernel streaming two (n_rows, d) operands per head on a GPU with ``sms`` SMs and ``l2_bytes``
    of L2: the rule above, at least 1."""
    tiles = triton.cdiv(n_rows, _GROUP_TILE_ROWS)
    enough = (_GROUP_TILES_PER_SM * sms) // tiles
    fits = (l2_bytes // 2) // (2 * n_rows * d * itemsize)
    return max(1, min(n_bh, enough, fits))


@functools.lru_cache(maxsize=1024)
def _device_head_group(n_bh: int, n_rows: int, d: int, itemsize: int, device_index: int) -> int:
    # cached: it is on every call's host path
    props = torch.cuda.get_device_properties(device_index)
    return head_group(n_bh=n_bh, n_rows=n_rows, d=d, itemsize=itemsize, sms=props.multi_processor_count,
                      l2_bytes=props.L2_cache_size)


def resolve_head_group(q3: torch.Tensor, k3: torch.Tensor, given: int | None) -> int:
    """The head group the kernels of one call on Q (..., n_q, d) and K (..., n_k, d) run with:
    ``given`` (checked, at most the batch), or head_group's rule for the longer of the two
    sequences (the one _common buckets on; they are equal in self-attention)."""
    batch, n_q, n_k, d = _dims(q3, k3)
    if given is not None:
        if given < 1:
            raise ValueError(f"head_group must be at least 1, got {given}")
        return min(given, batch)
    if not q3.is_cuda:  # the interpreter: the order within each head (tests give groups explicitly)
        return 1
    return _device_head_group(batch, max(n_q, n_k), d, q3.element_size(), q3.device.index)


# The launchers take contiguous tensors shaped (..., seq, d) (every leading dim is batch) and
# L, D shaped (..., n_q) fp32. ``fp32_dot``: FlashVariant.fp32_dot; ``meta``: ``_common``'s dict
# when the caller already has it (then it holds the dot precision); ``head_group``: the launch
# order's group of heads (kernels._program_tile), head_group()'s rule where None.

def launch_forward(q3, k3, v3, o, lse, is_causal: bool, *, config: dict | None = None, tma: bool = False,
                   gluon: bool = False, fp32_dot: str = "auto", head_group: int | None = None) -> Callable | None:
    """Fill O (like Q) and L (Q's leading dims and n_q, fp32) from Q (..., n_q, d) and K, V
    (..., n_k, d). tma: the TMA kernel (the tensors must pass tma_usable). gluon: kernels_gluon.py's
    warp-specialised forward instead (the tensors must pass gluon_usable("fwd_ws", ...)), with its
    fixed tiles. Returns _launch's bound launch (taking Q, K, V, O, L), or None (the Gluon kernel's
    included)."""
    batch, n_q, n_k, d = _dims(q3, k3)
    group = resolve_head_group(q3, k3, head_group)
    args = (q3, k3, v3, o, lse, n_q, n_k, group, d ** -0.5 * kernels.LOG2E)
    if gluon:
        _launch_gluon("fwd_ws", n_q, batch, args, is_causal)
        return None
    grid = _tile_grid(n_q, "BLOCK_M", batch)
    return _launch(_pick(_FWD, tma), grid, args, _common(d, max(n_q, n_k), q3.dtype, is_causal, fp32_dot), config)


def launch_dq(q3, k3, v3, o3, do3, lse, delta, dq, is_causal: bool, *, config: dict | None = None,
              meta: dict | None = None, tma: bool = False, gluon: bool = False, fp32_dot: str = "auto",
              head_group: int | None = None) -> Callable | None:
    """Fill dQ and D = rowsum(O * dO) (the dK/dV kernel's input), given L. gluon: kernels_gluon.py's
    kernel (the tensors must pass gluon_usable("dq", ...)), as in launch_dkdv. Returns _launch's
    bound launch (taking Q, K, V, O, dO, L, D, dQ), or None (the Gluon kernel's included)."""
    batch, n_q, n_k, d = _dims(q3, k3)
    group = resolve_head_group(q3, k3, head_group)
    args = (q3, k3, v3, o3, do3, lse, delta, dq, n_q, n_k, group, d ** -0.5 * kernels.LOG2E, d ** -0.5)
    if gluon:
        _launch_gluon("dq", n_q, batch, args, is_causal)
        return None
    grid = _tile_grid(n_q, "BLOCK_M2", batch)
    return _launch(_pick(_DQ, tma), grid, args, meta or _common(d, max(n_q, n_k), q3.dtype, is_causal, fp32_dot),
                   config)


def launch_dkdv(q3, k3, v3, do3, lse, delta, dk, dv, is_causal: bool, *, config: dict | None = None,
                meta: dict | None = None, tma: bool = False, gluon: bool = False, fp32_dot: str = "auto",
                head_group: int | None = None) -> Callable | None:
    """Fill dK and dV, given L and D (written by launch_dq). gluon: kernels_gluon.py's kernel (the
    tensors must pass gluon_usable("dkdv", ...)), with its fixed tiles (tuning.GLUON_TILES), through
    the public launch. Returns _launch's bound launch (taking Q, K, V, dO, L, D, dK, dV), or None."""
    batch, n_q, n_k, d = _dims(q3, k3)
    group = resolve_head_group(q3, k3, head_group)
    args = (q3, k3, v3, do3, lse, delta, dk, dv, n_q, n_k, group, d ** -0.5 * kernels.LOG2E, d ** -0.5)
    if gluon:
        _launch_gluon("dkdv", n_k, batch, args, is_causal)
        return None
    grid = _tile_grid(n_k, "BLOCK_N1", batch)
    return _launch(_pick(_DKDV, tma), grid, args,
                   meta or _common(d, max(n_q, n_k), q3.dtype, is_causal, fp32_dot), config)


def _launch_gluon(kernel: str, n_rows: int, batch: int, args: tuple, is_causal: bool) -> None:
    """kernels_gluon.py's ``kernel`` (a key of tuning.GLUON_TILES) under its fixed tiles
    (tuning.GLUON_TILES), one program per tile of n_rows (query rows for dQ and the forward, keys for
    the others) and per (batch, head)."""
    head_dim = args[0].shape[-1]
    tiles = GLUON_TILES[kernel].get(head_dim)
    if tiles is None:
        raise ValueError(f"the Gluon {kernel} kernel runs at head dims {sorted(GLUON_TILES[kernel])}, not {head_dim}: "
                         f"launch it only where gluon_usable({kernel!r}, ...) is true")
    from systems.attention.flash_triton import kernels_gluon  # imports Gluon only where it runs

    fn, rows_per_program = {"dq": (kernels_gluon.flash_bwd_dq_gluon_kernel, tiles["BLOCK_M"]),
                            "dkdv": (kernels_gluon.flash_bwd_dkdv_gluon_kernel, tiles["BLOCK_N"]),
                            "atomic_ws": (kernels_gluon.flash_bwd_atomic_ws_gluon_kernel, tiles["BLOCK_N"]),
                            "atomic_pp": (kernels_gluon.flash_bwd_atomic_pp_gluon_kernel, tiles["BLOCK_N"]),
                            "fwd_ws": (kernels_gluon.flash_fwd_ws_gluon_kernel, tiles["BLOCK_M"])}[kernel]
    _ensure_tma_allocator()
    fn[(triton.cdiv(n_rows, rows_per_program) * batch,)](*args, HEAD_DIM=head_dim, IS_CAUSAL=bool(is_causal), **tiles)


_PREP_ROWS = 64  # rows per program of the prep kernel: it is memory-bound, any tile that fills the GPU does


def launch_bwd_prep(o3, do3, lse, delta, lse2, dq_acc) -> None:
    """Fill D = rowsum(O * dO) and lse2 = L log2(e) (both like L: (..., n_q) fp32) and zero dq_acc
    (like O, fp32): the atomic kernel's inputs."""
    batch, n_q, _, d = _dims(o3, o3)
    kernels.flash_bwd_prep_kernel[(triton.cdiv(n_q, _PREP_ROWS), batch)](
        o3, do3, lse, delta, lse2, dq_acc, n_q, HEAD_DIM=d, BLOCK_D=_block_d(d), BLOCK_P=_PREP_ROWS, num_warps=4)


def launch_atomic(q3, k3, v3, do3, lse2, delta, dk, dv, dq_acc, is_causal: bool, *, config: dict | None = None,
                  meta: dict | None = None, gluon: str | None = None, fp32_dot: str = "auto") -> None:
    """Fill dK and dV and add dS K (dQ before its sm_scale) into dq_acc, given L in base 2 and D
    (launch_bwd_prep's lse2 and delta). gluon: kernels_gluon.py's "atomic_pp" or "atomic_ws" kernel,
    with its fixed tiles (the tensors must be ones FlashVariant(backward="atomic").atomic_gluon names
    it for); None: Triton's atomic kernel."""
    batch, n_q, n_k, d = _dims(q3, k3)
    group = resolve_head_group(q3, k3, None)
    args = (q3, k3, v3, do3, lse2, delta, dk, dv, dq_acc, n_q, n_k, group, d ** -0.5 * kernels.LOG2E, d ** -0.5)
    if gluon is not None:
        check_choice("launch_atomic's gluon", gluon, _ATOMIC_GLUON_KERNELS)
        _launch_gluon(gluon, n_k, batch, args, is_causal)
        return
    grid = _tile_grid(n_k, "BLOCK_N3", batch)
    _launch(TUNED["atomic"], grid, args, meta or _common(d, max(n_q, n_k), q3.dtype, is_causal, fp32_dot), config)


def launch_backward_atomic(q3, k3, v3, o3, do3, lse, delta, dq_acc, dq, dk, dv, is_causal: bool, *,
                           config: dict | None = None, meta: dict | None = None, gluon: str | None = None,
                           fp32_dot: str = "auto") -> None:
    """The whole atomic backward: the prep kernel, the atomic kernel (launch_atomic's ``gluon``),
    then dQ = sm_scale * dq_acc written in dq's dtype (``dq`` may be ``dq_acc`` itself, for fp32 inputs)."""
    lse2 = torch.empty_like(lse)
    launch_bwd_prep(o3, do3, lse, delta, lse2, dq_acc)
    launch_atomic(q3, k3, v3, do3, lse2, delta, dk, dv, dq_acc, is_causal, config=config, meta=meta, gluon=gluon,
                  fp32_dot=fp32_dot)
    torch.mul(dq_acc, q3.shape[-1] ** -0.5, out=dq)  # one elementwise kernel: scale and cast together


# ----------------------------------------------------------------------------- passes


def flash_forward_triton(q3, k3, v3, is_causal: bool, *, variant: FlashVariant = DEFAULT_VARIANT
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous Q (..., n_q, d), K, V (..., n_k, d) -> O (like Q), L (..., n_q) fp32, through the
    forward kernel ``variant.forward`` names."""
    _check_variant(variant)
    _contiguous(q3, k3, v3)
    o = torch.empty_like(q3)
    lse = torch.empty(q3.shape[:-1], device=q3.device, dtype=torch.float32)
    key = recipe_key("fwd", variant, is_causal, q3, k3, v3)
    if _replay(key, (q3, k3, v3, o, lse)):  # first: the host-bound short calls take it
        return o, lse
    if variant.forward_gluon(q3, k3, v3):  # (no recipe: the Gluon launch is not bound, and runs milliseconds)
        launch_forward(q3, k3, v3, o, lse, is_causal, gluon=True, head_group=variant.head_group)
        return o, lse
    tma = variant.forward_tma(q3, k3, v3)
    run = launch_forward(q3, k3, v3, o, lse, is_causal, tma=tma, fp32_dot=variant.fp32_dot,
                         head_group=variant.head_group)
    _keep_recipe(key, tma, (run,))
    return o, lse


def flash_backward_triton(q3, k3, v3, o3, lse, do3, is_causal: bool, *, variant: FlashVariant = DEFAULT_VARIANT):
    """dQ, dK, dV (like Q, K, V) from contiguous (..., seq, d) tensors and L (..., n_q), through the
    backward ``variant.backward`` names: the split pair (the dQ kernel, which also writes D, then
    the dK/dV kernel), launch_backward_atomic, or flash_pytorch's reference."""
    _check_variant(variant)
    if variant.backward == "pytorch":
        return backward_reference(q3, k3, v3, o3, lse, do3, is_causal)
    _contiguous(q3, k3, v3, o3, do3)
    delta = torch.empty_like(lse)
    dk, dv = torch.empty_like(k3), torch.empty_like(v3)
    dq = torch.empty_like(q3)
    key = recipe_key("bwd", variant, is_causal, q3, k3, v3, o3, do3, lse)
    if _replay(key, (q3, k3, v3, o3, do3, lse, delta, dq), (q3, k3, v3, do3, lse, delta, dk, dv)):
        return dq, dk, dv  # the split pair as launched for this key before (only it keeps recipes)
    if variant.runs_atomic(q3, k3, v3, o3, do3):  # (asked after the replay: the short calls skip it)
        dq_acc = torch.empty(q3.shape, device=q3.device, dtype=torch.float32)
        if q3.dtype == torch.float32:
            dq = dq_acc
        launch_backward_atomic(q3, k3, v3, o3, do3, lse, delta, dq_acc, dq, dk, dv, is_causal,
                               gluon=variant.atomic_gluon(q3, k3, v3, o3, do3), fp32_dot=variant.fp32_dot)
        return dq, dk, dv
    # one dict for both launches
    meta = _common(q3.shape[-1], max(q3.shape[-2], k3.shape[-2]), q3.dtype, is_causal, variant.fp32_dot)
    tma = variant.backward_tma(q3, k3, v3, o3, do3)
    group = resolve_head_group(q3, k3, variant.head_group)  # once for both launches
    run_dq = launch_dq(q3, k3, v3, o3, do3, lse, delta, dq, is_causal, meta=meta, tma=tma,
                       gluon=tma and variant.backward_gluon("dq", q3, k3, v3, o3, do3), head_group=group)
    run_dkdv = launch_dkdv(q3, k3, v3, do3, lse, delta, dk, dv, is_causal, meta=meta, tma=tma,
                           gluon=tma and variant.backward_gluon("dkdv", q3, k3, v3, o3, do3), head_group=group)
    _keep_recipe(key, tma, (run_dq, run_dkdv))
    return dq, dk, dv
