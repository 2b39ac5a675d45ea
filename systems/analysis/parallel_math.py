"""Parallelism math in closed form: memory, FLOPs and collective times for DP, FSDP, TP and FSDP+TP.

Three groups of answers, all on paper (no devices needed):

1. ``communication_accounting`` (CS336 2025 handout): the XXL stack of feed-forward blocks, its
   memory with and without FSDP, and the per-device batch at which a TPU v5p mesh that mixes FSDP
   (X) and tensor parallelism (Y) is compute-bound in the forward pass (Scaling Book notation).
2. The 2026 handout's section 8: the alternate ring all-reduce, and the DP / FSDP / TP / FSDP+TP
   limits for one SwiGLU FFN layer ``y = (f(x W1) * (x W2)) W3``, where the answers are bounds on
   the number of devices before communication time exceeds computation time.
3. The bucketed-DDP overhead model (2025 handout, ddp_bucketed_benchmarking (b)).

Conventions. Sizes in bytes, times in seconds, rates in FLOP/s and bytes/s, ``GB = 1e9`` bytes.
A matmul (A, B) @ (B, C) costs ``2ABC`` FLOPs. Collectives follow the handout's ring model: with
``N`` devices and ``W`` bytes/s of egress per device, an all-gather or reduce-scatter whose full
tensor is ``S`` bytes takes ``(N-1)/N * S/W`` and an all-reduce ``2 (N-1)/N * S/W``.

Every closed form has a plain-float function (used for numbers and figures) and, where the
algebra is the point, a sympy derivation (``symbolic_*``) that solves the same inequality from the
FLOP and byte counts; the tests check the two against each other and against brute-force counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp

from systems.config import get_config
from systems.measure.flops import BACKWARD_FACTOR, FLOPS_PER_MAC
from systems.measure.hardware import GPU_PEAKS

GB = 1e9  # decimal gigabyte, as in "H100 80GB" and "v5p 95 GB"


# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accelerator:
    """One device as the handouts model it: compute rate, link bandwidth and memory."""

    name: str
    flops_per_s: float  # C: dense peak of the compute dtype
    link_bytes_per_s: float  # W: egress bandwidth per device (TPU: W_ici of one mesh axis)
    memory_bytes: float

    def __post_init__(self) -> None:
        for field_name in ("flops_per_s", "link_bytes_per_s", "memory_bytes"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"{field_name} must be positive, got {getattr(self, field_name)!r}")

    @property
    def alpha(self) -> float:
        """C / W: FLOPs the device does in the time one byte crosses a link (the comms roofline)."""
        return self.flops_per_s / self.link_bytes_per_s

    def with_link(self, link_bytes_per_s: float, *, name: str | None = None) -> "Accelerator":
        return Accelerator(name=name or self.name, flops_per_s=self.flops_per_s,
                           link_bytes_per_s=link_bytes_per_s, memory_bytes=self.memory_bytes)


# TPU v5p as the Scaling Book and the 2025 handout give it: 9e10 B/s one way per ICI link,
# counted in both directions (a bidirectional ring halves each transfer's distance).
TPU_V5P_ICI_ONE_WAY_BYTES_PER_S = 9e10
TPU_V5P_BF16_FLOPS_PER_S = 4.6e14
TPU_V5P_HBM_BYTES = 95 * GB  # the handout's per-device figure
TPU_V5P = Accelerator(name="TPU v5p", flops_per_s=TPU_V5P_BF16_FLOPS_PER_S,
                      link_bytes_per_s=2 * TPU_V5P_ICI_ONE_WAY_BYTES_PER_S,
                      memory_bytes=TPU_V5P_HBM_BYTES)

# H100 SXM (systems.measure.hardware): NVLink 4 is 900 GB/s summed over both directions, so
# 450 GB/s of egress per GPU.
H100_NVLINK_EGRESS_BYTES_PER_S = GPU_PEAKS["H100"].nvlink_gb_s / 2 * GB
H100_HBM_BYTES = GPU_PEAKS["H100"].hbm_gb * GB
H100 = Accelerator(name="H100 SXM 80GB", flops_per_s=GPU_PEAKS["H100"].bf16_tflops * 1e12,
                   link_bytes_per_s=H100_NVLINK_EGRESS_BYTES_PER_S, memory_bytes=H100_HBM_BYTES)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _devices(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value >= 1):
            raise ValueError(f"{name} must be a device count >= 1, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Ring collectives (2026 handout §8.1)
# ---------------------------------------------------------------------------------------------


def ring_all_gather_time(*, size_bytes: float, n: float, link_bytes_per_s: float) -> float:
    """N-1 steps, each device sends one S/N chunk per step: (N-1)/N * S/W."""
    _positive(size_bytes=size_bytes, link_bytes_per_s=link_bytes_per_s)
    _devices(n=n)
    return (n - 1) / n * size_bytes / link_bytes_per_s


def ring_reduce_scatter_time(*, size_bytes: float, n: float, link_bytes_per_s: float) -> float:
    """Same traffic as the all-gather, with an add before each send: (N-1)/N * S/W."""
    return ring_all_gather_time(size_bytes=size_bytes, n=n, link_bytes_per_s=link_bytes_per_s)


def ring_all_reduce_time(*, size_bytes: float, n: float, link_bytes_per_s: float) -> float:
    """Reduce-scatter then all-gather: 2 (N-1)/N * S/W."""
    return 2 * ring_all_gather_time(size_bytes=size_bytes, n=n, link_bytes_per_s=link_bytes_per_s)


def alternate_ring_all_reduce_time(*, size_bytes: float, n: float, link_bytes_per_s: float) -> float:
    """The handout's alternate all-reduce: at step t device i forwards the *whole* input
    x^((i-t+1) mod N) (S bytes) to its right neighbour and adds the x^((i-t) mod N) it receives.

    Every device sends S bytes in each of N-1 steps, and a step cannot finish sooner than S/W,
    so the time is (N-1) * S / W: N/2 times the reduce-scatter + all-gather ring, because the
    payload is never split into N chunks.
    """
    _positive(size_bytes=size_bytes, link_bytes_per_s=link_bytes_per_s)
    _devices(n=n)
    return (n - 1) * size_bytes / link_bytes_per_s


# ---------------------------------------------------------------------------------------------
# 2025 handout: communication_accounting (XXL)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StackedFFN:
    """The handout's simplified model: n_blocks blocks of Linear(d_model, d_ff) -> Linear(d_ff, d_model)
    (no activation function, no attention, no embeddings or head, no biases)."""

    d_model: int
    d_ff: int
    n_blocks: int
    name: str = "custom"

    def __post_init__(self) -> None:
        for field_name in ("d_model", "d_ff", "n_blocks"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")

    @property
    def n_params(self) -> int:
        return self.n_blocks * 2 * self.d_model * self.d_ff


XXL = StackedFFN(d_model=16384, d_ff=53248, n_blocks=126, name="XXL")


@dataclass(frozen=True)
class MixedPrecision:
    """Bytes per value: FP32 master weights, accumulated gradients and AdamW moments (m and v);
    BF16 activations saved for backward and BF16 gradient/weight communication."""

    master_weight_bytes: int = 4
    grad_bytes: int = 4
    optimizer_bytes: int = 2 * 4  # AdamW keeps two FP32 moments per parameter
    activation_bytes: int = 2
    comm_bytes: int = 2

    @property
    def state_bytes_per_param(self) -> int:
        return self.master_weight_bytes + self.grad_bytes + self.optimizer_bytes


HANDOUT_PRECISION = MixedPrecision()


def model_state_bytes(model: StackedFFN, precision: MixedPrecision = HANDOUT_PRECISION) -> dict[str, float]:
    """(a) master weights, gradients and optimizer state on one device, in bytes."""
    p = model.n_params
    parts = {"master_weights": p * precision.master_weight_bytes, "gradients": p * precision.grad_bytes,
             "optimizer_state": p * precision.optimizer_bytes}
    parts["total"] = sum(parts.values())
    return parts


def activation_bytes_per_token(model: StackedFFN, precision: MixedPrecision = HANDOUT_PRECISION) -> float:
    """(a) activations saved for backward, per token.

    A bias-free Linear needs only its input to form the weight gradient (dW = x^T dy); the
    input-gradient uses the weight, which is already stored. Block k saves its d_model input
    for the first linear and the d_ff output of the first linear for the second; the second's
    output is the next block's input (saved there once) and the last output is not needed.
    """
    return model.n_blocks * (model.d_model + model.d_ff) * precision.activation_bytes


def activation_bytes(model: StackedFFN, *, tokens: float,
                     precision: MixedPrecision = HANDOUT_PRECISION) -> float:
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens!r}")
    return tokens * activation_bytes_per_token(model, precision)


def devices_worth(n_bytes: float, accelerator: Accelerator) -> float:
    """How many devices' memory n_bytes fills."""
    return n_bytes / accelerator.memory_bytes


