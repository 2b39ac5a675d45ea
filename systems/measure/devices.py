"""Device helpers every harness shares: the dtype vocabulary, choosing the device, synchronising,
and the one out-of-memory check."""

from __future__ import annotations

import gc
import os
import re

import torch

# The one dtype vocabulary: short names, as notebooks, CLIs and results files write them.
DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a short name ("fp32", "bf16", ...)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """The short name of a torch dtype ("fp32"), its torch name for one outside the vocabulary."""
    if dtype is None:
        return None
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1, read by Triton
    when it is imported): kernels then take CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when present), 'cpu' or 'cuda[:N]', with a clear error for anything else."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was requested but this machine has no CUDA GPU "
                         "(torch.cuda.is_available() is False); use --device cpu or auto")
    return torch.device(name)


def sync(device: torch.device) -> None:
    """Wait for queued device work (a no-op on a CPU), so a host timer reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # a collective's failure (NCCL out of memory for its own buffers, say) leaves the process group
    # unusable: never a point a sweep may record and step over
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return False
    # older allocator paths raise a plain RuntimeError whose message says so
    return "out of memory" in str(exc).lower()


def release_memory(device: torch.device | None = None) -> None:
    """Give cached CUDA blocks back to the driver, so the next measurement (or process) starts clean.

    Call it outside an ``except`` block: until then the traceback's frames hold the tensors.
    On a CPU refcounting frees memory already, and a full ``gc.collect`` over a notebook's data
    frames would only cost time.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


class catch_oom:
    """Turn an out-of-memory error inside the block into a record: ``with catch_oom() as oom: ...``,
    then ``if oom: row["status"] = "oom"`` and ``oom.message``; any other error propagates.

    Call ``release_memory()`` after the block, not inside it: until the ``with`` statement has
    finished, the exception's traceback holds the frames that hold the tensors."""

    def __init__(self) -> None:
        self.message: str | None = None

    def __enter__(self) -> "catch_oom":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, (torch.OutOfMemoryError, RuntimeError)) or not is_oom(exc):
            return False
        self.message = str(exc).splitlines()[0][:600]  # CUDA's first line names every size (oom_sizes)
        return True

    def __bool__(self) -> bool:
        return self.message is not None


_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_OOM_SIZES = {
    "requested_bytes": r"Tried to allocate ([\d.]+) (\w{2})?B",
    "device_free_bytes": r"of which ([\d.]+) (\w{2})?B is free",
    "allocated_bytes": r"([\d.]+) (\w{2})?B is allocated by PyTorch",
    # "reserved but unallocated": in blocks that live tensors still partly occupy
    "reserved_unallocated_bytes": r"([\d.]+) (\w{2})?B is reserved by PyTorch but unalloc",
}


def oom_sizes(message: str | None) -> dict[str, int]:
    """The sizes a CUDA out-of-memory message states, in bytes: the request, the device's free
    memory, what PyTorch had allocated and what it held reserved but unallocated (those present)."""
    out = {}
    for key, pattern in _OOM_SIZES.items():
        m = re.search(pattern, message or "")
        if m and (m.group(2) or "") in _UNITS:
            out[key] = round(float(m.group(1)) * _UNITS[m.group(2) or ""])
    return out
