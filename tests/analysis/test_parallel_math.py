"""Each closed form in systems.analysis.parallel_math against an independent count: ring collectives simulated
step by step on numpy arrays, FLOPs counted by torch's FlopCounterMode on real tensors, saved
activations counted with autograd's saved-tensor hooks, optimizer state read from torch.optim.AdamW,
the DDP bucket schedule replayed as a discrete-event simulation, and the device bounds found by
scanning for the first N where communication outlasts computation."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import sympy as sp
import torch
from torch.utils.flop_counter import FlopCounterMode

from systems.analysis import parallel_math as pm

# ------------------------------------------------------------------ ring simulations


def _step_time(sent_bytes_per_device: list[float], w: float) -> float:
    # a step lasts as long as the busiest sender needs for its egress
    return max(sent_bytes_per_device) / w


def simulate_ring_reduce_scatter(xs: list[np.ndarray], w: float):
    """Ring reduce-scatter: each device splits its tensor in N chunks; at step t device i sends its
    running partial of chunk (i - t + 1) mod N to i + 1, which adds it to its own copy."""
    n = len(xs)
    chunks = [np.array_split(x.astype(np.float64), n) for x in xs]
    elapsed = 0.0
    for t in range(1, n):
        sends = [(i, (i - t + 1) % n, chunks[i][(i - t + 1) % n].copy()) for i in range(n)]
        elapsed += _step_time([payload.size * xs[0].itemsize for _, _, payload in sends], w)
        for i, k, payload in sends:
            chunks[(i + 1) % n][k] = chunks[(i + 1) % n][k] + payload
    # the last receive of device i (step N-1, from i-1) completes chunk (i - 1 - (N-1) + 1) = (i + 1) mod N
    owned = {(i + 1) % n: chunks[i][(i + 1) % n] for i in range(n)}
    return owned, elapsed


def simulate_ring_all_gather(shards: list[np.ndarray], w: float):
    """Ring all-gather: at step t device i forwards the chunk it received last step (its own first)."""
    n = len(shards)
    have = [{i: shards[i]} for i in range(n)]
    elapsed = 0.0
    for t in range(1, n):
        sends = [(i, (i - t + 1) % n) for i in range(n)]
        elapsed += _step_time([have[i][k].size * shards[0].itemsize for i, k in sends], w)
        for i, k in sends:
            have[(i + 1) % n][k] = have[i][k]
    return [np.concatenate([h[k] for k in range(n)]) for h in have], elapsed


def simulate_alternate_all_reduce(xs: list[np.ndarray], w: float):
    """The handout's alternate algorithm: whole tensors circulate, each device adds what it receives."""
    n = len(xs)
    y = [x.astype(np.float64).copy() for x in xs]
    outbox = [x for x in xs]  # at t = 1 device i sends its own x^(i)
    elapsed = 0.0
    for t in range(1, n):
        for i in range(n):  # the index the handout says device i sends at step t
            assert np.array_equal(outbox[i], xs[(i - t + 1) % n])
        elapsed += _step_time([o.nbytes for o in outbox], w)
        received = [outbox[(i - 1) % n] for i in range(n)]
        for i in range(n):
            assert np.array_equal(received[i], xs[(i - t) % n])
            y[i] += received[i]
        outbox = received
    return y, elapsed


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_ring_collectives_match_simulation(n):
    rng = np.random.default_rng(n)
    w = 3.0e9
    elems = 12 * n  # divisible by n so every chunk is S / N
    xs = [rng.standard_normal(elems).astype(np.float32) for _ in range(n)]
    size = xs[0].nbytes
    total = np.sum(np.stack(xs).astype(np.float64), axis=0)

    owned, t_rs = simulate_ring_reduce_scatter(xs, w)
    ref_chunks = np.array_split(total, n)
    assert sorted(owned) == list(range(n))
    for k, chunk in owned.items():
        np.testing.assert_allclose(chunk, ref_chunks[k], rtol=1e-12)
    assert t_rs == pytest.approx(pm.ring_reduce_scatter_time(size_bytes=size, n=n, link_bytes_per_s=w), rel=1e-12)

    shards = np.array_split(xs[0], n)
    gathered, t_ag = simulate_ring_all_gather(shards, w)
    for g in gathered:
        np.testing.assert_array_equal(g, xs[0])
    assert t_ag == pytest.approx(pm.ring_all_gather_time(size_bytes=size, n=n, link_bytes_per_s=w), rel=1e-12)
    # all-reduce = reduce-scatter followed by all-gather of the reduced chunks
    reduced = [owned[k].astype(np.float32) for k in range(n)]
    _, t_ag2 = simulate_ring_all_gather(reduced, w)
    assert t_rs + t_ag2 == pytest.approx(pm.ring_all_reduce_time(size_bytes=size, n=n, link_bytes_per_s=w), rel=1e-12)

    ys, t_alt = simulate_alternate_all_reduce(xs, w)
    for y in ys:
        np.testing.assert_allclose(y, total, rtol=1e-12)
    assert t_alt == pytest.approx(pm.alternate_ring_all_reduce_time(size_bytes=size, n=n, link_bytes_per_s=w),
                                  rel=1e-12)
    # the alternate algorithm is N/2 times slower than the two-phase ring
    assert t_alt / (t_rs + t_ag2) == pytest.approx(n / 2)


