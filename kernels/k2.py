"""K2: FlashAttention-2 on CUDA cores, one fused kernel.

New relative to K1: S never leaves the chip. One CTA owns a Br=64 query tile of one
(batch, head); it streams KV tiles of Bc=64 keys and keeps the FA2 online-softmax state
(row max m, row sum l, unnormalized O) on chip, dividing by l once at the end.

Threads: 256 = 64 row groups of 4 (see ``kernels/simt.py``). Each group owns one query
row: it builds that row of S, reduces its max and sum with sub-warp shuffles, and
accumulates d/4 of its output columns in registers.

SMEM (plain row-major, no swizzle):
  sQ  (Br, d)  input dtype  loaded once
  sKV (Bc, d)  input dtype  holds K_j, then V_j of the same iteration
  sS  (Br, Bc) FP32         holds S_ij, overwritten in place by P_ij
48 KB at d=128. Reusing sKV for V is safe because K_j is dead once S_ij is built; it costs
one extra barrier per iteration, which TMA staging removes in K3.

Causal: tiles entirely above the diagonal are never visited (``tiles.kv_tile_count``);
only the tiles holding the diagonal or the seqlen edge apply per-element masks.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from . import simt
from .contract import (
    AMPERE_AND_LATER,
    LOG2_E,
    Capabilities,
    CompiledAttention,
    Problem,
    cute_dtype,
    fake_attention_args,
    fused_attention,
    jit_compile,
    run_kernel,  # noqa: F401  (the contract's launch-only entry)
)
from .tiles import kv_tile_count, unmasked_kv_tile_count

# SMEM at d=256: sQ 32 KB + sKV 32 KB + sS 16 KB = 80 KB, well inside 227 KB.
CAPS = Capabilities(head_dims=(32, 64, 96, 128, 256), sweep_max_seqlen=8192, archs=AMPERE_AND_LATER)

TILE_M = 64  # Br: query rows per CTA
TILE_N = 64  # Bc: keys per KV tile
THREADS_PER_ROW = 4
NUM_THREADS = TILE_M * THREADS_PER_ROW  # 256


class K2FMHA:
    def __init__(self, head_dim: int, dtype, causal: bool):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        batch, nheads, seqlen = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        grid = [cute.ceil_div(seqlen, TILE_M), nheads, batch]
        self.kernel(mQ, mK, mV, mO, mLSE, softmax_scale * LOG2_E).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = mQ.shape[2]
        row = tidx // THREADS_PER_ROW
        lane = tidx % THREADS_PER_ROW
        q_idx = m_block * TILE_M + row

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, TILE_M * self.head_dim], 128]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, TILE_N * self.head_dim], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * TILE_N], 128]

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(cute.make_layout((TILE_M, self.head_dim), stride=(self.head_dim, 1)))
        sKV = storage.sKV.get_tensor(cute.make_layout((TILE_N, self.head_dim), stride=(self.head_dim, 1)))
        sS = storage.sS.get_tensor(cute.make_layout((TILE_M, TILE_N), stride=(TILE_N, 1)))

        # (seqlen, d) views of this CTA's (batch, head)
        mQ_bh, mK_bh, mV_bh = mQ[batch, head, None, None], mK[batch, head, None, None], mV[batch, head, None, None]
        tile_q = (TILE_M, self.head_dim)
        tile_kv = (TILE_N, self.head_dim)

        simt.load_rows_zero_fill(cute.local_tile(mQ_bh, tile_q, (m_block, 0)), sQ, seqlen - m_block * TILE_M,
                                 tidx, NUM_THREADS)

        row_max, row_sum, acc_O = simt.init_row_state(self.head_dim, THREADS_PER_ROW)

        n_tiles = kv_tile_count(m_block, seqlen, TILE_M, TILE_N, self.causal)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, TILE_M, TILE_N, self.causal)
        for n_block in cutlass.range(n_tiles, unroll=1):
            kv_start = n_block * TILE_N
            # K_j over sKV: everyone must be done reading V_{j-1} (and sQ on the first pass).
            cute.arch.sync_threads()
            simt.load_rows_zero_fill(cute.local_tile(mK_bh, tile_kv, (n_block, 0)), sKV, seqlen - kv_start,
                                     tidx, NUM_THREADS)
            cute.arch.sync_threads()
            simt.qk_scores_to_smem(sQ, sKV, sS, row, lane, scale_log2, THREADS_PER_ROW)
            if n_block >= n_unmasked:
                simt.mask_scores(sS, row, lane, q_idx, kv_start, seqlen, THREADS_PER_ROW, self.causal)
            row_max, row_sum = simt.online_softmax_step(sS, row, lane, row_max, row_sum, acc_O, THREADS_PER_ROW)
            # V_j over K_j: everyone must be done reading K_j. The barrier also publishes
            # each row group's P to its neighbours in the group.
            cute.arch.sync_threads()
            simt.load_rows_zero_fill(cute.local_tile(mV_bh, tile_kv, (n_block, 0)), sKV, seqlen - kv_start,
                                     tidx, NUM_THREADS)
            cute.arch.sync_threads()
            simt.pv_accumulate(sS, sKV, acc_O, row, lane, THREADS_PER_ROW)

        simt.store_output_and_lse(acc_O, row_max, row_sum, mO[batch, head, None, None], mLSE[batch, head, None],
                                  q_idx, seqlen, lane, THREADS_PER_ROW)


def compile_kernel(p: Problem, *, keep_ptx: bool = False) -> CompiledAttention:
    dt = cute_dtype(p.dtype)
    fn = jit_compile(("k2", p.head_dim, p.dtype, p.causal),
                     lambda: (K2FMHA(p.head_dim, dt, p.causal), fake_attention_args(dt, p.head_dim)), keep_ptx)
    return fused_attention("k2", p, fn, keep_ptx, {"tile_m": TILE_M, "tile_n": TILE_N, "threads": NUM_THREADS})
