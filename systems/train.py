"""The training step every harness runs, the optimizers it steps, and the optimizer inside the backward.

One step, its variants as data:

    step = TrainStep(model, spec=StepSpec(precision="bf16", loss="fused"), optimizer=opt, grad_sync=ddp)
    loss = step(tokens, targets, marks=Marks(device))

- ``StepSpec``: the mode (forward only, forward + backward, or the full train step), the
  precision (bf16 / fp16 autocast over the model's weights; fp16 scales the loss), the loss
  (logits then cross-entropy, or the fused LM head + loss that never materialises the logits),
  and whether each phase ends with a device synchronisation (host timers, profiles).
- ``GraphedStep(step)``: the same step captured whole as one CUDA graph and replayed (its
  optimizer built with ``OptimizerSpec(capturable=True)``).
- The model may come wrapped: ``forward`` is what the step calls (a compiled model, a DDP
  wrapper), ``grad_sync`` the data-parallel wrapper whose ``finish_gradient_synchronization``
  runs after the backward (``systems.parallel.plan.apply`` returns both).
- ``OptimizerSpec`` / ``build_optimizer``: our AdamW, the fused Triton AdamW (optionally with bf16
  matmul weights and fp32 masters), torch's AdamW, sharded over the ranks (ZeRO-1), stepped
  inside the backward, or one per block (``GroupedOptimizer``) for a data-parallel wrapper to
  update each block as soon as its gradients are averaged.

Each phase is a profiler range (``systems.measure.trace.PHASE_RANGES``, inside ``STEP_RANGE``)
and, given ``marks``, a time mark of the same name, so every harness times and profiles the same
step the same way. ``phase_ms(marks)`` turns the marks into milliseconds per phase.

The optimizer inside the backward (``OptimizerInBackward``, ``block_groups``,
``priority_stream``):
The optimizer step inside the backward pass: each group of parameters is updated as soon as the
backward has produced all of its gradients, on a side CUDA stream, while the backward goes on.

Why: AdamW reads and writes every parameter, gradient and moment once per step, so it is
memory-bound, while the backward's matmuls are compute-bound. Run one after the other (as
``loss.backward(); opt.step()``) their times add up; run side by side part of the update can
hide under the backward. The last groups to get their gradients (the first block and the
embeddings) still finish after the backward: that tail is what ``step()`` waits for. How much
hides is measured, not promised (notebook 10, variant ``ours_overlap``). Where a step is bound by
the host's kernel launches, the hooks' Python work lands on the critical path of the backward
and can make the step slower.

How it works (applied from outside the model, which is not changed):

- The parameters are split into groups (``block_groups``: one per transformer block, plus one
  per module that owns parameters outside the blocks: embeddings, final norm, LM head), and
  each group gets its own optimizer (``make_optimizer(params)``, e.g. FusedAdamW: one launch
  updates a whole block).
- A ``register_post_accumulate_grad_hook`` on every parameter counts the arrivals; when the
  last parameter of a group has its gradient the group's ``optimizer.step()`` is launched.
  On CUDA it runs on a side stream that first waits for everything queued so far on the
  backward's stream (which produced the gradients); ``record_stream`` tells the caching
  allocator that the side stream reads those gradients, so setting ``grad`` to None right
  after the launch (``free_grads``) cannot hand their memory to a later backward kernel
  before the update has read it. On a CPU the update runs there and then (same semantics).
- The forward and backward should run on a stream of higher priority than the side stream
  (``priority_stream``). Stream priority is the only say one has over which kernel's CTAs the
  GPU dispatches first: at equal priority an update launched ahead of the next backward kernel
  holds every SM until its tens of thousands of CTAs have been dispatched, and the two streams
  take turns instead of overlapping (measured on an H100, 2.7B model: the backward grew by the
  whole update, no gain). With the backward's stream first, the update fills the SMs that the
  backward leaves idle. (Capping the update's grid to a few persistent programs instead was
  slower still: a few dozen CTAs cannot pull enough memory bandwidth.)
- ``step()`` launches what is left (groups some of whose parameters got no gradient: the
  ones that did are updated, as a plain optimizer would), then makes the current stream wait
  for the side stream, so the next forward reads updated weights. ``zero_grad()`` clears the
  gradients that are left (none with ``free_grads``).

When is it correct? The update of a parameter must not run while anything later in the backward
still needs its value. Autograd runs a parameter's AccumulateGrad node (and then the hook) only
once every backward node that feeds it a gradient has run, and the nodes that use a parameter's
value in the backward (a matmul's grad-input uses the weight) are those same nodes. A
parameter used several times (shared or tied weights) is one leaf with one AccumulateGrad node,
into which autograd sums every use's gradient before running it: the hook fires once, after the
last use (the tests check both). So for our models (one backward per step, no reentrant activation checkpointing) a
group's update never races its own backward. What breaks this is a hook firing twice before
``step()``: several backward passes per step (gradient accumulation), ``retain_graph``
backward twice, or reentrant checkpointing (which runs nested backward passes) - the first
firing would already have updated the weights. That is refused with a RuntimeError naming the
parameter; so is a parameter listed in two groups (ValueError).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.profiler import record_function

from systems.config import check_choice
from systems.measure.devices import DTYPES, sync
from systems.measure.timer import Marks
from systems.measure.trace import GRAD_SYNC_RANGE, PHASE_RANGES, STEP_RANGE

MODES = ("forward", "forward_backward", "train_step")
PRECISIONS = ("fp32", "bf16", "fp16")
LOSSES = ("logits", "fused", "hf_logits")
REDUCTIONS = ("mean", "sum")
OPTIMIZERS = ("ours", "fused", "torch", "torch_fused")
# the marks a step sets, in order (grad_sync only with a data-parallel wrapper; replay only, and
# alone after start, for a step replayed as one CUDA graph, whose phases have no marks)
MARKS = ("start", "forward", "backward", "grad_sync", "optimizer", "replay")


@dataclass(frozen=True)
class StepSpec:
    """What one step does."""

    mode: str = "train_step"  # forward (inference, no grad) | forward_backward | train_step
    precision: str = "fp32"  # fp32: no autocast; bf16 / fp16: autocast over the model's weights
    loss: str = "logits"  # logits: model(tokens) then cross-entropy | fused: linear_cross_entropy | hf_logits
    reduction: str = "mean"  # sum: the handout's leaderboard loss (fused loss only)
    sync_phases: bool = False  # synchronise the device at the end of each phase
    grads_to_none: bool = True  # False keeps .grad tensors between steps (views of DDP buckets)
    # SMs the backward's cuBLASLt matmuls leave free (``matmul_sm_carveout``), for the updates of an
    # optimizer inside the backward to run on; 0 leaves every SM to the matmuls
    sm_carveout: int = 0

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        if self.sm_carveout < 0:
            raise ValueError(f"sm_carveout counts SMs left free, got {self.sm_carveout}; use 0 for none")
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("loss", self.loss, LOSSES)
        check_choice("reduction", self.reduction, REDUCTIONS)
        if self.reduction == "sum" and self.loss != "fused":
            raise ValueError("reduction='sum' is implemented by the fused loss: set loss='fused'")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return None if self.precision == "fp32" else DTYPES[self.precision]


def compute_loss(spec: StepSpec, model: nn.Module, forward: Callable, tokens: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
    """The step's loss. The fused loss reads ``model.hidden_states`` and the LM head's weight, so it
    bypasses ``forward``: wrappers whose work lives in ``forward`` itself (torch's DDP, a compiled
    whole model) need the logits loss."""
    from systems.optim import cross_entropy

    if spec.loss == "fused":
        from systems.kernels.fused_linear_ce import linear_cross_entropy

        # the harnesses draw targets in range: skip the range check and its device sync
        return linear_cross_entropy(model.hidden_states(tokens), model.lm_head.weight, targets,
                                    reduction=spec.reduction, check_targets=False)
    if spec.loss == "hf_logits":
        return cross_entropy(forward(input_ids=tokens).logits, targets)
    return cross_entropy(forward(tokens), targets)


class TrainStep:
    """One step of ``spec.mode`` on ``model``; ``__call__(tokens, targets, marks=None)``.

    ``optimizer``: anything with ``step()`` and ``zero_grad(set_to_none=)`` (needed by the train
    step). ``forward``: what computes the logits (default: the model). ``grad_sync``: a
    data-parallel wrapper: ``finish_gradient_synchronization()`` runs after the backward, and its
    ``on_train_batch_start()``, where it has one, before the forward. ``context``: a factory of a context
    manager entered around the forward and again around the backward (e.g. an SDPA backend).
    """

    def __init__(self, model: nn.Module, *, spec: StepSpec = StepSpec(), optimizer=None,
                 forward: Callable | None = None, grad_sync=None,
                 context: Callable[[], ContextManager] | None = None):
        if spec.mode == "train_step" and optimizer is None:
            raise ValueError("a train_step needs an optimizer (or use mode='forward_backward')")
        self.model, self.spec, self.optimizer = model, spec, optimizer
        self.forward = forward if forward is not None else model
        self.grad_sync, self.context = grad_sync, context or contextlib.nullcontext
        self._batch_start = getattr(grad_sync, "on_train_batch_start", None)
        # the device is the batch's, known at the first call (a sharded model may own no parameter)
        self.device: torch.device | None = None
        self.scaler = None

    def _autocast(self) -> ContextManager:
        dtype = self.spec.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def _bind(self, device: torch.device) -> None:
        self.device = device
        if self.spec.precision == "fp16" and self.spec.mode != "forward":
            # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range
            self.scaler = torch.amp.GradScaler(device.type)

    @contextlib.contextmanager
    def _phase(self, name: str, marks: Marks | None) -> Iterator[None]:
        """A named profiler range, closed after a device sync when ``sync_phases`` (so a profile's
        CPU range holds its kernels and a host clock reads finished work), then a mark."""
        with record_function(PHASE_RANGES.get(name, GRAD_SYNC_RANGE)):
            yield
            if self.spec.sync_phases:
                sync(self.device)
        if marks is not None:
            marks.mark(name)

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=self.spec.grads_to_none)
        else:
            self.model.zero_grad(set_to_none=self.spec.grads_to_none)

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                 marks: Marks | None = None) -> torch.Tensor:
        """Returns the loss (detached), or the forward's output in forward mode."""
        spec = self.spec
        if self.device != tokens.device:
            self._bind(tokens.device)
        with record_function(STEP_RANGE):
            if marks is not None:
                marks.mark("start")
            if spec.mode == "forward":
                with self._phase("forward", marks), torch.no_grad(), self.context(), self._autocast():
                    return self.forward(tokens)
            with self._phase("forward", marks):
                self._zero_grad()
                if self._batch_start is not None:
                    self._batch_start()
                with self.context(), self._autocast():
                    loss = compute_loss(spec, self.model, self.forward, tokens, targets)
            with self._phase("backward", marks), self.context(), matmul_sm_carveout(spec.sm_carveout, self.device):
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            if self.grad_sync is not None:
                with self._phase("grad_sync", marks):
                    self.grad_sync.finish_gradient_synchronization()
            if spec.mode == "train_step":
                with self._phase("optimizer", marks):
                    if self.scaler:
                        self.scaler.step(self.optimizer)
                        self.scaler.update()
                    else:
                        self.optimizer.step()
        return loss.detach()


