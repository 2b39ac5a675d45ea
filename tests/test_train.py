"""OptimizerInBackward against the same optimizer stepped after the backward.

CPU: the updates run inside the hooks, synchronously; FusedAdamW takes its torch._foreach_*
fallback there (bit-identical to systems.optim.AdamW), so N steps must give exactly the
parameters of N plain steps. The Triton kernel path runs under TRITON_INTERPRET=1 in a
subprocess (as tests/kernels/test_fused_adamw.py does). GPU (marked gpu): the side stream.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from systems.config import get_config
from systems.kernels.fused_adamw import LOW_BITS, FusedAdamW
from systems.model import TransformerLM
from systems.optim import AdamW, cross_entropy
from systems.train import (GraphedStep, GroupedOptimizer, OptimizerInBackward, OptimizerSpec, StepSpec, TrainStep,
                           block_groups, build_optimizer, matmul_sm_carveout, matmul_weights_of, phase_ms,
                           priority_stream)
from systems.measure.timer import Marks
from systems.testing import have_triton, interpreting, run_interpreter_cases

INTERPRETING = interpreting()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# the kernel against AdamW's fp32 torch ops: an ulp or so per moment, ~1e-7 relative per update
# (the tolerance tests/kernels/test_fused_adamw.py explains)
KERNEL_TOL = dict(atol=1e-6, rtol=1e-5)


def twin_models(*, device="cpu", **overrides):
    """Two debug TransformerLMs with the same initial weights."""
    cfg = get_config("debug", context_length=32, **overrides)
    torch.manual_seed(0)
    a = TransformerLM(cfg).to(device)
    b = TransformerLM(cfg).to(device)
    b.load_state_dict(a.state_dict())
    return cfg, a, b


def train(model, opt, batches, *, device="cpu", autocast=False):
    for x, y in batches:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            loss = cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def random_batches(cfg, *, steps, device="cpu", batch=2, seq=32):
    gen = torch.Generator(device=device).manual_seed(1)
    return [tuple(torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen) for _ in range(2))
            for _ in range(steps)]


def in_backward(model, optimizer_cls, **kw):
    return OptimizerInBackward(block_groups(model, blocks=model.layers),
                               make_optimizer=lambda ps: optimizer_cls(ps, **HYPER), **kw)


def train_twins(ref_cls, ours_cls, *, steps, autocast=False):
    """Twin models trained on the same batches: ``ref_cls`` stepped after each backward, ``ours_cls``
    one per group inside it. Returns (ref, ours, ref_opt, ours_opt) for assert_same_training."""
    cfg, ref, ours = twin_models()
    batches = random_batches(cfg, steps=steps)
    ref_opt = ref_cls(ref.parameters(), **HYPER)
    ours_opt = in_backward(ours, ours_cls)
    train(ref, ref_opt, batches, autocast=autocast)
    train(ours, ours_opt, batches, autocast=autocast)
    return ref, ours, ref_opt, ours_opt


def assert_same_training(ref, ours, ref_opt, ours_opt, **tol):
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, msg=name, **tol)
    ref_state = ref_opt.state
    ours_state = {p: s for o in ours_opt.optimizers for p, s in o.state.items()}
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert ours_state[b]["step"] == ref_state[a]["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours_state[b][key], ref_state[a][key], **tol)


# ----------------------------------------------------------------------------- CPU


@pytest.mark.skipif(INTERPRETING, reason="the foreach fallback runs for CPU tensors outside the interpreter")
@pytest.mark.parametrize("optimizer_cls", [FusedAdamW, AdamW])
def test_matches_the_plain_optimizer_exactly(optimizer_cls):
    # fp32 on a CPU: each group is updated after its last use in the backward, so every gradient
    # is the plain run's; the update is elementwise and the same ops as AdamW's: bit-identical
    ref, ours, ref_opt, ours_opt = train_twins(AdamW, optimizer_cls, steps=4)
    assert_same_training(ref, ours, ref_opt, ours_opt, atol=0, rtol=0)


def test_matches_under_bf16_autocast():
    # the benchmark's setting: bf16 matmuls over fp32 weights; the same ops on both sides, so exact too
    ref, ours, ref_opt, ours_opt = train_twins(FusedAdamW, FusedAdamW, steps=3, autocast=True)
    assert_same_training(ref, ours, ref_opt, ours_opt, atol=0, rtol=0)


def test_updates_happen_inside_the_backward():
    cfg, model, _ = twin_models()
    opt = in_backward(model, FusedAdamW)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = random_batches(cfg, steps=1)[0]
    cross_entropy(model(x), y).backward()
    # before step(): every parameter already moved and its gradient was freed
    for p, p0 in zip(model.parameters(), before):
        assert not torch.equal(p, p0)
        assert p.grad is None
    opt.step()
    assert all(o.state[p]["step"] == 1 for o in opt.optimizers for p in o.param_groups[0]["params"])


def test_block_groups_cover_every_parameter_once():
    cfg, model, _ = twin_models()
    groups = block_groups(model, blocks=model.layers)
    # one per block, then the embeddings, the final norm and the LM head
    assert len(groups) == cfg.n_layers + 3
    ids = [id(p) for g in groups for p in g]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert groups[0] == list(model.layers[0].parameters())
    assert groups[-1] == [model.lm_head.weight]


class _TiedLM(nn.Module):
    """Embedding tied to the head, and one weight shared by both blocks."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        shared = nn.Linear(d, d)
        self.blocks = nn.ModuleList([nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Linear(d, d))])
        self.extra = nn.Parameter(torch.zeros(d))  # used only when ``use_extra``
        self.use_extra = True

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        if self.use_extra:
            h = h + self.extra
        return h @ self.embed.weight.T


