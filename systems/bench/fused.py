"""The fused training-step kernels against the unfused paths they replace, in one run.

- optimizer: one AdamW step over parameters shaped like a model preset's (our per-parameter
  loop, our multi-tensor ``foreach`` path, the Triton ``FusedAdamW`` with and without a bf16
  weight copy, and torch's ``AdamW(fused=True)``): median ms and the effective bandwidth of the
  bytes each element must move at least (p, m, v read and written, g read, the copy written).
- AdamW tiles (``--adamw-tiles 1024x8 2048x8``): the update the training step runs (split fp32
  masters, bf16 gradients) at each kernel tile (elements per program x warps), beside a copy of
  the same bytes in the same run, the roofline it can reach.
- loss: LM head + cross-entropy, forward + backward under bf16 autocast, unfused
  (``cross_entropy(h @ W.T)``) against ``linear_cross_entropy``: median ms, the TFLOP/s of the
  head's model FLOPs (``systems.measure.flops``' convention: the head's matmul, backward 2x) and
  peak memory above the inputs.
- rope: the fused QKV projection's output split into heads, q and k rotated, forward and forward +
  backward at the preset's batch 4 x 512 tokens, by the model's PyTorch ops (``qkv_heads``; eager,
  and compiled on CUDA as a compiled block runs them) against ``rope_qkv``'s Triton passes (CUDA):
  median ms and the bandwidth of the bytes each pass must move at least (forward: q's and k's
  features read and written; backward: dq, dk, dv read, the row's gradient written).

Times are ``systems.measure.timer.time_fn`` medians with their 10th / 90th percentiles.

    python -m systems.bench.fused --model 2.7B            # rows under build/fused/
    python -m systems.bench.fused --model xl-2025         # its head dim 64 fills rope's block
    python -m systems.bench.fused --model 2.7B --adamw-tiles 1024x8 2048x8 2048x16
"""

from __future__ import annotations

import argparse

import torch

from systems.bench.config import DEFAULT_OUT_ROOT, model_argument, out_file_argument
from systems.config import get_config
from systems.measure.devices import catch_oom, release_memory
from systems.measure.flops import FLOPS_PER_MAC, pass_factor
from systems.measure.results import ResultWriter
from systems.measure.timer import time_fn

GIB = 2**30


def _timed(fn, *, rep_ms: float, device: str) -> dict:
    """ms (median), p10_ms, p90_ms of ``fn``, after a warm-up of 30% of the repetition budget."""
    stats = time_fn(fn, device=device, warmup_ms=3 * rep_ms / 10, rep_ms=rep_ms)
    return dict(ms=stats["median_ms"], p10_ms=stats["p10_ms"], p90_ms=stats["p90_ms"])


def _meta_model(model: str) -> torch.nn.Module:
    """A TransformerLM preset on the meta device (shapes, no memory)."""
    from systems.model import TransformerLM

    with torch.device("meta"):
        return TransformerLM(get_config(model))


def preset_param_shapes(model: str) -> list[tuple[int, ...]]:
    """The parameter shapes of a TransformerLM preset."""
    return [tuple(p.shape) for p in _meta_model(model).parameters()]


def optimizer_rows(*, model: str, rep_ms: float = 400, device: str = "cuda") -> list[dict]:
    from systems.kernels.fused_adamw import FusedAdamW
    from systems.optim import AdamW

    shapes = preset_param_shapes(model)
    n = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    variants = {
        "ours_loop": (lambda: AdamW(params, lr=1e-4, foreach=False), 28),
        "ours_foreach": (lambda: AdamW(params, lr=1e-4, foreach=True), 28),
        "fused_triton": (lambda: FusedAdamW(params, lr=1e-4), 28),
        "fused_triton+bf16_copy": (lambda: FusedAdamW(
            params, lr=1e-4, low_precision_copies={p: torch.empty_like(p, dtype=torch.bfloat16) for p in params}), 30),
        "torch_fused": (lambda: torch.optim.AdamW(params, lr=1e-4, fused=True), 28),
    }
    rows = []
    for name, (make, bytes_per_elt) in variants.items():
        row = dict(bench="optimizer", model=model, variant=name, n_params=n, status="ok")
        opt = None
        with catch_oom() as oom:
            opt = make()
            opt.step()  # creates the state outside the timed region
            row.update(_timed(opt.step, rep_ms=rep_ms, device=device))
            row.update(min_bytes=bytes_per_elt * n, gbps=bytes_per_elt * n / (row["ms"] * 1e-3) / 1e9)
        if oom:
            row.update(status="oom", error=oom.message)
        opt = None
        release_memory()
        rows.append(row)
    return rows


