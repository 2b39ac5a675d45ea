"""Data parallelism through copy engines: each rank writes its gradients into the other ranks'
memory, and the optimizer's update sums them.

Why: NCCL's all-reduce runs as thread blocks on the SMs and streams the gradients through HBM
beside the backward's matmuls, which then run up to twice as long (docs/training_step_notes.md,
entries 3, 7 and 8); fewer NCCL thread blocks left the all-reduce too slow to hide, and matmuls
planned for fewer SMs lose what NCCL would have taken. Here no SM moves a gradient:

- every rank holds a receive buffer in symmetric memory (``torch.distributed._symmetric_memory``:
  each rank maps the others' buffers into its address space), one slot per other rank;
- as soon as the backward has produced the gradients of a group (a block), a side stream copies
  each into its place in every other rank's slot for this rank: a plain ``copy_`` between two
  dense tensors of one dtype, which is a ``cudaMemcpyAsync`` and runs on the GPU's copy engines
  over NVLink (a profile shows them as "Memcpy PtoP", no kernel);
- the sum is folded into the update (``FusedAdamW.fold_gradients``): a parameter's update reads
  its own gradient and the received one and averages them in registers, so the reduction makes
  no pass of its own over the gradients either (with more than one peer the received slots are
  first added into one, one pass).

The gradients stay where the backward put them (no bucket copy, no pre-scaling), and ``.grad``
keeps this rank's own gradient: unlike ``systems.parallel.ddp``'s wrappers, the average exists
only inside the update, so this wrapper needs the optimizer (a ``GroupedOptimizer`` of
``FusedAdamW`` or ``MasterWeightAdamW``, whose groups are the units synchronised and updated).

Synchronisation, on the side stream, with symmetric memory's barrier (a one-block kernel that
signals every peer and waits for theirs):
- before a step's first copy: every rank has finished the previous step's updates, which read
  its receive buffer (the side stream first waits for this rank's compute stream);
- after each group's copies, in one order alike on every rank (the order in which the backward
  completed the groups, once the ranks saw the same one; the groups reversed before that): the
  group's gradients from every peer have landed; the group's update waits for that barrier.

On gloo (CPU) the same wrapper moves each group's gradients with ``all_gather`` into plain
receive slots (in ``finish``, after the ranks' agreement), so the CPU tests check everything but
the copy engines. On GPUs the ranks' agreement (a host round trip, which waits for the slowest
host) is started before the updates are queued and waited for after: the updates only wait on the
GPU for their barriers, so the round trip runs while the GPU works instead of between the backward
and the updates. A gradient that only some ranks have still raises there, naming it, but a rank's
barrier for a group its peers never close then waits until its timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from systems.parallel.ddp import _DDPBase, broadcast_optimizer_state

# each gradient's place in a slot starts at a multiple of this (cudaMalloc's own alignment); the
# fused update's 16-byte vector loads need 16
ALIGN_BYTES = 256


class _Layout:
    """Byte offsets of the parameters' gradients in one receive slot."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self.offsets, self.nbytes = [], []
        end = 0
        for p in params:
            self.offsets.append(end)
            n = p.numel() * p.element_size()
            self.nbytes.append(n)
            end += -(-n // ALIGN_BYTES) * ALIGN_BYTES
        self.slot_bytes = max(end, ALIGN_BYTES)

    def view(self, buffer: torch.Tensor, slot: int, index: int, like: torch.Tensor) -> torch.Tensor:
        """Parameter ``index``'s place in ``slot`` of a flat byte ``buffer``, as a tensor shaped like ``like``."""
        start = slot * self.slot_bytes + self.offsets[index]
        return buffer[start:start + self.nbytes[index]].view(like.dtype).view(like.shape)


class CopyGraphs:
    """Each group's gradient copies captured once as a CUDA graph and replayed with one launch.

    Why: where the backward waits on the host (the default compile mode) every host call in the
    hooks delays the backward's own launches, and a copy into a peer-mapped buffer costs about
    10 us of CUDA runtime alone (a profile counted 584 in two steps: docs/training_step_notes.md,
    entries 14 and 18), one per gradient. A graph replays a group's copies (the same copy-engine
    transfers) with one launch. Its transfers read fixed addresses: a graph is replayed only while
    the group's gradients sit where it was captured (the caching allocator gives a step's same
    sequence of allocations the same blocks), recaptured when they moved, and after
    ``max_captures`` captures of one group that group's copies are issued one by one again.
    ``capture(copy)`` records what ``copy()`` issues on the current stream and returns an object
    with ``replay()``; the default captures a ``torch.cuda.CUDAGraph``. Measured on 2x H200 in the
    default compile mode: no gain the paired rounds resolve (entry 19), so it stays off by default."""

    def __init__(self, *, max_captures: int = 3, capture: Callable | None = None):
        self.max_captures = max_captures
        self._capture = capture or _capture_cuda_graph
        self.graphs: dict[tuple[int, ...], tuple[tuple[int, ...], object]] = {}
        self.captures: dict[tuple[int, ...], int] = {}

    def run(self, key: tuple[int, ...], addresses: tuple[int, ...], copy: Callable[[], None]) -> None:
        """Issue ``copy()``'s transfers for group ``key``, whose sources are at ``addresses``."""
        entry = self.graphs.get(key)
        if entry is not None and entry[0] == addresses:
            entry[1].replay()
            return
        if self.captures.get(key, 0) >= self.max_captures:
            self.graphs.pop(key, None)
            copy()
            return
        self.captures[key] = self.captures.get(key, 0) + 1
        graph = self._capture(copy)
        self.graphs[key] = (addresses, graph)
        graph.replay()


def _capture_cuda_graph(copy: Callable[[], None]):
    # not torch.cuda.graph(): it synchronises the device and empties the allocator's cache, which
    # would move the next step's gradients off the addresses being captured; "thread_local": the
    # backward's other CUDA calls go on while this thread captures
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(capture_error_mode="thread_local")
    try:
        copy()
    finally:
        graph.capture_end()
    return graph


def slot_of(source: int, receiver: int) -> int:
    """The slot of rank ``source``'s gradients in rank ``receiver``'s buffer (no slot for itself)."""
    if source == receiver:
        raise ValueError("a rank keeps no slot for its own gradients")
    return source if source < receiver else source - 1


class _SymmetricBuffer:
    """A buffer in symmetric memory (each rank maps the others'), whose barrier (a one-block kernel
    that signals every peer and waits for theirs) runs on the current stream."""

    def __init__(self, nbytes: int, group, device: torch.device, timeout_s: float):
        from torch.distributed import _symmetric_memory as symm_mem

        self.timeout_ms = int(timeout_s * 1000)
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group if group is not None else dist.group.WORLD)

    def barrier(self) -> None:
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)