class GraphedStep:
    """``step`` (a ``TrainStep``) captured whole, forward to update, as one CUDA graph and replayed.

    Why: a step of many small kernels waits on the host that launches them; torch.compile's
    CUDA graphs (``compile_mode="reduce-overhead"``) replay one block at a time, with the
    embedding, the loss, the optimizer and the launches between blocks left to the host, and
    cannot hold the optimizer inside the backward's side-stream updates. One graph of the whole
    step leaves the host one launch a step. (Measured, not promised: notebook 10's
    ``ours_stepgraph_*`` variants.)

    Calls: the first ``eager_steps`` run ``step`` as it is (they compile and create the
    optimizer's state); the next captures a call into a graph, then replays it; every later one
    copies its batch into the graph's inputs and replays. Each call is one training step. The
    returned loss is a copy of the graph's.

    The captured step runs on the current stream (a priority stream's priority is kept in the
    graph's kernels), or on a new stream where the current one is the default stream, which
    cannot be captured. What a replay cannot redo is refused when built: a data-parallel wrapper
    (its Python-side bookkeeping), fp16 loss scaling (host decisions), synchronised phases, and
    optimizers whose step scalars live on the host: the optimizer (or each group optimizer of an
    ``OptimizerInBackward``) must be ``FusedAdamW(capturable=True)``, whose ``prepare_replay``
    writes each step's learning rate and bias corrections before the replay. The batch's shape
    and dtype are those of the captured call; ``marks`` get "start" and "replay" only.
    """

    def __init__(self, step: TrainStep, *, eager_steps: int = 2):
        if step.spec.mode != "train_step" or step.spec.sync_phases or step.spec.precision == "fp16":
            raise ValueError("GraphedStep captures a train_step without sync_phases or fp16 loss scaling; got "
                             f"mode={step.spec.mode!r}, sync_phases={step.spec.sync_phases}, "
                             f"precision={step.spec.precision!r}")
        if step.grad_sync is not None:
            raise ValueError("GraphedStep does not capture a data-parallel wrapper's step: use the step as it is")
        if eager_steps < 1:
            raise ValueError(f"eager_steps must be >= 1 (the first step compiles and creates the optimizer's state), "
                             f"got {eager_steps}")
        optimizers = list(getattr(step.optimizer, "optimizers", [step.optimizer]))
        if not all(getattr(o, "capturable", False) for o in optimizers):
            raise ValueError("GraphedStep needs optimizers whose step scalars live on the device: "
                             "FusedAdamW or MasterWeightAdamW with capturable=True (OptimizerSpec(capturable=True))")
        self.step, self.eager_steps, self._optimizers = step, eager_steps, optimizers
        self.graph: torch.cuda.CUDAGraph | None = None
        self._calls = 0
        self._inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._loss: torch.Tensor | None = None

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor, *, marks: Marks | None = None) -> torch.Tensor:
        if self.graph is None and self._calls < self.eager_steps:
            self._calls += 1
            return self.step(tokens, targets, marks=marks)
        if tokens.device.type != "cuda":
            raise ValueError(f"GraphedStep replays a CUDA graph: the batch must be on a CUDA device, got {tokens.device}")
        if self.graph is None:
            self._capture(tokens, targets)
        static_tokens, static_targets = self._inputs
        if (tokens.shape, tokens.dtype, targets.shape) != (static_tokens.shape, static_tokens.dtype,
                                                           static_targets.shape):
            raise ValueError(f"GraphedStep replays the step it captured, on a batch of shape "
                             f"{tuple(static_tokens.shape)}; got {tuple(tokens.shape)}: build another for this shape")
        with record_function(STEP_RANGE):
            if marks is not None:
                marks.mark("start")
            if tokens is not static_tokens:
                static_tokens.copy_(tokens)
            if targets is not static_targets:
                static_targets.copy_(targets)
            for optimizer in self._optimizers:
                optimizer.prepare_replay()
            self.graph.replay()
            if marks is not None:
                marks.mark("replay")
        return self._loss.clone()

    def _capture(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self._inputs = (tokens.clone(), targets.clone())
        stream = torch.cuda.current_stream(tokens.device)
        if stream == torch.cuda.default_stream(tokens.device):
            stream = torch.cuda.Stream(device=tokens.device)
        # no gradients when the capture starts: the captured backward then allocates them in the
        # graph's pool and writes them, where existing ones would be accumulated into
        self.step._zero_grad()
        for optimizer in self._optimizers:
            optimizer.prepare_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            self._loss = self.step(*self._inputs)
        for optimizer in self._optimizers:
            optimizer.finish_capture()
        self.graph = graph


def phase_ms(marks: Marks) -> dict[str, float]:
    """Milliseconds of each phase a step marked ("forward", "backward", "grad_sync",
    "optimizer") and of the whole "step"."""
    out, previous = {}, "start"
    for name in MARKS[1:]:
        if name in marks:
            out[name] = marks.ms(previous, name)
            previous = name
    out["step"] = marks.ms("start", previous)
    return out


# ----------------------------------------------------------------------------- optimizers


@dataclass(frozen=True)
class OptimizerSpec:
    """Which AdamW, and how it is applied."""

    kind: str = "ours"  # ours (systems.optim) | fused (Triton) | torch (foreach) | torch_fused
    lr: float = 1e-4
    master_weights: bool = False  # bf16 matmul weights in the model, fp32 masters in the optimizer
    # with master_weights: the optimizer keeps only each master's low 16 bits, the model's bf16
    # weight being its high half (MasterWeightAdamW(split_masters=True): 26 bytes per parameter
    # and step instead of 28, the same arithmetic)
    split_masters: bool = False
    sharded: bool = False  # ZeRO-1: each rank keeps the state of its share of the parameters
    in_backward: bool = False  # one optimizer per block, stepped inside the backward
    # one optimizer per block (GroupedOptimizer), stepped after the backward: a data-parallel
    # wrapper may update each block as soon as its gradients are averaged (update_per_bucket)
    grouped: bool = False
    # the step's scalars in device memory, so a CUDA graph can capture the update (GraphedStep)
    capturable: bool = False

    def __post_init__(self) -> None:
        check_choice("optimizer", self.kind, OPTIMIZERS)
        if self.master_weights and self.kind != "fused":
            raise ValueError("master_weights is MasterWeightAdamW, a fused optimizer: set kind='fused'")
        if self.split_masters and not self.master_weights:
            raise ValueError("split_masters splits MasterWeightAdamW's fp32 masters: set master_weights=True")
        if self.capturable and (self.kind != "fused" or self.sharded):
            raise ValueError("capturable is FusedAdamW's (kind='fused'), unsharded: the other optimizers keep their "
                             "step scalars on the host")
        if self.sharded and self.in_backward:
            raise ValueError("a sharded optimizer cannot also step inside the backward: choose one")
        if self.grouped and (self.sharded or self.in_backward):
            raise ValueError("grouped is one optimizer per block stepped after the backward: it excludes sharded "
                             "and in_backward (which is grouped already)")


def optimizer_class(kind: str) -> tuple[type, dict]:
    """The optimizer class of ``kind`` and the keyword arguments that select its implementation."""
    check_choice("optimizer", kind, OPTIMIZERS)
    if kind == "fused":
        from systems.kernels.fused_adamw import FusedAdamW

        return FusedAdamW, {}
    if kind == "ours":
        from systems.optim import AdamW

        return AdamW, {}
    return torch.optim.AdamW, ({"fused": True} if kind == "torch_fused" else {"foreach": True})


def matmul_weights_of(model: nn.Module) -> list[nn.Parameter]:
    """The weights autocast casts to bf16 for every use: those of our Linear layers (LM head
    included). The embedding table is indexed, not multiplied, and the norm gains scale fp32
    activations, so those stay fp32."""
    from systems.model import Linear

    return [m.weight for m in model.modules() if isinstance(m, Linear) and m.weight.requires_grad]


def build_optimizer(model: nn.Module, spec: OptimizerSpec, *, blocks: Iterable[nn.Module] | None = None):
    """The optimizer of ``spec`` over ``model``'s trainable parameters. ``blocks``: the groups of
    the optimizer inside the backward or of ``grouped`` (default ``model.layers``). Build it before compiling:
    master weights change the model's weight dtypes."""
    params = [p for p in model.parameters() if p.requires_grad]
    cls, options = optimizer_class(spec.kind)
    if spec.master_weights:
        from systems.kernels.fused_adamw import MasterWeightAdamW

        low = {id(p) for p in matmul_weights_of(model)}

        def make(ps: list[nn.Parameter]):
            return MasterWeightAdamW(ps, lr=spec.lr, low_precision=[p for p in ps if id(p) in low],
                                     split_masters=spec.split_masters, capturable=spec.capturable)
    else:
        if spec.capturable:
            options = {**options, "capturable": True}

        def make(ps: list[nn.Parameter]):
            return cls(ps, lr=spec.lr, **options)
    if spec.in_backward or spec.grouped:
        groups = block_groups(model, blocks=blocks if blocks is not None else model.layers)
        grouped = OptimizerInBackward if spec.in_backward else GroupedOptimizer
        return grouped(groups, make_optimizer=make)
    if spec.sharded:
        from systems.parallel.sharded_optimizer import ShardedOptimizer

        if spec.master_weights:
            raise ValueError("master weights are not sharded: use sharded=False with master_weights")
        return ShardedOptimizer(params, cls, lr=spec.lr, **options)
    return make(params)


# ----------------------------------------------------------------------------- the optimizer inside the backward




@dataclass
class _Group:
    """One group's parameters, its optimizer, which of its parameters have their gradient in this
    step (``OptimizerInBackward``), and whether it was updated in this step already."""

    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    device: torch.device
    # id()s of the parameters whose hook fired this step; all of them: the group is updated
    arrived: set[int] = field(default_factory=set)
    stepped: bool = False

    @property
    def complete(self) -> bool:
        return len(self.arrived) == len(self.params)


def block_groups(model: nn.Module, *, blocks: Iterable[nn.Module]) -> list[list[nn.Parameter]]:
    """One group per block (in the order given), then one per module that directly owns
    parameters outside the blocks. Only parameters that require grad; each once (a parameter
    shared by several blocks goes with the first: its gradient is complete only after the
    last use in the backward, which is the first block's, so that group waits for it anyway)."""
    seen: set[int] = set()
    groups: list[list[nn.Parameter]] = []
    for block in blocks:
        group = []
        for p in block.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                group.append(p)
        groups.append(group)
    # named_parameters yields a shared parameter once, under the first name that reaches it
    owners: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            owners.setdefault(name.rpartition(".")[0], []).append(p)
    return [g for g in groups + list(owners.values()) if g]


# A lower number is a higher priority; the side stream has the default, 0, the lowest there is,
# so one level above it is enough to put the backward's kernels first.
COMPUTE_PRIORITY = -1


@contextlib.contextmanager
def priority_stream(device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    """Run the enclosed work (forward, backward, ``step()``) on a new CUDA stream of higher
    priority than the updates' side stream; ordered after the current stream's work on entry and
    before it on exit. A no-op on a CPU (yields None)."""
    if device.type != "cuda":
        yield None
        return
    outer = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device=device, priority=COMPUTE_PRIORITY)
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        outer.wait_stream(stream)


@contextlib.contextmanager
def matmul_sm_carveout(sms: int, device: torch.device) -> Iterator[None]:
    """Inside, cuBLASLt plans every matmul for ``sms`` fewer SMs than the GPU has (its SM count
    target), so a memory-bound kernel on another stream (an update of ``OptimizerInBackward``)
    finds SMs free while the matmuls run, instead of waiting for the gaps between them. Stream
    priority alone cannot give it that: a matmul's CTAs fill every SM, and a kernel's CTAs,
    once placed, are not preempted. torch's knob for this is private and experimental
    (``torch._C._set_sm_carveout_experimental``, read by its cuBLASLt matmuls, so the cuBLASLt
    backend is selected too); both settings are restored on exit. A CUDA graph captured inside keeps
    the carveout its matmuls were planned with. A no-op for ``sms`` 0 and off CUDA."""
    if not sms or device.type != "cuda":
        yield
        return
    count = torch.cuda.get_device_properties(device).multi_processor_count
    if sms >= count:
        raise ValueError(f"sm_carveout={sms} leaves the matmuls no SM of the {count} this GPU has; use fewer")
    carveout, backend = torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carveout)
        torch.backends.cuda.preferred_blas_library(backend)


