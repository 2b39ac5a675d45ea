"""Named hardware peaks (dense, no sparsity) for MFU, and the memory and NVLink figures the
analyses use; datasheet numbers, matched by GPU name.

MFU is reported against these named peaks; notebooks may also divide by a ceiling
measured on the machine (systems.measure.hardware.measure_matmul_tflops).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from systems.measure.flops import FLOPS_PER_MAC


@dataclass(frozen=True)
class GPUPeak:
    name: str
    bf16_tflops: float
    fp16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    hbm_tb_s: float
    # capacity and interconnect, filled where the workbook uses them (None: not given here)
    hbm_gb: float | None = None  # device memory, decimal GB (1e9 bytes)
    nvlink_gb_s: float | None = None  # NVLink per GPU, both directions summed, as datasheets state it

    def tflops(self, precision: str, tf32: bool = False) -> float:
        if precision == "bf16":
            return self.bf16_tflops
        if precision == "fp16":
            return self.fp16_tflops
        if precision == "fp32":
            return self.tf32_tflops if tf32 else self.fp32_tflops
        raise ValueError(f"unknown precision {precision!r}")


# Order matters: the first key found in the device name as a whole word wins ("H100 PCIe" before "H100").
# hbm_gb and nvlink_gb_s: NVIDIA's H100 and H200 datasheets (H100 SXM 80 GB, H200 SXM 141 GB HBM3e;
# NVLink 4, 900 GB/s).
GPU_PEAKS: dict[str, GPUPeak] = {
    "H200": GPUPeak("H200 SXM", 989.4, 989.4, 494.7, 66.9, 4.8, hbm_gb=141.0, nvlink_gb_s=900.0),
    "H100 PCIe": GPUPeak("H100 PCIe", 756.0, 756.0, 378.0, 51.2, 2.0),
    "H100": GPUPeak("H100 SXM", 989.4, 989.4, 494.7, 66.9, 3.35, hbm_gb=80.0, nvlink_gb_s=900.0),
    "B200": GPUPeak("B200", 2250.0, 2250.0, 1100.0, 80.0, 8.0),
    "A100": GPUPeak("A100 SXM", 312.0, 312.0, 156.0, 19.5, 2.0),
    "A10G": GPUPeak("A10G", 70.0, 70.0, 35.0, 31.2, 0.6),
    "L4": GPUPeak("L4", 121.0, 121.0, 60.0, 30.3, 0.3),
    "RTX 4090": GPUPeak("RTX 4090", 165.2, 165.2, 82.6, 82.6, 1.0),
}


def lookup_peak(device_name: str | None) -> GPUPeak | None:
    """The peak table row for a CUDA device name, or None for an unknown GPU (then no MFU)."""
    if not device_name:
        return None
    for key, peak in GPU_PEAKS.items():
        # a whole model name ("GH200" is not an H200), and an NVL card is none of these rows
        # (its clocks and memory differ): no peak is better than another GPU's
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name) and ("NVL" in key or "NVL" not in device_name):
            return peak
    return None


def measure_matmul_tflops(n: int = 8192, dtype=None, reps: int = 20) -> float:
    """Achieved TFLOP/s of an n^3 matmul on the current CUDA device (random data; the median of
    ``triton.testing.do_bench``'s calls over ``reps`` x 10 ms of repetitions)."""
    import torch
    import triton.testing

    dtype = dtype or torch.bfloat16
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = triton.testing.do_bench(lambda: a @ b, rep=reps * 10, return_mode="median")
    return FLOPS_PER_MAC * n**3 / (ms * 1e-3) / 1e12