class _CopyEngineTransport(_SymmetricBuffer):
    """Receive slots in symmetric memory; each group's copies on one of ``copy_streams`` side
    streams, in turn (so that several copy engines can run at once); barriers on the first, whose
    events the compute stream waits for."""

    host_collectives = False  # every wait is queued on the GPU

    def __init__(self, params, layout: _Layout, group, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, copy_streams: int = 1, copy_graphs: bool = False):
        super().__init__((world_size - 1) * layout.slot_bytes, group, device, timeout_s)
        self.streams = [torch.cuda.Stream(device) for _ in range(copy_streams)]
        self.stream = self.streams[0]  # the barriers'
        self._turn = 0
        peers = [r for r in range(world_size) if r != rank]
        remote = {q: self.handle.get_buffer(q, (self.buffer.numel(),), torch.uint8) for q in peers}
        # per parameter, its place in every peer's slot for this rank
        self.destinations = [[layout.view(remote[q], slot_of(rank, q), i, p) for q in peers]
                             for i, p in enumerate(params)]
        self.group_events: dict[int, torch.cuda.Event] = {}
        self.copy_graphs = CopyGraphs() if copy_graphs else None

    @staticmethod
    def _follow(stream: torch.cuda.Stream, after: torch.cuda.Event | None) -> None:
        """``stream`` waits for the compute stream: as it stands now, or at ``after`` (an event
        recorded on it by a caller on another thread)."""
        if after is None:
            stream.wait_stream(torch.cuda.current_stream())
        else:
            stream.wait_event(after)

    def begin_step(self, after: torch.cuda.Event | None = None) -> None:
        self._follow(self.stream, after)
        with torch.cuda.stream(self.stream):
            self.barrier()
        for other in self.streams[1:]:  # no copy of this step before the barrier
            other.wait_stream(self.stream)

    def push(self, grads: Sequence[tuple[int, torch.Tensor]], after: torch.cuda.Event | None = None) -> None:
        # One stream switch and one wait per group, not per gradient: where the backward is
        # host-bound (eager, or compiled without CUDA graphs) every host microsecond in the hooks
        # is a gap on the GPU. The gradients are read here on a side stream and may be freed by
        # the next step's zero_grad; their memory is reused only by work queued on the compute
        # stream after that, which already waits for their group's barrier (after these copies)
        # in finish: no record_stream.
        stream = self.streams[self._turn]
        self._turn = (self._turn + 1) % len(self.streams)
        self._follow(stream, after)

        def copy() -> None:
            for index, grad in grads:
                for destination in self.destinations[index]:
                    destination.copy_(grad)  # same dtype, both dense: a cudaMemcpyAsync, on a copy engine

        with torch.cuda.stream(stream):
            if self.copy_graphs is None:
                copy()
            else:
                self.copy_graphs.run(tuple(i for i, _ in grads), tuple(g.data_ptr() for _, g in grads), copy)

    def close_group(self, group: int, indices: Sequence[int]) -> None:
        for other in self.streams[1:]:  # the group's copies on every stream come before its barrier
            self.stream.wait_stream(other)
        with torch.cuda.stream(self.stream):
            self.barrier()
            event = torch.cuda.Event()
            event.record(self.stream)
        self.group_events[group] = event

    def wait_group(self, group: int) -> None:
        torch.cuda.current_stream().wait_event(self.group_events.pop(group))


