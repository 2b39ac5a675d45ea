"""Another rank's CUDA tensors, read where they lie: the caching allocator's segments shared
through legacy CUDA IPC (the driver's ``cuIpcGetMemHandle`` and ``cuIpcOpenMemHandle``).

Why (docs/training_step_notes.md, entries 27 and 29): ``DDPPeer``'s copies move every gradient
through HBM twice more beside the backward (read here, written into the peer's slot), and the
update then reads the received copy. Where the update loads the other rank's gradient over NVLink
from the memory autograd put it in, no copy runs at all.

How: a tensor lies in one of the caching allocator's segments (one ``cudaMalloc``, whose base and
size the driver gives). At each exchange every rank sends, per tensor, its segment's IPC handle and
its offset in it (a gloo all-gather of int64 rows); a rank opens each peer segment once (the peer's
memory mapped into its own address space, kept until ``close``) and makes each peer tensor a view
at the mapped base plus the offset. Rows equal to the previous exchange's reuse its views.

Limits: legacy IPC shares ``cudaMalloc`` memory only, so not the allocator's expandable segments nor
``cudaMallocAsync`` (``PYTORCH_CUDA_ALLOC_CONF``): the export then fails, naming the setting. A
tensor's memory must stay allocated on its rank until every peer has read it: the caller orders
that (``DDPPeer`` with ``read_peers``: a barrier after the updates, before the compute stream can
reuse the gradients' memory).
"""

from __future__ import annotations

import ctypes
import struct
import time
from typing import Sequence

import torch
import torch.distributed as dist

