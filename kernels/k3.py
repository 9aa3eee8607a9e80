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
    SMEM_CAPACITY,
    Problem,
    cute_dtype,
    fake_attention_args,
    fused_attention,
    jit_compile,
    run_kernel,  # noqa: F401  (the contract's launch-only entry)
)
from .tiles import kv_tile_count, unmasked_kv_tile_count

CAPS = Capabilities(head_dims=(32, 64, 96, 128, 256), sweep_max_seqlen=8192)

TILE_M = 64
TILE_N = 64
THREADS_PER_ROW = 4
NUM_THREADS = TILE_M * THREADS_PER_ROW  # 256


def smem_bytes(head_dim: int, dtype_bytes: int, kv_stages: int, qk_align: int = 128) -> int:
    """SharedStorage bytes: mbarriers, then sQ and sK aligned to ``qk_align`` (128 B here; K4.1
    swizzles them for WGMMA and passes 1024), then sV and the FP32 sS aligned to 128 B."""
    tile_bytes = TILE_N * head_dim * dtype_bytes
    return tma_pipeline.smem_footprint(kv_stages, [
        (TILE_M * head_dim * dtype_bytes, qk_align),
        (kv_stages * tile_bytes, qk_align),
        (kv_stages * tile_bytes, 128),
        (TILE_M * TILE_N * 4, 128),
    ])


def capabilities(kv_stages: int, head_dims=CAPS.head_dims, sweep_max_seqlen=CAPS.sweep_max_seqlen,
                 qk_align: int = 128) -> Capabilities:
    """The head dims whose sQ + kv_stages * (sK + sV) + sS fit in one CTA's SMEM."""
    fits = tuple(d for d in head_dims if smem_bytes(d, 2, kv_stages, qk_align) <= SMEM_CAPACITY)
    too_big = [f"d={d} needs {smem_bytes(d, 2, kv_stages, qk_align) // 1024} KB" for d in head_dims
               if d not in fits]
    why = f"with {kv_stages} KV stages {', '.join(too_big)} of SMEM (max {SMEM_CAPACITY // 1024} KB)" if too_big else ""
    return Capabilities(head_dims=fits, sweep_max_seqlen=sweep_max_seqlen, why=why)


def row_major(rows: int, cols: int, stages: int = 1) -> cute.Layout:
    return cute.make_layout((rows, cols, stages), stride=(cols, 1, rows * cols))


class K3FMHA:
    def __init__(self, head_dim: int, dtype, causal: bool, kv_stages: int):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.kv_stages = kv_stages

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        d = self.head_dim
        sQ_layout = row_major(TILE_M, d)
        sKV_layout = row_major(TILE_N, d, self.kv_stages)
        tma_q, mQ_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mQ), sQ_layout, (TILE_M, d))
        tma_k, mK_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mK), sKV_layout, (TILE_N, d))
        tma_v, mV_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mV), sKV_layout, (TILE_N, d))
        batch, nheads, seqlen = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        grid = [cute.ceil_div(seqlen, TILE_M), nheads, batch]
        self.kernel(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, mO, mLSE, softmax_scale * LOG2_E,
                    sQ_layout, sKV_layout).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_k: cute.CopyAtom, mK_tma: cute.Tensor,
               tma_v: cute.CopyAtom, mV_tma: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
               sQ_layout: cute.Layout, sKV_layout: cute.Layout):
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
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 128]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 128]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Float32, TILE_M * TILE_N], 128]

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sS = storage.sS.get_tensor(cute.make_layout((TILE_M, TILE_N), stride=(TILE_N, 1)))

        q_bytes = tma_pipeline.stage_bytes(self.dtype, sQ_layout)
        kv_bytes = 2 * tma_pipeline.stage_bytes(self.dtype, sKV_layout)
        pipeline_q, pipeline_kv = tma_pipeline.make_pipelines(
            storage.mbar_q.data_ptr(), storage.mbar_kv.data_ptr(), q_bytes, kv_bytes, stages, NUM_THREADS)

        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_q, mQ_tma, sQ, (TILE_M, self.head_dim), head, batch)
        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_k, mK_tma, sK, (TILE_N, self.head_dim), head, batch)
        tVsV, tVgV = tma_pipeline.partition_for_tma(tma_v, mV_tma, sV, (TILE_N, self.head_dim), head, batch)
        kv_loads = (tma_k, tKgK, tKsK, tma_v, tVgV, tVsV)

        n_tiles = kv_tile_count(m_block, seqlen, TILE_M, TILE_N, self.causal)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, TILE_M, TILE_N, self.causal)

        # ---- prefetch: Q, then the first min(stages, n_tiles) K/V tiles --------------------
        kv_produce = tma_pipeline.prefetch(pipeline_q, (tma_q, tQgQ[None, m_block], tQsQ[None, 0]), pipeline_kv,
                                           kv_loads, stages, n_tiles, warp_idx)

        row_max, row_sum, acc_o = simt.init_row_state(self.head_dim, THREADS_PER_ROW)
        sQ_tile = sQ[None, None, 0]

        tma_pipeline.wait_q(pipeline_q)
        kv_consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        # ---- steady state ---------------------------------------------------------------
        for n_block in cutlass.range(n_tiles, unroll=1):
            kv_start = n_block * TILE_N
            pipeline_kv.consumer_wait(kv_consume)
            sK_tile = sK[None, None, kv_consume.index]
            sV_tile = sV[None, None, kv_consume.index]
            simt.qk_scores_to_smem(sQ_tile, sK_tile, sS, row, lane, scale_log2, THREADS_PER_ROW)
            if n_block >= n_unmasked:
                simt.mask_scores(sS, row, lane, q_idx, kv_start, seqlen, THREADS_PER_ROW, self.causal)
            row_max, row_sum = simt.online_softmax_step(sS, row, lane, row_max, row_sum, acc_o, THREADS_PER_ROW)
            cute.arch.sync_warp()  # the row group's P is complete
            simt.pv_accumulate(sS, sV_tile, acc_o, row, lane, THREADS_PER_ROW)
            # Every lane of the warp is done with this stage (and with its P row, which the
            # next iteration overwrites); lane 0 then releases the stage for the warp, and
            # warp 0 refills it with tile n_block + stages once all warps have released it.
            cute.arch.sync_warp()
            kv_consume, kv_produce = tma_pipeline.release_and_refill(pipeline_kv, kv_consume, kv_produce, kv_loads,
                                                                     n_tiles, warp_idx)

        simt.store_output_and_lse(acc_o, row_max, row_sum, mO[batch, head, None, None], mLSE[batch, head, None],
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