def fsdp_bytes_per_device(model: StackedFFN, *, n_fsdp: float, tokens_per_device: float,
                          precision: MixedPrecision = HANDOUT_PRECISION) -> float:
    """(b) M(N) = (16 P + A/2) / N + A/2, where A = activations of the device's tokens.

    Weights, gradients and optimizer state (16 bytes/param) and every second layer's saved
    activations are split N ways; the other half of the activations stays whole on each device.
    """
    _devices(n_fsdp=n_fsdp)
    state = model_state_bytes(model, precision)["total"]
    acts = activation_bytes(model, tokens=tokens_per_device, precision=precision)
    return (state + acts / 2) / n_fsdp + acts / 2


def min_fsdp_degree(model: StackedFFN, *, accelerator: Accelerator, tokens_per_device: float = 0.0,
                    precision: MixedPrecision = HANDOUT_PRECISION) -> int:
    """(b) the smallest integer N with M(N) < device memory: N > (16P + A/2) / (M_dev - A/2)."""
    acts = activation_bytes(model, tokens=tokens_per_device, precision=precision)
    room = accelerator.memory_bytes - acts / 2
    if room <= 0:
        raise ValueError(f"the unsharded half of the activations ({acts / 2 / GB:.1f} GB) alone does not fit "
                         f"in {accelerator.name}'s {accelerator.memory_bytes / GB:.0f} GB; use fewer tokens")
    need = (model_state_bytes(model, precision)["total"] + acts / 2) / room
    n = math.floor(need) + 1  # strictly less than the memory
    return max(n, 1)


