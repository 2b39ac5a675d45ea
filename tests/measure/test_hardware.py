"""systems.measure.hardware: named peaks by GPU name (measure_matmul_tflops needs a GPU)."""

import pytest
import torch

from systems.measure.hardware import GPU_PEAKS, lookup_peak, measure_matmul_tflops


def test_unknown_gpu_has_no_peak():
    assert lookup_peak("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert lookup_peak("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert lookup_peak("Mystery Accelerator 9000") is None
    assert lookup_peak("NVIDIA A100-SXM4-80GB").name == "A100 SXM"
    # another GPU whose name contains a listed one gets no peak rather than a wrong one
    assert lookup_peak("NVIDIA GH200 480GB") is None and lookup_peak("NVIDIA H100 NVL") is None


def test_peak_by_precision():
    h100 = GPU_PEAKS["H100"]
    assert h100.tflops("bf16") == h100.bf16_tflops
    assert h100.tflops("fp32") == h100.fp32_tflops and h100.tflops("fp32", tf32=True) == h100.tf32_tflops
    with pytest.raises(ValueError, match="unknown precision"):
        h100.tflops("fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measured_matmul_rate_is_below_the_named_peak():
    peak = lookup_peak(torch.cuda.get_device_name())
    rate = measure_matmul_tflops(n=4096, reps=5)
    assert rate > 0
    if peak is not None:
        assert rate < 1.05 * peak.bf16_tflops  # a datasheet peak is an upper bound, 5 % for clock boost
