"""CUDA-core building blocks shared by K2, K3 and K4.1.

Every function here works on one *row group*: ``threads_per_row`` consecutive threads that
jointly own one query row of the tile. Thread ``tidx`` belongs to row ``tidx //
threads_per_row`` and is ``lane = tidx % threads_per_row`` inside its group. A row group
lives inside a single warp, so its reductions are sub-warp butterfly shuffles and nothing
here needs a CTA-wide barrier.

Ownership is interleaved: a thread owns score columns ``j = lane + threads_per_row * t``
of its row and output columns ``c = lane + threads_per_row * i``. Neighbouring lanes then
touch neighbouring elements of a row. That makes the V reads of ``pv_accumulate`` conflict
free: every lane of the warp reads the same row ``sV[j, ·]``, the lanes of a group read
consecutive elements, and the row groups read the same words (a broadcast).

SMEM bank conflicts (a known cost of K2/K3's plain row-major layouts, kept on purpose): a
warp holds 32 / threads_per_row row groups (8 in K2/K3, 16 in K4.1), one query row each.
Every access indexed by the thread's own row -- ``sS[row, j]`` in the softmax,
``sQ[row, c]`` in QK, ``sP[row, j]`` in PV -- touches that many consecutive rows at once.
With a 64-wide FP32 score row (256 B) or a bf16 Q row at d=64/128/256 (128/256/512 B) the
row stride is a multiple of 128 B, so all the row groups of a warp land on the same banks
and the access is replayed once per group. Likewise ``sK[lane + threads_per_row*t,
c]`` sends the lanes of a group to different K rows of the same column. Padding each row by
a few words or an XOR swizzle would spread them over the banks; K4's swizzled WGMMA layouts
(and its register-resident scores) are where this goes away.

Scores are kept in the log2 domain: ``S * scale * log2(e)``. ``exp(x - m) ==
exp2(x*log2(e) - m*log2(e))``, and ``ex2.approx`` is the native instruction (``exp`` is
ex2 plus a multiply), so folding ``log2(e)`` into the softmax scale once per score saves a
multiply per exponential and costs nothing. The natural-log LSE is recovered at the end as
``m * ln(2) + ln(l)``.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .contract import LN_2


@cute.jit
def load_rows_zero_fill(gSrc: cute.Tensor, sDst: cute.Tensor, n_valid_rows: Int32, tidx: Int32,
                        num_threads: cutlass.Constexpr):
    """Copy a (rows, d) GMEM tile into row-major SMEM with all threads, 16 bytes at a time.

    Rows at or past ``n_valid_rows`` (beyond seqlen) are written as zeros: a stale row of V
    multiplied by a zero probability is still NaN if it holds Inf/NaN bits.
    """
    vec = 128 // gSrc.element_type.width  # elements per 16-byte access
    gSrc_vec = cute.zipped_divide(gSrc, (1, vec))  # ((1, vec), (rows, d / vec))
    sDst_vec = cute.zipped_divide(sDst, (1, vec))
    n_rows = cute.size(gSrc, mode=[0])
    chunks_per_row = cute.size(gSrc, mode=[1]) // vec
    assert cute.size(gSrc, mode=[1]) % vec == 0 and (n_rows * chunks_per_row) % num_threads == 0, (
        f"load_rows_zero_fill: a ({n_rows}, {cute.size(gSrc, mode=[1])}) tile is not a whole number of "
        f"{vec}-element chunks per thread for {num_threads} threads (leftover chunks would be skipped)")
    for k in cutlass.range_constexpr(n_rows * chunks_per_row // num_threads):
        chunk = tidx + k * num_threads
        r = chunk // chunks_per_row
        cc = chunk % chunks_per_row
        if r < n_valid_rows:
            sDst_vec[None, (r, cc)].store(gSrc_vec[None, (r, cc)].load())
        else:
            sDst_vec[None, (r, cc)].store(cute.full((1, vec), 0, sDst.element_type))


@cute.jit
def qk_scores_to_smem(sQ: cute.Tensor, sK: cute.Tensor, sS: cute.Tensor, row: Int32, lane: Int32,
                      scale_log2: Float32, threads_per_row: cutlass.Constexpr):
    """S[row, j] = (Q[row, :] . K[j, :]) * scale * log2(e) for this thread's columns j.

    One Q element is loaded per step of the d loop and reused against all of the thread's
    Bc / threads_per_row K rows, which live in registers as running FP32 dot products.
    """
    head_dim = cute.size(sQ, mode=[1])
    n_cols = cute.size(sS, mode=[1]) // threads_per_row
    acc_S = cute.make_rmem_tensor((n_cols,), Float32)
    acc_S.fill(0.0)
    for c in cutlass.range(head_dim, unroll=8):
        q = sQ[row, c].to(Float32)
        for t in cutlass.range_constexpr(n_cols):
            acc_S[t] += q * sK[lane + threads_per_row * t, c].to(Float32)
    for t in cutlass.range_constexpr(n_cols):
        sS[row, lane + threads_per_row * t] = acc_S[t] * scale_log2


@cute.jit
def mask_scores(sS: cute.Tensor, row: Int32, lane: Int32, q_idx: Int32, kv_start: Int32, seqlen: Int32,
                threads_per_row: cutlass.Constexpr, causal: cutlass.Constexpr):
    """Write -inf over this thread's scores whose key is past seqlen or (causal) after the query.

    Only the last KV tile(s) of a query tile need this (see ``tiles.unmasked_kv_tile_count``).
    """
    n_cols = cute.size(sS, mode=[1]) // threads_per_row
    for t in cutlass.range_constexpr(n_cols):
        j = lane + threads_per_row * t
        kv_idx = kv_start + j
        masked = kv_idx >= seqlen
        if cutlass.const_expr(causal):
            masked = masked or kv_idx > q_idx
        if masked:
            sS[row, j] = -Float32.inf


@cute.jit
def butterfly_allreduce(val: Float32, op: cutlass.Constexpr, lanes: cutlass.Constexpr,
                        high_first: cutlass.Constexpr = False) -> Float32:
    """Combine ``val`` over each aligned group of ``lanes`` lanes (a power of 2) with butterfly
    shuffles: xor 1, 2, ... (``high_first``: from lanes/2 down). Every lane ends with the result;
    the order only matters to rounding."""
    steps = int(math.log2(lanes))
    for i in cutlass.range_constexpr(steps):
        offset = (lanes >> 1 >> i) if cutlass.const_expr(high_first) else (1 << i)
        val = op(val, cute.arch.shuffle_sync_bfly(val, offset=offset))
    return val


@cute.jit
def row_group_reduce(val: Float32, op: cutlass.Constexpr, threads_per_row: cutlass.Constexpr) -> Float32:
    """Combine ``val`` across the row group (its ``threads_per_row`` neighbouring lanes)."""
    return butterfly_allreduce(val, op, threads_per_row)


def init_row_state(head_dim: int, threads_per_row: int):
    """The FA2 running state of one row group before its first KV tile: row max -inf, row sum
    0, and this thread's d / threads_per_row unnormalized output columns at 0.
    Returns (row_max, row_sum, acc_O)."""
    acc_O = cute.make_rmem_tensor((head_dim // threads_per_row,), Float32)
    acc_O.fill(0.0)
    return -Float32.inf, Float32(0.0), acc_O


@cute.jit
def online_softmax_step(sS: cute.Tensor, row: Int32, lane: Int32, row_max: Float32, row_sum: Float32,
                        acc_O: cute.Tensor, threads_per_row: cutlass.Constexpr):
    """One FA2 row update: fold the score tile in sS into (row_max, row_sum, acc_O).

    Overwrites this thread's scores with P = exp2(S - m_new) in place and rescales the
    unnormalized output accumulator by exp2(m_old - m_new). Returns (m_new, l_new), both
    replicated across the row group.
    """
    n_cols = cute.size(sS, mode=[1]) // threads_per_row
    tile_max = -Float32.inf
    for t in cutlass.range_constexpr(n_cols):
        tile_max = cute.arch.fmax(tile_max, sS[row, lane + threads_per_row * t])
    tile_max = row_group_reduce(tile_max, cute.arch.fmax, threads_per_row)
    new_max = cute.arch.fmax(row_max, tile_max)
    # A row that has only seen masked keys keeps m = -inf; exponentiating against 0 instead
    # gives exp2(-inf) = 0 everywhere rather than the NaN of (-inf) - (-inf).
    max_safe = new_max
    if new_max == -Float32.inf:
        max_safe = Float32(0.0)
    correction = cute.math.exp2(row_max - max_safe, fastmath=True)
    tile_sum = Float32(0.0)
    for t in cutlass.range_constexpr(n_cols):
        j = lane + threads_per_row * t
        p = cute.math.exp2(sS[row, j] - max_safe, fastmath=True)
        sS[row, j] = p
        tile_sum += p
    tile_sum = row_group_reduce(tile_sum, lambda a, b: a + b, threads_per_row)
    for i in cutlass.range_constexpr(cute.size(acc_O)):
        acc_O[i] = acc_O[i] * correction
    return new_max, row_sum * correction + tile_sum


@cute.jit
def pv_accumulate(sP: cute.Tensor, sV: cute.Tensor, acc_O: cute.Tensor, row: Int32, lane: Int32,
                  threads_per_row: cutlass.Constexpr):
    """acc_O[i] += sum_j P[row, j] * V[j, lane + threads_per_row * i] over the whole KV tile."""
    tile_n = cute.size(sP, mode=[1])
    for j in cutlass.range(tile_n, unroll=4):
        p = sP[row, j]
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            acc_O[i] += p * sV[j, lane + threads_per_row * i].to(Float32)


@cute.jit
def store_output_and_lse(acc_O: cute.Tensor, row_max: Float32, row_sum: Float32, mO_bh: cute.Tensor,
                         mLSE_bh: cute.Tensor, q_idx: Int32, seqlen: Int32, lane: Int32,
                         threads_per_row: cutlass.Constexpr):
    """Deferred normalization: O = acc_O / l, written with LSE = m*ln2 + ln(l) for valid rows.

    A row with l == 0 saw no unmasked key; dividing by 1 keeps its O at 0 instead of NaN.
    """
    inv_sum = Float32(1.0)
    if row_sum != 0.0:
        inv_sum = 1.0 / row_sum
    if q_idx < seqlen:
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            mO_bh[q_idx, lane + threads_per_row * i] = (acc_O[i] * inv_sum).to(mO_bh.element_type)
        if lane == 0:
            mLSE_bh[q_idx] = row_max * LN_2 + cute.math.log(row_sum, fastmath=True)
