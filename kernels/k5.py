"""K5: warp specialization. Loads and math move to different warps.

What changes relative to K4 (same WGMMAs, same register softmax, same P handoff):

* One more warpgroup, the producer. Its warp 0 issues every TMA and only ever waits for a
  stage to be *empty*; the consumer warpgroups issue only WGMMAs and softmax and only wait for
  a stage to be *full*. In K4 warp 0 did both, so its warpgroup stalled whenever a refill had
  to wait for the other warpgroup's release.
* Register reallocation. The producer needs a handful of registers, the consumers all they can
  get: ``setmaxnreg`` moves them (producer down to 24, consumers up to 240 with two consumer
  warpgroups; 32 / 160 with three). The launch asks for one CTA per SM (``min_blocks_per_mp=1``)
  so ptxas pins the launch budget (168 or 128 per thread) that the two numbers balance against.
* K and V get pipelines of their own, so QK can start as soon as K has landed, before V has.
* KV tiles are walked in *descending* order: the diagonal and seqlen-tail tiles, the only ones
  that need a mask, come first, and the rest of the loop runs mask-free.
* Tile order (``kernels/schedule.py``): a 1-D grid of (m_block, head, batch) tiles, heaviest
  causal tiles first within each L2 section, a section being the heads whose K/V fit in L2.
* Persistent CTAs (``scheduler``): "single" launches one CTA per tile, as K4 did; "static" and
  "dynamic" launch one CTA per SM, and each loops over tiles, its producer warp loading the next
  tile's K and Q while the consumers finish the current one. "static" walks tiles round-robin
  (every tile costs the same when non-causal); "dynamic" (causal) has the producer claim the next
  tile from a global atomic counter and pass it to the consumers through SMEM, so an SM that drew
  light tiles takes more of them.
* A 2-CTA cluster (``cluster=2``, static non-causal only; measured in docs/k6.md): the two CTAs
  run neighbouring query tiles of one head in lockstep, so they read the same K/V tiles; each
  loads half of every K/V tile and multicasts it to both. L2 serves each K/V byte once per pair.
  ``cluster=4`` runs four such tiles off quarter loads (a knob: it lost, docs/k6.md).

Nothing after the role split may ``sync_threads`` (the producer warps are elsewhere): the
pipelines' mbarriers are the only synchronization between producer and consumers.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.runtime import make_fake_tensor
from cutlass.tensor_utils import LayoutEnum

from . import k4, schedule, sm90, tma_pipeline
from .contract import (
    H100_SMS,
    LOG2_E,
    SMEM_CAPACITY,
    Capabilities,
    CompiledAttention,
    Config,
    Problem,
    UnsupportedProblem,
    compiled_ptx,
    configure,
    cute_dtype,
    fake_attention_args,
    fake_stream,
    fused_attention,
    jit_compile,
    num_sms,
    run_kernel,  # noqa: F401  (the contract's launch-only entry)
)
from .tiles import kv_tile_count, kv_window_tiles, unmasked_kv_tile_count

class TileSlots(NamedTuple):
    """Dynamic scheduling: the claimed tile indices in SMEM slots, their pipeline, and the
    global counter the producer claims from."""

    pipeline: object
    sTileIdx: object
    mTileCounter: object


@cute.jit
def sequence_rows(mX: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """Rows [start, start + length) of a (1, heads, total, ...) packed tensor, as a tensor of its
    own: its shape bounds the epilogue's row predicates at the sequence's end."""
    shape = (mX.shape[0], mX.shape[1], length) + tuple(mX.shape[3:])
    return cute.make_tensor(mX.iterator + start * mX.stride[2], cute.make_layout(shape, stride=mX.stride))


class ConsumerContext(NamedTuple):
    """What every query tile of a consumer warpgroup reads: outputs, shapes, SMEM, pipelines, the
    O store, the tile grid (``tiles``), the thread's place, the scale, the GEMM state."""

    mO: object
    mLSE: object
    mAux: object
    kv_shape: tuple
    sQ: object
    pipelines: tuple
    o_store: tuple
    tile_grid: tuple
    tidx: object
    wg_idx: object
    scale_log2: object
    mmas: sm90.Mmas
    tile_slots: TileSlots


# GQA and keys outnumbering queries (bottom-right causal) come with K5's tile loop: K/V heads
# are indexed as head // group, and the KV walk takes its length from K.
CAPS = Capabilities(head_dims=(64, 128, 256), gqa=True, unequal_lengths=True, softcap=True, window=True,
                    varlen=True)

# The anchors' tiles (flash-attention's FA3 and flash-attn-4 sm90): three consumer warpgroups at
# d=64 (192-row tiles: more rows share each K/V tile), two at d=128/256; d=256 takes 80-key tiles,
# the most that fit two K/V stages beside a 128x256 Q tile in SMEM.
DEFAULT_CONFIG = {
    64: dict(num_wg=3, tile_n=128, kv_stages=2, q_stages=2, tma_store=False),
    128: dict(num_wg=2, tile_n=128, kv_stages=2, q_stages=2, tma_store=True),
    256: dict(num_wg=2, tile_n=80, kv_stages=2, q_stages=1, tma_store=False),
}
# q_stages=2: a persistent CTA's producer loads the next tile's Q while the consumers still read
# this one's (one stage would expose a Q load at every tile boundary). d=256 has no SMEM left.
# tma_store: O leaves through SMEM (the Q buffer of the tile, free once its QKs are done) and one
# TMA store instead of predicated register stores; that holds the Q buffer until the store has
# read it, which only a second Q stage hides (d<=128). Measured on an H100 (docs/k6.md), it pays
# at d=128 (causal short sequences most) and not at d=64, where three warpgroups' register
# stores are already small (and, with each warpgroup storing its own rows, o_store_per_wg, at more
# shapes: docs/k6.md).
# Persistent CTAs (one per SM, looping over tiles) by default: a static round-robin where every
# tile costs the same (non-causal); for causal, whose tiles differ, a static assignment leaves some
# SMs idle at the end (measured on an H100: docs/k5.md), so each CTA claims its next tile from an
# atomic counter, heaviest first ("dynamic"; config below).
# setmaxnreg budgets (producer, consumer) per consumer-warpgroup count: they must add up to the
# launch budget, 65536 / threads per CTA (24*128 + 240*256 = 168*384; 32*128 + 160*384 = 128*512).
REGISTERS = {2: (24, 240), 3: (32, 160)}
SCHEDULERS = ("single", "static", "dynamic")
TILE_STAGES = 2  # claimed tile indices in flight between the producer and the consumers
PRODUCER_WARPS = 4  # warpgroup 0; only its warp 0 issues loads, the other three idle (24 regs, 32 with three consumer WGs)


