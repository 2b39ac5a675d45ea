"""systems.bench.flash_targets: the interleaved protocol, the per-round ratios and the verdicts,
with a fake timer whose times are known (the real one needs a GPU and SDPA's cuDNN backend), and
the agreement check with fake outputs whose differences are known."""

import json

import pytest

from systems.bench import flash_targets as ft
from systems.measure.results import ResultWriter

# ms per pass of each implementation; ours is slower than cuDNN in round 1 only (a host hiccup)
BASE = {"triton": 1.0, "sdpa_cudnn": 1.0, "sdpa_flash": 2.0, "naive": 1.5, "triton_per_head": 1.25}


def fake_timer(calls):
    def timer(impl, *, batch, heads, seq, d, dtype, **kw):
        calls.append((impl, heads, seq, d, dtype))
        rnd = sum(1 for c in calls if c == calls[-1]) - 1  # how many times this point ran before
        slow = 1.5 if impl == "triton" and rnd == 1 else 1.0
        scale = seq / 1024
        return dict(impl=impl, batch=batch, heads=heads, seq=seq, d=d, dtype=dtype, status="ok",
                    **{f"{p}_ms": BASE[impl] * scale * slow * (2.0 if p == "bwd" else 1.0) for p in ft.PASSES})
    return timer


SHAPES = dict(bf16_shapes=((16, 16384, 64), (1, 1024, 64)), fp32_shapes=((1, 2048, 64),))


def test_rounds_interleave_and_rotate_the_implementations(tmp_path):
    calls = []
    writer = ResultWriter(tmp_path / "t.jsonl")
    rows = ft.measure(rounds=3, timer=fake_timer(calls), writer=writer, progress=None, **SHAPES)
    per_round = len(calls) // 3
    assert per_round == 2 * 3 + 1 * 2  # two bf16 shapes x 3 impls, one fp32 shape x 2
    # each round visits every shape before the next round starts, each shape's impls back to back
    assert [c[0] for c in calls[:3]] == ["triton", "sdpa_cudnn", "sdpa_flash"]
    assert [c[0] for c in calls[per_round:per_round + 3]] == ["sdpa_cudnn", "sdpa_flash", "triton"]
    assert [r["round"] for r in rows] == [0] * per_round + [1] * per_round + [2] * per_round
    written = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(written) == len(rows) and written[0]["shape"] == [16, 16384, 64]  # written as measured


def test_ratios_are_taken_within_a_round_and_the_median_ignores_one_bad_round():
    rows = ft.measure(rounds=3, timer=fake_timer([]), progress=None, **SHAPES)
    table = ft.ratios(rows)
    cell = next(c for c in table if c["shape"] == (16, 16384, 64) and c["baseline"] == "sdpa_cudnn"
                and c["pass_"] == "e2e")
    assert cell["rounds"] == 3 and cell["ratio"] == pytest.approx(1.0)  # rounds 0 and 2: 1.0; round 1: 1.5
    assert cell["low"] == pytest.approx(1.0) and cell["high"] == pytest.approx(1.5)
    assert cell["ours_ms"] == pytest.approx(16.0)
    flash = next(c for c in table if c["shape"] == (1, 1024, 64) and c["baseline"] == "sdpa_flash")
    assert flash["ratio"] == pytest.approx(0.5)
    naive = next(c for c in table if c["dtype"] == "fp32")
    assert naive["baseline"] == "naive" and naive["ratio"] == pytest.approx(1.0 / 1.5)


