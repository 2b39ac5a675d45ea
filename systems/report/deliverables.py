"""Every deliverable of the two CS336 assignment-2 handouts, and the notebook that answers it.

The report's first section (the deliverables index) renders this table: one row per problem and
sub-question, linking to its answer, with a status computed from the run. This module is only the
table and its accessors; rendering and status live elsewhere.

- ``handout``: "2025" (v1.0.4) or "2026" (v26.1.1). The same problem name can ask different things
  in the two years (2026's ``memory_profiling`` adds (f), and 2026 renames the model sizes: its ``xl``
  is 2025's "2.7B"), so each handout lists its own parts.
- ``part``: the handout's sub-question letter, or "" for a problem with no (a), (b), ... markers. A
  problem whose only sub-question is (a) (``pytorch_attention``, ``flash_benchmarking``) keeps "a".
- ``kind``: "code" (an implementation or script the handout asks for, graded by its tests where it
  has them), "written" (prose, possibly with timings), "table", "figure", or "number" (a quantity or
  closed-form expression with its short justification).
- ``needs``: what a real answer needs beyond the CPU smoke run (``None``: the smoke run already gives
  it, e.g. the closed forms of notebook 09 or the code checked on the CPU).

Rows follow the handout order; the tests compare problem names, parts and the count of
"Deliverable:" lines with the handout texts where those are present.

Counts are not written down here (they would go stale): ``python -m systems.report.deliverables``
prints the number of deliverables per handout and per notebook, from ``summary()``.

Mapping notes. 2025's ``ddp_bucketed_benchmarking`` (b) asks for equations: notebook 09 answers it
under its own heading (closed form, no GPU); notebook 07 fits the same model to measured all-reduce
times. 2025's FlashAttention-2 leaderboard (its section 1.3.3) has no Problem box and no Deliverable
line, so it has no row, though notebook 06 times its configuration; 2026's ``leaderboard`` problem
(a full 8B training step) is notebook 10's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

HANDOUTS = ("2025", "2026")
KINDS = ("code", "written", "table", "figure", "number")

# Notebook stems, short so that each table row fits on one line.
NB01 = "01_benchmarking"
NB02 = "02_kernel_profiling"
NB03 = "03_mixed_precision"
NB04 = "04_memory"
NB05 = "05_attention_compile"
NB06 = "06_flash_attention"
NB07 = "07_distributed"
NB08 = "08_sharding_fsdp"
NB09 = "09_parallelism_math"
NB10 = "10_fast_train_step"

# What a real answer needs beyond the CPU smoke run.
GPU = "a GPU"
GPUS2 = "2 GPUs"
GPUS6 = "6 GPUs"  # the all-reduce sweep goes up to 6 processes, one GPU each
GPUS2_LARGE = "2 GPUs of >= 125 GiB"  # the 2026 leaderboard's 8B step (systems.bench.leaderboard.MIN_GPU_MEMORY_GIB)
NEEDS = (None, GPU, GPUS2, GPUS6, GPUS2_LARGE)


@dataclass(frozen=True)
class Deliverable:
    handout: str  # "2025" or "2026"
    problem: str  # the handout's problem name, e.g. "benchmarking_script"
    part: str  # "a", "b", ...; "" when the problem has no sub-questions
    title: str  # what is asked, in our words
    kind: str  # one of KINDS
    notebook: str  # the notebook stem that answers it
    needs: str | None  # what answering it needs beyond a CPU smoke run

    def __post_init__(self) -> None:
        # a typo in the table should fail at import, not render as a broken row
        if self.handout not in HANDOUTS:
            raise ValueError(f"{self.problem}: handout must be one of {HANDOUTS}, got {self.handout!r}")
        if self.kind not in KINDS:
            raise ValueError(f"{self.handout} {self.problem} ({self.part}): kind must be one of {KINDS}, "
                             f"got {self.kind!r}")
        if self.part and not (len(self.part) == 1 and "a" <= self.part <= "z"):
            raise ValueError(f"{self.handout} {self.problem}: part must be '' or one letter a-z, got {self.part!r}")

    @property
    def anchor(self) -> str:
        """HTML id, unique per (handout, problem, part): problem names hold no '-', so the join is unambiguous."""
        return "-".join(s for s in (self.handout, self.problem, self.part) if s)


# problem -> rows of (part, kind, notebook, needs, title), in handout order
_TABLE_2025: dict[str, list[tuple[str, str, str, str | None, str]]] = {
    "benchmarking_script": [
        ("a", "code", NB01, None, "Harness timing forward and backward passes of a model built from hyperparameters"),
        ("b", "written", NB01, GPU, "Forward and backward time per model size: mean and spread over 10 timed steps"),
        ("c", "written", NB01, GPU, "What no, one or two warm-up steps do to the timings, and why"),
    ],
    "nsys_profile": [
        ("a", "written", NB02, GPU, "Forward time as the profiler sees it, against the Python-timer figure"),
        ("b", "written", NB02, GPU, "Costliest forward kernel, its calls per pass, and whether it leads with backward"),
        ("c", "written", NB02, GPU, "Non-matmul kernels that still take a noticeable share of forward time"),
        ("d", "written", NB02, GPU, "Matmul share of GPU time in a full AdamW step versus inference alone"),
        ("e", "written", NB02, GPU, "Softmax against the attention matmuls: runtime gap versus FLOP gap"),
    ],
    "mixed_precision_accumulation": [
        ("", "written", NB03, None, "Accuracy of adding 0.01 a thousand times with fp32, fp16 and mixed accumulators"),
    ],
    "benchmarking_mixed_precision": [
        ("a", "written", NB03, GPU, "Dtypes of toy-model parameters, outputs, loss and gradients under fp16 autocast"),
        ("b", "written", NB03, None, "What in LayerNorm is precision-sensitive, and whether bf16 still needs care"),
        ("c", "written", NB03, GPU, "Timings with and without bf16 autocast per model size, and how the gap trends"),
    ],
    "memory_profiling": [
        ("a", "figure", NB04, GPU, "Active-memory timelines of the 2.7B model: forward only and a full training step"),
        ("b", "table", NB04, GPU, "Peak memory per context length for a forward pass and for a full training step"),
        ("c", "written", NB04, GPU, "Peak memory of the 2.7B model with mixed precision, and whether it matters"),
        ("d", "number", NB04, GPU, "MiB of one fp32 residual-stream activation of the 2.7B model, derived"),
        ("e", "written", NB04, GPU, "Size of the largest forward allocations and which code creates them"),
    ],
    "pytorch_attention": [
        ("a", "table", NB05, GPU, "Naive attention over head dim x length: timings, OOM point, memory, the fix"),
    ],
    "torch_compile": [
        ("a", "table", NB05, GPU, "Compiled against eager attention: forward and backward timings"),
        ("b", "table", NB05, GPU, "Compiled against eager Transformer: forward, and forward + backward + step"),
    ],
    "flash_forward": [
        ("a", "code", NB06, None, "Tiled FlashAttention-2 forward in plain PyTorch, saving the logsumexp"),
        ("b", "code", NB06, GPU, "Fused Triton FlashAttention-2 forward kernel behind an autograd Function"),
        ("c", "code", NB06, GPU, "Optional causal-mask flag for the Triton forward, off by default"),
    ],
    "flash_backward": [
        ("", "code", NB06, None, "Backward recomputed from the logsumexp in compiled PyTorch, giving dQ, dK, dV"),
    ],
    "flash_benchmarking": [
        ("a", "table", NB06, GPU, "Triton FlashAttention-2 vs PyTorch attention: fwd, bwd, end-to-end latencies"),
    ],
    "distributed_communication_single_node": [
        ("", "table", NB07, GPUS6, "All-reduce time by backend, tensor size (1 MB-1 GB) and 2/4/6 processes"),
    ],
    "naive_ddp": [
        # the weight-match check itself is tests/test_ddp.py::test_variant_matches_single_process
        ("", "code", NB07, None, "Naive DDP all-reducing each gradient, checked against one-process training"),
    ],
    "naive_ddp_benchmarking": [
        ("", "written", NB07, GPUS2, "Naive DDP, xl on 2 GPUs: step time and time spent communicating gradients"),
    ],
    "minimal_ddp_flat_benchmarking": [
        ("", "written", NB07, GPUS2, "One flattened all-reduce per step: step and comm time against per-parameter"),
    ],
    "ddp_overlap_individual_parameters": [
        ("", "code", NB07, None, "DDP wrapper launching an async all-reduce per gradient as backward produces it"),
    ],
    "ddp_overlap_individual_parameters_benchmarking": [
        ("a", "written", NB07, GPUS2, "Step time with per-parameter overlap against the naive and flattened variants"),
        # the handout asks for Nsight screenshots; notebook 07 shows torch.profiler traces instead
        ("b", "figure", NB07, GPUS2, "Profiler traces contrasting naive DDP with overlapped communication"),
    ],
    "ddp_overlap_bucketed": [
        ("", "code", NB07, None, "DDP wrapper packing gradients into capped buckets, all-reduced once each is ready"),
    ],
    "ddp_bucketed_benchmarking": [
        ("a", "written", NB07, GPUS2, "Step time for bucket caps of 1 to 1000 MB, against expectation and no buckets"),
        ("b", "number", NB09, None, "Post-backward overhead of bucketed DDP as an equation; the best bucket size"),
    ],
    "communication_accounting": [
        ("a", "number", NB09, None, "XXL: FP32 state and BF16 saved activations, in GB and in H100-80GB units"),
        ("b", "number", NB09, None, "XXL memory per device when sharded; the FSDP degree that fits a 95 GB v5p"),
        ("c", "number", NB09, None, "Batch (per device, overall) making the XXL forward compute-bound on 16x4 v5p"),
        ("d", "written", NB09, None, "Ways to shrink the batch while staying compute-bound, with references"),
    ],
    "optimizer_state_sharding": [
        ("", "code", NB08, None, "Optimizer wrapper keeping 1/N of the state per rank, broadcasting updated shards"),
    ],
    "optimizer_state_sharding_accounting": [
        ("a", "written", NB08, GPUS2, "Peak memory at init, before and after the step, with and without sharding"),
        ("b", "written", NB08, GPUS2, "What optimizer-state sharding costs in speed: step time sharded against unsharded"),
        ("c", "written", NB08, None, "How this scheme differs from ZeRO stage 1 in memory and communication"),
    ],
}

_TABLE_2026: dict[str, list[tuple[str, str, str, str | None, str]]] = {
    "benchmarking_script": [
        ("a", "code", NB01, None, "Harness timing forward, forward+backward and full AdamW steps of a built model"),
        ("b", "written", NB01, GPU, "Forward, backward and optimizer time per model size: mean and spread"),
        ("c", "written", NB01, GPU, "What no, one or two warm-up steps do to the timings, and why"),
    ],
    "nsys_profile": [
        ("a", "written", NB02, GPU, "Forward time as the profiler sees it, against the Python-timer figure"),
        ("b", "written", NB02, GPU, "Costliest forward kernel, its calls per pass, and whether it leads with backward"),
        ("c", "written", NB02, GPU, "Non-matmul kernels that still take a noticeable share of forward time"),
        ("d", "written", NB02, GPU, "Matmul share of GPU time in a full AdamW step versus inference alone"),
        ("e", "written", NB02, GPU, "Softmax against the attention matmuls: runtime gap versus FLOP gap"),
    ],
    "mixed_precision_accumulation": [
        ("", "written", NB03, None, "Accuracy of adding 0.01 a thousand times with fp32, fp16 and mixed accumulators"),
    ],
    "benchmarking_mixed_precision": [
        ("a", "written", NB03, GPU, "Dtypes of toy-model parameters, outputs, loss and gradients under fp16 autocast"),
        ("b", "written", NB03, None, "What in LayerNorm is precision-sensitive, and whether bf16 still needs care"),
        ("c", "written", NB03, GPU, "Timings with and without bf16 autocast per model size, and how the gap trends"),
    ],
    "memory_profiling": [
        ("a", "figure", NB04, GPU, "Active-memory timelines of the xl model: forward only and a full training step"),
        ("b", "table", NB04, GPU, "Peak memory per context length for a forward pass and for a full training step"),
        ("c", "written", NB04, GPU, "Peak memory of the xl model with mixed precision, and whether it matters"),
        ("d", "number", NB04, GPU, "MiB of one fp32 residual-stream activation of the xl model, derived"),
        ("e", "written", NB04, GPU, "Size of the largest forward allocations and which code creates them"),
        # the handout asks for Nsight screenshots; notebook 04 counts saved tensors with autograd hooks
        ("f", "written", NB04, GPU, "Memory one block saves for backward (top five ops) and its gradients' size"),
    ],
    "gradient_checkpointing": [
        ("a", "written", NB04, None, "Memory-optimal nested checkpointing plan: asymptotic memory and compute"),
        ("b", "written", NB04, GPU, "Best one-level checkpoint grouping for xl at 4 x 2048, checked by measured peaks"),
    ],
    "pytorch_attention": [
        ("a", "table", NB05, GPU, "Naive attention over head dim x length: timings, OOM point, memory, the fix"),
    ],
    "torch_compile": [
        ("a", "table", NB05, GPU, "Compiled against eager attention: forward and backward timings"),
        ("b", "table", NB05, GPU, "Compiled against eager Transformer: forward, and forward + backward + step"),
    ],
    "flash_forward": [
        ("a", "code", NB06, None, "Tiled FlashAttention-2 forward in plain PyTorch, saving the logsumexp"),
        ("b", "code", NB06, GPU, "Fused Triton FlashAttention-2 forward kernel behind an autograd Function"),
        ("c", "code", NB06, GPU, "Optional causal-mask flag for the Triton forward, off by default"),
    ],
    "flash_backward": [
        ("", "code", NB06, None, "Backward recomputed from the logsumexp in compiled PyTorch, giving dQ, dK, dV"),
    ],
    "flash_benchmarking": [
        ("a", "table", NB06, GPU, "Triton FlashAttention-2 vs PyTorch attention: fwd, bwd, end-to-end latencies"),
    ],
    "distributed_communication_single_node": [
        ("", "table", NB07, GPUS6, "All-reduce time by tensor size (1 MB-1 GB) and 2/4/6 GPUs, with commentary"),
    ],
    "naive_ddp": [
        # the weight-match check itself is tests/test_ddp.py::test_variant_matches_single_process
        ("", "code", NB07, None, "Naive DDP all-reducing each gradient, checked against one-process training"),
    ],
    "naive_ddp_benchmarking": [
        ("", "written", NB07, GPUS2, "Naive DDP, xl on 2 GPUs: step time and time spent communicating gradients"),
    ],
    "minimal_ddp_flat_benchmarking": [
        ("", "written", NB07, GPUS2, "One flattened all-reduce per step: step and comm time against per-parameter"),
    ],
    "ddp_overlap_individual_parameters": [
        ("", "code", NB07, None, "DDP wrapper launching an async all-reduce per gradient as backward produces it"),
    ],
    "ddp_overlap_individual_parameters_benchmarking": [
        ("a", "written", NB07, GPUS2, "Step time with per-parameter overlap against the naive and flattened variants"),
        # the handout asks for Nsight screenshots; notebook 07 shows torch.profiler traces instead
        ("b", "figure", NB07, GPUS2, "Profiler traces contrasting naive DDP with overlapped communication"),
    ],
    "optimizer_state_sharding": [
        ("", "code", NB08, None, "Optimizer wrapper keeping 1/N of the state per rank, broadcasting updated shards"),
    ],
    "optimizer_state_sharding_accounting": [
        ("a", "written", NB08, GPUS2, "Peak memory at init, before and after the step, with and without sharding"),
        ("b", "written", NB08, GPUS2, "What optimizer-state sharding costs in speed: step time sharded against unsharded"),
        ("c", "written", NB08, None, "How this scheme differs from ZeRO stage 1 in memory and communication"),
    ],
    "fsdp": [
        ("", "code", NB08, None, "FSDP wrapper: sharded weights, prefetched all-gathers, reduce-scattered grads"),
    ],
    "fsdp_accounting": [
        ("a", "written", NB08, GPUS2, "Expected peak-memory saving of FSDP over optimizer-state sharding"),
        # the handout asks for Nsight screenshots; notebook 08 reads the gathers from a torch.profiler trace
        ("b", "written", NB08, GPUS2, "Whether each weight all-gather ends before its layer's forward (xl, 2 GPUs)"),
    ],
    "alternate_ring_all_reduce": [
        ("", "number", NB09, None, "Time of an all-reduce that passes whole inputs around the ring, in S, N and W"),
    ],
    "data_parallel_calcs": [
        ("a", "number", NB09, None, "Backward FLOPs per device for one FFN layer under data parallelism"),
        ("b", "number", NB09, None, "Backward communication time under data parallelism"),
        ("c", "number", NB09, None, "Largest DP degree before communication outlasts computation"),
    ],
    "fsdp_calcs": [
        ("a", "number", NB09, None, "Forward and backward FLOPs per device under FSDP"),
        ("b", "number", NB09, None, "Forward and backward communication time under FSDP"),
        ("c", "number", NB09, None, "Largest FSDP degree before forward or backward turns communication-bound"),
    ],
    "tp_calcs": [
        ("a", "written", NB09, None, "Backward pass of the column/row tensor-parallel FFN, written as equations"),
        ("b", "number", NB09, None, "Forward and backward FLOPs per device under tensor parallelism"),
        ("c", "number", NB09, None, "Forward and backward communication time under tensor parallelism"),
        ("d", "number", NB09, None, "Largest TP degree before forward or backward turns communication-bound"),
    ],
    "fsdp_tp_calcs": [
        ("a", "number", NB09, None, "Forward FLOPs per device with FSDP x TP"),
        ("b", "number", NB09, None, "Forward communication time with FSDP x TP when the two axes overlap"),
        ("c", "number", NB09, None, "Most devices with a compute-bound forward, best FSDP/TP split, axes overlapped"),
        ("d", "number", NB09, None, "The same limit when FSDP and TP collectives share links and cannot overlap"),
    ],
    "leaderboard": [
        ("", "number", NB10, GPUS2_LARGE, "Fastest full 8B training step, batch 2 x 32k tokens, on two GPUs"),
    ],
}


def _build(handout: str, table: dict[str, list[tuple[str, str, str, str | None, str]]]) -> tuple[Deliverable, ...]:
    return tuple(Deliverable(handout=handout, problem=problem, part=part, title=title, kind=kind, notebook=notebook,
                             needs=needs)
                 for problem, rows in table.items() for part, kind, notebook, needs, title in rows)


DELIVERABLES: tuple[Deliverable, ...] = _build("2025", _TABLE_2025) + _build("2026", _TABLE_2026)

_BY_KEY = {(d.handout, d.problem, d.part): d for d in DELIVERABLES}


def _check_handout(handout: str) -> None:
    if handout not in HANDOUTS:
        raise ValueError(f"unknown handout {handout!r}; the table holds {', '.join(HANDOUTS)}")


def deliverables(handout: str) -> list[Deliverable]:
    """One handout's deliverables, in handout order."""
    _check_handout(handout)
    return [d for d in DELIVERABLES if d.handout == handout]


