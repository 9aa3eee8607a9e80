"""K3: K2's compute body with the loads moved to TMA and an mbarrier pipeline.

New relative to K2:
* Loads are TMA bulk-tensor copies. The descriptors are built on the host from a
  (seqlen, d, heads, batch) view of each input; one elected thread of warp 0 issues a whole
  (64, d) tile per instruction, and rows past seqlen arrive as zeros (the descriptor knows
  the bounds), so the loads need no predicates. Scores past seqlen still need masking:
  a zero K row gives a score of 0, not -inf.
* Completion is tracked by mbarriers, not __syncthreads: ``PipelineTmaAsync`` for Q (one
  stage) and for K/V (``kv_stages`` stages). A stage's single barrier expects K bytes + V
  bytes, so it completes only when both tiles have landed.
* K and V get separate SMEM regions, each ``kv_stages`` deep: while the consumers read V of
  tile j, the producer may already be writing K of tile j+1 into another stage.
* The loop is a prefetch phase (fill up to kv_stages stages) then a steady state (consume
  tile j, release its stage, refill it with tile j + kv_stages).

The CTA-wide barriers of K2 are gone from the main loop: the only data threads exchange
through SMEM is a row of P inside one row group, which lives in one warp, so ``__syncwarp``
suffices. The registry exposes k3_1 / k3_2 / k3_3 = 1, 2, 5 KV stages.

SMEM: sQ (Br, d) + kv_stages * [sK (Bc, d) + sV (Bc, d)] + sS (Br, Bc) FP32 + mbarriers.
At d=128 five stages is 16 + 160 + 16 = 192 KB; at d=256 five stages would be 368 KB and is
refused.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32

from . import simt, tma_pipeline
from .contract import (
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

HEAD_DIMS = (32, 64, 96, 128, 256)
TILE_M = 64
TILE_N = 64
THREADS_PER_ROW = 4
NUM_THREADS = TILE_M * THREADS_PER_ROW  # 256


def smem_bytes(head_dim: int, dtype_bytes: int, kv_stages: int) -> int:
    """sQ, kv_stages-deep sK and sV, the FP32 sS, all plain row-major (128 B aligned)."""
    return tma_pipeline.smem_bytes(TILE_M, TILE_N, head_dim, dtype_bytes, kv_stages, swizzled="", score_tile=True)


def capabilities(kv_stages: int) -> Capabilities:
    """The head dims whose sQ + kv_stages * (sK + sV) + sS fit in one CTA's SMEM."""
    return tma_pipeline.smem_capabilities(HEAD_DIMS, lambda d: smem_bytes(d, 2, kv_stages),
                                          f"with {kv_stages} KV stages", sweep_max_seqlen=8192)


CAPS = capabilities(kv_stages=2)


class K3FMHA:
    tile_m, tile_n, num_threads = TILE_M, TILE_N, NUM_THREADS

    def __init__(self, head_dim: int, dtype, causal: bool, kv_stages: int):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.kv_stages = kv_stages

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        d, dt = self.head_dim, self.dtype
        # Plain row-major SMEM: CUDA-core code reads every buffer.
        sQ_layout = tma_pipeline.row_major(self.tile_m, d)
        sK_layout = tma_pipeline.row_major(self.tile_n, d, self.kv_stages)
        sV_layout = tma_pipeline.row_major(self.tile_n, d, self.kv_stages)

        tma_atom_Q, mQ_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mQ), sQ_layout, (self.tile_m, d))
        tma_atom_K, mK_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mK), sK_layout, (self.tile_n, d))
        tma_atom_V, mV_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mV), sV_layout, (self.tile_n, d))

        SharedStorage = tma_pipeline.shared_storage(dt, sQ_layout, sK_layout, sV_layout, self.kv_stages, swizzled="",
                                                    score_tile=(self.tile_m, self.tile_n))

        scale_log2 = softmax_scale * LOG2_E
        grid = (cute.ceil_div(mQ.shape[2], self.tile_m), mQ.shape[1], mQ.shape[0])
        self.kernel(tma_atom_Q, mQ_tma, tma_atom_K, mK_tma, tma_atom_V, mV_tma, mO, mLSE, scale_log2,
                    sQ_layout, sK_layout, sV_layout, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_atom_Q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_atom_K: cute.CopyAtom, mK_tma: cute.Tensor,
               tma_atom_V: cute.CopyAtom, mV_tma: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               scale_log2: Float32, sQ_layout: cute.Layout, sK_layout: cute.Layout, sV_layout: cute.Layout,
               SharedStorage: cutlass.Constexpr):
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

        n_tiles = kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)

        # ---- prefetch: Q, then the first min(stages, n_tiles) K/V tiles --------------------
        kv_produce = tma_pipeline.prefetch(pipeline_q, (tma_atom_Q, tQgQ, tQsQ), pipeline_kv, kv_loads, stages,
                                           n_tiles, warp_idx)

        row_max, row_sum, acc_O = simt.init_row_state(d, THREADS_PER_ROW)

        tma_pipeline.wait_q(pipeline_q)
        kv_consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        # ---- steady state ---------------------------------------------------------------
        for n_block in cutlass.range(n_tiles, unroll=1):
            kv_start = n_block * tile_n
            pipeline_kv.consumer_wait(kv_consume)
            sK_tile = sK[None, None, kv_consume.index]
            sV_tile = sV[None, None, kv_consume.index]
            simt.qk_scores_to_smem(sQ, sK_tile, sS, row, lane, scale_log2, THREADS_PER_ROW)
            if n_block >= n_unmasked:
                simt.mask_scores(sS, row, lane, q_idx, kv_start, seqlen, THREADS_PER_ROW, self.causal)
            row_max, row_sum = simt.online_softmax_step(sS, row, lane, row_max, row_sum, acc_O, THREADS_PER_ROW)
            cute.arch.sync_warp()  # the row group's P is complete
            simt.pv_accumulate(sS, sV_tile, acc_O, row, lane, THREADS_PER_ROW)
            # Every lane of the warp is done with this stage (and with its P row, which the
            # next iteration overwrites); lane 0 then releases the stage for the warp, and
            # warp 0 refills it with tile n_block + stages once all warps have released it.
            cute.arch.sync_warp()
            kv_consume, kv_produce = tma_pipeline.release_and_refill(pipeline_kv, kv_consume, kv_produce, kv_loads,
                                                                     n_tiles, warp_idx)

        simt.store_output_and_lse(acc_O, row_max, row_sum, mO[batch, head, None, None], mLSE[batch, head, None],
                                  q_idx, seqlen, lane, THREADS_PER_ROW)


def compile_kernel(p: Problem, *, kv_stages: int = 2, keep_ptx: bool = False) -> CompiledAttention:
    capabilities(kv_stages).check(p)  # also for direct callers with a depth the registry lacks
    dt = cute_dtype(p.dtype)
    fn = jit_compile(("k3", p.head_dim, p.dtype, p.causal, kv_stages),
                     lambda: (K3FMHA(p.head_dim, dt, p.causal, kv_stages), fake_attention_args(dt, p.head_dim)),
                     keep_ptx)
    name = {1: "k3_1", 2: "k3_2", 5: "k3_3"}.get(kv_stages, f"k3_s{kv_stages}")
    return fused_attention(name, p, fn, keep_ptx,
                           {"kv_stages": kv_stages, "smem_bytes": smem_bytes(p.head_dim, 2, kv_stages)})