class K5FMHA:
    def __init__(self, head_dim: int, dtype, causal: bool, num_wg: int, tile_n: int, kv_stages: int,
                 q_stages: int, scheduler: str, tma_store: bool = False, sm_count: int = H100_SMS,
                 section_bytes: int = schedule.SECTION_BYTES, o_store_per_wg: bool = False,
                 pin_descriptors: bool = True, cluster: int = 1, softcap: float = 0.0, window: tuple = None,
                 varlen: bool = False):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.num_wg = num_wg
        self.tile_m = sm90.WGMMA_M * num_wg
        self.tile_n = tile_n
        self.kv_stages = kv_stages
        self.q_stages = q_stages
        self.tma_store = tma_store
        assert tma_store or not o_store_per_wg, "o_store_per_wg: a per-warpgroup TMA store needs tma_store"
        self.o_store_per_wg = o_store_per_wg
        self.scheduler = scheduler
        self.sm_count = sm_count
        self.section_bytes = section_bytes
        self.pin_descriptors = pin_descriptors  # sm90.StagedOperand for K and V (False: as K4 indexes them)
        self.cluster = cluster  # CTAs sharing each K/V tile through multicast (1: none)
        self.kv_mcast_mask = (1 << cluster) - 1 if cluster > 1 else None
        self.softcap = softcap  # Problem.softcap: OnlineSoftmax.use_softcap
        self.window = window  # Problem.window, or None: tiles.kv_window_tiles bounds the walk
        self.varlen = varlen  # packed sequences: ``call_varlen``, ``sequence``
        self.num_threads = sm90.THREADS_PER_WARPGROUP * (num_wg + 1)
        self.producer_regs, self.consumer_regs = REGISTERS[num_wg]

    def o_store_rows(self) -> int:
        return 64 if self.o_store_per_wg else self.tile_m

    # Where QK's A operand (Q) comes from: SMEM, the stage's Q tile, at every KV tile. Hooks, so that
    # a variant can hold Q in registers instead (experiments.QInRegisters).
    def q_source(self):
        return warpgroup.OperandSource.SMEM

    def q_fragment(self, wg_mma_qk, sQ: cute.Tensor) -> cute.Tensor:
        return wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))

    def q_operand(self, tiled_mma_qk, sQ: cute.Tensor, tSrQ: cute.Tensor, q_stage: int, tidx: Int32) -> cute.Tensor:
        return tSrQ[None, None, None, q_stage]

    def o_store_layout(self, sQ_stage):
        """The SMEM layout one O store reads: a Q stage, or the first 64 rows of one (the same
        strides, so a warpgroup's slice at any row offset matches it)."""
        if const_expr(self.o_store_per_wg):
            return cute.composition(sQ_stage, (64, self.head_dim))
        return sQ_stage

    def smem_bytes(self) -> int:
        return tma_pipeline.smem_bytes(self.tile_m, self.tile_n, self.head_dim, self.dtype.width // 8, self.kv_stages,
                                       **self.storage_options())

    def storage_options(self) -> dict:
        """K5's SharedStorage beyond K4's: separate K and V barriers, q_stages Q buffers, tile slots."""
        return dict(kv_pipelines=2, q_stages=self.q_stages, tile_slots=TILE_STAGES)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, mTileCounter: cute.Tensor, stream):
        self.launch(mQ, mK, tma_pipeline.head_dim_major_view(mV), mO, mLSE, None, softmax_scale, mTileCounter,
                    stream)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                    mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mTiles: cute.Tensor, softmax_scale: Float32,
                    mTileCounter: cute.Tensor, stream):
        """Packed sequences: q, o (1, heads, total_q, d) and k, v (1, heads_kv, total_k, d) views of
        flash-attn's (total, heads, d) tensors, lse (1, heads, total_q); sequence b holds rows
        cu_seqlens[b]:cu_seqlens[b + 1] (``sequence``). ``mTiles`` (tiles, 2): the (sequence, query
        tile) pairs there are, in the order to run them (``varlen_tiles``): empty and short
        sequences cost nothing, and no CTA meets a tile past its sequence's end."""
        self.launch(mQ, mK, tma_pipeline.head_dim_major_view(mV), mO, mLSE, (mCuSeqlensQ, mCuSeqlensK, mTiles),
                    softmax_scale, mTileCounter, stream)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mAux, softmax_scale: Float32, mTileCounter: cute.Tensor, stream):
        """``mVt``: V as a (d, keys, heads, batch) view (its major mode read from the view).
        ``mAux``: None here; an operand that a subclass's hooks read (K4's)."""
        d, dt = self.head_dim, self.dtype
        mQt = tma_pipeline.seq_major_view(mQ)
        mKt = tma_pipeline.seq_major_view(mK)

        # Each consumer warpgroup owns 64 rows of the tile_m-row query tile, as in K4.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n), a_source=self.q_source())
        v_major = LayoutEnum.from_tensor(mVt)
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, v_major.sm90_mma_major_mode(), Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)

        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt,
                                                  self.q_stages)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt,
                                                  self.kv_stages)
        sVt_layout = sm90_utils.make_smem_layout_b(v_major, (self.tile_m, d, self.tile_n), dt, self.kv_stages)

        tma_atom_Q, mQ_tma = tma_pipeline.make_tma_load(mQt, sQ_layout, (self.tile_m, d))
        tma_atom_K, mK_tma = tma_pipeline.make_tma_load(mKt, sK_layout, (self.tile_n, d), self.cluster)
        tma_atom_V, mV_tma = tma_pipeline.make_tma_load(mVt, sVt_layout, (d, self.tile_n), self.cluster)
        tma_atom_O, mO_tma = None, None
        if const_expr(self.tma_store):  # O in the swizzled layout of one Q stage (or its 64-row slices)
            tma_atom_O, mO_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), tma_pipeline.seq_major_view(mO),
                self.o_store_layout(tma_pipeline.stage_layout(sQ_layout)), (self.o_store_rows(), d))

        SharedStorage = tma_pipeline.shared_storage(dt, sQ_layout, sK_layout, sVt_layout, self.kv_stages,
                                                    **self.storage_options())

        scale_log2 = softmax_scale * LOG2_E
        # One linear index per (m_block, head, batch) tile; schedule.tile_coords decodes it.
        num_tiles = cute.ceil_div(mQ.shape[2], self.tile_m) * mQ.shape[1] * mQ.shape[0]
        if const_expr(self.varlen):  # every (sequence, query tile) pair, for every head
            num_tiles = mAux[2].shape[0] * mQ.shape[1]
        grid_x = num_tiles if const_expr(self.scheduler == "single") else cutlass.min(num_tiles, self.sm_count)
        if const_expr(self.cluster > 1):  # one cluster per pair of query tiles, at most sm_count CTAs
            pairs = cute.ceil_div(mQ.shape[2], self.tile_m * self.cluster) * mQ.shape[1] * mQ.shape[0]
            grid_x = cutlass.min(pairs, self.sm_count // self.cluster) * self.cluster
        # K/V may have fewer heads (GQA: query head h reads K/V head h // group) and more rows
        # than Q (chunked prefill): the kernel takes both from K's shape.
        kv_shape = (mK.shape[2], mQ.shape[1] // mK.shape[1], mAux if const_expr(self.varlen) else None)
        self.kernel(mQ_tma, mK_tma, mV_tma, mO, mLSE, mAux, mTileCounter, kv_shape, tma_atom_Q, tma_atom_K, tma_atom_V,
                    (tma_atom_O, mO_tma), scale_log2, sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, SharedStorage).launch(
            grid=(grid_x, 1, 1), block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1, **({"cluster": [self.cluster, 1, 1]} if self.cluster > 1 else {}))

    @cute.kernel
    def kernel(self, mQ_tma: cute.Tensor, mK_tma: cute.Tensor, mV_tma: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mAux, mTileCounter: cute.Tensor, kv_shape: tuple, tma_atom_Q: cute.CopyAtom,
               tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, o_store: tuple, scale_log2: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            tma_pipeline.prefetch_descriptors(tma_atom_Q, tma_atom_K, tma_atom_V)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        pipelines = tma_pipeline.make_ws_pipelines(
            storage.mbar_q.data_ptr(), storage.mbar_k.data_ptr(), storage.mbar_v.data_ptr(),
            tma_pipeline.stage_bytes(self.dtype, sQ_layout), tma_pipeline.stage_bytes(self.dtype, sK_layout),
            tma_pipeline.stage_bytes(self.dtype, sVt_layout), self.q_stages, self.kv_stages, 4 * self.num_wg,
            self.cluster)
        # Dynamic scheduling: the producer thread posts each claimed tile index in a slot; every
        # consumer thread reads it and releases the slot.
        pipeline_tile = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_tile.data_ptr(), num_stages=TILE_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, sm90.THREADS_PER_WARPGROUP * self.num_wg),
            defer_sync=True)
        tile_slots = TileSlots(pipeline_tile, storage.tile_idx.get_tensor(cute.make_layout(TILE_STAGES)), mTileCounter)
        sQ, sK, sVt = tma_pipeline.smem_tensors(storage, sQ_layout, sK_layout, sVt_layout)
        # The mbarrier inits must be visible to the TMA unit and to every thread (of the cluster:
        # the other CTA multicasts into this one's stages and releases them): the last CTA-wide
        # barrier of the kernel.
        cute.arch.mbarrier_init_fence()
        if const_expr(self.cluster > 1):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        if warp_idx < PRODUCER_WARPS:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ_tma, mK_tma, mV_tma, mO, kv_shape, tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sVt,
                          pipelines, tile_slots)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(mO, mLSE, mAux, kv_shape, sQ, sK, sVt, tiled_mma_qk, tiled_mma_pv, scale_log2, pipelines,
                         tile_slots, o_store)

    @cute.jit
    def tiles(self, mO: cute.Tensor, kv_shape: tuple):
        """(first tile index, step, number of tiles, tile grid) of this CTA's tile loop; the tile grid
        is what ``tile_at`` needs to turn a tile index into coordinates."""
        seqlen, nheads, batch = mO.shape[2], mO.shape[1], mO.shape[0]
        seqlen_k, group, packed = kv_shape
        num_m_blocks = cute.ceil_div(seqlen, self.tile_m)
        # Non-causal tiles all cost the same: m fastest inside one head (K4's order) keeps just a
        # head or two of K/V in flight. Causal: L2 sections, heaviest m first.
        section = (schedule.l2_section_heads(seqlen_k, self.head_dim, self.dtype.width // 8, nheads * batch, group,
                                             self.section_bytes)
                   if const_expr(self.causal) else Int32(1))
        bx, _, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        if const_expr(self.cluster > 1):  # a cluster walks pairs of query tiles (tile_at splits them)
            num_m_blocks = cute.ceil_div(num_m_blocks, self.cluster)
            bx, gdx = bx // self.cluster, gdx // self.cluster
        if const_expr(self.varlen):
            # The pairs table (heaviest first) once per L2 section of heads, a pair's heads in a row:
            # the pairs in flight then read one section's K/V (seqlen_k: every sequence's keys).
            section = schedule.l2_section_heads(seqlen_k, self.head_dim, self.dtype.width // 8, nheads, group,
                                                self.section_bytes)
            return bx, gdx, packed[2].shape[0] * nheads, (packed[2], nheads, section)
        return bx, gdx, num_m_blocks * nheads * batch, (num_m_blocks, nheads, nheads * batch, section)

    @cute.jit
    def tile_at(self, tile_idx: Int32, tile_grid: tuple):
        """(m_block, head, batch) of a tile index from ``tiles``. In a cluster the index names a
        group of ``cluster`` neighbouring query tiles, and the CTA's rank picks one. With an odd
        m-block count the last group's second tile lies past the sequence: that CTA still loads
        its half of every K/V tile for its partner, and computes on zero-filled Q rows that
        nothing stores (the O store and the LSE stop at seqlen)."""
        if const_expr(self.varlen):  # tile_grid: the (sequence, query tile) table, the heads, the section
            table, nheads, section = tile_grid
            pair, head, _ = schedule.tile_coords(tile_idx, table.shape[0], nheads, nheads, section, False)
            return table[pair, 1], head, table[pair, 0]
        m_block, head, batch = schedule.tile_coords(tile_idx, *tile_grid, self.causal)
        if const_expr(self.cluster > 1):
            m_block = m_block * self.cluster + cute.arch.block_idx_in_cluster()
        return m_block, head, batch

    @cute.jit
    def sequence(self, kv_shape: tuple, seqlen: Int32, batch: Int32) -> tuple:
        """(first query row, query length, first key row, key length) of batch entry ``batch``: the
        whole of Q and K, or, packed (varlen), sequence ``batch``'s rows of them."""
        seq = (Int32(0), seqlen, Int32(0), kv_shape[0])
        if const_expr(self.varlen):
            mCuSeqlensQ, mCuSeqlensK, _ = kv_shape[2]
            q0, k0 = mCuSeqlensQ[batch], mCuSeqlensK[batch]
            seq = (q0, mCuSeqlensQ[batch + 1] - q0, k0, mCuSeqlensK[batch + 1] - k0)
        return seq

    @cute.jit
    def claim_next_tile(self, tile_slots: tuple, tile_produce: pipeline.PipelineState, step: Int32,
                        num_tiles: Int32) -> Int32:
        """Producer warp, dynamic scheduler: claim the next tile and post it to the consumers.

        The first ``grid`` tiles go to the CTAs by block index; claim c returns tile grid + c. Each
        CTA makes exactly one claim past the end; the CTA whose such claim comes last resets the
        counters to zero for the next launch (no memset per call).
        """
        pipeline_tile, sTileIdx, mTileCounter = tile_slots
        next_tile = Int32(0)
        if cute.arch.lane_idx() == 0:
            next_tile = cute.arch.atomic_add(mTileCounter.iterator, Int32(1), scope="gpu") + step
        next_tile = cute.arch.shuffle_sync(next_tile, 0)
        pipeline_tile.producer_acquire(tile_produce)
        with cute.arch.elect_one():
            sTileIdx[tile_produce.index] = next_tile
            pipeline_tile.producer_commit(tile_produce)
        if next_tile >= num_tiles:
            if cute.arch.lane_idx() == 0:
                # acq_rel: this CTA's claims happen before its "done", and the last CTA sees all.
                done = cute.arch.atomic_add(mTileCounter.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
                if done == step - 1:
                    mTileCounter[0] = Int32(0)
                    mTileCounter[1] = Int32(0)
        return next_tile

    @cute.jit
    def next_tile(self, tile_idx: Int32, step: Int32, tile_slots: tuple,
                  tile_consume: pipeline.PipelineState) -> Int32:
        """Consumers: the tile after ``tile_idx`` (round-robin, or the one the producer claimed)."""
        if const_expr(self.scheduler == "dynamic"):
            pipeline_tile, sTileIdx, _ = tile_slots
            pipeline_tile.consumer_wait(tile_consume)
            tile_idx = sTileIdx[tile_consume.index]
            pipeline_tile.consumer_release(tile_consume)
        else:
            tile_idx += step
        return tile_idx

    # ---- Producer: one warp, TMA only ---------------------------------------------------------

    @cute.jit
    def load(self, mQ_tma: cute.Tensor, mK_tma: cute.Tensor, mV_tma: cute.Tensor, mO: cute.Tensor, kv_shape: tuple,
             tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, sQ: cute.Tensor,
             sK: cute.Tensor, sVt: cute.Tensor, pipelines: tuple, tile_slots: tuple):
        pipeline_q, pipeline_k, pipeline_v = pipelines
        seqlen = mO.shape[2]
        q_produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        kv_produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        tile_produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_STAGES)
        tile_idx, step, num_tiles, tile_grid = self.tiles(mO, kv_shape)
        loads = (seqlen, mQ_tma, mK_tma, mV_tma, kv_shape, tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sVt, pipelines,
                 tile_grid)
        kv_produce = self.load_tiles(tile_idx, step, num_tiles, q_produce, kv_produce, tile_produce, loads, tile_slots)
        # Wait until the consumers have released every V stage: no mbarrier arrive may land
        # after this CTA has exited (K's are released before V's; in a cluster the arrives come
        # from the other CTA too, so wait for K's as well).
        if const_expr(self.cluster > 1):
            pipeline_k.producer_tail(kv_produce.clone())
        pipeline_v.producer_tail(kv_produce)

    @cute.jit
    def load_tiles(self, tile_idx: Int32, step: Int32, num_tiles: Int32, q_produce: pipeline.PipelineState,
                   kv_produce: pipeline.PipelineState, tile_produce: pipeline.PipelineState, loads: tuple,
                   tile_slots: TileSlots) -> pipeline.PipelineState:
        """The producer's walk over this CTA's tiles: round-robin, or those it claims."""
        while tile_idx < num_tiles:
            q_produce, kv_produce = self.load_tile(tile_idx, None, q_produce, kv_produce, loads)
            if const_expr(self.scheduler == "dynamic"):
                tile_idx = self.claim_next_tile(tile_slots, tile_produce, step, num_tiles)
                tile_produce.advance()
            else:
                tile_idx += step
        return kv_produce

    @cute.jit
    def load_tile(self, tile_idx: Int32, span, q_produce: pipeline.PipelineState,
                  kv_produce: pipeline.PipelineState, loads: tuple):
        """Q and the K/V tiles of one query tile: all of them (``span`` None), or KV tiles [lo, hi)."""
        m_block, head, batch = self.tile_at(tile_idx, loads[-1])
        seq = self.sequence(loads[4], loads[0], batch)
        return self.load_query_tile(m_block, head, Int32(0) if const_expr(self.varlen) else batch, seq, span,
                                    q_produce, kv_produce, loads)

    @cute.jit
    def load_query_tile(self, m_block: Int32, head: Int32, batch: Int32, seq: tuple, span,
                        q_produce: pipeline.PipelineState, kv_produce: pipeline.PipelineState, loads: tuple):
        _, mQ_tma, mK_tma, mV_tma, kv_shape, tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sVt, pipelines, _ = loads
        pipeline_q, pipeline_k, pipeline_v = pipelines
        tile_m, tile_n, d = self.tile_m, self.tile_n, self.head_dim
        q_start, seqlen, k_start, seqlen_k = seq
        rows = (q_start, 0) if const_expr(self.varlen) else None  # packed: the sequence's rows, by TMA coordinates
        keys, keys_t = ((k_start, 0), (0, k_start)) if const_expr(self.varlen) else (None, None)
        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_atom_Q, mQ_tma, sQ, (tile_m, d), head, batch,
                                                    coord=(m_block, 0), offset=rows)
        group = kv_shape[1]
        cta = (cute.arch.block_idx_in_cluster() if const_expr(self.cluster > 1) else 0, self.cluster)
        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_atom_K, mK_tma, sK, (tile_n, d), head // group, batch,
                                                    cta=cta, offset=keys)
        tVsVt, tVgVt = tma_pipeline.partition_for_tma(tma_atom_V, mV_tma, sVt, (d, tile_n), head // group, batch,
                                                    coord=(0, None), cta=cta, offset=keys_t)
        if const_expr(self.window is not None):
            n_lo, _, _, n_tiles = kv_window_tiles(m_block, seqlen, seqlen_k, tile_m, tile_n, self.causal, self.window)
        else:
            n_lo, n_tiles = (0, kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal, seqlen_k)
                             ) if const_expr(span is None) else span
        kv_loads = (pipeline_k, tma_atom_K, tKgK, tKsK, pipeline_v, tma_atom_V, tVgVt, tVsVt)
        # Q goes right after the first K: in a persistent CTA it waits for the consumers to
        # release sQ, and that K need not wait with it.
        q_load = (pipeline_q, q_produce, tma_atom_Q, tQgQ, tQsQ[None, q_produce.index])
        kv_produce = self.load_kv_tiles(n_tiles, kv_produce, kv_loads, q_load, n_lo)
        q_produce.advance()
        return q_produce, kv_produce

    @cute.jit
    def load_kv_tiles(self, n_tiles: Int32, kv_produce: pipeline.PipelineState, kv_loads: tuple,
                      q_load: tuple, n_lo=0) -> pipeline.PipelineState:
        """K and V of KV tiles n_tiles-1 down to n_lo, K_j then V_j, each as soon as its stage is
        free; Q after the first K."""
        pipeline_k, tma_atom_K, tKgK, tKsK, pipeline_v, tma_atom_V, tVgVt, tVsVt = kv_loads
        for i in cutlass.range(n_tiles - n_lo, unroll=1):
            n_block = n_tiles - 1 - i
            tma_pipeline.load_stage(pipeline_k, kv_produce, tma_atom_K, tKgK[None, n_block],
                                    tKsK[None, kv_produce.index], self.kv_mcast_mask)
            if i == 0:
                tma_pipeline.load_stage(*q_load)
            tma_pipeline.load_stage(pipeline_v, kv_produce, tma_atom_V, tVgVt[None, n_block],
                                    tVsVt[None, kv_produce.index], self.kv_mcast_mask)
            kv_produce.advance()
        return kv_produce

    # ---- Consumers: WGMMA + softmax only ------------------------------------------------------

    @cute.jit
    def consume(self, mO: cute.Tensor, mLSE: cute.Tensor, mAux, kv_shape: tuple, sQ: cute.Tensor, sK: cute.Tensor,
                sVt: cute.Tensor, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, scale_log2: Float32,
                pipelines: tuple, tile_slots: tuple, o_store: tuple):
        tile_m, tile_n, d = self.tile_m, self.tile_n, self.head_dim
        # thread index among the consumers
        tidx = cute.arch.thread_idx()[0] - sm90.THREADS_PER_WARPGROUP * (PRODUCER_WARPS // 4)
        wg_idx = cute.arch.make_warp_uniform(tidx // sm90.THREADS_PER_WARPGROUP)

        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        tSrQ = self.q_fragment(wg_mma_qk, sQ)
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        if const_expr(self.pin_descriptors):  # K's and V's descriptors made once, not in every KV step
            tSrK, tOrVt = sm90.StagedOperand(tSrK), sm90.StagedOperand(tOrVt)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((tile_m, tile_n)))
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((tile_m, d)), Float32)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        scale_log2 = self.score_scale(scale_log2, mAux)

        q_consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        tile_consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_STAGES)
        tile_idx, step, num_tiles, tile_grid = self.tiles(mO, kv_shape)
        ctx = ConsumerContext(mO, mLSE, mAux, kv_shape, sQ, pipelines, o_store, tile_grid, tidx, wg_idx, scale_log2,
                              sm90.Mmas(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS),
                              tile_slots)
        self.consume_tiles(tile_idx, step, num_tiles, q_consume, kv_consume, tile_consume, ctx)

    @cute.jit
    def consume_tiles(self, tile_idx: Int32, step: Int32, num_tiles: Int32, q_consume: pipeline.PipelineState,
                      kv_consume: pipeline.PipelineState, tile_consume: pipeline.PipelineState,
                      ctx: ConsumerContext):
        """The consumers' walk over this CTA's tiles: round-robin, or those the producer claimed."""
        while tile_idx < num_tiles:
            q_consume, kv_consume = self.consume_tile(tile_idx, None, q_consume, kv_consume, ctx)
            tile_idx = self.next_tile(tile_idx, step, ctx.tile_slots, tile_consume)
            tile_consume.advance()

    @cute.jit
    def consume_tile(self, tile_idx: Int32, span, q_consume: pipeline.PipelineState,
                     kv_consume: pipeline.PipelineState, ctx: "ConsumerContext"):
        """One query tile (or, with ``span`` = (lo, hi, end), its KV tiles [lo, hi)): mainloop, then
        the end of the tile (``end_tile``). Packed, O and LSE are written through views of the
        sequence's rows."""
        m_block, head, batch = self.tile_at(tile_idx, ctx.tile_grid)
        seq = self.sequence(ctx.kv_shape, ctx.mO.shape[2], batch)
        if const_expr(self.varlen):  # the sequence's rows of O and LSE, batch 0 of the packed views
            ctx = ctx._replace(mO=sequence_rows(ctx.mO, seq[0], seq[1]), mLSE=sequence_rows(ctx.mLSE, seq[0], seq[1]))
            batch = Int32(0)
        return self.consume_query_tile(tile_idx, span, q_consume, kv_consume, ctx, m_block, head, batch, seq)

    @cute.jit
    def consume_query_tile(self, tile_idx: Int32, span, q_consume: pipeline.PipelineState,
                           kv_consume: pipeline.PipelineState, ctx: "ConsumerContext", m_block: Int32, head: Int32,
                           batch: Int32, seq: tuple):
        mAux, sQ, pipelines, tidx = ctx.mAux, ctx.sQ, ctx.pipelines, ctx.tidx
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS = ctx.mmas
        pipeline_q = pipelines[0]
        tile_m, tile_n = self.tile_m, self.tile_n
        _, seqlen, _, seqlen_k = seq
        num_rows = cute.size(sm90.acc_mn_view(acc_O), mode=[0])
        n_tiles = kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal, seqlen_k)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal, seqlen_k)
        n_lo, n_left = 0, 0
        if const_expr(span is not None):
            n_lo, n_tiles, _ = span
        if const_expr(self.window is not None):  # masked, free, then masked again below n_lo
            first, n_lo, n_unmasked, n_tiles = kv_window_tiles(m_block, seqlen, seqlen_k, tile_m, tile_n, self.causal,
                                                               self.window)
            n_left = n_lo - first
        mask_lens = (seqlen_k, seqlen_k - seqlen)  # key length, causal diagonal offset
        acc_O.fill(0.0)
        softmax = self.tile_softmax(num_rows, ctx.scale_log2, mAux, m_block, head, batch, seqlen, n_tiles, seqlen_k)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        pipeline_q.consumer_wait(q_consume)
        # Q's stage as a compile-time index, one mainloop per stage: Q's WGMMA descriptors are then
        # loop-invariant. With a runtime stage the compiler rebuilds them (64-bit adds) for every
        # k-block of every KV tile: about 15 more instructions per KV tile at d=128 (SASS, docs/k6.md).
        for q_stage in cutlass.range_constexpr(self.q_stages):
            if q_consume.index == q_stage:
                tSrQ_stage = self.q_operand(tiled_mma_qk, sQ, tSrQ, q_stage, tidx)
                mmas = sm90.Mmas(tiled_mma_qk, tiled_mma_pv, tSrQ_stage, tSrK, tOrVt, tOrP, acc_O, tScS)
                kv_consume = self.mainloop(m_block, mask_lens, n_tiles, n_unmasked, kv_consume, pipelines, mmas,
                                           softmax, row_scale, n_lo, n_left)
        self.finish_o(acc_O, mAux)
        self.end_tile(tile_idx, span, q_consume, acc_O, softmax, ctx, m_block, head, batch)
        q_consume.advance()
        return q_consume, kv_consume

    @cute.jit
    def end_tile(self, tile_idx: Int32, span, q_consume: pipeline.PipelineState, acc_O: cute.Tensor,
                 softmax: sm90.OnlineSoftmax, ctx: ConsumerContext, m_block: Int32, head: Int32, batch: Int32):
        """After a tile's last PV: the epilogue (a variant that cuts tiles into spans ends a span its way)."""
        self.epilogue(tile_idx, q_consume, acc_O, softmax, ctx, m_block, head, batch)

    @cute.jit
    def epilogue(self, tile_idx: Int32, q_consume: pipeline.PipelineState, acc_O: cute.Tensor,
                 softmax: sm90.OnlineSoftmax, ctx: "ConsumerContext", m_block: Int32, head: Int32, batch: Int32):
        """O and LSE of a whole tile: through SMEM and a TMA store, or from registers."""
        mO, mLSE, sQ, o_store, tidx, wg_idx = ctx.mO, ctx.mLSE, ctx.sQ, ctx.o_store, ctx.tidx, ctx.wg_idx
        tiled_mma_pv = ctx.mmas.tiled_mma_pv
        pipeline_q = ctx.pipelines[0]
        tile_m, d = self.tile_m, self.head_dim
        seqlen = mO.shape[2]
        if const_expr(self.tma_store):
            tma_atom_O, mO_tma = o_store
            sO = sQ[None, None, q_consume.index]
            # The box one store sends: the whole tile, or (per warpgroup) this warpgroup's rows.
            sO_box, m_box, store_threads, store_wg = sO, m_block, sm90.THREADS_PER_WARPGROUP * self.num_wg, None
            if const_expr(self.o_store_per_wg):
                sO_box, m_box = cute.local_tile(sO, (64, d), (wg_idx, 0)), m_block * self.num_wg + wg_idx
                store_threads, store_wg = sm90.THREADS_PER_WARPGROUP, wg_idx
            tOsO, tOgO = tma_pipeline.partition_for_tma(tma_atom_O, mO_tma, sO_box, (self.o_store_rows(), d), head,
                                                        batch, coord=(m_box, 0))
            sm90.store_o_tma_and_lse(acc_O, softmax, tiled_mma_pv, tidx, sO, tOsO, tOgO, tma_atom_O, mLSE,
                                     m_block, head, batch, seqlen, tile_m, mO.element_type, store_threads, store_wg)
            pipeline_q.consumer_release(q_consume)  # the store has read sO: Q's buffer is free
        else:
            # Every QK of this tile has retired: the producer may load the next tile's Q.
            pipeline_q.consumer_release(q_consume)
            # K4's epilogue: normalize once, O and LSE straight from registers.
            sm90.store_o_and_lse(acc_O, softmax, tiled_mma_pv, tidx, mO, mLSE, m_block, head, batch, tile_m,
                                 mO.element_type)

    @cute.jit
    def mainloop(self, m_block: Int32, mask_lens: tuple, n_tiles: Int32, n_unmasked: Int32,
                 kv_consume: pipeline.PipelineState, pipelines: tuple, mmas: sm90.Mmas, softmax: sm90.OnlineSoftmax,
                 row_scale: cute.Tensor, n_lo=0, n_left=0) -> pipeline.PipelineState:
        """One query tile's KV loop, descending: the masked diagonal / seqlen-tail tiles first,
        then the mask-free rest, down to KV tile ``n_lo``; under a window, the ``n_left`` tiles
        below it, masked (the window's lower edge)."""
        n_masked, n_free = n_tiles - n_unmasked, n_unmasked
        if const_expr(not isinstance(n_lo, int)):
            n_masked = cutlass.max(n_tiles - cutlass.max(n_unmasked, n_lo), 0)
            n_free = cutlass.max(cutlass.min(n_unmasked, n_tiles) - n_lo, 0)
        for i in cutlass.range(n_masked, unroll=1):
            kv_consume = self.kv_iteration(n_tiles - 1 - i, m_block, mask_lens, kv_consume, pipelines, mmas, softmax,
                                           row_scale, masked=True)
        for i in cutlass.range(n_free, unroll=1):
            kv_consume = self.kv_iteration(n_lo + n_free - 1 - i, m_block, mask_lens, kv_consume, pipelines, mmas,
                                           softmax, row_scale, masked=False)
        if const_expr(self.window is not None):
            for i in cutlass.range(n_left, unroll=1):
                kv_consume = self.kv_iteration(n_lo - 1 - i, m_block, mask_lens, kv_consume, pipelines, mmas,
                                               softmax, row_scale, masked=True)
        return kv_consume

    @cute.jit
    def kv_iteration(self, n_block: Int32, m_block: Int32, mask_lens: tuple, kv_consume: pipeline.PipelineState,
                     pipelines: tuple, mmas: sm90.Mmas, softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor,
                     masked: cutlass.Constexpr[bool]) -> pipeline.PipelineState:
        """K4's iteration with separate K and V waits, and no loads: S = QK^T, (mask), softmax,
        O = O*scale + P V. Each stage is released right after the WGMMA that read it retired.
        Two hooks mark where a later stage may coordinate warpgroups (no-ops here)."""
        _, pipeline_k, pipeline_v = pipelines
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS = mmas
        pipeline_k.consumer_wait(kv_consume)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        sm90.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_consume.index], zero_init=True, wg_wait=-1)
        self.after_qk_issue()
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(kv_consume)
        softmax.cap(acc_S)
        if const_expr(masked):
            sm90.mask_tile(acc_S, tScS, m_block, n_block, mask_lens[0], self.tile_m, self.tile_n, self.causal,
                           mask_lens[1], window=self.window)
        softmax.step(acc_S, row_scale, check_inf=masked, n_block=n_block)
        softmax.rescale(acc_O, row_scale)
        self.p_to_operand(acc_S, tOrP)
        pipeline_v.consumer_wait(kv_consume)
        self.before_pv_issue()
        sm90.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_consume.index], zero_init=False, wg_wait=0)
        pipeline_v.consumer_release(kv_consume)
        kv_consume.advance()
        return kv_consume

    def counter_ints(self) -> int:
        """Int32s of the counter buffer: the dynamic scheduler's pair (a variant may add its own)."""
        return 2

    def zeroed_counter_ints(self) -> int:
        """Of those, how many read zero again after every launch (the kernel resets them)."""
        return 2

    # K4's hooks, as K4 has them; ``tile_softmax`` gets (mAux, m_block, head, batch, seqlen, n_tiles,
    # seqlen_k) after the scale.
    score_scale = k4.K4FMHA.score_scale

    def tile_softmax(self, num_rows: int, scale_log2: Float32, *tile) -> sm90.OnlineSoftmax:
        softmax = k4.K4FMHA.tile_softmax(self, num_rows, scale_log2, *tile)
        if const_expr(self.softcap > 0.0):  # bf16's P holds e^-2c; fp16's would underflow
            softmax.use_softcap(self.softcap, known_max=self.dtype == cutlass.BFloat16
                                and self.softcap <= sm90.KNOWN_MAX_SOFTCAP)
        return softmax

    p_to_operand = k4.K4FMHA.p_to_operand
    finish_o = k4.K4FMHA.finish_o

    def after_qk_issue(self):
        """A warpgroup has issued its QK WGMMAs (not waited for them)."""

    def before_pv_issue(self):
        """A warpgroup is about to issue its PV WGMMAs."""


