"""Notebook 08's answers rendered from rows shaped like the GPU run's."""

from __future__ import annotations

import pandas as pd

from systems.report import sharding_fsdp as report

MiB = 2**20
N = 1_998_235_200  # xl-2025


def _row(variant, *, state, temps, params=4 * N, grads=4 * N, acts=11_600 * MiB, other=0, precision="fp32", **extra):
    """A row as the benchmark writes it, with the allocator's numbers made from the parts."""
    after_step = params + grads + state + other
    return dict(model="xl-2025", variant=variant, precision=precision, status="ok", n_params=N, param_bytes_local=params,
                grads_measured=grads, opt_state_bytes=state, opt_temporaries_measured=temps, activations_measured=acts,
                peak_after_init=params, peak_fwd_bwd=params + state + acts + other, peak_opt_step=after_step + temps,
                mem_after_step=after_step, step_ms=400.0, step_ms_p10=399.0, step_ms_p90=401.0, **extra)


def test_sharding_answer_attributes_every_part_and_matches_the_accounting():
    opt = pd.DataFrame([_row("ddp", state=8 * N, temps=4 * N, other=500 * MiB),
                        _row("ddp_sharded", state=4 * N, temps=2 * N, other=300 * MiB)])
    text = report.sharding_memory_answer(opt, model="xl-2025", world_size=2, handout="2025")
    assert "during the step 38,613 MiB / 26,979 MiB" in text  # 20 and 16 bytes per parameter, plus other
    assert text.startswith("xl: ")  # the handout's name for the preset, not "xl-2025"
    assert "other 500 MiB / 300 MiB" in text and "As expected: they follow the accounting" in text and "by at most 1.6%" in text
    assert "the moments are 50% and the temporaries 50% of DDP's" in text
    table = report.breakdown_table(opt, model="xl-2025", world_size=2)
    assert table.loc["optimizer_temporaries", "ddp (fp32) measured"] == table.loc[
        "optimizer_temporaries", "ddp (fp32) computed"]
    assert all(isinstance(c, str) for c in table.columns)  # flat headers: a MultiIndex renders as tuples


def test_fsdp_saving_is_against_the_sharded_optimizer_and_counts_gathered_units():
    opt = pd.DataFrame([_row("ddp", state=8 * N, temps=4 * N), _row("ddp_sharded", state=4 * N, temps=2 * N)])
    unit = 164 * 10**6
    fsdp = pd.DataFrame([_row("fsdp", params=2 * N, grads=2 * N, state=4 * N, temps=2 * N, other=2 * unit,
                              gathered_unit_bytes=unit, prefetch=1)])
    text = report.fsdp_saving_answer(opt, fsdp, model="xl-2025", world_size=2, handout="2025")
    # at the peak (the forward's end) FSDP saves the other half of the weights, minus the units in flight
    assert "expected 3,811 MiB per rank" in text
    assert "3,499 MiB saved (92% of the expected)" in text
    assert "explain up to 313 MiB" in text
    assert "20 bytes per parameter" in text


def test_the_large_model_answer_says_what_happened_to_each_run():
    """10B on 2 ranks: the sharded-optimizer run out of memory, the FSDP run an error row (e.g. a
    hang past its deadline); the answer names both and the bytes the accounting needs."""
    opt = pd.DataFrame([dict(model="10B", variant="ddp_sharded", precision="fp32", status="oom", n_params=12_832_823_808)])
    fsdp = pd.DataFrame([dict(model="10B", variant="fsdp", status="error", error="distributed run did not finish")])
    text = report.large_model_answer(opt, fsdp, model="10B", world_size=2, handout="2026")
    assert "`ddp_sharded` (fp32) ran out of memory" in text
    assert "`fsdp` (bf16) failed (distributed run did not finish)" in text
    # 16 bytes per parameter + 4 of temporaries on half: 4+4+4+2 = 14 B/param sharded-state, 10 B/param FSDP
    assert "180 GB per rank with sharded optimizer state and 128 GB with FSDP" in text