def test_tied_and_shared_weights_are_updated_once_after_their_last_use():
    # autograd sums every use of a shared leaf before its AccumulateGrad runs: one hook, after
    # the last use; a skipped parameter (``extra`` in step 1) is skipped as a plain optimizer does
    torch.manual_seed(0)
    ref, ours = _TiedLM(), _TiedLM()
    ours.load_state_dict(ref.state_dict())
    groups = block_groups(ours, blocks=ours.blocks)
    assert len(groups[0]) == 2 and len(groups[1]) == 2  # the shared Linear goes with the first block
    assert groups[2:] == [[ours.extra], [ours.embed.weight]]  # the root's own parameter, then the embedding's
    # ``extra`` shares the embedding's group: in step 1 that group is partial, updated by step()
    groups = groups[:2] + [[ours.embed.weight, ours.extra]]
    ref_opt = AdamW(ref.parameters(), **HYPER)
    ours_opt = OptimizerInBackward(groups, make_optimizer=lambda ps: AdamW(ps, **HYPER))
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        ref.use_extra = ours.use_extra = step != 1
        x, y = (torch.randint(0, 32, (4, 8), generator=gen) for _ in range(2))
        for model, opt in ((ref, ref_opt), (ours, ours_opt)):
            cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert_same_training(ref, ours, ref_opt, ours_opt, atol=0, rtol=0)
    assert ours_opt.optimizers[-1].state[ours.extra]["step"] == 2
    assert ours_opt.optimizers[-1].state[ours.embed.weight]["step"] == 3


def test_two_backward_passes_before_step_are_refused():
    cfg, model, _ = twin_models()
    opt = in_backward(model, AdamW, free_grads=False)
    x, y = random_batches(cfg, steps=1)[0]
    cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="accumulated twice"):
        cross_entropy(model(x), y).backward()
    # zero_grad starts a new step: one backward is fine again
    opt.zero_grad()
    cross_entropy(model(x), y).backward()
    opt.step()