class GroupedOptimizer:
    """One optimizer per group of parameters, each group updated once per step: early, by
    ``step_group(params)``, or by ``step()``, which updates every group not updated yet.

    ``groups``: disjoint lists of parameters (``block_groups`` makes them for a transformer).
    ``make_optimizer``: builds one group's optimizer from its parameter list. The groups are the
    unit a data-parallel wrapper can update as soon as their gradients are averaged
    (``DDPBucketed(groups=..., on_synced=opt.step_group)``, through ``ParallelPlan(
    update_per_bucket=True)``): the update of the groups synchronised first then runs while the
    all-reduce of the rest goes on. Stepped only by ``step()`` it is the same arithmetic as one
    optimizer over all the parameters, in one launch per group.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Parameter]], *,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self._owner: dict[int, _Group] = {}  # id(parameter) -> its group
        self._groups: list[_Group] = []
        for index, params in enumerate(groups):
            params = list(params)
            if not params:
                raise ValueError(f"group {index} is empty; every group needs at least one parameter")
            devices = {p.device for p in params}
            if len(devices) != 1:
                raise ValueError(f"group {index} spans devices {sorted(map(str, devices))}; a group's update is one "
                                 "launch on one device")
            for p in params:
                if not p.requires_grad:
                    raise ValueError(f"group {index} has a parameter of shape {tuple(p.shape)} that does not "
                                     "require grad; it never gets a gradient to update with")
                if id(p) in self._owner:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two groups; each parameter "
                                     "must be in exactly one (its gradient is complete only once)")
            group = _Group(params=params, optimizer=make_optimizer(params), device=devices.pop())
            for p in params:
                self._owner[id(p)] = group
            self._groups.append(group)

    @property
    def groups(self) -> list[list[nn.Parameter]]:
        """The groups' parameter lists, in order (the model's parameters, not the masters)."""
        return [list(g.params) for g in self._groups]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The groups' optimizers, in the groups' order (their learning rates, states)."""
        return [g.optimizer for g in self._groups]

    @property
    def param_groups(self) -> list[dict]:
        """Every group optimizer's param groups: setting ``lr`` here reaches the optimizers."""
        return [pg for g in self._groups for pg in g.optimizer.param_groups]

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """What the group optimizer of ``param`` updates for it: its fp32 master where that
        optimizer keeps one (``MasterWeightAdamW``), else the parameter itself."""
        optimizer = self._owner[id(param)].optimizer
        return optimizer.master_of(param) if hasattr(optimizer, "master_of") else param

    def step_group(self, params: Sequence[torch.Tensor]) -> None:
        """Update, now, the group that ``params`` is (its parameters, in any order; those without a
        gradient are skipped as a plain optimizer skips them)."""
        group = self._owner.get(id(params[0])) if len(params) else None
        if group is None or {id(p) for p in params} != {id(p) for p in group.params}:
            raise ValueError("step_group takes one whole group of this optimizer's parameters (see .groups)")
        if group.stepped:
            raise RuntimeError(f"the group of a parameter of shape {tuple(params[0].shape)} was updated twice in "
                               "one step; each group is updated once between step() calls")
        self._launch(group)

    def fold_gradients(self, addends: dict[torch.Tensor, torch.Tensor] | None, scale: float = 1.0) -> None:
        """Each group optimizer's ``fold_gradients`` (``FusedAdamW``'s) with its parameters' addends;
        ``None`` ends the fold everywhere."""
        per_group: dict[int, dict] = {id(g): {} for g in self._groups}
        for param, addend in (addends or {}).items():
            group = self._owner.get(id(param))
            if group is None:
                raise ValueError(f"fold_gradients: a parameter of shape {tuple(param.shape)} is in no group")
            per_group[id(group)][param] = addend
        for group in self._groups:
            fold = getattr(group.optimizer, "fold_gradients", None)
            if fold is None:
                if addends:
                    raise ValueError(f"fold_gradients: the group optimizers ({type(group.optimizer).__name__}) "
                                     "cannot fold gradient addends; use FusedAdamW or MasterWeightAdamW")
                continue
            fold(per_group[id(group)] if addends is not None else None, scale)

    @torch.no_grad()
    def _launch(self, group: _Group) -> None:
        group.optimizer.step()
        group.stepped = True

    def step(self) -> None:
        """Update every group not updated since the last ``step()``."""
        for group in self._groups:
            if not group.stepped:
                self._launch(group)
        self._new_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self._groups:
            group.optimizer.zero_grad(set_to_none=set_to_none)
        self._new_step()

    def _new_step(self) -> None:
        for group in self._groups:
            group.arrived.clear()
            group.stepped = False

    def state_dict(self) -> dict:
        return {"optimizers": [g.optimizer.state_dict() for g in self._groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        states = state_dict["optimizers"]
        if len(states) != len(self._groups):
            raise ValueError(f"the state dict has {len(states)} group optimizers, this wrapper {len(self._groups)}")
        for group, state in zip(self._groups, states):
            group.optimizer.load_state_dict(state)


class OptimizerInBackward(GroupedOptimizer):
    """Runs ``make_optimizer(group)``'s step for every group as soon as its gradients exist.

    ``groups``, ``make_optimizer``: as ``GroupedOptimizer``'s.
    ``free_grads``: set each updated parameter's ``grad`` to None at once (saves the memory of
    the gradients of every group already updated while the backward goes on).

    Used as an optimizer in a training loop, inside ``priority_stream``: ``loss.backward()``
    (the updates happen here), ``opt.step()`` (the leftovers, then the wait), ``opt.zero_grad()``.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Parameter]], *,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], free_grads: bool = True):
        super().__init__(groups, make_optimizer=make_optimizer)
        self.free_grads = free_grads
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # the devices whose side stream got updates since the current stream last waited for it
        self._pending: set[torch.device] = set()
        # the hooks hold nothing but a weak reference to the wrapper: parameter -> hook -> wrapper
        # -> parameter would be a cycle that keeps a dropped model alive until a full gc pass
        this = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            wrapper = this()
            if wrapper is not None:
                wrapper._on_grad(p)

        self._handles = [p.register_post_accumulate_grad_hook(hook) for g in self._groups for p in g.params]

    def _on_grad(self, p: torch.Tensor) -> None:
        group = self._owner[id(p)]
        if id(p) in group.arrived:
            raise RuntimeError(
                f"the gradient of a parameter of shape {tuple(p.shape)} was accumulated twice before step(): "
                "OptimizerInBackward updates a group as soon as its gradients arrive, so it supports exactly one "
                "backward per step (no gradient accumulation, no reentrant activation checkpointing)")
        group.arrived.add(id(p))
        if group.complete:
            self._launch(group)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    @torch.no_grad()
    def _launch(self, group: _Group) -> None:
        grads = [p.grad for p in group.params if p.grad is not None]
        if group.device.type == "cuda":
            side = self._stream(group.device)
            # the gradients (and everything before them) were queued on the backward's current stream
            side.wait_stream(torch.cuda.current_stream(group.device))
            with torch.cuda.stream(side):
                group.optimizer.step()
            self._pending.add(group.device)
            for g in grads:
                g.record_stream(side)  # its memory is not reused until the side stream's update has read it
        else:
            group.optimizer.step()
        group.stepped = True
        if self.free_grads:
            for p in group.params:
                p.grad = None

    def step(self) -> None:
        """Update the groups that did not complete in the backward (only their parameters with a
        gradient), then make the current stream wait for every update."""
        for group in self._groups:
            if group.arrived and not group.stepped:  # complete groups were updated in the backward
                self._launch(group)
        self._wait()
        self._new_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # zeroing in place (set_to_none=False) writes gradients an update may still be reading
        self._wait()
        super().zero_grad(set_to_none=set_to_none)

    def _wait(self) -> None:
        # only streams with new work: inside a CUDA-graph capture, waiting for a side stream that
        # has not joined the capture would tie the graph to work outside it (an error)
        for device in self._pending:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])
        self._pending = set()

    def remove(self) -> None:
        """Remove the hooks: the parameters' gradients then just accumulate, as without the wrapper."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
