"""K4.1: QK^T on WGMMA, scores laundered through SMEM, PV still scalar.

New relative to K3.3 (same 5-stage TMA pipeline, same online softmax and scalar PV):
* One warpgroup (128 threads) per CTA, since a whole warpgroup issues each WGMMA; row groups
  shrink from 4 to 2 threads per row.
* S = Q K^T is one WGMMA chain (d/16 instructions of 64x64x16) reading Q and K from SMEM
  through descriptors, so sQ and sK take the swizzled layouts WGMMA wants (TMA writes the
  swizzle). sV stays plain row-major: scalar code reads it.
* The accumulator is a register fragment in WGMMA's C layout. An identity tensor partitioned
  like it (``tScS``) names each slot's (m, n); every thread scatters its slots to sS[m, n], and
  K3's softmax and PV run on sS unchanged. The slots land in other threads' rows, so two CTA
  barriers per tile come back (before overwriting the previous P, after the scatter).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.tensor_utils import LayoutEnum

from . import simt, sm90, tma_pipeline
from .contract import (
    LOG2_E,
    CompiledAttention,
    Problem,
    cute_dtype,
    fake_attention_args,
    fused_attention,
    jit_compile,
    run_kernel,  # noqa: F401  (the contract's launch-only entry)
)
from .tiles import kv_tile_count, unmasked_kv_tile_count

HEAD_DIMS = (32, 64, 96, 128, 256)
TILE_M = 64
TILE_N = 64
KV_STAGES = 5
THREADS_PER_ROW = 2
NUM_THREADS = 128  # one warpgroup


def smem_bytes(head_dim: int, dtype_bytes: int = 2, kv_stages: int = KV_STAGES) -> int:
    """K3's SharedStorage with sQ and sK swizzled for WGMMA (sV and sS stay plain)."""
    return tma_pipeline.smem_bytes(TILE_M, TILE_N, head_dim, dtype_bytes, kv_stages, swizzled="QK", score_tile=True)


# Every K3 head dim whose SMEM fits (d=256 with 5 KV stages does not; the refusal says how many KB).
CAPS = tma_pipeline.smem_capabilities(HEAD_DIMS, smem_bytes, f"with {KV_STAGES} KV stages", sweep_max_seqlen=16384)