def test_grouped_optimizer_matches_the_plain_optimizer_stepped_early_or_late():
    # GroupedOptimizer's groups are updated after the backward (every gradient is final), by
    # step_group for some groups (as DDPBucketed's on_synced does) and step() for the rest: the
    # same elementwise ops on the same gradients as one AdamW over everything, so bit-identical
    cfg, ref, ours = twin_models()
    batches = random_batches(cfg, steps=3)
    ref_opt = AdamW(ref.parameters(), **HYPER)
    ours_opt = GroupedOptimizer(block_groups(ours, blocks=ours.layers), make_optimizer=lambda ps: AdamW(ps, **HYPER))
    train(ref, ref_opt, batches)
    for i, (x, y) in enumerate(batches):
        cross_entropy(ours(x), y).backward()
        for group in reversed(ours_opt.groups[:i + 1]):  # a different number of early groups each step
            ours_opt.step_group(group)
        ours_opt.step()
        ours_opt.zero_grad(set_to_none=True)
    assert_same_training(ref, ours, ref_opt, ours_opt, atol=0, rtol=0)


def test_grouped_optimizer_steps_each_group_once_and_only_whole_groups():
    cfg, model, _ = twin_models()
    opt = build_optimizer(model, OptimizerSpec(kind="ours", grouped=True))
    assert isinstance(opt, GroupedOptimizer) and len(opt.groups) == cfg.n_layers + 3  # + embedding, norm, head
    x, y = random_batches(cfg, steps=1)[0]
    cross_entropy(model(x), y).backward()
    first = opt.groups[0]
    with pytest.raises(ValueError, match="one whole group"):
        opt.step_group(first[:1])
    opt.step_group(list(reversed(first)))
    with pytest.raises(RuntimeError, match="updated twice"):
        opt.step_group(first)
    opt.step()
    assert all(o.state[p]["step"] == 1 for o in opt.optimizers for p in o.param_groups[0]["params"])
    with pytest.raises(ValueError, match="excludes sharded"):
        OptimizerSpec(grouped=True, sharded=True)


def test_bad_groups_are_clear_errors():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    make = lambda ps: AdamW(ps)  # noqa: E731
    with pytest.raises(ValueError, match="two groups"):
        OptimizerInBackward([[a], [a, b]], make_optimizer=make)
    with pytest.raises(ValueError, match="empty"):
        OptimizerInBackward([[a], []], make_optimizer=make)
    with pytest.raises(ValueError, match="does not require grad"):
        OptimizerInBackward([[a, nn.Parameter(torch.zeros(2), requires_grad=False)]], make_optimizer=make)


def test_state_dict_round_trip_and_remove():
    cfg, ref, ours = twin_models()
    batches = random_batches(cfg, steps=4)
    ref_opt, ours_opt = in_backward(ref, AdamW), in_backward(ours, AdamW)
    train(ref, ref_opt, batches)
    train(ours, ours_opt, batches[:2])
    # a fresh wrapper on the same model continues from the saved state
    state = ours_opt.state_dict()
    ours_opt.remove()
    resumed = in_backward(ours, AdamW)
    resumed.load_state_dict(state)
    train(ours, resumed, batches[2:])
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    with pytest.raises(ValueError, match="group optimizers"):
        resumed.load_state_dict({"optimizers": state["optimizers"][:1]})
    # without hooks the backward only accumulates gradients
    resumed.remove()
    before = [p.detach().clone() for p in ours.parameters()]
    x, y = batches[0]
    cross_entropy(ours(x), y).backward()
    assert all(torch.equal(p, p0) and p.grad is not None for p, p0 in zip(ours.parameters(), before))


def test_split_masters_need_master_weights():
    with pytest.raises(ValueError, match="set master_weights=True"):
        OptimizerSpec(kind="fused", split_masters=True)


