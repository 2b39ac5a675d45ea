"""The fused-kernel benchmark (systems/bench/fused.py) on the CPU: one row per variant with a median
and its spread, the FLOP convention behind the loss rows' TFLOP/s, out-of-memory as a row, and the
command line's refusal without a GPU."""

import pytest
import torch

from systems.bench import fused
from systems.measure import flops


def test_optimizer_rows_time_every_variant():
    rows = fused.optimizer_rows(model="debug", rep_ms=5, device="cpu")
    assert [r["variant"] for r in rows] == ["ours_loop", "ours_foreach", "fused_triton", "fused_triton+bf16_copy",
                                            "torch_fused"]
    n = fused.get_config("debug").n_params  # the closed form: the shapes are the preset's
    for r in rows:
        assert r["status"] == "ok" and r["n_params"] == n, r
        assert 0 < r["p10_ms"] <= r["ms"] <= r["p90_ms"], r
        # the bytes each element must move at least over the median time
        assert r["gbps"] == pytest.approx(r["min_bytes"] / (r["ms"] * 1e-3) / 1e9)


def test_loss_rows_count_the_heads_model_flops():
    rows = fused.loss_rows(tokens=64, d_model=32, vocab=96, rep_ms=5, device="cpu")
    assert [r["variant"] for r in rows] == ["unfused", "fused"]
    # the LM head's matmul (2 FLOPs per multiply-add) forward, and backward = 2x forward
    work = flops.FLOPS_PER_MAC * 64 * 32 * 96 * 3
    for r in rows:
        assert r["status"] == "ok" and r["tflops"] == pytest.approx(work / (r["ms"] * 1e-3) / 1e12)


def test_out_of_memory_becomes_a_row(monkeypatch):
    def boom(*_, **__):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(fused, "_timed", boom)
    rows = fused.optimizer_rows(model="debug", rep_ms=5, device="cpu")
    assert {r["status"] for r in rows} == {"oom"} and all("injected" in r["error"] for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_needs_a_gpu():
    with pytest.raises(SystemExit) as exc:
        fused.main([])
    assert exc.value.code == 2


def test_rope_rows_time_both_passes_against_the_bytes_they_must_move():
    # on the CPU only the PyTorch path runs (the compiled path and the Triton passes need CUDA)
    rows = fused.rope_rows(batch=2, seq=8, n_heads=2, d_head=16, rep_ms=5, device="cpu", dtype=torch.float32)
    assert [(r["variant"], r["phase"]) for r in rows] == [("pytorch", "forward"), ("pytorch", "forward+backward")]
    row_bytes = 2 * 8 * 3 * 2 * 16 * 4  # the fused projection's output, fp32
    # forward: q's and k's features read and written (v is a view); backward: dq, dk, dv read, the row written
    assert [r["min_bytes"] for r in rows] == [pytest.approx(row_bytes * 4 / 3), pytest.approx(row_bytes * 10 / 3)]
    for r in rows:
        assert r["status"] == "ok" and 0 < r["p10_ms"] <= r["ms"] <= r["p90_ms"], r
        assert r["gbps"] == pytest.approx(r["min_bytes"] / (r["ms"] * 1e-3) / 1e9)


def test_adamw_tile_rows_time_each_tile_beside_a_copy_of_its_bytes():
    # on the CPU the update takes the PyTorch fallback whatever the tile: the rows' shape is checked
    rows = fused.adamw_tile_rows(model="debug", tiles=[(1024, 8), (2048, 16)], rep_ms=5, device="cpu")
    assert [(r["variant"], r.get("block"), r.get("num_warps")) for r in rows] == [
        ("copy", None, None), ("fused_triton_split", 1024, 8), ("fused_triton_split", 2048, 16)]
    cfg = fused.get_config("debug")
    # split masters move 26 bytes per element of a matmul weight (bf16 gradient); the fp32
    # embedding table and norm gains 28
    fp32 = cfg.vocab_size * cfg.d_model + (2 * cfg.n_layers + 1) * cfg.d_model
    want = 26 * (cfg.n_params - fp32) + 28 * fp32
    for r in rows:
        assert r["status"] == "ok" and r["min_bytes"] == want, r
        assert 0 < r["p10_ms"] <= r["ms"] <= r["p90_ms"], r
        assert r["gbps"] == pytest.approx(want / (r["ms"] * 1e-3) / 1e9)


def test_adamw_tiles_are_parsed_or_refused():
    assert fused.parse_tile("1024x8") == (1024, 8) and fused.parse_tile("2048X16") == (2048, 16)
    with pytest.raises(ValueError, match="BLOCKxWARPS"):
        fused.parse_tile("1024")
    with pytest.raises(SystemExit) as exc:
        fused.main(["--adamw-tiles", "big"])
    assert exc.value.code == 2
