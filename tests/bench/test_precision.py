"""systems.bench.precision: accumulation values, the autocast dtype probe, the LayerNorm experiment
and the sweep's configurations (their tables and answers: tests/report/test_mixed_precision.py)."""

import pytest
import torch

from systems.bench import precision as mp
from systems.bench.benchmark import MODES


def test_accumulation_reproduces_handout_values():
    df = mp.accumulation_experiment().set_index("loop")
    # The handout prints 10.0001, 9.9531, 10.0021, 10.0021. The loops are deterministic IEEE
    # arithmetic, so the only slack needed is the handout's 4-decimal rounding (5e-5), doubled.
    assert df.loc["fp32 += fp32", "result"] == pytest.approx(10.0001, abs=1e-4)
    assert df.loc["fp16 += fp16", "result"] == pytest.approx(9.9531, abs=1e-4)
    assert df.loc["fp32 += fp16", "result"] == pytest.approx(10.0021, abs=1e-4)
    assert df.loc["fp32 += fp16.to(fp32)", "result"] == pytest.approx(10.0021, abs=1e-4)
    # the error column is |result - 10| by definition
    assert (df["abs_error"] - (df["result"] - 10.0).abs()).abs().max() < 1e-12
    # with an fp32 accumulator the error is the increment's rounding alone (within fp32 summation noise)
    for loop in ("fp32 += fp16", "fp32 += bf16"):
        assert df.loc[loop, "abs_error"] == pytest.approx(df.loc[loop, "error_from_increment_rounding"], rel=0.1)
    # bf16 accumulation stalls far below 10: once the spacing exceeds 0.02, 0.01 rounds away
    assert df.loc["bf16 += bf16", "result"] < 9.0
    err = df["abs_error"]
    assert err["fp32 += fp32"] < err["fp32 += fp16"] < err["fp16 += fp16"]


def test_accumulation_rejects_bad_input():
    with pytest.raises(ValueError):
        mp.accumulation_experiment(n=0)
    with pytest.raises(ValueError):
        mp.accumulate(mp.AccumulationCase("x", "fp8", "fp32"))


def test_dtype_probe_cpu_bf16():
    probe = mp.probe_autocast_dtypes("bf16", device="cpu")
    assert set(probe.columns) >= {"device", "autocast", "quantity", "dtype", "probe"}
    got = dict(zip(probe["quantity"], probe["dtype"]))
    expected = {
        "parameter fc1.weight": "fp32",
        "parameter ln.weight": "fp32",
        "fc1 matmul operands (x, weight)": "bf16/bf16",
        "fc1 output": "bf16",
        "ReLU output": "bf16",
        # the LayerNorm kernel keeps fp32 statistics whatever its input
        "LayerNorm saved mean / rstd": "fp32/fp32",
        # CPU autocast (torch 2.13) does not put layer_norm on its fp32 list, so the output
        # follows the bf16 input; CUDA autocast returns fp32 here
        "LayerNorm output": "bf16",
        "logits (fc2 output)": "bf16",
        "loss": "fp32",
        "grad of logits": "bf16",
        "grad fc1.weight": "fp32",
        "grad ln.weight": "fp32",
        "grad fc2.weight": "fp32",
    }
    for quantity, dtype in expected.items():
        assert got.get(quantity) == dtype, (quantity, got.get(quantity))
    assert (probe["device"] == "cpu").all() and (probe["autocast"] == "bf16").all()


def test_dtype_probe_validates_and_pivots():
    with pytest.raises(ValueError):
        mp.probe_autocast_dtypes("fp8", device="cpu")
    with pytest.raises(ValueError):
        mp.probe_autocast_dtypes("bf16", device="tpu")
    both = mp.probe_all(("fp16", "bf16"), device="cpu")
    assert set(both["autocast"]) == {"fp16", "bf16"}


def test_toy_model_shapes():
    model = mp.ToyModel(20, 5)
    assert model(torch.randn(3, 20)).shape == (3, 5)
    assert [type(m) for m in (model.fc1, model.ln, model.fc2)] == [torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Linear]


def test_layernorm_sensitivity_sanity():
    scales = [1e-4, 1.0, 10.0, 100.0]
    df = mp.layernorm_sensitivity(scales=scales, d=1024, rows=8, mean_to_std=(0.0, 10.0))
    assert len(df) == len(scales) * 2 * 3 * 3

    def get(dtype, method, scale, offset=0.0):
        r = df[(df.dtype == dtype) & (df.method == method) & (df.scale == scale) & (df.mean_to_std == offset)]
        return r.iloc[0]

    # d * scale^2 = 1024 * 100 > 65504: the fp16 sum of squares must overflow at scale 10 ...
    assert get("fp16", "sum_sq", 10.0).nonfinite_frac == 1.0
    # ... but not at scale 1 (sum ~ 1024), where its error is a few fp16 ulps (2^-11 ~ 5e-4)
    assert get("fp16", "sum_sq", 1.0).nonfinite_frac == 0.0
    assert get("fp16", "sum_sq", 1.0).var_rel_err < 2e-3
    # the fp32-internal kernel on fp16 input does not overflow while the input itself is finite
    assert get("fp16", "torch_kernel", 100.0).nonfinite_frac == 0.0
    # bf16 never overflows here, but its error is at bf16 resolution (2^-8 ~ 4e-3), well above fp32's
    assert (df[df.dtype == "bf16"].nonfinite_frac == 0).all()
    for s in scales:
        assert 1e-5 < get("bf16", "sum_sq", s).var_rel_err < 2e-2
        assert get("fp32", "sum_sq", s).var_rel_err < 1e-5
    # fp16 squares of 1e-4 activations (1e-8) are below fp16's smallest subnormal (6e-8): variance lost
    assert get("fp16", "sum_sq", 1e-4).var_rel_err > 0.5
    # a large mean makes the one-pass bf16 variance cancel: far worse than two-pass
    assert get("bf16", "sum_sq", 1.0, 10.0).out_max_err > 5 * get("bf16", "two_pass", 1.0, 10.0).out_max_err
    with pytest.raises(ValueError):
        mp.layernorm_sensitivity(scales=[1.0], methods=("welford",))


def test_precision_sweep_configs():
    configs = mp.precision_sweep_configs(["debug", "small"], context_length=64, batch_size=2,
                                         steps={"small": (1, 2)}, default_steps=(2, 3), device="cpu")
    assert len(configs) == 2 * len(MODES) * 2
    assert [c.precision for c in configs[:2]] == ["fp32", "bf16"]
    assert configs[0].model == "debug" and configs[-1].model == "small"
    assert (configs[0].warmup, configs[0].steps) == (2, 3)
    assert (configs[-1].warmup, configs[-1].steps) == (1, 2)
    with pytest.raises(ValueError):
        mp.precision_sweep_configs(["tiny"])
    with pytest.raises(ValueError):
        mp.precision_sweep_configs(["debug"], modes=("backward",))
