"""K10: K9 warp-specialized, FA3's backward organisation.

New relative to K9 (same walk, same five GEMMs, same operand placement):

* A producer warpgroup at a small register budget (``setmaxnreg``, K5's budgets): its warp 0
  issues the TMA loads (K and V once, then the Q/dO ring across the walk), its warp 1 is the dQ
  writer; the MMA warpgroups get the registers the producer gives up.
* dQ leaves by TMA reduce-add. Each step's dQ share is written (fp32) into ``sdQ``; the writer
  warp adds the whole tile into the fp32 accumulator in GMEM with one ``cp.reduce.async.bulk``
  (``CopyReduceBulkTensorTileS2GOp``), so the MMA warps never wait on atomics. Two named barriers
  hand the buffer back and forth: ``DQ_FULL`` (the MMA warps have written it) and ``DQ_EMPTY``
  (the TMA has read it).
* The MMA warpgroups synchronize among themselves with a named barrier (``MMA``), not the CTA
  barrier, which would wait for the producer warps.
* A deterministic mode: the key tiles' dQ shares of a query tile are added in a fixed order
  (a semaphore per query tile), so the fp32 sums, and the gradients, repeat bit for bit. Causal,
  the order is the one the shares arrive in (the last key tile first: it starts on the diagonal).
* d = 256 (``K10BackwardSplitD``): dK and dV of 64 keys would need 256 registers a thread, so
  the two MMA warpgroups share one 64-key tile and split the head dim of dK, dV and dQ; P^T
  and dS^T meet in SMEM.
"""

from __future__ import annotations

import enum
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import k4, k5, k9, simt, sm90, tma_pipeline
from .tiles import ROW_ALIGN, kv_window_tiles, packed_row_start, packed_tile_start, query_window_tiles
from .contract import LOG2_E, SMEM_CAPACITY, FakeShapes, Problem, UnsupportedProblem, cute_dtype, fake_stream, jit_compile, num_sms

HEAD_DIMS = (*k9.HEAD_DIMS, 256)
# d = 256: one Q/dO stage, so that K, V, Q, dO, P^T, dS^T and the fp32 dQ share fit in 227 KB.
DEFAULT_CONFIG = {**k9.DEFAULT_CONFIG, 256: dict(num_wg=2, tile_m=64, q_stages=1)}


class Barrier(enum.IntEnum):
    """K10's named-barrier ids (0 is sync_threads)."""

    MMA = 1  # the MMA warpgroups among themselves (sdS written / read)
    DQ_FULL = 2  # MMA warps -> dQ writer: sdQ holds this step's dQ share
    DQ_EMPTY = 3  # dQ writer -> MMA warps: the TMA has read sdQ
    # early_dq: warpgroup w hands its half of sdQ over on its own pair, DQ_FULL + 2w and DQ_EMPTY + 2w
    DQ_FULL_WG1 = 4
    DQ_EMPTY_WG1 = 5

# knobs of the passes around the main kernel, not of its class: wide_prepass (WidePrepass)
PASS_KNOBS = ("wide_prepass",)

# dq_flat: a dQ share leaves in the accumulator's own register order, as 256-float rows (one TMA
# box of at most 256 elements per dimension) of a flat fp32 buffer per query tile.
FLAT_WIDTH = 256


