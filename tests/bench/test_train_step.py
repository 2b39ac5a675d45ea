"""The fast-training-step variants: same losses and gradients as the reference path (fused
projections: from the same weights, converted), the Hugging Face baseline has our architecture's
parameters, timing rows, OOM rows, the notebook's plans (notebook 10's smoke run:
tests/notebooks/test_10_fast_train_step.py)."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from systems.bench import train_step as ts
from systems.config import get_config
from systems.measure.results import ResultWriter, read_records
from systems.model import fuse_projections_state_dict, unfuse_projections_state_dict
from systems.train import compute_loss


def _built(variant: str, **kw):
    torch.manual_seed(0)  # same seed, same initial weights for every variant of one impl
    cfg = ts.StepConfig(model="debug", variant=variant, context_length=32, device="cpu", **kw)
    return ts.build(cfg, device=torch.device("cpu"))


def _loss(built, x, y):
    model, _, step = built
    return compute_loss(step.spec, model, step.forward, x, y)


def test_fused_variant_matches_the_reference_loss_and_gradients():
    ref_model, ref_opt, ref_step = ref = _built("ours_eager")
    fused_model, _, _ = fused = _built("ours_fused")
    x = torch.randint(0, 512, (2, 32))
    y = torch.randint(0, 512, (2, 32))
    a, b = _loss(ref, x, y), _loss(fused, x, y)
    a.backward()
    b.backward()
    # fp32 on both paths; the fused loss sums chunk by chunk, so only rounding differs
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref_model.named_parameters(), fused_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def _steps(variant: ts.Variant, *, device: str, steps: int = 3):
    """Losses of ``steps`` training steps of the debug model, and (name, parameter, master) triples."""
    name = f"test_{id(variant)}"
    ts.VARIANTS[name] = variant
    try:
        torch.manual_seed(0)
        cfg = ts.StepConfig(model="debug", variant=name, context_length=32, device=device, lr=1e-3)
        model, opt, step = ts.build(cfg, device=torch.device(device))
    finally:
        del ts.VARIANTS[name]
    gen = torch.Generator(device=device).manual_seed(1)
    x, y = (torch.randint(0, 512, (2, 32), generator=gen, device=device) for _ in range(2))
    losses = [float(step(x, y)) for _ in range(steps)]
    master_of = getattr(opt, "master_of", lambda p: p)
    return losses, [(n, p, master_of(p)) for n, p in model.named_parameters()]


def test_master_weights_keep_autocasts_arithmetic():
    # bf16 matmul weights with fp32 masters in the optimizer against autocast over fp32 weights:
    # the matmuls see the same bf16 roundings and the gradients the same bf16 values (autocast's
    # cast back to fp32 is exact), so on a CPU the two paths agree bit for bit
    ref = ts.Variant(impl="ours", fused_loss=True, optimizer="fused")
    losses_ref, params_ref = _steps(ref, device="cpu")
    for extra in ({}, {"optimizer_in_backward": True}):
        losses, params = _steps(ts.Variant(**{**ts.asdict(ref), "master_weights": True, **extra}), device="cpu")
        assert losses == losses_ref, extra
        for (name, _, a), (_, p, master) in zip(params_ref, params):
            matmul = name.split(".")[-2] in {"q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3", "lm_head"}
            assert p.dtype == (torch.bfloat16 if matmul else torch.float32), name
            torch.testing.assert_close(master, a, atol=0, rtol=0, msg=f"{name} {extra}")


_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("base, fused, device", [
    ("ours_fused_master", "ours_fused_master_fusedproj", "cpu"),
    pytest.param("ours_master", "ours_master_fusedproj", "cuda", marks=_ON_GPU),
    pytest.param("ours_graphs", "ours_graphs_fusedproj", "cuda", marks=_ON_GPU),
])
def test_fused_projections_train_as_the_unfused_model_from_the_same_weights(base, fused, device, monkeypatch):
    # one seed gives the fused model other initial FFN weights (systems.model.SwiGLU), so both
    # variants start from one unfused model's weights, the fused one's converted; loaded as the
    # model is built, before the optimizer copies its fp32 masters
    import systems.model

    torch.manual_seed(0)
    start = systems.model.TransformerLM(get_config("debug")).state_dict()

    class FromStart(systems.model.TransformerLM):
        def __init__(self, cfg, **kw):
            super().__init__(cfg, **kw)
            self.load_state_dict(fuse_projections_state_dict(start) if cfg.fused_projections else start)

    monkeypatch.setattr(systems.model, "TransformerLM", FromStart)
    losses_ref, params_ref = _steps(ts.VARIANTS[base], device=device)
    losses, params = _steps(ts.VARIANTS[fused], device=device)
    # bf16 matmuls: a (n, 3d) GEMM may round an output to the neighbouring bf16 value where three
    # (n, d) ones did not, and x's gradient is rounded once out of one GEMM instead of three
    # times, added; the first loss agrees to the bit (CPU and H100), and a few flipped roundings
    # move a mean over 64 tokens by far less than 1e-3 (5e-5 seen after 3 steps)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), rtol=1e-3, atol=0)
    masters = unfuse_projections_state_dict({n: m for n, _, m in params})
    lr = 1e-3  # _steps' learning rate
    for name, _, want in params_ref:
        # Adam's first steps move every element by about lr whatever its gradient's size: an
        # element whose tiny gradient changes sign with a rounding moves the other way, so allow
        # per tensor at most 1% of the masters more than lr/2 apart, or one (a norm gain has 64);
        # at most 0.4% seen, on a CPU and on an H100
        far = int(((masters[name] - want).abs() > lr / 2).sum())
        assert far <= max(1, 0.01 * want.numel()), f"{name}: {far} of {want.numel()} elements differ by more than lr/2"
    stacked = {n: p.dtype for n, p, _ in params if n.split(".")[-2] in {"qkv_proj", "w13"}}
    assert stacked and set(stacked.values()) == {torch.bfloat16}  # the fused weights are matmul weights too


def test_fused_projection_variants_are_their_base_variants_plus_the_lever():
    for fused, base in (("ours_fused_master_fusedproj", "ours_fused_master"), ("ours_master_fusedproj", "ours_master"),
                        ("ours_graphs_fusedproj", "ours_graphs")):
        assert ts.VARIANTS[fused] == dataclasses.replace(ts.VARIANTS[base], fused_projections=True)
        assert ("QKV and W1/W3 as one GEMM each", base, fused) in ts.LEVERS
        for name, layout in ((fused, True), (base, False)):  # the variant alone sets the model's layout
            cfg = ts.StepConfig(model="debug", variant=name, context_length=32, device="cpu")
            assert cfg.model_config().fused_projections is layout
    assert "ours_master_fusedproj" in ts.FULL_PLAN.variants["2.7B"]
    assert "ours_graphs_fusedproj" in ts.FULL_PLAN.variants["xl-2025"]
    assert "ours_fused_master_fusedproj" in ts.SMOKE_PLAN.variants["debug"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["ours_master", "ours_graphs", "ours_graphs_overlap"])
def test_gpu_fast_variants_track_the_reference(variant):
    # Inductor and cuBLAS may pick other kernels (other summation orders) for each path, and
    # Adam's first steps move every element by about lr whatever its gradient's size, so an
    # element whose tiny gradient changes sign moves the other way: allow losses within 1e-2
    # relative over 3 steps, and per tensor at most 1% of the masters more than lr/10 apart
    lr = 1e-3
    ref = ts.Variant(impl="ours", compile_blocks=True, fused_loss=True, optimizer="fused")
    losses_ref, params_ref = _steps(ref, device="cuda")
    losses, params = _steps(ts.VARIANTS[variant], device="cuda")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), rtol=1e-2, atol=0)
    for (name, _, a), (_, _, master) in zip(params_ref, params):
        far = ((master - a).abs() > lr / 10).float().mean().item()
        assert far <= 0.01, f"{name}: {far:.2%} of the elements differ by more than lr/10"


def test_step_graph_variants_are_their_eager_variants_captured_whole():
    for name, base in (("ours_stepgraph_split", "ours_master_split"),
                       ("ours_stepgraph_overlap_sm16_split", "ours_master_overlap_sm16_split"),
                       ("ours_stepgraph_overlap_sm16_split_fusedproj_qkvrope",
                        "ours_master_overlap_sm16_split_fusedproj_qkvrope")):
        assert ts.VARIANTS[name] == dataclasses.replace(ts.VARIANTS[base], graph_step=True)
        assert ("the whole step as one CUDA graph", base, name) in ts.LEVERS
        assert ts.VARIANTS[name].optimizer_spec(lr=1e-3).capturable
    # against one graph per block: the same step with the blocks' graphs in place of the step's
    assert ts.VARIANTS["ours_stepgraph_overlap_split"] == dataclasses.replace(
        ts.VARIANTS["ours_graphs_overlap_split"], compile_mode=None, graph_step=True)
    for size, pairs in (("2.7B", [("ours_master_split", "ours_stepgraph_split"), ("ours_graphs_split", "ours_stepgraph_split"),
                                  ("ours_master_overlap_sm16_split", "ours_stepgraph_overlap_sm16_split")]),
                        ("xl-2025", [("ours_graphs_split", "ours_stepgraph_split"),
                                     ("ours_graphs_overlap_split_fusedproj_qkvrope",
                                      "ours_stepgraph_overlap_split_fusedproj_qkvrope")])):
        for pair in pairs:  # notebook 10's lever table measures each of them in one run
            assert set(pair) <= set(ts.FULL_PLAN.variants[size]) and pair in {(b, a) for _, b, a in ts.LEVERS}
    _, _, step = _built("ours_stepgraph_split", warmup=3)
    assert isinstance(step, ts.GraphedStep) and step.eager_steps == ts.GRAPH_EAGER_STEPS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant,base", [("ours_stepgraph_split", "ours_master_split"),
                                          ("ours_stepgraph_overlap_sm16_split", "ours_master_overlap_sm16_split")])
def test_gpu_step_graph_variants_track_their_eager_variants(variant, base):
    # the same compiled kernels, replayed: tolerances as test_gpu_fast_variants_track_the_reference's,
    # over 6 steps, 4 of them replays (a frozen bias correction would move most elements by more
    # than lr/10 after the first replays)
    lr = 1e-3
    losses_ref, params_ref = _steps(ts.VARIANTS[base], device="cuda", steps=6)
    losses, params = _steps(ts.VARIANTS[variant], device="cuda", steps=6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), rtol=1e-2, atol=0)
    for (name, _, a), (_, _, master) in zip(params_ref, params):
        far = ((master - a).abs() > lr / 10).float().mean().item()
        assert far <= 0.01, f"{name}: {far:.2%} of the elements differ by more than lr/10"


def test_variants_refuse_contradictions():
    with pytest.raises(ValueError, match="master_weights needs"):
        ts.Variant(impl="hf", optimizer="torch_fused", master_weights=True)
    with pytest.raises(ValueError, match="compile_mode applies"):
        ts.Variant(impl="ours", compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="sm_carveout leaves SMs"):
        ts.Variant(impl="ours", compile_blocks=True, optimizer="fused", sm_carveout=16)
    with pytest.raises(ValueError, match="optimizer in the backward or fused projections"):
        ts.Variant(impl="hf", optimizer="torch_fused", fused_projections=True)
    with pytest.raises(ValueError, match="choose a \\*_fusedproj or \\*_qkvrope variant"):
        ts.StepConfig(model="debug", variant="ours_eager", model_overrides={"fused_projections": True})
    with pytest.raises(ValueError, match="qkv_rope_kernel is a variant's lever"):
        ts.StepConfig(model="debug", variant="ours_eager", model_overrides={"qkv_rope_kernel": True})
    with pytest.raises(ValueError, match="set fused_projections=True"):
        ts.Variant(impl="ours", compile_blocks=True, qkv_rope_kernel=True)
    with pytest.raises(ValueError, match="graph_step captures the whole step"):
        ts.Variant(impl="ours", compile_blocks=True, optimizer="fused", compile_mode="reduce-overhead", graph_step=True)
    with pytest.raises(ValueError, match="need warmup >= 3"):
        ts.StepConfig(model="debug", variant="ours_stepgraph_split", warmup=2)
    cfg = ts.StepConfig(model="debug", variant="ours_graphs_fusedproj_qkvrope", device="cpu").model_config()
    assert cfg.fused_projections and cfg.qkv_rope_kernel


def test_hf_llama_has_our_architectures_parameter_count():
    pytest.importorskip("transformers")
    cfg = get_config("debug")
    hf = ts.hf_llama(cfg, device=torch.device("cpu"))
    # same layers, no biases, untied head: the closed-form count of our model
    assert sum(p.numel() for p in hf.parameters()) == cfg.n_params


@pytest.mark.parametrize("variant", ["ours_eager", "ours_fused", "ours_fused_master_fusedproj"])
def test_measure_reports_phases_that_add_up(variant, tmp_path):
    cfg = ts.StepConfig(model="debug", variant=variant, batch_size=2, context_length=32, warmup=1, steps=2,
                        device="cpu")
    row = ts.measure(cfg, trace_path=tmp_path / "t.json")
    assert row["status"] == "ok" and row["fused_projections"] == ts.VARIANTS[variant].fused_projections
    parts = row["forward_ms"] + row["backward_ms"] + row["optimizer_ms"]
    # medians of each phase need not sum to the median step exactly, but on 2 steps they bracket it
    assert 0.5 * row["step_ms"] <= parts <= 2.0 * row["step_ms"]
    assert row["tokens_per_s"] > 0 and (tmp_path / "t.json").exists()
    # the span of the timed steps per step: at least the shortest step (the host's work between steps
    # is in it too)
    assert row["step_ms_span"] >= row["step_ms_p10"] * 0.99


def test_cli_traces_one_variant_and_prints_where_its_time_goes(tmp_path, capsys):
    trace = tmp_path / "t.json"
    argv = ["--model", "debug", "--variants", "ours_eager", "--batch-size", "2", "--context-length", "32",
            "--steps", "2", "--warmup", "1", "--trace-variant", "ours_eager", "--trace", str(trace),
            "--out", str(tmp_path / "steps.jsonl")]
    assert ts.main(argv) == 0
    out = capsys.readouterr().out
    assert trace.exists() and f"trace: {trace}" in out
    # the category table (every category named), the phases, then the top kernels (here CPU operators)
    assert all(c in out for c in ("matmul", "elementwise", "reduction/softmax")) and "forward" in out
    assert "instances_per_step" in out and "mean_us" in out
    with pytest.raises(SystemExit):
        ts.main(["--model", "debug", "--variants", "ours_eager", "--trace-variant", "ours_fused"])
    assert "not among --variants" in capsys.readouterr().err


def test_overlap_variant_builds_one_optimizer_per_block_and_measures(monkeypatch):
    from systems.kernels.fused_adamw import FusedAdamW
    from systems.train import OptimizerInBackward

    model, opt, _ = _built("ours_overlap")
    assert isinstance(opt, OptimizerInBackward)
    # one per block, then embeddings, final norm, LM head
    assert len(opt.optimizers) == model.cfg.n_layers + 3
    assert all(isinstance(o, FusedAdamW) for o in opt.optimizers)
    # measure() through the optimizer-in-backward path, without the blocks' CPU compile (seconds)
    eager = ts.Variant(**{**ts.asdict(ts.VARIANTS["ours_overlap"]), "compile_blocks": False})
    monkeypatch.setitem(ts.VARIANTS, "overlap_eager", eager)
    cfg = ts.StepConfig(model="debug", variant="overlap_eager", batch_size=2, context_length=32, warmup=1,
                        steps=2, device="cpu")
    row = ts.measure(cfg)
    assert row["status"] == "ok" and row["optimizer_in_backward"]
    # the updates ran inside the backward: the optimizer phase is only step()'s bookkeeping
    assert row["optimizer_ms"] < row["backward_ms"]


def test_out_of_memory_becomes_a_row(monkeypatch, tmp_path):
    def boom(*_, **__):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ts, "build", boom)
    writer = ResultWriter(tmp_path / "rows.jsonl")
    rows = ts.run_variants(model="debug", variants=["ours_eager", "ours_fused"], writer=writer, device="cpu",
                           context_length=32, progress=False)
    assert [r["status"] for r in rows] == ["oom", "oom"]
    assert len(read_records(tmp_path / "rows.jsonl")) == 2


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown variant"):
        ts.StepConfig(variant="warp_drive")
    with pytest.raises(ValueError, match="warmup"):
        ts.StepConfig(warmup=0)
    proc = subprocess.run([sys.executable, "-m", "systems.bench.train_step", "--variants", "warp_drive"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_plans_name_known_variants_and_our_targets_known_presets():
    from systems.config import PRESETS

    for plan in (ts.FULL_PLAN, ts.SMOKE_PLAN):
        assert all(v in ts.VARIANTS for variants in plan.variants.values() for v in variants)
        assert plan.trace[1] in plan.variants[plan.trace[0]]
        ts.StepConfig(model=next(iter(plan.variants)), **plan.step)  # a valid step config
    assert set(ts.OUR_TARGETS_MS) <= set(PRESETS) and set(ts.OUR_TARGETS_MS) <= set(ts.FULL_PLAN.variants)