class K4QKFMHA:
    tile_m, tile_n, num_threads = TILE_M, TILE_N, NUM_THREADS

    def __init__(self, head_dim: int, dtype, causal: bool, kv_stages: int = KV_STAGES):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.kv_stages = kv_stages

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        d, dt = self.head_dim, self.dtype
        # GEMM-I  S(tile_m, tile_n) = Q(tile_m, d) . K(tile_n, d)^T, both K-major (d contiguous).
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.tile_n))

        # Swizzled SMEM for the WGMMA operands: the layout atom (128B swizzle for 64 bf16 along
        # the contiguous axis) is what lets WGMMA read 8x8 core matrices without bank conflicts.
        # sV stays plain row-major: scalar code reads it.
        sQ_layout = cute.select(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt, 1),
            mode=[0, 1])
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt,
                                                  self.kv_stages)
        sV_layout = tma_pipeline.row_major(self.tile_n, d, self.kv_stages)

        tma_atom_Q, mQ_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mQ), sQ_layout, (self.tile_m, d))
        tma_atom_K, mK_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mK), sK_layout, (self.tile_n, d))
        tma_atom_V, mV_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mV), sV_layout, (self.tile_n, d))

        SharedStorage = tma_pipeline.shared_storage(dt, sQ_layout, sK_layout, sV_layout, self.kv_stages, swizzled="QK",
                                                    score_tile=(self.tile_m, self.tile_n))

        scale_log2 = softmax_scale * LOG2_E
        grid = (cute.ceil_div(mQ.shape[2], self.tile_m), mQ.shape[1], mQ.shape[0])
        self.kernel(tma_atom_Q, mQ_tma, tma_atom_K, mK_tma, tma_atom_V, mV_tma, mO, mLSE, scale_log2,
                    sQ_layout, sK_layout, sV_layout, tiled_mma_qk, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_atom_Q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_atom_K: cute.CopyAtom, mK_tma: cute.Tensor,
               tma_atom_V: cute.CopyAtom, mV_tma: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.Layout, tiled_mma_qk: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        tile_m, tile_n, d, stages = self.tile_m, self.tile_n, self.head_dim, self.kv_stages
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        seqlen = mO.shape[2]
        # Row groups (kernels/simt.py): THREADS_PER_ROW threads own query row q_idx.
        row = tidx // THREADS_PER_ROW
        lane = tidx % THREADS_PER_ROW
        q_idx = m_block * tile_m + row

        if warp_idx == 0:
            tma_pipeline.prefetch_descriptors(tma_atom_Q, tma_atom_K, tma_atom_V)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sK, sV = tma_pipeline.smem_tensors(storage, sQ_layout, sK_layout, sV_layout)
        sS = storage.sS.get_tensor(cute.make_layout((tile_m, tile_n), stride=(tile_n, 1)))
        pipeline_q, pipeline_kv = tma_pipeline.make_pipelines(storage, self.dtype, sQ_layout, sK_layout, sV_layout,
                                                              stages, self.num_threads)

        # ---- TMA partitions: one box per tile, indexed by SMEM stage and GMEM tile ----------
        # Q: just this CTA's tile; K, V: every KV tile, indexed when loaded.
        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_atom_Q, mQ_tma, sQ, (tile_m, d), head, batch, (m_block, 0))
        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_atom_K, mK_tma, sK, (tile_n, d), head, batch)
        tVsV, tVgV = tma_pipeline.partition_for_tma(tma_atom_V, mV_tma, sV, (tile_n, d), head, batch)
        kv_loads = (tma_atom_K, tKgK, tKsK, tma_atom_V, tVgV, tVsV)

        # ---- MMA partitions -------------------------------------------------------------
        # WGMMA operands as SMEM descriptors; the accumulator is a per-thread fragment.
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))          # (.., stage)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((tile_m, tile_n)), Float32)
        # Coordinate probe: the identity tensor partitioned like acc_S says which (row, col)
        # of the tile each accumulator register holds.
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((tile_m, tile_n)))

        n_tiles = kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)

        # ---- prefetch: Q, then the first min(stages, n_tiles) K/V tiles (as K3) ------------
        kv_produce = tma_pipeline.prefetch(pipeline_q, (tma_atom_Q, tQgQ, tQsQ), pipeline_kv, kv_loads, stages,
                                           n_tiles, warp_idx)

        row_max, row_sum, acc_O = simt.init_row_state(d, THREADS_PER_ROW)

        tma_pipeline.wait_q(pipeline_q)
        kv_consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        # ---- steady state ------------------------------------------------------------------
        for n_block in cutlass.range(n_tiles, unroll=1):
            kv_start = n_block * tile_n
            pipeline_kv.consumer_wait(kv_consume)
            # S = Q K^T on the tensor cores, FP32 accumulate, then wait for it.
            sm90.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_consume.index], zero_init=True, wg_wait=0)

            # Scatter the fragment into the plain (tile_m, tile_n) tile; the first barrier keeps
            # us from overwriting the previous P while another row group still reads it in PV.
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                m, n = tScS[i]
                sS[m, n] = acc_S[i] * scale_log2
            cute.arch.sync_threads()

            # From here on, K3's loop body.
            if n_block >= n_unmasked:
                simt.mask_scores(sS, row, lane, q_idx, kv_start, seqlen, THREADS_PER_ROW, self.causal)
            row_max, row_sum = simt.online_softmax_step(sS, row, lane, row_max, row_sum, acc_O, THREADS_PER_ROW)
            cute.arch.sync_warp()  # the row group's P is complete
            simt.pv_accumulate(sS, sV[None, None, kv_consume.index], acc_O, row, lane, THREADS_PER_ROW)
            cute.arch.sync_warp()  # as K3: the warp is done with this stage
            kv_consume, kv_produce = tma_pipeline.release_and_refill(pipeline_kv, kv_consume, kv_produce, kv_loads,
                                                                     n_tiles, warp_idx)

        simt.store_output_and_lse(acc_O, row_max, row_sum, mO[batch, head, None, None], mLSE[batch, head, None],
                                  q_idx, seqlen, lane, THREADS_PER_ROW)


def compile_kernel(p: Problem, *, keep_ptx: bool = False) -> CompiledAttention:
    CAPS.check(p)
    dt = cute_dtype(p.dtype)
    fn = jit_compile(("k4_qk", p.head_dim, p.dtype, p.causal),
                     lambda: (K4QKFMHA(p.head_dim, dt, p.causal), fake_attention_args(dt, p.head_dim)), keep_ptx)
    return fused_attention("k4_qk", p, fn, keep_ptx, {"kv_stages": KV_STAGES, "smem_bytes": smem_bytes(p.head_dim)})
