"""K9: the backward pass, FA2's algorithm (the FA2 paper's Algorithm 2) on Hopper's tensor cores.

Given O and the forward's LSE, the gradients of O = softmax(scale * Q K^T) V are, with P
recomputed from the LSE (the forward never stores it):

    D = rowsum(dO * O)                 (a pre-pass, one value per query row)
    P = exp(scale * Q K^T - LSE)
    dV = P^T dO        dP = dO V^T        dS = P * (dP - D)
    dQ = scale * dS K  dK = scale * dS^T Q

Parallelism over keys: one CTA owns one K/V tile of one (batch, head) and walks the query tiles,
so dK and dV accumulate in registers for the whole walk and are written once; dQ of a query tile
gets a contribution from every key tile, which CTAs add into an fp32 accumulator with atomics.
Three launches, as FA2 and FA3 do: the pre-pass (D, the LSE in log2 units, dQ's accumulator
zeroed), the main kernel, a post-pass that narrows dQ to the input dtype.

The main kernel is K4's shape turned around: no warp specialization, warp 0 issues the TMA loads,
and each of ``num_wg`` warpgroups owns 64 keys of the K/V tile (K4: 64 query rows). Five WGMMAs
per query tile, with the operands where each GEMM can read them:

* S^T = K Q^T and dP^T = V dO^T: keys are the M axis, so the results land in registers as P^T and
  dS^T, exactly the A operands dV and dK need (the register handoff of K4's P).
* dV += P^T dO and dK += dS^T Q: Q and dO stay in the SMEM the TMA wrote (d contiguous) and are
  read as MN-major B operands: the same bytes, the layout's two modes swapped.
* dQ = dS K: queries are the M axis, so dS goes through SMEM (``sdS``, written transposed from the
  registers) and K is read MN-major from its buffer; the warpgroups split d between them.

Scale: dS is stored already multiplied by softmax_scale, so dQ and dK come out scaled.
"""

from __future__ import annotations

from typing import Optional

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import k4, simt, sm90, tma_pipeline
from .contract import LOG2_E, Config, FakeShapes, Problem, UnsupportedProblem, cute_dtype, fake_stream, jit_compile

HEAD_DIMS = (64, 128)
# Per head dim: warpgroups (64 keys each), query rows per step, Q/dO stages. At d=128, dK and dV
# take 128 fp32 registers per thread for the whole walk; a 64-row query step keeps S^T and dP^T
# at 32 each (FA3's 64 x 128 tile for d=128).
DEFAULT_CONFIG = {
    64: dict(num_wg=2, tile_m=64, q_stages=2),
    128: dict(num_wg=2, tile_m=64, q_stages=2),
}


def transpose_view(s: cute.Tensor) -> cute.Tensor:
    """The same SMEM with its first two modes swapped: a K-major WGMMA operand tile read as the
    MN-major operand of another GEMM (the bytes do not move)."""
    return cute.make_tensor(s.iterator, cute.select(s.layout, mode=[1, 0, *range(2, cute.rank(s.layout))]))


