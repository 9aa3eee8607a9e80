"""TMA and mbarrier-pipeline plumbing shared by every TMA stage (K3, K4.1, K4 and later).

Host side (inside the @cute.jit launcher): re-view an SDPA-layout tensor with the tile modes
first (``seq_major_view``, or ``head_dim_major_view`` for a V read as an MN-major WGMMA
operand), lay out the SMEM it lands in (``row_major`` for CUDA-core readers, the swizzled
WGMMA layouts otherwise) and build one TMA descriptor per operand (``make_tma_load``).
``smem_bytes`` is every stage's SMEM budget; ``smem_capabilities`` turns it into the head dims
a stage accepts.

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
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .contract import SMEM_CAPACITY, Capabilities

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


def row_major(rows: int, cols: int, stages=None) -> cute.Layout:
    """A plain (rows, cols[, stages]) SMEM tile, cols contiguous: what TMA writes for a buffer that
    CUDA-core code reads (K3's sQ/sK/sV, K4.1's sV). WGMMA operands use the swizzled layouts of
    ``cutlass.utils.hopper_helpers.make_smem_layout_a/b`` instead."""
    if stages is None:
        return cute.make_layout((rows, cols), stride=(cols, 1))
    return cute.make_layout((rows, cols, stages), stride=(cols, 1, rows * cols))


def make_tma_load(mX_view: cute.Tensor, smem_layout, tile: tuple, multicast: int = 1):
    """Host-built descriptor that copies one ``tile`` box into one stage of ``smem_layout``.

    ``smem_layout`` may carry a trailing stage mode: a single TMA writes its first two modes.
    ``tile`` is the box in the view's mode order: (rows, d) for a seq-major view, (d, rows)
    for the head-dim-major one. Returns (atom, tma_tensor). Rows past seqlen are outside the
    descriptor's bounds, so the hardware zero-fills them: no predicate in the kernel.
    ``multicast`` > 1 (a cluster of that many CTAs sharing the tile): each CTA's TMA writes its
    1/multicast slice of the box into the same SMEM offset of every CTA of the cluster.
    """
    op = cpasync.CopyBulkTensorTileG2SOp() if multicast == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
    return cpasync.make_tiled_tma_atom(op, mX_view, stage_layout(smem_layout), tile, num_multicast=multicast)


def stage_layout(smem_layout):
    """One stage of a (possibly staged) SMEM layout: its first two modes."""
    return cute.select(smem_layout, mode=[0, 1])


def stage_bytes(dtype, *smem_layouts) -> int:
    """Bytes one TMA of each buffer delivers, summed: what a stage's full barrier expects."""
    return sum(cute.size_in_bytes(dtype, stage_layout(layout)) for layout in smem_layouts)


# --------------------------------------------------------------------------------------
# Host: the SMEM budget
# --------------------------------------------------------------------------------------


def _alignment(operand: str, swizzled: str) -> int:
    """1024 B for a 128B-swizzled WGMMA operand (the swizzle pattern repeats every 1024 B), else 128 B."""
    return 1024 if operand in swizzled else 128