def test_verdicts_need_every_shape_measured_and_within_the_limit():
    rows = ft.measure(rounds=3, timer=fake_timer([]), progress=None, **SHAPES)
    verdicts = {v["target"]: v for v in ft.verdicts(ft.ratios(rows))}
    assert verdicts["leaderboard fwd+bwd"]["met"]  # 1.00 <= 1.00
    assert not verdicts["leaderboard fwd+bwd, stretch"]["met"]  # 1.00 > 0.95
    assert verdicts["backward at seq >= 4096"]["shapes"] == 1  # only the 16384 shape is in this table
    assert verdicts["fp32 fwd+bwd at seq >= 1024"]["met"] and verdicts["fp32 fwd+bwd at seq >= 1024"]["worst"] < 1
    # a target whose shape did not run is not met
    missing = ft.verdicts(ft.ratios([r for r in rows if r["shape"] != [1, 1024, 64]]))
    assert not next(v for v in missing if v["target"] == "short sequence fwd+bwd")["met"]
    # a point that failed (no time) leaves the target unmet, not silently met
    failed = [dict(r, e2e_ms=None) if r["impl"] == "triton" and r["shape"] == [1, 1024, 64] else r for r in rows]
    short = next(v for v in ft.verdicts(ft.ratios(failed)) if v["target"] == "short sequence fwd+bwd")
    assert short["measured"] == 0 and not short["met"]


def test_the_printed_table_names_every_shape_and_target():
    rows = ft.measure(rounds=2, timer=fake_timer([]), progress=None, **SHAPES)
    table = ft.ratios(rows)
    text = ft.format_table(table, ft.verdicts(table))
    assert "(16, 16384, 64)" in text and "(1, 2048, 64)" in text
    assert "leaderboard fwd+bwd" in text and "NOT met" in text and "ours, not the handout's" in text
    # a --shape run without any fp32 shape gives that target no verdict; a shape that failed still does
    bf16_only = [r for r in rows if r["dtype"] == "bf16"]
    lines = ft.format_table(ft.ratios(bf16_only), ft.verdicts(ft.ratios(bf16_only))).splitlines()
    fp32 = next(line for line in lines if "fp32 fwd+bwd" in line)
    assert fp32.endswith("not run (none of its shapes in this run)") and "met" not in fp32


def test_bad_rounds_fail_early():
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        ft.measure(rounds=0, timer=fake_timer([]), progress=None)


def test_warm_calls_cover_each_kernel_class_once():
    pytest.importorskip("triton")
    calls = ft.warm_calls()
    keys = [c.kernels_key() for c in calls]
    assert len(keys) == len(set(keys)) and {c.dtype for c in calls} == {"bf16", "fp32"}


def test_also_times_another_implementation_beside_the_others(capsys):
    impls = {dtype: (*names, "triton_per_head") for dtype, names in ft.IMPLS.items()}
    rows = ft.measure(rounds=3, impls=impls, timer=fake_timer([]), progress=None, **SHAPES)
    table = ft.ratios(rows)
    cell = next(c for c in table if c["shape"] == (16, 16384, 64) and c["baseline"] == "triton_per_head"
                and c["pass_"] == "e2e")
    assert cell["ratio"] == pytest.approx(0.8) and cell["high"] == pytest.approx(1.2)  # 1.0 / 1.25; round 1 1.5x
    text = ft.format_also(table, ["triton_per_head"])
    assert text.count("triton_per_head") == 3 and "0.80 (0.80-1.20)" in text  # one line per shape
    assert {v["target"] for v in ft.verdicts(table)} == {t.name for t in ft.TARGETS}  # the targets are unchanged
    with pytest.raises(SystemExit):
        ft.main(["--also", "triton_typo"])
    assert "--also: unknown implementation 'triton_typo'" in capsys.readouterr().err


def test_shape_arguments_are_checked(capsys):
    from systems.bench.config import shape_argument

    assert shape_argument("BH,SEQ,D")("16,4096,64") == (16, 4096, 64)
    for bad in ("16,4096", "16,4096,0", "a,b,c"):
        with pytest.raises(SystemExit):
            ft.main(["--shape", bad])
    assert "3 positive integers BH,SEQ,D" in capsys.readouterr().err


def fake_outputs(perturbed: dict):
    """outputs' signature: every implementation returns the same seeded tensors, except that
    ``perturbed`` maps (impl, shape) to (output index, amount) added to one element."""
    import torch

    def run(impl, *, bh, seq, d, dtype):
        gen = torch.Generator().manual_seed(bh + seq + d)
        outs = [torch.randn(1, bh, 8, d, generator=gen) * 3 for _ in range(4)]
        index, amount = perturbed.get((impl, (bh, seq, d)), (0, 0.0))
        outs[index][0, 0, 0, 0] += amount
        return tuple(outs)
    return run