def dq_mma(dtype, head_dim: int, num_wg: int, split_queries: bool = False) -> cute.TiledMma:
    """dQ (tile_m, d) = dS (tile_m, tile_n) . K (tile_n, d): queries contiguous in sdS, d in sK; the
    warpgroups split d (``split_queries``: the queries, 64 each)."""
    if split_queries:
        return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
                                                 atom_layout_mnk=(num_wg, 1, 1), tiler_mn=(64, head_dim))
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
                                             atom_layout_mnk=(1, num_wg, 1), tiler_mn=(64, head_dim // num_wg))


class K9Backward:
    def __init__(self, head_dim: int, dtype, causal: bool, num_wg: int, tile_m: int, q_stages: int):
        self.head_dim, self.dtype, self.causal = head_dim, dtype, causal
        self.num_wg = num_wg
        self.tile_n = sm90.WGMMA_M * num_wg  # keys of the CTA: warpgroup w owns [64w, 64w + 64)
        self.tile_m = tile_m  # query rows per step of the walk
        self.q_stages = q_stages
        self.dq_tile = (tile_m, head_dim)  # dQ's accumulator tile, as its GEMM's (M, N)
        self.num_threads = sm90.THREADS_PER_WARPGROUP * num_wg

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, softmax_scale: Float32,
                 stream):
        dt, tile_n = self.dtype, self.tile_n
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = self.tiled_mmas()
        sK_layout, sQ_layout, sdS_layout = self.smem_layouts()
        (tma_atom_K, mK_tma), (tma_atom_V, mV_tma), (tma_atom_Q, mQ_tma), (tma_atom_dO, mdO_tma) = self.tma_loads(
            mK, mV, mQ, mdO, sK_layout, sQ_layout)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]

        grid = (cute.ceil_div(mK.shape[2], tile_n), mK.shape[1], mK.shape[0])  # (key tiles, K/V heads, batch)
        self.kernel(mQ_tma, mK_tma, mV_tma, mdO_tma, mLSE2, mD, mdQaccum, mdK, mdV, tma_atom_Q, tma_atom_K,
                    tma_atom_V, tma_atom_dO, softmax_scale * LOG2_E, softmax_scale, sK_layout, sQ_layout, sdS_layout,
                    tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    def tiled_mmas(self) -> tuple:
        """The five GEMMs' three tiled MMAs (the table in docs/k9.md)."""
        d, dt = self.head_dim, self.dtype
        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        # S^T, dP^T (tile_n, tile_m) = K, V (tile_n, d) . Q, dO (tile_m, d)^T: both operands K-major.
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, K_MAJOR, Float32,
                                                          atom_layout_mnk=(self.num_wg, 1, 1),
                                                          tiler_mn=(64, self.tile_m))
        # dV, dK (tile_n, d) += P^T, dS^T (registers) . dO, Q: B contracted over queries, d contiguous.
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(dt, dt, K_MAJOR, MN_MAJOR, Float32,
                                                          atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, d),
                                                          a_source=warpgroup.OperandSource.RMEM)
        return tiled_mma_sdp, tiled_mma_dkv, dq_mma(dt, d, self.num_wg)

    def smem_layouts(self) -> tuple:
        """K and V as A-operand tiles (one stage), Q and dO as B-operand tiles (``q_stages``), sdS."""
        d, dt, tile_m, tile_n = self.head_dim, self.dtype, self.tile_m, self.tile_n
        sK_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tile_n, tile_m, d), dt, 1)  # K and V
        sQ_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (tile_n, tile_m, d), dt, self.q_stages)
        sdS_layout = cute.select(sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, (tile_m, d, tile_n), dt, 1),
                                 mode=[0, 1])
        return sK_layout, sQ_layout, sdS_layout

    def tma_loads(self, mK: cute.Tensor, mV: cute.Tensor, mQ: cute.Tensor, mdO: cute.Tensor, sK_layout,
                  sQ_layout) -> tuple:
        """(atom, TMA view) of K, V, Q and dO."""
        d = self.head_dim
        return tuple(tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(m), layout, (rows, d))
                     for m, layout, rows in ((mK, sK_layout, self.tile_n), (mV, sK_layout, self.tile_n),
                                             (mQ, sQ_layout, self.tile_m), (mdO, sQ_layout, self.tile_m)))

    def mma_partitions(self, mmas: tuple, smem: tuple, wg_idx: Int32, tidx: Int32) -> tuple:
        """Warpgroup ``wg_idx``'s operand fragments of the five GEMMs (a trailing stage mode on Q's
        and dO's), the A fragments P^T and dS^T are converted into, dK's and dV's accumulators
        (zeroed), and the coordinate probes that say which (key, query) of the S^T tile and which
        (query, d) of the dQ tile each of thread ``tidx``'s registers holds."""
        tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq = mmas
        sK, sV, sQ, sdO, sdS = smem
        d, tile_m, tile_n = self.head_dim, self.tile_m, self.tile_n
        wg_sdp = tiled_mma_sdp.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
        wg_dkv = tiled_mma_dkv.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
        wg_dq = tiled_mma_dq.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))[None, None, None, 0]
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))[None, None, None, 0]
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))  # (.., stage)
        tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))  # (.., stage)
        tdVrdO = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sdO)))  # (.., stage)
        tdKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sQ)))  # (.., stage)
        tdQrdS, tdQrK = self.dq_operands(wg_dq, sdS, sK)
        tdVrP, tdKrdS = self.dkv_operands_a(wg_dkv)
        acc_dV = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((tile_n, d)), Float32)
        acc_dK = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((tile_n, d)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        tScS = tiled_mma_sdp.get_slice(tidx).partition_C(cute.make_identity_tensor((tile_n, tile_m)))
        tdQcdQ = tiled_mma_dq.get_slice(tidx).partition_C(cute.make_identity_tensor(self.dq_tile))
        return (tSrK, tdPrV, tSrQ, tdPrdO, tdVrdO, tdKrQ, tdQrdS, tdQrK, tdVrP, tdKrdS, acc_dV, acc_dK, tScS,
                tdQcdQ)

    def dkv_operands_a(self, wg_dkv) -> tuple:
        """dV's and dK's A operands, P^T and dS^T: register fragments their fp32 tiles are
        converted into (a stage whose GEMMs read them from SMEM partitions its own)."""
        shape = wg_dkv.partition_shape_A((self.tile_n, self.tile_m))
        return wg_dkv.make_fragment_A(shape), wg_dkv.make_fragment_A(shape)

    def dq_operands(self, wg_dq, sdS: cute.Tensor, sK: cute.Tensor) -> tuple:
        """dQ's GEMM operands (A, B): dS, queries contiguous in sdS, and K, d contiguous in sK."""
        return (wg_dq.make_fragment_A(wg_dq.partition_A(sdS)),
                wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))[None, None, None, 0])

    @cute.kernel
    def kernel(self, mQ_tma: cute.Tensor, mK_tma: cute.Tensor, mV_tma: cute.Tensor, mdO_tma: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, scale_log2: Float32, softmax_scale: Float32,
               sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
               tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        d, tile_m, tile_n, stages = self.head_dim, self.tile_m, self.tile_n, self.q_stages
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_head, batch = cute.arch.block_idx()
        seqlen, seqlen_k = mLSE2.shape[2], mdK.shape[2]
        group = mLSE2.shape[1] // mdK.shape[1]  # query heads per K/V head (GQA): all of them walk here
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // sm90.THREADS_PER_WARPGROUP)
        if warp_idx == 0:
            tma_pipeline.prefetch_descriptors(tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        consumer_warps = self.num_threads // cute.arch.WARP_SIZE
        pipeline_kv = tma_pipeline.make_tma_pipeline(storage.mbar_kv.data_ptr(), 1, consumer_warps,
                                                     tma_pipeline.stage_bytes(self.dtype, sK_layout, sK_layout))
        pipeline_qdo = tma_pipeline.make_tma_pipeline(storage.mbar_qdo.data_ptr(), stages, consumer_warps,
                                                      tma_pipeline.stage_bytes(self.dtype, sQ_layout, sQ_layout))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # The walk: for each query head of the group, the query tiles this key tile sees: all, or
        # (causal, bottom-right: query i sees keys j <= i + seqlen_k - seqlen) from the one whose
        # last row sees its first key. Step t is query tile m_first + t % per_head of head t // per_head.
        offset = seqlen_k - seqlen
        m_tiles = cute.ceil_div(seqlen, tile_m)
        m_first = cutlass.max(n_block * tile_n - offset, 0) // tile_m if const_expr(self.causal) else 0
        per_head = m_tiles - m_first
        walk = (kv_head * group, m_first, per_head)
        count = per_head * group

        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_atom_K, mK_tma, sK, (tile_n, d), kv_head, batch, (None, 0))
        tVsV, tVgV = tma_pipeline.partition_for_tma(tma_atom_V, mV_tma, sV, (tile_n, d), kv_head, batch, (None, 0))
        qdo_sources = (tma_atom_Q, mQ_tma, sQ, tma_atom_dO, mdO_tma, sdO)
        if warp_idx == 0:
            tma_pipeline.load_kv_stage(pipeline_kv, tma_pipeline.pipe_state(1, 0, producer=True), n_block,
                                       tma_atom_K, tKgK, tKsK, tma_atom_V, tVgV, tVsV)
            for t in cutlass.range(cutlass.min(stages, count), unroll=1):
                self.load_qdo(pipeline_qdo, t, walk, batch, qdo_sources)

        # ---- MMA partitions ------------------------------------------------------------------
        (tSrK, tdPrV, tSrQ, tdPrdO, tdVrdO, tdKrQ, tdQrdS, tdQrK, tdVrP, tdKrdS, acc_dV, acc_dK, tScS,
         tdQcdQ) = self.mma_partitions((tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq), (sK, sV, sQ, sdO, sdS), wg_idx,
                                       tidx)

        pipeline_kv.consumer_wait(tma_pipeline.pipe_state(1, 0, producer=False))
        for t in cutlass.range(count, unroll=1):
            head, m_block = self.step_at(t, walk)
            qdo = tma_pipeline.pipe_state(stages, t, producer=False)
            pipeline_qdo.consumer_wait(qdo)
            acc_S = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((tile_n, tile_m)), Float32)
            acc_dP = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C((tile_n, tile_m)), Float32)
            sm90.gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, qdo.index], zero_init=True, wg_wait=-1)
            sm90.gemm(tiled_mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, qdo.index], zero_init=True, wg_wait=0)
            self.p_and_ds(acc_S, acc_dP, tScS, mLSE2, mD, n_block, m_block, head, batch, (seqlen, offset),
                          scale_log2, softmax_scale)
            sm90.convert_to(sm90.acc_as_operand_a(acc_S), tdVrP)
            sm90.convert_to(sm90.acc_as_operand_a(acc_dP), tdKrdS)
            sm90.gemm(tiled_mma_dkv, acc_dV, tdVrP, tdVrdO[None, None, None, qdo.index], zero_init=False, wg_wait=-1)
            sm90.gemm(tiled_mma_dkv, acc_dK, tdKrdS, tdKrQ[None, None, None, qdo.index], zero_init=False, wg_wait=-1)
            # dS^T into sdS, read back as dS (queries contiguous) by the dQ GEMM of every warpgroup.
            cute.arch.sync_threads()  # the previous step's dQ GEMMs are done reading sdS
            self.store_ds(acc_dP, tScS, sdS)
            cute.arch.fence_view_async_shared()  # generic-proxy stores -> the WGMMA's async reads
            cute.arch.sync_threads()
            acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((tile_m, d)), Float32)
            sm90.gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrK, zero_init=True, wg_wait=0)
            pipeline_qdo.consumer_release(qdo)  # dV's and dK's GEMMs (the only readers of Q/dO) are done
            if warp_idx == 0:
                if t + stages < count:
                    self.load_qdo(pipeline_qdo, t + stages, walk, batch, qdo_sources)
            self.add_dq(acc_dQ, tdQcdQ, mdQaccum, m_block, head, batch, seqlen)

        for acc, mX in ((acc_dK, mdK), (acc_dV, mdV)):
            rX = cute.make_rmem_tensor_like(acc, self.dtype)
            sm90.convert_to(acc, rX)
            sm90.store_rows(rX, None, tiled_mma_dkv, tidx, mX, None, n_block, kv_head, batch, tile_n)

    @cute.jit
    def step_at(self, t: Int32, walk: tuple) -> tuple:
        """(query head, query tile) of step t of the walk (first head, m_first, tiles per head)."""
        first_head, m_first, per_head = walk
        return first_head + t // per_head, m_first + t % per_head

    @cute.jit
    def load_qdo(self, pipeline_qdo, t: Int32, walk: tuple, batch: Int32, sources: tuple):
        """Producer: step t's Q and dO tiles (its query head's) into stage t % q_stages."""
        tma_atom_Q, mQ_tma, sQ, tma_atom_dO, mdO_tma, sdO = sources
        head, m_block = self.step_at(t, walk)
        tile = (self.tile_m, self.head_dim)
        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_atom_Q, mQ_tma, sQ, tile, head, batch, (None, 0))
        tdOsdO, tdOgdO = tma_pipeline.partition_for_tma(tma_atom_dO, mdO_tma, sdO, tile, head, batch, (None, 0))
        tma_pipeline.load_kv_stage(pipeline_qdo, tma_pipeline.pipe_state(self.q_stages, t, producer=True), m_block,
                                   tma_atom_Q, tQgQ, tQsQ, tma_atom_dO, tdOgdO, tdOsdO)

    @cute.jit
    def p_and_ds(self, acc_S: cute.Tensor, acc_dP: cute.Tensor, tScS: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, n_block: Int32, m_block: Int32, head: Int32, batch: Int32, lens: tuple,
                 scale_log2: Float32, softmax_scale: Float32):
        """In place: acc_S becomes P^T = exp2(S^T * scale_log2 - LSE2), acc_dP becomes
        dS^T * scale = P^T * (dP^T - D) * scale. A query past the sequence gets LSE2 = +inf
        (P = 0); causal, a key past the query's diagonal (``lens`` = (seqlen, its offset)) gets P = 0."""
        seqlen, offset = lens
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            key, row = tScS[i]
            q = m_block * self.tile_m + row
            lse2, dq_dot = Float32(math.inf), Float32(0.0)
            if q < seqlen:
                lse2, dq_dot = mLSE2[batch, head, q], mD[batch, head, q]
            p = cute.math.exp2(acc_S[i] * scale_log2 - lse2, fastmath=True)
            if const_expr(self.causal):
                if n_block * self.tile_n + key > q + offset:
                    p = Float32(0.0)
            acc_S[i] = p
            acc_dP[i] = p * (acc_dP[i] - dq_dot) * softmax_scale

    @cute.jit
    def store_ds(self, acc_dS: cute.Tensor, tScS: cute.Tensor, sdS: cute.Tensor):
        """This thread's dS^T values into sdS[query, key], narrowed (one 2-byte store each)."""
        for i in cutlass.range_constexpr(cute.size(acc_dS)):
            key, row = tScS[i]
            sdS[row, key] = acc_dS[i].to(self.dtype)

    @cute.jit
    def add_dq(self, acc_dQ: cute.Tensor, tdQcdQ: cute.Tensor, mdQaccum: cute.Tensor, m_block: Int32,
               head: Int32, batch: Int32, seqlen: Int32):
        """This key tile's share of dQ for the query tile, added into the fp32 accumulator."""
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            row, col = tdQcdQ[i]
            q = m_block * self.tile_m + row
            if q < seqlen:
                cute.arch.atomic_add(mdQaccum.iterator + cute.crd2idx((batch, head, q, col), mdQaccum.layout),
                                     acc_dQ[i])


