"""TMA and mbarrier-pipeline plumbing shared by every TMA stage (K3, K4.1, K4 and later).

Host side (inside the @cute.jit launcher): re-view an SDPA-layout tensor with the tile modes
first (``seq_major_view``, or ``head_dim_major_view`` for a V read as an MN-major WGMMA
operand) and build one TMA descriptor per operand (``make_tma_load``).

Device side: pair a (batch, head)'s GMEM tiles with the staged SMEM buffer
(``partition_for_tma``), build the Q and K+V ``PipelineTmaAsync`` objects (``make_pipelines``:
Q one stage; K+V ``kv_stages`` stages sharing one mbarrier per stage), and issue loads through
them: ``load_q`` once, ``load_kv_stage`` for every K+V tile. Warp 0 is the producer (it
prefetches, then refills each stage as it is released); every warp consumes.

A pipeline position is either carried through the loop (``PipelineState.advance``: K3 and
K4.1 through ``prefetch`` / ``release_and_refill``) or computed from the tile index
(``pipe_state``: K4).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

# --------------------------------------------------------------------------------------
# Host: views and descriptors
# --------------------------------------------------------------------------------------


def seq_major_view(mX: cute.Tensor) -> cute.Tensor:
    """(batch, heads, seqlen, d) -> (seqlen, d, heads, batch); the bytes do not move.

    TMA tiles the leading modes, so the (seqlen, d) tile modes go first and (heads, batch)
    become plain coordinates the CTA selects. Q, K (and V read as a K-major operand) use it.
    """
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[2, 3, 1, 0]))


def head_dim_major_view(mX: cute.Tensor) -> cute.Tensor:
    """(batch, heads, seqlen, d) -> (d, seqlen, heads, batch); the bytes do not move.

    K4's PV GEMM contracts over keys, but V's contiguous axis is d (PV's N axis). With d as the
    leading mode, ``LayoutEnum.from_tensor`` reads V as an MN-major B operand, and the TMA box
    is (d, tile_n).
    """
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[3, 2, 1, 0]))


def make_tma_load(mX_view: cute.Tensor, smem_layout, tile: tuple):
    """Host-built descriptor that copies one ``tile`` box into one stage of ``smem_layout``.

    ``smem_layout`` may carry a trailing stage mode: a single TMA writes its first two modes.
    ``tile`` is the box in the view's mode order: (rows, d) for a seq-major view, (d, rows)
    for the head-dim-major one. Returns (atom, tma_tensor). Rows past seqlen are outside the
    descriptor's bounds, so the hardware zero-fills them: no predicate in the kernel.
    """
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mX_view, stage_layout(smem_layout), tile)


def stage_layout(smem_layout):
    """One stage of a (possibly staged) SMEM layout: its first two modes."""
    return cute.select(smem_layout, mode=[0, 1])


def smem_footprint(kv_stages: int, buffers) -> int:
    """Bytes of a SharedStorage laid out as the K3/K4.1/K4 structs are: the Q mbarrier pair and
    ``kv_stages`` K+V pairs (8 B each) first, then each buffer of ``buffers`` = [(bytes,
    alignment), ...] at the next multiple of its alignment (128 B for plain row-major tiles,
    1024 B for a 128B-swizzled WGMMA operand, whose swizzle pattern repeats every 1024 B)."""
    offset = 8 * 2 * (1 + kv_stages)
    for size, align in buffers:
        offset = -(-offset // align) * align + size
    return offset


def stage_bytes(dtype, smem_layout) -> int:
    """Bytes one TMA of this buffer delivers: what a stage's full barrier expects."""
    return cute.size_in_bytes(dtype, stage_layout(smem_layout))


# --------------------------------------------------------------------------------------
# Device: partitions, pipelines, loads
# --------------------------------------------------------------------------------------


def prefetch_descriptors(*tma_atoms: cute.CopyAtom):
    """Pull the TMA descriptors (they live in the kernel's parameter space) into the
    descriptor cache before the first copy needs them. One warp is enough."""
    for atom in tma_atoms:
        cpasync.prefetch_descriptor(atom)


@cute.jit
def partition_for_tma(tma_atom: cute.CopyAtom, mX_tma: cute.Tensor, sX: cute.Tensor, tile: cutlass.Constexpr,
                      head: Int32, batch: Int32, coord: tuple = (None, 0)):
    """Pair an SMEM buffer (tile[0], tile[1][, stages]) with the GMEM boxes of one (batch, head).

    ``coord`` picks the boxes as in ``cute.local_tile``: None on the sequence mode keeps all
    of them ((None, 0) for a seq-major view, (0, None) for the head-dim-major one), a tile
    index there keeps just that one. Returns (tXsX, tXgX): index tXsX[None, stage] (an
    unstaged sX has the box mode only) and tXgX[None, tile] (only the box with a fixed coord).
    """
    gX = cute.local_tile(mX_tma[None, None, head, batch], tile, coord)
    return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                 cute.group_modes(gX, 0, 2))


