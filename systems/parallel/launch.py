"""Start a group of ranks and give each a ready process group.

Two ways in, one worker contract ``fn(dist_ctx, *args)``:

- ``spawn(fn, world_size, backend)``: from a notebook or a script on one node. The ranks are
  fresh processes (multiprocessing "spawn"), so ``fn`` must be importable by name (defined in a
  module, not in the notebook). Each rank's return value comes back to the caller as a list.
- ``run_from_env(fn, backend)``: under ``torchrun`` (env:// rendezvous: RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT, LOCAL_RANK), so the same worker runs multi-node.

Backends: ``gloo`` runs on CPU; ``nccl`` runs one process per GPU and binds rank ``r`` to
``cuda:LOCAL_RANK`` with ``torch.cuda.set_device``. Every process group gets a collective
timeout, so a rank stuck in a collective with a dead peer errors out instead of hanging; a rank
that raises ends the whole run, and its traceback is re-raised in the caller as
``DistributedRunError``. A rank killed from outside Python (SIGKILL, a native crash) is named
with its signal or exit code, before the peers that then lose their connection to it.
"""

from __future__ import annotations

import datetime as _dt
import faulthandler
import gc
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")

# The GPU hosts require NVLink multicast (NVLS / symmetric-memory multicast) off; every process
# this module starts inherits these unless the caller already chose a value.
ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

DEFAULT_TIMEOUT_S = 300.0
_PORT_RETRIES = 3


class DistributedRunError(RuntimeError):
    """A rank of a spawned run failed; ``rank`` is the first one that did, ``details`` its traceback."""

    def __init__(self, message: str, *, rank: int | None = None, details: str = ""):
        super().__init__(message)
        self.rank = rank
        self.details = details


@dataclass
class DistContext:
    """What a worker gets as its first argument."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sync(self) -> None:
        """Wait for this rank's queued device work (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """All ranks meet here, with their device work finished."""
        self.sync()
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()
        self.sync()


def apply_env_defaults() -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now (bind to port 0 and read the number back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def resolve_backend(backend: str | None) -> str:
    if backend in (None, "auto"):
        return default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {backend!r}")
    return backend


def validate_world_size(world_size: int, backend: str) -> None:
    """Readable errors before any process starts."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs; use backend='gloo' on CPU")
        n_gpus = torch.cuda.device_count()
        if world_size > n_gpus:
            raise ValueError(f"backend 'nccl' runs one process per GPU: world_size {world_size} "
                             f"needs {world_size} GPUs, this machine has {n_gpus}")


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or anything else that set the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_process_group(*, backend: str, rank: int, world_size: int, local_rank: int,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the env:// rendezvous (MASTER_ADDR / MASTER_PORT must be set) and bind the device."""
    apply_env_defaults()
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU: this node has "
                             f"{torch.cuda.device_count()}")
        device = torch.device("cuda", local_rank)
        # set_device before init: NCCL creates its communicator on the current device, and every
        # later bare .cuda() / torch.empty(device="cuda") lands on this rank's GPU.
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size,
                                timeout=_dt.timedelta(seconds=timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                                timeout=_dt.timedelta(seconds=timeout_s))
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend,
                       device=device, timeout_s=timeout_s)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_importable(fn: Callable) -> None:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    # a script's __main__ is re-run by each child (as __mp_main__), so its functions resolve;
    # an interactive session's or a notebook's __main__ has no file and cannot be re-run
    interactive_main = module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None)
    if module is None or interactive_main or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"spawn needs a function the new processes can import by name; {qualname or fn!r} "
            f"is defined in {module or 'an unknown module'}{' (a notebook or script)' if module == '__main__' else ''}. "
            "Move it into a module (e.g. systems/bench/...) and import it.")


