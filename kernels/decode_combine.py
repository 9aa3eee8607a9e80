"""The decode stage's merge as a kernel of its own (``Combine``, registered as decode_combine), and
``combine_row``, the one-warp merge of an output row that it shares with the main kernel's
in-kernel merges (``DecodeFMHA.merge_rows``, kernels/decode_kernel.py).

Each split s wrote an fp32 partial O_s, normalized by its own sum, and its LSE_s; the merge is
LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s. An empty split (LSE = -inf) weighs 0.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import simt


class Combine:
    """O[b, i, h] = sum_s exp(LSE_s - LSE) O_s with LSE = log sum_s exp(LSE_s), per row (b, i, h).

    A warp owns a row; its lanes own d/32 adjacent columns. Two passes over the splits' LSEs
    (max, then the sum of exponentials), one over the partial rows. Launched with programmatic
    dependent launch (PDL): its CTAs start while the main kernel's last ones run, and wait in
    ``griddepcontrol_wait`` until its writes are visible, so the launch gap is hidden.
    """

    ROWS_PER_CTA = 4

    def __init__(self, merge_prefetch: int = 0):
        self.merge_prefetch = merge_prefetch

    @cute.jit
    def __call__(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 num_splits: Int32, stream):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mO_partial, mLSE_partial, mO, mLSE, num_splits).launch(
            grid=(cute.ceil_div(rows, self.ROWS_PER_CTA), 1, 1), block=[32 * self.ROWS_PER_CTA, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        # The next step's main kernel may launch now (its CTAs come up and prefetch as SMs free);
        # it waits for this grid, which waits for the main kernel: the order holds.
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()  # the main kernel has finished and its partials are visible
        row = bx * self.ROWS_PER_CTA + cute.arch.make_warp_uniform(tidx // 32)
        batch_size, q_len, nheads = mO.shape[0], mO.shape[1], mO.shape[2]
        if row < batch_size * q_len * nheads:
            head, q_idx, batch = row % nheads, (row // nheads) % q_len, row // (nheads * q_len)
            combine_row(mO_partial, mLSE_partial, mO, mLSE, num_splits, batch, q_idx, head, lane,
                        self.merge_prefetch)


@cute.jit
def combine_row(mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                num_splits: Int32, batch: Int32, q_idx: Int32, head: Int32, lane: Int32,
                prefetch: cutlass.Constexpr[int]):
    """One warp merges the splits of output row (batch, q_idx, head); lanes own d/32 columns.
    The partial rows of the first ``prefetch`` splits are loaded before the LSE passes, so that
    they and the LSEs cross from L2 in one round trip (the merge is the step's critical path)."""
    cols = cute.size(mO, mode=[3]) // 32
    parts = cute.make_rmem_tensor((cols, max(prefetch, 1)), Float32)
    for s in cutlass.range_constexpr(prefetch):
        if s < num_splits:
            parts[None, s].store(cute.local_tile(mO_partial[s, batch, q_idx, head, None], (cols,), (lane,)).load())
    lse_max = -Float32.inf
    for s in cutlass.range(lane, num_splits, 32, unroll=1):
        lse_max = cute.arch.fmax(lse_max, mLSE_partial[s, batch, head, q_idx])
    lse_max = warp_allreduce(lse_max, cute.arch.fmax)
    shift = Float32(0.0) if lse_max == -Float32.inf else lse_max  # every split empty
    total = Float32(0.0)
    for s in cutlass.range(lane, num_splits, 32, unroll=1):
        total += cute.math.exp(mLSE_partial[s, batch, head, q_idx] - shift, fastmath=True)
    lse = shift + cute.math.log(warp_allreduce(total, operator.add), fastmath=True)  # log 0 = -inf

    # Every split wrote its partial (an empty one O = 0, LSE = -inf: weight 0), so the sum
    # needs no branch, and unrolled, the loads of several splits are in flight at once.
    lse_safe = Float32(0.0) if lse == -Float32.inf else lse  # all empty: weights exp(-inf) = 0
    acc = cute.make_rmem_tensor(cols, Float32)
    acc.fill(0.0)
    for s in cutlass.range_constexpr(prefetch):
        if s < num_splits:
            weight = cute.math.exp(mLSE_partial[s, batch, head, q_idx] - lse_safe, fastmath=True)
            acc.store(acc.load() + weight * parts[None, s].load())
    for s in cutlass.range(prefetch, num_splits, unroll=4):
        weight = cute.math.exp(mLSE_partial[s, batch, head, q_idx] - lse_safe, fastmath=True)
        part = cute.local_tile(mO_partial[s, batch, q_idx, head, None], (cols,), (lane,))
        acc.store(acc.load() + weight * part.load())
    out = cute.local_tile(mO[batch, q_idx, head, None], (cols,), (lane,))
    out.store(acc.load().to(mO.element_type))
    if lane == 0:
        mLSE[batch, head, q_idx] = lse


@cute.jit
def warp_allreduce(x: Float32, op: cutlass.Constexpr) -> Float32:
    return simt.butterfly_allreduce(x, op, 32, high_first=True)