def _tma_pipeline(barriers, num_stages: int, consumer_warps: int, tx_bytes: int):
    """Full/empty mbarrier pairs per stage. One elected producer thread arms a stage with the
    expected byte count; the TMA engine completes it; one lane per consumer warp releases it."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers, num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes, defer_sync=True)


def make_pipelines(mbar_q, mbar_kv, q_bytes: int, kv_bytes: int, kv_stages: int, num_threads: int):
    """Q: one stage, one TMA. K/V: kv_stages stages; one barrier per stage expects K+V bytes,
    so it completes only when both tiles of the stage have landed.

    Producer: one elected thread of warp 0. Consumers: every warp; one lane per warp
    arrives on the empty barrier when the warp is done with a stage.
    """
    consumer_warps = num_threads // cute.arch.WARP_SIZE
    pipeline_q = _tma_pipeline(mbar_q, 1, consumer_warps, q_bytes)
    pipeline_kv = _tma_pipeline(mbar_kv, kv_stages, consumer_warps, kv_bytes)
    # Barrier init must be visible to the async (TMA) proxy and to every thread before use:
    # one fence and one CTA barrier for both pipelines.
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipeline_q, pipeline_kv


def pipe_state(stages: int, t: Int32, producer: bool) -> pipeline.PipelineState:
    """Pipeline position of the t-th tile, computed instead of carried through the loop.

    Stage t % stages; the phase flips every full lap. Producers start on phase 1 so that
    their first lap passes the (initially "empty") barriers without waiting.
    """
    lap_parity = (t // stages) % 2
    phase = lap_parity ^ 1 if producer else lap_parity
    return pipeline.PipelineState(stages, t, t % stages, phase)


@cute.jit
def load_q(pipeline_q: pipeline.PipelineTmaAsync, tma_q: cute.CopyAtom, tQgQ_tile: cute.Tensor,
           tQsQ_stage: cute.Tensor):
    """Producer: Q's single stage, loaded once per CTA (never released, so never refilled)."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
    pipeline_q.producer_acquire(state)
    cute.copy(tma_q, tQgQ_tile, tQsQ_stage, tma_bar_ptr=pipeline_q.producer_get_barrier(state))


def wait_q(pipeline_q: pipeline.PipelineTmaAsync):
    """Consumers: block until Q has landed."""
    pipeline_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))


@cute.jit
def load_kv_stage(pipeline_kv: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, n_block: Int32,
                  tma_k: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor,
                  tma_v: cute.CopyAtom, tVgV: cute.Tensor, tVsV: cute.Tensor):
    """Producer: KV tile ``n_block`` into stage ``state.index``.

    producer_acquire waits until every consumer warp has released the stage, then arms its
    full barrier with the K+V byte count; both copies signal that one barrier.
    """
    pipeline_kv.producer_acquire(state)
    barrier = pipeline_kv.producer_get_barrier(state)
    cute.copy(tma_k, tKgK[None, n_block], tKsK[None, state.index], tma_bar_ptr=barrier)
    cute.copy(tma_v, tVgV[None, n_block], tVsV[None, state.index], tma_bar_ptr=barrier)