# ------------------------------------------------------------------ FLOPs on real tensors


def _swiglu(x, w1, w2, w3):
    return (torch.nn.functional.silu(x @ w1) * (x @ w2)) @ w3


def _count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _ffn_params(d, dff, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(d, dff, generator=g, dtype=dtype) / d**0.5
    w2 = torch.randn(d, dff, generator=g, dtype=dtype) / d**0.5
    w3 = torch.randn(dff, d, generator=g, dtype=dtype) / dff**0.5
    return w1, w2, w3


def _fwd_bwd_flops(x, w1, w2, w3):
    """FLOPs of one forward and one backward (weights and input all need gradients)."""
    params = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    with FlopCounterMode(display=False) as fwd_counter:
        y = _swiglu(*params)
    dy = torch.randn_like(y)
    with FlopCounterMode(display=False) as bwd_counter:
        y.backward(dy)
    return fwd_counter.get_total_flops(), bwd_counter.get_total_flops()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_per_device_flops_dp_fsdp_tp(n):
    B, D, DFF = 16, 12, 20
    layer = pm.FFNLayer(batch_tokens=B, d_model=D, d_ff=DFF)
    w1, w2, w3 = _ffn_params(D, DFF)
    x = torch.randn(B, D, dtype=torch.float64)
    # DP and FSDP devices run the whole layer on B / N rows
    fwd, bwd = _fwd_bwd_flops(x[: B // n], w1, w2, w3)
    assert bwd == pm.per_device_flops(layer, backward=True, n_dp=n)
    assert fwd == pm.per_device_flops(layer, n_fsdp=n)
    assert bwd == pm.per_device_flops(layer, backward=True, n_fsdp=n)
    # a TP device runs all B rows on a D_FF / N slice of W1, W2 (columns) and W3 (rows)
    k = DFF // n
    fwd, bwd = _fwd_bwd_flops(x, w1[:, :k], w2[:, :k], w3[:k])
    assert fwd == pm.per_device_flops(layer, n_tp=n)
    assert bwd == pm.per_device_flops(layer, backward=True, n_tp=n)
    # FSDP + TP: B / N_FSDP rows on a D_FF / N_TP slice
    fwd, _ = _fwd_bwd_flops(x[: B // n], w1[:, : DFF // 2], w2[:, : DFF // 2], w3[: DFF // 2])
    assert fwd == pm.per_device_flops(layer, n_fsdp=n, n_tp=2)


def test_tp_backward_equations_match_autograd():
    B, D, DFF, n = 6, 8, 12, 3
    w1, w2, w3 = _ffn_params(D, DFF, seed=1)
    x = torch.randn(B, D, dtype=torch.float64)
    dy = torch.randn(B, D, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    y_ref = _swiglu(*leaves)
    y_ref.backward(dy)
    out = pm.tp_ffn_forward_backward(x, dy, list(w1.chunk(n, dim=1)), list(w2.chunk(n, dim=1)),
                                     list(w3.chunk(n, dim=0)))
    # float64 throughout: differences are rounding of sums in another order
    torch.testing.assert_close(out["y"], y_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["dx"], leaves[0].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(out["dW1"], dim=1), leaves[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(out["dW2"], dim=1), leaves[2].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(out["dW3"], dim=0), leaves[3].grad, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ communication bytes


@pytest.mark.parametrize("n", [2, 4, 5])
def test_comm_times_from_real_tensor_sizes(n):
    B, D, DFF = 20, 12, 20
    w = 7.0e9
    layer = pm.FFNLayer(batch_tokens=B, d_model=D, d_ff=DFF)
    w1, w2, w3 = (t.half() for t in _ffn_params(D, DFF, dtype=torch.float32))
    grad_bytes = sum(t.numel() * t.element_size() for t in (w1, w2, w3))  # the grads have the weights' shapes
    y = torch.zeros(B, D, dtype=torch.float16)
    act_bytes = y.numel() * y.element_size()

    def ring(size_bytes, kind):
        elems = int(size_bytes) // 2
        xs = [np.zeros(elems, dtype=np.float16) for _ in range(n)]  # fp16 payloads
        _, t_rs = simulate_ring_reduce_scatter(xs, w)
        _, t_ag = simulate_ring_all_gather(np.array_split(xs[0], n), w)
        return {"ag": t_ag, "rs": t_rs, "ar": t_rs + t_ag}[kind]

    # the shapes are chosen so every tensor splits into n equal ring chunks, making the count exact
    assert (grad_bytes // 2) % n == 0 and (act_bytes // 2) % n == 0
    approx = dict(rel=1e-12)
    assert ring(grad_bytes, "ar") == pytest.approx(pm.dp_backward_comm_time(layer, n_dp=n, link_bytes_per_s=w), **approx)
    assert ring(grad_bytes, "ag") == pytest.approx(pm.fsdp_forward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w),
                                                   **approx)
    assert ring(grad_bytes, "ag") + ring(grad_bytes, "rs") == pytest.approx(
        pm.fsdp_backward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w), **approx)
    assert ring(act_bytes, "ar") == pytest.approx(pm.tp_forward_comm_time(layer, n_tp=n, link_bytes_per_s=w), **approx)
    assert ring(act_bytes, "ar") == pytest.approx(pm.tp_backward_comm_time(layer, n_tp=n, link_bytes_per_s=w), **approx)
    # 2D: the FSDP axis gathers one TP shard of the weights, the TP axis reduces one FSDP shard of y
    times = pm.fsdp_tp_forward_comm_times(layer, n_fsdp=n, n_tp=2, link_bytes_per_s=w)
    assert times["fsdp"] == pytest.approx(pm.ring_all_gather_time(size_bytes=grad_bytes / 2, n=n, link_bytes_per_s=w))
    assert times["tp"] == pytest.approx(pm.ring_all_reduce_time(size_bytes=act_bytes / n, n=2, link_bytes_per_s=w))
    assert times["overlapped"] == max(times["fsdp"], times["tp"])
    assert times["serial"] == pytest.approx(times["fsdp"] + times["tp"])


# ------------------------------------------------------------------ device bounds by scanning


def _first_comm_bound(compute, comm, start=1.0, step=1e-3, stop=1e5):
    """Smallest N on a fine grid where communication time exceeds computation time."""
    n = start
    while n < stop:
        if comm(n) > compute(n) * (1 + 1e-12):
            return n
        n += step if n < 100 else step * n / 10
    return math.inf


ACCELERATORS = [pm.Accelerator(name="toy", flops_per_s=1e12, link_bytes_per_s=5e9, memory_bytes=1e9),
                pm.H100, pm.TPU_V5P]


@pytest.mark.parametrize("hw", ACCELERATORS, ids=lambda a: a.name)
def test_device_bounds_by_scanning(hw):
    layer = pm.FFNLayer(batch_tokens=4096 if hw.name != "toy" else 2000, d_model=512, d_ff=1536)
    c, w = hw.flops_per_s, hw.link_bytes_per_s
    cases = {
        "dp": (lambda n: pm.per_device_flops(layer, backward=True, n_dp=n) / c,
               lambda n: pm.dp_backward_comm_time(layer, n_dp=n, link_bytes_per_s=w),
               pm.dp_max_devices(layer, accelerator=hw)),
        "fsdp_fwd": (lambda n: pm.per_device_flops(layer, n_fsdp=n) / c,
                     lambda n: pm.fsdp_forward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w),
                     pm.fsdp_max_devices(layer, accelerator=hw)["forward"]),
        "fsdp_bwd": (lambda n: pm.per_device_flops(layer, backward=True, n_fsdp=n) / c,
                     lambda n: pm.fsdp_backward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w),
                     pm.fsdp_max_devices(layer, accelerator=hw)["backward"]),
        "tp_fwd": (lambda n: pm.per_device_flops(layer, n_tp=n) / c,
                   lambda n: pm.tp_forward_comm_time(layer, n_tp=n, link_bytes_per_s=w),
                   pm.tp_max_devices(layer, accelerator=hw)["forward"]),
        "tp_bwd": (lambda n: pm.per_device_flops(layer, backward=True, n_tp=n) / c,
                   lambda n: pm.tp_backward_comm_time(layer, n_tp=n, link_bytes_per_s=w),
                   pm.tp_max_devices(layer, accelerator=hw)["backward"]),
    }
    for name, (compute, comm, bound) in cases.items():
        found = _first_comm_bound(compute, comm)
        # the scan's grid step sets the tolerance
        assert found == pytest.approx(bound, rel=2e-3, abs=2e-3), name


def test_fsdp_tp_optima_by_grid_search():
    hw = pm.Accelerator(name="toy", flops_per_s=1e12, link_bytes_per_s=1e10, memory_bytes=1e9)
    layer = pm.FFNLayer(batch_tokens=600, d_model=256, d_ff=400)
    c, w = hw.flops_per_s, hw.link_bytes_per_s
    best_ov, best_se = (0.0, None), (0.0, None)
    for nf in np.linspace(1, 12, 441):
        for nt in np.linspace(1, 16, 601):
            compute = pm.per_device_flops(layer, n_fsdp=nf, n_tp=nt) / c
            t = pm.fsdp_tp_forward_comm_times(layer, n_fsdp=nf, n_tp=nt, link_bytes_per_s=w)
            if t["overlapped"] <= compute and nf * nt > best_ov[0]:
                best_ov = (nf * nt, (nf, nt))
            if t["serial"] <= compute and nf * nt > best_se[0]:
                best_se = (nf * nt, (nf, nt))
    ov = pm.fsdp_tp_max_devices_overlapped(layer, accelerator=hw)
    se = pm.fsdp_tp_max_devices_serial(layer, accelerator=hw)
    assert ov["n_fsdp"] < 12 and ov["n_tp"] < 16  # the grid covers the optimum
    # the grid's spacing (0.025) bounds how far the searched optimum can sit from the true one
    assert best_ov[0] == pytest.approx(ov["n"], rel=1e-2)
    assert best_se[0] == pytest.approx(se["n"], rel=1e-2)
    assert best_se[1][0] == pytest.approx(se["n_fsdp"], abs=0.3)
    assert best_se[1][1] == pytest.approx(se["n_tp"], abs=0.3)
    assert se["n"] < ov["n"]


def test_sympy_derivations_agree_with_closed_forms():
    sym = pm.symbolic_2026()
    B, D, DFF, W, C, S, N = sp.symbols("B D D_FF W C S N", positive=True)
    NF, NT = sp.symbols("N_FSDP N_TP", positive=True)
    rng = random.Random(0)
    for _ in range(5):
        vals = dict(B=rng.uniform(1e3, 1e5), D=rng.uniform(64, 8192), DFF=rng.uniform(256, 32768),
                    W=rng.uniform(1e10, 1e12), C=rng.uniform(1e13, 1e15), N=rng.uniform(2, 64))
        subs = {B: vals["B"], D: vals["D"], DFF: vals["DFF"], W: vals["W"], C: vals["C"], N: vals["N"],
                NF: 3.0, NT: 5.0, S: 1e6}
        layer = pm.FFNLayer(batch_tokens=vals["B"], d_model=vals["D"], d_ff=vals["DFF"])
        hw = pm.Accelerator(name="r", flops_per_s=vals["C"], link_bytes_per_s=vals["W"], memory_bytes=1.0)
        n, w = vals["N"], vals["W"]
        expected = {
            "ring_all_reduce": pm.ring_all_reduce_time(size_bytes=1e6, n=n, link_bytes_per_s=w),
            "alternate_ring_all_reduce": pm.alternate_ring_all_reduce_time(size_bytes=1e6, n=n, link_bytes_per_s=w),
            "dp_backward_flops": pm.per_device_flops(layer, backward=True, n_dp=n),
            "dp_backward_comm": pm.dp_backward_comm_time(layer, n_dp=n, link_bytes_per_s=w),
            "fsdp_forward_comm": pm.fsdp_forward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w),
            "fsdp_backward_comm": pm.fsdp_backward_comm_time(layer, n_fsdp=n, link_bytes_per_s=w),
            "tp_forward_comm": pm.tp_forward_comm_time(layer, n_tp=n, link_bytes_per_s=w),
            "dp_max_n": pm.dp_max_devices(layer, accelerator=hw),
            "fsdp_max_n_forward": pm.fsdp_max_devices(layer, accelerator=hw)["forward"],
            "fsdp_max_n_backward": pm.fsdp_max_devices(layer, accelerator=hw)["backward"],
            "tp_max_n_forward": pm.tp_max_devices(layer, accelerator=hw)["forward"],
            "tp_max_n_backward": pm.tp_max_devices(layer, accelerator=hw)["backward"],
            "fsdp_tp_forward_flops": pm.per_device_flops(layer, n_fsdp=3.0, n_tp=5.0),
            "fsdp_tp_comm_fsdp_axis": pm.fsdp_tp_forward_comm_times(layer, n_fsdp=3.0, n_tp=5.0,
                                                                    link_bytes_per_s=w)["fsdp"],
            "fsdp_tp_comm_tp_axis": pm.fsdp_tp_forward_comm_times(layer, n_fsdp=3.0, n_tp=5.0,
                                                                  link_bytes_per_s=w)["tp"],
            "fsdp_tp_max_n_overlapped": pm.fsdp_tp_max_devices_overlapped(layer, accelerator=hw)["n"],
        }
        serial = pm.fsdp_tp_max_devices_serial(layer, accelerator=hw)
        if serial["n_fsdp"] > 1 and serial["n_tp"] > 1:  # interior optimum: sympy's stationary point
            expected |= {"fsdp_tp_max_n_serial": serial["n"], "fsdp_tp_serial_n_fsdp": serial["n_fsdp"],
                         "fsdp_tp_serial_n_tp": serial["n_tp"]}
        for key, value in expected.items():
            assert float(sym[key].subs(subs)) == pytest.approx(value, rel=1e-9), key


# ------------------------------------------------------------------ 2025 communication_accounting


def test_xxl_counts():
    assert pm.XXL.n_params == 126 * 2 * 16384 * 53248
    state = pm.model_state_bytes(pm.XXL)
    assert state["total"] == 16 * pm.XXL.n_params


def test_memory_of_a_small_stack_by_counting_tensors():
    """Build a scaled-down StackedFFN, count saved activations and AdamW state in torch."""
    small = pm.StackedFFN(d_model=8, d_ff=24, n_blocks=3)
    tokens = 10
    layers = []
    for _ in range(small.n_blocks):
        layers += [torch.nn.Linear(small.d_model, small.d_ff, bias=False),
                   torch.nn.Linear(small.d_ff, small.d_model, bias=False)]
    master = torch.nn.Sequential(*layers)  # FP32 master weights
    assert sum(p.numel() for p in master.parameters()) == small.n_params

    compute = torch.nn.Sequential(*[torch.nn.Linear(l.in_features, l.out_features, bias=False)
                                    for l in layers]).to(torch.bfloat16)
    compute.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
    param_ptrs = {p.data_ptr() for p in compute.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in param_ptrs:  # weights are stored anyway; count activations only
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    x = torch.randn(tokens, small.d_model, dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compute(x)
    out.float().sum().backward()
    assert sum(saved.values()) == pm.activation_bytes(small, tokens=tokens)

    # FP32 grads accumulated into the master copy, then one AdamW step creates m and v
    for p_master, p_compute in zip(master.parameters(), compute.parameters()):
        p_master.grad = p_compute.grad.float()
    opt = torch.optim.AdamW(master.parameters())
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in master.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in master.parameters())
    moments = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim() > 0)
    counted = {"master_weights": weights, "gradients": grads, "optimizer_state": moments}
    expected = pm.model_state_bytes(small)
    for key, value in counted.items():
        assert value == expected[key], key


@pytest.mark.parametrize("tokens", [0, 300, 2000])
def test_min_fsdp_degree_by_scanning(tokens):
    hw = pm.TPU_V5P
    n = 1
    while pm.fsdp_bytes_per_device(pm.XXL, n_fsdp=n, tokens_per_device=tokens) >= hw.memory_bytes:
        n += 1
    assert pm.min_fsdp_degree(pm.XXL, accelerator=hw, tokens_per_device=tokens) == n


def test_min_fsdp_degree_rejects_impossible_batch():
    with pytest.raises(ValueError, match="does not fit"):
        pm.min_fsdp_degree(pm.XXL, accelerator=pm.TPU_V5P, tokens_per_device=1e6)


def _mesh_counts(model, mesh, b, accelerator, p=2):
    """Per-device bytes and FLOPs of one block, from the shard shapes (tokens b per device)."""
    B = b * mesh.x * mesh.y
    d, f = model.d_model, model.d_ff
    gathered_weight = (d, f // mesh.y)  # W_in[D, F_Y] (W_out[F_Y, D] is the same size)
    act = (B // mesh.x, d)  # In[B_X, D] gathered, Out[B_X, D] reduce-scattered
    flops = 2 * (2 * act[0] * d * (f // mesh.y))
    w = accelerator.link_bytes_per_s
    return {"math": flops / accelerator.flops_per_s,
            "fsdp": 2 * p * math.prod(gathered_weight) / (mesh.m_x * w),
            "tp": 2 * p * math.prod(act) / (mesh.m_y * w)}


def test_mesh_threshold_by_scanning_the_batch():
    model, mesh, hw = pm.XXL, pm.HANDOUT_MESH, pm.TPU_V5P
    b = 1
    while True:
        t = _mesh_counts(model, mesh, b, hw)
        if t["math"] >= max(t["fsdp"], t["tp"]):
            break
        b += 1
    b_star = pm.mesh_compute_bound_tokens_per_device(model, mesh=mesh, accelerator=hw)
    assert b == math.ceil(b_star)
    for key, value in pm.mesh_forward_block_times(model, mesh=mesh, accelerator=hw, tokens_per_device=b).items():
        assert value == pytest.approx(t[key], rel=1e-12), key
    sym = pm.symbolic_mesh_2025()
    subs = dict(zip(sp.symbols("C W_ici M_X M_Y Y F", positive=True),
                    (hw.flops_per_s, hw.link_bytes_per_s, mesh.m_x, mesh.m_y, mesh.y, model.d_ff)))
    assert float(sym["b_star"].subs(subs)) == pytest.approx(b_star)
    assert float(sym["y_max"].subs(subs)) == pytest.approx(pm.mesh_tp_limit(model, mesh=mesh, accelerator=hw))
    opt = pm.optimal_mesh_tokens_per_device(model, accelerator=hw, m_x=mesh.m_x, m_y=mesh.m_y)
    assert float(sym["b_star_optimal_split"].subs(subs)) == pytest.approx(opt["tokens_per_device"])
    assert opt["tokens_per_device"] < b_star


def test_mesh_rejects_tp_beyond_limit():
    mesh = pm.TPUMesh(x=2, y=64)
    with pytest.raises(ValueError, match="TP degree"):
        pm.mesh_compute_bound_tokens_per_device(pm.XXL, mesh=mesh, accelerator=pm.TPU_V5P)


# ------------------------------------------------------------------ bucketed DDP


def simulate_bucketed_backward(*, total_bytes, w, o, n_buckets):
    """Discrete events: bucket k's gradients are ready at k * c (c = its transfer time); one
    all-reduce at a time, each o + c long. Returns how long the last one ends after backward."""
    c = total_bytes / n_buckets / w
    stream_free = 0.0
    for k in range(1, n_buckets + 1):
        start = max(k * c, stream_free)
        stream_free = start + o + c
    return stream_free - n_buckets * c


@pytest.mark.parametrize("s,w,o", [(1e9, 1e10, 1e-4), (3e8, 5e10, 3e-5), (2e6, 1e9, 0.0)])
def test_ddp_bucket_overhead_matches_event_simulation(s, w, o):
    for nb in (1, 2, 5, 17, 64):
        assert pm.ddp_bucket_overhead(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o,
                                      n_buckets=nb) == pytest.approx(
            simulate_bucketed_backward(total_bytes=s, w=w, o=o, n_buckets=nb), rel=1e-9)


def simulate_paced_backward(*, total_bytes, w, o, n_buckets, backward_s, last_bytes):
    """Discrete events with a measured backward: bucket k ready at k * backward_s / n_b; the
    buckets' all-reduces one at a time, the last of its own size."""
    c = backward_s / n_buckets
    stream_free = 0.0
    for k in range(1, n_buckets + 1):
        size = last_bytes if k == n_buckets else total_bytes / n_buckets
        stream_free = max(k * c, stream_free) + o + size / w
    return stream_free - backward_s


@pytest.mark.parametrize("backward_s", [0.003, 0.05, 0.3])
def test_paced_bucket_overhead_matches_event_simulation(backward_s):
    s, w, o = 8e9, 3e11, 4e-5
    for nb in (1, 2, 8, 98, 435):
        for last in (None, 6.4e7):
            expected = simulate_paced_backward(total_bytes=s, w=w, o=o, n_buckets=nb, backward_s=backward_s,
                                               last_bytes=s / nb if last is None else last)
            assert pm.ddp_bucket_overhead_paced(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o,
                                                n_buckets=nb, backward_s=backward_s, last_bucket_bytes=last) \
                == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # under the handout's assumption (the backward as long as the transfers) it is the handout's model
    for nb in (1, 5, 64):
        assert pm.ddp_bucket_overhead_paced(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o,
                                            n_buckets=nb, backward_s=s / w) == pytest.approx(
            pm.ddp_bucket_overhead(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o, n_buckets=nb))


def test_optimal_buckets_by_integer_scan():
    s, w, o = 4e9, 5e10, 5e-5
    sims = {nb: simulate_bucketed_backward(total_bytes=s, w=w, o=o, n_buckets=nb) for nb in range(1, 500)}
    best = min(sims, key=sims.get)
    n_star = pm.optimal_n_buckets(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o)
    assert best in (math.floor(n_star), math.ceil(n_star))
    assert pm.optimal_bucket_bytes(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o) == pytest.approx(
        math.sqrt(s * w * o))
    sym = pm.symbolic_ddp_bucket()
    subs = dict(zip(sp.symbols("s w o", positive=True), (s, w, o)))
    assert float(sym["n_star"].subs(subs)) == pytest.approx(n_star)
    assert float(sym["overhead_star"].subs(subs)) == pytest.approx(
        pm.ddp_bucket_overhead(total_bytes=s, bandwidth_bytes_per_s=w, per_call_overhead_s=o, n_buckets=n_star))


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        pm.ddp_bucket_overhead(total_bytes=1e6, bandwidth_bytes_per_s=1e9, per_call_overhead_s=1e-5, n_buckets=0)
    with pytest.raises(ValueError):
        pm.optimal_bucket_bytes(total_bytes=1e6, bandwidth_bytes_per_s=-1.0, per_call_overhead_s=1e-5)
    with pytest.raises(ValueError):
        pm.ring_all_reduce_time(size_bytes=1.0, n=0.5, link_bytes_per_s=1.0)
    with pytest.raises(ValueError):
        pm.FFNLayer(batch_tokens=0, d_model=1, d_ff=1)
    with pytest.raises(ValueError):
        pm.StackedFFN(d_model=8, d_ff=0, n_blocks=1)


def test_answers_table_has_every_problem():
    df = pm.answers_table()
    assert set(df["problem"]) == {"communication_accounting", "alternate_ring_all_reduce", "data_parallel_calcs",
                                  "fsdp_calcs", "tp_calcs", "fsdp_tp_calcs"}
    assert df["value"].notna().all()


def test_tp_backward_check_and_the_ratio_grid():
    check = pm.tp_backward_check()
    # float64 sums of a few dozen terms: differences of a few ulp of O(1) values
    assert max(v for k, v in check.items() if k != "n_tp") < 1e-12
    layer, hw = pm.leaderboard_ffn(), pm.H100
    grid = pm.fsdp_tp_ratio_grid(layer, accelerator=hw, n_points=5, span=1.0)
    # the grid's far corner is the overlapped optimum, where both axes' ratios are exactly 1
    assert grid["overlapped"][-1, -1] == pytest.approx(1.0)
    assert grid["serial"][-1, -1] == pytest.approx(2.0)
    assert grid["overlapped"][0, 0] == 0.0  # one device: no communication