def parse_tile(text: str) -> tuple[int, int]:
    """'1024x8' -> (1024, 8): elements per program x warps."""
    try:
        block, warps = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"an AdamW tile is BLOCKxWARPS, e.g. 1024x8; got {text!r}") from None
    return block, warps


def adamw_tile_rows(*, model: str, tiles: list[tuple[int, int]], rep_ms: float = 300,
                    device: str = "cuda") -> list[dict]:
    """The split-master update of ``model``'s parameters at each (block, num_warps) tile, and a
    copy of the bytes it must move (26 per element of a matmul weight, 28 of the fp32 embedding
    table and gains), one row each."""
    from systems.kernels.fused_adamw import MasterWeightAdamW
    from systems.train import matmul_weights_of

    lm = _meta_model(model)
    matmul = {id(p) for p in matmul_weights_of(lm)}
    # (shape, held in bf16 with a split master): the matmul weights, as MasterWeightAdamW holds them in the step
    shapes = [(tuple(p.shape), id(p) in matmul) for p in lm.parameters()]
    n = sum(torch.Size(s).numel() for s, _ in shapes)
    min_bytes = sum((26 if low else 28) * torch.Size(s).numel() for s, low in shapes)
    rows = []
    row = dict(bench="optimizer_tile", model=model, variant="copy", n_params=n, min_bytes=min_bytes, status="ok")
    with catch_oom() as oom:
        source = torch.empty(min_bytes // 2, dtype=torch.uint8, device=device)  # read + write: min_bytes
        row.update(_timed(source.clone, rep_ms=rep_ms, device=device))
        row["gbps"] = min_bytes / (row["ms"] * 1e-3) / 1e9
    if oom:
        row.update(status="oom", error=oom.message)
    source = None
    rows.append(row)
    for block, warps in tiles:
        row = dict(bench="optimizer_tile", model=model, variant="fused_triton_split", block=block, num_warps=warps,
                   n_params=n, min_bytes=min_bytes, status="ok")
        params = opt = None
        with catch_oom() as oom:
            gen = torch.Generator(device=device).manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s, _ in shapes]
            opt = MasterWeightAdamW(params, lr=1e-4, low_precision=[p for p, (_, low) in zip(params, shapes) if low],
                                    split_masters=True, block=block, num_warps=warps)
            for p in params:  # bf16 gradients for the bf16 weights, as the step's
                p.grad = torch.randn(p.shape, device=device, generator=gen, dtype=p.dtype) * 1e-3
            opt.step()  # launch tables and kernel compile outside the timed region
            row.update(_timed(opt.step, rep_ms=rep_ms, device=device))
            row["gbps"] = min_bytes / (row["ms"] * 1e-3) / 1e9
        if oom:
            row.update(status="oom", error=oom.message)
        params = opt = None
        release_memory()
        rows.append(row)
    return rows