def problems(handout: str) -> list[str]:
    """One handout's problem names, in handout order, each once."""
    return list(dict.fromkeys(d.problem for d in deliverables(handout)))


def find(handout: str, problem: str, part: str = "") -> Deliverable:
    """The deliverable for (handout, problem, part); ValueError for an unknown handout, KeyError if absent."""
    _check_handout(handout)
    found = _BY_KEY.get((handout, problem, part))
    if found is not None:
        return found
    parts = [d.part for d in DELIVERABLES if d.handout == handout and d.problem == problem]
    if parts:
        listed = ", ".join(repr(p) for p in parts)
        raise KeyError(f"{handout} handout: problem {problem!r} has no part {part!r}; its parts are {listed}")
    elsewhere = [h for h in HANDOUTS
                 if h != handout and any(d.handout == h and d.problem == problem for d in DELIVERABLES)]
    hint = f" (the {elsewhere[0]} handout has it)" if elsewhere else ""
    raise KeyError(f"{handout} handout has no problem {problem!r}{hint}")


def summary() -> dict[str, dict[str, int]]:
    """Deliverables per notebook for each handout, notebooks in order."""
    return {h: dict(sorted(Counter(d.notebook for d in deliverables(h)).items())) for h in HANDOUTS}


def _main() -> None:
    for handout, per_notebook in summary().items():
        print(f"{handout}: {sum(per_notebook.values())} deliverables in {len(problems(handout))} problems")
        for notebook, n in per_notebook.items():
            print(f"  {notebook:<22} {n}")


if __name__ == "__main__":
    _main()
