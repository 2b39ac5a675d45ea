"""Tile-size exploration for the FlashAttention-2 Triton kernels, one kernel at a time.

The autotuner inside ``systems.attention.flash_triton`` picks among a short list of configs
per (sequence bucket, head dim, causal, dtype); this tool measures a longer list of candidates
for each of the three kernels (forward, dK/dV, dQ) directly, next to torch SDPA's flash and cuDNN
backends at the same shapes, so the short list can be chosen from data. It launches the kernels
with explicit tile sizes, bypassing the autotuner, and writes one row per (shape, kernel,
candidate) as it goes.

    python -m systems.flash_tuning --out results/06_flash_attention_tuning.jsonl
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from .devices import DTYPES, release_memory
from .results import ResultWriter

# (block_m, block_n, num_warps, num_stages); for dK/dV block_m is the streamed query tile and
# block_n the resident key tile, for dQ block_m is the resident query tile.
CANDIDATES: dict[str, list[tuple[int, int, int, int]]] = {
    "fwd": [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3),
            (128, 128, 8, 2), (128, 32, 4, 4), (64, 32, 4, 4)],
    "dkdv": [(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3),
             (64, 128, 8, 2), (16, 64, 4, 4), (16, 128, 4, 4)],
    "dq": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (128, 32, 8, 4),
           (128, 128, 8, 2), (64, 32, 4, 4), (32, 64, 4, 3)],
}

SHAPES = [(1, 1024, 64), (1, 4096, 64), (1, 16384, 64), (1, 65536, 64),
          (1, 1024, 128), (1, 4096, 128), (1, 16384, 128), (1, 65536, 128),
          (16, 16384, 64)]  # (batch, seq, head dim); the last is the leaderboard shape


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    do: torch.Tensor
    delta: torch.Tensor


def make_inputs(*, batch: int, seq: int, d: int, dtype: str, device: str = "cuda") -> Inputs:
    from .attention.flash_triton import flash_forward_triton

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(batch, seq, d, device=device, dtype=DTYPES[dtype], generator=gen) for _ in range(4))
    o, lse = flash_forward_triton(q, k, v, True)
    delta = (o.float() * do.float()).sum(-1)
    return Inputs(q, k, v, o, lse, do, delta)


# each kernel's two tile-size meta-parameters, in the (block_m, block_n) order of CANDIDATES
TILE_NAMES = {"fwd": ("BLOCK_M", "BLOCK_N"), "dkdv": ("BLOCK_M1", "BLOCK_N1"), "dq": ("BLOCK_M2", "BLOCK_N2")}


def launch(kernel: str, x: Inputs, cfg: tuple[int, int, int, int], *, is_causal: bool = True):
    """A zero-argument closure launching ``kernel`` once with the tile sizes of ``cfg``, through
    the kernel module's own launchers (its outputs are the closure's ``o``, ``dk``/``dv`` or ``dq``)."""
    from .attention import flash_triton as ft

    if kernel not in TILE_NAMES:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {list(TILE_NAMES)}")
    bm, bn, warps, stages = cfg
    m_name, n_name = TILE_NAMES[kernel]
    config = {m_name: bm, n_name: bn, "num_warps": warps, "num_stages": stages}
    if kernel == "fwd":
        o, lse = torch.empty_like(x.q), torch.empty_like(x.lse)
        return lambda: ft.launch_forward(x.q, x.k, x.v, o, lse, is_causal, config=config)
    if kernel == "dkdv":
        dk, dv = torch.empty_like(x.k), torch.empty_like(x.v)
        return lambda: ft.launch_dkdv(x.q, x.k, x.v, x.do, x.lse, x.delta, dk, dv, is_causal, config=config)
    dq = torch.empty_like(x.q)
    delta = torch.empty_like(x.delta)  # the dQ kernel writes D; the dK/dV candidates read x.delta
    return lambda: ft.launch_dq(x.q, x.k, x.v, x.o, x.do, x.lse, delta, dq, is_causal, config=config)


def explore(*, shapes=SHAPES, candidates=CANDIDATES, dtype: str = "bf16", out_path: str | None = None,
            rep_ms: float = 30) -> list[dict]:
    """Every candidate of every kernel at every shape, plus SDPA flash / cuDNN fwd and bwd."""
    import triton.testing

    from .attention_bench import attention_flops, time_attention

    writer = ResultWriter(out_path) if out_path else None
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        if writer is not None:
            writer.write(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    for batch, seq, d in shapes:
        shape = dict(batch=batch, seq=seq, d=d, dtype=dtype)
        fwd_flops = attention_flops(batch=batch, n_q=seq, n_k=seq, d=d, is_causal=True, pass_="fwd")
        for impl in ("sdpa_flash", "sdpa_cudnn"):
            r = time_attention(impl, batch=batch, heads=1, seq=seq, d=d, dtype=dtype, rep_ms=rep_ms)
            emit(dict(**shape, kernel="baseline", impl=impl, status=r["status"], fwd_ms=r.get("fwd_ms"),
                      bwd_ms=r.get("bwd_ms"), e2e_ms=r.get("e2e_ms")))
        x = make_inputs(batch=batch, seq=seq, d=d, dtype=dtype)
        for kernel, cands in candidates.items():
            # FLOPs each kernel really performs: the dK/dV and dQ kernels both recompute S and dP
            flops = fwd_flops * {"fwd": 1.0, "dkdv": 2.0, "dq": 1.5}[kernel]
            for cfg in cands:
                row = dict(**shape, kernel=kernel, impl="triton", block_m=cfg[0], block_n=cfg[1],
                           warps=cfg[2], stages=cfg[3], status="ok")
                try:
                    fn = launch(kernel, x, cfg)
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")
                    row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: a row, go on
                    row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                emit(row)
        del x
        release_memory()
    return rows


def host_overhead(*, shapes=((1, 1024, 64), (1, 4096, 128)), dtype: str = "bf16", calls: int = 200,
                  device: str = "cuda") -> list[dict]:
    """Host (CPU) time per call of each path, the GPU left to run behind: microseconds to enqueue
    our public forward, our public forward + backward, one direct forward-kernel launch, and SDPA's
    forward + backward. When a path's host time exceeds its kernels' device time, the GPU waits
    and the path's measured latency is the host time (the short-sequence points of the sweep)."""
    import time

    from .attention.flash_triton import flash_attention_triton
    from .attention_bench import get_impl

    rows = []
    for batch, seq, d in shapes:
        x = make_inputs(batch=batch, seq=seq, d=d, dtype=dtype, device=device)
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        sdpa = get_impl("sdpa_flash")
        paths = {
            "public_fwd": lambda: flash_attention_triton(x.q, x.k, x.v, is_causal=True),
            "public_fwd_bwd": lambda: flash_attention_triton(q, k, v, is_causal=True).backward(x.do),
            "kernel_fwd": launch("fwd", x, CANDIDATES["fwd"][1]),
            "sdpa_flash_fwd_bwd": lambda: sdpa(q[None], k[None], v[None], True).backward(x.do[None]),
        }
        for name, fn in paths.items():
            fn()  # compile, autotune, allocate outside the timed loop
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host_s = time.perf_counter() - t0  # enqueue time only: no synchronisation inside
            if device == "cuda":
                torch.cuda.synchronize()
            total_s = time.perf_counter() - t0
            rows.append(dict(batch=batch, seq=seq, d=d, dtype=dtype, path=name, calls=calls,
                             host_us_per_call=host_s / calls * 1e6, wall_us_per_call=total_s / calls * 1e6))
            q.grad = k.grad = v.grad = None
    return rows