@pytest.mark.skipif(INTERPRETING, reason="the foreach fallback runs for CPU tensors outside the interpreter")
@pytest.mark.parametrize("in_backward", [False, True])
def test_split_masters_train_as_fp32_masters(in_backward):
    # OptimizerSpec.split_masters reaches MasterWeightAdamW (per group inside the backward too):
    # no fp32 master tensors, the same training as fp32 masters. A master whose update is a tie
    # rounded down is stored one ulp lower (a handful among these ~140k weights x 4), and later
    # updates add the same values to both (the moments do not depend on the weights): the
    # masters agree to about an ulp; the bf16 weights, so the forward and the gradients, exactly
    cfg, ref, ours = twin_models()
    batches = random_batches(cfg, steps=3)
    spec = OptimizerSpec(kind="fused", lr=1e-2, master_weights=True, in_backward=in_backward)
    ref_opt = build_optimizer(ref, spec)
    ours_opt = build_optimizer(ours, replace(spec, split_masters=True))
    optimizers = ours_opt.optimizers if in_backward else [ours_opt]
    assert not any(o._copies for o in optimizers)
    assert all(w.dtype == torch.bfloat16 and any(LOW_BITS in o.state.get(w, {}) for o in optimizers)
               for w in matmul_weights_of(ours))
    train(ref, ref_opt, batches, autocast=True)
    train(ours, ours_opt, batches, autocast=True)
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(ours_opt.master_of(b), ref_opt.master_of(a), atol=1e-8, rtol=1e-6, msg=name)


def test_priority_stream_is_a_no_op_on_a_cpu():
    with priority_stream(torch.device("cpu")) as stream:
        assert stream is None


def test_sm_carveout_is_checked_and_a_no_op_on_a_cpu():
    with pytest.raises(ValueError, match="counts SMs left free"):
        StepSpec(sm_carveout=-1)
    before = torch._C._get_sm_carveout_experimental()
    with matmul_sm_carveout(16, torch.device("cpu")):
        assert torch._C._get_sm_carveout_experimental() == before


def test_graphed_step_refuses_what_a_replay_cannot_redo():
    _, model, _ = twin_models()
    capturable = build_optimizer(model, OptimizerSpec(kind="fused", capturable=True))
    spec = StepSpec(precision="bf16", loss="fused")
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedStep(TrainStep(model, spec=spec, optimizer=FusedAdamW(model.parameters())))
    with pytest.raises(ValueError, match="fp16 loss scaling"):
        GraphedStep(TrainStep(model, spec=replace(spec, precision="fp16"), optimizer=capturable))
    with pytest.raises(ValueError, match="sync_phases"):
        GraphedStep(TrainStep(model, spec=replace(spec, sync_phases=True), optimizer=capturable))
    with pytest.raises(ValueError, match="data-parallel wrapper"):
        GraphedStep(TrainStep(model, spec=spec, optimizer=capturable, grad_sync=object()))
    with pytest.raises(ValueError, match="eager_steps must be >= 1"):
        GraphedStep(TrainStep(model, spec=spec, optimizer=capturable), eager_steps=0)
    with pytest.raises(ValueError, match="capturable is FusedAdamW's"):
        OptimizerSpec(kind="ours", capturable=True)
    # its eager steps are the step itself; past them a CPU batch is refused, not captured
    graphed = GraphedStep(TrainStep(model, spec=spec, optimizer=capturable), eager_steps=1)
    x, y = random_batches(get_config("debug"), steps=1)[0]
    assert torch.isfinite(graphed(x, y))
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        graphed(x, y)


# ----------------------------------------------------------------------------- Triton kernel, CPU


@pytest.mark.skipif(not have_triton() or INTERPRETING, reason="spawns the interpreter run itself")
def test_triton_kernel_in_interpreter_subprocess():
    """Runs this file's test_interp_* case with TRITON_INTERPRET=1 set before triton is imported."""
    run_interpreter_cases(__file__, min_passed=1)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")