class K10Backward(k9.K9Backward):
    # What a variant (kernels/k10_experiments.py) changes: sdQ's stages (each a slot per dQ part),
    # the multiple a query tile is of, whether packed calls store dK and dV by TMA
    dq_stages = 1
    TILE_M_STEP = sm90.WGMMA_M  # dQ's GEMM takes the queries as M, 64 rows a warpgroup
    PACKED_TMA_STORE = False

    def __init__(self, head_dim: int, dtype, causal: bool, num_wg: int, tile_m: int, q_stages: int,
                 deterministic: bool = False, overlap: bool = False, dq_flat: bool = False,
                 ds_stmatrix: bool = False, last_first: bool = False, window: tuple = None, softcap: float = 0.0,
                 varlen: bool = False, mask_edges: bool = False, early_dq: bool = False,
                 dq_split_queries: bool = False, tanh_under_dp: bool = False, step_counter: bool = False,
                 plain_first: bool = False, dkv_tma_store: bool = False, pin_descriptors: bool = False,
                 unguarded_rows: bool = False, capped_overlap: bool = False):
        super().__init__(head_dim, dtype, causal, num_wg, tile_m, q_stages)
        self.varlen = varlen  # packed sequences: ``call_varlen``
        # mask_edges (FA3's): only a step on an edge (the diagonal, a window's side, a sequence's
        # end) runs the masks and the guards on LSE2 and D; the others take a copy without them
        self.mask_edges = mask_edges
        # early_dq (flash-attn-4's sm90 step): sdS a buffer per Q/dO stage, so no step waits for it
        # to be free; dQ's GEMM issued before dK's, its share stored while dK's runs, and each
        # warpgroup hands its half of sdQ to the writer on its own barriers, not waiting for the other
        self.early_dq = early_dq
        # dq_split_queries (flash-attn-4's d = 64 layout, 128 queries a step): the warpgroups split
        # dQ's queries, 64 each, so each issues m64n64 WGMMAs, not twice as many m64n32 ones
        self.dq_split_queries = dq_split_queries
        # tanh_under_dp: under a softcap, early_dq's step computes t = tanh(S * scale / c) while dP's
        # GEMM runs (in S's registers), and P and dS from t after it, rather than all of it after
        self.tanh_under_dp = tanh_under_dp and softcap > 0.0
        # capped_overlap: under a softcap, the overlapped start all the same: t = tanh(S * scale / c)
        # stays in S's registers for the slope 1 - t^2, and P is kept only as dV's 16-bit operand,
        # widened back for dS after dP's wait (the registers the uncapped start holds, no more)
        self.capped_overlap = capped_overlap and softcap > 0.0 and overlap
        # step_counter: each loop (loads, dQ writer, MMA) keeps its step's (head, query tile) and
        # advances it, rather than dividing the step index by the walk's length (``step_at``)
        self.step_counter = step_counter
        # plain_first: with mask_edges, the copy of the step without masks comes first in program
        # order (ptxas gave the first copy cheaper WGMMA descriptor arithmetic: 452 SASS a warp a
        # step against 530, d = 128)
        self.plain_first = plain_first
        # pin_descriptors: the staged SMEM operands (Q, dO, and early_dq's dS) as K5's
        # sm90.StagedOperand, a descriptor built once and advanced by the stage, in both copies
        self.pin_descriptors = pin_descriptors
        # unguarded_rows (rectangular calls): no guard on the query rows past the sequence. The TMA
        # fills them with zeros (Q, dO, LSE2 and D alike), so P = 1 and dP = 0 there: dV gains
        # P^T dO = 0, dK gains dS^T Q = 0, and their dQ rows are never stored. A step is then an
        # edge only for the masks. Packed, those rows are the next sequence's (compile_backward drops it)
        self.unguarded_rows = unguarded_rows
        assert not (unguarded_rows and varlen), "packed: a tile's rows past a sequence are the next one's"
        # dkv_tma_store (FA3's epilogue): dK and dV leave through sK and sV and a TMA store each,
        # rather than as 4-byte stores whose warp spans 8 rows (rectangular calls only: a packed
        # sequence's box would run into the next sequence's rows)
        self.dkv_tma_store = dkv_tma_store
        assert not (dkv_tma_store and varlen and not self.PACKED_TMA_STORE), "packed: dK and dV by rows"
        assert not self.tanh_under_dp or (early_dq and not overlap), "early_dq's step, its start without overlap"
        assert not dq_split_queries or tile_m % (sm90.WGMMA_M * num_wg) == 0
        assert not early_dq or (dq_flat and q_stages >= 2 and num_wg == 2), (
            "flat dQ shares, an sdS tile per stage (two at least), a barrier pair per warpgroup (Barrier names two)")
        assert not (softcap and overlap) or self.capped_overlap, "the overlapped start keeps no fp32 P under a cap"
        self.window = window  # Problem.window, or None: tiles.query_window_tiles bounds the walk
        self.softcap = softcap
        self.deterministic = deterministic
        self.last_first = last_first  # deterministic order: the key tiles seeing a query tile, last to first
        self.overlap = overlap  # variants, not yet measured: see mma_step_overlapped and store_dq
        self.dq_flat = dq_flat
        self.ds_stmatrix = ds_stmatrix
        self.dq_parts = num_wg if early_dq else 1  # TMA reduce-adds per share: one per warpgroup's half
        assert not dq_flat or tile_m * head_dim % (FLAT_WIDTH * self.dq_parts) == 0, "whole flat rows a part"
        self.dq_box = (tile_m * head_dim // FLAT_WIDTH // self.dq_parts, FLAT_WIDTH) if dq_flat else (tile_m, head_dim)
        self.mma_threads = sm90.THREADS_PER_WARPGROUP * num_wg
        self.num_threads = self.mma_threads + sm90.THREADS_PER_WARPGROUP  # + the producer warpgroup
        self.producer_regs, self.consumer_regs = k5.REGISTERS[num_wg]

    def tiled_mmas(self) -> tuple:
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = super().tiled_mmas()
        if self.dq_split_queries:
            tiled_mma_dq = k9.dq_mma(self.dtype, self.head_dim, self.num_wg, split_queries=True)
        return tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq

    def smem_layouts(self) -> tuple:
        """K9's; ``early_dq``: sdS a tile per Q/dO stage."""
        sK_layout, sQ_layout, sdS_layout = super().smem_layouts()
        if self.early_dq:
            sdS_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (self.tile_m, self.head_dim, self.tile_n),
                                                       self.dtype, self.q_stages)
        return sK_layout, sQ_layout, sdS_layout

    def mma_partitions(self, mmas: tuple, smem: tuple, wg_idx: Int32, tidx: Int32) -> tuple:
        """K9's; ``early_dq``: dQ's A operand (dS) with a trailing stage mode, as Q's and dO's."""
        if not self.early_dq:
            return super().mma_partitions(mmas, smem, wg_idx, tidx)
        sK, sV, sQ, sdO, sdS = smem
        parts = list(super().mma_partitions(mmas, (sK, sV, sQ, sdO, sdS[None, None, 0]), wg_idx, tidx))
        self.stage_ds_operand(parts, mmas[2].get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP), sdS)
        return tuple(parts)

    def stage_ds_operand(self, parts: list, wg_dq, sdS: cute.Tensor):
        """``mma_partitions``' dQ operand read from sdS, with its stage mode: tdQrdS (A)."""
        parts[6] = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
                 stream, mdQsem: Optional[cute.Tensor] = None):
        grid = (cute.ceil_div(mK.shape[2], self.tile_n), mK.shape[1], mK.shape[0])
        self.launch(mQ, mK, mV, mdO, mLSE2, mD, mdQaccum, mdK, mdV, softmax_scale, stream, mdQsem, None, grid)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                    mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                    softmax_scale: Float32, stream, mdQsem: Optional[cute.Tensor], mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor, mTiles: cute.Tensor):
        """Packed sequences: every tensor a (1, heads, total rows, ...) view, sequence b in rows
        cu_seqlens[b]:cu_seqlens[b + 1]. ``mTiles`` (pairs, 2): the (sequence, key tile) pairs
        there are, heaviest walk first (``harness.varlen.varlen_key_tiles``); one CTA per pair and
        K/V head, so no CTA is launched for a key tile past its sequence's keys, and the schedule
        ends on short walks."""
        grid = (mTiles.shape[0], mK.shape[1], 1)
        self.launch(mQ, mK, mV, mdO, mLSE2, mD, mdQaccum, mdK, mdV, softmax_scale, stream, mdQsem,
                    (mCuSeqlensQ, mCuSeqlensK, mTiles), grid)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
               stream, mdQsem: Optional[cute.Tensor], seqs: Optional[tuple], grid: tuple):
        dt, tile_m = self.dtype, self.tile_m
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = self.tiled_mmas()
        sK_layout, sQ_layout, sdS_layout = self.smem_layouts()
        sdQ_layout = tma_pipeline.row_major(*self.dq_box)  # fp32, as the TMA reduce reads it
        if cutlass.const_expr(self.early_dq):  # the same rows, a warpgroup's half a slot (dq_stages of them)
            sdQ_layout = tma_pipeline.row_major(*self.dq_box, self.dq_parts * self.dq_stages)
        # LSE2 or D of each stage's query rows; a stage starts 128-byte aligned, as a TMA box's
        # destination must (a tile_m that is not a multiple of 32 would put the second elsewhere)
        sRow_layout = cute.make_layout((tile_m, self.q_stages), stride=(1, -(-tile_m // 32) * 32))

        (tma_atom_K, mK_tma), (tma_atom_V, mV_tma), (tma_atom_Q, mQ_tma), (tma_atom_dO, mdO_tma) = self.tma_loads(
            mK, mV, mQ, mdO, sK_layout, sQ_layout)
        tma_atom_dQ, mdQ_tma = cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(),
                                                           tma_pipeline.seq_major_view(mdQaccum), sdQ_layout,
                                                           self.dq_box)
        # LSE2 and D ride the Q/dO ring: one TMA box of tile_m floats each per stage.
        rows_view = lambda m: cute.make_tensor(m.iterator, cute.select(m.layout, mode=[2, 1, 0]))  # noqa: E731
        tma_atom_LSE, mLSE_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rows_view(mLSE2),
                                                             cute.make_layout(tile_m), (tile_m,))
        tma_atom_D, mD_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rows_view(mD),
                                                         cute.make_layout(tile_m), (tile_m,))

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 128]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]

        if cutlass.const_expr(SharedStorage.size_in_bytes() > SMEM_CAPACITY):
            raise UnsupportedProblem(f"K10 (backward): {SharedStorage.size_in_bytes()} bytes of SMEM, more than "
                                     f"{SMEM_CAPACITY} (dq_stages={self.dq_stages}, q_stages={self.q_stages})")
        dkv_atoms = None  # dkv_tma_store: (atom, TMA view) of dK and dV, boxes of sK's layout
        if cutlass.const_expr(self.dkv_tma_store):
            dkv_atoms = tuple(cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), tma_pipeline.seq_major_view(m),
                                                          tma_pipeline.stage_layout(sK_layout),
                                                          (self.tile_n, self.head_dim)) for m in (mdK, mdV))

        self.kernel(mQ_tma, mK_tma, mV_tma, mdO_tma, mdQ_tma, mLSE_tma, mD_tma, mLSE2.shape, mdK, mdV, mdQsem, seqs,
                    dkv_atoms, (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dQ, tma_atom_LSE, tma_atom_D),
                    softmax_scale * LOG2_E, softmax_scale, (sK_layout, sQ_layout, sdS_layout, sdQ_layout, sRow_layout),
                    (tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq), SharedStorage).launch(grid=grid, block=[self.num_threads, 1, 1],
                                          smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ_tma: cute.Tensor, mK_tma: cute.Tensor, mV_tma: cute.Tensor, mdO_tma: cute.Tensor,
               mdQ_tma: cute.Tensor, mLSE_tma: cute.Tensor, mD_tma: cute.Tensor, q_rows: tuple, mdK: cute.Tensor,
               mdV: cute.Tensor, mdQsem: Optional[cute.Tensor], seqs: Optional[tuple], dkv_atoms: Optional[tuple],
               atoms: tuple, scale_log2: Float32, softmax_scale: Float32, layouts: tuple, mmas: tuple,
               SharedStorage: cutlass.Constexpr):
        tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_dQ, tma_atom_LSE, tma_atom_D = atoms
        sK_layout, sQ_layout, sdS_layout, sdQ_layout, sRow_layout = layouts
        tile_m, tile_n, stages = self.tile_m, self.tile_n, self.q_stages
        n_block, kv_head, batch = cute.arch.block_idx()
        seqlen, seqlen_k = q_rows[2], mdK.shape[2]
        group = q_rows[1] // mdK.shape[1]
        starts = None  # packed: where the sequence's queries, keys and LSE2/D rows start (TMA offsets)
        if cutlass.const_expr(self.varlen):  # block x: a (sequence, key tile) pair of the table
            mCuSeqlensQ, mCuSeqlensK, mTiles = seqs
            batch, n_block = mTiles[n_block, 0], mTiles[n_block, 1]
            q0, k0 = mCuSeqlensQ[batch], mCuSeqlensK[batch]
            seqlen, seqlen_k = mCuSeqlensQ[batch + 1] - q0, mCuSeqlensK[batch + 1] - k0
            starts = ((q0, 0), (k0, 0), packed_row_start(q0, batch), packed_tile_start(q0, batch, tile_m))
            mdK, mdV = k5.sequence_rows(mdK, k0, seqlen_k), k5.sequence_rows(mdV, k0, seqlen_k)
            batch = Int32(0)  # of the packed (1, heads, total, ...) views
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            tma_pipeline.prefetch_descriptors(*atoms)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        sLSE, sD = storage.sLSE.get_tensor(sRow_layout), storage.sD.get_tensor(sRow_layout)
        mma_warps = self.mma_threads // cute.arch.WARP_SIZE
        pipeline_kv = tma_pipeline.make_tma_pipeline(storage.mbar_kv.data_ptr(), 1, mma_warps,
                                                     tma_pipeline.stage_bytes(self.dtype, sK_layout, sK_layout))
        row_bytes = 2 * tile_m * 4  # LSE2 and D
        pipeline_qdo = tma_pipeline.make_tma_pipeline(storage.mbar_qdo.data_ptr(), stages, mma_warps,
                                                      tma_pipeline.stage_bytes(self.dtype, sQ_layout, sQ_layout)
                                                      + row_bytes)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        offset = seqlen_k - seqlen
        m_tiles = cute.ceil_div(seqlen, tile_m)
        m_first = cutlass.max(n_block * tile_n - offset, 0) // tile_m if cutlass.const_expr(self.causal) else 0
        per_head = m_tiles - m_first
        if cutlass.const_expr(self.window is not None):  # possibly none: a key before every query's window
            m_first, m_end = query_window_tiles(n_block, seqlen, seqlen_k, tile_m, tile_n, self.causal, self.window)
            per_head = m_end - m_first
        walk = (kv_head * group, m_first, per_head)
        count = per_head * group

        if warp_idx < 4:  # the producer warpgroup
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(pipeline_kv, pipeline_qdo, walk, count, n_block, kv_head, batch, starts,
                          (tma_atom_K, mK_tma, sK, tma_atom_V, mV_tma, sV),
                          (tma_atom_Q, mQ_tma, sQ, tma_atom_dO, mdO_tma, sdO, tma_atom_LSE, mLSE_tma, sLSE,
                           tma_atom_D, mD_tma, sD))
            elif warp_idx == 1:
                order = (mdQsem, n_block, q_rows[1], m_tiles, offset, cute.ceil_div(seqlen_k, tile_n))
                if cutlass.const_expr(self.varlen):  # the sequence's first semaphore
                    order = order + (starts[3],)
                self.write_dq(tma_atom_dQ, mdQ_tma, sdQ, walk, count, batch, starts, order)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.mma(pipeline_kv, pipeline_qdo, walk, count, n_block, kv_head, batch, (seqlen, offset, seqlen_k),
                     (sK, sV, sQ, sdO, sdS, sdQ), mmas, sLSE, sD, mdK, mdV, scale_log2, softmax_scale, dkv_atoms,
                     starts)

    # ---- Producer warpgroup: warp 0 loads, warp 1 writes dQ ------------------------------------

    @cute.jit
    def load(self, pipeline_kv, pipeline_qdo, walk: tuple, count: Int32, n_block: Int32, kv_head: Int32,
             batch: Int32, starts: Optional[tuple], kv_sources: tuple, qdo_sources: tuple):
        tma_atom_K, mK_tma, sK, tma_atom_V, mV_tma, sV = kv_sources
        tile = (self.tile_n, self.head_dim)
        keys = starts[1] if cutlass.const_expr(starts is not None) else None
        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_atom_K, mK_tma, sK, tile, kv_head, batch, (None, 0),
                                                    offset=keys)
        tVsV, tVgV = tma_pipeline.partition_for_tma(tma_atom_V, mV_tma, sV, tile, kv_head, batch, (None, 0),
                                                    offset=keys)
        tma_pipeline.load_kv_stage(pipeline_kv, tma_pipeline.pipe_state(1, 0, producer=True), n_block,
                                   tma_atom_K, tKgK, tKsK, tma_atom_V, tVgV, tVsV)
        if cutlass.const_expr(self.step_counter):  # step 0's (head, query tile)
            at_head, at_m = walk[0], Int32(walk[1])
        for t in cutlass.range(count, unroll=1):  # each waits until the consumers have released its stage
            if cutlass.const_expr(self.step_counter):
                self.load_qdo(pipeline_qdo, t, walk, batch, qdo_sources, starts, at=(at_head, at_m))
                at_head, at_m = self.next_step(at_head, at_m, walk)
            else:
                self.load_qdo(pipeline_qdo, t, walk, batch, qdo_sources, starts)
        # No mbarrier arrive may land after the CTA has exited: wait for the last releases.
        pipeline_qdo.producer_tail(tma_pipeline.pipe_state(self.q_stages, count, producer=True))

    @cute.jit
    def load_qdo(self, pipeline_qdo, t: Int32, walk: tuple, batch: Int32, sources: tuple, starts=None, at=None):
        """Producer: step t's Q and dO tiles and its rows' LSE2 and D, into stage t % q_stages, all
        four completing one barrier (packed, ``starts``: from the sequence's first row; ``at``: the
        step's (head, query tile), when the caller counts them)."""
        (tma_atom_Q, mQ_tma, sQ, tma_atom_dO, mdO_tma, sdO, tma_atom_LSE, mLSE_tma, sLSE, tma_atom_D, mD_tma,
         sD) = sources
        if cutlass.const_expr(at is None):
            head, m_block = self.step_at(t, walk)
        else:
            head, m_block = at
        tile = (self.tile_m, self.head_dim)
        rows = starts[0] if cutlass.const_expr(starts is not None) else None
        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_atom_Q, mQ_tma, sQ, tile, head, batch, (None, 0), offset=rows)
        tdOsdO, tdOgdO = tma_pipeline.partition_for_tma(tma_atom_dO, mdO_tma, sdO, tile, head, batch, (None, 0),
                                                        offset=rows)
        state = tma_pipeline.pipe_state(self.q_stages, t, producer=True)
        pipeline_qdo.producer_acquire(state)
        barrier = pipeline_qdo.producer_get_barrier(state)
        cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=barrier)
        cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=barrier)
        for atom, m_tma, s_rows in ((tma_atom_LSE, mLSE_tma, sLSE), (tma_atom_D, mD_tma, sD)):
            g_rows = m_tma[None, head, batch]
            if cutlass.const_expr(starts is not None):  # the pre-pass's padded rows: 16-byte aligned starts
                g_rows = cute.domain_offset((starts[2],), g_rows)
            g_rows = cute.local_tile(g_rows, (self.tile_m,), (None,))
            t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_rows, 0, 1),
                                             cute.group_modes(g_rows, 0, 1))
            cute.copy(atom, t_g[None, m_block], t_s[None, state.index], tma_bar_ptr=barrier)

    @cute.jit
    def write_dq(self, tma_atom_dQ: cute.CopyAtom, mdQ_tma: cute.Tensor, sdQ: cute.Tensor, walk: tuple,
                 count: Int32, batch: Int32, starts: Optional[tuple], order: tuple):
        """Each step's dQ share, once the MMA warps have written it to sdQ, added into the fp32
        accumulator by one TMA reduce-add; sdQ is handed back as soon as the TMA has read it.
        Deterministic (``order``: the semaphores, this CTA's key tile, heads, query tiles): a share
        waits for its turn, then counts itself added once it has landed."""
        handoff = self.mma_threads // self.dq_parts + cute.arch.WARP_SIZE
        if cutlass.const_expr(self.step_counter):  # step 0's (head, query tile)
            at_head, at_m = walk[0], Int32(walk[1])
        for t in cutlass.range(count, unroll=1):
            if cutlass.const_expr(self.step_counter):
                head, m_block = at_head, at_m
            else:
                head, m_block = self.step_at(t, walk)
            tdQsdQ, tdQgdQ = tma_pipeline.partition_for_tma(tma_atom_dQ, mdQ_tma, sdQ, self.dq_box, head, batch,
                                                            (None, 0), offset=self.dq_offset(starts))
            stage = self.dq_stage(t)
            for w in cutlass.range_constexpr(self.dq_parts):  # early_dq: each warpgroup's half as it comes
                pair = self.dq_pair(2 * w, stage)
                cute.arch.barrier(barrier_id=Barrier.DQ_FULL + pair, number_of_threads=handoff)
                if cutlass.const_expr(self.deterministic and w == 0):
                    self.wait_turn(order, head, m_block, batch)
                if cutlass.const_expr(self.early_dq):
                    cute.copy(tma_atom_dQ, tdQsdQ[None, w + self.dq_parts * stage],
                              tdQgdQ[None, m_block * self.dq_parts + w])
                else:
                    cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ[None, m_block])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                if t + self.dq_stages < count:  # the MMA warps wait for it before the stage's next share only
                    cute.arch.barrier_arrive(barrier_id=Barrier.DQ_EMPTY + pair, number_of_threads=handoff)
            if cutlass.const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # landed in GMEM, not just read
                self.pass_turn(order, head, m_block, batch)
            if cutlass.const_expr(self.step_counter):
                at_head, at_m = self.next_step(at_head, at_m, walk)
        cute.arch.cp_async_bulk_wait_group(0, read=False)  # the last reduce has landed in GMEM

    def dq_stage(self, t: Int32):
        """The sdQ stage step t's shares go to (one stage: 0, no code)."""
        return 0

    def dq_pair(self, pair, stage):
        """The DQ_FULL/DQ_EMPTY pair (an offset from DQ_FULL) of a share in sdQ stage ``stage``."""
        return pair

    def dq_offset(self, starts: Optional[tuple]):
        """Packed, where the sequence's dQ shares start in the accumulator: at its first row, or,
        ``dq_flat``, at its first query tile's slot (``packed_tile_start``; a slot per tile)."""
        if starts is None:
            return None
        return (starts[3] * self.dq_box[0] * self.dq_parts, 0) if self.dq_flat else starts[0]

    @cute.jit
    def next_step(self, head: Int32, m_block: Int32, walk: tuple) -> tuple:
        """(head, query tile) of the step after (head, m_block) in the walk (``step_counter``):
        the next tile, or the next head's first."""
        m_block = m_block + 1
        if m_block == walk[1] + walk[2]:
            head, m_block = head + 1, Int32(walk[1])
        return head, m_block

    @cute.jit
    def wait_turn(self, order: tuple, head: Int32, m_block: Int32, batch: Int32):
        """Deterministic: wait until the shares due before this one have been added. The key tiles
        that see query tile i are 0..J(i) (causal too: a prefix). In key-tile order this tile's turn
        is its index, and it waits only for CTAs launched before it. Causal, key tile j reaches i
        i - m_first(j) steps into its walk, so the shares arrive last tile first: turn J(i) - j
        costs no waiting, but waits for CTAs launched after this one, which is safe only when all
        of one (batch, K/V head)'s key tiles fit on the GPU at once (``last_first``, set by the
        host)."""
        mdQsem, n_block, nheads, m_tiles, offset, n_tiles = order[:6]
        lock = self.semaphore(order, head, m_block, batch)
        turn_due = n_block
        if cutlass.const_expr(self.window is not None):  # the key tiles that see query tile i: [first, end)
            seqlen_k = n_tiles * self.tile_n  # only its tile count matters here
            first, _, _, end = kv_window_tiles(m_block, seqlen_k - offset, seqlen_k, self.tile_m, self.tile_n,
                                               self.causal, self.window)
            turn_due = end - 1 - n_block if cutlass.const_expr(self.last_first) else n_block - first
        elif cutlass.const_expr(self.last_first):
            last = cutlass.min(((m_block + 1) * self.tile_m + offset - 1) // self.tile_n, n_tiles - 1)
            turn_due = last - n_block
        if cute.arch.lane_idx() == 0:
            turn = cute.arch.load(lock, Int32, sem="acquire", scope="gpu")
            while turn != turn_due:
                turn = cute.arch.load(lock, Int32, sem="acquire", scope="gpu")
        cute.arch.sync_warp()
        cute.arch.fence_proxy("async.global")  # the earlier shares, seen through the acquire, for the TMA

    @cute.jit
    def pass_turn(self, order: tuple, head: Int32, m_block: Int32, batch: Int32):
        if cute.arch.lane_idx() == 0:
            cute.arch.fence_proxy("async.global")  # this share's adds before the release that announces them
            cute.arch.red(self.semaphore(order, head, m_block, batch), Int32(1), op="add", dtype=Int32,
                          sem="release", scope="gpu")

    @cute.jit
    def semaphore(self, order: tuple, head: Int32, m_block: Int32, batch: Int32):
        """Query tile ``m_block``'s dQ semaphore: one per (batch, head, query tile), or packed, per
        head a table of every sequence's tiles from the sequence's first (``packed_tile_start``)."""
        mdQsem, nheads, m_tiles = order[0], order[2], order[3]
        if cutlass.const_expr(self.varlen):
            return mdQsem.iterator + head * (mdQsem.shape[0] // nheads) + order[6] + m_block
        return mdQsem.iterator + (batch * nheads + head) * m_tiles + m_block

    @cute.jit
    def p_and_ds(self, acc_S: cute.Tensor, acc_dP: cute.Tensor, tScS: cute.Tensor, sLSE: cute.Tensor,
                 sD: cute.Tensor, n_block: Int32, m_block: Int32, lens: tuple, scale_log2: Float32,
                 softmax_scale: Float32, edge: bool = True, capped: bool = False):
        """K9's ``p_and_ds`` column by column, LSE2 and D from the stage's SMEM rows (the producer's
        TMA brought them with Q and dO): each column's pair is read once, as it is needed. With a
        softcap c the forward's score was c * t, t = tanh(S * scale / c): P = exp2(c * log2(e) * t
        - LSE2), and the chain rule through the cap multiplies dS by 1 - t^2 (``capped``: acc_S
        holds t already, ``cap_scores``)."""
        seqlen, offset, seqlen_k = lens
        s_mn, dp_mn, c_mn = sm90.acc_mn_view(acc_S), sm90.acc_mn_view(acc_dP), sm90.acc_mn_view(tScS)
        if cutlass.const_expr(self.softcap > 0.0):
            cap_scale, scale_log2 = softmax_scale * (1.0 / self.softcap), Float32(self.softcap * LOG2_E)
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            q, lse2, dot = self.column_rows(c_mn, c, m_block, seqlen, sLSE, sD, edge)
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                score, slope = s_mn[r, c], None
                if cutlass.const_expr(self.softcap > 0.0):
                    if cutlass.const_expr(not capped):
                        score = sm90.tanh_approx(score * cap_scale)
                    slope = 1.0 - score * score
                p = self.probability(score, lse2, (n_block, c_mn[r, c][0], seqlen_k), (q, offset), scale_log2, edge)
                s_mn[r, c] = p
                dp_mn[r, c] = self.score_grad(p, dp_mn[r, c], dot, softmax_scale, slope)

    def score_grad(self, p, dp, dot, softmax_scale, slope=None):
        """One score's dS = P * (dP - D), times a softcap's slope 1 - t^2 (``slope``) and softmax_scale."""
        return p * (dp - dot) * (softmax_scale if slope is None else softmax_scale * slope)

    @cute.jit
    def cap_scores(self, acc_S: cute.Tensor, softmax_scale: Float32):
        """In place, S^T -> t = tanh(S^T * scale / c): the softcap's tanh, alone (``tanh_under_dp``)."""
        cap_scale = softmax_scale * (1.0 / self.softcap)
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[i] = sm90.tanh_approx(acc_S[i] * cap_scale)

    def hidden(self, key: Int32, diagonal: Int32):
        """Whether a query row whose diagonal key is ``diagonal`` (row + seqlen_k - seqlen) does
        not see ``key``: causal, past the diagonal; a window, outside (left, right) of it. None
        when every key is seen (no mask at all)."""
        out = None
        if cutlass.const_expr(self.causal):
            out = key > diagonal
        left, right = self.window if cutlass.const_expr(self.window is not None) else (-1, -1)
        if cutlass.const_expr(right >= 0 and not self.causal):
            out = key > diagonal + right
        if cutlass.const_expr(left >= 0):
            out = (key < diagonal - left) if cutlass.const_expr(out is None) else out | (key < diagonal - left)
        return out

    @cute.jit
    def column_rows(self, c_mn: cute.Tensor, c: int, m_block: Int32, seqlen: Int32, sLSE=None, sD=None,
                    edge: bool = True):
        """(query, LSE2, D) of column ``c`` of the S^T tile: its query row's LSE2 (with ``sLSE``) and
        D (with ``sD``) from the stage's SMEM rows; past the sequence the TMA filled zeros, so LSE2 =
        +inf there makes P 0, and D is 0 (``edge``: a tile that may run past the sequence)."""
        row = c_mn[0, c][1]
        q = m_block * self.tile_m + row
        lse2, dot = Float32(float("inf")), Float32(0.0)
        if cutlass.const_expr(not edge or self.unguarded_rows):
            lse2, dot = self.row_values(row, sLSE, sD, lse2, dot)
        else:
            lse2, dot = self.guarded_row_values(row, q, seqlen, sLSE, sD, lse2, dot)
        return q, lse2, dot

    @cute.jit
    def guarded_row_values(self, row: Int32, q: Int32, seqlen: Int32, sLSE, sD, lse2: Float32, dot: Float32) -> tuple:
        """``row_values`` on an edge step: read only for a query inside the sequence."""
        if q < seqlen:
            lse2, dot = self.row_values(row, sLSE, sD, lse2, dot)
        return lse2, dot

    @staticmethod
    def row_values(row, sLSE, sD, lse2, dot) -> tuple:
        """``column_rows``' reads: the row's LSE2 and D from the rows given, the defaults otherwise."""
        return (lse2 if sLSE is None else sLSE[row]), (dot if sD is None else sD[row])

    @cute.jit
    def probability(self, score: Float32, lse2: Float32, key: tuple, query: tuple, scale_log2: Float32,
                    edge: bool = True) -> Float32:
        """P = exp2(S * scale_log2 - LSE2) of one score; 0 where the query does not see the key
        (``hidden``; ``key``: its key tile, its column there and the sequence's key count; ``query``:
        the query and the diagonal's offset). Packed and not causal, also past the sequence's keys:
        the last key tile holds the next sequence's first keys, not the TMA's zeros."""
        p = cute.math.exp2(score * scale_log2 - lse2, fastmath=True)
        if cutlass.const_expr(edge and (self.causal or self.window is not None or self.varlen)):
            (n_block, column, seqlen_k), (q, offset) = key, query
            index = n_block * self.tile_n + column
            out = self.hidden(index, q + offset)
            if cutlass.const_expr(self.varlen and not self.causal):
                out = (index >= seqlen_k) if cutlass.const_expr(out is None) else out | (index >= seqlen_k)
            if out:
                p = Float32(0.0)
        return p

    @cute.jit
    def on_edge(self, n_block: Int32, m_block: Int32, lens: tuple):
        """Whether the (key tile, query tile) step may hold a pair ``probability`` masks or a row
        ``column_rows`` guards: its query tile runs past the sequence, ``hidden`` hides one of the
        tile's two corner pairs, or (packed, not causal) its key tile runs past the sequence's keys.
        The corners suffice: a key past the diagonal (causal, a window's right side) is hidden first
        at (last key, first query), a key before the window's left side at (first key, last query)."""
        seqlen, offset, seqlen_k = lens
        first_q, first_k = m_block * self.tile_m, n_block * self.tile_n
        last_q, last_k = first_q + self.tile_m - 1, first_k + self.tile_n - 1
        edge = last_q >= seqlen
        above, below = self.hidden(last_k, first_q + offset), self.hidden(first_k, last_q + offset)
        if cutlass.const_expr(self.unguarded_rows and above is not None):  # only the masks make an edge
            edge = above | below
        elif cutlass.const_expr(above is not None):  # None: no causal mask and no window
            edge = edge | above | below
        if cutlass.const_expr(self.varlen and not self.causal):
            edge = edge | (last_k >= seqlen_k)
        return edge

    # ---- MMA warpgroups: K9's step, with named barriers and dQ through sdQ --------------------

    @cute.jit
    def issue_s_and_dp(self, tiled_mma_sdp: cute.TiledMma, accs: tuple, operands: tuple, stage: Int32,
                       running: cutlass.Constexpr[int], ahead: tuple = None):
        """S^T's GEMM, then dP^T's, issued; the wait leaves ``running`` of them (the last) in flight.
        ``ahead`` ((tScS, the stage's LSE2 row, edge)): ``lse2_ahead`` between the two issues, returned."""
        tSrK, tSrQ, tdPrV, tdPrdO = operands[:4]
        sm90.gemm(tiled_mma_sdp, accs[0], tSrK, tSrQ[None, None, None, stage], zero_init=True, wg_wait=-1)
        lse2 = None
        if cutlass.const_expr(ahead is not None):
            lse2 = self.lse2_ahead(*ahead)
        sm90.gemm(tiled_mma_sdp, accs[1], tdPrV, tdPrdO[None, None, None, stage], zero_init=True, wg_wait=running)
        return lse2

    def lse2_ahead(self, tScS: cute.Tensor, sLSE: cute.Tensor, edge: bool):
        """The overlapped start's columns' LSE2, read between S^T's issue and dP^T's (None: read as
        P needs them)."""
        return None

    def d_ahead(self, tScS: cute.Tensor, sD: cute.Tensor, edge: bool):
        """The overlapped start's columns' D, read before dP^T's wait (None: read as dS needs them)."""
        return None

    @cute.jit
    def wait_for_dp(self, dv_mma: cute.TiledMma, accs: tuple, operands: tuple, stage: Int32) -> bool:
        """The overlapped start's wait for dP^T's GEMM; whether it issued dV's GEMM (no: the step does)."""
        warpgroup.wait_group(0)
        return False

    @cute.jit
    def scores_and_grads(self, tiled_mma_sdp: cute.TiledMma, accs: tuple, operands: tuple, tScS: cute.Tensor,
                         rows: tuple, n_block: Int32, m_block: Int32, lens: tuple, scale_log2: Float32,
                         softmax_scale: Float32, edge: bool):
        """A step's start (both steps but the overlapped one): S^T and dP^T, waited for, then
        ``p_and_ds`` on them."""
        acc_S, acc_dP = accs[0], accs[1]
        stage = rows[2]
        self.issue_s_and_dp(tiled_mma_sdp, accs, operands, stage, 0)
        self.p_and_ds(acc_S, acc_dP, tScS, rows[0][None, stage], rows[1][None, stage], n_block, m_block, lens,
                      scale_log2, softmax_scale, edge)

    @cute.jit
    def mma_step(self, mmas: tuple, accs: tuple, operands: tuple, tScS: cute.Tensor, sdS: cute.Tensor, rows: tuple,
                 n_block: Int32, m_block: Int32, lens: tuple, scale_log2: Float32, softmax_scale: Float32,
                 edge: bool = True):
        """One query tile's five GEMMs and their element-wise work; dQ's share into acc_dQ."""
        self.scores_and_grads(mmas[0], accs, operands, tScS, rows, n_block, m_block, lens, scale_log2,
                              softmax_scale, edge)
        self.weight_grads(mmas, accs, operands[4:], tScS, sdS, rows[2])

    @cute.jit
    def weight_grads(self, mmas: tuple, accs: tuple, operands: tuple, tScS: cute.Tensor, sdS: cute.Tensor,
                     stage: Int32):
        """``mma_step``'s second half, from P^T and dS^T: dV's, dK's and dQ's GEMMs."""
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        acc_S, acc_dP, acc_dK, acc_dV, acc_dQ = accs
        tdVrP, tdVrdO, tdKrdS, tdKrQ, tdQrdS, tdQrK = operands
        # One fp32 tile at a time beside dK and dV (the MMA warps have 240 registers): P^T goes
        # to dV's GEMM, then dS^T to sdS and to dK's GEMM.
        sm90.convert_to(sm90.acc_as_operand_a(acc_S), tdVrP)
        self.dv_then_dk(mmas, accs, operands, tScS, sdS, stage)
        # dV's and dK's GEMMs read P^T and dS^T from registers until they retire
        warpgroup.wait_group(0)
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)
        sm90.gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrK, zero_init=True, wg_wait=0)

    @cute.jit
    def dv_then_dk(self, mmas: tuple, accs: tuple, operands: tuple, tScS: cute.Tensor, sdS: cute.Tensor,
                   stage: Int32):
        """From P^T (already dV's operand) and dS^T: dV's GEMM issued, dS^T to sdS once it is free,
        then to dK's GEMM (both left running)."""
        tiled_mma_sdp, tiled_mma_dkv = mmas[0], mmas[1]
        acc_dP, acc_dK, acc_dV = accs[1], accs[2], accs[3]
        tdVrP, tdVrdO, tdKrdS, tdKrQ = operands[:4]
        sm90.gemm(tiled_mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, stage], zero_init=False, wg_wait=-1)
        self.wait_ds_free()
        self.store_dS(acc_dP, tScS, sdS, tiled_mma_sdp)
        cute.arch.fence_view_async_shared()
        sm90.convert_to(sm90.acc_as_operand_a(acc_dP), tdKrdS)
        sm90.gemm(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQ[None, None, None, stage], zero_init=False, wg_wait=-1)

    @cute.jit
    def mma_step_overlapped(self, mmas: tuple, accs: tuple, operands: tuple, tScS: cute.Tensor, sdS: cute.Tensor,
                            rows: tuple, n_block: Int32, m_block: Int32, lens: tuple, scale_log2: Float32,
                            softmax_scale: Float32, edge: bool = True):
        """``mma_step`` with less waiting (FA3's order): P is computed while dP's GEMM still runs
        (wait for S alone), and dQ's GEMM is issued behind dV's and dK's with one wait for all
        three. A variant until measured against ``mma_step``."""
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        acc_S, acc_dP, acc_dK, acc_dV, acc_dQ = accs
        tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO, tdKrdS, tdKrQ, tdQrdS, tdQrK = operands
        stage = rows[2]
        self.overlapped_start(tiled_mma_sdp, accs, operands, tScS, rows, n_block, m_block, lens, scale_log2,
                              softmax_scale, edge)
        self.dv_then_dk(mmas, accs, operands[4:], tScS, sdS, stage)
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)  # every dS^T stored
        sm90.gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrK, zero_init=True, wg_wait=0)  # dV's, dK's and dQ's

    @cute.jit
    def overlapped_start(self, tiled_mma_sdp: cute.TiledMma, accs: tuple, operands: tuple, tScS: cute.Tensor,
                         rows: tuple, n_block: Int32, m_block: Int32, lens: tuple, scale_log2: Float32,
                         softmax_scale: Float32, edge: bool, dv_mma: cute.TiledMma = None) -> bool:
        """The overlapped steps' start: S^T and dP^T issued, P^T computed (and converted to dV's
        operand) while dP^T's GEMM still runs, then dS^T. Returns ``wait_for_dp``'s answer."""
        acc_S, acc_dP, tdVrP = accs[0], accs[1], operands[4]
        stage = rows[2]
        lse2 = self.issue_s_and_dp(tiled_mma_sdp, accs, operands, stage, 1,  # S done, dP runs on
                                   (tScS, rows[0][None, stage], edge))
        acc_P = acc_S
        if cutlass.const_expr(self.capped_overlap):  # acc_S keeps t for the slope; P goes to dV's operand only
            self.cap_scores(acc_S, softmax_scale)
            acc_P = cute.make_rmem_tensor_like(acc_S)
            scale_log2 = Float32(self.softcap * LOG2_E)
        self.probabilities(acc_S, tScS, rows[0][None, stage], n_block, m_block, lens, scale_log2, edge, lse2, acc_P)
        sm90.convert_to(sm90.acc_as_operand_a(acc_P), tdVrP)
        dot = self.d_ahead(tScS, rows[1][None, stage], edge)
        dv_issued = self.wait_for_dp(dv_mma, accs, operands, stage)
        slopes = None
        if cutlass.const_expr(self.capped_overlap):  # P back from dV's operand into the scratch tile
            slopes = acc_S
            sm90.convert_from(tdVrP, sm90.acc_as_operand_a(acc_P))
        self.score_grads(acc_P, acc_dP, tScS, rows[1][None, stage], m_block, lens[0], softmax_scale, edge, dot,
                         slopes)
        return dv_issued

    @cute.jit
    def mma_step_early(self, mmas: tuple, accs: tuple, operands: tuple, tScS: cute.Tensor, sdS: cute.Tensor,
                       rows: tuple, n_block: Int32, m_block: Int32, lens: tuple, scale_log2: Float32,
                       softmax_scale: Float32, edge: bool = True, dq: tuple = None):
        """``mma_step_overlapped`` (or, without ``overlap``, ``mma_step``'s start) in flash-attn-4's
        order (``early_dq``): dS^T to this stage's sdS (the step before wrote the other one), dQ's
        GEMM before dK's, and this warpgroup's dQ share stored to sdQ while dK's GEMM runs. ``dq``:
        (step, tdQcdQ, sdQ, thread, warpgroup)."""
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        acc_S, acc_dP, acc_dK, acc_dV, acc_dQ = accs
        tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO, tdKrdS, tdKrQ, tdQrdS, tdQrK = operands
        t, tdQcdQ, sdQ, tidx, wg_idx = dq
        stage = rows[2]
        dv_issued = False
        if cutlass.const_expr(self.overlap):
            dv_issued = self.overlapped_start(tiled_mma_sdp, accs, operands, tScS, rows, n_block, m_block, lens,
                                              scale_log2, softmax_scale, edge, tiled_mma_dkv)
        elif cutlass.const_expr(self.tanh_under_dp):  # the cap's tanh while dP's GEMM runs, P after it
            self.issue_s_and_dp(tiled_mma_sdp, accs, operands, stage, 1)
            self.cap_scores(acc_S, softmax_scale)
            warpgroup.wait_group(0)
            self.p_and_ds(acc_S, acc_dP, tScS, rows[0][None, stage], rows[1][None, stage], n_block, m_block, lens,
                          scale_log2, softmax_scale, edge, capped=True)
            sm90.convert_to(sm90.acc_as_operand_a(acc_S), tdVrP)
        else:  # a softcap: tanh's slope is not kept past dP's wait, so both GEMMs first, as mma_step
            self.scores_and_grads(tiled_mma_sdp, accs, operands, tScS, rows, n_block, m_block, lens, scale_log2,
                                  softmax_scale, edge)
            sm90.convert_to(sm90.acc_as_operand_a(acc_S), tdVrP)
        if cutlass.const_expr(not dv_issued):
            sm90.gemm(tiled_mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, stage], zero_init=False, wg_wait=-1)
        self.store_dS(acc_dP, tScS, sdS[None, None, stage], tiled_mma_sdp)
        cute.arch.fence_view_async_shared()
        sm90.convert_to(sm90.acc_as_operand_a(acc_dP), tdKrdS)
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)  # every dS^T stored
        dq_a, dq_b = self.dq_gemm_operands(tdQrdS, tdQrK, stage)
        sm90.gemm(tiled_mma_dq, acc_dQ, dq_a, dq_b, zero_init=True, wg_wait=1)  # dV's done
        sm90.gemm(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQ[None, None, None, stage], zero_init=False, wg_wait=1)  # dQ's
        self.hand_over_dq(acc_dQ, tdQcdQ, sdQ, tidx, t, 2 * wg_idx, sm90.THREADS_PER_WARPGROUP)  # its own pair
        warpgroup.wait_group(0)  # dK's GEMM reads dS^T from registers until it retires

    def dq_gemm_operands(self, tdQrdS, tdQrK, stage: Int32) -> tuple:
        """early_dq's dQ GEMM operands in (A, B) order: this stage's dS, and K."""
        return tdQrdS[None, None, None, stage], tdQrK

    @cute.jit
    def hand_over_dq(self, acc_dQ: cute.Tensor, tdQcdQ: cute.Tensor, sdQ: cute.Tensor, tidx: Int32, t: Int32,
                     pair, threads: cutlass.Constexpr[int]):
        """Step t's dQ share into sdQ and over to the writer on the barriers DQ_FULL + ``pair`` and
        DQ_EMPTY + ``pair``, shared by ``threads`` MMA threads and the writer warp: wait until its
        TMA has read the share before (none before step 0), store, fence for the async proxy, arrive."""
        handoff = threads + cute.arch.WARP_SIZE
        sdQ, pair = self.wait_dq_free(sdQ, t, pair, handoff)
        self.store_dq(acc_dQ, tdQcdQ, sdQ, tidx)
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> the TMA's reads
        cute.arch.barrier_arrive(barrier_id=Barrier.DQ_FULL + pair, number_of_threads=handoff)

    @cute.jit
    def wait_dq_free(self, sdQ: cute.Tensor, t: Int32, pair, handoff: cutlass.Constexpr[int]) -> tuple:
        """``hand_over_dq``'s wait for the writer's read of the share before; (the sdQ stage and the
        barrier pair step t's share takes)."""
        if t > 0:
            cute.arch.barrier(barrier_id=Barrier.DQ_EMPTY + pair, number_of_threads=handoff)
        return sdQ, pair

    @cute.jit
    def wait_ds_free(self):
        """Before a step writes sdS: both warpgroups' dQ GEMMs of the step before are done with it."""
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)

    @cute.jit
    def store_dS(self, acc_dS: cute.Tensor, tScS: cute.Tensor, sdS: cute.Tensor, tiled_mma_sdp: cute.TiledMma):
        """dS^T into sdS[query, key]: K9's 2-byte stores, or, ``ds_stmatrix``, narrowed in the C
        layout and written by ``stmatrix`` (8x8 tiles, 16-byte rows: sdS's query axis is
        contiguous, the accumulator's N axis), as the TMA-store epilogue writes O."""
        if cutlass.const_expr(not self.ds_stmatrix):
            self.store_ds(acc_dS, tScS, sdS)
        else:
            rdS = cute.make_rmem_tensor_like(acc_dS, self.dtype)
            sm90.convert_to(acc_dS, rdS)
            atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            thr = cute.make_tiled_copy_C(atom, tiled_mma_sdp).get_slice(cute.arch.thread_idx()[0]
                                                                       - sm90.THREADS_PER_WARPGROUP)
            cute.copy(atom, thr.retile(rdS), thr.partition_D(k9.transpose_view(sdS)))

    @cute.jit
    def store_dq(self, acc_dQ: cute.Tensor, tdQcdQ: cute.Tensor, sdQ: cute.Tensor, tidx: Int32):
        """This thread's dQ share into sdQ: at [row, col] (column pairs, 8-byte stores), or, ``dq_flat``,
        in register order, 4 floats at a time with the warpgroup's threads side by side (16-byte
        stores, no bank conflicts); ``FlatPostpass`` reads that order back."""
        if cutlass.const_expr(not self.dq_flat):
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                row, col = self.dq_coord(tdQcdQ[i])
                sdQ[row, col] = acc_dQ[i]
        else:
            per_thread = cute.size(acc_dQ)
            threads = sm90.THREADS_PER_WARPGROUP
            base = (tidx // threads) * threads * per_thread + (tidx % threads) * 4
            flat = cute.make_tensor(sdQ.iterator + base, cute.make_layout((4, per_thread // 4), stride=(1, 4 * threads)))
            cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout((4, per_thread // 4))), flat)

    def dq_coord(self, coord) -> tuple:
        """(row, col) in sdQ of a dQ share's element at ``coord`` of its GEMM's C tile."""
        return coord

    @cute.jit
    def probabilities(self, acc_S: cute.Tensor, tScS: cute.Tensor, sLSE: cute.Tensor, n_block: Int32,
                      m_block: Int32, lens: tuple, scale_log2: Float32, edge: bool = True, lse2_ahead=None,
                      out: cute.Tensor = None):
        """``p_and_ds``'s first half: acc_S (or ``out``) becomes P^T, column by column (``lse2_ahead``:
        the columns' LSE2, read already)."""
        seqlen, offset, seqlen_k = lens
        s_mn, c_mn = sm90.acc_mn_view(acc_S), sm90.acc_mn_view(tScS)
        p_mn = s_mn if cutlass.const_expr(out is None) else sm90.acc_mn_view(out)
        for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            q, lse2, _ = self.column_rows(c_mn, c, m_block, seqlen, None if cutlass.const_expr(
                lse2_ahead is not None) else sLSE, None, edge)
            if cutlass.const_expr(lse2_ahead is not None):
                lse2 = lse2_ahead[c]
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                p_mn[r, c] = self.probability(s_mn[r, c], lse2, (n_block, c_mn[r, c][0], seqlen_k), (q, offset),
                                              scale_log2, edge)

    @cute.jit
    def score_grads(self, acc_P: cute.Tensor, acc_dP: cute.Tensor, tScS: cute.Tensor, sD: cute.Tensor,
                    m_block: Int32, seqlen: Int32, softmax_scale: Float32, edge: bool = True, dot_ahead=None,
                    slopes: cute.Tensor = None):
        """``p_and_ds``'s second half: acc_dP becomes dS^T * scale (``dot_ahead``: the columns' D, read
        already; ``slopes``: a softcap's t, whose 1 - t^2 the chain rule multiplies in)."""
        p_mn, dp_mn, c_mn = sm90.acc_mn_view(acc_P), sm90.acc_mn_view(acc_dP), sm90.acc_mn_view(tScS)
        for c in cutlass.range_constexpr(cute.size(p_mn, mode=[1])):
            if cutlass.const_expr(dot_ahead is not None):
                dot = dot_ahead[c]
            else:
                _, _, dot = self.column_rows(c_mn, c, m_block, seqlen, None, sD, edge)
            for r in cutlass.range_constexpr(cute.size(p_mn, mode=[0])):
                slope = None
                if cutlass.const_expr(slopes is not None):
                    t = sm90.acc_mn_view(slopes)[r, c]
                    slope = 1.0 - t * t
                dp_mn[r, c] = self.score_grad(p_mn[r, c], dp_mn[r, c], dot, softmax_scale, slope)

    @cute.jit
    def mma(self, pipeline_kv, pipeline_qdo, walk: tuple, count: Int32, n_block: Int32, kv_head: Int32,
            batch: Int32, lens: tuple, smem: tuple, mmas: tuple, sLSE: cute.Tensor, sD: cute.Tensor,
            mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32, softmax_scale: Float32,
            dkv_atoms: Optional[tuple] = None, starts: Optional[tuple] = None):
        """The MMA warpgroups: the walk, then dK and dV out (``starts``: packed, where the sequence's
        rows start, as ``kernel`` found them)."""
        sK, sV, sQ, sdO, sdS, sdQ = smem
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        tile_m, tile_n, stages = self.tile_m, self.tile_n, self.q_stages
        tidx = cute.arch.thread_idx()[0] - sm90.THREADS_PER_WARPGROUP  # among the MMA threads
        wg_idx = cute.arch.make_warp_uniform(tidx // sm90.THREADS_PER_WARPGROUP)

        (tSrK, tdPrV, tSrQ, tdPrdO, tdVrdO, tdKrQ, tdQrdS, tdQrK, tdVrP, tdKrdS, acc_dV, acc_dK, tScS,
         tdQcdQ) = self.mma_partitions(mmas, (sK, sV, sQ, sdO, sdS), wg_idx, tidx)
        if cutlass.const_expr(self.pin_descriptors):
            tSrQ, tdPrdO, tdVrdO, tdKrQ = (sm90.StagedOperand(x) for x in (tSrQ, tdPrdO, tdVrdO, tdKrQ))
            if cutlass.const_expr(self.early_dq):
                tdQrdS, tdQrK = self.pin_staged_dq(tdQrdS, tdQrK)

        pipeline_kv.consumer_wait(tma_pipeline.pipe_state(1, 0, producer=False))
        if cutlass.const_expr(self.step_counter):  # step 0's (head, query tile)
            at_head, at_m = walk[0], Int32(walk[1])
        for t in cutlass.range(count, unroll=1):
            if cutlass.const_expr(self.step_counter):
                head, m_block = at_head, at_m
            else:
                head, m_block = self.step_at(t, walk)
            qdo = tma_pipeline.pipe_state(stages, t, producer=False)
            pipeline_qdo.consumer_wait(qdo)
            acc_S = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((tile_n, tile_m)), Float32)
            acc_dP = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((tile_n, tile_m)), Float32)
            acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C(self.dq_tile), Float32)
            operands = (tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdVrdO, tdKrdS, tdKrQ, tdQrdS, tdQrK)
            step = self.mma_step_overlapped if cutlass.const_expr(self.overlap) else self.mma_step
            kw = {}
            if cutlass.const_expr(self.early_dq):  # the step hands its dQ share over itself
                step, kw = self.mma_step_early, dict(dq=(t, tdQcdQ, sdQ, tidx, wg_idx))
            self.before_step(t)
            args = (mmas, (acc_S, acc_dP, acc_dK, acc_dV, acc_dQ), operands, tScS, sdS, (sLSE, sD, qdo.index),
                    n_block, m_block, lens, scale_log2, softmax_scale)
            if cutlass.const_expr(self.unguarded_rows and not self.causal and self.window is None):
                step(*args, edge=False, **kw)  # nothing to mask and no row to guard: no edge
            elif cutlass.const_expr(self.mask_edges and self.plain_first):
                if cutlass.not_(self.on_edge(n_block, m_block, lens)):
                    step(*args, edge=False, **kw)
                else:
                    step(*args, **kw)
            elif cutlass.const_expr(self.mask_edges):
                if self.on_edge(n_block, m_block, lens):
                    step(*args, **kw)
                else:
                    step(*args, edge=False, **kw)
            else:
                step(*args, **kw)
            pipeline_qdo.consumer_release(qdo)
            if cutlass.const_expr(not self.early_dq):  # both warpgroups' shares on one pair
                self.hand_over_dq(acc_dQ, tdQcdQ, sdQ, tidx, t, 0, self.mma_threads)
            if cutlass.const_expr(self.step_counter):
                at_head, at_m = self.next_step(at_head, at_m, walk)

        self.end_walk(acc_dK, softmax_scale)
        self.store_dkv((acc_dK, acc_dV), (sK, sV), (mdK, mdV), tiled_mma_dkv, tidx, dkv_atoms, n_block, kv_head, batch,
                       lens, starts)

    def pin_staged_dq(self, tdQrdS, tdQrK) -> tuple:
        """``pin_descriptors`` with early_dq: the staged dQ operand (dS) pinned too."""
        return sm90.StagedOperand(tdQrdS), tdQrK

    def before_step(self, t: Int32):
        """Hook: the MMA warps' work before step t (none)."""

    def end_walk(self, acc_dK: cute.Tensor, softmax_scale: Float32):
        """Hook: dK's accumulator once the walk is done, before it is stored (as it is)."""

    @cute.jit
    def store_dkv(self, accs: tuple, smem: tuple, outs: tuple, tiled_mma_dkv: cute.TiledMma, tidx: Int32,
                  dkv_atoms: Optional[tuple], n_block: Int32, kv_head: Int32, batch: Int32, lens: tuple,
                  starts: Optional[tuple]):
        """dK and dV out: by TMA (``dkv_tma_store``), or row by row."""
        if cutlass.const_expr(self.dkv_tma_store):
            self.store_dkv_tma(accs, smem, tiled_mma_dkv, tidx, dkv_atoms, n_block, kv_head, batch)
        else:
            self.store_dkv_rows(accs, outs, tiled_mma_dkv, tidx, n_block, kv_head, batch)

    @cute.jit
    def store_dkv_rows(self, accs: tuple, outs: tuple, tiled_mma_dkv: cute.TiledMma, tidx: Int32, n_block: Int32,
                       kv_head: Int32, batch: Int32):
        """dK and dV narrowed in registers and stored from the accumulator layout, row-guarded."""
        for acc, mX in zip(accs, outs):
            rX = cute.make_rmem_tensor_like(acc, self.dtype)
            sm90.convert_to(acc, rX)
            sm90.store_rows(rX, None, tiled_mma_dkv, tidx, mX, None, n_block, kv_head, batch, self.tile_n)

    @cute.jit
    def store_dkv_tma(self, accs: tuple, smem: tuple, tiled_mma_dkv: cute.TiledMma, tidx: Int32, dkv_atoms: tuple,
                      n_block: Int32, kv_head: Int32, batch: Int32, keys: Optional[tuple] = None):
        """``dkv_tma_store``: dK and dV narrowed into sK and sV by ``stmatrix``, then one TMA store
        each (K5's O epilogue), which clips the rows past the keys (packed, ``keys``: boxes from the
        sequence's first key row). sK and sV are free once both warpgroups are past their last
        step: each step waits for its GEMMs to retire."""
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)
        store_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma_dkv).get_slice(tidx)
        for acc, sX in zip(accs, smem):
            rX = cute.make_rmem_tensor_like(acc, self.dtype)
            sm90.convert_to(acc, rX)
            cute.copy(store_atom, thr_store.retile(rX), thr_store.partition_D(sX[None, None, 0]))
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> the TMA's reads
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)
        if cute.arch.make_warp_uniform(tidx // cute.arch.WARP_SIZE) == 0:
            for (atom, m_tma), sX in zip(dkv_atoms, smem):
                tXsX, tXgX = tma_pipeline.partition_for_tma(atom, m_tma, sX, (self.tile_n, self.head_dim), kv_head,
                                                            batch, (None, 0), offset=keys)
                cute.copy(atom, tXsX[None, 0], tXgX[None, n_block])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sK and sV read before the CTA exits


class K10BackwardSplitD(K10Backward):
    """d = 256. dK and dV of a 64-key tile hold 64 x 256 floats each: 256 registers a thread for
    the two, more than a warpgroup has. So both MMA warpgroups own the same 64 keys and split the
    head dim instead: warpgroup w accumulates dK[:, 128w:128w+128] and dV[:, 128w:128w+128] (64
    + 64 registers), and computes dQ's same columns. S^T and dP^T still contract over all of d;
    the warpgroups split their queries (32 each), so each computes P^T and dS^T of its queries in
    fp32, as before. dV's and dK's GEMMs then need every query's P^T and dS^T: both go to SMEM
    (``sdS`` holds the two tiles) and the GEMMs read them there (SS) instead of from registers."""

    def __init__(self, head_dim: int, dtype, causal: bool, num_wg: int, tile_m: int, q_stages: int,
                 overlap: bool = False, **kw):
        assert num_wg == 2 and tile_m % (16 * num_wg) == 0, "two warpgroups, each a multiple of 16 queries"
        super().__init__(head_dim, dtype, causal, num_wg, tile_m, q_stages, overlap=False, **kw)
        self.tile_n = sm90.WGMMA_M  # one 64-key tile for both warpgroups

    def tiled_mmas(self) -> tuple:
        """S^T, dP^T (64 keys, tile_m) with the warpgroups side by side over the queries; dV, dK
        (64 keys, d) with A (P^T, dS^T) from SMEM and the warpgroups side by side over d; dQ as
        K9's (the warpgroups split d)."""
        d, dt, wg = self.head_dim, self.dtype, self.num_wg
        K_MAJOR, MN_MAJOR = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32, atom_layout_mnk=(1, wg, 1),
                                                          tiler_mn=(self.tile_n, self.tile_m // wg))
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32, atom_layout_mnk=(1, wg, 1),
                                                          tiler_mn=(self.tile_n, d // wg))
        return tiled_mma_sdp, tiled_mma_dkv, k9.dq_mma(dt, d, wg)

    def smem_layouts(self) -> tuple:
        """K9's, with ``sdS`` two tiles deep: dS^T in tile 0, P^T in tile 1."""
        sK_layout, sQ_layout, _ = super().smem_layouts()
        sdS_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (self.tile_m, self.head_dim, self.tile_n),
                                                   self.dtype, 2)
        return sK_layout, sQ_layout, sdS_layout

    def dkv_operands_a(self, wg_dkv) -> tuple:
        return None, None  # SMEM fragments: ``mma_partitions``

    def mma_partitions(self, mmas: tuple, smem: tuple, wg_idx: Int32, tidx: Int32) -> tuple:
        """K9's fragments, with dV's and dK's A operands read from the P^T and dS^T tiles in SMEM."""
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        sK, sV, sQ, sdO, sdSP = smem
        sdS, sP = sdSP[None, None, 0], sdSP[None, None, 1]
        parts = list(super().mma_partitions(mmas, (sK, sV, sQ, sdO, sdS), wg_idx, tidx))
        wg_dkv = tiled_mma_dkv.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
        parts[8] = wg_dkv.make_fragment_A(wg_dkv.partition_A(k9.transpose_view(sP)))  # tdVrP
        parts[9] = wg_dkv.make_fragment_A(wg_dkv.partition_A(k9.transpose_view(sdS)))  # tdKrdS
        return tuple(parts)

    @cute.jit
    def weight_grads(self, mmas: tuple, accs: tuple, operands: tuple, tScS: cute.Tensor, sdS: cute.Tensor,
                     stage: Int32):
        """After S^T and dP^T of this warpgroup's queries: P^T and dS^T into SMEM, then dV's, dK's
        and dQ's GEMMs over all queries (their columns of d), one wait for the three."""
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        acc_S, acc_dP, acc_dK, acc_dV, acc_dQ = accs
        tdVrP, tdVrdO, tdKrdS, tdKrQ, tdQrdS, tdQrK = operands
        # both warpgroups' previous GEMMs have retired (each waits at its step's end): the tiles are free
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)
        self.store_dS(acc_S, tScS, sdS[None, None, 1], tiled_mma_sdp)
        self.store_dS(acc_dP, tScS, sdS[None, None, 0], tiled_mma_sdp)
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMAs' reads
        cute.arch.barrier(barrier_id=Barrier.MMA, number_of_threads=self.mma_threads)  # every query's P^T and dS^T
        sm90.gemm(tiled_mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, stage], zero_init=False, wg_wait=-1)
        sm90.gemm(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQ[None, None, None, stage], zero_init=False, wg_wait=-1)
        sm90.gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrK, zero_init=True, wg_wait=0)


