"""Notebook 09's report: the link measured from all-reduce rows, and the answers it feeds."""

from __future__ import annotations

import pandas as pd
import pytest

from systems.analysis import parallel_math as pm
from systems.report import parallelism_math as report


def _rows():
    rows = []
    for source, machine, ws, busbw_1g in (("a.jsonl", "8x H200", 2, 320.0), ("a.jsonl", "8x H200", 8, 350.0),
                                         ("b.jsonl", "2x H200", 2, 330.0)):
        for mb, o in ((1, 40e-6), (10, 40e-6), (100, 40e-6), (1000, 40e-6)):
            algbw = busbw_1g / (2 * (ws - 1) / ws) * 1e9
            t = o + mb * 1e6 / algbw
            rows.append(dict(backend="nccl", status="ok", world_size=ws, size_bytes=mb * 10**6, time_ms=t * 1e3,
                             busbw_GBps=mb * 1e6 / t * 2 * (ws - 1) / ws / 1e9, source=source, machine=machine,
                             gpu=machine.split("x ", 1)[1],  # as read_allreduce labels a row: its env's GPU
                             commit="abc"))
    rows.append(dict(backend="gloo", status="ok", world_size=2, size_bytes=10**9, time_ms=600.0, busbw_GBps=1.7,
                     source="c.jsonl", machine="CPU", commit="def"))
    return pd.DataFrame(rows)


def test_measured_link_takes_the_bus_bandwidth_of_the_largest_message_and_fits_o_and_w():
    link = report.measured_link(_rows())
    # W: the median busbw at 1 GB over the three NCCL series (gloo left out)
    at_1g = sorted(r for r in _rows().query("backend == 'nccl' and size_bytes == 1e9")["busbw_GBps"])
    assert link["W"] == pytest.approx(at_1g[1] * 1e9)
    assert link["W_rows"] == 3 and link["W_sources"] == "a.jsonl, b.jsonl"
    # the fit recovers the o and w the rows were made from (exact: t = o + s / w by construction)
    assert link["o"] == pytest.approx(40e-6, rel=1e-6) and link["fit_sizes"] == 4
    assert link["w"] in (pytest.approx(320e9, rel=1e-6), pytest.approx(330e9, rel=1e-6))
    assert report.measured_link(_rows().query("backend == 'gloo'")) is None


def test_measured_accelerator_moves_only_the_bounds_that_depend_on_w():
    link = report.measured_link(_rows())
    measured = report.with_measured_link(pm.H100, link)
    layer = pm.leaderboard_ffn()
    assert measured.flops_per_s == pm.H100.flops_per_s and measured.link_bytes_per_s == link["W"]
    # DP's bound is 1 + B W / C: lower W, proportionally lower bound minus one
    ratio = (pm.dp_max_devices(layer, accelerator=measured) - 1) / (pm.dp_max_devices(layer, accelerator=pm.H100) - 1)
    assert ratio == pytest.approx(link["W"] / pm.H100.link_bytes_per_s)
    answers = report.section8_answers(layer=layer, hws=[pm.H100, measured], example_n=8)
    assert f"{pm.dp_max_devices(layer, accelerator=measured):.1f}" in answers[("data_parallel_calcs", "c")]
    assert "H100 with the NCCL W measured on H200" in answers[("fsdp_tp_calcs", "d")]
    assert measured.name == "H100 with the NCCL W measured on H200"  # the rows' machines: 8x H200 and 2x H200


def test_a_fit_without_a_positive_intercept_takes_notebook_07s_fallback_and_says_so():
    # t = s / w - 1 us: the least-squares intercept is negative, which has no optimal bucket count
    rows = _rows()
    rows["time_ms"] = rows["size_bytes"] / 330e9 * 1e3 - 1e-3
    link = report.measured_link(rows)
    first = rows[(rows["source"] == link["fit_source"]) & (rows["world_size"] == 2)].sort_values("size_bytes")
    assert link["o"] == pytest.approx(first["time_ms"].iloc[0] / 1e3)  # the smallest message's time
    assert "o: smallest message's time (fitted intercept not positive)" in report.link_text(link, pm.H100)
    text, w, o = report.bucket_answer(link=link, gpu=pm.H100)
    assert o == link["o"] and "the best bucket is" in text
    # a clean fit's text names no fallback
    assert "fitted intercept" not in report.link_text(report.measured_link(_rows()), pm.H100)