def read_peers_refusal(world_size: int, device: torch.device) -> str | None:
    """Why ``read_peers`` cannot run on these ranks (``None``: it can)."""
    if world_size != 2:
        return (f"read_peers folds the one other rank's gradient into the update: it needs exactly 2 ranks, got "
                f"{world_size}; use the copies (read_peers=False) for more")
    if device.type != "cuda":
        return ("read_peers maps the other GPU's memory (CUDA IPC): on CPU ranks (gloo) leave it off (DDPPeer then "
                "all-gathers the gradients)")
    return None


class _ReadTransport(_SymmetricBuffer):
    """No copies: each rank's update reads the other rank's gradients over NVLink where autograd
    put them (``systems.parallel.peer_memory``); symmetric memory only for the barriers, which run
    on the compute stream."""

    def __init__(self, group, device: torch.device, timeout_s: float):
        from systems.parallel.peer_memory import PeerTensors

        super().__init__(ALIGN_BYTES, group, device, timeout_s)
        self.peers = PeerTensors(group)

    def close(self) -> None:
        self.peers.close()


class _GatherTransport:
    """gloo: each group's gradients all-gathered when the group is waited for (in finish, after
    the ranks agreed on which gradients exist: a mismatch then raises instead of pairing wrong)."""

    host_collectives = True

    def __init__(self, params, layout: _Layout, group, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.params, self.layout, self.group = rank, world_size, params, layout, group
        self.buffer = torch.zeros((world_size - 1) * layout.slot_bytes, dtype=torch.uint8, device=device)
        self.grads: dict[int, torch.Tensor] = {}
        self.closed: dict[int, Sequence[int]] = {}

    def begin_step(self, after: None = None) -> None:
        self.grads.clear()

    def push(self, grads: Sequence[tuple[int, torch.Tensor]], after: None = None) -> None:
        self.grads.update(grads)

    def close_group(self, group: int, indices: Sequence[int]) -> None:
        self.closed[group] = indices

    def wait_group(self, group: int) -> None:
        sent = [i for i in self.closed.pop(group) if i in self.grads]
        if not sent:
            return
        flat = torch.cat([self.grads.pop(i).detach().reshape(-1).view(torch.uint8) for i in sent])
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat, group=self.group)
        for source, data in enumerate(gathered):
            if source == self.rank:
                continue
            start = 0
            for i in sent:
                n = self.layout.nbytes[i]
                place = self.layout.view(self.buffer, slot_of(source, self.rank), i, self.params[i])
                place.view(-1).view(torch.uint8).copy_(data[start:start + n])
                start += n