def test_zero1_answer_places_our_sharding_among_the_zero_stages():
    # 2**23 fp32 parameters (32 MiB per tensor) on 2 ranks: DDP holds weights + grads + 2 moments = 128 MiB;
    # sharded, the moments halve: 32 + 32 + 32 = 96 MiB. DDP sends 2 x 1/2 x 32 = 32 MiB, ours + 1/2 x 32 =
    # 48 MiB, ZeRO-1 1/2 x 32 + 1/2 x 32 = 32 MiB: 1.50x
    text = report.zero1_answer(2**23, 2)
    assert "(96 MiB per rank here, against 128 MiB for DDP)" in text
    assert "fp32 master weights (12 bytes per parameter)" in text and "stage 2 (P_os+g)" in text
    assert "every gradient (32 MiB sent per rank)" in text and "(+16 MiB), 48 MiB in all" in text
    assert "ours sends 1.50x ZeRO-1's volume" in text and "{" not in text


def test_sharding_time_answer_reads_the_rank_count_from_the_rows():
    opt = pd.DataFrame([_row("ddp", state=8 * N, temps=4 * N, world_size=4),
                        {**_row("ddp_sharded", state=2 * N, temps=N, world_size=4), "step_ms": 410.0,
                         "step_ms_p10": 409.0, "step_ms_p90": 411.0}])
    text = report.sharding_time_answer(opt, model="xl-2025", handout="2025")
    assert "x1.025" in text and "the broadcast costs more than updating 1/4 of them saves." in text
    # ddp's 400 ms inside 399.5-411: no verdict either way
    opt.loc[1, "step_ms_p10"] = 399.5
    assert "within the noise" in report.sharding_time_answer(opt, model="xl-2025", handout="2025")
    # without a spread the medians are compared, and the answer says that is all it did
    opt.loc[1, "step_ms_p10"] = float("nan")
    text = report.sharding_time_answer(opt, model="xl-2025", handout="2025")
    assert "nan" not in text and "within the noise" not in text
    assert ("(median of the slowest rank): 400 ms without and 410 ms with sharding, x1.025" in text
            and "saves by these medians (no p10-p90 spread was recorded to tell it from noise)." in text)


def test_fsdp_ratios_say_when_the_steps_differ_beyond_their_spread():
    # fp32: 380 against 400 ms, neither median inside the other's 1 ms spread: ours faster.
    # bf16: 238 (209-278) against 248 (237-272), the rows of a host-paced run: within the noise.
    fsdp = pd.DataFrame([{**_row("fsdp", state=4 * N, temps=2 * N), "step_ms": 380.0, "step_ms_p10": 379.0,
                          "step_ms_p90": 381.0},
                         _row("fsdp2", state=4 * N, temps=2 * N),
                         {**_row("fsdp", state=4 * N, temps=2 * N, precision="bf16"), "step_ms": 238.0,
                          "step_ms_p10": 209.0, "step_ms_p90": 278.0},
                         {**_row("fsdp2", state=4 * N, temps=2 * N, precision="bf16"), "step_ms": 248.0,
                          "step_ms_p10": 237.0, "step_ms_p90": 272.0}])
    ratios = report.fsdp_ratios(fsdp, model="xl-2025").set_index("precision")
    assert ratios.loc["fp32", "step_time_ratio"] == 0.95 and ratios.loc["fp32", "step_time"] == "ours faster"
    assert ratios.loc["bf16", "step_time"] == "within the noise"
    assert ratios.loc["bf16", "peak_memory_ratio"] == 1.0
    # ours at 420 (419-421) against 400 (399-401): slower beyond the spread
    fsdp.loc[0, ["step_ms", "step_ms_p10", "step_ms_p90"]] = [420.0, 419.0, 421.0]
    assert report.fsdp_ratios(fsdp, model="xl-2025").set_index("precision").loc["fp32", "step_time"] == "ours slower"
    # a row without its spread gets no verdict either way, whether the value is NaN or the column absent
    fsdp.loc[0, "step_ms_p90"] = float("nan")
    assert report.fsdp_ratios(fsdp, model="xl-2025").set_index("precision").loc["fp32", "step_time"] == (
        "spread not measured")
    without = report.fsdp_ratios(fsdp.drop(columns=["step_ms_p10", "step_ms_p90"]), model="xl-2025")
    assert set(without["step_time"]) == {"spread not measured"}
