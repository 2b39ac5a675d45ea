"""Four backward kernels and a forward in Gluon, for Hopper: asynchronous wgmma (notes entries 16,
17, 18, 23, 24, 25, 26, 27).

Triton's ``tl.dot`` waits for every product that is not a loop-carried accumulator right after
issuing it, so in kernels.py's dK/dV loop the tensor cores idle through the exponentials and dS,
and the CUDA cores through S^T and dP^T (notes entry 15). Gluon exposes the waits. The dK/dV
kernel, per query tile, with the wgmma groups in flight oldest first:

    issue S^T = K Q^T and dP^T = V dO^T         in flight: dV, dK (last tile), S^T, dP^T
    wait until one is left                      S^T done (and the last tile's dV, dK)
    P^T = exp2(S^T - L), issue dV += P^T dO     dP^T runs under the exponentials
    wait until one is left                      dP^T done; dV in flight
    dS^T = P^T o (dP^T - D), issue dK += dS^T Q dV runs under dS^T; dK under the next tile's issue

Beyond that: K and V are wgmma's A operand from registers (loaded once; only Q^T and dO^T are read
from shared memory per product), Q and dO stream through TMA into a ring of STAGES buffers, and L
and D through cp.async into the same ring, each thread arriving on the tile's mbarrier when its
copies land (so the loop never waits on a global load). The dQ kernel is the same schedule per key
tile with one product fewer (_dq_key_loop), Q and dO in registers, K and V through the TMA ring.
The atomic backward's kernel (flash_bwd_atomic_ws_gluon_kernel, FlashAttention-3's layout) adds
the fifth product to that loop: dS^T goes to shared memory, dQ's part dS K is issued before dK's
product and waited while that runs, and is added into an fp32 buffer by one TMA bulk reduce-add
per query tile. It is warp-specialised: two consumer warpgroups over 128 keys run the products,
beside a loader warp (Q, dO, L, D into the ring) and a dQ warp (the reduce-adds); the two workers
hold 24 registers each, so the consumers get 240, which d = 128 needs (a one-partition form of
it, entries 18 and 21, spilled there and was only level with the split pair at d = 64). At d = 64
the two consumers are separate partitions instead (flash_bwd_atomic_pp_gluon_kernel, entry 26):
they take turns with dQ's product, so they no longer meet at a barrier every query tile, and every
product takes its A operand from registers (entry 27): K and V for S^T and dP^T, and K^T for dQ's
part, computed transposed (dQ^T = K^T dS^T). An m64n64k16 wgmma with both operands in shared
memory reads 4 KB there in its 32 cycles of tensor work, all of shared memory's 128 bytes a cycle.

The forward (flash_fwd_ws_gluon_kernel) is warp-specialised the same way, as FlashAttention-3's:
a program owns 128 query rows (192 at d = 64), consumer warpgroups of 64 rows each and a loader
warp streaming K and V through a ring. Each consumer issues S_j = Q K_j^T beside O += P_{j-1}
V_{j-1}, then does S_j's softmax while those run; the consumers take turns issuing (a "ping-pong"
through an mbarrier each), so one's exponentials run while the others' products keep the tensor
cores busy.

Written against the Gluon of Triton 3.6 (an experimental API that changes between releases: 3.9
renamed the TMA copies, and the reduce-add has no public call in 3.6: _tma_reduce_add), so launch.py
runs them only inside pyproject.toml's GPU-tested versions, for 16-bit inputs on sm_90, at the head
dims where each measured faster than its Triton twin (tuning.GLUON_TILES: dK/dV at d = 64, dQ at
d = 128, the atomic kernel's two forms at d = 64 and d = 128, the forward at both), and kernels.py's
kernels everywhere else. Each reads the same inputs and writes the same outputs as its twin in
kernels.py (flash_bwd_dkdv_tma_kernel, flash_bwd_dq_tma_kernel, flash_bwd_atomic_kernel for both
atomic forms, flash_fwd_tma_kernel), in the same program order (kernels._program_tile, imported into Gluon
unchanged).
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from systems.attention.flash_triton import kernels

_LOG2E = gl.constexpr(kernels.LOG2E)
_LN2 = gl.constexpr(kernels._LN2.value)
_MASKED = gl.constexpr(-1e6)  # kernels._MASKED
# the atomic kernel's dQ staging buffers: a tile's reduce reads one while the next tile's products
# run. Three or four measured 1.01x the time at d = 64 (notes entry 24); at d = 128 they do not fit.
_DQ_BUFFERS = gl.constexpr(2)
_WG_ROWS = gl.constexpr(64)  # the rows of one consumer warpgroup's tiles (wgmma's M)
# kernels.py's index helpers are scalar arithmetic only, so they compile as Gluon unchanged
_program_tile = gluon.jit(kernels._program_tile.fn)
_diagonal_query_tiles = gluon.jit(kernels._diagonal_query_tiles.fn)
_key_bounds = gluon.jit(kernels._key_bounds.fn)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[the box at coord] += shared memory ``src``, by the TMA engine (one
    cp.reduce.async.bulk.tensor .add; completion tracked like a TMA store's, tma.store_wait).
    Triton 3.6's Gluon has no public call for it; this is its hopper.tma.async_copy_shared_to_global
    with the builder's reduce op (GluonOpBuilder.create_async_tma_reduce) in place of the copy."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _head_descriptor(base, bh, n_rows, HEAD_DIM: gl.constexpr, BLOCK_ROWS: gl.constexpr, layout: gl.constexpr):
    """A TMA descriptor of (batch, head) bh's (n_rows, HEAD_DIM) slice of a contiguous tensor, in
    tiles of BLOCK_ROWS rows (rows past n_rows read as zeros)."""
    return tma.make_tensor_descriptor(base + bh * n_rows * HEAD_DIM, shape=[n_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                      block_shape=[BLOCK_ROWS, HEAD_DIM], layout=layout)


@gluon.jit
def _tile_operands(X, Y, n_x, A, B, n_a, bh, HEAD_DIM: gl.constexpr, BLOCK_X: gl.constexpr, BLOCK_A: gl.constexpr,
                   STAGES: gl.constexpr, layout: gl.constexpr):
    """The TMA descriptors and shared memory of a program's four operand tensors: X and Y (n_x rows
    a head), one tile of BLOCK_X rows each held for the whole program, and A and B (n_a rows), tiles
    of BLOCK_A rows streamed through rings of STAGES buffers."""
    dtype: gl.constexpr = X.dtype.element_ty
    x_desc = _head_descriptor(X, bh, n_x, HEAD_DIM, BLOCK_X, layout)
    y_desc = _head_descriptor(Y, bh, n_x, HEAD_DIM, BLOCK_X, layout)
    a_desc = _head_descriptor(A, bh, n_a, HEAD_DIM, BLOCK_A, layout)
    b_desc = _head_descriptor(B, bh, n_a, HEAD_DIM, BLOCK_A, layout)
    x_smem = gl.allocate_shared_memory(dtype, [BLOCK_X, HEAD_DIM], layout)
    y_smem = gl.allocate_shared_memory(dtype, [BLOCK_X, HEAD_DIM], layout)
    a_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_A, HEAD_DIM], layout)
    b_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_A, HEAD_DIM], layout)
    return x_desc, y_desc, a_desc, b_desc, x_smem, y_smem, a_ring, b_ring


@gluon.jit
def _store_tile(base, x, bh, row0, n_rows, HEAD_DIM: gl.constexpr, BLOCK_ROWS: gl.constexpr, layout: gl.constexpr):
    """Store x (BLOCK_ROWS, HEAD_DIM, in ``layout``) into rows row0... of (batch, head) bh's slice
    of a contiguous (..., n_rows, HEAD_DIM) tensor, in its dtype; rows past n_rows are dropped."""
    rows = row0 + gl.arange(0, BLOCK_ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offsets = bh * n_rows * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    gl.store(base + offsets, x.to(base.dtype.element_ty), mask=rows[:, None] < n_rows)


@gluon.jit
def _issue_tile(q_desc, do_desc, q_ring, do_ring, l_ring, d_ring, bars, slot, row0, L_bh, D_bh, n_q, copy_cols):
    """Start loading query tile ``row0``'s Q, dO (TMA; rows past n_q read as zeros) and L, D
    (cp.async, zeros past n_q) into ring slot ``slot``; its barrier completes when all have landed
    (one TMA arrival with the byte count, one arrival per thread)."""
    bar = bars.index(slot)
    rows = row0 + copy_cols
    async_copy.async_copy_global_to_shared(l_ring.index(slot), L_bh + rows, mask=rows < n_q)
    async_copy.async_copy_global_to_shared(d_ring.index(slot), D_bh + rows, mask=rows < n_q)
    async_copy.mbarrier_arrive(bar, increment_count=False)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0, 0], bar, q_ring.index(slot))
    tma.async_copy_global_to_shared(do_desc, [row0, 0], bar, do_ring.index(slot))


@gluon.jit
def _scaled_scores(s_t, qk_scale, offs_n, offs_m, offset, n_k, MASK: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """S^T (keys offs_n x queries offs_m) in base 2, masked where MASK: the causal mask (IS_CAUSAL) or
    else the key bound."""
    s_t = s_t * qk_scale
    if MASK:
        if IS_CAUSAL:
            keep = offs_n[:, None] <= offs_m[None, :] + offset
        else:  # keys past n_k read as zeros, and exp2(0 - L) may overflow: their dS K would be nan
            keep = offs_n[:, None] < n_k
        s_t = gl.where(keep, s_t, _MASKED)
    return s_t


@gluon.jit
def _query_loop(dk, dv, k_op, v_op, q_desc, do_desc, q_ring, do_ring, l_ring, d_ring, bars, L_bh, D_bh, offs_n,
                n_q, n_k, offset, qk_scale, lo, hi, it, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr,
                p_layout: gl.constexpr):
    """Accumulate dK, dV (wgmma accumulators, in flight) of one key tile over query tiles [lo, hi),
    in transposed form (keys x queries), as kernels._dkdv_query_loop does. ``it`` counts the tiles
    through the ring over the calls (slot it % STAGES, barrier phase (it // STAGES) % 2). MASK: the
    causal mask (IS_CAUSAL) or else the key bound. Every product has completed on return."""
    n_iter = gl.cdiv(hi - lo, BLOCK_M)
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    # one element a thread for the cp.async of L and D (the score layout's columns repeat per thread)
    copy_cols = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    for i in gl.static_range(STAGES - 1):
        if i < n_iter:
            _issue_tile(q_desc, do_desc, q_ring, do_ring, l_ring, d_ring, bars, (it + i) % STAGES, lo + i * BLOCK_M,
                        L_bh, D_bh, n_q, copy_cols)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    for i in range(0, n_iter):
        start_m = lo + i * BLOCK_M
        slot = (it + i) % STAGES
        mbarrier.wait(bars.index(slot), ((it + i) // STAGES) & 1)
        q_s = q_ring.index(slot)
        do_s = do_ring.index(slot)
        s_t = warpgroup_mma(k_op, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_op, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        lse = l_ring.index(slot).load(gl.SliceLayout(0, s_layout))
        delta = d_ring.index(slot).load(gl.SliceLayout(0, s_layout))
        s_t, dk, dv = warpgroup_mma_wait(1, deps=[s_t, dk, dv])
        # the last tile's products are done with its slot: refill it STAGES - 1 tiles ahead
        if i + STAGES - 1 < n_iter:
            _issue_tile(q_desc, do_desc, q_ring, do_ring, l_ring, d_ring, bars, (it + i + STAGES - 1) % STAGES,
                        start_m + (STAGES - 1) * BLOCK_M, L_bh, D_bh, n_q, copy_cols)
        s_t = _scaled_scores(s_t, qk_scale, offs_n, start_m + cols, offset, n_k, MASK, IS_CAUSAL)
        p_t = gl.exp2(s_t - lse[None, :] * _LOG2E)  # P^T = exp(S - L) (eq. 13)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(q_s.dtype), p_layout), do_s, dv, is_async=True)  # eq. 14
        dp_t = warpgroup_mma_wait(1, deps=[dp_t])
        ds_t = (p_t * (dp_t - delta[None, :])).to(q_s.dtype)  # dS^T = P^T o (dP^T - D) (eq. 16)
        dk = warpgroup_mma(gl.convert_layout(ds_t, p_layout), q_s, dk, is_async=True)  # eq. 18
    dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
    return warpgroup_mma_init(dk), warpgroup_mma_init(dv), it + n_iter


@gluon.jit
def _masked_query_tiles(n0, n_q, n_k, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The query tiles [lo, hi) a key tile's program (keys n0...) runs first, masked: those that see
    part of it (the causal diagonal); without causality, the first query tile, or every one if the
    key tile is ragged (past n_k). The tiles from hi to n_q follow, unmasked.

    Either way the unmasked loop then starts from accumulators that went through a completed wait.
    Measured on the H100 (notes entry 16): one loop over all the query tiles from the zero
    accumulators gave wrong dK and dV whenever it ran two or more tiles; split this way the
    kernels are exact. The cause is not pinned down (the suspect: the two equal zero accumulators
    merged by the common-subexpression passes Gluon runs). Keys past n_k are never seen by a
    causal query past the diagonal, so the unmasked loop needs no key bound."""
    if IS_CAUSAL:
        lo, hi = _diagonal_query_tiles(n0, n_k - n_q, BLOCK_M, BLOCK_N)
    else:
        lo = 0
        hi = gl.where(n0 + BLOCK_N > n_k, n_q, BLOCK_M)
    return lo, gl.minimum(hi, n_q)


@gluon.jit(do_not_specialize=kernels._ORDER_ARGS)
def flash_bwd_dkdv_gluon_kernel(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, head_group, qk_scale, sm_scale,
                                HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Grid (key tiles x batch, in _program_tile's order). dK and dV of the split backward; runs
    after the dQ kernel, which wrote Delta. One program owns dK and dV of one key tile; BLOCK_N / 16
    warps, a warpgroup per 64 keys."""
    WARPS: gl.constexpr = gl.num_warps()
    # wgmma's accumulators: S^T, dP^T (keys x queries), dK, dV (keys x d)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    tile_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    tile, bh = _program_tile(n_k, head_group, BLOCK_N, False)
    n0 = tile * BLOCK_N
    k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_ring, do_ring = _tile_operands(
        K, V, n_k, Q, dO, n_q, bh, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, tile_smem)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    d_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1 + 32 * WARPS)  # the TMA's expect and each thread's cp.async
    mbarrier.init(kv_bar, count=1)
    fence_async_shared()

    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)  # rows past n_k read as zeros
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    L_bh = L + bh * n_q
    D_bh = Delta + bh * n_q
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    mbarrier.wait(kv_bar, 0)
    k_op = k_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    v_op = v_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))

    offset = n_k - n_q
    lo, hi = _masked_query_tiles(n0, n_q, n_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    dk, dv, it = _query_loop(dk, dv, k_op, v_op, q_desc, do_desc, q_ring, do_ring, l_ring, d_ring, bars, L_bh, D_bh,
                             offs_n, n_q, n_k, offset, qk_scale, lo, hi, 0, BLOCK_M, BLOCK_N, STAGES, True,
                             IS_CAUSAL, s_layout, p_layout)
    # ... then the query tiles that see all of it (rows past n_q load as zeros and add nothing)
    dk, dv, it = _query_loop(dk, dv, k_op, v_op, q_desc, do_desc, q_ring, do_ring, l_ring, d_ring, bars, L_bh, D_bh,
                             offs_n, n_q, n_k, offset, qk_scale, hi, n_q, it, BLOCK_M, BLOCK_N, STAGES, False,
                             IS_CAUSAL, s_layout, p_layout)
    dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    mbarrier.invalidate(kv_bar)

    _store_tile(dK, dk * sm_scale, bh, n0, n_k, HEAD_DIM, BLOCK_N, kv_layout)  # dK = dS^T Q * scale
    _store_tile(dV, dv, bh, n0, n_k, HEAD_DIM, BLOCK_N, kv_layout)


# ----------------------------------------------------------------------------- five products, warp-specialised


@gluon.jit
def _visited_query_tiles(lo, hi, n_q, BLOCK_M: gl.constexpr):
    """How many query tiles a key tile's program visits, and how many of them are masked: [lo, hi)
    first, then hi on (_masked_query_tiles)."""
    n_masked = gl.maximum(gl.cdiv(hi - lo, BLOCK_M), 0)
    return n_masked + gl.maximum(gl.cdiv(n_q - hi, BLOCK_M), 0), n_masked


@gluon.jit
def _visited_tile_row(t, lo, hi, n_masked, BLOCK_M: gl.constexpr):
    """The first row of the t-th query tile a key tile's program visits."""
    return gl.where(t < n_masked, lo + t * BLOCK_M, hi + (t - n_masked) * BLOCK_M)


@gluon.jit
def _ws_loader(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar, ready, empty,
               L_bh, D_bh, n0, n_q, lo, hi, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, copy_layout: gl.constexpr):
    """The loader warp: K and V once, then per visited query tile Q and dO (TMA) and L in base 2 and D
    (cp.async, zeros past n_q) into the ring slot the consumers released (``empty``), completing its
    ``ready`` barrier."""
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)  # rows past n_k read as zeros
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    n_tiles, n_masked = _visited_query_tiles(lo, hi, n_q, BLOCK_M)
    copy_rows = gl.arange(0, BLOCK_M, layout=copy_layout)
    for t in range(n_tiles):
        row0 = _visited_tile_row(t, lo, hi, n_masked, BLOCK_M)
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        _issue_tile(q_desc, do_desc, q_ring, do_ring, l_ring, d_ring, ready, slot, row0, L_bh, D_bh, n_q, copy_rows)


@gluon.jit
def _ws_dq_adder(dq_desc, dq_stage, dq_ready, dq_empty, n_q, lo, hi, BLOCK_M: gl.constexpr):
    """The dQ warp: per visited query tile, once the consumers have staged its dS K (``dq_ready``),
    one TMA reduce-add into DQ_ACC (rows past n_q dropped by the descriptor); a staging buffer is
    released (``dq_empty``) once the reduce that read it is done, leaving one in flight."""
    n_tiles, n_masked = _visited_query_tiles(lo, hi, n_q, BLOCK_M)
    for t in range(n_tiles):
        row0 = _visited_tile_row(t, lo, hi, n_masked, BLOCK_M)
        b = t % _DQ_BUFFERS
        mbarrier.wait(dq_ready.index(b), (t // _DQ_BUFFERS) & 1)
        _tma_reduce_add(dq_desc, [row0, 0], dq_stage.index(b))
        tma.store_wait(_DQ_BUFFERS - 1)  # the reduce issued one tile earlier has read its buffer
        mbarrier.arrive(dq_empty.index((t + 1) % _DQ_BUFFERS), count=1, pred=t >= _DQ_BUFFERS - 1)
    tma.store_wait(0)


@gluon.jit
def _ws_query_loop(dk, dv, k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, ready, empty, ds_smem, dq_stage,
                   dq_ready, dq_empty, offs_n, n_k, offset, qk_scale, lo, hi, it, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
                   dq_layout: gl.constexpr):
    """The consumers' loop over query tiles [lo, hi) (``it`` counts tiles over the calls): the four
    products of _query_loop and dQ's part dS K, the loads and the reduce-adds left to the worker
    warps. A ring slot goes back to the loader once the next tile's first wait has retired the dK
    and dV products that read it."""
    n_iter = gl.cdiv(hi - lo, BLOCK_M)
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    for i in range(0, n_iter):
        start_m = lo + i * BLOCK_M
        t = it + i
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        q_s = q_ring.index(slot)
        do_s = do_ring.index(slot)
        s_t = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_t, dk, dv = warpgroup_mma_wait(1, deps=[s_t, dk, dv])
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
        s_t = _scaled_scores(s_t, qk_scale, offs_n, start_m + cols, offset, n_k, MASK, IS_CAUSAL)
        lse2 = l_ring.index(slot).load(gl.SliceLayout(0, s_layout))
        p_t = gl.exp2(s_t - lse2[None, :])  # P^T = exp(S - L) (eq. 13), both in base 2
        dv = warpgroup_mma(gl.convert_layout(p_t.to(q_s.dtype), p_layout), do_s, dv, is_async=True)  # eq. 14
        dp_t = warpgroup_mma_wait(1, deps=[dp_t])
        delta = d_ring.index(slot).load(gl.SliceLayout(0, s_layout))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q_s.dtype)  # dS^T = P^T o (dP^T - D) (eq. 16)
        # dQ's part dS K (eq. 17) from dS^T in shared memory, issued before dK += dS^T Q (eq. 18) so
        # that it is waited first, while dK's product runs. It is waited within the iteration:
        # ptxas serialises every wgmma if the registers of one issued in an earlier iteration are
        # read after the loop's back edge (its warning C7514).
        ds_smem.store(ds_t)
        fence_async_shared()
        gl.thread_barrier()
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t, p_layout), q_s, dk, is_async=True)
        dq = warpgroup_mma_wait(1, deps=[dq])
        b = t % _DQ_BUFFERS
        mbarrier.wait(dq_empty.index(b), ((t // _DQ_BUFFERS) & 1) ^ 1)
        dq_stage.index(b).store(dq)
        fence_async_shared()  # the generic-proxy stores before the dQ warp's TMA reads them
        mbarrier.arrive(dq_ready.index(b), count=1)
    dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
    return warpgroup_mma_init(dk), warpgroup_mma_init(dv), it + n_iter


@gluon.jit
def _ws_consumers(k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar, ready, empty, ds_smem, dq_stage,
                  dq_ready, dq_empty, n0, n_q, n_k, lo, hi, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr,
                  kv_layout: gl.constexpr, p_layout: gl.constexpr, dq_layout: gl.constexpr):
    """The default partition, two warpgroups of 64 keys each: dK and dV of the key tile (returned,
    their products complete)."""
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offset = n_k - n_q
    mbarrier.wait(kv_bar, 0)
    dk, dv, it = _ws_query_loop(dk, dv, k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, ready, empty, ds_smem,
                                dq_stage, dq_ready, dq_empty, offs_n, n_k, offset, qk_scale, lo, hi, 0, HEAD_DIM,
                                BLOCK_M, BLOCK_N, STAGES, True, IS_CAUSAL, s_layout, p_layout, dq_layout)
    dk, dv, it = _ws_query_loop(dk, dv, k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, ready, empty, ds_smem,
                                dq_stage, dq_ready, dq_empty, offs_n, n_k, offset, qk_scale, hi, n_q, it, HEAD_DIM,
                                BLOCK_M, BLOCK_N, STAGES, False, IS_CAUSAL, s_layout, p_layout, dq_layout)
    dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
    return dk, dv


@gluon.jit(do_not_specialize=kernels._ORDER_ARGS)
def flash_bwd_atomic_ws_gluon_kernel(Q, K, V, dO, L2, Delta, dK, dV, DQ_ACC, n_q, n_k, head_group, qk_scale,
                                     sm_scale, HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr,
                                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Grid (key tiles x batch); num_warps = 8 (the consumers) and two worker warps. The atomic
    backward's kernel (five products, as kernels.flash_bwd_atomic_kernel, same arguments but the
    tiles), warp-specialised (FlashAttention-3's layout, notes entries 23 and 24): dK and dV, and
    dS K added into DQ_ACC (zeroed, with Delta and L2 = L log2(e) written, by
    kernels.flash_bwd_prep_kernel) through TMA reduce-adds, one per (key tile, query tile). In one
    partition the kernel spills at d = 128 (the dK, dV, S^T, dP^T and dQ accumulators alone are 224
    registers a thread at 128 keys, notes entry 21); here the worker warps run at 24 registers, so
    the consumers get 240, and the loads and the reduce-adds leave the consumers' instruction stream."""
    WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPS // 4],
                                                        instr_shape=[16, HEAD_DIM // (WARPS // 4), 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    tile_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dq_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    copy_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])  # the loader warp's cp.async
    dtype: gl.constexpr = Q.dtype.element_ty

    tile, bh = _program_tile(n_k, head_group, BLOCK_N, False)
    n0 = tile * BLOCK_N
    k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_ring, do_ring = _tile_operands(
        K, V, n_k, Q, dO, n_q, bh, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, tile_smem)
    dq_desc = _head_descriptor(DQ_ACC, bh, n_q, HEAD_DIM, BLOCK_M, dq_smem)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    d_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], tile_smem)
    dq_stage = gl.allocate_shared_memory(gl.float32, [_DQ_BUFFERS, BLOCK_M, HEAD_DIM], dq_smem)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [_DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [_DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1 + 32)  # the TMA's expect and each loader thread's cp.async
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(_DQ_BUFFERS):
        mbarrier.init(dq_ready.index(s), count=1)
        mbarrier.init(dq_empty.index(s), count=1)
    mbarrier.init(kv_bar, count=1)
    fence_async_shared()

    lo, hi = _masked_query_tiles(n0, n_q, n_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    L2_bh = L2 + bh * n_q  # L in base 2, written by the prep kernel
    D_bh = Delta + bh * n_q
    dk, dv = gl.warp_specialize([
        (_ws_consumers, (k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar, ready, empty, ds_smem, dq_stage,
                         dq_ready, dq_empty, n0, n_q, n_k, lo, hi, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                         IS_CAUSAL, s_layout, kv_layout, p_layout, dq_layout)),
        (_ws_loader, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar,
                      ready, empty, L2_bh, D_bh, n0, n_q, lo, hi, BLOCK_M, STAGES, copy_layout)),
        (_ws_dq_adder, (dq_desc, dq_stage, dq_ready, dq_empty, n_q, lo, hi, BLOCK_M)),
    ], [1, 1], [24, 24])
    _store_tile(dK, dk * sm_scale, bh, n0, n_k, HEAD_DIM, BLOCK_N, kv_layout)  # dK = dS^T Q * scale
    _store_tile(dV, dv, bh, n0, n_k, HEAD_DIM, BLOCK_N, kv_layout)


@gluon.jit
def _pp_query_loop(dk, dv, k_op, v_op, kt_op, q_ring, do_ring, l_ring, d_ring, ready, empty, ds_smem, ds_half, ds_free,
                   dq_stage, dq_ready, dq_empty, offs_n, n_k, offset, qk_scale, lo, hi, it, WG: gl.constexpr,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr):
    """Consumer WG's loop over query tiles [lo, hi) (``it`` counts tiles over the calls): the four
    products of _ws_query_loop on its own 64 keys, and on every other tile (t % 2 == WG) dQ's part
    over both consumers' keys, once the other consumer has put its half of dS^T in shared memory
    (``ds_half``): one product, dQ^T = K^T dS^T, where _ws_query_loop runs dS K as two of 32
    columns. k_op, v_op (this consumer's keys) and kt_op (K^T, all 128 keys) are register A
    operands, so each product reads only its B operand from shared memory. The
    other consumer waits only for a dS^T buffer to be free again (``ds_free``, two tiles on), so
    the two drift out of step and one's exponentials run under the other's products, where
    _ws_query_loop's two warpgroups meet at a barrier every tile.

    Every product is waited within its iteration: in a worker partition, a wgmma left in flight
    across the loop's back edge (as _ws_query_loop leaves dK's) made ptxas serialise every wgmma
    of the kernel (its C7512, "insufficient register resources"; 1.17x the time on the H100)."""
    n_iter = gl.cdiv(hi - lo, BLOCK_M)
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([_WG_ROWS, BLOCK_M], gl.float32, s_layout)
    for i in range(0, n_iter):
        start_m = lo + i * BLOCK_M
        t = it + i
        slot = t % STAGES
        b = t % 2  # the dS^T and dQ staging buffer, and the consumer that runs dQ's product
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        q_s = q_ring.index(slot)
        do_s = do_ring.index(slot)
        s_t = warpgroup_mma(k_op, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_op, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(1, deps=[s_t])
        s_t = _scaled_scores(s_t, qk_scale, offs_n, start_m + cols, offset, n_k, MASK, IS_CAUSAL)
        lse2 = l_ring.index(slot).load(gl.SliceLayout(0, s_layout))
        p_t = gl.exp2(s_t - lse2[None, :])  # P^T = exp(S - L) (eq. 13), both in base 2
        dv = warpgroup_mma(gl.convert_layout(p_t.to(q_s.dtype), p_layout), do_s, dv, is_async=True)  # eq. 14
        dp_t = warpgroup_mma_wait(1, deps=[dp_t])
        delta = d_ring.index(slot).load(gl.SliceLayout(0, s_layout))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q_s.dtype)  # dS^T = P^T o (dP^T - D) (eq. 16)
        ds_half_smem = ds_smem.index(b).slice(WG * _WG_ROWS, _WG_ROWS)
        if b == WG:
            ds_half_smem.store(ds_t)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.wait(ds_half.index(b), (t // 2) & 1)
            # dQ's part dS K (eq. 17), transposed: (d x queries), as dS^T is stored
            dq_t = warpgroup_mma(kt_op, ds_smem.index(b), gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, s_layout),
                                 use_acc=False, is_async=True)
            dq = gl.permute(warpgroup_mma_wait(0, deps=[dq_t]), (1, 0))  # (queries x d)
            mbarrier.arrive(ds_free.index(b), count=1)
            mbarrier.wait(dq_empty.index(b), ((t // 2) & 1) ^ 1)
            dq_stage.index(b).store(dq)
            fence_async_shared()  # the generic-proxy stores before the dQ warp's TMA reads them
            mbarrier.arrive(dq_ready.index(b), count=1)
        else:
            mbarrier.wait(ds_free.index(b), ((t // 2) & 1) ^ 1)  # tile t - 2's dQ product has read it
            ds_half_smem.store(ds_t)
            fence_async_shared()
            mbarrier.arrive(ds_half.index(b), count=1)
        dk = warpgroup_mma(gl.convert_layout(ds_t, p_layout), q_s, dk, is_async=True)  # dK += dS^T Q (eq. 18)
        dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
        mbarrier.arrive(empty.index(slot), count=1)  # dK and dV, the last readers of Q and dO, are done
        dk = warpgroup_mma_init(dk)
        dv = warpgroup_mma_init(dv)
    return dk, dv, it + n_iter


@gluon.jit
def _pp_consumer(k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar, ready, empty, ds_smem, ds_half, ds_free,
                 dq_stage, dq_ready, dq_empty, dK, dV, bh, n0, n_q, n_k, lo, hi, qk_scale, sm_scale, WG: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Consumer warpgroup WG: keys n0 + 64 WG ... of the key tile; their dK and dV stored."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    k_s = k_smem.slice(WG * _WG_ROWS, _WG_ROWS)
    v_s = v_smem.slice(WG * _WG_ROWS, _WG_ROWS)
    dk = warpgroup_mma_init(gl.zeros([_WG_ROWS, HEAD_DIM], gl.float32, kv_layout))
    dv = warpgroup_mma_init(gl.zeros([_WG_ROWS, HEAD_DIM], gl.float32, kv_layout))
    offs_n = n0 + WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    offset = n_k - n_q
    mbarrier.wait(kv_bar, 0)
    # A operands of the products accumulating in s_layout (S^T, dP^T, dQ^T: N = BLOCK_M), loaded once:
    # 16 + 16 + 32 registers a thread
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    k_op = k_s.load(a_layout)
    v_op = v_s.load(a_layout)
    kt_op = k_smem.permute((1, 0)).load(a_layout)  # (d x keys)
    dk, dv, it = _pp_query_loop(dk, dv, k_op, v_op, kt_op, q_ring, do_ring, l_ring, d_ring, ready, empty, ds_smem,
                                ds_half, ds_free, dq_stage, dq_ready, dq_empty, offs_n, n_k, offset, qk_scale, lo, hi,
                                0, WG, HEAD_DIM, BLOCK_M, STAGES, True, IS_CAUSAL, s_layout, p_layout)
    dk, dv, it = _pp_query_loop(dk, dv, k_op, v_op, kt_op, q_ring, do_ring, l_ring, d_ring, ready, empty, ds_smem,
                                ds_half, ds_free, dq_stage, dq_ready, dq_empty, offs_n, n_k, offset, qk_scale, hi,
                                n_q, it, WG, HEAD_DIM, BLOCK_M, STAGES, False, IS_CAUSAL, s_layout, p_layout)
    dk, dv = warpgroup_mma_wait(0, deps=[dk, dv])
    row0 = n0 + WG * _WG_ROWS
    _store_tile(dK, dk * sm_scale, bh, row0, n_k, HEAD_DIM, _WG_ROWS, kv_layout)  # dK = dS^T Q * scale
    _store_tile(dV, dv, bh, row0, n_k, HEAD_DIM, _WG_ROWS, kv_layout)


@gluon.jit(do_not_specialize=kernels._ORDER_ARGS)
def flash_bwd_atomic_pp_gluon_kernel(Q, K, V, dO, L2, Delta, dK, dV, DQ_ACC, n_q, n_k, head_group, qk_scale,
                                     sm_scale, HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr,
                                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """flash_bwd_atomic_ws_gluon_kernel (same arguments and outputs) with its two consumer
    warpgroups as two partitions of 64 keys each, which take turns running dQ's product over both
    (_pp_query_loop) and store their own dK and dV; num_warps = 4 (consumer 0), a worker warpgroup
    (consumer 1, 240 registers) and the loader and dQ warps (24). At d = 64 only: at d = 128 one
    consumer's dK, dV, S^T, dP^T and dQ accumulators would need more than 240 registers."""
    gl.static_assert(BLOCK_N == 2 * _WG_ROWS, "two consumer warpgroups of 64 keys")
    gl.static_assert(HEAD_DIM == _WG_ROWS, "dQ^T's rows are the head dim, one warpgroup's 64")
    # tile t's dS^T and dQ staging buffer is t % 2, the same index as the consumer running its dQ
    # product, and the dQ warp (_ws_dq_adder) cycles through _DQ_BUFFERS of them
    gl.static_assert(_DQ_BUFFERS == 2, "one dQ staging buffer per consumer")
    tile_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dq_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    dtype: gl.constexpr = Q.dtype.element_ty

    tile, bh = _program_tile(n_k, head_group, BLOCK_N, False)
    n0 = tile * BLOCK_N
    k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_ring, do_ring = _tile_operands(
        K, V, n_k, Q, dO, n_q, bh, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, tile_smem)
    dq_desc = _head_descriptor(DQ_ACC, bh, n_q, HEAD_DIM, BLOCK_M, dq_smem)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    d_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], tile_smem)
    dq_stage = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_smem)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_half = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1 + 32)  # the TMA's expect and each loader thread's cp.async
        mbarrier.init(empty.index(s), count=2)  # both consumers release a slot
    for s in gl.static_range(2):
        mbarrier.init(ds_half.index(s), count=1)
        mbarrier.init(ds_free.index(s), count=1)
        mbarrier.init(dq_ready.index(s), count=1)
        mbarrier.init(dq_empty.index(s), count=1)
    mbarrier.init(kv_bar, count=1)
    fence_async_shared()

    lo, hi = _masked_query_tiles(n0, n_q, n_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    L2_bh = L2 + bh * n_q  # L in base 2, written by the prep kernel
    D_bh = Delta + bh * n_q
    copy_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])  # the loader warp's cp.async
    # (the consumers' arguments are written out twice: in a tuple variable the block sizes would not
    # stay constexpr)
    gl.warp_specialize([
        (_pp_consumer, (k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar, ready, empty, ds_smem, ds_half,
                        ds_free, dq_stage, dq_ready, dq_empty, dK, dV, bh, n0, n_q, n_k, lo, hi, qk_scale, sm_scale,
                        0, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL)),
        (_pp_consumer, (k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar, ready, empty, ds_smem, ds_half,
                        ds_free, dq_stage, dq_ready, dq_empty, dK, dV, bh, n0, n_q, n_k, lo, hi, qk_scale, sm_scale,
                        1, HEAD_DIM, BLOCK_M, STAGES, IS_CAUSAL)),
        (_ws_loader, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_ring, do_ring, l_ring, d_ring, kv_bar,
                      ready, empty, L2_bh, D_bh, n0, n_q, lo, hi, BLOCK_M, STAGES, copy_layout)),
        (_ws_dq_adder, (dq_desc, dq_stage, dq_ready, dq_empty, n_q, lo, hi, BLOCK_M)),
    ], [4, 1, 1], [240, 24, 24])


# ----------------------------------------------------------------------------- dQ


@gluon.jit
def _issue_key_tile(k_desc, v_desc, k_ring, v_ring, bars, slot, row0):
    """Start loading key tile ``row0``'s K and V (TMA; rows past n_k read as zeros) into ring slot
    ``slot``; its barrier completes when both have landed."""
    bar = bars.index(slot)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0, 0], bar, k_ring.index(slot))
    tma.async_copy_global_to_shared(v_desc, [row0, 0], bar, v_ring.index(slot))


@gluon.jit
def _dq_key_loop(dq, q_op, do_op, lse2, delta, k_desc, v_desc, k_ring, v_ring, bars, offs_m, n_k, offset, qk_scale,
                 lo, hi, it, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr, ds_layout: gl.constexpr):
    """Accumulate dQ (a wgmma accumulator, in flight) of one query tile over key tiles [lo, hi), as
    kernels._dq_key_loop does. ``it`` counts the tiles through the ring over the calls. Per key
    tile, with the wgmma groups in flight oldest first:

        issue S = Q K^T and dP = dO V^T          in flight: dQ (last tile), S, dP
        wait until one is left                    S done (and the last tile's dQ)
        P = exp2(S - L)                           dP runs under the exponentials
        wait for dP; dS = P o (dP - D); issue dQ += dS K    dQ runs under the next tile's issue

    Every product has completed on return."""
    n_iter = gl.cdiv(hi - lo, BLOCK_N)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for i in gl.static_range(STAGES - 1):
        if i < n_iter:
            _issue_key_tile(k_desc, v_desc, k_ring, v_ring, bars, (it + i) % STAGES, lo + i * BLOCK_N)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    for i in range(0, n_iter):
        start_n = lo + i * BLOCK_N
        slot = (it + i) % STAGES
        mbarrier.wait(bars.index(slot), ((it + i) // STAGES) & 1)
        k_s = k_ring.index(slot)
        s = warpgroup_mma(q_op, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_op, v_ring.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s, dq = warpgroup_mma_wait(1, deps=[s, dq])
        # the last tile's products are done with its slot: refill it STAGES - 1 tiles ahead
        if i + STAGES - 1 < n_iter:
            _issue_key_tile(k_desc, v_desc, k_ring, v_ring, bars, (it + i + STAGES - 1) % STAGES,
                            start_n + (STAGES - 1) * BLOCK_N)
        s = s * qk_scale  # base-2 scores
        if MASK:
            keys = start_n + cols
            keep = keys[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (keys[None, :] <= offs_m[:, None] + offset)
            s = gl.where(keep, s, _MASKED)
        p = gl.exp2(s - lse2[:, None])  # P = exp(S - L) (eq. 13)
        dp = warpgroup_mma_wait(0, deps=[dp])
        ds = p * (dp - delta[:, None])  # dS = P o (dP - D) (eq. 16)
        dq = warpgroup_mma(gl.convert_layout(ds.to(k_s.dtype), ds_layout), k_s, dq, is_async=True)  # eq. 17
    dq = warpgroup_mma_wait(0, deps=[dq])
    return warpgroup_mma_init(dq), it + n_iter


@gluon.jit(do_not_specialize=kernels._ORDER_ARGS)
def flash_bwd_dq_gluon_kernel(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, head_group, qk_scale, sm_scale,
                              HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Grid (query tiles x batch, in _program_tile's order); BLOCK_M / 16 warps (a warpgroup per 64
    query rows). One program owns dQ of one query tile and, first, writes D = rowsum(O o dO) of its
    rows for the dK/dV kernel, as kernels._dq_program does; it reads and writes the same tensors.
    Q and dO are wgmma's A operand from registers (loaded once); K and V stream through TMA into a
    ring of STAGES buffers."""
    WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])  # 16-byte row chunks
    tile_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    tile, bh = _program_tile(n_q, head_group, BLOCK_M, IS_CAUSAL)
    m0 = tile * BLOCK_M
    q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_ring, v_ring = _tile_operands(
        Q, dO, n_q, K, V, n_k, bh, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, tile_smem)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    mbarrier.init(q_bar, count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem)  # rows past n_q read as zeros
    tma.async_copy_global_to_shared(do_desc, [m0, 0], q_bar, do_smem)

    # D = rowsum(O o dO) (the handout's eq. 19 helper), while Q and dO land
    offs_r = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))
    offs_c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
    row_offs = bh * n_q * HEAD_DIM + offs_r[:, None] * HEAD_DIM + offs_c[None, :]
    o = gl.load(O + row_offs, mask=offs_r[:, None] < n_q, other=0.0)
    do_rows = gl.load(dO + row_offs, mask=offs_r[:, None] < n_q, other=0.0)
    delta_rows = gl.sum(o.to(gl.float32) * do_rows.to(gl.float32), 1)
    gl.store(Delta + bh * n_q + offs_r, delta_rows, mask=offs_r < n_q)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    delta = gl.convert_layout(delta_rows, gl.SliceLayout(1, s_layout))
    lse2 = gl.load(L + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0) * _LOG2E
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout))
    mbarrier.wait(q_bar, 0)
    q_op = q_smem.load(a_layout)
    do_op = do_smem.load(a_layout)

    offset = n_k - n_q
    hi_unmasked, hi = _key_bounds(m0, n_k, offset, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # First, masked, the key tiles from the diagonal (causal) or the last key tile on (at least one
    # tile), then, unmasked, the rest: the loop over many tiles then starts from an accumulator that
    # went through a completed wait, as the dK/dV kernel's must (its comment: measured on the H100)
    split = gl.minimum(hi_unmasked, ((hi - 1) // BLOCK_N) * BLOCK_N)
    dq, it = _dq_key_loop(dq, q_op, do_op, lse2, delta, k_desc, v_desc, k_ring, v_ring, bars, offs_m, n_k, offset,
                          qk_scale, split, hi, 0, BLOCK_M, BLOCK_N, STAGES, True, IS_CAUSAL, s_layout, ds_layout)
    dq, it = _dq_key_loop(dq, q_op, do_op, lse2, delta, k_desc, v_desc, k_ring, v_ring, bars, offs_m, n_k, offset,
                          qk_scale, 0, split, it, BLOCK_M, BLOCK_N, STAGES, False, IS_CAUSAL, s_layout, ds_layout)
    dq = warpgroup_mma_wait(0, deps=[dq])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    mbarrier.invalidate(q_bar)

    _store_tile(dQ, dq * sm_scale, bh, m0, n_q, HEAD_DIM, BLOCK_M, dq_layout)  # dQ = dS K * scale



# ----------------------------------------------------------------------------- forward, warp-specialised



@gluon.jit
def _to_16bit_pairs(x, dtype: gl.constexpr):
    """x (fp32) as ``dtype`` (bf16 or fp16), converted two elements at a time by one cvt.rn.*x2.f32.
    Why not ``x.to(dtype)``: its PTX (a cvt per element, then a mov packing each pair) becomes, in
    ptxas for sm_90a, one F2FP packing the pair with its halves swapped and a PRMT swapping them
    back: 32 of the d = 64 forward's 424 instructions a key tile, on the path from the exponentials
    to O's product; without them the forward took 0.95-0.97x the time at d = 64 and 0.97-0.99x at
    d = 128 on one H100, with bit-identical outputs (notes entry 28)."""
    CVT: gl.constexpr = "cvt.rn.bf16x2.f32 $0, $2, $1;" if dtype == gl.bfloat16 else "cvt.rn.f16x2.f32 $0, $2, $1;"
    return gl.inline_asm_elementwise(CVT, "=r,r,r", [x], dtype=dtype.value, is_pure=True, pack=2)


@gluon.jit
def _softmax_tile(qk, m_i, l_i, qk_scale, keys, rows, n_k, offset, MASK: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """One key tile's online-softmax step on the raw scores qk (rows x keys): P (fp32, base 2), the
    new row max, alpha (what rescales the sums and O accumulated under the old max) and the new row
    sums, as kernels._fwd_key_loop. MASK: the causal mask (IS_CAUSAL) and the key bound; unmasked,
    the max is taken over the raw scores and scaled once (one fused multiply-add a score)."""
    if MASK:
        s = qk * qk_scale
        keep = keys[None, :] < n_k
        if IS_CAUSAL:
            keep = keep & (keys[None, :] <= rows[:, None] + offset)
        s = gl.where(keep, s, _MASKED)
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _fwd_key_loop(acc, p_op, m_i, l_i, q_s, k_ring, v_ring, ready, empty, turn, rows, n_k, offset, qk_scale,
                  lo, hi, WG: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  p_layout: gl.constexpr):
    """Key tiles lo..hi-1 (indices; tile 0 ran before): on this warpgroup's turn, issue S_j and
    O += P_{j-1} V_{j-1} and hand the turn to the next (round robin); S_j's softmax runs under O's
    product and the other warpgroups', then O is rescaled and tile j-1's ring slot released. Returns O without
    P_j V_j (the caller adds the last tile's)."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([_WG_ROWS, BLOCK_N], gl.float32, s_layout)
    for j in range(lo, hi):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        # in turn, consumer 0 first (a fresh barrier passes parity 1)
        mbarrier.wait(turn.index(WG), (j + (1 if WG == 0 else 0)) & 1)
        qk = warpgroup_mma(q_s, k_ring.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
        mbarrier.arrive(turn.index((WG + 1) % CONSUMERS), count=1)
        qk = warpgroup_mma_wait(1, deps=[qk])
        p, m_i, alpha, l_i = _softmax_tile(qk, m_i, l_i, qk_scale, j * BLOCK_N + cols, rows, n_k, offset, MASK,
                                           IS_CAUSAL)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(_to_16bit_pairs(p, q_s.dtype), p_layout)
    return acc, p_op, m_i, l_i


@gluon.jit
def _fwd_key_tiles(m0, n_q, n_k, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key tiles of the query tile at row m0: how many every row sees in full (kernels._key_bounds)
    and how many any row sees; at least one, which runs masked when no row sees a key."""
    hi_unmasked, hi = _key_bounds(m0, n_k, n_k - n_q, BLOCK_M, BLOCK_N, IS_CAUSAL)
    return hi_unmasked // BLOCK_N, gl.maximum(gl.cdiv(hi, BLOCK_N), 1)


@gluon.jit
def _fwd_consumer(q_smem, k_ring, v_ring, q_bar, ready, empty, turn, O, L, bh, m0, n_q, n_k, qk_scale,
                  WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Consumer warpgroup ``WG``: rows m0 + 64 WG ... against every key tile the program visits, then
    their O and L (natural-log logsumexp of the scaled scores) stored."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    offset = n_k - n_q
    n_unmasked, n_tiles = _fwd_key_tiles(m0, n_q, n_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    first_masked = gl.maximum(n_unmasked, 1)
    CONSUMERS: gl.constexpr = BLOCK_M // _WG_ROWS
    rows = m0 + WG * _WG_ROWS + gl.arange(0, _WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    q_s = q_smem.index(WG)
    mbarrier.wait(q_bar, 0)
    # key tile 0 on its own (masked: harmless where no mask is needed): S_0 and its softmax
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(turn.index(WG), 1 if WG == 0 else 0)
    qk = warpgroup_mma(q_s, k_ring.index(0).permute((1, 0)), gl.zeros([_WG_ROWS, BLOCK_N], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    mbarrier.arrive(turn.index((WG + 1) % CONSUMERS), count=1)
    qk = warpgroup_mma_wait(0, deps=[qk])
    m_i = gl.full([_WG_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([_WG_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    p, m_i, alpha, l_i = _softmax_tile(qk, m_i, l_i, qk_scale, keys, rows, n_k, offset, True, IS_CAUSAL)
    p_op = gl.convert_layout(_to_16bit_pairs(p, q_s.dtype), p_layout)
    acc = gl.zeros([_WG_ROWS, HEAD_DIM], gl.float32, o_layout)
    acc, p_op, m_i, l_i = _fwd_key_loop(acc, p_op, m_i, l_i, q_s, k_ring, v_ring, ready, empty, turn, rows, n_k,
                                        offset, qk_scale, 1, first_masked, WG, CONSUMERS, BLOCK_N, STAGES, False,
                                        IS_CAUSAL, s_layout, o_layout, p_layout)
    acc, p_op, m_i, l_i = _fwd_key_loop(acc, p_op, m_i, l_i, q_s, k_ring, v_ring, ready, empty, turn, rows, n_k,
                                        offset, qk_scale, first_masked, n_tiles, WG, CONSUMERS, BLOCK_N, STAGES, True,
                                        IS_CAUSAL, s_layout, o_layout, p_layout)
    last = (n_tiles - 1) % STAGES
    acc = warpgroup_mma(p_op, v_ring.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index(last), count=1)

    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    _store_tile(O, o, bh, m0 + WG * _WG_ROWS, n_q, HEAD_DIM, _WG_ROWS, o_layout)
    gl.store(L + bh * n_q + rows, (m_i + gl.log2(l_i)) * _LN2, mask=rows < n_q)


@gluon.jit
def _fwd_loader(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, m0, n_q, n_k,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """The loader warp: every consumer's Q tile once, then each visited key tile's K and V (TMA;
    rows past n_k read as zeros) into the ring slot all consumers released (``empty``)."""
    mbarrier.expect(q_bar, (BLOCK_M // _WG_ROWS) * q_desc.block_type.nbytes)
    for w in gl.static_range(BLOCK_M // _WG_ROWS):  # rows past n_q read as zeros
        tma.async_copy_global_to_shared(q_desc, [m0 + w * _WG_ROWS, 0], q_bar, q_smem.index(w))
    _, n_tiles = _fwd_key_tiles(m0, n_q, n_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for j in range(n_tiles):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        _issue_key_tile(k_desc, v_desc, k_ring, v_ring, ready, slot, j * BLOCK_N)


@gluon.jit(do_not_specialize=kernels._ORDER_ARGS)
def flash_fwd_ws_gluon_kernel(Q, K, V, O, L, n_q, n_k, head_group, qk_scale, HEAD_DIM: gl.constexpr,
                              IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              STAGES: gl.constexpr):
    """Grid (query tiles of BLOCK_M = 128 or 192 x batch, in _program_tile's order); num_warps = 4
    (consumer 0), one worker warpgroup per further 64 rows (at 240 registers for two consumers, 160
    for three) and a loader warp (24). The forward of kernels.flash_fwd_tma_kernel (same arguments but SEQ_BUCKET and the tiles): O and L."""
    gl.static_assert(BLOCK_M == 2 * _WG_ROWS or BLOCK_M == 3 * _WG_ROWS, "two or three consumer warpgroups")
    CONSUMERS: gl.constexpr = BLOCK_M // _WG_ROWS
    tile_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    dtype: gl.constexpr = Q.dtype.element_ty
    tile, bh = _program_tile(n_q, head_group, BLOCK_M, IS_CAUSAL)
    m0 = tile * BLOCK_M
    q_desc = _head_descriptor(Q, bh, n_q, HEAD_DIM, _WG_ROWS, tile_smem)
    k_desc = _head_descriptor(K, bh, n_k, HEAD_DIM, BLOCK_N, tile_smem)
    v_desc = _head_descriptor(V, bh, n_k, HEAD_DIM, BLOCK_N, tile_smem)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, _WG_ROWS, HEAD_DIM], tile_smem)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_smem)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_smem)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())  # whose turn to issue
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)  # every consumer releases a slot
    for s in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(s), count=1)
    fence_async_shared()
    # (the partitions' arguments are written out each time: in a tuple variable the block sizes would
    # not stay constexpr). Two consumers at 240 registers; three (d = 64) at 160, consumer 0 at 168.
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_fwd_consumer, (q_smem, k_ring, v_ring, q_bar, ready, empty, turn, O, L, bh, m0, n_q, n_k, qk_scale, 0,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL)),
            (_fwd_consumer, (q_smem, k_ring, v_ring, q_bar, ready, empty, turn, O, L, bh, m0, n_q, n_k, qk_scale, 1,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL)),
            (_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, m0, n_q, n_k, BLOCK_M,
                           BLOCK_N, STAGES, IS_CAUSAL)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_fwd_consumer, (q_smem, k_ring, v_ring, q_bar, ready, empty, turn, O, L, bh, m0, n_q, n_k, qk_scale, 0,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL)),
            (_fwd_consumer, (q_smem, k_ring, v_ring, q_bar, ready, empty, turn, O, L, bh, m0, n_q, n_k, qk_scale, 1,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL)),
            (_fwd_consumer, (q_smem, k_ring, v_ring, q_bar, ready, empty, turn, O, L, bh, m0, n_q, n_k, qk_scale, 2,
                             HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL)),
            (_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, m0, n_q, n_k, BLOCK_M,
                           BLOCK_N, STAGES, IS_CAUSAL)),
        ], [4, 4, 1], [160, 160, 24])
