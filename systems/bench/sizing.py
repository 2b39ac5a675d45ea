"""Size a training run before renting it: per GPU, the memory one training step's state takes, the
bytes it communicates and the time those take, for any preset, world size and listed GPU.

    python -m systems.bench.sizing --model 2.7B 8B --world-size 2 8 --gpu H100
    python -m systems.bench.sizing --model 10B --world-size 8 --gpu A100 --memory-gb 80 --link-gb-s 300

Closed forms, not measurements (notebooks 04, 07, 08 and 10 measure):

- memory: the handouts' accounting (``systems.analysis.sharding``): fp32 weights and gradients,
  AdamW's two fp32 moments and torch AdamW's one fp32 temporary per updated parameter, per
  scheme (DDP; DDP with the sharded optimizer; ZeRO-1; FSDP). Activations are not counted: the
  ``left for activations`` column is what the device has for them, the CUDA context and the
  allocator's slack;
- communication: ring algorithms' bytes per rank per step (``communication_per_step``), timed at
  the datasheet NVLink egress (half the both-directions figure; ``--link-gb-s`` for another);
- computation: the step's model FLOPs (``systems.measure.flops``: matmuls, causal attention, LM
  head; backward 2x forward) per GPU at ``--mfu`` of the datasheet dense bf16 peak.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from systems.analysis.sharding import SCHEMES, communication_per_step, per_rank_bytes
from systems.bench.config import model_argument
from systems.config import get_config
from systems.measure.flops import train_step_flops
from systems.measure.hardware import GPU_PEAKS

GB = 1e9
SCHEME_NAMES = {"ddp": "DDP", "ddp_sharded": "DDP + sharded optimizer", "zero1": "ZeRO-1", "fsdp": "FSDP"}


def size_run(*, model: str, world_size: int, gpu: str, context_length: int, global_batch: int, mfu: float,
             memory_gb: float | None = None, link_gb_s: float | None = None) -> list[dict]:
    """One row per scheme: GB per GPU of each part of the training state, what is left of the
    device for activations, and the step's communication and computation times per GPU."""
    if gpu not in GPU_PEAKS:
        raise ValueError(f"unknown GPU {gpu!r}: one of {', '.join(GPU_PEAKS)}")
    peak = GPU_PEAKS[gpu]
    memory_gb = memory_gb if memory_gb is not None else peak.hbm_gb
    if memory_gb is None:
        raise ValueError(f"no memory size is listed for {gpu}: give it with --memory-gb")
    link_gb_s = link_gb_s if link_gb_s is not None else (peak.nvlink_gb_s / 2 if peak.nvlink_gb_s else None)
    for name, value in (("world_size", world_size), ("context_length", context_length),
                        ("global_batch", global_batch), ("memory_gb", memory_gb)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of the peak in (0, 1], got {mfu}")
    if link_gb_s is not None and not link_gb_s > 0:
        raise ValueError(f"link_gb_s must be positive, got {link_gb_s}")
    cfg = get_config(model)
    flops = train_step_flops(cfg, batch=global_batch, seq=context_length)
    compute_s = flops / world_size / (peak.bf16_tflops * 1e12 * mfu)
    comm = dict(zip(SCHEMES, communication_per_step(cfg.n_params, world_size)))
    rows = []
    for scheme in SCHEMES if world_size > 1 else ("ddp",):  # on one GPU every scheme is the same
        b = per_rank_bytes(cfg.n_params, world_size, scheme)
        total = b.step_peak
        sent = comm[scheme]["bytes_per_rank"]
        rows.append({"model": model, "params_B": cfg.n_params / 1e9, "gpus": world_size,
                     "scheme": SCHEME_NAMES[scheme] if world_size > 1 else "one GPU", "weights_GB": b.params / GB, "grads_GB": b.grads / GB,
                     "moments_GB": b.optimizer_state / GB, "temporaries_GB": b.optimizer_temporaries / GB,
                     "total_GB": total / GB, "left_for_activations_GB": memory_gb - total / GB,
                     "comm_GB": sent / GB, "comm_s": sent / (link_gb_s * GB) if link_gb_s else float("nan"),
                     "compute_s": compute_s})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.sizing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", type=model_argument, default=["2.7B"], help="presets (systems.config)")
    parser.add_argument("--world-size", nargs="+", type=int, default=[1, 8], help="GPUs")
    parser.add_argument("--gpu", default="H100", choices=list(GPU_PEAKS), help="a datasheet row (systems.measure.hardware)")
    parser.add_argument("--memory-gb", type=float, default=None, help="device memory, GB (default: the datasheet's)")
    parser.add_argument("--link-gb-s", type=float, default=None,
                        help="egress per GPU, GB/s (default: half the datasheet's both-directions NVLink)")
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=256, help="sequences per step, all GPUs together")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of the dense bf16 peak the step reaches")
    args = parser.parse_args(argv)
    try:
        rows = [row for model in args.model for world in args.world_size
                for row in size_run(model=model, world_size=world, gpu=args.gpu, context_length=args.context_length,
                                    global_batch=args.global_batch, mfu=args.mfu, memory_gb=args.memory_gb,
                                    link_gb_s=args.link_gb_s)]
    except ValueError as exc:
        parser.error(str(exc))
    peak = GPU_PEAKS[args.gpu]
    print(f"{peak.name}: {args.memory_gb or peak.hbm_gb:g} GB, dense bf16 {peak.bf16_tflops:g} TFLOP/s at MFU "
          f"{args.mfu:.0%}; {args.global_batch} x {args.context_length} tokens per step; fp32 weights, gradients "
          f"and AdamW moments (the handouts' accounting); activations not counted")
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:,.3g}"))
    short = [r for r in rows if r["left_for_activations_GB"] <= 0]
    if short:
        print("does not fit before activations: " + "; ".join(f"{r['model']} on {r['gpus']} ({r['scheme']})"
                                                               for r in short), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
