"""The FlashAttention-2 kernels: the @triton.jit helpers, the program bodies, and the kernels as plain
jit functions (tuning.py wraps them in autotuners, launch.py launches them).

What makes them fast:
- softmax in base 2: log2(e) is folded into the score scale so the inner loops call exp2;
  the saved L is converted back to the natural-log logsumexp the handout asks for.
- causal attention skips every key tile above the diagonal, and splits the rest into an
  unmasked loop (off-diagonal tiles, no mask arithmetic, no bounds checks) and a short
  masked loop over the tiles that touch the diagonal or the ragged end of the sequence.
- causal tiles are launched longest-first so the last wave is made of short programs: within each
  (batch, head), or over groups of heads (_program_tile; launch.head_group picks the group).
- two backwards: the "split" pair, a dQ kernel that walks key tiles for one query tile, then a
  dK/dV kernel that walks query tiles for one key tile (no atomics, but both recompute S and dP:
  seven matmuls); and one "atomic" kernel over key tiles that also adds each query tile's dS K
  into an fp32 dQ buffer with atomics (five matmuls), between a small kernel that writes D and
  zeroes that buffer and a cast of it.
- each of the forward, dQ and dK/dV program bodies takes a TMA constexpr, behind two kernels
  (pointer and TMA twins): with it, the tiles streamed through the inner loops (K, V in the
  forward and dQ; Q, dO in dK/dV) are read through device-side tensor descriptors (Hopper's TMA
  engine; out-of-range rows and columns read as zeros).

Causal convention (the same as ``naive_attention`` and ``flash_pytorch``): query i sees keys
j <= i + (n_keys - n_queries); causal with n_queries > n_keys is rejected.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are scaled by sm_scale * log2(e) so the kernels can use exp2
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)
_MASKED = tl.constexpr(-1e6)  # the handout's masked score (in base-2 units here; exp2 of it is 0)
# The launch order's argument changes with the batch but not the code: compiled once, not again
# for a group of one head or a multiple of 16 (what Triton specialises an int on by default)
_ORDER_ARGS = ["head_group"]


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; masks only what can be out of range (all compile-time)."""
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _load_tile(src, row0, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """A (rows, BLOCK_D) tile starting at row0: through a tensor descriptor (TMA, which zero-fills
    rows past n_rows and columns past HEAD_DIM by itself), or as _load_rows from a base pointer."""
    if TMA:
        x = src.load([row0, 0])
    else:
        x = _load_rows(src + rows[:, None] * HEAD_DIM + offs_d[None, :], rows, n_rows, offs_d, HEAD_DIM, BLOCK_D,
                       CHECK_ROWS)
    return x


@triton.jit
def _streamed(base, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
              TMA: tl.constexpr):
    """What an inner loop reads one (batch, head)'s (n_rows, d) operand through, for _load_tile: a
    tensor descriptor of it (TMA; rows past n_rows read as zeros), or its base pointer."""
    if TMA:
        src = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                        block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def _key_bounds(m0, n_k, offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """For the query tile starting at row m0: where the key tiles every row sees in full end (the
    unmasked loop runs up to there), and where the keys any row sees end (the masked loop runs
    from the first to the second: the diagonal tiles and the ragged end)."""
    n_k_full = (n_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi_unmasked = tl.minimum(((m0 + offset + 1) // BLOCK_N) * BLOCK_N, n_k_full)
        hi = tl.minimum(m0 + BLOCK_M + offset, n_k)
    else:
        hi_unmasked = n_k_full
        hi = n_k
    return hi_unmasked, hi


@triton.jit
def _diagonal_query_tiles(n0, offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Causal, for the key tile starting at row n0: the query tiles [lo, hi) that see part of it
    (its diagonal; they need the mask). Query tiles from hi on see all of it."""
    lo = (tl.maximum(n0 - offset, 0) // BLOCK_M) * BLOCK_M
    last_partial = tl.maximum(n0 + BLOCK_N - 1 - offset, 0)
    hi = ((last_partial + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    return lo, hi


@triton.jit
def _program_tile(n_rows, head_group, BLOCK: tl.constexpr, LONGEST_LAST: tl.constexpr):
    """(tile, (batch, head)) of this program, in a one-dimensional grid of one program per BLOCK
    rows of n_rows and per (batch, head), launched longest tile first: with LONGEST_LAST (causal
    query tiles: the last sees the most keys) the tile order is reversed, else tile 0 is the
    longest (causal key tiles) or all are equal.

    Programs launch in grid order. The heads go in groups of head_group (the last may be
    smaller); within a group the tile rank varies slowest, so each of its heads' longest tiles
    launches before any of their second longest. head_group = 1 is longest-first within each head
    only: the last head's long tiles then start late and run past everyone else's short ones (the
    kernel's tail). All heads in one group is longest-first over the whole launch, but its
    programs then stream every head's K and V (or Q and dO) at once, which can overflow L2
    (launch.head_group picks between the two; notes entry 14)."""
    n_tiles = tl.cdiv(n_rows, BLOCK)
    n_bh = tl.num_programs(0) // n_tiles
    pid = tl.program_id(0)
    per_group = head_group * n_tiles
    group = pid // per_group
    first = group * head_group
    size = tl.minimum(head_group, n_bh - first)
    within = pid - group * per_group
    rank = within // size
    bh = first + within % size
    tile = rank
    if LONGEST_LAST:
        tile = n_tiles - 1 - rank
    return tile, bh.to(tl.int64)


@triton.jit
def _store_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _atomic_add_rows(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     CHECK_ROWS: tl.constexpr):
    """Add a (rows, BLOCK_D) fp32 tile into global memory with atomics, masked as _load_rows.

    relaxed: the adds only have to be atomic, not ordered against other memory operations (the
    buffer is read by the next launch), and acq_rel would fence around every one of them."""
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tl.atomic_add(ptrs, x, mask=rows[:, None] < n_rows, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    else:
        if HEAD_DIM == BLOCK_D:
            tl.atomic_add(ptrs, x, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=offs_d[None, :] < HEAD_DIM, sem="relaxed")

# ----------------------------------------------------------------------------- forward

@triton.jit
def _fwd_key_loop(acc, m_i, l_i, q, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, lo, hi,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                  FMA_SOFTMAX: tl.constexpr, WS: tl.constexpr):
    """Online softmax over key tiles [lo, hi). MASK=False is the hot off-diagonal loop.
    K_src, V_src: the (batch, head)'s base pointers, or its tensor descriptors when TMA.

    FMA_SOFTMAX (unmasked loop only): the row max is taken over the raw scores and scaled once, so
    the scale and the max's subtraction become one fused multiply-add per score instead of a
    multiply and a subtraction (qk_scale > 0, so max(x) * scale = max(x * scale) exactly).
    WS: Triton's warp specialisation of the loop (producer warps issue the TMA loads)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        keys = start_n + offs_n
        k = _load_tile(K_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if MASK or not FMA_SOFTMAX:
            s = qk * qk_scale  # base-2 scores
            if MASK:
                keep = keys[None, :] < n_k
                if IS_CAUSAL:
                    keep = keep & (keys[None, :] <= offs_m[:, None] + offset)
                s = tl.where(keep, s, _MASKED)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_program(Q, K, V, O, L, n_q, n_k, head_group, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, TMA: tl.constexpr, FMA_SOFTMAX: tl.constexpr, WS: tl.constexpr):
    """Grid (query tiles x batch, in _program_tile's order). One program: one query tile against
    all (visible) key tiles. TMA: K and V stream through tensor descriptors (Q and O, touched
    once, stay pointer accesses)."""
    tile, bh = _program_tile(n_q, head_group, BLOCK_M, IS_CAUSAL)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + bh * n_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                   offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    K_src = _streamed(K + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    V_src = _streamed(V + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    offset = n_k - n_q
    hi_unmasked, hi = _key_bounds(m0, n_k, offset, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, m_i, l_i = _fwd_key_loop(acc, m_i, l_i, q, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale,
                                  0, hi_unmasked, BLOCK_N, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, INPUT_PRECISION, TMA,
                                  FMA_SOFTMAX, WS)
    acc, m_i, l_i = _fwd_key_loop(acc, m_i, l_i, q, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale,
                                  hi_unmasked, hi,
                                  BLOCK_N, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, INPUT_PRECISION, TMA, False, False)

    o = acc / l_i[:, None]
    _store_rows(O + bh * n_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                o.to(O.dtype.element_ty), offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # natural-log logsumexp of the (scaled) scores
    tl.store(L + bh * n_q + offs_m, lse, mask=offs_m < n_q)


# Each program body is one @triton.jit function behind two kernels, pointer and TMA: two kernels give
# two autotuners (tuning.py) with their own config lists and their own plans (launch.py).
@triton.jit(do_not_specialize=_ORDER_ARGS)
def flash_fwd_kernel(Q, K, V, O, L, n_q, n_k, head_group, qk_scale, SEQ_BUCKET,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      FMA_SOFTMAX: tl.constexpr):
    _fwd_program(Q, K, V, O, L, n_q, n_k, head_group, qk_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL, INPUT_PRECISION,
                 BLOCK_M, BLOCK_N, False, FMA_SOFTMAX, False)


@triton.jit(do_not_specialize=_ORDER_ARGS)
def flash_fwd_tma_kernel(Q, K, V, O, L, n_q, n_k, head_group, qk_scale, SEQ_BUCKET,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                          INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          FMA_SOFTMAX: tl.constexpr, WS: tl.constexpr):
    _fwd_program(Q, K, V, O, L, n_q, n_k, head_group, qk_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL, INPUT_PRECISION,
                 BLOCK_M, BLOCK_N, True, FMA_SOFTMAX, WS)

# ----------------------------------------------------------------------------- backward: dK/dV of the split pair

@triton.jit
def _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale, lo, hi,
                     BLOCK_M1: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     CAUSAL_MASK: tl.constexpr, CHECK_ROWS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     TMA: tl.constexpr, EARLY_DP: tl.constexpr, WS: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), in transposed form (keys x queries).

    Query rows past n_q load as zeros (Q, dO, L, D), so their P is finite and their
    contribution to dV = P^T dO and dK = dS^T Q is exactly zero: no score mask is needed for them.
    Q_src, dO_src: base pointers, or tensor descriptors when TMA.
    EARLY_DP: dP^T's product is issued right after S^T's, so the tensor cores run it while the
    threads compute P^T (the exponentials), instead of after dV's product. WS: as _fwd_key_loop.
    """
    offs_mb = tl.arange(0, BLOCK_M1)
    for start_m in tl.range(lo, hi, BLOCK_M1, warp_specialize=WS):
        rows = start_m + offs_mb
        q = _load_tile(Q_src, start_m, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS, TMA)
        do = _load_tile(dO_src, start_m, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS, TMA)
        if CHECK_ROWS:
            lse = tl.load(L_bh + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(D_bh + rows, mask=rows < n_q, other=0.0)
        else:
            lse = tl.load(L_bh + rows)
            delta = tl.load(D_bh + rows)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale  # S^T in base 2
        if EARLY_DP:
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # dP^T = V dO^T (eq. 15)
        if CAUSAL_MASK:
            s_t = tl.where(offs_n[:, None] <= rows[None, :] + offset, s_t, _MASKED)
        p_t = tl.math.exp2(s_t - lse[None, :] * _LOG2E)  # P^T = exp(S - L) (eq. 13)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)  # dV += P^T dO (eq. 14)
        if not EARLY_DP:
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T = P^T o (dP^T - D) (eq. 16)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)  # dK += dS^T Q (eq. 18)
    return dk, dv


@triton.jit
def _dkdv_program(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, head_group, qk_scale, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, TMA: tl.constexpr,
                  EARLY_DP: tl.constexpr, WS: tl.constexpr):
    """Grid (key tiles x batch, in _program_tile's order). One program owns dK and dV
    of one key tile: no atomics.
    Runs after the dQ kernel, which wrote Delta. TMA: Q and dO stream through tensor descriptors."""
    tile, bh = _program_tile(n_k, head_group, BLOCK_N1, False)
    n0 = tile * BLOCK_N1
    offs_n = n0 + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, BLOCK_D)
    kv_tile = bh * n_k * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = _load_rows(K + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    Q_src = _streamed(Q + bh * n_q * HEAD_DIM, n_q, HEAD_DIM, BLOCK_M1, BLOCK_D, TMA)
    dO_src = _streamed(dO + bh * n_q * HEAD_DIM, n_q, HEAD_DIM, BLOCK_M1, BLOCK_D, TMA)
    L_bh = L + bh * n_q
    D_bh = Delta + bh * n_q

    offset = n_k - n_q
    n_q_full = (n_q // BLOCK_M1) * BLOCK_M1
    if IS_CAUSAL:
        # query tiles that see part of this key tile (the diagonal), masked ...
        lo_diag, hi_diag = _diagonal_query_tiles(n0, offset, BLOCK_M1, BLOCK_N1)
        dk, dv = _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale,
                                  lo_diag, tl.minimum(hi_diag, n_q),
                                  BLOCK_M1, HEAD_DIM, BLOCK_D, True, True, INPUT_PRECISION, TMA, EARLY_DP, False)
    else:
        hi_diag = 0
    # ... then the query tiles that see all of it: unmasked, unchecked; then a ragged tail
    dk, dv = _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale,
                              hi_diag, n_q_full,
                              BLOCK_M1, HEAD_DIM, BLOCK_D, False, False, INPUT_PRECISION, TMA, EARLY_DP, WS)
    dk, dv = _dkdv_query_loop(dk, dv, k, v, Q_src, dO_src, L_bh, D_bh, offs_n, offs_d, n_q, offset, qk_scale,
                              tl.maximum(hi_diag, n_q_full), n_q,
                              BLOCK_M1, HEAD_DIM, BLOCK_D, False, True, INPUT_PRECISION, TMA, EARLY_DP, False)

    dk = dk * sm_scale  # S = Q K^T * scale, so dK = dS^T Q * scale
    _store_rows(dK + kv_tile, dk.to(dK.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(dV + kv_tile, dv.to(dV.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=_ORDER_ARGS)
def flash_bwd_dkdv_kernel(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, head_group, qk_scale, sm_scale, SEQ_BUCKET,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                           INPUT_PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                           EARLY_DP: tl.constexpr):
    _dkdv_program(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, head_group, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                  INPUT_PRECISION, BLOCK_M1, BLOCK_N1, False, EARLY_DP, False)


@triton.jit(do_not_specialize=_ORDER_ARGS)
def flash_bwd_dkdv_tma_kernel(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, head_group, qk_scale, sm_scale, SEQ_BUCKET,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                               INPUT_PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                               EARLY_DP: tl.constexpr, WS: tl.constexpr):
    _dkdv_program(Q, K, V, dO, L, Delta, dK, dV, n_q, n_k, head_group, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                  INPUT_PRECISION, BLOCK_M1, BLOCK_N1, True, EARLY_DP, WS)

# ----------------------------------------------------------------------------- backward: dQ of the split pair

@triton.jit
def _dq_key_loop(dq, q, do, lse2, delta, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, lo, hi,
                 BLOCK_N2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                 EARLY_DP: tl.constexpr, WS: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi). K_src, V_src: pointers or descriptors.
    EARLY_DP, WS: as _dkdv_query_loop."""
    offs_nb = tl.arange(0, BLOCK_N2)
    for start_n in tl.range(lo, hi, BLOCK_N2, warp_specialize=WS):
        keys = start_n + offs_nb
        k = _load_tile(K_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        v = _load_tile(V_src, start_n, keys, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if EARLY_DP:
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        if MASK:
            keep = keys[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (keys[None, :] <= offs_m[:, None] + offset)
            s = tl.where(keep, s, _MASKED)
        p = tl.math.exp2(s - lse2[:, None])
        if not EARLY_DP:
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)  # dQ += dS K (eq. 17)
    return dq


@triton.jit
def _dq_program(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, head_group, qk_scale, sm_scale,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, TMA: tl.constexpr,
                EARLY_DP: tl.constexpr, WS: tl.constexpr):
    """Grid (query tiles x batch, in _program_tile's order). One program owns dQ of
    one query tile: no atomics.
    TMA: K and V stream through tensor descriptors.

    Its prologue computes D = rowsum(O * dO) (handout eq. 19's helper) for its rows and stores it
    for the dK/dV kernel, which runs next: one launch fewer than a separate D kernel."""
    tile, bh = _program_tile(n_q, head_group, BLOCK_M2, IS_CAUSAL)
    m0 = tile * BLOCK_M2
    offs_m = m0 + tl.arange(0, BLOCK_M2)
    offs_d = tl.arange(0, BLOCK_D)
    q_tile = bh * n_q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = _load_rows(Q + q_tile, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(dO + q_tile, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    o = _load_rows(O + q_tile, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh * n_q + offs_m, delta, mask=offs_m < n_q)
    lse2 = tl.load(L + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0) * _LOG2E
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    K_src = _streamed(K + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N2, BLOCK_D, TMA)
    V_src = _streamed(V + bh * n_k * HEAD_DIM, n_k, HEAD_DIM, BLOCK_N2, BLOCK_D, TMA)

    offset = n_k - n_q
    hi_unmasked, hi = _key_bounds(m0, n_k, offset, BLOCK_M2, BLOCK_N2, IS_CAUSAL)
    dq = _dq_key_loop(dq, q, do, lse2, delta, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, 0, hi_unmasked,
                      BLOCK_N2, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, INPUT_PRECISION, TMA, EARLY_DP, WS)
    dq = _dq_key_loop(dq, q, do, lse2, delta, K_src, V_src, offs_m, offs_d, n_k, offset, qk_scale, hi_unmasked, hi,
                      BLOCK_N2, HEAD_DIM, BLOCK_D, True, IS_CAUSAL, INPUT_PRECISION, TMA, EARLY_DP, False)
    dq = dq * sm_scale
    _store_rows(dQ + q_tile, dq.to(dQ.dtype.element_ty), offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=_ORDER_ARGS)
def flash_bwd_dq_kernel(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, head_group, qk_scale, sm_scale, SEQ_BUCKET,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                         EARLY_DP: tl.constexpr):
    _dq_program(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, head_group, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                INPUT_PRECISION, BLOCK_M2, BLOCK_N2, False, EARLY_DP, False)


@triton.jit(do_not_specialize=_ORDER_ARGS)
def flash_bwd_dq_tma_kernel(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, head_group, qk_scale, sm_scale, SEQ_BUCKET,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                             INPUT_PRECISION: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
                             EARLY_DP: tl.constexpr, WS: tl.constexpr):
    _dq_program(Q, K, V, O, dO, L, Delta, dQ, n_q, n_k, head_group, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, IS_CAUSAL,
                INPUT_PRECISION, BLOCK_M2, BLOCK_N2, True, EARLY_DP, WS)

# ----------------------------------------------------------------------------- backward: one kernel with atomic dQ

@triton.jit
def flash_bwd_prep_kernel(O, dO, L, Delta, L2, DQ_ACC, n_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_P: tl.constexpr):
    """Grid (row tiles, batch). The atomic backward's prologue: D = rowsum(O * dO) and L2 = L log2(e)
    (L in base 2) for the atomic kernel, and zeros in the fp32 dQ buffer it adds into (one launch for
    all three, no memset). L2 here saves the atomic kernels a multiply per query column and key tile
    (about 6% of the d = 64 consumer loop's instructions, notes entry 29)."""
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    tile = bh * n_q * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    o = _load_rows(O + tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(dO + tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    tl.store(Delta + bh * n_q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < n_q)
    lse = tl.load(L + bh * n_q + rows, mask=rows < n_q)
    tl.store(L2 + bh * n_q + rows, lse * _LOG2E, mask=rows < n_q)
    _store_rows(DQ_ACC + tile, tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32), rows, n_q, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _atomic_query_loop(dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L2_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k,
                       offset, qk_scale, lo, hi, BLOCK_M3: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
                       CHECK_ROWS: tl.constexpr, DEFER_DQ_ADD: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """_dkdv_query_loop's five matmuls over query tiles [lo, hi), plus dQ += dS K added into DQ_bh
    (fp32, unscaled) with atomics: each query tile's dQ gets one add per key tile that sees it.

    MASK: the causal mask (when IS_CAUSAL) and the key bound. Keys past n_k load as zeros, so
    their rows of dS K vanish, but their P = exp2(0 - L2) can overflow to inf when L2 is very
    negative and inf * 0 is nan; the masked loop runs wherever such keys meet real queries.
    Query rows past n_q load as zeros (their dS is 0) and their atomics are masked off.

    DEFER_DQ_ADD: a tile's dQ part (dq_prev, rows_prev) is added at the next iteration, once that
    iteration's S^T dot is issued, instead of right after its own dot, which the adds would have
    to wait for. On an H100 this took 3-7% off (notes entry 4). The caller adds the last one."""
    offs_mb = tl.arange(0, BLOCK_M3)
    for start_m in range(lo, hi, BLOCK_M3):
        rows = start_m + offs_mb
        q_tile = rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = _load_rows(Q_bh + q_tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
        do = _load_rows(dO_bh + q_tile, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
        if CHECK_ROWS:
            lse2 = tl.load(L2_bh + rows, mask=rows < n_q, other=0.0)
            delta = tl.load(D_bh + rows, mask=rows < n_q, other=0.0)
        else:
            lse2 = tl.load(L2_bh + rows)
            delta = tl.load(D_bh + rows)
        s_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        if DEFER_DQ_ADD:  # before s_t's first use, so the adds are issued while its dot runs
            _atomic_add_rows(DQ_bh + rows_prev[:, None] * HEAD_DIM + offs_d[None, :], dq_prev, rows_prev, n_q,
                             offs_d, HEAD_DIM, BLOCK_D, True)
        s_t = s_t * qk_scale  # S^T in base 2
        if MASK:
            keep = offs_n[:, None] < n_k
            if IS_CAUSAL:
                keep = keep & (offs_n[:, None] <= rows[None, :] + offset)
            s_t = tl.where(keep, s_t, _MASKED)
        p_t = tl.math.exp2(s_t - lse2[None, :])  # P^T = exp(S - L), both in base 2
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)  # dV += P^T dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # dP^T = V dO^T
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)  # dS^T, rounded once for both dots
        dk = tl.dot(ds_t, q, dk, input_precision=INPUT_PRECISION)  # dK += dS^T Q
        dq = tl.dot(tl.trans(ds_t), k, input_precision=INPUT_PRECISION)  # this key tile's part of dS K
        if DEFER_DQ_ADD:
            dq_prev = dq
            rows_prev = rows
        else:
            _atomic_add_rows(DQ_bh + q_tile, dq, rows, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
    return dk, dv, dq_prev, rows_prev


@triton.jit(do_not_specialize=_ORDER_ARGS)
def flash_bwd_atomic_kernel(Q, K, V, dO, L2, Delta, dK, dV, DQ_ACC, n_q, n_k, head_group, qk_scale, sm_scale,
                             SEQ_BUCKET,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                             INPUT_PRECISION: tl.constexpr, BLOCK_M3: tl.constexpr, BLOCK_N3: tl.constexpr,
                             DEFER_DQ_ADD: tl.constexpr):
    """Grid (key tiles x batch, in _program_tile's order). One program owns dK and dV of one key
    tile, as the dK/dV kernel, and adds its share of dQ into DQ_ACC (zeroed, with D and L2 = L log2(e)
    written, by the prep kernel). Key tile 0 sees the most query tiles when causal: it is the longest."""
    tile, bh = _program_tile(n_k, head_group, BLOCK_N3, False)
    n0 = tile * BLOCK_N3
    offs_n = n0 + tl.arange(0, BLOCK_N3)
    offs_d = tl.arange(0, BLOCK_D)
    kv_tile = bh * n_k * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = _load_rows(K + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + kv_tile, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N3, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N3, BLOCK_D], dtype=tl.float32)
    # the deferred add's carry starts as a tile of rows past n_q: its add is masked off entirely
    dq_prev = tl.zeros([BLOCK_M3, BLOCK_D], dtype=tl.float32)
    rows_prev = n_q + tl.arange(0, BLOCK_M3)
    Q_bh = Q + bh * n_q * HEAD_DIM
    dO_bh = dO + bh * n_q * HEAD_DIM
    DQ_bh = DQ_ACC + bh * n_q * HEAD_DIM
    L2_bh = L2 + bh * n_q
    D_bh = Delta + bh * n_q

    offset = n_k - n_q
    n_q_full = (n_q // BLOCK_M3) * BLOCK_M3
    if IS_CAUSAL:
        # the query tiles that see part of this key tile, masked (padding keys are never seen by
        # a real query past them, so the unmasked loops below need no key bound)
        lo_diag, lo = _diagonal_query_tiles(n0, offset, BLOCK_M3, BLOCK_N3)
        dk, dv, dq_prev, rows_prev = _atomic_query_loop(
            dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L2_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
            qk_scale, lo_diag, tl.minimum(lo, n_q),
            BLOCK_M3, HEAD_DIM, BLOCK_D, True, True, True, DEFER_DQ_ADD, INPUT_PRECISION)
    else:
        # a ragged last key tile meets every query: all of them through the masked loop
        lo = tl.where(n0 + BLOCK_N3 > n_k, n_q, 0)
        dk, dv, dq_prev, rows_prev = _atomic_query_loop(
            dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L2_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
            qk_scale, 0, lo,
            BLOCK_M3, HEAD_DIM, BLOCK_D, True, False, True, DEFER_DQ_ADD, INPUT_PRECISION)
    # the query tiles that see all of this key tile: unmasked, unchecked; then a ragged tail
    dk, dv, dq_prev, rows_prev = _atomic_query_loop(
        dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L2_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
        qk_scale, lo, n_q_full,
        BLOCK_M3, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, False, DEFER_DQ_ADD, INPUT_PRECISION)
    dk, dv, dq_prev, rows_prev = _atomic_query_loop(
        dk, dv, dq_prev, rows_prev, k, v, Q_bh, dO_bh, L2_bh, D_bh, DQ_bh, offs_n, offs_d, n_q, n_k, offset,
        qk_scale, tl.maximum(lo, n_q_full), n_q,
        BLOCK_M3, HEAD_DIM, BLOCK_D, False, IS_CAUSAL, True, DEFER_DQ_ADD, INPUT_PRECISION)
    if DEFER_DQ_ADD:  # the last query tile's add
        _atomic_add_rows(DQ_bh + rows_prev[:, None] * HEAD_DIM + offs_d[None, :], dq_prev, rows_prev, n_q,
                         offs_d, HEAD_DIM, BLOCK_D, True)

    dk = dk * sm_scale  # dQ's sm_scale is applied by the cast that follows this kernel
    _store_rows(dK + kv_tile, dk.to(dK.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(dV + kv_tile, dv.to(dV.dtype.element_ty), offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D)
