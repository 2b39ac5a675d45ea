"""The sweep's ratio summaries (pure pandas) and the FLOP count behind its TFLOP/s columns."""

import math

import pandas as pd
import pytest

from systems.bench.flash import attention_flops, geomean_ratios, speed_ratios


def _row(impl, seq, d, fwd, bwd, dtype="bf16", status="ok"):
    return dict(impl=impl, seq=seq, d=d, dtype=dtype, status=status, fwd_ms=fwd, bwd_ms=bwd)


def test_speed_ratios_and_geomeans():
    sweep = pd.DataFrame([
        _row("triton", 1024, 64, 1.0, 2.0), _row("sdpa_cudnn", 1024, 64, 2.0, 2.0), _row("sdpa_flash", 1024, 64, 4.0, 1.0),
        _row("triton", 4096, 64, 2.0, 4.0), _row("sdpa_cudnn", 4096, 64, 1.0, 8.0), _row("sdpa_flash", 4096, 64, 2.0, 4.0),
        # outside the grid: a short sequence, another head dim, fp32: all ignored
        _row("triton", 512, 64, 1.0, 1.0), _row("sdpa_cudnn", 512, 64, 100.0, 100.0),
        _row("triton", 1024, 32, 1.0, 1.0), _row("sdpa_cudnn", 1024, 32, 100.0, 100.0),
        _row("triton", 1024, 128, 1.0, 1.0, dtype="fp32"), _row("sdpa_cudnn", 1024, 128, 9.0, 9.0, dtype="fp32"),
        # cuDNN failed here: the point is missing from its columns, not a zero
        _row("triton", 8192, 128, 1.0, 1.0), _row("sdpa_cudnn", 8192, 128, None, None, status="oom"),
        _row("sdpa_flash", 8192, 128, 1.0, 1.0),
    ])
    ratios = speed_ratios(sweep)
    assert list(ratios.index) == [(64, 1024), (64, 4096), (128, 8192)]
    assert ratios.loc[(64, 1024), "fwd vs sdpa_cudnn"] == 2.0 and ratios.loc[(64, 4096), "bwd vs sdpa_cudnn"] == 2.0
    assert math.isnan(ratios.loc[(128, 8192), "fwd vs sdpa_cudnn"])
    gm = geomean_ratios(ratios).set_index(["pass", "baseline"])
    # fwd vs cuDNN: 2.0 and 0.5 -> 1.0, exactly the target; bwd vs flash: 0.5, 1.0, 1.0
    assert gm.loc[("fwd", "sdpa_cudnn"), "geomean speed"] == pytest.approx(1.0)
    assert gm.loc[("fwd", "sdpa_cudnn"), "met"] and gm.loc[("fwd", "sdpa_cudnn"), "missing"] == 1
    assert gm.loc[("bwd", "sdpa_flash"), "geomean speed"] == pytest.approx(0.5 ** (1 / 3))
    assert not gm.loc[("bwd", "sdpa_flash"), "met"] and gm.loc[("bwd", "sdpa_flash"), "points"] == 3


def test_attention_flops_causal_halves_and_backward_is_2_5x():
    fwd = attention_flops(batch=2, n_q=128, n_k=128, d=64, is_causal=False, pass_="fwd")
    assert fwd == 4 * 2 * 128 * 128 * 64
    assert attention_flops(batch=2, n_q=128, n_k=128, d=64, is_causal=True, pass_="fwd") == fwd / 2
    assert attention_flops(batch=2, n_q=128, n_k=128, d=64, is_causal=False, pass_="bwd") == 2.5 * fwd
    assert attention_flops(batch=2, n_q=128, n_k=128, d=64, is_causal=False, pass_="e2e") == 3.5 * fwd
