"""How much HBM bandwidth a memory-bound kernel pulls from N SMs: the question behind overlapping
the optimizer's update with the backward's matmuls (docs/training_step_notes.md, entries 4 and 5).

An update hidden under the backward must move its bytes on the SMs the matmuls leave it. If one SM
can pull only its fair share of the chip's bandwidth (about 3 TB/s / 132), N SMs move N/132 of
it and the overlap saves nothing; if one SM can pull several times that, a few SMs move most of
it. This copies a buffer with a persistent kernel of one program per SM on N SMs, through plain
loads and stores (threads hold the data: in-flight bytes are bounded by registers and warps) and
through TMA tensor descriptors (the copy engine moves tiles into shared memory, the threads only
issue), and reports the bandwidth (bytes read + written per second) and its share of the
all-SM plain copy in the same run.

    python -m systems.bench.sm_bandwidth --sms 8 16 32 66 132 --out build/sm_bandwidth/sm_bandwidth.jsonl
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

from systems.bench.config import DEFAULT_OUT_ROOT, out_file_argument
from systems.measure.results import ResultWriter
from systems.measure.timer import time_fn
from systems.train import matmul_sm_carveout

ROW = 256  # fp32 elements per row: 1 KiB, the widest TMA box dimension
BLOCK_ROWS = 32  # rows per tile: 32 KiB per load


@triton.jit
def copy_kernel(src, dst, n_rows, ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, TMA: tl.constexpr,
                STAGES: tl.constexpr):
    """Persistent copy of an (n_rows, ROW) buffer: program p copies row tiles p, p + P, p + 2P, ...
    (P programs), through tensor descriptors (TMA) or plain pointer loads and stores."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, BLOCK_ROWS)
    if TMA:
        src_desc = tl.make_tensor_descriptor(src, shape=[n_rows, ROW], strides=[ROW, 1], block_shape=[BLOCK_ROWS, ROW])
        dst_desc = tl.make_tensor_descriptor(dst, shape=[n_rows, ROW], strides=[ROW, 1], block_shape=[BLOCK_ROWS, ROW])
    for tile in tl.range(pid, n_tiles, programs, num_stages=STAGES):
        if TMA:
            dst_desc.store([tile * BLOCK_ROWS, 0], src_desc.load([tile * BLOCK_ROWS, 0]))
        else:
            rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            offs = rows[:, None] * ROW + tl.arange(0, ROW)[None, :]
            keep = rows[:, None] < n_rows
            tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)


def copy(src: torch.Tensor, dst: torch.Tensor, *, programs: int, tma: bool, warps: int, stages: int) -> None:
    """Copy ``src`` into ``dst`` (contiguous fp32, a multiple of ROW elements) with ``programs``
    persistent programs."""
    if src.shape != dst.shape or src.dtype != torch.float32 or src.numel() % ROW:
        raise ValueError(f"copy takes two fp32 buffers of one shape and a multiple of {ROW} elements")
    if tma:
        from systems.attention.flash_triton.launch import _ensure_tma_allocator

        _ensure_tma_allocator()  # device-side descriptors need Triton's scratch allocator
    copy_kernel[(programs,)](src, dst, src.numel() // ROW, ROW=ROW, BLOCK_ROWS=BLOCK_ROWS, TMA=tma, STAGES=stages,
                             num_warps=warps)


# (path, warps, stages): plain loads with more warps hold more bytes in flight; TMA with deeper pipelines
PATHS = (("plain", 8, 1), ("plain", 32, 1), ("plain", 8, 3), ("tma", 4, 2), ("tma", 4, 4))


def measure(*, sms: list[int], gib: float = 1.0, rep_ms: float = 100, out: str | None = None) -> list[dict]:
    device = torch.device("cuda")
    count = torch.cuda.get_device_properties(device).multi_processor_count
    bad = [n for n in sms if not 1 <= n <= count]
    if bad:
        raise ValueError(f"--sms {bad}: this GPU has {count} SMs; give counts from 1 to {count}")
    n = int(gib * 2**30 / 4) // ROW * ROW
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    moved = 2 * src.numel() * 4  # bytes read + written
    writer = ResultWriter(out) if out else None
    rows, reference = [], None
    for (path, warps, stages), programs in itertools.product(PATHS, [count, *sorted(set(sms) - {count})]):
        row = dict(path=path, warps=warps, stages=stages, sms=programs, gpu_sms=count, bytes=moved, status="ok")
        try:
            copy(src, dst, programs=programs, tma=path == "tma", warps=warps, stages=stages)
            torch.testing.assert_close(dst, src, rtol=0, atol=0)
            stats = time_fn(lambda: copy(src, dst, programs=programs, tma=path == "tma", warps=warps, stages=stages),
                            device=device, rep_ms=rep_ms)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, the sweep goes on
            row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        else:
            row.update(ms=stats["median_ms"], p10_ms=stats["p10_ms"], p90_ms=stats["p90_ms"],
                       gb_per_s=moved / (stats["median_ms"] * 1e-3) / 1e9)
            row["gb_per_s_per_sm"] = row["gb_per_s"] / programs
            if reference is None and path == "plain" and programs == count:
                reference = row["gb_per_s"]
            row["share_of_all_sm_plain"] = row["gb_per_s"] / reference if reference else None
        rows.append(row)
        if writer is not None:
            writer.write(row)
        shown = f"{row['gb_per_s']:8.0f} GB/s ({row['gb_per_s_per_sm']:6.1f} per SM)" if row["status"] == "ok" \
            else row["error"]
        print(f"{path:>5} warps {warps:2d} stages {stages} on {programs:3d} SMs: {shown}", flush=True)
    return rows


