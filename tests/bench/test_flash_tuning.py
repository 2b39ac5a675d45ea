"""The tile explorer launches the same kernels the autotuned path runs: with explicit tiles it
must produce the autotuned path's outputs. Runs under the Triton interpreter in a subprocess
(TRITON_INTERPRET must be set before triton is imported).

Then the store that persists tuned plans across processes (flash_triton/tuning.py): its key, its
file, and what it does with a file it cannot use."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from systems.testing import have_triton

SCRIPT = textwrap.dedent("""
    import torch
    from systems.bench import flash_tuning as t
    from systems.attention.flash_triton import FlashVariant, flash_backward_triton, flash_forward_triton

    x = t.make_inputs(batch=2, seq=48, d=16, dtype="fp16", device="cpu")
    o_ref, lse_ref = flash_forward_triton(x.q, x.k, x.v, True)
    dq_ref, dk_ref, dv_ref = flash_backward_triton(x.q, x.k, x.v, x.o, x.lse, x.do, True)

    # capture the kernels' outputs: launch() allocates them, so read them back from its closure
    def outputs(kernel, cfg):
        fn = t.launch(kernel, x, cfg)
        fn()
        cells = {name: c.cell_contents for name, c in zip(fn.__code__.co_freevars, fn.__closure__)}
        return cells

    fwd = outputs("fwd", (16, 16, 4, 1))
    torch.testing.assert_close(fwd["o"], o_ref, rtol=0, atol=0)
    # the explorer's D = rowsum(O * dO) comes from torch, the backward's from its own kernel: the
    # sums round differently (fp32), which moves fp16 gradients by at most about one fp32 ulp of D
    dkdv = outputs("dkdv", (16, 32, 4, 1))
    torch.testing.assert_close(dkdv["dk"], dk_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(dkdv["dv"], dv_ref, rtol=0, atol=0)  # dV does not use D
    dq = outputs("dq", (32, 16, 4, 1))
    torch.testing.assert_close(dq["dq"], dq_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(dq["delta"], x.delta, rtol=0, atol=1e-5)  # the dQ kernel's D, fp32 sums
    # the whole atomic backward with the interpreter's tiles reproduces the public atomic path
    # exactly (the interpreter runs the programs, and so the atomic adds, in one fixed order)
    dq_at, dk_at, dv_at = flash_backward_triton(x.q, x.k, x.v, x.o, x.lse, x.do, True,
                                                variant=FlashVariant(backward="atomic"))
    atomic = outputs("atomic", (16, 32, 4, 1))
    for name, want in (("dq", dq_at), ("dk", dk_at), ("dv", dv_at)):
        torch.testing.assert_close(atomic[name], want, rtol=0, atol=0)
    torch.testing.assert_close(atomic["dq"], dq_ref, rtol=0, atol=2e-3)  # fp16 dQ: rounding of other sums

    # --compare-backward's pieces that run without a GPU: the check (fp32, which the interpreter's
    # numpy dots compute exactly to rounding) and the table
    checks = t.check_backwards(cases=[((2, 40, 16), 40, True)], dtype="fp32", device="cpu", tol=1e-5)
    assert [r["impl"] for r in checks] == ["triton_split", "triton_atomic", "triton_tma", "triton_gluon"], checks
    assert all(r["status"] == "ok" for r in checks), checks
    fake = [dict(kind="time", status="ok", batch=1, heads=1, seq=4096, d=64, impl=impl, fwd_ms=ms, bwd_ms=2 * ms,
                 e2e_ms=3 * ms) for impl, ms in (("sdpa_cudnn", 1.0), ("triton_atomic", 0.5))]
    table = t.compare_table(fake)
    assert "0.50x" in table and "triton_atomic  bwd: 2.000" in table, table
    rows = t.host_overhead(shapes=((1, 32, 16),), dtype="fp16", calls=1, device="cpu")
    assert [r["path"] for r in rows] == ["public_fwd", "public_fwd_bwd", "kernel_fwd", "sdpa_flash_fwd_bwd"]
    # the plans those calls chose, as --compare-backward records them
    plans = t.stored_plans()
    assert {"fwd", "dq", "dkdv", "atomic"} <= {r["kernel"] for r in plans}, plans
    assert all(r["kind"] == "plan" and r["origin"] == "tuned" and "num_warps" in r for r in plans), plans
    print("OK")
""")


@pytest.mark.slow
def test_explicit_tiles_reproduce_the_autotuned_kernels():
    # the interpreter runs one config per kernel, the same tiles as above
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# ----------------------------------------------------------------------------- persisted plans

needs_triton = pytest.mark.skipif(not have_triton(), reason="needs triton")
TUNE_KEY = (1024, 64, True, "ieee")  # SEQ_BUCKET, HEAD_DIM, IS_CAUSAL, INPUT_PRECISION


def _store_key(tuning, **changes):
    key = tuning.StoreKey(gpu="NVIDIA H100 80GB HBM3", triton="3.6.0", source=tuning.current_source_hash())
    return dataclasses.replace(key, **changes)


def _listed(tuning, kernel, i=0):
    return tuning.config_meta((tuning.CONFIGS[kernel]["half"] + tuning.CONFIGS[kernel]["fp32"])[i])


@needs_triton
def test_source_hash_follows_the_kernels_and_their_configs(monkeypatch):
    from systems.attention.flash_triton import kernels, tuning

    source = inspect.getsource(kernels)
    base = tuning.source_hash(source, tuning.CONFIGS)
    assert base == tuning.current_source_hash()
    edited = source.replace("acc = acc * alpha[:, None]", "acc = acc * alpha[:, None] * 1.0")
    assert edited != source and tuning.source_hash(edited, tuning.CONFIGS) != base
    fewer = {**tuning.CONFIGS, "fwd": {"half": tuning.CONFIGS["fwd"]["half"][:1], "fp32": []}}
    assert tuning.source_hash(source, fewer) != base
    # and the pruner's budget, which decides which of the listed configs are tried
    monkeypatch.setattr(tuning, "_SMEM_BUDGET", tuning._SMEM_BUDGET - 1024)
    assert tuning.source_hash(source, tuning.CONFIGS) != base


@needs_triton
def test_candidates_are_configs_of_their_kernels():
    """Every candidate becomes a config of its own kernel: its two tile names, power-of-two tiles
    (tl.arange needs them), the kernel's default options unless the candidate overrides them."""
    from systems.attention.flash_triton import tuning
    from systems.bench import flash_tuning

    assert flash_tuning._tiles("64x128/8/3, 16x32/4/1") == [(64, 128, 8, 3), (16, 32, 4, 1)]
    tables = [*flash_tuning.CANDIDATES.items(), *flash_tuning.FP32_CANDIDATES.items()]
    for kernel, candidates in tables:
        assert len(set(map(repr, candidates))) == len(candidates), f"{kernel}: a candidate listed twice"
        rows, cols = tuning.TILE_NAMES[kernel.removesuffix("_tma")]
        for m, n, warps, stages, *extra in candidates:
            meta = tuning.config_meta(tuning.tile_config(kernel, m, n, warps=warps, stages=stages, **(extra or [{}])[0]))
            assert (meta[rows], meta[cols], meta["num_warps"], meta["num_stages"]) == (m, n, warps, stages)
            assert m & (m - 1) == 0 and n & (n - 1) == 0, (kernel, m, n)
            options = {**tuning.kernel_options(kernel), **(extra or [{}])[0]}
            assert {k: meta[k] for k in options} == options
    with pytest.raises(ValueError, match="unknown kernel 'fwd_typo'"):
        tuning.tile_config("fwd_typo", 64, 64, warps=4, stages=3)


def test_schedule_candidates_put_each_option_beside_its_tiles_without_it(capsys):
    from systems.bench import flash_tuning

    for kernel, options in flash_tuning.SCHEDULE_CANDIDATES.items():
        table = flash_tuning.schedule_candidates(kernel)
        baselines = [c for c in table if len(c) == 4]
        assert table == baselines + options and len(set(baselines)) == len(baselines)
        assert {c[:4] for c in options} == set(baselines), kernel  # every option has its baseline
        assert all(c[4] for c in options)
    with pytest.raises(SystemExit):
        flash_tuning.main(["--schedule", "--dtype", "fp32"])
    assert "drop --dtype fp32" in capsys.readouterr().err


def test_launch_order_candidates_give_each_table_config_every_head_group(capsys):
    from systems.attention.flash_triton import tuning
    from systems.bench import flash_tuning

    groups = flash_tuning.LAUNCH_ORDER_GROUPS
    assert groups[0] == 1 and None in groups  # the order before groups, and the rule's choice
    for kernel in flash_tuning.LAUNCH_ORDER_KERNELS:
        table = flash_tuning.launch_order_candidates(kernel)
        assert len(table) == len(groups) * len(tuning.CONFIGS[kernel]["half"])
        for start in range(0, len(table), len(groups)):  # one config's groups back to back
            run = table[start:start + len(groups)]
            assert [c[4]["head_group"] for c in run] == list(groups)
            assert len({(c[:4], tuple(sorted((k, v) for k, v in c[4].items() if k != "head_group")))
                        for c in run}) == 1
    with pytest.raises(ValueError, match="unknown kernel 'atomic'"):
        flash_tuning.launch_order_candidates("atomic")
    for argv in (["--launch-order", "--dtype", "fp32"], ["--launch-order", "--schedule"]):
        with pytest.raises(SystemExit):
            flash_tuning.main(argv)
    err = capsys.readouterr().err
    assert "drop --dtype fp32" in err and "give one" in err


def test_head_group_ratios_divide_by_one_head_a_group():
    from systems.bench import flash_tuning

    def row(ms, group, status="ok", ws=False, kernel="dq_tma", used=None):
        return dict(kernel=kernel, impl="triton", batch=16, seq=16384, d=64, block_m=128, block_n=64, warps=8,
                    stages=3, status=status, ms=ms, head_group_used=used or group,
                    meta=dict(EARLY_DP=True, WS=ws, head_group=group))

    rows = [row(2.0, 1), row(1.5, 4), row(1.6, None, used=3),
            row(3.0, 1, ws=True), row(9.0, 4, ws=True, status="error"),  # a failed group: left out
            row(1.0, 4, kernel="fwd_tma"),  # no one-head-a-group row to divide by: left out
            dict(kernel="baseline", impl="sdpa_cudnn", status="ok")]
    got = {(r["tile"], r["group"]): r for r in flash_tuning.head_group_ratios(rows)}
    assert set(got) == {("128x64/8/3", 1), ("128x64/8/3", 4), ("128x64/8/3", "rule")}  # the WS config's 1 only
    assert len(flash_tuning.head_group_ratios(rows)) == 4
    assert got[("128x64/8/3", 4)]["ratio"] == pytest.approx(0.75)
    assert got[("128x64/8/3", "rule")]["group_used"] == 3 and got[("128x64/8/3", "rule")]["ratio"] == pytest.approx(0.8)


@needs_triton
def test_plan_store_round_trip_and_key(tmp_path):
    from systems.attention.flash_triton import tuning

    key = _store_key(tuning)
    fwd, dq = _listed(tuning, "fwd"), _listed(tuning, "dq", 1)
    tuning.PlanStore(tmp_path, key).put("fwd", torch.bfloat16, TUNE_KEY, fwd)
    tuning.PlanStore(tmp_path, key).put("dq", torch.bfloat16, TUNE_KEY, dq)  # another process, same file
    store = tuning.PlanStore(tmp_path, key)  # a new process reads both
    assert store.get("fwd", torch.bfloat16, TUNE_KEY) == fwd and store.get("dq", torch.bfloat16, TUNE_KEY) == dq
    assert store.get("fwd", torch.float16, TUNE_KEY) is None
    assert store.get("fwd", torch.bfloat16, (4096, *TUNE_KEY[1:])) is None
    assert [p.name for p in tmp_path.iterdir()] == [key.file_name()]
    # another GPU, another Triton, edited kernels: another file, nothing in it yet
    for other in (_store_key(tuning, gpu="NVIDIA H200"), _store_key(tuning, triton="3.8.0"),
                  _store_key(tuning, source="0" * 64)):
        assert other.file_name() != key.file_name()
        assert tuning.PlanStore(tmp_path, other).get("fwd", torch.bfloat16, TUNE_KEY) is None


@needs_triton
def test_plan_store_ignores_corrupt_and_foreign_files(tmp_path):
    from systems.attention.flash_triton import tuning

    key = _store_key(tuning)
    fwd = _listed(tuning, "fwd")
    tuning.PlanStore(tmp_path, key).put("fwd", torch.bfloat16, TUNE_KEY, fwd)
    path = tmp_path / key.file_name()
    good = json.loads(path.read_text())

    def entry(**changes):
        return {**good, "plans": [{**good["plans"][0], **changes}]}

    unusable = ["{not json", "[]", json.dumps({**good, "format": 2}),
                json.dumps({**good, "gpu": "NVIDIA H200"}),  # foreign: written for another GPU
                json.dumps(entry(config={**fwd, "BLOCK_M": 7})),  # no listed config
                json.dumps(entry(tune_key=[1024, 64])), json.dumps(entry(kernel="bwd")), json.dumps(entry(dtype=3))]
    for text in unusable:
        path.write_text(text)
        with pytest.warns(UserWarning, match="ignoring the flash-attention plan cache"):
            assert tuning.PlanStore(tmp_path, key).get("fwd", torch.bfloat16, TUNE_KEY) is None, text
    # a new plan replaces the unusable file
    tuning.PlanStore(tmp_path, key).put("fwd", torch.bfloat16, TUNE_KEY, fwd)
    assert tuning.PlanStore(tmp_path, key).get("fwd", torch.bfloat16, TUNE_KEY) == fwd
    # a directory that cannot be made: a warning, and the plan kept in memory
    (tmp_path / "blocker").write_text("")
    store = tuning.PlanStore(tmp_path / "blocker" / "plans", key)
    with pytest.warns(UserWarning, match="cannot write"):
        store.put("fwd", torch.bfloat16, TUNE_KEY, fwd)
    assert store.get("fwd", torch.bfloat16, TUNE_KEY) == fwd


@needs_triton
def test_cache_dir_only_where_asked_inside_tests(tmp_path, monkeypatch):
    from systems.attention.flash_triton import tuning

    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
    assert tuning.cache_dir() == tmp_path
    store = tuning.plan_store(torch.device("cpu"))
    assert store.path.parent == tmp_path and store.key.triton and store.key.gpu == "cpu"
    monkeypatch.delenv(tuning.CACHE_ENV)
    assert tuning.cache_dir() is None and tuning.plan_store(torch.device("cpu")) is None  # inside pytest
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if tuning.INTERPRETING or not tuning.autotuning():
        assert tuning.cache_dir() is None
    else:
        assert tuning.cache_dir() == tmp_path / "xdg" / "systems" / "flash_triton"