class IssueThread:
    """A transport's calls from the backward's hooks (``begin_step``, ``push``, ``close_group``)
    made by a worker thread, in the order the hooks made them; ``wait_group``, from finish, first
    waits until the worker has closed the group.

    Why: where the backward waits on the host (the default compile mode) the host time the hooks
    spend on copies, barriers and stream switches delays the backward's own launches one for one
    (about 9 ms a step at 2.7B on 2x H200: docs/training_step_notes.md, entry 18). Here a hook
    only marks where the compute stream stands (``mark()``: an event the copies then wait for) and
    enqueues; PyTorch's CUDA calls release the GIL while they run, so the worker's calls can run
    beside the backward's. ``busy_seconds`` sums the worker's time in the calls. Measured on 2x
    H200 (entry 20): alone it moved the hooks' time off that thread without shortening the
    backward (the driver's peer copies and the GIL are shared); with ``copy_graphs`` the backward
    took 12-15 ms less; ``defer_copies`` beat both, so it stays off by default."""

    def __init__(self, transport, *, mark: Callable[[], object], device: torch.device, timeout_s: float):
        self.transport = transport
        self._mark = mark
        self._timeout_s = timeout_s
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._closed: dict[int, threading.Event] = {}
        self._failure: BaseException | None = None
        self.busy_seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(device,), name="ddp-peer-issue", daemon=True)
        self._thread.start()

    def _run(self, device: torch.device) -> None:
        if device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(device)
        while (task := self._tasks.get()) is not None:
            call, args, done = task
            if self._failure is None:  # after a failure only the waiters are released
                start = time.perf_counter()
                try:
                    call(*args)
                except BaseException as exc:  # re-raised on the caller's thread, in wait_group
                    self._failure = exc
                self.busy_seconds += time.perf_counter() - start
            if done is not None:
                done.set()

    def begin_step(self) -> None:
        self._tasks.put((self.transport.begin_step, (self._mark(),), None))

    def push(self, grads: Sequence[tuple[int, torch.Tensor]], after: object = None) -> None:
        self._tasks.put((self.transport.push, (grads, self._mark() if after is None else after), None))

    def close_group(self, group: int, indices: Sequence[int]) -> None:
        done = self._closed[group] = threading.Event()
        self._tasks.put((self.transport.close_group, (group, indices), done))

    def wait_group(self, group: int) -> None:
        if not self._closed.pop(group).wait(self._timeout_s):
            raise RuntimeError(f"DDPPeer's issue thread did not close group {group} within {self._timeout_s:.0f} s")
        if self._failure is not None:
            raise RuntimeError(f"DDPPeer's issue thread failed: {self._failure!r}") from self._failure
        self.transport.wait_group(group)

    def stop(self) -> None:
        self._tasks.put(None)
        self._thread.join(timeout=self._timeout_s)