def schedule_config(p: Problem) -> dict:
    """Persistent (static) non-causal and dynamic causal, L2 sections by key length
    (schedule.section_bytes)."""
    return dict(scheduler="dynamic" if p.causal or p.varlen else "static",  # packed: tiles of unequal work
                section_bytes=schedule.section_bytes(p.kv_len) if p.causal and not p.varlen else schedule.SECTION_BYTES)


def config(p: Problem, overrides: dict = None) -> Config:
    """DEFAULT_CONFIG for the head dim and K5's schedule, then the overrides. Packed sequences
    store O from registers (``build`` says why)."""
    defaults = dict(DEFAULT_CONFIG[p.head_dim], **schedule_config(p))
    if p.varlen:
        defaults.update(tma_store=False)
    return configure(defaults, overrides)


def check_config(cfg: dict, name: str = "K5") -> None:
    """K4's checks, num_wg among the counts with setmaxnreg budgets (REGISTERS), then the
    scheduler's and the cluster's."""
    k4.check_config(cfg, name, num_wgs=REGISTERS)
    if cfg["scheduler"] not in SCHEDULERS:
        raise UnsupportedProblem(f"{name} config {cfg}: scheduler must be one of {SCHEDULERS}")
    cluster = cfg.get("cluster", 1)
    if cluster not in (1, 2, 4):
        raise UnsupportedProblem(f"{name} config {cfg}: cluster must be 1, 2 or 4 CTAs")
    if cluster > 1 and (cfg.get("causal") or cfg["scheduler"] != "static"):
        raise UnsupportedProblem(f"{name} config {cfg}: cluster={cluster} runs query tiles that read the same K/V "
                                 "tiles in lockstep, so it needs the static scheduler and a non-causal problem")
    if cfg.get("ctas") is not None and (cfg["ctas"] < cluster or cfg["ctas"] % cluster):
        raise UnsupportedProblem(f"{name} config {cfg}: ctas must be a whole number (>= 1) of clusters of "
                                 f"{cluster} CTAs")


