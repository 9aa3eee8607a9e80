"""K4.2: both GEMMs on WGMMA, online softmax on the accumulator in registers.

What changes relative to K3 (TMA loads into a multi-stage pipeline, CUDA-core math):

* S = Q K^T and O += P V are warpgroup MMAs (WGMMA, 64 x N x 16 per instruction) reading
  Q, K, V straight from swizzled SMEM through 64-bit descriptors. The swizzled layouts come
  from ``cutlass.utils.hopper_helpers.make_smem_layout_a/b``; TMA writes in that same swizzle.
* The score tile never leaves registers. The online softmax runs on the QK accumulator
  fragment (each row lives on 4 sibling lanes: quad shuffles for max and sum), and the
  probabilities P are handed to the PV WGMMA as its *register* A operand: the QK C fragment
  re-indexed as an A fragment (``sm90.acc_as_operand_a``) and narrowed to bf16/fp16.
* V is the B operand of PV with the contraction over keys, but its contiguous axis is d,
  which is PV's N axis. So V is re-viewed at entry with modes (d, seqlen, heads, batch):
  the bytes do not move, and both the TMA atom and the WGMMA descriptor see an MN-major
  operand derived from that one view.
* O stays in registers for the whole KV loop (rescaled per tile, normalized once at the
  end) and is written straight from registers with row predication; LSE goes out with it.
  (An SMEM + TMA store would clip rows for free, but costs a CTA barrier and an STSM pass
  for a write that happens once per CTA, after its whole KV loop; 4-byte predicated stores
  are simpler.)

Threads: ``num_wg`` warpgroups (``DEFAULT_CONFIG``: 3 at d=64, 2 at d=128/256), each owning
its own 64-row slice of a tile_m = 64*num_wg query tile and doing exactly the same work. No
warp specialization (K5): warp 0 also issues the TMA loads, between its own WGMMAs. The
warpgroups drift against each other freely, so one's softmax overlaps another's tensor-core
work without any explicit scheduling (K6).

Pipeline: Q one stage; K and V share ``kv_stages`` stages with one full barrier per stage
that covers K+V bytes. Separate K and V barriers only pay when QK can start before V lands,
i.e. when loads are issued just in time; here they are issued stages-lag tiles ahead, so a
single barrier (half the mbarrier traffic) is enough. Stage s of tile j is refilled with tile
j+stages at iteration j+``refill_lag``: lag 1 is the tightest ring, lag 2 lets the other
warpgroup trail warp 0 by up to a tile before warp 0 has to wait for its release. The lag
must stay below kv_stages (``check_config`` refuses the rest: with lag >= stages warp 0 would
wait for a tile it has not loaded yet).

Causal: KV tiles above the diagonal are never loaded or computed (``tiles.kv_tile_count``);
only the trailing diagonal / seqlen tiles run the masked code path. CTAs are launched
heaviest-first (reversed query tiles) so the long causal rows do not start last.

Reading order: the file starts on the host (``K4FMHA.__call__``: TMA-friendly views, the two
tiled MMAs, swizzled SMEM layouts, TMA atoms, the SharedStorage struct, the launch) and then
follows the kernel's data flow (pipelines, TMA and MMA partitions, the KV loop in
``kv_iteration``, the epilogue). Unlike K2/K3/K4.1, which declare SharedStorage inside the
kernel and let the DSL size the dynamic SMEM from the allocator, K4 declares it in the host
launcher next to the layouts it is built from and passes ``smem=SharedStorage.size_in_bytes()``
explicitly (the CUTLASS Hopper examples' idiom): with up to ~220 KB per CTA the requested
size is then visible at the launch, beside the ``smem_bytes`` that ``compile_kernel`` checks
against the 227 KB limit. Both forms allocate the same struct through ``SmemAllocator``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import sm90, tma_pipeline
from .contract import (
    LOG2_E,
    SMEM_CAPACITY,
    Capabilities,
    CompiledAttention,
    Problem,
    UnsupportedProblem,
    cute_dtype,
    fake_attention_args,
    fused_attention,
    jit_compile,
    run_kernel,  # noqa: F401  (the contract's launch-only entry)
)
from .tiles import kv_tile_count, unmasked_kv_tile_count

CAPS = Capabilities(head_dims=(64, 128, 256))

# Per head dim, timed on an H200 at seqlen 8192, bf16 (scripts/k4_tune.py, d=64 and d=128):
# d=64 gains from a third warpgroup (more rows share each K/V tile, and three warpgroups hide
# one another's softmax better). d=128 stays at 2 warpgroups: that kernel uses 194 registers
# per thread; 3 warpgroups (384 threads) cap ptxas at 168, which it meets without spilling,
# but the config is not in k4_tune.py's sweep, so 2 vs 3 at d=128 is untimed here. (Register
# counts: ptxas -v via harness/inspect_ptx.ptxas_report on the CPU-compiled PTX, nvidia-cutlass-dsl
# 4.8.1, sm_90a; d=64's 3-warpgroup default uses 155.) d=256 needs tile_n=64 to fit two stages
# in SMEM (tile_n=128 would need 321 KB); its config comes from an earlier tuning run that
# scripts/k4_tune.py does not reproduce.
DEFAULT_CONFIG = {
    64: dict(num_wg=3, tile_n=128, kv_stages=3, refill_lag=2),
    128: dict(num_wg=2, tile_n=128, kv_stages=2, refill_lag=1),
    256: dict(num_wg=2, tile_n=64, kv_stages=2, refill_lag=1),
}


class K4FMHA:
    def __init__(self, head_dim: int, dtype, causal: bool, num_wg: int, tile_n: int, kv_stages: int,
                 refill_lag: int):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.num_wg = num_wg
        self.tile_m = 64 * num_wg
        self.tile_n = tile_n
        self.kv_stages = kv_stages
        self.refill_lag = refill_lag
        self.num_threads = 128 * num_wg

    def smem_bytes(self) -> int:
        """SharedStorage bytes: mbarriers, then sQ, sK, sV each on a 1024-byte boundary."""
        tile_bytes = self.dtype.width // 8 * self.head_dim
        return tma_pipeline.smem_footprint(self.kv_stages, [
            (self.tile_m * tile_bytes, 1024),
            (self.kv_stages * self.tile_n * tile_bytes, 1024),
            (self.kv_stages * self.tile_n * tile_bytes, 1024),
        ])

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        d, dt = self.head_dim, self.dtype
        # TMA-friendly views of the (B, H, N, d) tensors: (N, d, H, B), and V as (d, N, H, B).
        # V's leading mode is now d, so LayoutEnum reads it as MN-major for the PV B operand.
        mQt = tma_pipeline.seq_major_view(mQ)
        mKt = tma_pipeline.seq_major_view(mK)
        mVt = tma_pipeline.head_dim_major_view(mV)

        # GEMM-I  S(tile_m, tile_n) = Q(tile_m, d) . K(tile_n, d)^T, both K-major (d contiguous).
        # GEMM-II O(tile_m, d) += P(tile_m, tile_n) . V^T(d, tile_n), P from registers, V MN-major.
        # atom_layout (num_wg, 1, 1): warpgroup w owns rows [64w, 64w+64) of both.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n))
        v_major = LayoutEnum.from_tensor(mVt)
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, v_major.sm90_mma_major_mode(), Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)

        # Swizzled SMEM: the layout atom (128B swizzle for 64 bf16 along the contiguous axis)
        # is what lets WGMMA read 8x8 core matrices without bank conflicts.
        sQ_layout = cute.select(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt, 1),
            mode=[0, 1])
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt,
                                                  self.kv_stages)
        sVt_layout = sm90_utils.make_smem_layout_b(v_major, (self.tile_m, d, self.tile_n), dt, self.kv_stages)

        tma_Q, gQ_tma = tma_pipeline.make_tma_load(mQt, sQ_layout, (self.tile_m, d))
        tma_K, gK_tma = tma_pipeline.make_tma_load(mKt, sK_layout, (self.tile_n, d))
        tma_V, gV_tma = tma_pipeline.make_tma_load(mVt, sVt_layout, (d, self.tile_n))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sVt_layout)], 1024]

        scale_log2 = softmax_scale * LOG2_E
        grid = (cute.ceil_div(mQ.shape[2], self.tile_m), mQ.shape[1], mQ.shape[0])
        self.kernel(gQ_tma, gK_tma, gV_tma, mO, mLSE, tma_Q, tma_K, tma_V, scale_log2,
                    sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, gQ_tma: cute.Tensor, gK_tma: cute.Tensor, gV_tma: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom,
               scale_log2: Float32, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sVt_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        tile_m, tile_n, d, stages = self.tile_m, self.tile_n, self.head_dim, self.kv_stages
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        # Causal: the last query tiles visit the most KV tiles; launch them first.
        m_block = gdx - 1 - bx if const_expr(self.causal) else bx
        seqlen = mO.shape[2]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            tma_pipeline.prefetch_descriptors(tma_Q, tma_K, tma_V)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        q_bytes = tma_pipeline.stage_bytes(self.dtype, sQ_layout)
        kv_bytes = tma_pipeline.stage_bytes(self.dtype, sK_layout) + tma_pipeline.stage_bytes(self.dtype, sVt_layout)
        pipe_q, pipe_kv = tma_pipeline.make_pipelines(storage.mbar_q.data_ptr(), storage.mbar_kv.data_ptr(),
                                                      q_bytes, kv_bytes, stages, self.num_threads)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sV.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)

        n_tiles = kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)

        # ---- TMA partitions: one box per tile, indexed by SMEM stage and GMEM tile ----------
        # Q: just this CTA's tile; K, V: every KV tile, indexed when loaded.
        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_Q, gQ_tma, sQ, (tile_m, d), head, batch, coord=(m_block, 0))
        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_K, gK_tma, sK, (tile_n, d), head, batch)
        # V^T is viewed (d, seqlen, ...): its KV tiles run along mode 1.
        tVsV, tVgV = tma_pipeline.partition_for_tma(tma_V, gV_tma, sVt, (d, tile_n), head, batch, coord=(0, None))
        kv_loads = (tma_K, tKgK, tKsK, tma_V, tVgV, tVsV)

        if warp_idx == 0:
            tma_pipeline.load_q(pipe_q, tma_Q, tQgQ, tQsQ)
            for t in cutlass.range(cutlass.min(stages, n_tiles), unroll=1):
                tma_pipeline.load_kv_stage(pipe_kv, tma_pipeline.pipe_state(stages, t, producer=True), t, *kv_loads)

        # ---- MMA partitions -------------------------------------------------------------
        # Operand descriptors are per warpgroup (the WGMMA is issued by all 128 threads of
        # it); accumulator fragments are per thread.
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))          # (.., stage)
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))        # (.., stage)
        # P's home: a 16-bit register A fragment, rewritten from acc_S every KV tile.
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((tile_m, tile_n)))
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((tile_m, d)), Float32)
        acc_O.fill(0.0)  # zero + unified rescale: the first tile needs no special case
        # Coordinate probe: the identity tensor partitioned like acc_S says which (row, col)
        # of the tile each accumulator register holds.
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((tile_m, tile_n)))

        softmax = sm90.OnlineSoftmax(cute.size(sm90.acc_mn_view(acc_O), mode=[0]), scale_log2)
        row_scale = cute.make_rmem_tensor(softmax.num_rows, Float32)

        # Q is loaded once and read by every QK GEMM; its stage is never released.
        tma_pipeline.wait_q(pipe_q)
        # Unmasked tiles first, then the diagonal / seqlen-tail tiles with the masked path.
        loads = (pipe_kv, *kv_loads)
        mmas = (tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS)
        for j in cutlass.range(n_unmasked, unroll=1):
            self.kv_iteration(j, n_tiles, m_block, seqlen, warp_idx, loads, mmas, softmax, row_scale,
                              masked=False)
        for j in cutlass.range(n_unmasked, n_tiles, unroll=1):
            self.kv_iteration(j, n_tiles, m_block, seqlen, warp_idx, loads, mmas, softmax, row_scale,
                              masked=True)

        # ---- Epilogue: normalize once, write O and LSE straight from registers ------------
        lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
        softmax.finalize(acc_O, lse)
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        sm90.convert_to(acc_O, rO)

        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        gO = cute.local_tile(mO[batch, head, None, None], (tile_m, d), (m_block, 0))
        tOgO_mn = sm90.acc_mn_view(thr_mma_pv.partition_C(gO))
        tOcO_mn = sm90.acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((tile_m, d))))
        rO_mn = sm90.acc_mn_view(rO)
        rows_left = seqlen - m_block * tile_m
        for r in cutlass.range_constexpr(softmax.num_rows):
            row = tOcO_mn[r, 0][0]
            if row < rows_left:
                # Each row segment is (2 adjacent columns) x (pairs 8 apart): 4-byte stores.
                cute.autovec_copy(rO_mn[r, None], tOgO_mn[r, None])
                if tOcO_mn[r, 0][1] == 0:  # lane 0 of the quad owns column 0: it writes LSE
                    mLSE[batch, head, m_block * tile_m + row] = lse[r]

    @cute.jit
    def kv_iteration(self, j: Int32, n_tiles: Int32, m_block: Int32, seqlen: Int32, warp_idx: Int32,
                     loads: tuple, mmas: tuple, softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor,
                     masked: cutlass.Constexpr[bool]):
        """One KV tile: S = QK^T, (mask), softmax on the fragment, O = O*scale + P V."""
        pipe_kv, *kv_loads = loads
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS = mmas
        cons = tma_pipeline.pipe_state(self.kv_stages, j, producer=False)
        pipe_kv.consumer_wait(cons)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        sm90.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, cons.index], zero_init=True, wg_wait=-1)
        # While QK runs on the tensor cores, warp 0 refills the stage that was consumed
        # refill_lag tiles ago (it waits there until every warp has released it).
        if warp_idx == 0:
            t = j - self.refill_lag + self.kv_stages
            if j >= self.refill_lag and t < n_tiles:
                tma_pipeline.load_kv_stage(pipe_kv, tma_pipeline.pipe_state(self.kv_stages, t, producer=True), t,
                                           *kv_loads)
        warpgroup.wait_group(0)
        if const_expr(masked):
            sm90.mask_tile(acc_S, tScS, m_block, j, seqlen, self.tile_m, self.tile_n, self.causal)
        softmax.step(acc_S, row_scale, check_inf=masked)
        softmax.rescale(acc_O, row_scale)
        # The register handoff: acc_S's C fragment re-read in A-operand order, narrowed.
        sm90.convert_to(sm90.acc_as_operand_a(acc_S), tOrP)
        sm90.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, cons.index], zero_init=False, wg_wait=0)
        pipe_kv.consumer_release(cons)


def _config(p: Problem, overrides: dict) -> dict:
    cfg = dict(DEFAULT_CONFIG[p.head_dim])
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def check_config(cfg: dict) -> None:
    """Refuse a configuration the kernel cannot run (rather than hang, mis-tile or spill)."""
    for name in ("num_wg", "tile_n", "kv_stages", "refill_lag"):
        if not isinstance(cfg[name], int) or isinstance(cfg[name], bool):
            raise UnsupportedProblem(f"K4 config {cfg}: {name} must be an int")
    num_wg, tile_n, stages, lag = cfg["num_wg"], cfg["tile_n"], cfg["kv_stages"], cfg["refill_lag"]
    if not 1 <= lag < stages:
        # At iteration j warp 0 first waits for tile j, then loads tile j - lag + stages. With
        # lag >= stages (kv_stages == 1 included) that is tile j or an earlier one, which has
        # not been loaded yet: warp 0 waits forever for a load only it can issue.
        raise UnsupportedProblem(
            f"K4 config {cfg}: needs 1 <= refill_lag < kv_stages (at iteration j warp 0 waits for tile j, "
            f"then loads tile j - refill_lag + kv_stages; with refill_lag >= kv_stages that tile is not "
            f"loaded yet and the kernel would hang)")
    if not 1 <= num_wg <= 3 or 64 * num_wg > 256:
        raise UnsupportedProblem(
            f"K4 config {cfg}: num_wg must be 1, 2 or 3 (tile_m = 64*num_wg rows is one TMA box of at "
            f"most 256 rows, and 4 warpgroups would leave at most 128 registers per thread)")
    if tile_n % 16 != 0 or not 16 <= tile_n <= 256:
        raise UnsupportedProblem(
            f"K4 config {cfg}: tile_n must be a multiple of 16 in [16, 256] (the PV WGMMA's K step is 16 "
            f"keys, and a K/V tile is one TMA box of at most 256 rows)")


def compile_kernel(p: Problem, *, keep_ptx: bool = False, num_wg=None, tile_n=None, kv_stages=None,
                   refill_lag=None) -> CompiledAttention:
    CAPS.check(p)
    cfg = _config(p, dict(num_wg=num_wg, tile_n=tile_n, kv_stages=kv_stages, refill_lag=refill_lag))
    check_config(cfg)
    dt = cute_dtype(p.dtype)
    kernel = K4FMHA(p.head_dim, dt, p.causal, **cfg)
    if kernel.smem_bytes() > SMEM_CAPACITY:
        raise UnsupportedProblem(
            f"K4 config {cfg} at head_dim {p.head_dim} needs {kernel.smem_bytes() // 1024} KB of SMEM "
            f"(limit {SMEM_CAPACITY // 1024} KB): use fewer kv_stages or a smaller tile_n")
    key = ("k4", p.head_dim, p.dtype, p.causal, tuple(sorted(cfg.items())))
    fn = jit_compile(key, lambda: (kernel, fake_attention_args(dt, p.head_dim)), keep_ptx)
    return fused_attention("k4", p, fn, keep_ptx, dict(cfg, smem_bytes=kernel.smem_bytes()))
