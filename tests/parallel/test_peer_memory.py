"""PeerTensors on 2 gloo ranks with a driver that maps CPU buffers: each rank's segments are byte
buffers filled from a recipe of (rank, segment), and "opening" a peer's handle builds a replica of
that peer's segment from the same recipe in this process. A view read back equal to the peer's
tensor then proves the rows' handle, offset and size arithmetic, which real CUDA IPC uses alike
(its GPU case: tests/parallel/test_peer.py's read_peers test)."""

from __future__ import annotations

import struct

import pytest
import torch

from systems.parallel.launch import DistributedRunError, spawn
from systems.parallel.peer_memory import HANDLE_BYTES, PeerTensors, view_at


def _segment(rank: int, k: int, nbytes: int) -> torch.Tensor:
    return ((torch.arange(nbytes) * (2 * rank + 1) + 7 * k) % 251).to(torch.uint8)


class _BufferDriver:
    def __init__(self, rank: int):
        self.rank = rank
        self.segments: dict[int, tuple[int, torch.Tensor]] = {}  # base -> (k, buffer)
        self.replicas: list[torch.Tensor] = []  # keeps the mapped replicas alive
        self.opened: list[tuple[int, int]] = []
        self.closed: list[int] = []
        self.lookups = 0
        self.frees = 0
        self.synchronized = 0

    def new_segment(self, k: int, nbytes: int) -> torch.Tensor:
        buffer = _segment(self.rank, k, nbytes)
        self.segments[buffer.data_ptr()] = (k, buffer)
        return buffer

    def segment_frees(self, device) -> int:
        return self.frees

    def segment(self, address: int) -> tuple[int, int]:
        self.lookups += 1
        for base, (_, buffer) in self.segments.items():
            if base <= address < base + buffer.numel():
                return base, buffer.numel()
        raise RuntimeError(f"no segment holds {address:#x}")

    def export(self, base: int) -> bytes:
        k, buffer = self.segments[base]
        # padded with 0xFF: the handle's words travel as signed int64
        return struct.pack("<qqq", self.rank, k, buffer.numel()).ljust(HANDLE_BYTES, b"\xff")

    def open(self, handle: bytes) -> int:
        assert handle[24:] == b"\xff" * (HANDLE_BYTES - 24)
        rank, k, nbytes = struct.unpack("<qqq", handle[:24])
        replica = _segment(rank, k, nbytes)
        self.replicas.append(replica)
        self.opened.append((rank, k))
        return replica.data_ptr()

    def close(self, address: int) -> None:
        self.closed.append(address)

    def synchronize(self) -> None:
        self.synchronized += 1


SHAPES = [((3, 4), torch.float32), ((5,), torch.bfloat16), ((2, 2, 2), torch.float16)]


def _placed(driver: _BufferDriver, rank: int, segment: torch.Tensor, k: int, i: int) -> torch.Tensor:
    """Tensor i of SHAPES in ``segment``, at an offset that differs between the ranks."""
    shape, dtype = SHAPES[i]
    offset = 256 * i + 64 * rank
    n = torch.Size(shape).numel() * dtype.itemsize
    return segment[offset:offset + n].view(dtype).view(shape)


def _expected(peer: int, k: int, i: int) -> torch.Tensor:
    shape, dtype = SHAPES[i]
    offset, n = 256 * i + 64 * peer, torch.Size(shape).numel() * dtype.itemsize
    return _segment(peer, k, 1024)[offset:offset + n].view(dtype).view(shape)


def _worker(ctx):
    driver = _BufferDriver(ctx.rank)
    peers = PeerTensors(driver=driver)
    peer = 1 - ctx.rank
    seg0, seg1 = driver.new_segment(0, 1024), driver.new_segment(1, 1024)
    tensors = [_placed(driver, ctx.rank, seg0, 0, 0), _placed(driver, ctx.rank, seg0, 0, 1),
               _placed(driver, ctx.rank, seg1, 1, 2)]
    report = {}
    first = peers.exchange(tensors)[peer]
    report["first"] = all(torch.equal(v, _expected(peer, k, i)) for i, (v, k) in enumerate(zip(first, (0, 0, 1))))
    report["first_opens"] = sorted(driver.opened)
    lookups = driver.lookups
    again = peers.exchange(tensors)[peer]
    report["reused"] = again is first and peers.opens == 2 and driver.lookups == lookups
    # tensor 1 moves to a new segment; tensor 2 is absent this time (on both ranks), so the peer's
    # segment 1 is referred to no more: unmapped, after the device's queued reads
    seg2 = driver.new_segment(2, 1024)
    moved = peers.exchange([tensors[0], _placed(driver, ctx.rank, seg2, 2, 1), None])[peer]
    report["moved"] = (torch.equal(moved[0], _expected(peer, 0, 0)) and torch.equal(moved[1], _expected(peer, 2, 1))
                       and moved[2] is None and peers.opens == 3 and peers.present[peer] == [True, True, False])
    report["unmapped"] = len(driver.closed) == 1 and driver.synchronized == 1
    driver.frees += 1  # a segment went back to the driver: every address is looked up again
    lookups = driver.lookups
    back = peers.exchange(tensors)[peer]  # segment 1 mapped again, segment 2 unmapped
    report["looked_up_again"] = driver.lookups - lookups == 3 and torch.equal(back[2], _expected(peer, 1, 2))
    report["remapped"] = peers.opens == 4 and len(driver.closed) == 2
    peers.close()
    report["closed"] = len(driver.closed) == 4  # the two left mapped
    return report


@pytest.mark.slow
def test_peer_tensors_are_views_of_the_peers_segments_opened_once():
    for rank, report in enumerate(spawn(_worker, 2, "gloo", timeout_s=30, deadline_s=90)):
        assert report["first"], rank
        assert report["first_opens"] == [(1 - rank, 0), (1 - rank, 1)]
        assert report["reused"], rank  # the same rows: the same views, no driver call
        assert report["moved"], rank
        assert report["unmapped"], rank
        assert report["looked_up_again"], rank
        assert report["remapped"], rank
        assert report["closed"], rank


def _mismatch_worker(ctx):
    driver = _BufferDriver(ctx.rank)
    peers = PeerTensors(driver=driver)
    segment = driver.new_segment(0, 1024)
    n = 4 + ctx.rank  # rank 1's tensor is one element longer
    peers.exchange([segment[:4 * n].view(torch.float32)])


@pytest.mark.slow
def test_tensors_of_other_sizes_are_refused_naming_both():
    with pytest.raises(DistributedRunError, match=r"tensor 0 is (16|20) bytes on rank [01] and (16|20) here"):
        spawn(_mismatch_worker, 2, "gloo", timeout_s=30, deadline_s=90)


def test_a_view_at_an_address_reads_the_memory_there_without_owning_it():
    data = torch.arange(12, dtype=torch.float32)
    view = view_at(data.data_ptr() + 4 * 4, torch.empty(2, 3))
    assert view.shape == (2, 3) and view.dtype == torch.float32
    assert view.flatten().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    view.zero_()  # the same memory
    assert data[4:10].eq(0).all()