def test_agreement_compares_each_triton_impl_with_its_dtypes_baseline(tmp_path):
    # errors are relative to max(1, max |baseline|): 0.5 on outputs of max ~10 is ~5e-2, under
    # bf16's 6e-2, and 1.0 is over it; fp32's 2e-4 catches 0.01
    perturbed = {("triton", (16, 16384, 64)): (1, 0.5), ("triton_tma", (16, 16384, 64)): (3, 1.5),
                 ("triton", (1, 2048, 64)): (2, 0.01)}
    impls = {"bf16": ("triton", "sdpa_cudnn", "triton_tma"), "fp32": ("triton", "naive")}
    rows = ft.agreement(impls=impls, run=fake_outputs(perturbed), writer=ResultWriter(tmp_path / "a.jsonl"),
                        **SHAPES)
    got = {(r["impl"], tuple(r["shape"])): r for r in rows}
    assert set(got) == {(i, s) for i in ("triton", "triton_tma") for s in SHAPES["bf16_shapes"]} | {
        ("triton", (1, 2048, 64))}  # Triton implementations only; baselines are not checked against themselves
    assert got[("triton", (1, 1024, 64))]["worst"] == 0 and got[("triton", (1, 1024, 64))]["agrees"]
    lb = got[("triton", (16, 16384, 64))]
    assert lb["baseline"] == "sdpa_cudnn" and 0 < lb["dQ"] <= 6e-2 and lb["O"] == 0 and lb["agrees"]
    assert not got[("triton_tma", (16, 16384, 64))]["agrees"] and got[("triton_tma", (16, 16384, 64))]["dV"] > 6e-2
    fp32 = got[("triton", (1, 2048, 64))]
    assert fp32["baseline"] == "naive" and not fp32["agrees"] and fp32["dK"] > 2e-4
    written = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(written) == len(rows) and all(w["kind"] == "agreement" for w in written)
    text = ft.format_agreement(rows)
    assert text.count("DIFFERENT") == 2 and "triton_tma vs sdpa_cudnn" in text


def test_from_prints_an_earlier_runs_tables_without_measuring(tmp_path, capsys, monkeypatch):
    # one file as a run writes it: timing rows (with an --also implementation), then agreement rows
    path = tmp_path / "run.jsonl"
    writer = ResultWriter(path)
    impls = {dtype: (*names, "triton_per_head") for dtype, names in ft.IMPLS.items()}
    rows = ft.measure(rounds=3, impls=impls, timer=fake_timer([]), writer=writer, progress=None, **SHAPES)
    checked = ft.agreement(impls=impls, run=fake_outputs({}), writer=writer, **SHAPES)
    monkeypatch.setattr(ft, "measure", None)  # nothing may be timed
    assert ft.main(["--from", str(path)]) == 0
    printed = capsys.readouterr().out
    # the same tables the measuring run printed, after a line naming the machine and commit
    assert printed.splitlines()[0].startswith(f"rows of {path}: ")
    assert ft.report(rows, checked, ["triton_per_head"]) in printed and "DIFFERENT" not in printed
    # a file whose agreement failed exits 1, as the run did
    bad = tmp_path / "bad.jsonl"
    writer = ResultWriter(bad)
    for row in rows:
        writer.write(row)
    ft.agreement(impls=impls, run=fake_outputs({("triton", (1, 1024, 64)): (0, 5.0)}), writer=writer, **SHAPES)
    assert ft.main(["--from", str(bad)]) == 1 and "DIFFERENT" in capsys.readouterr().out
    # not a rows file: one line and exit 2
    for other, says in [(tmp_path / "missing.jsonl", "cannot read"), (tmp_path / "notes.md", "is not JSON lines")]:
        if other.suffix == ".md":
            other.write_text("# notes\n")
        with pytest.raises(SystemExit) as exit_:
            ft.main(["--from", str(other)])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