def smem_bytes(tile_m: int, tile_n: int, head_dim: int, dtype_bytes: int, kv_stages: int, *,
               swizzled: str = "QKV", score_tile: bool = False, kv_pipelines: int = 1, q_stages: int = 1,
               tile_slots: int = 0) -> int:
    """Bytes of the ``shared_storage`` struct, the SMEM budget of every TMA stage.

    First the mbarriers, 8 B each: a full/empty pair for Q's one stage and for each of the
    ``kv_stages`` stages of each K/V pipeline (``kv_pipelines`` = 1 where K and V share one
    barrier per stage, 2 where each has a pipeline of its own). Then sQ (tile_m, d) and
    kv_stages-deep sK and sV (tile_n, d), each 1024-byte aligned if its operand letter is in
    ``swizzled``, else 128-byte; last, where the stage keeps one (``score_tile``: K3, K4.1), the
    FP32 (tile_m, tile_n) score tile sS. K5 onward: ``q_stages`` Q buffers (each with its barrier
    pair), and ``tile_slots`` int32 slots with a barrier pair each, through which a persistent
    CTA's producer passes claimed tile indices to its consumers (right after the mbarriers).
    """
    tile_bytes = head_dim * dtype_bytes
    buffers = [("Q", q_stages * tile_m * tile_bytes), ("K", kv_stages * tile_n * tile_bytes),
               ("V", kv_stages * tile_n * tile_bytes)]
    if score_tile:
        buffers.append(("S", tile_m * tile_n * 4))
    offset = 8 * 2 * (q_stages + kv_pipelines * kv_stages + tile_slots) + 4 * tile_slots
    for operand, size in buffers:
        align = _alignment(operand, swizzled)
        offset = -(-offset // align) * align + size
    return offset


def shared_storage(dtype, sQ_layout, sK_layout, sV_layout, kv_stages: int, *, swizzled: str = "QKV",
                   score_tile=None, kv_pipelines: int = 1, q_stages: int = 1, tile_slots: int = 0):
    """The SharedStorage struct ``smem_bytes`` counts, field for field: ``mbar_q``, ``mbar_kv``
    (``mbar_k`` and ``mbar_v`` for two K/V pipelines), ``mbar_tile`` and ``tile_idx`` given
    ``tile_slots``, ``sQ``, ``sK``, ``sV`` and, given
    ``score_tile`` = (tile_m, tile_n), the FP32 ``sS``. Built on the host, next to the layouts."""
    def buffer(operand, elem_type, cosize):
        return cute.struct.Align[cute.struct.MemRange[elem_type, cosize], _alignment(operand, swizzled)]

    mbar_stages = cute.struct.MemRange[cutlass.Int64, 2 * kv_stages]
    fields = {"mbar_q": cute.struct.MemRange[cutlass.Int64, 2 * q_stages]}
    fields.update({"mbar_kv": mbar_stages} if kv_pipelines == 1 else {"mbar_k": mbar_stages, "mbar_v": mbar_stages})
    if tile_slots:
        fields.update(mbar_tile=cute.struct.MemRange[cutlass.Int64, 2 * tile_slots],
                      tile_idx=cute.struct.MemRange[cutlass.Int32, tile_slots])
    fields.update(sQ=buffer("Q", dtype, cute.cosize(sQ_layout)), sK=buffer("K", dtype, cute.cosize(sK_layout)),
                  sV=buffer("V", dtype, cute.cosize(sV_layout)))
    if score_tile is not None:
        fields["sS"] = buffer("S", cutlass.Float32, score_tile[0] * score_tile[1])
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def smem_capabilities(head_dims, smem_bytes_of, setting: str, **caps) -> Capabilities:
    """Capabilities for the head dims whose SharedStorage (``smem_bytes_of(d)`` bytes) fits in one
    CTA's SMEM; a refusal names the KB each other head dim would need under ``setting``."""
    need = {d: smem_bytes_of(d) for d in head_dims}
    fits = tuple(d for d in head_dims if need[d] <= SMEM_CAPACITY)
    too_big = ", ".join(f"d={d} needs {need[d] // 1024} KB" for d in head_dims if d not in fits)
    why = f"{setting}: {too_big} of SMEM (max {SMEM_CAPACITY // 1024} KB)" if too_big else ""
    return Capabilities(head_dims=fits, why=why, **caps)


# --------------------------------------------------------------------------------------
# Device: partitions, pipelines, loads
# --------------------------------------------------------------------------------------


def prefetch_descriptors(*tma_atoms: cute.CopyAtom):
    """Pull the TMA descriptors (they live in the kernel's parameter space) into the
    descriptor cache before the first copy needs them. One warp is enough."""
    for atom in tma_atoms:
        cpasync.prefetch_descriptor(atom)


def smem_tensors(storage, *smem_layouts) -> tuple:
    """sQ, sK, sV (in that order) of an allocated ``shared_storage``; a swizzled layout
    (a ComposedLayout) keeps its swizzle."""
    buffers = (storage.sQ, storage.sK, storage.sV)
    return tuple(buf.get_tensor(layout.outer, swizzle=layout.inner) if isinstance(layout, cute.ComposedLayout)
                 else buf.get_tensor(layout) for buf, layout in zip(buffers, smem_layouts))


@cute.jit
def partition_for_tma(tma_atom: cute.CopyAtom, mX_tma: cute.Tensor, sX: cute.Tensor, tile: cutlass.Constexpr,
                      head: Int32, batch: Int32, coord: tuple = (None, 0), cta: tuple = (0, 1), offset=None):
    """Pair an SMEM buffer (tile[0], tile[1][, stages]) with the GMEM boxes of one (batch, head).

    ``coord`` picks the boxes as in ``cute.local_tile``: None on the sequence mode keeps all
    of them ((None, 0) for a seq-major view, (0, None) for the head-dim-major one), a tile
    index there keeps just that one. Returns (tXsX, tXgX): index tXsX[None, stage] (an
    unstaged sX has the box mode only) and tXgX[None, tile] (only the box with a fixed coord).
    ``cta`` = (rank, CTAs) for a multicast atom: this CTA's slice of each box. ``offset``: where
    the (batch, head) matrix starts, as a coordinate of its two modes (a packed sequence's first
    row); the boxes then start there, at any row.
    """
    gX = mX_tma[None, None, head, batch]
    if cutlass.const_expr(offset is not None):
        gX = cute.domain_offset(offset, gX)
    gX = cute.local_tile(gX, tile, coord)
    return cpasync.tma_partition(tma_atom, cta[0], cute.make_layout(cta[1]), cute.group_modes(sX, 0, 2),
                                 cute.group_modes(gX, 0, 2))


def make_tma_pipeline(barriers, num_stages: int, consumer_warps: int, tx_bytes: int, cluster: int = 1):
    """Full/empty mbarrier pairs per stage. One elected producer thread arms a stage with the
    expected byte count; the TMA engine completes it; one lane per consumer warp releases it.
    Shared by a ``cluster`` of CTAs (multicast loads): lane r of each consumer warp releases the
    stage in CTA r, so a stage is empty once every warp of every CTA is done with it."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers, num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * cluster),
        tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, cluster, 1, 1)), defer_sync=True)


def make_pipelines(storage, dtype, sQ_layout, sK_layout, sV_layout, kv_stages: int, num_threads: int):
    """Q: one stage, one TMA. K/V: kv_stages stages; one barrier per stage expects K+V bytes,
    so it completes only when both tiles of the stage have landed. The mbarriers are those of
    an allocated ``shared_storage``.

    Producer: one elected thread of warp 0. Consumers: every warp; one lane per warp
    arrives on the empty barrier when the warp is done with a stage.
    """
    consumer_warps = num_threads // cute.arch.WARP_SIZE
    pipeline_q = make_tma_pipeline(storage.mbar_q.data_ptr(), 1, consumer_warps, stage_bytes(dtype, sQ_layout))
    pipeline_kv = make_tma_pipeline(storage.mbar_kv.data_ptr(), kv_stages, consumer_warps,
                                    stage_bytes(dtype, sK_layout, sV_layout))
    # Barrier init must be visible to the async (TMA) proxy and to every thread before use:
    # one fence and one CTA barrier for both pipelines.
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipeline_q, pipeline_kv


def make_kv_pipeline(storage, dtype, sK_layout, sV_layout, kv_stages: int, num_threads: int):
    """``make_pipelines`` without Q's (decode loads Q with the threads): K+V only, then the same
    fence and CTA barrier."""
    pipeline_kv = make_tma_pipeline(storage.mbar_kv.data_ptr(), kv_stages, num_threads // cute.arch.WARP_SIZE,
                                    stage_bytes(dtype, sK_layout, sV_layout))
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return pipeline_kv


def pipe_state(stages: int, t: Int32, producer: bool) -> pipeline.PipelineState:
    """Pipeline position of the t-th tile, computed instead of carried through the loop.

    Stage t % stages; the phase flips every full lap. Producers start on phase 1 so that
    their first lap passes the (initially "empty") barriers without waiting.
    """
    lap_parity = (t // stages) % 2
    phase = lap_parity ^ 1 if producer else lap_parity
    return pipeline.PipelineState(stages, t, t % stages, phase)


@cute.jit
def load_q(pipeline_q: pipeline.PipelineTmaAsync, tma_atom_Q: cute.CopyAtom, tQgQ_tile: cute.Tensor,
           tQsQ_stage: cute.Tensor):
    """Producer: Q's single stage, loaded once per CTA (never released, so never refilled)."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
    pipeline_q.producer_acquire(state)
    cute.copy(tma_atom_Q, tQgQ_tile, tQsQ_stage, tma_bar_ptr=pipeline_q.producer_get_barrier(state))


def wait_q(pipeline_q: pipeline.PipelineTmaAsync):
    """Consumers: block until Q has landed."""
    pipeline_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))