def green_stream(sms: int, device: torch.device):
    """(green context, its stream): kernels on the stream run on ``sms`` SMs only. The context must
    stay referenced while the stream is used."""
    from torch.cuda.green_contexts import GreenContext

    context = GreenContext.create(num_sms=sms, device_id=device.index or 0)
    return context, context.Stream()


def overlap(*, sms: list[int], gib: float = 1.0, gemms: int = 40, rep_ms: float = 100,
            out: str | None = None) -> list[dict]:
    """The premise of hiding a memory-bound kernel under matmuls, measured: ``gemms`` bf16 matmuls
    (2048 x 2560 by 2560 x 10240, the 2.7B model's SwiGLU shape at 2048 tokens) on the current stream,
    a copy of ``gib`` GiB on a green-context stream confined to N SMs, each alone and then
    launched together: with the matmuls on every SM, and with them planned for N SMs fewer
    (``matmul_sm_carveout``: a persistent matmul's CTAs then need no SM the copy holds). Wall
    times from events on the current stream (which waits for the copy)."""
    device = torch.device("cuda")
    count = torch.cuda.get_device_properties(device).multi_processor_count
    n = int(gib * 2**30 / 4) // ROW * ROW
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    a = torch.randn(2048, 2560, device=device, dtype=torch.bfloat16)
    b = torch.randn(2560, 10240, device=device, dtype=torch.bfloat16)
    writer = ResultWriter(out) if out else None
    main_stream = torch.cuda.current_stream(device)

    def matmuls():
        for _ in range(gemms):
            torch.mm(a, b)

    def copy_queued(stream, programs):  # the copy on ``stream``, after what the main stream queued
        stream.wait_stream(main_stream)
        with torch.cuda.stream(stream):
            copy(src, dst, programs=programs, tma=False, warps=8, stages=1)

    def copy_on(stream, programs):
        copy_queued(stream, programs)
        main_stream.wait_stream(stream)

    def copy_beside_matmuls(stream, programs, carveout):
        copy_queued(stream, programs)
        with matmul_sm_carveout(carveout, device):
            matmuls()
        main_stream.wait_stream(stream)

    def carved_matmuls(carveout):
        with matmul_sm_carveout(carveout, device):
            matmuls()

    def timed(fn) -> float:
        # events on the current stream, which every fn ends by waiting for the copy's stream
        return time_fn(fn, device=device, rep_ms=rep_ms)["median_ms"]

    rows = []
    gemm_ms = timed(matmuls)
    all_sms_ms = timed(lambda: copy(src, dst, programs=count * 4, tma=False, warps=8, stages=1))
    for n_sms in sms:
        row = dict(sms=n_sms, gpu_sms=count, gemms=gemms, bytes=2 * n * 4, gemm_ms=gemm_ms,
                   copy_all_sms_ms=all_sms_ms, status="ok")
        try:
            context, stream = green_stream(n_sms, device)  # the context stays referenced while its stream runs
            copy_ms = timed(lambda: copy_on(stream, n_sms * 8))
            both_ms = timed(lambda: copy_beside_matmuls(stream, n_sms * 8, 0))
            carved_gemm_ms = timed(lambda: carved_matmuls(n_sms))
            both_carved_ms = timed(lambda: copy_beside_matmuls(stream, n_sms * 8, n_sms))
        except Exception as exc:  # noqa: BLE001 - no green contexts here: a row, the sweep goes on
            row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        else:
            row.update(copy_green_ms=copy_ms, both_ms=both_ms, serial_ms=gemm_ms + all_sms_ms,
                       copy_green_gb_per_s=2 * n * 4 / (copy_ms * 1e-3) / 1e9, carved_gemm_ms=carved_gemm_ms,
                       both_carved_ms=both_carved_ms)
            row["both_over_serial"] = both_ms / row["serial_ms"]
            row["both_carved_over_serial"] = both_carved_ms / row["serial_ms"]
        rows.append(row)
        if writer is not None:
            writer.write(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, nargs="+", default=[8, 16, 32, 66])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the copied buffer")
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--overlap", action="store_true",
                        help="instead: matmuls beside a copy confined to N SMs by a green context (overlap)")
    parser.add_argument("--out", type=out_file_argument, default=f"{DEFAULT_OUT_ROOT}/sm_bandwidth/sm_bandwidth.jsonl")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this measures a GPU's memory bandwidth and needs CUDA")
    try:
        if args.overlap:
            overlap(sms=args.sms, gib=args.gib, rep_ms=args.rep_ms, out=args.out)
        else:
            measure(sms=args.sms, gib=args.gib, rep_ms=args.rep_ms, out=args.out)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