def _cpu_threads_per_rank(world_size: int) -> int:
    # ranks of a CPU run share the cores; without this each rank starts one thread per core and
    # they oversubscribe the machine (a 2-core box with 2 ranks runs far slower).
    return max(1, (os.cpu_count() or 1) // world_size)


def _worker(rank: int, fn: Callable, world_size: int, backend: str, master_addr: str, port: int,
            args: tuple, timeout_s: float, exchange_dir: str) -> None:
    """Entry point of one spawned rank: rendezvous, run fn, hand back its result or its error."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    apply_env_defaults()
    exchange = Path(exchange_dir)
    # a native abort (NCCL, gloo, a kernel) then prints every thread's Python stack to stderr
    faulthandler.enable()
    try:
        if backend == "gloo":
            torch.set_num_threads(_cpu_threads_per_rank(world_size))
        ctx = init_process_group(backend=backend, rank=rank, world_size=world_size, local_rank=rank,
                                 timeout_s=timeout_s)
        result = fn(ctx, *args)
        # reference cycles (autograd hooks, wrapped modules) can hold communication work past
        # destroy_process_group; free them while the group can still shut down in order
        gc.collect()
        destroy_process_group()
        tmp = exchange / f"rank{rank}.result.tmp"
        with tmp.open("wb") as f:
            pickle.dump(result, f)
        tmp.rename(exchange / f"rank{rank}.result")
    except BaseException as exc:
        # the time stamp tells the caller which rank failed first: the others usually fail
        # afterwards, in a collective whose peer has gone.
        record = {"time": time.time(), "rank": rank, "type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc()}
        (exchange / f"rank{rank}.error").write_bytes(pickle.dumps(record))
        raise
    # The result is handed back. Leave without interpreter teardown: gloo's background threads
    # can abort a finished rank there ("terminate called without an active exception", seen on
    # CI after a complete run), and that would fail a run whose every result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _collect_errors(exchange: Path) -> list[dict]:
    records = []
    for path in exchange.glob("rank*.error"):
        try:
            records.append(pickle.loads(path.read_bytes()))
        except Exception:  # a rank killed while writing: skip its partial file
            continue
    return sorted(records, key=lambda r: r["time"])


def _terminate(processes, grace_s: float = 5.0) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


@dataclass
class RankExit:
    """How a rank's process ended on its own (before the launcher terminated anything)."""

    rank: int
    exitcode: int  # negative: killed by signal -exitcode (multiprocessing's convention)
    time: float  # when the launcher saw it end (time.time(), comparable with the error records')

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        if self.signal_name:
            return f"was killed by signal {self.signal_name}"
        return f"exited with code {self.exitcode}"


def _wait_for_ranks(processes, *, deadline_s: float | None, grace_s: float = 2.0) -> list[RankExit]:
    """Wait until every rank has exited, or one has failed; returns the failed ranks' exits, in
    the order they were seen.

    After the first failure the others get ``grace_s`` to end by themselves (a peer that lost its
    partner usually raises within milliseconds); whatever is still running then is terminated,
    and those terminations are not reported as failures: the caller must tell a rank that died
    on its own (the cause) from one the launcher stopped (a consequence).
    """
    from multiprocessing.connection import wait

    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    failed: list[RankExit] = []
    start = time.monotonic()
    grace_end = None
    while pending:
        timeout = 0.5 if grace_end is None else max(0.0, grace_end - time.monotonic())
        for sentinel in wait(list(pending), timeout=timeout):
            rank = pending.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                failed.append(RankExit(rank, processes[rank].exitcode, time.time()))
        if failed and grace_end is None:
            grace_end = time.monotonic() + grace_s
        if grace_end is not None and time.monotonic() >= grace_end:
            break
        if grace_end is None and deadline_s is not None and time.monotonic() - start > deadline_s:
            _terminate(processes)
            raise DistributedRunError(f"distributed run did not finish within deadline_s={deadline_s:g} s; all "
                                      f"{len(processes)} ranks were terminated")
    _terminate(processes)
    return failed


def _failure_error(failed: list[RankExit], errors: list[dict], world_size: int) -> DistributedRunError:
    """One error naming the rank that failed first, then the others.

    A rank that ended without a Python error record died outside Python. Killed by a signal other
    than SIGABRT (SIGKILL from the OOM killer or a user, SIGSEGV) or exiting with a code of its
    own, it is the cause: its peers then fail in their collectives ("Connection reset by peer")
    and must not be blamed. SIGABRT is also how NCCL's and gloo's error handling end a rank
    whose peer has gone, so such a rank is ordered by time with the Python errors.
    """
    recorded = {e["rank"] for e in errors}
    # (order, time, rank, what happened, the same in a few words)
    events = [(0 if f.signal_name != "SIGABRT" else 1, f.time, f.rank,
               f"{f.describe()} without raising a Python error (killed from outside, e.g. by the kernel's "
               "OOM killer or kill -9, or crashed in native code)", f.describe())
              for f in failed if f.rank not in recorded]
    events += [(1, e["time"], e["rank"], f"failed with {e['type']}: {e['message']}", f"({e['type']})")
               for e in errors]
    if not events:
        return DistributedRunError("distributed run failed: "
                                   + ", ".join(f"rank {f.rank} {f.describe()}" for f in failed))
    events.sort(key=lambda e: e[:2])
    _, _, rank, text, _ = events[0]
    later = ", ".join(f"rank {r} {short}" for _, _, r, _, short in events[1:])
    details = errors[0]["traceback"] if errors else ""
    label = "" if not errors or errors[0]["rank"] == rank else f"rank {errors[0]['rank']}'s traceback:\n"
    return DistributedRunError(f"rank {rank} of {world_size} {text}" + (f"\n(then: {later})" if later else "")
                               + (f"\n\n{label}{details}" if details else ""), rank=rank, details=details)


def _spawn_once(fn, world_size, backend, args, timeout_s, deadline_s, master_addr, port):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="systems-dist-") as exchange_dir:
        exchange = Path(exchange_dir)
        context = mp.start_processes(
            _worker, args=(fn, world_size, backend, master_addr, port, tuple(args), timeout_s, exchange_dir),
            nprocs=world_size, join=False, start_method="spawn")
        try:
            failed = _wait_for_ranks(context.processes, deadline_s=deadline_s)
        finally:
            _terminate(context.processes)  # an interrupt (Ctrl-C) must not leave ranks behind
        if failed:
            raise _failure_error(failed, _collect_errors(exchange), world_size) from None
        results = []
        for rank in range(world_size):
            with (exchange / f"rank{rank}.result").open("rb") as f:
                results.append(pickle.load(f))
        return results


