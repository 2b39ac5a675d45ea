"""systems/bench/gemms.py: a block's GEMMs, their operands laid out as autograd passes them, timed
on the CPU with the debug model (the rates are the GPU's business; here the shapes and the rows)."""

import pytest
import torch

from systems.bench import gemms
from systems.config import get_config


def test_the_projections_cover_every_linear_of_a_block_once():
    cfg = get_config("debug")
    d, f = cfg.d_model, cfg.d_ff
    for fused in (False, True):
        weights = sum(p.per_block * p.d_in * p.d_out for p in gemms.block_projections(cfg, fused=fused))
        assert weights == 4 * d * d + 3 * d * f  # q, k, v, o and w1, w2, w3, whichever layout
    assert [p.name for p in gemms.block_projections(cfg, fused=True)] == ["qkv_proj", "output_proj", "w13", "w2"]


def test_each_gemm_is_the_product_autograd_computes_for_a_linear():
    # the three products against autograd's own on an fp64 Linear: same shapes, same values (fp64:
    # the only difference is summation order, far under the 1e-12 tolerance)
    p = gemms.Projection("w", d_in=5, d_out=7)
    torch.manual_seed(0)
    a, b = gemms.gemm_operands(p, "forward", tokens=3, device="cpu", dtype=torch.float64)
    x, w = a, b.t()
    w.requires_grad_(True)
    x.requires_grad_(True)
    y = torch.nn.functional.linear(x, w)
    assert torch.allclose(torch.mm(a, b), y, rtol=0, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.allclose(torch.mm(dy, w.detach()), x.grad, rtol=0, atol=1e-12)
    assert torch.allclose(torch.mm(dy.t(), x.detach()), w.grad, rtol=0, atol=1e-12)
    for pass_, shape in (("input_grad", (3, 7, 5)), ("weight_grad", (7, 3, 5))):
        a, b = gemms.gemm_operands(p, pass_, tokens=3, device="cpu", dtype=torch.float64)
        assert (a.shape[0], a.shape[1], b.shape[1]) == shape
    with pytest.raises(ValueError, match="pass must be one of"):
        gemms.gemm_operands(p, "backward", tokens=3, device="cpu", dtype=torch.float64)


def test_run_gemms_writes_a_row_per_gemm_as_it_goes(tmp_path):
    from systems.measure.results import ResultWriter, read_records

    writer = ResultWriter(tmp_path / "g.jsonl")
    rows = gemms.run_gemms(["debug"], tokens=32, device="cpu", dtype=torch.float32, writer=writer)
    assert len(rows) == 2 * 4 * 3 and len(read_records(tmp_path / "g.jsonl")) == len(rows)
    cfg = get_config("debug")
    for r in rows:
        assert r["flops"] == 2 * r["m"] * r["k"] * r["n"] and r["tflops"] > 0
        assert r["block_ms"] == pytest.approx(r["per_block"] * r["median_ms"])
        assert r["n_layers"] == cfg.n_layers and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
    qkv = [r for r in rows if r["projection"] == "qkv_proj" and r["gemm"] == "forward"][0]
    assert (qkv["m"], qkv["k"], qkv["n"]) == (32, cfg.d_model, 3 * cfg.d_model)


def test_the_cli_refuses_to_run_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as exc:
        gemms.main(["--model", "debug"])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