# --------------------------------------------------------------------------------------
# The K+V ring with a carried producer position (K3, K4.1)
# --------------------------------------------------------------------------------------


@cute.jit
def prefetch(pipeline_q: pipeline.PipelineTmaAsync, q_load: tuple, pipeline_kv: pipeline.PipelineTmaAsync,
             kv_loads: tuple, kv_stages: cutlass.Constexpr, n_tiles: Int32, warp_idx: Int32) -> pipeline.PipelineState:
    """Warp 0 issues Q (``q_load`` = (atom, GMEM tile, SMEM stage)), then the first
    min(kv_stages, n_tiles) K+V tiles (``kv_loads`` = load_kv_stage's six TMA arguments).

    Returns the producer position: the next tile to load and the stage it goes to. Every warp
    gets one; only warp 0's ever moves on (in ``release_and_refill``).
    """
    kv_produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, kv_stages)
    if warp_idx == 0:
        load_q(pipeline_q, *q_load)
        for _ in cutlass.range(cutlass.min(kv_stages, n_tiles), unroll=1):
            load_kv_stage(pipeline_kv, kv_produce, kv_produce.count, *kv_loads)
            kv_produce.advance()
    return kv_produce


@cute.jit
def release_and_refill(pipeline_kv: pipeline.PipelineTmaAsync, kv_consume: pipeline.PipelineState,
                       kv_produce: pipeline.PipelineState, kv_loads: tuple, n_tiles: Int32, warp_idx: Int32):
    """Release the stage just consumed, then (warp 0) refill it with the tile kv_stages ahead.

    Call once every lane of the warp is done reading the stage: lane 0 arrives on the empty
    barrier for the whole warp. The refill's producer_acquire waits until all warps have
    released the stage. Returns the advanced (kv_consume, kv_produce).
    """
    pipeline_kv.consumer_release(kv_consume)
    kv_consume.advance()
    if warp_idx == 0:
        if kv_produce.count < n_tiles:
            load_kv_stage(pipeline_kv, kv_produce, kv_produce.count, *kv_loads)
            kv_produce.advance()
    return kv_consume, kv_produce


# --------------------------------------------------------------------------------------
# Warp-specialized pipelines (K5 onward): one producer warp, consumer warpgroups
# --------------------------------------------------------------------------------------


def make_ws_pipelines(mbar_q, mbar_k, mbar_v, q_bytes: int, k_bytes: int, v_bytes: int, q_stages: int,
                      kv_stages: int, consumer_warps: int):
    """Q (``q_stages``: a persistent CTA's next Q loads while this one is read), K and V
    (``kv_stages`` each, same stage index for the same KV tile).

    K and V get barriers of their own so that a consumer can start QK as soon as K has landed
    (K6 issues the next QK before the current PV). Only the consumer warps release stages; the
    producer warp never consumes. Unlike ``make_pipelines`` this does not sync the CTA: the
    caller does it once, right before the role split (the last barrier all threads reach).
    """
    return tuple(_tma_pipeline(mbar, stages, consumer_warps, nbytes)
                 for mbar, stages, nbytes in ((mbar_q, q_stages, q_bytes), (mbar_k, kv_stages, k_bytes),
                                              (mbar_v, kv_stages, v_bytes)))


@cute.jit
def load_stage(pipeline_x: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, tma_atom: cute.CopyAtom,
               tXgX_tile: cute.Tensor, tXsX_stage: cute.Tensor):
    """Producer: wait until the stage is empty, arm its full barrier, issue one TMA into it."""
    pipeline_x.producer_acquire(state)
    cute.copy(tma_atom, tXgX_tile, tXsX_stage, tma_bar_ptr=pipeline_x.producer_get_barrier(state))