def loss_rows(*, tokens: int, d_model: int, vocab: int, rep_ms: float = 300, device: str = "cuda") -> list[dict]:
    from systems.kernels.fused_linear_ce import linear_cross_entropy
    from systems.optim import cross_entropy

    gen = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(tokens, d_model, device=device, generator=gen) * 0.5).requires_grad_()
    weight = (torch.randn(vocab, d_model, device=device, generator=gen) * d_model ** -0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    impls = {
        "unfused": lambda: cross_entropy(hidden @ weight.T, targets),
        "fused": lambda: linear_cross_entropy(hidden, weight, targets, check_targets=False),
    }
    flops = FLOPS_PER_MAC * tokens * d_model * vocab * pass_factor("fwd_bwd")  # the head's matmul, backward 2x
    rows = []
    for name, loss_fn in impls.items():
        row = dict(bench="loss", variant=name, tokens=tokens, d_model=d_model, vocab=vocab, status="ok")

        def step():
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                loss = loss_fn()
            loss.backward()

        with catch_oom() as oom:
            step()
            if torch.device(device).type == "cuda":  # the allocator's high-water mark: CUDA only
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
            row.update(_timed(step, rep_ms=rep_ms, device=device))
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        if oom:
            row.update(status="oom", error=oom.message)
        hidden.grad = weight.grad = None
        release_memory()
        rows.append(row)
    return rows


def rope_rows(*, batch: int, seq: int, n_heads: int, d_head: int, rep_ms: float = 300, device: str = "cuda",
              dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    from systems.model import RotaryEmbedding, qkv_heads

    gen = torch.Generator(device=device).manual_seed(0)
    width = 3 * n_heads * d_head
    qkv = torch.randn(batch, seq, width, device=device, generator=gen).to(dtype).requires_grad_()
    grads = [torch.randn(batch, n_heads, seq, d_head, device=device, generator=gen).to(dtype) for _ in range(3)]
    cos, sin = RotaryEmbedding(d_head, seq, device=device).tables(torch.arange(seq, device=device))
    impls = {"pytorch": lambda t: qkv_heads(t, cos, sin, n_heads=n_heads)}
    if torch.device(device).type == "cuda":
        from systems.kernels.rope_qkv import rope_qkv

        impls["pytorch_compiled"] = torch.compile(impls["pytorch"])
        impls["triton"] = lambda t: rope_qkv(t, cos, sin, n_heads=n_heads)
    row_bytes = batch * seq * width * qkv.element_size()
    # forward: 2/3 of the row read, as much written (v stays a view); backward: 3/3 read, 3/3 written
    passes = {"forward": (lambda fn: fn(qkv), 4 / 3),
              "forward+backward": (lambda fn: torch.autograd.grad(fn(qkv), qkv, grads), 4 / 3 + 2)}
    rows = []
    for name, fn in impls.items():
        for phase, (run, rows_moved) in passes.items():
            row = dict(bench="rope", variant=name, phase=phase, batch=batch, seq=seq, n_heads=n_heads,
                       d_head=d_head, dtype=str(dtype).removeprefix("torch."), status="ok")
            with catch_oom() as oom:
                row.update(_timed(lambda: run(fn), rep_ms=rep_ms, device=device))
                row.update(min_bytes=rows_moved * row_bytes, gbps=rows_moved * row_bytes / (row["ms"] * 1e-3) / 1e9)
            if oom:
                row.update(status="oom", error=oom.message)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=model_argument, default="2.7B", help="preset whose parameter shapes the optimizer updates")
    parser.add_argument("--out", type=out_file_argument, default=f"{DEFAULT_OUT_ROOT}/fused/10_fused_kernels.jsonl")
    parser.add_argument("--adamw-tiles", nargs="+", default=None, metavar="BLOCKxWARPS",
                        help="time only the split-master AdamW update at these kernel tiles (e.g. 1024x8 2048x8), "
                             "beside a copy of the same bytes")
    args = parser.parse_args(argv)
    try:
        tiles = [parse_tile(t) for t in args.adamw_tiles] if args.adamw_tiles else None
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        parser.error("the fused kernels are timed on a GPU; none is visible")
    writer = ResultWriter(args.out)

    def emit(rows: list[dict]) -> None:
        # each kernel's rows are written as soon as they are measured: an interrupted run keeps them
        for row in rows:
            writer.write(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    if tiles:
        emit(adamw_tile_rows(model=args.model, tiles=tiles))
        return 0
    cfg, cfg8b = get_config(args.model), get_config("8B")
    emit(optimizer_rows(model=args.model))
    for case in (dict(tokens=4 * 512, d_model=cfg.d_model, vocab=cfg.vocab_size),
                 dict(tokens=32768, d_model=cfg8b.d_model, vocab=cfg8b.vocab_size)):
        emit(loss_rows(**case))
    emit(rope_rows(batch=4, seq=512, n_heads=cfg.n_heads, d_head=cfg.d_head))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