def best_configs(rows: list[dict]) -> dict:
    """(kernel, batch, seq, d) -> the fastest candidate's (block_m, block_n, warps, stages) and ms."""
    best: dict = {}
    for r in rows:
        if r.get("impl") != "triton" or r.get("status") != "ok":
            continue
        key = (r["kernel"], r["batch"], r["seq"], r["d"])
        if key not in best or r["ms"] < best[key][1]:
            best[key] = ((r["block_m"], r["block_n"], r["warps"], r["stages"]), r["ms"])
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/06_flash_attention_tuning.jsonl")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--rep-ms", type=float, default=30)
    parser.add_argument("--host-overhead", action="store_true",
                        help="only measure the host time per call of each path (see host_overhead)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the exploration times GPU kernels and needs CUDA")
    if args.host_overhead:
        writer = ResultWriter(args.out)
        for row in host_overhead(dtype=args.dtype):
            writer.write(row)
            print(f"{row['path']:>20} seq {row['seq']:6d} d {row['d']:3d}: host {row['host_us_per_call']:8.1f} us, "
                  f"wall {row['wall_us_per_call']:8.1f} us per call")
        return 0
    rows = explore(dtype=args.dtype, out_path=args.out, rep_ms=args.rep_ms)
    for (kernel, batch, seq, d), (cfg, ms) in sorted(best_configs(rows).items(),
                                                     key=lambda kv: (kv[0][0], kv[0][3], kv[0][1], kv[0][2])):
        print(f"best {kernel:5s} batch {batch:2d} seq {seq:6d} d {d:3d}: {cfg} {ms:.4f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