def test_interp_fused_kernel_per_group_matches_adamw():
    # FusedAdamW's kernel, one launch per group, against AdamW's torch ops after the backward
    ref, ours, ref_opt, ours_opt = train_twins(AdamW, FusedAdamW, steps=2)
    assert_same_training(ref, ours, ref_opt, ours_opt, **KERNEL_TOL)
    assert all(o._tables for o in ours_opt.optimizers)  # every group went through the kernel


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_cuda
def test_gpu_sm_carveout_is_set_inside_and_restored():
    device = torch.device("cuda")
    count = torch.cuda.get_device_properties(device).multi_processor_count
    before = (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library())
    a = torch.randn(512, 512, device=device, dtype=torch.bfloat16)
    with matmul_sm_carveout(16, device):
        assert torch._C._get_sm_carveout_experimental() == 16
        torch.testing.assert_close(a @ a, (a.float() @ a.float()).bfloat16(), rtol=2e-2, atol=1e-1)
    assert (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()) == before
    with pytest.raises(ValueError, match="leaves the matmuls no SM"):
        with matmul_sm_carveout(count, device):
            pass


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_gpu_graphed_step_trains_as_the_eager_step(in_backward):
    # the same kernels with the same arguments (the scalars read from memory are the same fp32
    # values), so the replays follow the eager steps up to the run-to-run differences of the
    # backward's atomics: KERNEL_TOL. A replay that kept the capture's bias corrections, read a
    # stale batch or raced the side stream's updates would be far outside it
    cfg, ref, ours = twin_models(device="cuda", d_model=256, d_ff=768, n_layers=4, n_heads=4)
    batches = random_batches(cfg, steps=6, device="cuda", batch=4, seq=32)
    spec = StepSpec(precision="bf16", loss="fused")
    opt_spec = OptimizerSpec(kind="fused", lr=1e-3, master_weights=True, split_masters=True, in_backward=in_backward,
                             capturable=True)
    steps = [TrainStep(m, spec=spec, optimizer=build_optimizer(m, opt_spec)) for m in (ref, ours)]
    graphed = GraphedStep(steps[1], eager_steps=2)
    with priority_stream(torch.device("cuda")):  # as train_step.measure runs the in-backward variants
        losses_ref = [float(steps[0](x, y)) for x, y in batches]
        losses = []
        for x, y in batches:
            marks = Marks(torch.device("cuda"))
            losses.append(float(graphed(x, y, marks=marks)))
    assert graphed.graph is not None
    assert set(phase_ms(marks)) == {"replay", "step"}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), rtol=1e-4, atol=0)
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        master_a, master_b = steps[0].optimizer.master_of(a), steps[1].optimizer.master_of(b)
        torch.testing.assert_close(master_b, master_a, msg=name, **KERNEL_TOL)


@pytest.mark.gpu
@needs_cuda
def test_gpu_side_stream_matches_the_plain_step():
    # a model large enough that the side stream's updates overlap later backward kernels; the
    # same kernels on the same values as the plain FusedAdamW step, so the only differences
    # would come from a race (an update reading a gradient whose memory was reused, or a
    # forward reading weights before their update ended), which would be far above this tolerance
    cfg, ref, ours = twin_models(device="cuda", d_model=512, d_ff=1536, n_layers=8, n_heads=8)
    batches = random_batches(cfg, steps=4, device="cuda", batch=8, seq=32)
    ref_opt = FusedAdamW(ref.parameters(), **HYPER)
    ours_opt = in_backward(ours, FusedAdamW)
    train(ref, ref_opt, batches, device="cuda", autocast=True)
    with priority_stream(torch.device("cuda")) as stream:  # as train_step.measure runs it
        assert torch.cuda.current_stream() == stream and stream.priority < torch.cuda.Stream().priority
        train(ours, ours_opt, batches, device="cuda", autocast=True)
    torch.cuda.synchronize()
    assert_same_training(ref, ours, ref_opt, ours_opt, **KERNEL_TOL)
