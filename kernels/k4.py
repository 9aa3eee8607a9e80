"""K4.2: both GEMMs on WGMMA, online softmax on the accumulator in registers.

New relative to K4.1 (same TMA loads, swizzled sQ/sK and QK WGMMA):
* P stays in registers. The online softmax runs on the QK accumulator fragment (a row spans 4
  sibling lanes: quad shuffles), and that fragment, re-indexed as a register A operand
  (``sm90.acc_as_operand_a``) and narrowed to 16 bits, is the PV WGMMA's A operand. sS and
  its CTA barriers are gone.
* V is PV's B operand, contracted over keys but contiguous in d (PV's N axis): it is re-viewed
  as (d, seqlen, heads, batch) and lands MN-major in a swizzled ``sVt``; the bytes do not move.
* O stays in registers for the whole KV loop and is stored from them, rows predicated, LSE
  beside it (a TMA store would cost an SMEM pass and a CTA barrier for a once-per-CTA write).
* Pipeline positions are computed from the tile index (``tma_pipeline.pipe_state``), so warp 0
  refills a stage while QK runs: tile n_block + stages goes into that stage at iteration
  n_block + ``refill_lag``. K and V still share one full barrier per stage.
* The tile shape is a configuration. ``k4_seed`` runs K4.1's (one warpgroup, 64-key tiles,
  5 stages); ``k4`` runs ``DEFAULT_CONFIG``, tuned per head dim, where each of num_wg
  warpgroups owns 64 rows of the query tile. No warp specialization yet (K5).
* Unmasked KV tiles and the diagonal / seqlen-tail tiles run in separate loops
  (``kv_iteration(masked=...)``); causal CTAs launch heaviest-first.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import sm90, tma_pipeline
from .contract import (
    LOG2_E,
    Capabilities,
    CompiledAttention,
    Config,
    Problem,
    UnsupportedProblem,
    configure,
    cute_dtype,
    fake_attention_args,
    fused_attention,
    jit_compile,
    run_kernel,  # noqa: F401  (the contract's launch-only entry)
)
from .tiles import kv_tile_count, unmasked_kv_tile_count

HEAD_DIMS = (64, 128, 256)

# K4.1's shape on K4.2's code: the registry's k4_seed, the first row of scripts/k4_tune.py.
SEED_CONFIG = dict(num_wg=1, tile_n=64, kv_stages=5, refill_lag=1)

# Per head dim, timed on an H200 at seqlen 8192, bf16 (scripts/k4_tune.py, d=64 and d=128):
# d=64 gains from a third warpgroup (more rows share each K/V tile, and three warpgroups hide
# one another's softmax better). d=128 stays at 2 warpgroups: 3 (384 threads) would cap ptxas
# at 168 registers per thread (compare the count `python bench.py k4 --compile-only --headdim
# 128` prints for 2), and 3 at d=128 is not in k4_tune.py's sweep, so it is untimed.
# d=256 needs tile_n=64 to fit two stages in SMEM; its config comes from an earlier tuning run
# that scripts/k4_tune.py does not reproduce.
DEFAULT_CONFIG = {
    64: dict(num_wg=3, tile_n=128, kv_stages=3, refill_lag=2),
    128: dict(num_wg=2, tile_n=128, kv_stages=2, refill_lag=1),
    256: dict(num_wg=2, tile_n=64, kv_stages=2, refill_lag=1),
}


def smem_bytes(head_dim: int, num_wg: int, tile_n: int, kv_stages: int, dtype_bytes: int = 2, **_) -> int:
    """sQ, kv_stages-deep sK and sVt, all swizzled WGMMA operands."""
    return tma_pipeline.smem_bytes(sm90.WGMMA_M * num_wg, tile_n, head_dim, dtype_bytes, kv_stages)


class K4FMHA:
    def __init__(self, head_dim: int, dtype, causal: bool, num_wg: int, tile_n: int, kv_stages: int,
                 refill_lag: int):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.num_wg = num_wg
        self.tile_m = sm90.WGMMA_M * num_wg  # warpgroup w owns query rows [64w, 64w + 64) of the tile
        self.tile_n = tile_n
        self.kv_stages = kv_stages
        self.refill_lag = refill_lag
        self.num_threads = sm90.THREADS_PER_WARPGROUP * num_wg

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        # V as (d, seqlen, heads, batch): d is now the leading mode, so LayoutEnum reads V as
        # MN-major for the PV B operand.
        self.launch(mQ, mK, tma_pipeline.head_dim_major_view(mV), mO, mLSE, None, softmax_scale, stream)

    @cute.jit
    def launch(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mAux: Optional[cute.Tensor], softmax_scale: Float32, stream):
        """Build the MMAs, SMEM layouts and TMA atoms around V viewed as (d, seqlen, heads, batch)
        (its major mode read from the view), then launch. ``mAux``: None here; an operand that a
        subclass's hooks (``score_scale``, ``finish_o``) read."""
        d, dt = self.head_dim, self.dtype
        v_major = LayoutEnum.from_tensor(mVt)
        # GEMM-I  S(tile_m, tile_n) = Q(tile_m, d) . K(tile_n, d)^T, both K-major (d contiguous).
        # GEMM-II O(tile_m, d) += P(tile_m, tile_n) . V^T(d, tile_n), P from registers, V MN-major.
        # atom_layout (num_wg, 1, 1): warpgroup w owns rows [64w, 64w+64) of both.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, v_major.sm90_mma_major_mode(), Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)

        # Swizzled SMEM for the WGMMA operands: the layout atom (128B swizzle for 64 bf16 along
        # the contiguous axis) is what lets WGMMA read 8x8 core matrices without bank conflicts.
        # sVt, the MN-major V, is now one of them.
        sQ_layout = cute.select(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt, 1),
            mode=[0, 1])
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt,
                                                  self.kv_stages)
        sVt_layout = sm90_utils.make_smem_layout_b(v_major, (self.tile_m, d, self.tile_n), dt, self.kv_stages)

        tma_atom_Q, mQ_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mQ), sQ_layout, (self.tile_m, d))
        tma_atom_K, mK_tma = tma_pipeline.make_tma_load(tma_pipeline.seq_major_view(mK), sK_layout, (self.tile_n, d))
        tma_atom_V, mV_tma = tma_pipeline.make_tma_load(mVt, sVt_layout, (d, self.tile_n))

        SharedStorage = tma_pipeline.shared_storage(dt, sQ_layout, sK_layout, sVt_layout, self.kv_stages)

        scale_log2 = softmax_scale * LOG2_E
        grid = (cute.ceil_div(mQ.shape[2], self.tile_m), mQ.shape[1], mQ.shape[0])
        self.kernel(mQ_tma, mK_tma, mV_tma, mO, mLSE, mAux, tma_atom_Q, tma_atom_K, tma_atom_V, scale_log2,
                    sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mQ_tma: cute.Tensor, mK_tma: cute.Tensor, mV_tma: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mAux: Optional[cute.Tensor], tma_atom_Q: cute.CopyAtom,
               tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
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
        wg_idx = cute.arch.make_warp_uniform(tidx // sm90.THREADS_PER_WARPGROUP)

        if warp_idx == 0:
            tma_pipeline.prefetch_descriptors(tma_atom_Q, tma_atom_K, tma_atom_V)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sK, sVt = tma_pipeline.smem_tensors(storage, sQ_layout, sK_layout, sVt_layout)
        pipeline_q, pipeline_kv = tma_pipeline.make_pipelines(storage, self.dtype, sQ_layout, sK_layout, sVt_layout,
                                                              stages, self.num_threads)

        n_tiles = kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)
        n_unmasked = unmasked_kv_tile_count(m_block, seqlen, tile_m, tile_n, self.causal)

        # ---- TMA partitions: one box per tile, indexed by SMEM stage and GMEM tile ----------
        tQsQ, tQgQ = tma_pipeline.partition_for_tma(tma_atom_Q, mQ_tma, sQ, (tile_m, d), head, batch, (m_block, 0))
        # K's KV tiles run along mode 0; V^T's, viewed (d, seqlen, ...), along mode 1.
        tKsK, tKgK = tma_pipeline.partition_for_tma(tma_atom_K, mK_tma, sK, (tile_n, d), head, batch, (None, 0))
        tVsVt, tVgVt = tma_pipeline.partition_for_tma(tma_atom_V, mV_tma, sVt, (d, tile_n), head, batch, (0, None))
        kv_loads = (tma_atom_K, tKgK, tKsK, tma_atom_V, tVgVt, tVsVt)

        # ---- prefetch: Q, then the first min(stages, n_tiles) K/V tiles --------------------
        if warp_idx == 0:
            tma_pipeline.load_q(pipeline_q, tma_atom_Q, tQgQ, tQsQ)
            for n_block in cutlass.range(cutlass.min(stages, n_tiles), unroll=1):
                tma_pipeline.load_kv_stage(pipeline_kv, tma_pipeline.pipe_state(stages, n_block, producer=True),
                                           n_block, *kv_loads)

        # ---- MMA partitions -------------------------------------------------------------
        # Operand descriptors are per warpgroup (the WGMMA is issued by all 128 threads of
        # it); accumulator fragments are per thread.
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * sm90.THREADS_PER_WARPGROUP)
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

        softmax = self.tile_softmax(cute.size(sm90.acc_mn_view(acc_O), mode=[0]), self.score_scale(scale_log2, mAux))
        row_scale = cute.make_rmem_tensor(softmax.num_rows, Float32)

        # Q is loaded once and read by every QK GEMM; its stage is never released.
        tma_pipeline.wait_q(pipeline_q)
        # Unmasked tiles first, then the diagonal / seqlen-tail tiles with the masked path.
        loads = (pipeline_kv, *kv_loads)
        mmas = sm90.Mmas(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS)
        for n_block in cutlass.range(n_unmasked, unroll=1):
            self.kv_iteration(n_block, n_tiles, m_block, seqlen, warp_idx, loads, mmas, softmax, row_scale,
                              masked=False)
        for n_block in cutlass.range(n_unmasked, n_tiles, unroll=1):
            self.kv_iteration(n_block, n_tiles, m_block, seqlen, warp_idx, loads, mmas, softmax, row_scale,
                              masked=True)

        # ---- Epilogue: normalize once, write O and LSE straight from registers ------------
        self.finish_o(acc_O, mAux)
        sm90.store_o_and_lse(acc_O, softmax, tiled_mma_pv, tidx, mO, mLSE, m_block, head, batch, tile_m,
                             mO.element_type)

    @cute.jit
    def kv_iteration(self, n_block: Int32, n_tiles: Int32, m_block: Int32, seqlen: Int32, warp_idx: Int32,
                     loads: tuple, mmas: sm90.Mmas, softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor,
                     masked: cutlass.Constexpr[bool]):
        """One KV tile: S = QK^T, (mask), softmax on the fragment, O = O*scale + P V."""
        pipeline_kv, *kv_loads = loads
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS = mmas
        kv_consume = tma_pipeline.pipe_state(self.kv_stages, n_block, producer=False)
        pipeline_kv.consumer_wait(kv_consume)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        sm90.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_consume.index], zero_init=True, wg_wait=-1)
        # While QK runs on the tensor cores, warp 0 refills the stage that was consumed
        # refill_lag tiles ago (it waits there until every warp has released it).
        if warp_idx == 0:
            n_refill = n_block - self.refill_lag + self.kv_stages
            if n_block >= self.refill_lag and n_refill < n_tiles:
                kv_produce = tma_pipeline.pipe_state(self.kv_stages, n_refill, producer=True)
                tma_pipeline.load_kv_stage(pipeline_kv, kv_produce, n_refill, *kv_loads)
        warpgroup.wait_group(0)
        if const_expr(masked):
            sm90.mask_tile(acc_S, tScS, m_block, n_block, seqlen, self.tile_m, self.tile_n, self.causal)
        softmax.step(acc_S, row_scale, check_inf=masked)
        softmax.rescale(acc_O, row_scale)
        self.p_to_operand(acc_S, tOrP)
        sm90.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_consume.index], zero_init=False, wg_wait=0)
        pipeline_kv.consumer_release(kv_consume)

    # ---- Hooks: what a later stage changes about the scores, P and O (K4's own behaviour here) ----

    def score_scale(self, scale_log2: Float32, mAux) -> Float32:
        """The factor on S = QK^T before exp2 (log2 units)."""
        return scale_log2

    def tile_softmax(self, num_rows: int, scale_log2: Float32, *tile) -> sm90.OnlineSoftmax:
        """A fresh row max / sum for a query tile (``tile``: its coordinates, for a stage that needs them)."""
        return sm90.OnlineSoftmax(num_rows, scale_log2)

    def p_to_operand(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        """The register handoff: acc_S's C fragment re-read in A-operand order, narrowed."""
        sm90.convert_to(sm90.acc_as_operand_a(acc_S), tOrP)

    def finish_o(self, acc_O: cute.Tensor, mAux):
        """O's accumulator after the last KV tile, before normalization and the store."""


def config(p: Problem, overrides: dict = None, defaults: dict = None) -> Config:
    """DEFAULT_CONFIG (or ``defaults``, a table of the same shape) for ``p``'s head dim, then the
    overrides."""
    return configure((defaults or DEFAULT_CONFIG)[p.head_dim], overrides)


def check_config(cfg: dict, name: str = "K4", num_wgs=(1, 2, 3)) -> None:
    """Refuse a configuration the kernel cannot run (rather than hang, mis-tile or spill): the
    knobs every stage from K4 on has (K5's ``check_config`` adds its own)."""
    for key in ("num_wg", "tile_n", "kv_stages", "q_stages", "refill_lag"):
        if key in cfg and (not isinstance(cfg[key], int) or isinstance(cfg[key], bool)):
            raise UnsupportedProblem(f"{name} config {cfg}: {key} must be an int")
    if "refill_lag" in cfg and not 1 <= cfg["refill_lag"] < cfg["kv_stages"]:
        raise UnsupportedProblem(
            f"{name} config {cfg}: needs 1 <= refill_lag < kv_stages (at iteration n warp 0 waits for tile n, "
            f"then loads tile n - refill_lag + kv_stages; with refill_lag >= kv_stages that tile is not "
            f"loaded yet and the kernel would hang)")
    if cfg["num_wg"] not in num_wgs:
        raise UnsupportedProblem(
            f"{name} config {cfg}: num_wg must be one of {sorted(num_wgs)}, the warpgroup counts this stage has "
            f"tiles (64*num_wg rows, one TMA box of at most 256) and register budgets for")
    if cfg["tile_n"] % 16 != 0 or not 16 <= cfg["tile_n"] <= 256:
        raise UnsupportedProblem(
            f"{name} config {cfg}: tile_n must be a multiple of 16 in [16, 256] (the PV WGMMA's K step is 16 "
            f"keys, and a K/V tile is one TMA box of at most 256 rows)")
    if cfg["kv_stages"] < 1 or cfg.get("q_stages", 1) < 1:
        raise UnsupportedProblem(f"{name} config {cfg}: kv_stages and q_stages must be >= 1")


def capabilities(num_wg=None, tile_n=None, kv_stages=None, refill_lag=None) -> Capabilities:
    """The head dims whose configuration fits in SMEM: DEFAULT_CONFIG's, with the overrides
    (k4_seed's registry entry overrides all four; its 5 stages do not fit at d=256)."""
    overrides = dict(num_wg=num_wg, tile_n=tile_n, kv_stages=kv_stages, refill_lag=refill_lag)
    given = ", ".join(f"{k}={v}" for k, v in overrides.items() if v is not None)
    return tma_pipeline.smem_capabilities(HEAD_DIMS,
                                          lambda d: smem_bytes(d, **config(Problem(1, 1, 1, d), overrides)),
                                          f"with {given or 'DEFAULT_CONFIG'}")


CAPS = capabilities()


def compile_kernel(p: Problem, *, keep_ptx: bool = False, num_wg=None, tile_n=None, kv_stages=None,
                   refill_lag=None) -> CompiledAttention:
    CAPS.check(p)
    cfg = config(p, dict(num_wg=num_wg, tile_n=tile_n, kv_stages=kv_stages, refill_lag=refill_lag))
    check_config(cfg)
    capabilities(num_wg, tile_n, kv_stages, refill_lag).check(p)  # SMEM, with this configuration
    dt = cute_dtype(p.dtype)
    key = ("k4", p.head_dim, p.dtype, p.causal, tuple(sorted(cfg.items())))
    fn = jit_compile(key, lambda: (K4FMHA(p.head_dim, dt, p.causal, **cfg), fake_attention_args(dt, p.head_dim)),
                     keep_ptx)
    name = "k4_seed" if cfg == SEED_CONFIG else "k4"
    return fused_attention(name, p, fn, keep_ptx, dict(cfg, smem_bytes=smem_bytes(p.head_dim, **cfg)))
