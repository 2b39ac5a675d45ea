"""The DDP benchmark: settings, variants, budget, and the wrappers' check against one process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from systems.bench.ddp import DDPBenchConfig, main, notebook_config, run_ddp_benchmark
from systems.measure.results import read_records


@pytest.mark.slow
def test_ddp_benchmark_compiled_setting_runs_after_eager(tmp_path):
    """A compiled setting reuses the eager setting's variants on the same model with its blocks
    compiled: rows carry (precision, compiled, setting), each setting has its own nosync baseline,
    and the DDP hooks still see every gradient (the bucketed run would hang or raise otherwise)."""
    cfg = DDPBenchConfig(model="debug", context_length=32, batch_size=2, precisions=("fp32",),
                         compiled_precisions=("fp32",), variants=("nosync", "bucketed:0.05", "torch_ddp"),
                         warmup=1, steps=2, profile=False, out_path=str(tmp_path / "ddp.jsonl"),
                         overlap_path=str(tmp_path / "overlap.jsonl"), trace_dir=str(tmp_path / "traces"))
    run_ddp_benchmark(cfg, world_size=2, backend="gloo", timeout_s=300)
    rows = read_records(tmp_path / "ddp.jsonl")
    assert [(r["setting"], r["variant"]) for r in rows] == [
        ("fp32", "nosync"), ("fp32", "bucketed:0.05"), ("fp32", "torch_ddp"),
        ("fp32+compile", "nosync"), ("fp32+compile", "bucketed:0.05"), ("fp32+compile", "torch_ddp")]
    for r in rows:
        assert r["compiled"] == (r["setting"] == "fp32+compile")
        assert r["first_step_s"] > 0 and r["step_ms"] > 0
    by = {(r["setting"], r["variant"]): r for r in rows}
    assert by[("fp32+compile", "torch_ddp")]["baseline_step_ms"] == by[("fp32+compile", "nosync")]["step_ms"]


@pytest.mark.slow
def test_the_command_line_runs_only_the_variants_it_is_given(tmp_path):
    main(["--model", "debug", "--context-length", "32", "--global-batch", "2", "--backend", "gloo",
          "--precisions", "fp32", "--variants", "nosync", "overlap", "torch_ddp", "--no-torch-ddp", "--no-profile",
          "--warmup", "1", "--steps", "2", "--out-dir", str(tmp_path)])
    rows = read_records(tmp_path / "07_distributed_ddp.jsonl")
    assert [(r["setting"], r["variant"], r["status"]) for r in rows] == [("fp32", "nosync", "ok"),
                                                                         ("fp32", "overlap", "ok")]


@pytest.mark.slow
def test_ddp_benchmark_master_weights_setting_runs_last_with_bf16_gradients(tmp_path):
    """The master-weights setting converts the model after the others: its rows come last, carry
    master_weights and the bf16 gradient bytes (about half of fp32's), and bucketed_update (each
    block updated as its bucket lands) and peer_update (the other ranks' gradients summed inside
    each block's update) train through the same step as the other variants."""
    cfg = DDPBenchConfig(model="debug", context_length=32, batch_size=2, precisions=("fp32",),
                         variants=("nosync", "bucketed:0.05"), master_weights=True,
                         master_variants=("nosync", "bucketed_update", "peer_update", "torch_ddp"),
                         include_torch_ddp=False,
                         warmup=1, steps=2, profile=False, out_path=str(tmp_path / "ddp.jsonl"),
                         overlap_path=str(tmp_path / "overlap.jsonl"), trace_dir=str(tmp_path / "traces"))
    run_ddp_benchmark(cfg, world_size=2, backend="gloo", timeout_s=300)
    rows = read_records(tmp_path / "ddp.jsonl")
    assert [(r["setting"], r["variant"]) for r in rows] == [
        ("fp32", "nosync"), ("fp32", "bucketed:0.05"),
        ("bf16-master", "nosync"), ("bf16-master", "bucketed_update"), ("bf16-master", "peer_update"),
        ("bf16-master", "torch_ddp")]
    fp32, master = rows[0], rows[-1]
    assert master["master_weights"] and not fp32["master_weights"]
    # the debug model's matmul weights are most of its parameters; embedding and norms stay fp32
    assert 0.5 * fp32["grad_bytes"] < master["grad_bytes"] < 0.8 * fp32["grad_bytes"]
    update, peer = rows[3], rows[4]
    assert update["status"] == "ok" and update["n_buckets"] > 1
    assert peer["status"] == "ok"
    # the updates run inside the gradient sync, so little is left for the optimizer phase
    assert update["optimizer_ms"] < update["sync_wait_ms"]
    assert peer["optimizer_ms"] < peer["sync_wait_ms"]


@pytest.mark.slow
def test_paired_rounds_alternate_nosync_the_fastest_variant_and_torch_ddp(tmp_path):
    """The rounds run (ABC, CBA) between the master-weights setting's variants and torch DDP's own
    block, which stays last; each round's overhead and ratio to torch DDP come from its own medians."""
    cfg = DDPBenchConfig(model="debug", context_length=32, batch_size=2, precisions=("fp32",), variants=("nosync",),
                         master_weights=True, master_variants=("nosync", "peer_update", "torch_ddp"), paired_rounds=2,
                         warmup=1, steps=2, profile=False, out_path=str(tmp_path / "ddp.jsonl"),
                         overlap_path=str(tmp_path / "overlap.jsonl"), paired_path=str(tmp_path / "paired.jsonl"),
                         trace_dir=str(tmp_path / "traces"))
    result = run_ddp_benchmark(cfg, world_size=2, backend="gloo", timeout_s=300)
    rounds = read_records(tmp_path / "paired.jsonl")
    assert rounds == result["paired"]
    assert [(r["setting"], r["round"], r["variant"], r["first"], r["status"]) for r in rounds] == [
        ("bf16-master", 0, "peer_update", "nosync", "ok"), ("bf16-master", 1, "peer_update", "torch_ddp", "ok")]
    for r in rounds:
        assert r["overhead_ms"] == r["variant_ms"] - r["nosync_ms"]
        assert r["share"] == pytest.approx(r["overhead_ms"] / r["variant_ms"])
        assert r["torch_ddp_ms"] > 0 and r["vs_torch_ddp"] == pytest.approx(r["variant_ms"] / r["torch_ddp_ms"])
    assert [r["variant"] for r in read_records(tmp_path / "ddp.jsonl")][-1] == "torch_ddp"


@pytest.mark.slow
def test_paired_rounds_without_torch_ddp_alternate_two_arms(tmp_path):
    """Without torch DDP among the master variants the rounds are ABBA of no sync and ours, and
    their rows carry no torch DDP time."""
    cfg = DDPBenchConfig(model="debug", context_length=32, batch_size=2, precisions=("fp32",), variants=("nosync",),
                         master_weights=True, master_variants=("nosync", "peer_update"), paired_rounds=2,
                         include_torch_ddp=False, warmup=1, steps=2, profile=False,
                         out_path=str(tmp_path / "ddp.jsonl"), overlap_path=str(tmp_path / "overlap.jsonl"),
                         paired_path=str(tmp_path / "paired.jsonl"), trace_dir=str(tmp_path / "traces"))
    rounds = run_ddp_benchmark(cfg, world_size=2, backend="gloo", timeout_s=300)["paired"]
    assert [(r["first"], r["status"]) for r in rounds] == [("nosync", "ok"), ("peer_update", "ok")]
    assert not any("torch_ddp_ms" in r or "vs_torch_ddp" in r for r in rounds)


def _torch_ddp_leftover_worker(ctx) -> dict:
    import gc
    import weakref

    import torch

    from systems.config import get_config
    from systems.model import TransformerLM
    from systems.parallel.plan import ParallelPlan, apply

    torch.manual_seed(0)
    model = TransformerLM(get_config("debug"))
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(ctx.rank))
    par = apply(model, ParallelPlan(data_parallel="torch_ddp"))
    par.forward(tokens).sum().backward()
    averaged = model.lm_head.weight.grad.double().sum().item()
    # the wrapper still referenced: a backward through the bare model, as the next arm's runs
    model.zero_grad(set_to_none=True)
    model(tokens).sum().backward()
    bare = model.lm_head.weight.grad.double().sum().item()
    wrapper = weakref.ref(par.wrapper)
    del par
    freed = wrapper() is None  # before any garbage collection: nothing but the bench held it
    gc.collect()
    return {"averaged": averaged, "bare": bare, "freed": freed}