class WidePrepass(k9.Prepass):
    """``wide_prepass``: K9's pre-pass with 16 bytes of O and dO a thread, where K9's warp a row
    reads 2 bytes a lane. A row's d/8 threads each take 8 neighbouring elements (one vector load of
    each) and zero 8 floats of dQ's accumulator (two 16-byte stores); a 128-thread CTA takes
    128 / (d/8) rows, and D's sum closes over the row's threads."""

    VEC = 8  # 16 bytes of a 16-bit dtype

    def rows_per_cta(self, head_dim: int) -> int:
        per_row = head_dim // self.VEC  # a row's threads: D's butterfly sums over a power of two within a warp
        assert head_dim % self.VEC == 0 and per_row & (per_row - 1) == 0 and per_row <= 32, head_dim
        return 32 * self.WARPS // per_row

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
               mdQaccum: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        per_row = cute.size(mO, mode=[3]) // self.VEC  # threads a row: neighbouring lanes of one warp
        part, q = tidx % per_row, bx * self.rows_per_cta(cute.size(mO, mode=[3])) + tidx // per_row
        self.wide_row(mO, mdO, mLSE, mLSE2, mD, mdQaccum, batch, head, q, q, q, part, q < mO.shape[2])

    @cute.jit
    def wide_row(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
                 mdQaccum: cute.Tensor, batch: Int32, head: Int32, q: Int32, out_row: Int32, dq_row: Int32,
                 part: Int32, valid):
        """Part ``part`` of query row ``q`` (if ``valid``): D and LSE2 into row ``out_row``, dQ's
        row ``dq_row`` zeroed. Every thread of the row calls it, valid or not: the shuffles that
        close D's sum need the row's whole group."""
        per_row = cute.size(mO, mode=[3]) // self.VEC
        dot = Float32(0.0)
        if valid:
            rO = cute.make_rmem_tensor(self.VEC, mO.element_type)
            rdO = cute.make_rmem_tensor(self.VEC, mdO.element_type)
            cute.autovec_copy(cute.local_tile(mO[batch, head, q, None], (self.VEC,), (part,)), rO)
            cute.autovec_copy(cute.local_tile(mdO[batch, head, q, None], (self.VEC,), (part,)), rdO)
            for i in cutlass.range_constexpr(self.VEC):
                dot += rO[i].to(Float32) * rdO[i].to(Float32)
            self.zero_part(mdQaccum, batch, head, dq_row, part)
        dot = simt.butterfly_allreduce(dot, lambda a, b: a + b, per_row)
        if valid:
            if part == 0:
                mD[batch, head, out_row] = dot
                mLSE2[batch, head, out_row] = mLSE[batch, head, q] * LOG2_E

    @cute.jit
    def zero_part(self, mdQaccum: cute.Tensor, batch: Int32, head: Int32, row: Int32, part: Int32):
        """8 floats of dQ's accumulator row ``row`` zeroed, two 16-byte stores."""
        zeros = cute.make_rmem_tensor(self.VEC, Float32)
        zeros.fill(0.0)
        cute.autovec_copy(zeros, cute.local_tile(mdQaccum[batch, head, row, None], (self.VEC,), (part,)))