class DDPPeer(_DDPBase):
    """Gradients copied into every other rank's memory by copy engines and averaged inside the
    update (the module docstring). ``optimizer``: a ``GroupedOptimizer`` over the wrapped module
    whose group optimizers fold addends (``FusedAdamW``, ``MasterWeightAdamW``); each group is
    updated in ``finish_gradient_synchronization`` as soon as every peer's gradients of it have
    landed, so ``optimizer.step()`` afterwards has nothing left to do. ``.grad`` holds this
    rank's own gradient, not the average. The ranks agree on the order of the groups' barriers and
    updates through the gradient check: with ``check_gradients=False`` they keep the first one, the
    groups reversed. ``copy_graphs`` (GPUs): each group's copies replayed as one CUDA graph
    (``CopyGraphs``) instead of one call per gradient. ``issue_thread``: the hooks' transport
    calls made by a worker thread (``IssueThread``). ``defer_copies``: no hooks; every group's
    copies issued in finish, after the backward, each group's update waiting for its own copies
    (where the backward waits on the host and the update does not, the copies' host calls then
    cost the step nothing, and their transfers run beside the update instead of the backward).
    ``read_peers`` (two GPUs): no copies at all; each update reads the other rank's gradient over
    NVLink from the memory autograd put it in (``_ReadTransport``): after the backward, the ranks
    exchange where their gradients lie (a host round trip), a barrier on each compute stream waits
    until both backwards are done, the updates run, and a second barrier keeps either rank from
    reusing its gradients' memory before the other has read them. The exchanged rows say which
    gradients each rank has, so no separate agreement runs (``check_gradients`` has no effect).
    ``hook_seconds`` sums the host time spent inside the hooks, over steps."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None, *, optimizer,
                 copy_streams: int = 1, copy_graphs: bool = False, issue_thread: bool = False,
                 defer_copies: bool = False, read_peers: bool = False, check_gradients: bool = True,
                 timeout_s: float = 300.0):
        if not (hasattr(optimizer, "groups") and hasattr(optimizer, "step_group")
                and hasattr(optimizer, "fold_gradients")):
            raise ValueError("DDPPeer updates each group as its gradients land and folds the other ranks' gradients "
                             "into the update: pass a GroupedOptimizer of FusedAdamW or MasterWeightAdamW "
                             "(build_optimizer(model, OptimizerSpec(kind='fused', grouped=True, ...)))")
        if not (isinstance(copy_streams, int) and copy_streams >= 1):
            raise ValueError(f"copy_streams must be a positive integer, got {copy_streams!r}")
        if read_peers and (copy_streams != 1 or copy_graphs or issue_thread or defer_copies):
            raise ValueError("read_peers makes no copies: leave copy_streams, copy_graphs, issue_thread and "
                             "defer_copies at their defaults with it")
        # read_peers: the exchange's rows are the agreement (no second round trip)
        super().__init__(module, process_group, check_gradients=check_gradients and not read_peers)
        if self.world_size < 2:
            raise ValueError("DDPPeer needs at least 2 ranks (it copies gradients to the other ranks)")
        params = self._params
        refusal = read_peers_refusal(self.world_size, params[0].device) if read_peers else None
        if refusal is not None:
            raise ValueError(refusal)
        position = {id(p): i for i, p in enumerate(params)}
        self.optimizer = optimizer
        self._groups: list[list[int]] = []
        for g, group in enumerate(optimizer.groups):
            missing = [tuple(p.shape) for p in group if id(p) not in position]
            if missing:
                raise ValueError(f"optimizer group {g} has a parameter of shape {missing[0]} that is not a trainable "
                                 "parameter of the wrapped module")
            self._groups.append([position[id(p)] for p in group])
        covered = {i for group in self._groups for i in group}
        if len(covered) != len(params):
            raise ValueError(f"{len(params) - len(covered)} trainable parameters are in no optimizer group: the "
                             "groups must cover every parameter that gets a gradient")
        self._group_of = {i: g for g, group in enumerate(self._groups) for i in group}
        # the order of the groups' barriers and updates, alike on every rank (the barriers pair by
        # count): first the groups reversed, then the order in which the backward completed them, as
        # soon as every rank saw the same one (``_adopt``). The reversed groups are not that order:
        # block_groups lists the modules outside the blocks last, the embeddings among them, whose
        # gradient the backward produces last; while it stood third, every block's barrier waited
        # for the end of the backward and every block's update for the embeddings' copy.
        self._order = list(reversed(range(len(self._groups))))
        self._next_order: list[int] | None = None
        self.layout = _Layout(params)
        device = params[0].device
        self.read_peers = read_peers
        if read_peers:
            self.transport = _ReadTransport(process_group, device, timeout_s)
        elif device.type == "cuda":
            self.transport = _CopyEngineTransport(params, self.layout, process_group, self.rank, self.world_size,
                                                  device, timeout_s, copy_streams, copy_graphs)
        elif copy_graphs:
            raise ValueError("copy_graphs replays CUDA copies: on CPU ranks (gloo) DDPPeer all-gathers instead; "
                             "leave copy_graphs=False there")
        else:
            self.transport = _GatherTransport(params, self.layout, process_group, self.rank, self.world_size, device)
        # where the compute stream stands, for copies issued later or from another thread
        self._mark = (lambda: torch.cuda.current_stream().record_event()) if device.type == "cuda" else (lambda: None)
        self.issue = self.transport  # what the hooks call: the transport, or a thread that calls it
        if issue_thread:
            self.issue = IssueThread(self.transport, mark=self._mark, device=device, timeout_s=timeout_s)
        self.hook_seconds = 0.0
        self.defer_copies = defer_copies
        # the optimizer was built first, maybe from this rank's own initial weights
        broadcast_optimizer_state(optimizer, process_group)
        self._peer_grads: list | None = None  # read_peers: the other rank's gradients the update folds in
        if not read_peers:
            self._slots = [[self.layout.view(self.transport.buffer, s, i, p) for s in range(self.world_size - 1)]
                           for i, p in enumerate(params)]
            # each parameter's addend is the first peer's slot, into which finish adds the others'
            optimizer.fold_gradients({p: slots[0] for p, slots in zip(params, self._slots)},
                                     scale=1.0 / self.world_size)
        self._reset_step()
        for p in params if not (defer_copies or read_peers) else []:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _reset_step(self) -> None:
        if self._next_order is not None:  # between steps, so that no step mixes two orders
            self._order, self._next_order = self._next_order, None
        self._started = False
        self._completed: list[int] = []  # groups in the order their last gradient arrived
        self._arrived = [0] * len(self._groups)
        self._ready: set[int] = set()  # parameters whose gradient arrived this step
        self._pending: dict[int, list] = {}  # per group not complete yet: (index, gradient) to push
        self._closed = 0  # groups closed this step: a prefix of self._order

    def on_train_batch_start(self) -> None:
        self._reset_step()

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self.optimizer.fold_gradients(None)  # the next wrapper's (or none's) plain gradients
        if self.read_peers:  # collective: every rank unmaps the other's memory before either frees it
            self.transport.close()
            self._peer_grads = None
        if isinstance(self.issue, IssueThread):
            self.issue.stop()
            self.issue = self.transport

    @property
    def exchange_seconds(self) -> float | None:
        """``read_peers``: host time spent learning where the other rank's gradients lie (its round
        trip waits for the other host), summed over steps; ``None`` for the copies."""
        return self.transport.peers.seconds if self.read_peers else None

    @property
    def group_order(self) -> list[int]:
        """The optimizer groups' indices in the order their barriers close and their updates run."""
        return list(self._order)

    def _issue_order(self) -> list[int]:
        return [0 if i in self._ready else -1 for i in range(len(self._params))]

    def _order_proposal(self) -> list[int]:
        """Per group, its position in this step's completion order; -1 where it did not complete."""
        position = [-1] * len(self._groups)
        for k, g in enumerate(self._completed):
            position[g] = k
        return position

    def _adopt(self, proposal: list[int]) -> None:
        completed = sorted((k, g) for g, k in enumerate(proposal) if k >= 0)
        order = [g for _, g in completed]
        order += [g for g in self._order if proposal[g] < 0]  # groups that got no gradient: as before
        if order != self._order:
            self._next_order = order

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        start = time.perf_counter()
        if not self._started:
            self.issue.begin_step()
            self._started = True
        i = self._position[id(param)]
        self._ready.add(i)
        g = self._group_of[i]
        self._pending.setdefault(g, []).append((i, param.grad))
        self._arrived[g] += 1
        if self._arrived[g] == len(self._groups[g]):
            self._completed.append(g)
            self.issue.push(self._pending.pop(g))
            self._close_groups(complete_only=True)
        self.hook_seconds += time.perf_counter() - start

    def _close_groups(self, *, complete_only: bool) -> None:
        """Close groups in the fixed order (the ranks' barriers pair by count), while complete."""
        while self._closed < len(self._order):
            g = self._order[self._closed]
            if complete_only and self._arrived[g] < len(self._groups[g]):
                return
            self.issue.close_group(g, self._groups[g])
            self._closed += 1

    @torch.no_grad()
    def _finish_reading(self) -> None:
        """``read_peers``: the updates read the other rank's gradients where they lie."""
        self._ready = {i for i, p in enumerate(self._params) if p.grad is not None}
        first_barrier = False  # issued: then the second must be too
        try:
            grads = [p.grad if i in self._ready else None for i, p in enumerate(self._params)]
            peers = self.transport.peers
            (other, peer), = peers.exchange(grads).items()
            # both ranks hold both ranks' rows: a gradient one rank lacks raises, named, on both,
            # before either issues a barrier
            theirs = peers.present[other]
            lacking = [i for i in range(len(self._params)) if (i in self._ready) != theirs[i]]
            if lacking:
                orders = [[0 if i in self._ready else -1 for i in range(len(self._params))],
                          [0 if has else -1 for has in theirs]]
                raise RuntimeError(self._mismatch_message(lacking[0], orders[::-1] if other < self.rank else orders,
                                                          n_more=len(lacking) - 1))
            if not self._ready:
                return
            if peer is not self._peer_grads:  # the other rank's gradients moved (or the first step)
                self.optimizer.fold_gradients({self._params[i]: peer[i] for i in sorted(self._ready)},
                                              scale=1.0 / self.world_size)
                self._peer_grads = peer
            self.transport.barrier()  # both backwards done: every gradient either update reads is written
            first_barrier = True
            for g in self._order:
                if any(i in self._ready for i in self._groups[g]):
                    self.optimizer.step_group([self._params[i] for i in self._groups[g]])
        finally:
            if first_barrier:
                # both ranks' updates done: neither reuses its gradients' memory before the other
                # has read them (issued after a failed update too, or the other rank's would hang)
                self.transport.barrier()
            self._reset_step()

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if self.read_peers:
            self._finish_reading()
            return
        if self.defer_copies:  # no hooks: the gradients as the backward left them
            self._ready = {i for i, p in enumerate(self._params) if p.grad is not None}
        pending = self._start_check()
        try:
            if self.transport.host_collectives:  # its waits pair on the host: agree before any
                self._complete_check(pending)
                pending = None
            if self._ready:  # then the first gradient's hook began the step (deferred: no hook did)
                if self.defer_copies:
                    backward_done = self._mark()
                    self.issue.begin_step()
                for g in list(self._pending):  # groups some of whose parameters got no gradient on any rank
                    self.issue.push(self._pending.pop(g))
                if not self.defer_copies:
                    self._close_groups(complete_only=False)
                for g in self._order:
                    if self.defer_copies:  # the group's copies, its barrier, then its update at once:
                        # the first update is queued after one group's copies, not after all of them.
                        # The copies wait for the backward only: following the compute stream as it
                        # stands would queue each group's copies behind the previous group's update.
                        grads = [(i, self._params[i].grad) for i in self._groups[g] if i in self._ready]
                        if grads:
                            self.issue.push(grads, after=backward_done)
                        self.issue.close_group(g, self._groups[g])
                    self.issue.wait_group(g)
                    indices = [i for i in self._groups[g] if i in self._ready]
                    if not indices:
                        continue
                    for i in indices:  # more than one peer: their slots added into the first
                        for slot in self._slots[i][1:]:
                            self._slots[i][0].add_(slot)
                    self.optimizer.step_group([self._params[i] for i in self._groups[g]])
            # Copy engines: the updates above are only queued (each waits on the GPU for its group's
            # barrier), so the hosts' round trip runs while the GPU updates. Where the ranks
            # disagree, this raises after queueing updates whose barriers never pair; the error
            # names the parameter, and the GPU's barrier then fails at its timeout.
            self._complete_check(pending)
        finally:
            self._reset_step()