def build(name: str, kernel_cls, p: Problem, cfg: dict, keep_ptx: bool, fake_args=None,
          dtype: str | None = None) -> CompiledAttention:
    """Compile ``kernel_cls`` (K5FMHA or a subclass) for ``p`` and bind its tile counter.

    The dynamic scheduler's counter is an int32 pair in GMEM that must read zero at every launch;
    the kernel resets it itself, so one zeroed pair per (device, stream) serves every call.
    ``fake_args(dtype, head_dim)``: the kernel's arguments before the counter, by default (q, k, v,
    o, lse, softmax_scale); ``dtype`` (default ``p.dtype``): the kernel class's dtype argument.
    """
    # a window or packed sequences, like causal, give each query tile its own K/V tiles (no clusters,
    # no split tail); a packed sequence's O rows end mid-tile: no TMA store
    check_config(dict(cfg, causal=not p.lockstep), name.upper())
    if p.varlen and cfg.get("tma_store"):
        raise UnsupportedProblem(f"{name.upper()} config {cfg}: packed sequences (varlen) store O from registers, "
                                 "row by row (a TMA store would write into the next sequence): tma_store=False")
    dt = cute_dtype(dtype or p.dtype)  # the kernel class's dtype
    # ctas: fewer persistent CTAs than SMs (tests: a variant's tail on a small problem)
    cfg = dict(cfg)
    ctas = cfg.pop("ctas", None)
    sm_count = ctas or (num_sms() if cfg.get("cluster", 1) == 1 else schedule.max_cluster_ctas(cfg["cluster"]))
    features = dict(({"softcap": p.softcap} if p.softcap else {}), **({"window": p.window} if p.window != (-1, -1)
                                                                     else {}), **({"varlen": True} if p.varlen else {}))
    kernel = kernel_cls(p.head_dim, dt, p.causal, sm_count=sm_count, **cfg, **features)
    if kernel.smem_bytes() > SMEM_CAPACITY:
        raise UnsupportedProblem(
            f"{name.upper()} config {cfg} at head_dim {p.head_dim} needs {kernel.smem_bytes() // 1024} KB of SMEM "
            f"(limit {SMEM_CAPACITY // 1024} KB): use fewer kv_stages or a smaller tile_n")
    key = (name, p.head_dim, dtype or p.dtype, p.causal, sm_count, tuple(sorted(cfg.items())),
           *((tuple(sorted(features.items())),) if features else ()))

    def counter():
        return make_fake_tensor(Int32, (kernel.counter_ints(),), stride=(1,))

    def args():
        if p.varlen:  # q, k, v, o, lse as (1, heads, total, ...) views, then cu_seqlens_q/k and max_seqlen_q
            q, k, v, o, lse, scale, stream = fake_attention_args(dt, p.head_dim, separate_kv=True)
            cu = [make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4) for _ in range(2)]
            tiles = make_fake_tensor(Int32, (cute.sym_int(), 2), stride=(2, 1), assumed_align=4)
            return kernel.call_varlen, (q, k, v, o, lse, *cu, tiles, scale, counter(), stream)
        if fake_args is None:
            *head, stream = fake_attention_args(dt, p.head_dim, separate_kv=True)
        else:
            *head, stream = fake_args(dt, p.head_dim)
        return kernel, (*head, counter(), stream)

    fn = jit_compile(key, args, keep_ptx)
    info = dict(cfg, smem_bytes=kernel.smem_bytes(), **({"ctas": ctas} if ctas else {}))
    compiled = fused_attention(name, p, fn, keep_ptx, info)
    counters = schedule.TileCounters(kernel.counter_ints())
    compiled.buffers["counters"] = counters  # tests read them back: the first zeroed_ints must be zero
    compiled.buffers["zeroed_ints"] = kernel.zeroed_counter_ints()

    def with_counter(jit_fn):  # the launch: this stream's counter pair goes last
        return lambda q, *args: jit_fn(q, *args, counters.get(q.get_device()))

    compiled.launch = with_counter(fn)

    def compile_entry(entry_key, make_entry, head_args):
        entry = jit_compile((key, entry_key), lambda: (make_entry(kernel), (*head_args(dt, p.head_dim), counter(),
                                                                           fake_stream())), keep_ptx)
        launch = with_counter(entry)
        launch.ptx = compiled_ptx(entry) if keep_ptx else None
        return launch

    compiled.compile_entry = compile_entry
    return compiled


def compile_kernel(p: Problem, *, keep_ptx: bool = False, num_wg=None, tile_n=None, kv_stages=None,
                   q_stages=None, scheduler=None, tma_store=None) -> CompiledAttention:
    CAPS.check(p)
    cfg = config(p, dict(num_wg=num_wg, tile_n=tile_n, kv_stages=kv_stages, q_stages=q_stages,
                                 scheduler=scheduler, tma_store=tma_store))
    return build("k5", K5FMHA, p, cfg, keep_ptx)