# --------------------------------------------------------------------------------------
# The pre-pass and the post-pass: one warp per query row
# --------------------------------------------------------------------------------------

class Prepass:
    """D = rowsum(dO * O) in fp32 and the LSE in log2 units, one warp per query row (lane l holds
    elements l, l + 32, ... of the row); the row of dQ's fp32 accumulator zeroed on the way."""

    WARPS = 4

    def rows_per_cta(self, head_dim: int) -> int:
        """Query rows a CTA takes: a warp each."""
        return self.WARPS

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
                 mdQaccum: cute.Tensor, stream):
        grid = (cute.ceil_div(mO.shape[2], self.rows_per_cta(cute.size(mO, mode=[3]))), mO.shape[1], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mdQaccum).launch(grid=grid, block=[32 * self.WARPS, 1, 1],
                                                               stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
               mdQaccum: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        lane, q = tidx % 32, bx * self.WARPS + tidx // 32
        if q < mO.shape[2]:
            self.row(mO, mdO, mLSE, mLSE2, mD, mdQaccum, batch, head, q, q, lane)

    @cute.jit
    def row(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
            mdQaccum: cute.Tensor, batch: Int32, head: Int32, q: Int32, out_row: Int32, lane: Int32,
            dq_row: Optional[Int32] = None):
        """One warp's query row ``q``: D and LSE2 into row ``out_row`` of mD and mLSE2, dQ's row
        (``dq_row`` of the accumulator where it lies elsewhere) zeroed."""
        zero_row = q
        if cutlass.const_expr(dq_row is not None):
            zero_row = dq_row
        dot = Float32(0.0)
        for j in cutlass.range_constexpr(cute.size(mO, mode=[3]) // 32):
            c = lane + 32 * j
            dot += mO[batch, head, q, c].to(Float32) * mdO[batch, head, q, c].to(Float32)
            mdQaccum[batch, head, zero_row, c] = Float32(0.0)
        dot = simt.butterfly_allreduce(dot, lambda a, b: a + b, 32)
        if lane == 0:
            mD[batch, head, out_row] = dot
            mLSE2[batch, head, out_row] = mLSE[batch, head, q] * LOG2_E


class Postpass:
    """dQ's fp32 accumulator narrowed to the input dtype, one warp per query row."""

    WARPS = 4

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, stream):
        grid = (cute.ceil_div(mdQ.shape[2], self.WARPS), mdQ.shape[1], mdQ.shape[0])
        self.kernel(mdQaccum, mdQ).launch(grid=grid, block=[32 * self.WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        lane, q = tidx % 32, bx * self.WARPS + tidx // 32
        if q < mdQ.shape[2]:
            for j in cutlass.range_constexpr(cute.size(mdQ, mode=[3]) // 32):
                c = lane + 32 * j
                mdQ[batch, head, q, c] = mdQaccum[batch, head, q, c].to(mdQ.element_type)


# --------------------------------------------------------------------------------------
# Host: compile and launch
# --------------------------------------------------------------------------------------

def config(p: Problem, overrides: dict = None) -> Config:
    return k4.config(p, overrides, DEFAULT_CONFIG)


def check(p: Problem, stage: str = "K9", features: bool = False, head_dims: tuple = HEAD_DIMS) -> None:
    """What the backward refuses; ``features``: whether the stage takes a window and a softcap."""
    if not features and (p.softcap or p.window != (-1, -1)):
        raise UnsupportedProblem(f"{stage} (backward): no sliding window or softcap (K10 takes them)")
    if not features and p.varlen:
        raise UnsupportedProblem(f"{stage} (backward): no packed sequences (varlen; K10 takes them)")
    if p.window != (-1, -1) and p.seqlen > p.kv_len:  # as the forward: the tile bounds assume keys >= queries
        raise UnsupportedProblem(f"{stage} (backward): a sliding window with more queries than keys (seqlen_q "
                                 f"{p.seqlen} > seqlen_k {p.kv_len}) is not supported")
    if p.head_dim not in head_dims:
        raise UnsupportedProblem(f"{stage} (backward): head_dim {p.head_dim} not supported "
                                 f"(supported: {list(head_dims)})")
    if p.dtype not in ("bfloat16", "float16"):
        raise UnsupportedProblem(f"{stage} (backward): dtype {p.dtype} not supported (bfloat16, float16)")


def fake_tensors(p: Problem, f: FakeShapes | None = None) -> tuple:
    """Makers of fake (batch, heads, seqlen, d) tensors (``kv``: K/V's heads and length) and
    (batch, heads, seqlen) ones, shapes shared (``f``'s, or new ones), for one compile."""
    f = f or FakeShapes()
    return (lambda dtype, kv=False: f.tensor(dtype, (p.head_dim,), kv=kv)), (lambda: f.tensor(Float32, ()))


def compile_backward(p: Problem, keep_ptx: bool = False, **overrides) -> tuple:
    """(pre-pass, main kernel, post-pass) compiled for ``p``'s head dim, dtype and masking."""
    check(p)
    cfg = config(p, overrides)
    dt = cute_dtype(p.dtype)

    def main():
        x, rows = fake_tensors(p)
        return (K9Backward(p.head_dim, dt, p.causal, **cfg),
                (x(dt), x(dt, True), x(dt, True), x(dt), rows(), rows(), x(Float32), x(dt, True), x(dt, True),
                 Float32(1.0), fake_stream()))

    key = ("k9", p.head_dim, p.dtype, p.causal, tuple(sorted(cfg.items())))
    pre, post = compile_passes(p, keep_ptx)
    return pre, jit_compile(key, main, keep_ptx), post


def compile_passes(p: Problem, keep_ptx: bool = False, prepass: type = None) -> tuple:
    """The pre-pass and the post-pass for ``p``'s head dim and dtype (a later stage may share them;
    ``prepass``: a subclass of ``Prepass`` in its place)."""
    dt = cute_dtype(p.dtype)
    prepass = prepass or Prepass

    def pre():
        x, rows = fake_tensors(p)
        return prepass(), (x(dt), x(dt), rows(), rows(), rows(), x(Float32), fake_stream())

    def post():
        x, _ = fake_tensors(p)
        return Postpass(), (x(Float32), x(dt), fake_stream())

    return (jit_compile(("k9_pre", p.head_dim, p.dtype, prepass.__name__), pre, keep_ptx),
            jit_compile(("k9_post", p.head_dim, p.dtype), post, keep_ptx))


def row_buffers(batch: int, heads: int, rows: int, device) -> tuple:
    """LSE2 and D, (batch, heads, rows) floats each, in one allocation: every row padded to 4
    floats (16 bytes, where a TMA box of them may start) and D starting 32 bytes into the
    allocation (the pre-pass's compile assumes 32-byte aligned row tensors)."""
    import torch

    size = batch * heads * (rows + (-rows % 4))
    flat = torch.empty(2 * (size + (-size % 8)), device=device, dtype=torch.float32)
    return tuple(flat[start:start + size].view(batch, heads, -1)[..., :rows] for start in (0, size + (-size % 8)))


def aligned_rows(t):
    """``t`` contiguous and 16-byte aligned, as the kernels' TMA and 16-byte loads take O and dO:
    itself when it is, else a copy (a caller's view may start anywhere)."""
    t = t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def run_backward(compiled: tuple, q, k, v, o, lse, do, softmax_scale: float, grads: tuple | None = None,
                 extra: tuple = (), dq_accum=None, post_extra: tuple = ()) -> tuple:
    """(dq, dk, dv) of attention(q, k, v) = o with log-sum-exp ``lse`` (natural log, float32,
    (batch, heads, seqlen)), for the gradient ``do`` of o, into ``grads`` if given (the checks
    pass NaN-filled ones). Three launches; ``extra``: arguments after the main kernel's own;
    ``dq_accum``: (the accumulator as the pre-pass zeroes it, as the kernel and the post-pass
    read it) where a stage lays it out otherwise (zeroed already); ``post_extra``: arguments after
    the post-pass's own."""
    import torch

    pre, main, post = compiled
    b, h, n, d = q.shape
    lse2, dot = row_buffers(b, h, n, q.device)
    if dq_accum is None:
        dq_accum = (torch.empty(b, h, n, d, device=q.device, dtype=torch.float32),) * 2
    dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    o, do = aligned_rows(o), aligned_rows(do)
    pre(o, do, lse, lse2, dot, dq_accum[0])
    main(q, k, v, do, lse2, dot, dq_accum[1], dk, dv, softmax_scale, *extra)
    post(dq_accum[1], dq, *post_extra)
    return dq, dk, dv