@pytest.mark.slow
def test_torch_ddp_inside_the_rounds_leaves_the_next_arm_alone():
    """The rounds run our arms after torch DDP's (CBA): its hooks must not reduce the bare model's
    gradients while the wrapper lives, and deleting the wrapper must free it at once. The ranks'
    tokens differ, so a gradient averaged by DDP is the same on both and a bare one is not."""
    from systems.parallel.launch import spawn

    out = spawn(_torch_ddp_leftover_worker, 2, "gloo", timeout_s=30, deadline_s=120)
    assert out[0]["averaged"] == pytest.approx(out[1]["averaged"])
    assert out[0]["bare"] != pytest.approx(out[1]["bare"])
    assert all(r["freed"] for r in out)


def test_ddp_bench_config_rejects_unknown_compiled_precision():
    with pytest.raises(ValueError, match="precisions must be among"):
        DDPBenchConfig(compiled_precisions=("fp8",))
    with pytest.raises(ValueError, match="compile_mode applies"):
        DDPBenchConfig(compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="nothing to run"):
        DDPBenchConfig(precisions=())
    assert DDPBenchConfig(precisions=(), compiled_precisions=("bf16",)).settings() == [("bf16", True, False)]
    assert DDPBenchConfig(precisions=(), compiled_precisions=("bf16",), master_weights=True).settings()[-1] == (
        "bf16", True, True)
    for grouped in ("bucketed_update", "peer_update"):
        with pytest.raises(ValueError, match=f"{grouped} update the blocks.*list them in master_variants"):
            DDPBenchConfig(variants=("nosync", grouped))
    with pytest.raises(ValueError, match="positive count of copy streams"):
        DDPBenchConfig(master_weights=True, master_variants=("nosync", "peer_update:0"))
    from systems.bench.ddp import variant_plan

    graphed = variant_plan("peer_update:graphs")
    assert graphed.data_parallel == "peer" and graphed.copy_graphs and graphed.copy_streams == 1
    assert not variant_plan("peer_update:2").copy_graphs
    both = variant_plan("peer_update:graphs+thread+2")
    assert both.copy_graphs and both.issue_thread and both.copy_streams == 2
    assert not variant_plan("peer_update").issue_thread
    assert variant_plan("peer_update:deferred").defer_copies and not variant_plan("peer_update:graphs").defer_copies
    assert variant_plan("peer_update:read").read_peers and not variant_plan("peer_update").read_peers
    with pytest.raises(ValueError, match="options joined by '\\+'.*got 'threads'"):
        variant_plan("peer_update:graphs+threads")
    with pytest.raises(ValueError, match="positive count of SMs"):
        DDPBenchConfig(master_weights=True, master_variants=("nosync", "bucketed_update:x"))
    with pytest.raises(ValueError, match="gradients are bf16 already"):
        DDPBenchConfig(master_weights=True, master_variants=("nosync", "bucketed_lp:100"))
    with pytest.raises(ValueError, match="paired_rounds alternate the master-weights setting's nosync"):
        DDPBenchConfig(paired_rounds=2)
    with pytest.raises(ValueError, match="paired_rounds counts rounds"):
        DDPBenchConfig(master_weights=True, paired_rounds=-1)
    with pytest.raises(ValueError, match="<MiB>/<last MiB>"):  # refused before any rank starts
        DDPBenchConfig(variants=("bucketed_tail:1000",))
    proc = subprocess.run([sys.executable, "-m", "systems.bench.ddp", "--tail-buckets-mb", "1000"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--tail-buckets-mb" in proc.stderr


@pytest.mark.slow
def test_a_variant_past_the_budget_is_recorded_as_skipped(tmp_path):
    """The budget is wall-clock seconds for the sweep: once the next variant's warm-up and timed
    steps would run past it, the variant gets a row with status "skipped (budget)" and nothing
    runs; every rank takes the same branch (rank 0's clock decides), so nothing hangs."""
    cfg = DDPBenchConfig(model="debug", context_length=32, batch_size=2, precisions=("fp32",),
                         variants=("nosync", "naive", "flat", "overlap"), warmup=1, steps=2, profile=False,
                         budget_s=1e-3, out_path=str(tmp_path / "ddp.jsonl"), overlap_path=str(tmp_path / "o.jsonl"),
                         trace_dir=str(tmp_path / "traces"))
    run_ddp_benchmark(cfg, world_size=2, backend="gloo", timeout_s=120)
    rows = read_records(tmp_path / "ddp.jsonl")
    # the first variant always runs (nothing is known about the step yet); the rest would overrun
    assert [(r["variant"], r["status"]) for r in rows] == [
        ("nosync", "ok"), ("naive", "skipped (budget)"), ("flat", "skipped (budget)"), ("overlap", "skipped (budget)")]
    assert rows[0]["backward_ms"] > 0 and rows[0]["step_ms"] >= rows[0]["backward_ms"]


def test_notebook_configs_follow_the_handouts_xl():
    """2025's xl is the xl-2025 preset with the handout's 1-1000 MB bucket sweep; 2026's xl is the
    2.7B preset (2560/10240/32/32); the smoke profile is the debug model."""
    c25, c26 = notebook_config(profile="full", handout="2025"), notebook_config(profile="full", handout="2026")
    assert c25.model == "xl-2025" and c26.model == "2.7B"
    assert {f"bucketed:{b:g}" for b in (1, 10, 100, 1000)} <= set(c25.variants)
    assert c26.model_config().d_model == 2560 and c26.model_config().n_layers == 32
    for c in (c25, c26):
        assert c.variants[0] == "nosync" and c.variants[-1] == "torch_ddp"
        assert {"naive", "flat", "overlap"} <= set(c.variants) and c.budget_s is not None
        assert (c.context_length, c.batch_size) == (512, 4)
    assert notebook_config(profile="smoke", handout="2026").model == "debug"
    with pytest.raises(ValueError, match="budget_s"):
        DDPBenchConfig(budget_s=0)


@pytest.mark.slow
def test_every_wrapper_trains_like_one_process(tmp_path):
    """The notebook's check of the code deliverables: each wrapper's weights after 3 AdamW steps
    on 2 gloo ranks against one process on the whole batch. fp32 sums of the half-batch gradients
    in another order differ in the last bits (~1e-7 relative per step), so a few 1e-7 is the
    expected distance; a wrong average or a missing gradient moves weights by lr = 1e-3 or more."""
    from systems.bench.ddp import CHECKED_WRAPPERS, check_against_single_process

    rows = check_against_single_process(tmp_path / "check.jsonl")
    assert sorted((r["wrapper"], r["rank"]) for r in rows) == sorted((w, r) for w, _ in CHECKED_WRAPPERS for r in (0, 1))
    for r in rows:
        assert r["max_abs_diff"] < 1e-5, r


def test_trace_paths_are_files_directly_in_the_trace_directory():
    """A bucketed_tail variant's '/' once made a subdirectory per trace."""
    from systems.bench.ddp import trace_path

    path = trace_path("traces", setting="bf16+compile", variant="bucketed_tail:1000/1")
    assert path.parent.name == "traces" and path.name == "ddp_bf16_compile_bucketed_tail_1000_1_rank0.json.gz"
    assert trace_path("t", setting="bf16-master+compile", variant="peer_update").name == (
        "ddp_bf16-master_compile_peer_update_rank0.json.gz")


def test_a_variant_that_runs_out_of_memory_leaves_the_model_without_its_wrapper(monkeypatch):
    # the sweep turns the error into an "oom" row and goes on, so the next variant must not find
    # this one's gradient hooks still on the model
    import torch

    from systems.bench import ddp

    closed = []
    monkeypatch.setattr(ddp, "_train_step", lambda name, model, opt, precision: ("par", "step"))
    monkeypatch.setattr(ddp, "_close", lambda par, opt: closed.append((par, opt)))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(ddp, "_timed_steps", out_of_memory)
    ctx = type("Ctx", (), {"device": torch.device("cpu")})()
    from systems.measure.devices import catch_oom

    with catch_oom() as oom:
        ddp._time_variant("overlap", "model", "opt", "fp32", None, None, ctx, cfg=None)
    assert oom and oom.message.startswith("CUDA out of memory") and closed == [("par", "opt")]