@cute.jit
def load_kv_stage(pipeline_kv: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, n_block: Int32,
                  tma_atom_K: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor,
                  tma_atom_V: cute.CopyAtom, tVgV: cute.Tensor, tVsV: cute.Tensor):
    """Producer: KV tile ``n_block`` into stage ``state.index``.

    producer_acquire waits until every consumer warp has released the stage, then arms its
    full barrier with the K+V byte count; both copies signal that one barrier.
    """
    pipeline_kv.producer_acquire(state)
    barrier = pipeline_kv.producer_get_barrier(state)
    cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, state.index], tma_bar_ptr=barrier)
    cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, state.index], tma_bar_ptr=barrier)


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
                      kv_stages: int, consumer_warps: int, cluster: int = 1):
    """Q (``q_stages``: a persistent CTA's next Q loads while this one is read), K and V
    (``kv_stages`` each, same stage index for the same KV tile; shared by the ``cluster``'s CTAs).

    K and V get barriers of their own so that a consumer can start QK as soon as K has landed
    (K6 issues the next QK before the current PV). Only the consumer warps release stages; the
    producer warp never consumes. Unlike ``make_pipelines`` this does not sync the CTA: the
    caller does it once, right before the role split (the last barrier all threads reach).
    """
    return tuple(make_tma_pipeline(mbar, stages, consumer_warps, nbytes, ctas)
                 for mbar, stages, nbytes, ctas in ((mbar_q, q_stages, q_bytes, 1), (mbar_k, kv_stages, k_bytes, cluster),
                                                    (mbar_v, kv_stages, v_bytes, cluster)))


@cute.jit
def load_stage(pipeline_x: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, tma_atom: cute.CopyAtom,
               tXgX_tile: cute.Tensor, tXsX_stage: cute.Tensor, mcast_mask: cutlass.Constexpr = None):
    """Producer: wait until the stage is empty, arm its full barrier, issue one TMA into it
    (with ``mcast_mask``, this CTA's slice into every CTA of the mask)."""
    pipeline_x.producer_acquire(state)
    if const_expr(mcast_mask is None):
        cute.copy(tma_atom, tXgX_tile, tXsX_stage, tma_bar_ptr=pipeline_x.producer_get_barrier(state))
    else:
        cute.copy(tma_atom, tXgX_tile, tXsX_stage, tma_bar_ptr=pipeline_x.producer_get_barrier(state),
                  mcast_mask=cutlass.Int16(mcast_mask))