HANDLE_BYTES = 64  # CUipcMemHandle
_ROW = HANDLE_BYTES // 8 + 2  # the handle as int64 words, the offset in the segment, the byte count (-1: no tensor)
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class CudaDriver:
    """The four driver calls, through ctypes on ``libcuda.so.1`` (the primary context that PyTorch
    made current on this thread is the one they use)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._lib = lib
        ptr, size = ctypes.c_uint64, ctypes.c_size_t
        self._range = self._function("cuMemGetAddressRange_v2", ctypes.POINTER(ptr), ctypes.POINTER(size), ptr)
        self._export = self._function("cuIpcGetMemHandle", ctypes.POINTER(_Handle), ptr)
        self._open = self._function("cuIpcOpenMemHandle_v2", ctypes.POINTER(ptr), _Handle, ctypes.c_uint)
        self._close = self._function("cuIpcCloseMemHandle", ptr)

    def _function(self, name: str, *argtypes):
        function = getattr(self._lib, name)
        function.argtypes, function.restype = list(argtypes), ctypes.c_int
        return function

    def _check(self, result: int, what: str) -> None:
        if result == 0:
            return
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(result, ctypes.byref(name))
        hint = ""
        if what.startswith("cuIpcGetMemHandle"):
            hint = (": legacy CUDA IPC shares cudaMalloc memory only; unset expandable_segments and "
                    "backend:cudaMallocAsync in PYTORCH_CUDA_ALLOC_CONF")
        raise RuntimeError(f"{what} failed with {(name.value or b'?').decode()} ({result}){hint}")

    @staticmethod
    def segment_frees(device: torch.device) -> int:
        """How many segments the caching allocator has given back to the driver on ``device``."""
        # the nested dict: memory_stats() flattens it in Python, host time at every step
        return torch.cuda.memory_stats_as_nested_dict(device)["segment"]["all"]["freed"]

    def segment(self, address: int) -> tuple[int, int]:
        """The base and size of the allocation that holds ``address``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self._range(ctypes.byref(base), ctypes.byref(size), address), f"cuMemGetAddressRange({address:#x})")
        return base.value, size.value

    def export(self, base: int) -> bytes:
        handle = _Handle()
        self._check(self._export(ctypes.byref(handle), base), f"cuIpcGetMemHandle({base:#x})")
        return bytes(handle.reserved)

    def open(self, handle: bytes) -> int:
        """Map another process's allocation; returns its base in this process."""
        address = ctypes.c_uint64()
        self._check(self._open(ctypes.byref(address), _Handle.from_buffer_copy(handle), _LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
        return address.value

    def close(self, address: int) -> None:
        self._check(self._close(address), f"cuIpcCloseMemHandle({address:#x})")

    @staticmethod
    def synchronize() -> None:
        """Wait for the device's queued work (before a mapping it may read is closed)."""
        torch.cuda.synchronize()


def view_at(address: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s shape and dtype on its device over memory this process does not own
    (nothing frees it when the view goes)."""
    storage = torch._C._construct_storage_from_data_pointer(address, like.device, like.nbytes)
    flat = torch.empty(0, dtype=torch.uint8, device=like.device).set_(storage)
    return flat.view(like.dtype).view(like.shape)  # (nbytes,) uint8 -> (numel,) -> like.shape


class PeerTensors:
    """Each exchange maps every other rank's tensors into this process (module docstring).
    ``group``: the ranks (``None``: all); the rows travel on a gloo group of their own, built here
    (collective: every rank of the default group constructs this, and calls ``close``).
    ``present[peer]``: after an exchange, which positions that peer sent a tensor for. A peer
    segment no row refers to any more is unmapped at the next exchange that notices, after the
    device has finished its queued work (which may still read it). ``driver``: ``CudaDriver()`` by
    default; the tests give one that maps CPU buffers."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, driver=None):
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._rows_group = dist.new_group(ranks=ranks, backend="gloo")
        self.driver = driver if driver is not None else CudaDriver()
        # address -> its segment's base, for addresses seen since the allocator last freed a segment
        self._segments: dict[int, int] = {}
        self._frees = -1
        self._places: tuple | None = None  # where the tensors of the last rows lay
        self._my_rows = torch.empty(0, _ROW, dtype=torch.int64)
        self._opened: dict[bytes, int] = {}  # a peer segment's handle -> its base here
        self._last: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]] = {}  # peer -> (rows, views)
        self._used: dict[int, set[bytes]] = {}  # peer -> the handles its last rows refer to
        self.present: dict[int, list[bool]] = {}
        self.opens = 0  # segments mapped so far (each a driver call that the next exchanges skip)
        self.seconds = 0.0  # host time in exchange, waiting for the other ranks included, over calls

    def _rows(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """This rank's rows; the previous exchange's when every tensor is where it was then and no
        segment went back to the driver since (a step's host time: the rows take milliseconds)."""
        present = [t for t in tensors if t is not None]
        frees = self.driver.segment_frees(present[0].device) if present else self._frees
        places = (frees, tuple(t.data_ptr() if t is not None else None for t in tensors),
                  tuple(t.nbytes if t is not None else -1 for t in tensors))
        if places == self._places:
            return self._my_rows
        if frees != self._frees:  # a segment went back to the driver: a remembered base may be stale
            self._segments.clear()
            self._frees = frees
        handles: dict[int, list[int]] = {}  # exported once per segment and exchange: a segment
        # freed and allocated again at its base gets a new handle
        rows = []
        for i, t in enumerate(tensors):
            if t is None:
                rows.append([0] * (_ROW - 1) + [-1])
                continue
            if not t.is_contiguous():  # the peer builds a dense view of the bytes
                raise ValueError(f"PeerTensors: tensor {i} is not contiguous: exchange dense tensors only")
            address = t.data_ptr()
            base = self._segments.get(address)
            if base is None:
                base = self._segments[address] = self.driver.segment(address)[0]
            if base not in handles:
                handles[base] = list(struct.unpack(f"<{HANDLE_BYTES // 8}q", self.driver.export(base)))
            rows.append(handles[base] + [address - base, t.nbytes])  # one _ROW
        self._places, self._my_rows = places, torch.tensor(rows, dtype=torch.int64).view(len(tensors), _ROW)
        return self._my_rows

    def exchange(self, tensors: Sequence[torch.Tensor | None]) -> dict[int, list[torch.Tensor | None]]:
        """Per other rank, its tensors at the same positions (``None`` where it sent none), as views
        shaped like this rank's; every rank calls this with the same count of tensors. Where a
        position holds ``None`` on one rank, the other rank's tensor there comes back as ``None``."""
        start = time.perf_counter()
        rows = self._rows(tensors)
        gathered = [torch.empty_like(rows) for _ in range(self.world_size)]
        dist.all_gather(gathered, rows, group=self._rows_group)
        out = {}
        changed = False
        for peer, peer_rows in enumerate(gathered):
            if peer == self.rank:
                continue
            last = self._last.get(peer)
            if last is not None and torch.equal(last[0], peer_rows):
                out[peer] = last[1]
                continue
            changed = True
            views: list[torch.Tensor | None] = []
            used: set[bytes] = set()
            listed = peer_rows.tolist()
            self.present[peer] = [row[-1] >= 0 for row in listed]
            for i, (row, like) in enumerate(zip(listed, tensors)):
                if row[-1] < 0 or like is None:
                    views.append(None)
                    continue
                if row[-1] != like.nbytes:
                    raise ValueError(f"PeerTensors: tensor {i} is {row[-1]} bytes on rank {peer} and "
                                     f"{like.nbytes} here: every rank must send tensors "
                                     "of the same shapes and dtypes in the same order")
                handle = struct.pack(f"<{HANDLE_BYTES // 8}q", *row[:-2])
                base = self._opened.get(handle)
                if base is None:
                    base = self._opened[handle] = self.driver.open(handle)
                    self.opens += 1
                used.add(handle)
                views.append(view_at(base + row[-2], like))
            self._last[peer], self._used[peer] = (peer_rows, views), used
            out[peer] = views
        if changed:
            self._unmap_unused()
        self.seconds += time.perf_counter() - start
        return out

    def _unmap_unused(self) -> None:
        # a segment the peer may have freed stays mapped (and its memory held) until unmapped here;
        # the reads queued before this exchange may still use it: wait for the device first
        used = set().union(*self._used.values())
        stale = [h for h in self._opened if h not in used]
        if not stale:
            return
        self.driver.synchronize()
        for handle in stale:
            self.driver.close(self._opened.pop(handle))

    def close(self) -> None:
        """Unmap every peer segment once the device has finished its reads, and leave the rows'
        group after every rank has unmapped: a rank may then give its segments back to the driver
        (``torch.cuda.empty_cache``) with no other rank still mapping them. Collective."""
        self._last.clear()
        self._used.clear()
        if self._opened:
            self.driver.synchronize()
        for base in self._opened.values():
            self.driver.close(base)
        self._opened.clear()
        dist.barrier(group=self._rows_group)
        dist.destroy_process_group(self._rows_group)