@dataclass(frozen=True)
class TPUMesh:
    """Scaling Book notation: X-way FSDP over M_X mesh axes, Y-way TP over M_Y mesh axes.

    A collective over an axis group that spans M physical axes sees M * W_ici of bandwidth.
    """

    x: int  # FSDP degree
    y: int  # TP degree
    m_x: int = 2
    m_y: int = 1

    def __post_init__(self) -> None:
        for field_name in ("x", "y", "m_x", "m_y"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be an integer >= 1, got {value!r}")

    @property
    def n_devices(self) -> int:
        return self.x * self.y


HANDOUT_MESH = TPUMesh(x=16, y=4, m_x=2, m_y=1)


def mesh_forward_block_times(model: StackedFFN, *, mesh: TPUMesh, accelerator: Accelerator,
                             tokens_per_device: float, precision: MixedPrecision = HANDOUT_PRECISION,
                             ring_factor: bool = False) -> dict[str, float]:
    """(c) forward time of one block on each device, split into math, FSDP comms and TP comms.

    Sharding (Scaling Book "FSDP + TP"): activations In[B_X, D_Y], weights W_in[D_X, F_Y],
    W_out[F_Y, D_X]. Per block and device, with b = B/(XY) tokens per device:

    * math: two matmuls of (B/X, D) x (D, F/Y): T_math = 2 * 2 b D F / C;
    * FSDP axis: all-gather W_in and W_out to [D, F_Y]: 2 * p D F / Y bytes at M_X W:
      T_fsdp = 2 p D F / (Y M_X W);
    * TP axis: all-gather In to [B_X, D] and reduce-scatter Out from [B_X, D]: 2 * p (B/X) D bytes
      at M_Y W: T_tp = 2 p b Y D / (M_Y W).

    p is the communication dtype's bytes. The Scaling Book drops the ring's (n-1)/n; set
    ``ring_factor=True`` to keep it.
    """
    _positive(tokens_per_device=tokens_per_device)
    d, f, p = model.d_model, model.d_ff, precision.comm_bytes
    w = accelerator.link_bytes_per_s
    fx = (mesh.x - 1) / mesh.x if ring_factor else 1.0
    fy = (mesh.y - 1) / mesh.y if ring_factor else 1.0
    b = tokens_per_device
    t_math = 2 * FLOPS_PER_MAC * b * d * f / accelerator.flops_per_s
    t_fsdp = fx * 2 * p * d * f / (mesh.y * mesh.m_x * w)
    t_tp = fy * 2 * p * b * mesh.y * d / (mesh.m_y * w)
    return {"math": t_math, "fsdp": t_fsdp, "tp": t_tp}


def mesh_tp_limit(model: StackedFFN, *, mesh: TPUMesh, accelerator: Accelerator,
                  precision: MixedPrecision = HANDOUT_PRECISION) -> float:
    """(c) TP comms hide under math iff Y < 2 F M_Y W / (p C) = M_Y F / alpha for p = 2 bytes;
    both sides scale with the batch, so no batch size rescues a too-large Y."""
    return FLOPS_PER_MAC * model.d_ff * mesh.m_y / (precision.comm_bytes * accelerator.alpha)


def mesh_compute_bound_tokens_per_device(model: StackedFFN, *, mesh: TPUMesh, accelerator: Accelerator,
                                         precision: MixedPrecision = HANDOUT_PRECISION,
                                         ring_factor: bool = False) -> float:
    """(c) the per-device batch b* (tokens) above which the forward pass is compute-bound.

    With the FSDP and TP axes on different links, the two collectives overlap each other and
    the math, so the block is compute-bound when T_math >= max(T_fsdp, T_tp):

    * T_math >= T_fsdp  <=>  b >= p alpha / (2 M_X Y)   (= alpha / (M_X Y) in bf16),
    * T_math >= T_tp    <=>  Y <= M_Y F / alpha (independent of b; checked, else ValueError).
    """
    y_limit = mesh_tp_limit(model, mesh=mesh, accelerator=accelerator, precision=precision)
    if mesh.y > y_limit:
        raise ValueError(f"TP degree Y={mesh.y} exceeds M_Y F / alpha = {y_limit:.1f}: the TP all-gather and "
                         "reduce-scatter outlast the math at every batch size")
    fx = (mesh.x - 1) / mesh.x if ring_factor else 1.0
    return fx * precision.comm_bytes * accelerator.alpha / (FLOPS_PER_MAC * mesh.m_x * mesh.y)


def optimal_mesh_tokens_per_device(model: StackedFFN, *, accelerator: Accelerator, m_x: int = 2, m_y: int = 1,
                                   precision: MixedPrecision = HANDOUT_PRECISION) -> dict[str, float]:
    """(c, d) the smallest per-device batch any FSDP x TP split reaches (Scaling Book's
    b > alpha^2 / (M_X M_Y F) in bf16): saturate both conditions, Y = M_Y F / alpha and then
    b = alpha / (M_X Y). Returns the threshold and the Y that attains it."""
    y_star = FLOPS_PER_MAC * model.d_ff * m_y / (precision.comm_bytes * accelerator.alpha)
    b_star = precision.comm_bytes * accelerator.alpha / (FLOPS_PER_MAC * m_x * y_star)
    return {"tokens_per_device": b_star, "y": y_star}


# ---------------------------------------------------------------------------------------------
# 2026 handout §8: one SwiGLU FFN layer under DP, FSDP, TP and FSDP + TP
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FFNLayer:
    """x (B, D) -> y = (f(x W1) * (x W2)) W3 with W1, W2 (D, D_FF) and W3 (D_FF, D); B counts tokens."""

    batch_tokens: float
    d_model: float
    d_ff: float
    bytes_per_value: float = 2  # the handout's FP16 weights, activations and gradients

    def __post_init__(self) -> None:
        _positive(batch_tokens=self.batch_tokens, d_model=self.d_model, d_ff=self.d_ff,
                  bytes_per_value=self.bytes_per_value)

    @property
    def weight_bytes(self) -> float:
        """All three weight matrices (or their gradients): 3 D D_FF values."""
        return 3 * self.d_model * self.d_ff * self.bytes_per_value

    @property
    def activation_bytes(self) -> float:
        """One (B, D) activation, e.g. y or dx."""
        return self.batch_tokens * self.d_model * self.bytes_per_value


LEADERBOARD_BATCH_SIZE = 2  # sequences per step in the 2026 leaderboard problem


def leaderboard_ffn() -> FFNLayer:
    """The 2026 leaderboard model's FFN (the '8B' preset) at its batch: 2 sequences of 32,768 tokens."""
    cfg = get_config("8B")
    return FFNLayer(batch_tokens=LEADERBOARD_BATCH_SIZE * cfg.context_length, d_model=cfg.d_model, d_ff=cfg.d_ff)


def forward_flops(layer: FFNLayer) -> float:
    """Three matmuls (B, D) x (D, D_FF) -> x1, x2 and (B, D_FF) x (D_FF, D) -> y: 6 B D D_FF."""
    return 3 * FLOPS_PER_MAC * layer.batch_tokens * layer.d_model * layer.d_ff


def backward_flops(layer: FFNLayer) -> float:
    """Six matmuls: dz = dy W3^T, dx = dx1 W1^T + dx2 W2^T (two), dW3, dW2, dW1: 12 B D D_FF."""
    return BACKWARD_FACTOR * forward_flops(layer)


def per_device_flops(layer: FFNLayer, *, backward: bool = False, **degrees: float) -> float:
    """The forward's (or backward's) matmul FLOPs on one device, the layer's work split over the
    product of the parallel degrees: DP and FSDP split the batch, TP the hidden width, 2D both,
    and each device does an equal share. The handouts' per-device counts are its cases:
    DP (a) 12 B D D_FF / N_DP (``backward=True, n_dp=N``); FSDP (a) 6 B D D_FF / N_FSDP and
    12 B D D_FF / N_FSDP (``n_fsdp=N``); TP (b) 6 B D D_FF / N_TP and 12 B D D_FF / N_TP
    (``n_tp=N``); FSDP + TP 6 B D D_FF / (N_FSDP N_TP) (``n_fsdp=..., n_tp=...``)."""
    _devices(**degrees)
    return (backward_flops(layer) if backward else forward_flops(layer)) / math.prod(degrees.values())


# -- data parallel ----------------------------------------------------------------------------



def dp_backward_comm_time(layer: FFNLayer, *, n_dp: float, link_bytes_per_s: float) -> float:
    """(b) one ring all-reduce of dW1, dW2, dW3 (3 D D_FF values):
    2 (N-1)/N * 6 D D_FF / W = 12 D D_FF (N-1) / (N W) in FP16; independent of B."""
    return ring_all_reduce_time(size_bytes=layer.weight_bytes, n=n_dp, link_bytes_per_s=link_bytes_per_s)


def dp_max_devices(layer: FFNLayer, *, accelerator: Accelerator) -> float:
    """(c) N_DP <= 1 + 2 B W / (p C) = 1 + B W / C for p = 2 bytes."""
    return 1 + FLOPS_PER_MAC * layer.batch_tokens / (layer.bytes_per_value * accelerator.alpha)


# -- FSDP -------------------------------------------------------------------------------------





def fsdp_forward_comm_time(layer: FFNLayer, *, n_fsdp: float, link_bytes_per_s: float) -> float:
    """(b) all-gather W1, W2, W3: (N-1)/N * 6 D D_FF / W."""
    return ring_all_gather_time(size_bytes=layer.weight_bytes, n=n_fsdp, link_bytes_per_s=link_bytes_per_s)


def fsdp_backward_comm_time(layer: FFNLayer, *, n_fsdp: float, link_bytes_per_s: float) -> float:
    """(b) all-gather the weights again and reduce-scatter their gradients: 2 (N-1)/N * 6 D D_FF / W."""
    gather = ring_all_gather_time(size_bytes=layer.weight_bytes, n=n_fsdp, link_bytes_per_s=link_bytes_per_s)
    scatter = ring_reduce_scatter_time(size_bytes=layer.weight_bytes, n=n_fsdp, link_bytes_per_s=link_bytes_per_s)
    return gather + scatter


def fsdp_max_devices(layer: FFNLayer, *, accelerator: Accelerator) -> dict[str, float]:
    """(c) forward and backward both give N_FSDP <= 1 + B W / C (bytes and FLOPs both double in
    the backward, so the bound is the same and equals DP's)."""
    bound = 1 + FLOPS_PER_MAC * layer.batch_tokens / (layer.bytes_per_value * accelerator.alpha)
    return {"forward": bound, "backward": bound}


# -- tensor parallel --------------------------------------------------------------------------




def tp_forward_comm_time(layer: FFNLayer, *, n_tp: float, link_bytes_per_s: float) -> float:
    """(c) all-reduce the partial sums y^(i), one (B, D) tensor: 2 (N-1)/N * 2 B D / W."""
    return ring_all_reduce_time(size_bytes=layer.activation_bytes, n=n_tp, link_bytes_per_s=link_bytes_per_s)


def tp_backward_comm_time(layer: FFNLayer, *, n_tp: float, link_bytes_per_s: float) -> float:
    """(c) all-reduce the partial input gradients dx^(i), one (B, D) tensor: 2 (N-1)/N * 2 B D / W.
    dy needs no collective: y was all-reduced, so every device already holds all of dy."""
    return ring_all_reduce_time(size_bytes=layer.activation_bytes, n=n_tp, link_bytes_per_s=link_bytes_per_s)


def tp_max_devices(layer: FFNLayer, *, accelerator: Accelerator) -> dict[str, float]:
    """(d) forward: N_TP <= 1 + 3 D_FF W / (p C) (= 1 + 3 D_FF W / (2C)); backward: twice the
    math for the same bytes, N_TP <= 1 + 6 D_FF W / (p C) (= 1 + 3 D_FF W / C). No B: TP's limit
    is set by the model width, DP's by the batch."""
    unit = FLOPS_PER_MAC * layer.d_ff / (layer.bytes_per_value * accelerator.alpha)
    return {"forward": 1 + 1.5 * unit, "backward": 1 + 3 * unit}


# -- FSDP + TP --------------------------------------------------------------------------------



def fsdp_tp_forward_comm_times(layer: FFNLayer, *, n_fsdp: float, n_tp: float,
                               link_bytes_per_s: float) -> dict[str, float]:
    """(b) FSDP axis: all-gather each TP shard of W1, W2, W3 (6 D D_FF / N_TP bytes) over N_FSDP
    devices, (N_FSDP-1)/N_FSDP * 6 D D_FF / (N_TP W). TP axis: all-reduce y^(i) for this FSDP
    shard's rows, (B / N_FSDP, D): 2 (N_TP-1)/N_TP * 2 B D / (N_FSDP W).
    Overlapped collectives cost the max of the two; collectives that share the links, the sum."""
    _devices(n_fsdp=n_fsdp, n_tp=n_tp)
    fsdp = ring_all_gather_time(size_bytes=layer.weight_bytes / n_tp, n=n_fsdp, link_bytes_per_s=link_bytes_per_s)
    tp = ring_all_reduce_time(size_bytes=layer.activation_bytes / n_fsdp, n=n_tp, link_bytes_per_s=link_bytes_per_s)
    return {"fsdp": fsdp, "tp": tp, "overlapped": max(fsdp, tp), "serial": fsdp + tp}


def _fsdp_tp_budgets(layer: FFNLayer, accelerator: Accelerator) -> tuple[float, float]:
    """a = 2BW/(pC) (= BW/C) and b = 3 D_FF W/(pC) (= 3 D_FF W/(2C)): the forward is compute-bound
    on the FSDP axis iff N_FSDP - 1 <= a, on the TP axis iff N_TP - 1 <= b."""
    a = FLOPS_PER_MAC * layer.batch_tokens / (layer.bytes_per_value * accelerator.alpha)
    b = 1.5 * FLOPS_PER_MAC * layer.d_ff / (layer.bytes_per_value * accelerator.alpha)
    return a, b


def fsdp_tp_max_devices_overlapped(layer: FFNLayer, *, accelerator: Accelerator) -> dict[str, float]:
    """(c) Divide each axis's comm time by the compute time 6 B D D_FF / (N_FSDP N_TP C):
    FSDP: (N_FSDP-1) / a and TP: (N_TP-1) / b with a = BW/C, b = 3 D_FF W / (2C); the N_FSDP N_TP
    factors cancel, so the two constraints decouple. With overlapped axes each must be <= 1, and
    N = N_FSDP N_TP is largest at N_FSDP = 1 + a, N_TP = 1 + b:

        N <= (1 + B W / C) (1 + 3 D_FF W / (2C))  ~  3 B D_FF W^2 / (2 C^2).
    """
    a, b = _fsdp_tp_budgets(layer, accelerator)
    return {"n": (1 + a) * (1 + b), "n_fsdp": 1 + a, "n_tp": 1 + b}


def fsdp_tp_max_devices_serial(layer: FFNLayer, *, accelerator: Accelerator) -> dict[str, float]:
    """(d) Collectives that share the links add: (N_FSDP-1)/a + (N_TP-1)/b <= 1. Maximise
    (1+u)(1+v) on u/a + v/b = 1 (u = N_FSDP-1, v = N_TP-1): the stationary point is
    N_FSDP = (a + b + ab) / (2b), N_TP = (a + b + ab) / (2a), so

        N <= (a + b + ab)^2 / (4 a b)  ~  a b / 4 = 3 B D_FF W^2 / (8 C^2),

    a quarter of the overlapped limit: each axis gets half its budget. When the stationary point
    needs N_FSDP < 1 or N_TP < 1 the optimum is the pure strategy (N = 1 + b or 1 + a).
    """
    a, b = _fsdp_tp_budgets(layer, accelerator)
    n_fsdp, n_tp = (a + b + a * b) / (2 * b), (a + b + a * b) / (2 * a)
    if n_fsdp < 1:
        n_fsdp, n_tp = 1.0, 1 + b
    elif n_tp < 1:
        n_fsdp, n_tp = 1 + a, 1.0
    return {"n": n_fsdp * n_tp, "n_fsdp": n_fsdp, "n_tp": n_tp}


def fsdp_tp_ratio_grid(layer: FFNLayer, *, accelerator: Accelerator, n_points: int, span: float = 1.5) -> dict:
    """Forward comm / compute over a grid of (N_FSDP, N_TP), up to ``span`` times the overlapped
    optimum on each axis: arrays ``n_fsdp`` (columns), ``n_tp`` (rows), ``overlapped`` and
    ``serial`` (ratios > 1: communication-bound)."""
    import numpy as np

    ov = fsdp_tp_max_devices_overlapped(layer, accelerator=accelerator)
    nf = np.linspace(1, span * ov["n_fsdp"], n_points)
    nt = np.linspace(1, span * ov["n_tp"], n_points)
    overlapped, serial = np.empty((len(nt), len(nf))), np.empty((len(nt), len(nf)))
    for i, t in enumerate(nt):
        for j, f in enumerate(nf):
            compute = per_device_flops(layer, n_fsdp=f, n_tp=t) / accelerator.flops_per_s
            times = fsdp_tp_forward_comm_times(layer, n_fsdp=f, n_tp=t, link_bytes_per_s=accelerator.link_bytes_per_s)
            overlapped[i, j], serial[i, j] = times["overlapped"] / compute, times["serial"] / compute
    return {"n_fsdp": nf, "n_tp": nt, "overlapped": overlapped, "serial": serial}


def tp_backward_check(*, batch: int = 8, d_model: int = 16, d_ff: int = 24, n_tp: int = 4, seed: int = 0) -> dict:
    """tp_calcs (a), executed: ``tp_ffn_forward_backward`` on ``n_tp`` column/row shards against
    autograd on the unsharded layer, in float64; the largest difference of y, dx and each dW."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_model, generator=g, dtype=torch.float64)
    w1, w2 = (torch.randn(d_model, d_ff, generator=g, dtype=torch.float64) / d_model**0.5 for _ in range(2))
    w3 = torch.randn(d_ff, d_model, generator=g, dtype=torch.float64) / d_ff**0.5
    dy = torch.randn(batch, d_model, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    y = (torch.nn.functional.silu(leaves[0] @ leaves[1]) * (leaves[0] @ leaves[2])) @ leaves[3]
    y.backward(dy)
    tp = tp_ffn_forward_backward(x, dy, list(w1.chunk(n_tp, 1)), list(w2.chunk(n_tp, 1)), list(w3.chunk(n_tp, 0)))
    return {"n_tp": n_tp, "y": (tp["y"] - y).abs().max().item(), "dx": (tp["dx"] - leaves[0].grad).abs().max().item(),
            "dW1": (torch.cat(tp["dW1"], 1) - leaves[1].grad).abs().max().item(),
            "dW2": (torch.cat(tp["dW2"], 1) - leaves[2].grad).abs().max().item(),
            "dW3": (torch.cat(tp["dW3"], 0) - leaves[3].grad).abs().max().item()}


# ---------------------------------------------------------------------------------------------
# Sympy derivations: the same answers solved from the FLOP and byte counts
# ---------------------------------------------------------------------------------------------


def symbolic_2026() -> dict[str, sp.Expr]:
    """Derive every §8 answer with sympy (FP16, p = 2 bytes) and return the closed forms.

    Compute times are FLOPs / C, comm times come from the ring formulas; each device bound is
    the root in N of comm == compute (comm/compute grows with N, so the bound is N <= root).
    """
    B, D, Dff, W, C, S, N = sp.symbols("B D D_FF W C S N", positive=True)
    NF, NT = sp.symbols("N_FSDP N_TP", positive=True)
    p = 2
    matmul = lambda a, b, c: FLOPS_PER_MAC * a * b * c  # noqa: E731 - one line per matmul below
    ag = lambda size, n: (n - 1) / n * size / W  # noqa: E731
    ar = lambda size, n: 2 * (n - 1) / n * size / W  # noqa: E731

    fwd = matmul(B, D, Dff) + matmul(B, D, Dff) + matmul(B, Dff, D)  # x1, x2, y
    bwd = matmul(B, D, Dff) + 2 * matmul(B, Dff, D) + 3 * matmul(D, B, Dff)  # dz; dx (2); dW1..3
    weights = 3 * D * Dff * p
    act = B * D * p

    def bound(comm, compute, var=N):
        (root,) = sp.solve(sp.Eq(comm, compute), var)
        return sp.expand(root)  # reads as 1 + ..., the handout's form

    out: dict[str, sp.Expr] = {
        "ring_all_reduce": ar(S, N),
        "alternate_ring_all_reduce": (N - 1) * S / W,
        "dp_backward_flops": sp.simplify(bwd / N),
        "dp_backward_comm": sp.simplify(ar(weights, N)),
        "fsdp_forward_flops": sp.simplify(fwd / N),
        "fsdp_backward_flops": sp.simplify(bwd / N),
        "fsdp_forward_comm": sp.simplify(ag(weights, N)),
        "fsdp_backward_comm": sp.simplify(2 * ag(weights, N)),
        "tp_forward_flops": sp.simplify(fwd / N),
        "tp_backward_flops": sp.simplify(bwd / N),
        "tp_forward_comm": sp.simplify(ar(act, N)),
        "tp_backward_comm": sp.simplify(ar(act, N)),
        "fsdp_tp_forward_flops": sp.simplify(fwd / (NF * NT)),
        "fsdp_tp_comm_fsdp_axis": sp.simplify(ag(weights / NT, NF)),
        "fsdp_tp_comm_tp_axis": sp.simplify(ar(act / NF, NT)),
    }
    out["dp_max_n"] = bound(out["dp_backward_comm"], out["dp_backward_flops"] / C)
    out["fsdp_max_n_forward"] = bound(out["fsdp_forward_comm"], out["fsdp_forward_flops"] / C)
    out["fsdp_max_n_backward"] = bound(out["fsdp_backward_comm"], out["fsdp_backward_flops"] / C)
    out["tp_max_n_forward"] = bound(out["tp_forward_comm"], out["tp_forward_flops"] / C)
    out["tp_max_n_backward"] = bound(out["tp_backward_comm"], out["tp_backward_flops"] / C)

    compute_2d = out["fsdp_tp_forward_flops"] / C
    nf_max = bound(out["fsdp_tp_comm_fsdp_axis"], compute_2d, NF)
    nt_max = bound(out["fsdp_tp_comm_tp_axis"], compute_2d, NT)
    out["fsdp_tp_overlapped_n_fsdp"] = nf_max
    out["fsdp_tp_overlapped_n_tp"] = nt_max
    out["fsdp_tp_max_n_overlapped"] = sp.Mul(nf_max, nt_max, evaluate=False)

    # Serial: on comm_fsdp + comm_tp == compute, solve for N_TP, then maximise N_FSDP * N_TP.
    (nt_on_boundary,) = sp.solve(sp.Eq(out["fsdp_tp_comm_fsdp_axis"] + out["fsdp_tp_comm_tp_axis"], compute_2d), NT)
    product = sp.simplify(NF * nt_on_boundary)
    stationary = [r for r in sp.solve(sp.diff(product, NF), NF) if r.is_positive is not False]
    (nf_star,) = stationary
    out["fsdp_tp_serial_n_fsdp"] = sp.simplify(nf_star)
    out["fsdp_tp_serial_n_tp"] = sp.simplify(nt_on_boundary.subs(NF, nf_star))
    out["fsdp_tp_max_n_serial"] = sp.factor(sp.simplify(product.subs(NF, nf_star)))
    # leading order when both budgets are large (W / C large): N grows as W^2
    for key in ("fsdp_tp_max_n_overlapped", "fsdp_tp_max_n_serial"):
        out[key + "_leading"] = sp.limit(out[key] / W**2, W, sp.oo) * W**2
    return out


def symbolic_mesh_2025() -> dict[str, sp.Expr]:
    """communication_accounting (c) in symbols: the per-device batch b at which T_math = T_fsdp,
    the TP-axis limit on Y, and the optimal-split threshold (both conditions tight)."""
    b, D, F, C, W, X, Y, MX, MY = sp.symbols("b D F C W_ici X Y M_X M_Y", positive=True)
    p = 2
    t_math = 2 * FLOPS_PER_MAC * b * D * F / C
    t_fsdp = 2 * p * D * F / (Y * MX * W)
    t_tp = 2 * p * b * Y * D / (MY * W)
    (b_star,) = sp.solve(sp.Eq(t_math, t_fsdp), b)
    (y_max,) = sp.solve(sp.Eq(t_math, t_tp), Y)
    return {"t_math": t_math, "t_fsdp": t_fsdp, "t_tp": t_tp, "b_star": sp.simplify(b_star),
            "y_max": sp.simplify(y_max), "b_star_optimal_split": sp.simplify(b_star.subs(Y, y_max))}


# ---------------------------------------------------------------------------------------------
# tp_calcs (a): the TP backward pass, executable on tensors
# ---------------------------------------------------------------------------------------------


def tp_ffn_forward_backward(x, dy, w1_shards, w2_shards, w3_shards):
    """The TP FFN (W1, W2 column-parallel, W3 row-parallel) forward and backward, one device per
    shard, with the collectives done as sums over the shard list; f = SiLU.

    Forward on device i:  x1 = x W1^(i), x2 = x W2^(i), z = f(x1) * x2, y^(i) = z W3^(i);
                          y = all-reduce_i(y^(i)).
    Backward on device i (dy is replicated because y was all-reduced):
        dz^(i)   = dy W3^(i)T
        dx2^(i)  = dz^(i) * f(x1^(i))
        dx1^(i)  = dz^(i) * f'(x1^(i)) * x2^(i)
        dW3^(i)  = z^(i)T dy
        dW2^(i)  = x^T dx2^(i)
        dW1^(i)  = x^T dx1^(i)
        dx^(i)   = dx1^(i) W1^(i)T + dx2^(i) W2^(i)T
        dx       = all-reduce_i(dx^(i))
    Returns y, dx and the per-device gradient shards (lists).
    """
    import torch

    if not (len(w1_shards) == len(w2_shards) == len(w3_shards)) or not w1_shards:
        raise ValueError("need one W1, W2 and W3 shard per device, and at least one device")
    y_parts, dx_parts, dw1, dw2, dw3 = [], [], [], [], []
    for w1, w2, w3 in zip(w1_shards, w2_shards, w3_shards):
        x1, x2 = x @ w1, x @ w2
        sig = torch.sigmoid(x1)
        f_x1 = x1 * sig
        z = f_x1 * x2
        y_parts.append(z @ w3)
        dz = dy @ w3.T
        dx2 = dz * f_x1
        df = sig * (1 + x1 * (1 - sig))  # d/dx [x sigmoid(x)]
        dx1 = dz * df * x2
        dw3.append(z.T @ dy)
        dw2.append(x.T @ dx2)
        dw1.append(x.T @ dx1)
        dx_parts.append(dx1 @ w1.T + dx2 @ w2.T)
    y = torch.stack(y_parts).sum(0)  # all-reduce
    dx = torch.stack(dx_parts).sum(0)  # all-reduce
    return {"y": y, "dx": dx, "dW1": dw1, "dW2": dw2, "dW3": dw3}


# ---------------------------------------------------------------------------------------------
# Bucketed DDP overhead (2025 handout, ddp_bucketed_benchmarking (b))
# ---------------------------------------------------------------------------------------------


def ddp_bucket_overhead(*, total_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float,
                        n_buckets: int) -> float:
    """Time the last gradient all-reduce runs past the end of the backward pass.

    Model. s = total_bytes of gradients in n_b equal buckets of s/n_b bytes; an all-reduce of a
    bucket costs o + (s/n_b)/w, where w is the algorithm bandwidth (bytes per rank / time) and o
    the fixed cost of a call. The handout's assumption "computing a bucket's gradients takes as
    long as communicating it" is taken as: compute per bucket = its transfer time c = s/(n_b w),
    with o extra on the communication stream only (the launch/latency cost has no compute twin).

    Bucket k is ready at k c (k = 1..n_b). All-reduces run one at a time, each o + c long, and
    o + c > c, so the stream never idles after the first: all-reduce k ends at c + k (o + c).
    The backward ends at n_b c, hence

        overhead(n_b) = c + n_b o = s / (n_b w) + n_b o.

    The first term is the last bucket's transfer, which cannot start before its gradients exist;
    the second is the per-call latency that accumulates on the stream. One bucket (no overlap)
    gives s/w + o, the cost of the plain flat all-reduce after backward.

    (Under the other reading, compute = the whole o + c, the stream keeps pace exactly and the
    overhead is one bucket's all-reduce, o + s/(n_b w), which only falls with n_b; it gives no
    optimum, which is why the reading above is the one the question intends.)
    """
    _positive(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    if not per_call_overhead_s >= 0:
        raise ValueError(f"per_call_overhead_s must be >= 0, got {per_call_overhead_s!r}")
    if not n_buckets > 0:
        raise ValueError(f"n_buckets must be positive, got {n_buckets!r}")
    return total_bytes / (n_buckets * bandwidth_bytes_per_s) + n_buckets * per_call_overhead_s


def ddp_bucket_overhead_paced(*, total_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float,
                              n_buckets: int, backward_s: float, last_bucket_bytes: float | None = None) -> float:
    """The same overhead when the backward takes ``backward_s`` (measured), not the transfer time.

    Bucket k (k = 1..n_b) is ready at k c with c = backward_s / n_b (gradients at a uniform rate);
    an all-reduce costs t = o + s / (n_b w), the last one t_last = o + last / w (the last bucket
    holds the first parameters; its size differs when a separate cap or a large embedding sets
    it). The stream runs them one at a time, so each of the n_b - 1 hand-offs can add a backlog of
    t - c when communication is the slower of the two, and nothing when it keeps up:

        overhead = t_last + (n_b - 1) max(0, t - c).

    With the handout's assumption c = s / (n_b w) this is s / (n_b w) + n_b o, the function above
    (t - c = o). When the backward is much slower than the transfers (a big model on a fast link)
    the backlog vanishes and only the last bucket's all-reduce is left: the fewer, larger buckets
    the handout's optimum prefers then cost more, not less.
    """
    _positive(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s, backward_s=backward_s)
    if not per_call_overhead_s >= 0:
        raise ValueError(f"per_call_overhead_s must be >= 0, got {per_call_overhead_s!r}")
    if not n_buckets >= 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets!r}")
    t = per_call_overhead_s + total_bytes / (n_buckets * bandwidth_bytes_per_s)
    last = total_bytes / n_buckets if last_bucket_bytes is None else last_bucket_bytes
    t_last = per_call_overhead_s + last / bandwidth_bytes_per_s
    return t_last + (n_buckets - 1) * max(0.0, t - backward_s / n_buckets)


def optimal_n_buckets(*, total_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float) -> float:
    """d/dn_b [s/(n_b w) + n_b o] = -s/(n_b^2 w) + o = 0  =>  n_b* = sqrt(s / (w o)).

    The overhead is convex in n_b, so this is the minimum (a real number; the best integer is
    floor or ceil of it). At the optimum both terms are equal and the overhead is 2 sqrt(s o / w).
    """
    _positive(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
              per_call_overhead_s=per_call_overhead_s)
    return math.sqrt(total_bytes / (bandwidth_bytes_per_s * per_call_overhead_s))


def optimal_bucket_bytes(*, total_bytes: float, bandwidth_bytes_per_s: float, per_call_overhead_s: float) -> float:
    """Bucket size at the optimum: s / n_b* = sqrt(s w o). The bucket whose transfer time
    (s/n_b)/w equals the time n_b o that the calls' fixed costs add up to."""
    n = optimal_n_buckets(total_bytes=total_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                          per_call_overhead_s=per_call_overhead_s)
    return total_bytes / n


def symbolic_ddp_bucket() -> dict[str, sp.Expr]:
    """The overhead model and its minimiser in sympy."""
    s, w, o, n = sp.symbols("s w o n_b", positive=True)
    overhead = s / (n * w) + n * o
    (n_star,) = sp.solve(sp.diff(overhead, n), n)
    return {"overhead": overhead, "n_star": n_star, "bucket_star": sp.simplify(s / n_star),
            "overhead_star": sp.simplify(overhead.subs(n, n_star))}


# ---------------------------------------------------------------------------------------------
# All answers as one table
# ---------------------------------------------------------------------------------------------


def answers_table(*, model: StackedFFN = XXL, mesh: TPUMesh = HANDOUT_MESH, tpu: Accelerator = TPU_V5P,
                  gpu: Accelerator = H100, layer: FFNLayer | None = None,
                  example_n: int = 8, extra: tuple[Accelerator, ...] = ()):
    """Every numbered answer, evaluated: the 2025 XXL numbers on the handout's hardware and the
    2026 bounds for ``layer`` (default: the leaderboard FFN) on ``gpu``, ``tpu`` and each of
    ``extra`` (e.g. the GPU with a measured link bandwidth)."""
    import pandas as pd

    layer = layer or leaderboard_ffn()
    rows: list[dict] = []

    def add(problem, part, quantity, value, unit, formula=""):
        rows.append(dict(problem=problem, part=part, quantity=quantity, value=float(value), unit=unit,
                         formula=formula))

    ca = "communication_accounting"
    state = model_state_bytes(model)
    add(ca, "a", "parameters", model.n_params, "params", "2 n_blocks d_model d_ff")
    add(ca, "a", "FP32 weights + grads + AdamW", state["total"] / GB, "GB", "16 P bytes")
    add(ca, "a", "... in H100-80GB", devices_worth(state["total"], gpu), "GPUs", "16 P / 80 GB")
    add(ca, "a", "BF16 activations saved, per token", activation_bytes_per_token(model) / 1e6, "MB/token",
        "2 n_blocks (d_model + d_ff)")
    add(ca, "a", "... in H100-80GB per 1k tokens", devices_worth(activation_bytes(model, tokens=1000), gpu),
        "GPUs", "")
    b_star = mesh_compute_bound_tokens_per_device(model, mesh=mesh, accelerator=tpu)
    add(ca, "b", f"min N_FSDP for {tpu.name} (weights/optimizer only)", min_fsdp_degree(model, accelerator=tpu),
        "devices", "16P / N < 95 GB")
    add(ca, "b", "min N_FSDP at b = ceil(b*) tokens/device", min_fsdp_degree(
        model, accelerator=tpu, tokens_per_device=math.ceil(b_star)), "devices", "(16P + A/2)/N + A/2 < 95 GB")
    add(ca, "c", "per-device batch b* (compute-bound above)", b_star, "tokens", "alpha / (M_X Y)")
    add(ca, "c", "overall batch X Y b*", b_star * mesh.n_devices, "tokens", "X Y b*")
    add(ca, "c", "TP limit M_Y F / alpha (Y must not exceed)", mesh_tp_limit(model, mesh=mesh, accelerator=tpu),
        "devices", "")
    opt = optimal_mesh_tokens_per_device(model, accelerator=tpu, m_x=mesh.m_x, m_y=mesh.m_y)
    add(ca, "d", "per-device batch with the best FSDP/TP split", opt["tokens_per_device"], "tokens",
        "alpha^2 / (M_X M_Y F)")

    add("alternate_ring_all_reduce", "", f"time in units of S/W at N={example_n}",
        alternate_ring_all_reduce_time(size_bytes=1.0, n=example_n, link_bytes_per_s=1.0), "S/W", "(N-1) S / W")
    n = example_n
    # (problem, part, pass, the parallel degrees, the handout's formula): one device's share of the work
    for problem, part, pass_, degrees, formula in [
            ("data_parallel_calcs", "a", "backward", {"n_dp": n}, "12 B D D_FF / N"),
            ("fsdp_calcs", "a", "forward", {"n_fsdp": n}, "6 B D D_FF / N"),
            ("fsdp_calcs", "a", "backward", {"n_fsdp": n}, "12 B D D_FF / N"),
            ("tp_calcs", "b", "forward", {"n_tp": n}, "6 B D D_FF / N"),
            ("tp_calcs", "b", "backward", {"n_tp": n}, "12 B D D_FF / N")]:
        flops = per_device_flops(layer, backward=pass_ == "backward", **degrees)
        add(problem, part, f"{pass_} FLOPs/device at N={n}", flops / 1e12, "TFLOP", formula)
    add("fsdp_tp_calcs", "a", f"forward FLOPs/device at N_FSDP = N_TP = {n}",
        per_device_flops(layer, n_fsdp=n, n_tp=n) / 1e12, "TFLOP", "6 B D D_FF / (N_FSDP N_TP)")
    for hw in (gpu, *extra, tpu):
        tag = f" [{hw.name}]"
        w = hw.link_bytes_per_s
        # (problem, part, pass, the collective's time, the handout's formula)
        for problem, part, pass_, seconds, formula in [
                ("data_parallel_calcs", "b", "backward", dp_backward_comm_time(layer, n_dp=n, link_bytes_per_s=w),
                 "12 D D_FF (N-1) / (N W)"),
                ("fsdp_calcs", "b", "forward", fsdp_forward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w),
                 "6 D D_FF (N-1) / (N W)"),
                ("fsdp_calcs", "b", "backward", fsdp_backward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w),
                 "12 D D_FF (N-1) / (N W)"),
                ("tp_calcs", "c", "forward", tp_forward_comm_time(layer, n_tp=n, link_bytes_per_s=w), "4 B D (N-1) / (N W)"),
                ("tp_calcs", "c", "backward", tp_backward_comm_time(layer, n_tp=n, link_bytes_per_s=w),
                 "4 B D (N-1) / (N W)")]:
            add(problem, part, f"{pass_} comm at N={n}" + tag, seconds * 1e3, "ms", formula)
        add("data_parallel_calcs", "c", "max N_DP" + tag, dp_max_devices(layer, accelerator=hw), "devices",
            "1 + B W / C")
        fs = fsdp_max_devices(layer, accelerator=hw)
        add("fsdp_calcs", "c", "max N_FSDP, forward" + tag, fs["forward"], "devices", "1 + B W / C")
        add("fsdp_calcs", "c", "max N_FSDP, backward" + tag, fs["backward"], "devices", "1 + B W / C")
        tp = tp_max_devices(layer, accelerator=hw)
        add("tp_calcs", "d", "max N_TP, forward" + tag, tp["forward"], "devices", "1 + 3 D_FF W / (2C)")
        add("tp_calcs", "d", "max N_TP, backward" + tag, tp["backward"], "devices", "1 + 3 D_FF W / C")
        times = fsdp_tp_forward_comm_times(layer, n_fsdp=n, n_tp=n, link_bytes_per_s=w)
        add("fsdp_tp_calcs", "b", f"forward comm (max of axes) at N_FSDP = N_TP = {n}" + tag,
            times["overlapped"] * 1e3, "ms", "max(6 D D_FF (F-1)/(F T W), 4 B D (T-1)/(F T W))")
        ov = fsdp_tp_max_devices_overlapped(layer, accelerator=hw)
        se = fsdp_tp_max_devices_serial(layer, accelerator=hw)
        add("fsdp_tp_calcs", "c", "max N, overlapped axes" + tag, ov["n"], "devices", "(1 + BW/C)(1 + 3 D_FF W/(2C))")
        add("fsdp_tp_calcs", "c", "optimal N_FSDP, overlapped" + tag, ov["n_fsdp"], "devices", "1 + B W / C")
        add("fsdp_tp_calcs", "c", "optimal N_TP, overlapped" + tag, ov["n_tp"], "devices", "1 + 3 D_FF W / (2C)")
        add("fsdp_tp_calcs", "d", "max N, serial collectives" + tag, se["n"], "devices", "(a + b + ab)^2 / (4ab)")
        add("fsdp_tp_calcs", "d", "optimal N_FSDP, serial" + tag, se["n_fsdp"], "devices", "(a + b + ab) / (2b)")
        add("fsdp_tp_calcs", "d", "optimal N_TP, serial" + tag, se["n_tp"], "devices", "(a + b + ab) / (2a)")
    return pd.DataFrame(rows)