def spawn(fn: Callable[..., Any], world_size: int, backend: str = "auto", *, args: Sequence = (),
          timeout_s: float = DEFAULT_TIMEOUT_S, deadline_s: float | None = None,
          master_addr: str = "127.0.0.1", port: int | None = None) -> list[Any]:
    """Run ``fn(dist_ctx, *args)`` on ``world_size`` new processes of this node; their return values.

    timeout_s: the process group's collective timeout (a rank waiting longer on its peers raises);
        it also bounds the rendezvous, so keep it above the ranks' start-up skew (seconds).
    deadline_s: optional wall-clock limit for the whole run; past it every rank is terminated.
    port: the rendezvous port; by default a free one is picked (and re-picked if it was taken in
        the meantime).
    A failing rank ends every rank; the caller gets ``DistributedRunError`` naming the first rank
    that failed, with its exception and traceback.
    """
    backend = resolve_backend(backend)
    validate_world_size(world_size, backend)
    _check_importable(fn)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    apply_env_defaults()  # children inherit the parent's environment
    attempts = 1 if port is not None else _PORT_RETRIES
    for attempt in range(attempts):
        chosen = port if port is not None else find_free_port(master_addr)
        try:
            return _spawn_once(fn, world_size, backend, args, timeout_s, deadline_s, master_addr, chosen)
        except DistributedRunError as exc:
            # another process may grab the port between find_free_port and rank 0 binding it
            taken = "address already in use" in str(exc).lower() or "eaddrinuse" in str(exc).lower()
            if not taken or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def run_from_env(fn: Callable[..., Any], backend: str = "auto", *, args: Sequence = (),
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Inside a torchrun process: join the env:// rendezvous, run ``fn(dist_ctx, *args)``, tear down.

    Returns this rank's result. A failure raises here; torchrun then stops the other ranks.
    """
    if not under_torchrun():
        raise RuntimeError("run_from_env needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                           "(start the script with torchrun, or call spawn instead)")
    backend = resolve_backend(backend)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "gloo":
        torch.set_num_threads(_cpu_threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    ctx = init_process_group(backend=backend, rank=rank, world_size=world_size, local_rank=local_rank,
                             timeout_s=timeout_s)
    result = fn(ctx, *args)
    destroy_process_group()
    return result


def launch(fn: Callable[..., Any], world_size: int, backend: str = "auto", *, args: Sequence = (),
           timeout_s: float = DEFAULT_TIMEOUT_S, deadline_s: float | None = None) -> list[Any]:
    """``run_from_env`` under torchrun (this rank's result, as a one-element list), else ``spawn``."""
    if under_torchrun():
        return [run_from_env(fn, backend, args=args, timeout_s=timeout_s)]
    return spawn(fn, world_size, backend, args=args, timeout_s=timeout_s, deadline_s=deadline_s)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (dist.all_gather_object)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
