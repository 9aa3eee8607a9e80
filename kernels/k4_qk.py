"""K4.1: QK^T on WGMMA, scores laundered through SMEM, PV still scalar.

New relative to K3.3 (same 5-stage TMA pipeline, same online softmax and scalar PV):
* One warpgroup (128 threads) per CTA: a WGMMA is issued by all 128 threads of a
  warpgroup together. Row groups shrink from 4 to 2 threads per row, so each thread now
  accumulates d/2 output columns.
* S = Q K^T is one 64 x 64 x d WGMMA chain (d/16 instructions of 64x64x16) reading Q and
  K straight from SMEM through descriptors. The tensor cores want swizzled operand tiles,
  so sQ and sK use the layouts ``make_smem_layout_a/b`` pick (128B swizzle at d=64/128) and
  the TMA descriptors write that swizzle. sV stays plain row-major: scalar code reads it.
* The accumulator comes back as a per-thread register fragment in WGMMA's C layout.
  An identity tensor partitioned exactly like the accumulator tells each thread the
  (m, n) tile coordinate of every fragment slot; the thread writes each slot to sS[m, n].
  After a barrier the K3 softmax runs on sS unchanged.

Because fragment slots land in other threads' rows, sS is now shared across the whole
CTA: two CTA barriers per iteration return (before overwriting the previous P and after
the scatter).
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
from . import k3
from .k3 import row_major
from .tiles import kv_tile_count, unmasked_kv_tile_count

TILE_M = 64
TILE_N = 64
KV_STAGES = 5
THREADS_PER_ROW = 2
NUM_THREADS = 128  # one warpgroup
# sQ and sK are 128B-swizzled WGMMA operands: their buffers start on 1024-byte boundaries.
SWIZZLE_ALIGN = 1024

# K3's SMEM budget with the swizzled buffers' alignment: every K3 head dim that fits
# (d=256 with 5 KV stages does not; the refusal says how many KB it would need).
CAPS = k3.capabilities(KV_STAGES, head_dims=(32, 64, 96, 128, 256), sweep_max_seqlen=16384,
                       qk_align=SWIZZLE_ALIGN)


def smem_bytes(head_dim: int, dtype_bytes: int = 2, kv_stages: int = KV_STAGES) -> int:
    return k3.smem_bytes(head_dim, dtype_bytes, kv_stages, qk_align=SWIZZLE_ALIGN)


class K4QKFMHA:
    def __init__(self, head_dim: int, dtype, causal: bool, kv_stages: int = KV_STAGES):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.kv_stages = kv_stages

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        d = self.head_dim
        # S = Q K^T: M = Br, N = Bc, K = d. Q and K are both d-contiguous: K-major operands.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K,
                                                      Float32, (1, 1, 1), (TILE_M, TILE_N))
        mma_tiler = (TILE_M, TILE_N, d)
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, mma_tiler, self.dtype, 1)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, mma_tiler, self.dtype, self.kv_stages)
        sV_layout = row_major(TILE_N, d, self.kv_stages)
        tma_q, mQ_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mQ), sQ_layout, (TILE_M, d))
        tma_k, mK_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mK), sK_layout, (TILE_N, d))
        tma_v, mV_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mV), sV_layout, (TILE_N, d))
        batch, nheads, seqlen = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        grid = [cute.ceil_div(seqlen, TILE_M), nheads, batch]
        self.kernel(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, mO, mLSE, softmax_scale * LOG2_E, tiled_mma,
                    sQ_layout, sK_layout, sV_layout).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_k: cute.CopyAtom, mK_tma: cute.Tensor,
               tma_v: cute.CopyAtom, mV_tma: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
               tiled_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        seqlen = mO.shape[2]
        row = tidx // THREADS_PER_ROW
        lane = tidx % THREADS_PER_ROW
        q_idx = m_block * TILE_M + row
        stages = self.kv_stages

        if warp_idx == 0:
            tma_pipeline.prefetch_descriptors(tma_q, tma_k, tma_v)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            # 1024-byte alignment: the 128B swizzle pattern repeats every 8 rows of 128 B.
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SWIZZLE_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], SWIZZLE_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * TILE_N], 128]

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout)
        sS = storage.sS.get_tensor(cute.make_layout((TILE_M, TILE_N), stride=(TILE_N, 1)))

        q_bytes = tma_pipeline.stage_bytes(self.dtype, sQ_layout)
        kv_bytes = tma_pipeline.stage_bytes(self.dtype, sK_layout) + tma_pipeline.stage_bytes(self.dtype, sV_layout)
        pipeline_q, pipeline_kv = tma_pipeline.make_pipelines(
            storage.mbar_q.data_ptr(), storage.mbar_kv.data_ptr(), q_bytes, kv_bytes, stages, NUM_THREADS)

        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_q, mQ_tma, sQ, (TILE_M, self.head_dim), head, batch)
        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_k, mK_tma, sK, (TILE_N, self.head_dim), head, batch)
        tVsV, tVgV = tma_pipeline.partition_for_tma(tma_v, mV_tma, sV, (TILE_N, self.head_dim), head, batch)
        kv_loads = (tma_k, tKgK, tKsK, tma_v, tVgV, tVsV)

        # WGMMA operands as SMEM descriptors; tSrQ (MMA, 1, d/16, 1), tSrK (MMA, 1, d/16, stages).
        thr_mma = tiled_mma.get_slice(tidx)
        tSrQ = tiled_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = tiled_mma.make_fragment_B(thr_mma.partition_B(sK))
        acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, TILE_N)), Float32)
        # The coordinate probe: slot i of acc_s holds S[tScS[i]].
        tScS = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))

        n_tiles = kv_tile_count(m_block, seqlen, TILE_M, TILE_N, self.causal)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, TILE_M, TILE_N, self.causal)

        # ---- prefetch (as K3) ------------------------------------------------------------
        kv_produce = tma_pipeline.prefetch(pipeline_q, (tma_q, tQgQ[None, m_block], tQsQ[None, 0]), pipeline_kv,
                                           kv_loads, stages, n_tiles, warp_idx)

        row_max, row_sum, acc_o = simt.init_row_state(self.head_dim, THREADS_PER_ROW)

        tma_pipeline.wait_q(pipeline_q)
        kv_consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        # ---- steady state ------------------------------------------------------------------
        for n_block in cutlass.range(n_tiles, unroll=1):
            kv_start = n_block * TILE_N
            pipeline_kv.consumer_wait(kv_consume)
            stage = kv_consume.index

            # S = Q K_j^T on the tensor cores, FP32 accumulate, then wait for it (K4 issues
            # both of its GEMMs through the same helper).
            sm90.gemm(tiled_mma, acc_s, tSrQ[None, None, None, 0], tSrK[None, None, None, stage], zero_init=True,
                      wg_wait=0)

            # Scatter the fragment into the plain (Br, Bc) tile; the first barrier keeps us
            # from overwriting P_{j-1} while another row group still reads it in PV.
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                m, n = tScS[i]
                sS[m, n] = acc_s[i] * scale_log2
            cute.arch.sync_threads()

            if n_block >= n_unmasked:
                simt.mask_scores(sS, row, lane, q_idx, kv_start, seqlen, THREADS_PER_ROW, self.causal)
            row_max, row_sum = simt.online_softmax_step(sS, row, lane, row_max, row_sum, acc_o, THREADS_PER_ROW)
            cute.arch.sync_warp()  # the row group's P is complete
            simt.pv_accumulate(sS, sV[None, None, stage], acc_o, row, lane, THREADS_PER_ROW)
            cute.arch.sync_warp()  # as K3: the warp is done with this stage
            kv_consume, kv_produce = tma_pipeline.release_and_refill(pipeline_kv, kv_consume, kv_produce, kv_loads,
                                                                     n_tiles, warp_idx)

        simt.store_output_and_lse(acc_o, row_max, row_sum, mO[batch, head, None, None], mLSE[batch, head, None],
                                  q_idx, seqlen, lane, THREADS_PER_ROW)


def compile_kernel(p: Problem, *, keep_ptx: bool = False) -> CompiledAttention:
    CAPS.check(p)
    dt = cute_dtype(p.dtype)
    fn = jit_compile(("k4_qk", p.head_dim, p.dtype, p.causal),
                     lambda: (K4QKFMHA(p.head_dim, dt, p.causal), fake_attention_args(dt, p.head_dim)), keep_ptx)
    return fused_attention("k4_qk", p, fn, keep_ptx,
                           {"kv_stages": KV_STAGES, "smem_bytes": smem_bytes(p.head_dim, 2, KV_STAGES)})