class VarlenPrepass(k9.Prepass):
    """K9's pre-pass on packed sequences: a CTA per (block of rows, head, sequence). Sequence b's
    LSE2 and D land at ``tiles.packed_row_start`` of its first row: a TMA box of floats starts
    only 16 bytes into its innermost dimension, and a packed sequence may start at any row.
    ``flat_tile_m``: dQ's accumulator is ``dq_flat``'s, each query tile's slot from
    ``packed_tile_start``, zeroed whole (the last tile's rows past the sequence too: its share
    spreads every row over the slot)."""

    def __init__(self, flat_tile_m: int = 0):
        self.flat_tile_m = flat_tile_m

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
                 mdQaccum: cute.Tensor, mCuSeqlensQ: cute.Tensor, max_seqlen_q: Int32, stream):
        rows = max_seqlen_q + (self.flat_tile_m - 1 if cutlass.const_expr(self.flat_tile_m) else 0)
        grid = (cute.ceil_div(rows, self.rows_per_cta(cute.size(mO, mode=[3]))), mO.shape[1], mCuSeqlensQ.shape[0] - 1)
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mdQaccum, mCuSeqlensQ).launch(grid=grid, block=[32 * self.WARPS, 1, 1],
                                                                            stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
               mdQaccum: cute.Tensor, mCuSeqlensQ: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, seq = cute.arch.block_idx()
        lane, r = tidx % 32, bx * self.WARPS + tidx // 32
        q, out_row, dq_row, length = self.sequence_row(mCuSeqlensQ, seq, r)
        if r < length:
            self.row(mO, mdO, mLSE, mLSE2, mD, mdQaccum, Int32(0), head, q, out_row, lane, dq_row)
        if cutlass.const_expr(self.flat_tile_m):
            if r >= length and r < cute.ceil_div(length, self.flat_tile_m) * self.flat_tile_m:
                for j in cutlass.range_constexpr(cute.size(mO, mode=[3]) // 32):
                    mdQaccum[0, head, dq_row, lane + 32 * j] = Float32(0.0)

    @cute.jit
    def sequence_row(self, mCuSeqlensQ: cute.Tensor, seq: Int32, r: Int32):
        """Row ``r`` of packed sequence ``seq``: (its packed row, where its D and LSE2 go, its row of
        dQ's accumulator, the sequence's length)."""
        q0 = mCuSeqlensQ[seq]
        length = mCuSeqlensQ[seq + 1] - q0
        dq_row = q0 + r
        if cutlass.const_expr(self.flat_tile_m):
            dq_row = packed_tile_start(q0, seq, self.flat_tile_m) * self.flat_tile_m + r
        return q0 + r, packed_row_start(q0, seq) + r, dq_row, length


class WideVarlenPrepass(VarlenPrepass, WidePrepass):
    """``wide_prepass`` on packed sequences: ``VarlenPrepass``'s rows, launch and flat slots,
    ``WidePrepass``'s 16 bytes a thread."""

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
               mdQaccum: cute.Tensor, mCuSeqlensQ: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, seq = cute.arch.block_idx()
        per_row = cute.size(mO, mode=[3]) // self.VEC
        part, r = tidx % per_row, bx * self.rows_per_cta(cute.size(mO, mode=[3])) + tidx // per_row
        q, out_row, dq_row, length = self.sequence_row(mCuSeqlensQ, seq, r)
        self.wide_row(mO, mdO, mLSE, mLSE2, mD, mdQaccum, Int32(0), head, q, out_row, dq_row, part, r < length)
        if cutlass.const_expr(self.flat_tile_m):
            if r >= length and r < cute.ceil_div(length, self.flat_tile_m) * self.flat_tile_m:
                self.zero_part(mdQaccum, Int32(0), head, dq_row, part)


class FlatPostpass:
    """``dq_flat``'s post-pass, a CTA per query tile: its fp32 shares read back in the MMA threads'
    register order (16-byte loads, the warpgroup's threads side by side, as ``store_dq`` wrote
    them), narrowed into an SMEM tile at [row, col], then written out row by row, 16 bytes a
    thread. Stored straight from the MMA order, each warp's store would touch 8 rows' 16 bytes."""

    PAD = 8  # elements after each SMEM row: rows 16 bytes apart in the banks, so the MMA-order writes don't collide

    def __init__(self, head_dim: int, dtype, num_wg: int, tile_m: int, split_queries: bool = False):
        self.head_dim, self.dtype, self.num_wg, self.tile_m = head_dim, dtype, num_wg, tile_m
        self.split_queries = split_queries  # the main kernel's dq_split_queries: its register order

    def dq_mma(self) -> cute.TiledMma:
        """The main kernel's dQ GEMM, whose register order the shares are in."""
        return k9.dq_mma(self.dtype, self.head_dim, self.num_wg, self.split_queries)

    def share_shape(self) -> tuple:
        """The C tile of ``dq_mma``: (tile_m, d)."""
        return self.tile_m, self.head_dim

    def share_coord(self, coord) -> tuple:
        """(row, col) in the query tile of the share element at ``coord`` of that C tile."""
        return coord

    def launch(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, stream, mCuSeqlensQ=None, max_tiles=None,
               scale=None):
        """The entry points' launch: a CTA per query tile of each (head, batch), or packed (with
        ``mCuSeqlensQ``), per (query tile of the longest sequence's ``max_tiles``, head, sequence);
        ``scale``: a factor on the shares (an entry point a variant adds)."""
        if mCuSeqlensQ is None:
            grid = (cute.ceil_div(mdQ.shape[2], self.tile_m), mdQ.shape[1], mdQ.shape[0])
        else:
            grid = (max_tiles, mdQ.shape[1], mCuSeqlensQ.shape[0] - 1)
        self.kernel(mdQaccum, mdQ, self.dq_mma(), mCuSeqlensQ, scale).launch(
            grid=grid, block=[sm90.THREADS_PER_WARPGROUP * self.num_wg, 1, 1], stream=stream)

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, stream):
        self.launch(mdQaccum, mdQ, stream)

    @cute.jit
    def call_varlen(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor, max_tiles: Int32,
                    stream):
        """Packed: (1, heads, total, d) dQ, a CTA per (query tile, head, sequence) of the longest
        sequence's ``max_tiles``; sequence b's tiles in the slots from ``packed_tile_start``."""
        self.launch(mdQaccum, mdQ, stream, mCuSeqlensQ, max_tiles)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, tiled_mma_dq: cute.TiledMma,
               mCuSeqlensQ: Optional[cute.Tensor], scale: Optional[Float32]):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen, slot, first = mdQ.shape[2], m_block, Int32(0)
        if cutlass.const_expr(mCuSeqlensQ is not None):  # block z: the sequence
            first = mCuSeqlensQ[batch]
            seqlen, slot = mCuSeqlensQ[batch + 1] - first, packed_tile_start(first, batch, self.tile_m) + m_block
            batch = Int32(0)
        sdQ = cutlass.utils.SmemAllocator().allocate_tensor(
            self.dtype, cute.make_layout((self.tile_m, self.head_dim), stride=(self.head_dim + self.PAD, 1)),
            byte_alignment=16)
        if m_block * self.tile_m < seqlen:  # packed: the longest sequence's tile count was launched
            tdQcdQ = tiled_mma_dq.get_slice(tidx).partition_C(cute.make_identity_tensor(self.share_shape()))
            per_thread, threads = cute.size(tdQcdQ), sm90.THREADS_PER_WARPGROUP
            rows = self.tile_m * self.head_dim // FLAT_WIDTH  # of the flat buffer, per query tile
            tile = mdQaccum[batch, head, None, None]
            base = cute.assume(slot * rows * FLAT_WIDTH + (tidx // threads) * threads * per_thread + (tidx % threads) * 4,
                               divby=4)  # 16-byte loads
            acc = cute.make_rmem_tensor(per_thread, Float32)
            cute.autovec_copy(cute.make_tensor(tile.iterator + base, cute.make_layout((4, per_thread // 4),
                                                                                      stride=(1, 4 * threads))),
                              cute.make_tensor(acc.iterator, cute.make_layout((4, per_thread // 4))))
            for i in cutlass.range_constexpr(per_thread):  # acc[i]: the share of tdQcdQ[i], as store_dq wrote it
                row, col = self.share_coord(tdQcdQ[i])
                if cutlass.const_expr(scale is not None):
                    acc[i] = acc[i] * scale
                sdQ[row, col] = acc[i].to(self.dtype)
        cute.arch.barrier()
        if m_block * self.tile_m < seqlen:
            vec = 16 // (self.dtype.width // 8)  # elements in 16 bytes
            per_row = self.head_dim // vec
            nthreads = sm90.THREADS_PER_WARPGROUP * self.num_wg
            for j in cutlass.range_constexpr(self.tile_m * per_row // nthreads):
                r, c = (tidx + j * nthreads) // per_row, (tidx + j * nthreads) % per_row
                q = m_block * self.tile_m + r
                if q < seqlen:
                    cute.autovec_copy(cute.local_tile(sdQ[r, None], (vec,), (c,)),
                                      cute.local_tile(mdQ[batch, head, first + q, None], (vec,), (c,)))


def check(p: Problem) -> None:
    k9.check(p, "K10", features=True, head_dims=HEAD_DIMS)


def config(p: Problem, overrides: dict = None):
    """K4's rule over ``DEFAULT_CONFIG``; an override ``by_head_dim`` ({d: overrides}) adds its
    entry for p.head_dim (a stage whose tile differs by head dim, as FA3's do)."""
    overrides = dict(overrides or {})
    per_d = overrides.pop("by_head_dim", None) or {}
    overrides.update(per_d.get(p.head_dim, per_d.get(str(p.head_dim), {})))  # JSON keys are strings
    return k4.config(p, overrides, DEFAULT_CONFIG)


def padded_row_tensor(batch, heads, rows):
    """A fake (batch, heads, rows) float tensor whose rows start 16-byte aligned (LSE2 or D, as
    k9.row_buffers lays them out): what a TMA box of them needs."""
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(Float32, (batch, heads, rows),
                            stride=(cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1), assumed_align=16)


def compile_backward(p: Problem, keep_ptx: bool = False, deterministic: bool = False, dq_flat: bool = False,
                     **overrides) -> tuple:
    """(K9's pre-pass, K10's main kernel, the post-pass, the configuration) compiled for ``p``."""
    from cutlass.cute.runtime import make_fake_tensor

    from . import k10_experiments as experiments  # the knobs measured and left off

    check(p)
    split_d = p.head_dim > 128  # K10BackwardSplitD: one 64-key tile per CTA, its own (sequential) step
    cfg = experiments.settle(config(p, overrides), p, split_d, dq_flat)
    # its class attributes decide what follows (K10's own drops below touch none of the knobs it is built for)
    kernel_cls = experiments.kernel_class(cfg, K10BackwardSplitD if split_d else K10Backward)
    if cfg["tile_m"] % kernel_cls.TILE_M_STEP:
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: tile_m must be a multiple of {kernel_cls.TILE_M_STEP}"
                                 " (the step of dQ's GEMM along the queries)")
    if p.softcap and cfg.get("overlap") and not cfg.get("capped_overlap"):  # no register for tanh's slope
        cfg = cfg.with_(overlap=False)
    if p.softcap and cfg.get("overlap") and cfg.get("tanh_under_dp"):  # capped_overlap: the tanh is under dP's GEMM
        cfg = cfg.with_(tanh_under_dp=False)
    dt = cute_dtype(p.dtype)
    tile_n = sm90.WGMMA_M * (1 if split_d else cfg["num_wg"])  # the CTA's keys
    if split_d:
        cfg = cfg.with_(overlap=False, **{k: False for k in ("early_dq", "dq_split_queries", "tanh_under_dp",
                                                             "dkv_tma_store") if cfg.get(k)})
        if cfg["q_stages"] != 1 or cfg["num_wg"] != 2 or cfg["tile_m"] != 64:
            raise UnsupportedProblem(f"K10 (backward) config {cfg}: at head_dim 256, two warpgroups, 64 queries a step "
                                     "and one Q/dO stage (a second stage would need 272 KB of SMEM)")
    if cfg.get("early_dq") and not dq_flat:
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: early_dq hands over flat dQ shares (dq_flat)")
    if cfg.get("tanh_under_dp") and not cfg.get("early_dq"):
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: tanh_under_dp is early_dq's step under a softcap")
    if cfg.get("early_dq") and cfg["q_stages"] < 2:
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: early_dq keeps a dS tile per Q/dO stage, and needs "
                                 "two: a step's dS must not overwrite the one the other warpgroup's dQ GEMM reads")
    if cfg.get("dq_split_queries") and cfg["tile_m"] % (sm90.WGMMA_M * cfg["num_wg"]):
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: dq_split_queries gives each warpgroup 64 of the "
                                 f"step's queries: tile_m a multiple of {sm90.WGMMA_M * cfg['num_wg']}")
    if p.varlen and cfg.get("dkv_tma_store") and not kernel_cls.PACKED_TMA_STORE:
        cfg = cfg.with_(dkv_tma_store=False)  # a box at a packed sequence's last key tile would run into the next
    if p.varlen and cfg.get("unguarded_rows"):
        cfg = cfg.with_(unguarded_rows=False)  # a tile's rows past a sequence are the next one's
    key_tiles = -(-p.kv_len // tile_n)
    window = p.sliding_window
    arrive_last_first = p.causal or (window is not None and window[1] >= 0)  # key tiles start their walks in order
    last_first = deterministic and arrive_last_first and key_tiles <= num_sms()  # K10Backward.wait_turn says why
    features = dict(({"window": window} if window else {}), **({"softcap": p.softcap} if p.softcap else {}))

    def cu_seqlens():  # a fake cu_seqlens: int32, batch + 1
        return make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)

    def accumulator(f, x):  # dQ's fp32 accumulator: (batch, heads, seqlen, d), or dq_flat's rows
        if not dq_flat:
            return x(Float32)
        outer = lambda: cute.sym_int64(divisibility=FLAT_WIDTH)  # noqa: E731
        return make_fake_tensor(Float32, (f.batch, f.nheads, cute.sym_int(), FLAT_WIDTH),
                                stride=(outer(), outer(), FLAT_WIDTH, 1), assumed_align=16)

    def main():
        f = FakeShapes()
        x, _ = k9.fake_tensors(p, f)
        # LSE2 and D rows start 16-byte aligned (k9.run_backward pads them): the TMA needs that
        # packed, the rows are the pre-pass's padded ones (packed_row_start): a length of their own
        padded_rows = cute.sym_int() if p.varlen else f.seqlen
        rows = lambda: padded_row_tensor(f.batch, f.nheads, padded_rows)  # noqa: E731
        args = (x(dt), x(dt, True), x(dt, True), x(dt), rows(), rows(), accumulator(f, x), x(dt, True),
                x(dt, True), Float32(1.0), fake_stream())
        semaphores = make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4) if deterministic else None
        kernel = kernel_cls(p.head_dim, dt, p.causal, **experiments.kernel_args(cfg), deterministic=deterministic,
                            dq_flat=dq_flat, last_first=last_first, varlen=p.varlen, **features)
        if p.varlen:  # cu_seqlens_q, cu_seqlens_k and the (sequence, key tile) table
            tiles = make_fake_tensor(Int32, (cute.sym_int(), 2), stride=(2, 1), assumed_align=4)
            return kernel.call_varlen, args + (semaphores, cu_seqlens(), cu_seqlens(), tiles)
        return kernel, args + (semaphores,)

    def flat_post():
        f = FakeShapes()
        x, _ = k9.fake_tensors(p, f)
        entry, extra = experiments.flat_postpass(cfg, p.varlen, (p.head_dim, dt, cfg["num_wg"], cfg["tile_m"],
                                                                 bool(cfg.get("dq_split_queries"))))
        return entry, (accumulator(f, x), x(dt), *((cu_seqlens(), Int32(1)) if p.varlen else ()), *extra,
                       fake_stream())

    pre, post = k9.compile_passes(p, keep_ptx, WidePrepass if cfg.get("wide_prepass") else None)
    kernel_knobs = tuple(sorted((k, v) for k, v in cfg.items() if k not in PASS_KNOBS))  # either pre-pass: one build
    if p.varlen:
        def varlen_pre():
            f = FakeShapes()
            x, rows = k9.fake_tensors(p, f)
            padded_rows = cute.sym_int()
            # dq_flat: the accumulator's rows are the slots' (tile_m each), not the packed rows
            accum = k9.fake_tensors(p)[0](Float32) if dq_flat else x(Float32)
            prepass = WideVarlenPrepass if cfg.get("wide_prepass") else VarlenPrepass
            return prepass(cfg["tile_m"] if dq_flat else 0), (
                x(dt), x(dt), rows(), padded_row_tensor(f.batch, f.nheads, padded_rows),
                padded_row_tensor(f.batch, f.nheads, padded_rows), accum, cu_seqlens(), Int32(1), fake_stream())

        pre = jit_compile(("k10_varlen_pre", p.head_dim, p.dtype, cfg["tile_m"] if dq_flat else 0,
                           bool(cfg.get("wide_prepass"))), varlen_pre,
                          keep_ptx)
    if dq_flat:
        post = jit_compile(("k10_flat_post", p.head_dim, p.dtype, kernel_knobs, p.varlen), flat_post,
                           keep_ptx)
    key = ("k10", p.head_dim, p.dtype, p.causal, deterministic, last_first, dq_flat, kernel_knobs,
           *((tuple(sorted(features.items())),) if features else ()), *(("varlen",) if p.varlen else ()))
    return pre, jit_compile(key, main, keep_ptx), post, cfg.with_(deterministic=deterministic, dq_flat=dq_flat,
                                                                  last_first=last_first, tile_n=tile_n)


def flat_accumulator(batch: int, heads: int, rows: int, d: int, tiles: int, tile_m: int, device) -> tuple:
    """``dq_flat``'s accumulator, ``tiles`` query tiles' slots a head, each whole (a tile's share
    covers all its rows): (a (batch, heads, rows, d) view of its start, which the pre-pass zeroes;
    the rows of FLAT_WIDTH floats the kernel and the post-pass take). Only what lies past the view
    is zeroed here: a fill of the whole buffer would cost as much again as the pre-pass's zeroing."""
    import torch

    per_head = tiles * tile_m * d
    flat = torch.empty(batch, heads, per_head // FLAT_WIDTH, FLAT_WIDTH, device=device, dtype=torch.float32)
    if rows * d < per_head:
        flat.view(batch, heads, -1)[:, :, rows * d:].zero_()
    return flat.view(batch, heads, -1)[:, :, :rows * d].view(batch, heads, rows, d), flat


def run_backward(compiled: tuple, q, k, v, o, lse, do, softmax_scale: float, grads: tuple | None = None) -> tuple:
    """K9's ``run_backward`` with K10's kernel; deterministic, a zeroed semaphore per query tile
    of each (batch, head) besides; ``dq_flat``, the accumulator as rows of FLAT_WIDTH floats,
    zeroed here (padding included: the last tile's share covers all its rows)."""
    import torch

    from . import k10_experiments as experiments

    pre, main, post, cfg = compiled
    b, h, n, d = q.shape
    tiles = -(-n // cfg["tile_m"])
    extra, dq_accum = (None,), None
    if cfg["deterministic"]:
        extra = (torch.zeros(b * h * tiles, device=q.device, dtype=torch.int32),)
    if cfg["dq_flat"]:
        dq_accum = flat_accumulator(b, h, n, d, tiles, cfg["tile_m"], q.device)
    return k9.run_backward((pre, main, post), q, k, v, o, lse, do, softmax_scale, grads, extra, dq_accum,
                           experiments.post_args(cfg, softmax_scale))


def run_varlen_backward(compiled: tuple, q, k, v, o, lse, do, softmax_scale: float, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q: int, key_tiles, grads: tuple | None = None) -> tuple:
    """``run_backward`` on packed sequences: q, o, do (total_q, heads, d), k, v (total_k, heads_kv,
    d), lse (heads, total_q), cu_seqlens int32 on the GPU, the longest sequence's queries, the
    (sequence, key tile) table (int32 (pairs, 2) on the GPU, ``call_varlen``; deterministic, in
    (sequence, key tile) order). The kernels see (1, heads, total, d) views; LSE2 and D live in
    padded rows (``VarlenPrepass``), dQ's accumulator and the post-pass at the packed rows, or,
    ``dq_flat``, a slot of flat rows per head and query tile; deterministic, a zeroed semaphore per
    head and query tile. Both per-tile tables are numbered by ``packed_tile_start``. Returns
    (dq, dk, dv), packed."""
    import torch

    from . import k10_experiments as experiments

    pre, main, post, cfg = compiled
    packed = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731  (total, heads, d) -> (1, heads, total, d)
    total, h, d = q.shape
    seqs, tile_m = cu_seqlens_q.shape[0] - 1, cfg["tile_m"]
    slots = total // tile_m + seqs + 1  # query tiles per head, every sequence's from packed_tile_start
    lse2, dot = k9.row_buffers(1, h, total + ROW_ALIGN * seqs, q.device)
    if cfg["dq_flat"]:
        dq_accum, accum = flat_accumulator(1, h, slots * tile_m, d, slots, tile_m, q.device)  # the pre-pass zeroes the slots
    else:
        dq_accum = accum = torch.empty(1, h, total, d, device=q.device, dtype=torch.float32)
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    o, do = (packed(k9.aligned_rows(t)) for t in (o, do))  # views of (total, heads, d) rows: no transposed copy
    pre(o, do, lse.unsqueeze(0), lse2, dot, dq_accum, cu_seqlens_q, max_seqlen_q)
    semaphores = torch.zeros(h * slots, device=q.device, dtype=torch.int32) if cfg["deterministic"] else None
    main(packed(q), packed(k), packed(v), do, lse2, dot, accum, packed(dk), packed(dv), softmax_scale, semaphores,
         cu_seqlens_q, cu_seqlens_k, key_tiles)
    if cfg["dq_flat"]:
        post(accum, packed(dq), cu_seqlens_q, max(1, -(-max_seqlen_q // tile_m)),
             *experiments.post_args(cfg, softmax_scale))
    else:
        post(accum, packed(dq))
    return dq, dk, dv
