"""TMA and mbarrier-pipeline plumbing shared by K3 and K4.1.

Host side (inside the @cute.jit launcher): re-view an SDPA-layout tensor with the tile modes
first and build one TMA descriptor per operand. Device side: carve a (tile, d) per-(batch,
head) view out of the TMA tensor and partition it against the staged SMEM buffer, and build
the two PipelineTmaAsync objects (Q: one stage; K+V: kv_stages stages sharing one mbarrier
per stage).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync


def seq_major_view(mX: cute.Tensor) -> cute.Tensor:
    """(batch, heads, seqlen, d) -> (seqlen, d, heads, batch); the bytes do not move.

    TMA tiles the leading modes, so the (seqlen, d) tile modes go first and (heads, batch)
    become plain coordinates the CTA selects.
    """
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[2, 3, 1, 0]))


def make_tma_load(mX_view: cute.Tensor, smem_layout, tile_rows: int, head_dim: int):
    """Host-built descriptor that copies one (tile_rows, head_dim) box into ``smem_layout``.

    Returns (atom, tma_tensor). Rows past seqlen are outside the descriptor's bounds, so the
    hardware zero-fills them: no predicate in the kernel.
    """
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX_view, smem_layout,
                                       (tile_rows, head_dim))


@cute.jit
def partition_for_tma(tma_atom: cute.CopyAtom, mX_tma: cute.Tensor, sX: cute.Tensor, tile_rows: cutlass.Constexpr,
                      head: cutlass.Int32, batch: cutlass.Int32):
    """Pair an SMEM buffer (tile_rows, d[, stages]) with the (tile_rows, d, n_tiles) GMEM tiles
    of one (batch, head). Returns (tXsX, tXgX): index tXsX[None, stage], tXgX[None, tile]."""
    head_dim = cute.size(mX_tma, mode=[1])
    gX = cute.local_tile(mX_tma[None, None, head, batch], (tile_rows, head_dim), (None, 0))
    return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                 cute.group_modes(gX, 0, 2))


def make_pipelines(mbar_q, mbar_kv, q_bytes: int, kv_bytes: int, kv_stages: int, num_threads: int):
    """Q: one stage, one TMA. K/V: kv_stages stages; one barrier per stage expects K+V bytes,
    so it completes only when both tiles of the stage have landed.

    Producer: one elected thread of warp 0. Consumers: every warp; one lane per warp
    arrives on the empty barrier when the warp is done with a stage.
    """
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, num_threads // cute.arch.WARP_SIZE)
    pipeline_q = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar_q, num_stages=1, producer_group=producer, consumer_group=consumers,
        tx_count=q_bytes, defer_sync=True)
    pipeline_kv = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar_kv, num_stages=kv_stages, producer_group=producer, consumer_group=consumers,
        tx_count=kv_bytes, defer_sync=True)
    # Barrier init must be visible to the async (TMA) proxy and to every thread before use.
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipeline_q, pipeline_kv
