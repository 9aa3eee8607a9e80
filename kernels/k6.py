"""K6: hide the softmax behind the GEMMs. Ping-pong between warpgroups, overlap inside one.

K5 left each consumer warpgroup strictly serial: QK, wait, softmax, PV, wait. While a warpgroup
runs its exponentials (MUFU: about 1/250 of the tensor cores' rate, i.e. roughly half the GEMM
time at d=128) its tensor-core work stops. K6 keeps K5's host code, producer and tile loop, and
replaces only the consumer's KV loop (``mainloop``), in two steps that are registered apart:

* ``k6_pp``, ping-pong (``sm90.WarpScheduler``): the consumer warpgroups pass a token through
  named barriers so that one issues its GEMMs (PV of tile j and QK of tile j+1) while the other
  runs its softmax. The tensor cores see back-to-back GEMMs from alternating warpgroups.
* ``k6``, plus intra-warpgroup overlap: step j issues QK of tile j+1 *and* PV of tile j, then
  waits only for the QK (``wait_group(1)``), runs the softmax of tile j+1 while PV j is still on
  the tensor cores, and waits for PV only before it overwrites P. One prologue (QK + softmax of the
  first tile) and one epilogue (the last PV) bracket the loop. The price: S of tile j+1 lives
  beside P of tile j and O through the whole softmax (more registers).

O may only be touched with no PV in flight. By default it is rescaled after ``wait_group(0)``, on
the critical path; at d=256 that is 128 multiplies per thread per tile, so there it moves under
the QK GEMM of the next step instead (``rescale_o_before_gemm``). The anchors use ping-pong only
up to d=128 with the overlap: at d=256 the GEMMs already dwarf the softmax.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from . import k5, sm90, tma_pipeline
from .contract import CompiledAttention, Config, Problem, run_kernel  # noqa: F401  (run_kernel: the contract's launch-only entry)

CAPS = k5.CAPS
# K6's measured defaults, each with the runs behind it (docs/k6-runs.md, "Why the defaults are what
# they are", has the numbers; every result file is in results/).
PINGPONG_MAX_HEAD_DIM = 128  # at d=256 the GEMMs dwarf the softmax: the overlap alone, as the anchors
OVERLAP_MIN_HEAD_DIM = 128  # d=64 with the overlap spills at 128 keys, is slower at 112 (ws-tune-h100-early)
TILE_N_WITH_OVERLAP = {64: 112}  # the width d=64 would take with the overlap (same run)
NON_CAUSAL_TILE_N_WITH_OVERLAP = {128: 144}  # ws-tune-h100-d128n
NO_OVERLAP_UP_TO_SEQLEN = {(128, False): 2048}  # the H100 sweep in docs/k6.md
SHORT_SEQUENCE_CONFIG = {  # (head_dim, causal) -> (up to this many keys, overrides): ws-tune-h100-d64wg, -d256n
    (64, True): (1024, dict(num_wg=2)),
    (256, True): (2048, dict(tile_n=64)),
    (256, False): (1024, dict(tile_n=64)),
}
LONG_SEQUENCE_TILE_N = {(64, False): (16384, 176)}  # (head_dim, causal) -> (from keys, tile_n): ws-tune-h200-d64long-r3
TMA_STORE_UP_TO_SEQLEN = {(256, False): 8192, (256, True): 8192, (64, False): 2048,  # ws-tune-h100-d256short,
                          (64, True): 8192}  # -d256tmastore, -perwg-d64-r3
O_STORE_PER_WG_NON_CAUSAL_UP_TO_SEQLEN = 2048  # ws-tune-h100-perwg-r3, -perwg-d128long-r3
CLUSTER_FROM_SEQLEN = {128: 4096, 256: 2048}  # ws-tune-h200-cluster-r3, -cluster-short-r3


class K6FMHA(k5.K5FMHA):
    def __init__(self, *args, pingpong: bool, overlap: bool, rescale_o_before_gemm: bool = None, **kw):
        super().__init__(*args, **kw)
        self.warp_scheduler = sm90.WarpScheduler(self.num_wg, pingpong)  # K5's two hooks call it (below)
        self.overlap = overlap
        if rescale_o_before_gemm is None:
            rescale_o_before_gemm = self.head_dim > 128
        self.rescale_o_before_gemm = overlap and rescale_o_before_gemm

    def after_qk_issue(self):
        self.warp_scheduler.arrive()  # the next warpgroup's GEMMs may queue behind these

    def before_pv_issue(self):
        self.warp_scheduler.sync()  # wait for the token

    @cute.jit
    def consume(self, *args):
        self.warp_scheduler.init()  # the first consumer warpgroup holds the token
        k5.K5FMHA.consume(self, *args)

    @cute.jit
    def mainloop(self, m_block: Int32, mask_lens: tuple, n_tiles: Int32, n_unmasked: Int32,
                 kv_consume: pipeline.PipelineState, pipelines: tuple, mmas: sm90.Mmas, softmax: sm90.OnlineSoftmax,
                 row_scale: cute.Tensor, n_lo=0, n_left=0) -> pipeline.PipelineState:
        if const_expr(not self.overlap):
            # K5's loop with the token around each batch of GEMMs: sync before the first QK,
            # then (inside K5's kv_iteration) arrive after QK j, sync before PV j; arrive after the last.
            self.warp_scheduler.sync()
            kv_consume = k5.K5FMHA.mainloop(self, m_block, mask_lens, n_tiles, n_unmasked, kv_consume, pipelines,
                                            mmas, softmax, row_scale, n_lo, n_left)
            self.warp_scheduler.arrive()
        else:
            # Prologue: QK and softmax of the first (masked) tile; its PV runs in the first step.
            self.first_qk_softmax(n_tiles - 1, m_block, mask_lens, kv_consume, pipelines, mmas, softmax, row_scale)
            n_masked = cutlass.max(n_tiles - 1 - cutlass.max(n_unmasked, n_lo), 0)
            for i in cutlass.range(n_masked, unroll=1):
                kv_consume = self.overlapped_step(n_tiles - 2 - i, m_block, mask_lens, kv_consume, pipelines, mmas,
                                                  softmax, row_scale, masked=True)
            for i in cutlass.range(n_tiles - 1 - n_lo - n_masked, unroll=1):
                kv_consume = self.overlapped_step(n_tiles - 2 - n_masked - i, m_block, mask_lens, kv_consume, pipelines,
                                                  mmas, softmax, row_scale, masked=False)
            if const_expr(self.window is not None):  # below n_lo, masked; the peeled first tile may be one of them
                top = cutlass.min(n_lo, n_tiles - 1)
                for i in cutlass.range(top - (n_lo - n_left), unroll=1):
                    kv_consume = self.overlapped_step(top - 1 - i, m_block, mask_lens, kv_consume, pipelines, mmas,
                                                      softmax, row_scale, masked=True)
            kv_consume = self.last_pv(kv_consume, pipelines, mmas, softmax, row_scale)
        return kv_consume

    @cute.jit
    def load_kv_tiles(self, n_tiles: Int32, kv_produce: pipeline.PipelineState, kv_loads: tuple,
                      q_load: tuple, n_lo=0) -> pipeline.PipelineState:
        """With the overlap, step j needs K of tile j+1 before V of tile j: load in that order
        (K_first, Q, K_next, V_first, K_next2, V_next, ..., V_last)."""
        if const_expr(not self.overlap):
            kv_produce = k5.K5FMHA.load_kv_tiles(self, n_tiles, kv_produce, kv_loads, q_load, n_lo)
        else:
            pipeline_k, tma_atom_K, tKgK, tKsK, pipeline_v, tma_atom_V, tVgVt, tVsVt = kv_loads
            mcast = self.kv_mcast_mask
            tma_pipeline.load_stage(pipeline_k, kv_produce, tma_atom_K, tKgK[None, n_tiles - 1],
                                    tKsK[None, kv_produce.index], mcast)
            tma_pipeline.load_stage(*q_load)
            for i in cutlass.range(n_tiles - 1 - n_lo, unroll=1):
                kv_prev = kv_produce.clone()
                kv_produce.advance()
                tma_pipeline.load_stage(pipeline_k, kv_produce, tma_atom_K, tKgK[None, n_tiles - 2 - i],
                                        tKsK[None, kv_produce.index], mcast)
                tma_pipeline.load_stage(pipeline_v, kv_prev, tma_atom_V, tVgVt[None, n_tiles - 1 - i],
                                        tVsVt[None, kv_prev.index], mcast)
            tma_pipeline.load_stage(pipeline_v, kv_produce, tma_atom_V, tVgVt[None, n_lo], tVsVt[None, kv_produce.index],
                                    mcast)
            kv_produce.advance()
        return kv_produce

    @cute.jit
    def first_qk_softmax(self, n_block: Int32, m_block: Int32, mask_lens: tuple, kv_consume: pipeline.PipelineState,
                         pipelines: tuple, mmas: sm90.Mmas, softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor):
        """S = QK^T of the first tile, masked (the first tile is the only one that may hold the
        seqlen tail, and, causal, the diagonal), softmax, P into registers. No PV yet."""
        _, pipeline_k, _ = pipelines
        tiled_mma_qk, _, tSrQ, tSrK, _, tOrP, _, tScS = mmas
        pipeline_k.consumer_wait(kv_consume)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        sm90.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_consume.index], zero_init=True, wg_wait=0)
        pipeline_k.consumer_release(kv_consume)
        softmax.cap(acc_S)
        sm90.mask_tile(acc_S, tScS, m_block, n_block, mask_lens[0], self.tile_m, self.tile_n, self.causal,
                       mask_lens[1], window=self.window)
        softmax.step(acc_S, row_scale, check_inf=True, n_block=n_block)  # O is still zero: no rescale needed
        self.p_to_operand(acc_S, tOrP)

    @cute.jit
    def overlapped_step(self, n_block: Int32, m_block: Int32, mask_lens: tuple, kv_consume: pipeline.PipelineState,
                        pipelines: tuple, mmas: sm90.Mmas, softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor,
                        masked: cutlass.Constexpr[bool]) -> pipeline.PipelineState:
        """QK of tile ``n_block`` and PV of the previous tile in flight together; the softmax of
        ``n_block`` runs under the PV. ``kv_consume`` enters on the previous tile's stage."""
        _, pipeline_k, pipeline_v = pipelines
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_O, tScS = mmas
        kv_prev = kv_consume.clone()  # V of the previous tile, whose P is in tOrP
        kv_consume.advance()
        pipeline_k.consumer_wait(kv_consume)
        self.warp_scheduler.sync()
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        sm90.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_consume.index], zero_init=True, wg_wait=-1)
        if const_expr(self.rescale_o_before_gemm):
            softmax.rescale(acc_O, row_scale)  # the previous tile's factor, while only QK runs
        pipeline_v.consumer_wait(kv_prev)
        sm90.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_prev.index], zero_init=False, wg_wait=-1)
        self.warp_scheduler.arrive()
        warpgroup.wait_group(1)  # QK done; PV may still run
        pipeline_k.consumer_release(kv_consume)
        softmax.cap(acc_S)
        if const_expr(masked):
            sm90.mask_tile(acc_S, tScS, m_block, n_block, mask_lens[0], self.tile_m, self.tile_n, self.causal,
                       mask_lens[1], window=self.window)
        self.softmax_under_pv(acc_S, tOrP, acc_O, softmax, row_scale, n_block, masked, (pipeline_v, kv_prev),
                              mask_lens)
        return kv_consume

    @cute.jit
    def softmax_under_pv(self, acc_S: cute.Tensor, tOrP: cute.Tensor, acc_O: cute.Tensor, softmax: sm90.OnlineSoftmax,
                         row_scale: cute.Tensor, n_block: Int32, masked: cutlass.Constexpr[bool], v_stage: tuple,
                         mask_lens: tuple):
        """Tile j+1's softmax while PV j runs, then the wait for PV j (``v_stage``: its V stage, to
        release): after it P (j's) may be overwritten and O touched."""
        pipeline_v, kv_prev = v_stage
        softmax.step(acc_S, row_scale, check_inf=masked, n_block=n_block)
        warpgroup.wait_group(0)  # PV done: its P and V may be overwritten, O may be touched
        pipeline_v.consumer_release(kv_prev)
        self.p_to_operand(acc_S, tOrP)
        if const_expr(not self.rescale_o_before_gemm):
            softmax.rescale(acc_O, row_scale)

    @cute.jit
    def last_pv(self, kv_consume: pipeline.PipelineState, pipelines: tuple, mmas: sm90.Mmas,
                softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor) -> pipeline.PipelineState:
        _, _, pipeline_v = pipelines
        _, tiled_mma_pv, _, _, tOrVt, tOrP, acc_O, _ = mmas
        if const_expr(self.rescale_o_before_gemm):
            softmax.rescale(acc_O, row_scale)
        pipeline_v.consumer_wait(kv_consume)
        sm90.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_consume.index], zero_init=False, wg_wait=0)
        pipeline_v.consumer_release(kv_consume)
        kv_consume.advance()
        return kv_consume


def compile_kernel(p: Problem, *, keep_ptx: bool = False, tuned: bool = True, num_wg=None, tile_n=None, kv_stages=None,
                   q_stages=None, scheduler=None, tma_store=None, pingpong=None, overlap=None,
                   section_bytes=None, emulated_exp2=None, skip_unit_rescale=None,
                   rescale_o_before_gemm=None, pin_pv_wait=None, o_store_per_wg=None, split_tail=None,
                   ctas=None, pin_descriptors=None, cluster=None, q_in_regs=None) -> CompiledAttention:
    CAPS.check(p)
    cfg = config(p, dict(
        num_wg=num_wg, tile_n=tile_n, kv_stages=kv_stages, q_stages=q_stages, scheduler=scheduler, tma_store=tma_store,
        pingpong=pingpong, overlap=overlap, section_bytes=section_bytes, emulated_exp2=emulated_exp2,
        skip_unit_rescale=skip_unit_rescale, rescale_o_before_gemm=rescale_o_before_gemm, pin_pv_wait=pin_pv_wait,
        o_store_per_wg=o_store_per_wg, split_tail=split_tail, ctas=ctas, pin_descriptors=pin_descriptors,
        cluster=cluster, q_in_regs=q_in_regs), tuned)
    from .experiments import kernel_class  # K6FMHA, or with the knobs measured and left off that cfg asks for

    kernel_cls, cfg = kernel_class(cfg, not p.lockstep)  # tiles not alike, as causal
    return k5.build("k6", kernel_cls, p, cfg, keep_ptx)


def config(p: Problem, overrides: dict, tuned: bool = True) -> Config:
    """K6's configuration of ``p``: the measured defaults above wherever ``overrides`` leaves a knob
    None, then K5's (``k5.config``). Without ``tuned``, K5's configuration with ping-pong
    (on unless asked off) and the overlap (off unless asked on): the registry's one-idea steps."""
    if not tuned:
        return k5.config(p, dict(overrides, pingpong=overrides["pingpong"] is not False,
                                 overlap=bool(overrides["overlap"])))
    num_wg, tile_n, overlap, pingpong = (overrides[k] for k in ("num_wg", "tile_n", "overlap", "pingpong"))
    tma_store, o_store_per_wg, cluster = overrides["tma_store"], overrides["o_store_per_wg"], overrides["cluster"]
    scheduler, split_tail, ctas = overrides["scheduler"], overrides["split_tail"], overrides["ctas"]
    if overlap is None:
        short = NO_OVERLAP_UP_TO_SEQLEN.get((p.head_dim, p.causal), 0)
        overlap = p.head_dim >= OVERLAP_MIN_HEAD_DIM and p.kv_len > short
    pingpong = (p.head_dim <= PINGPONG_MAX_HEAD_DIM or not overlap) if pingpong is None else pingpong
    short, short_config = SHORT_SEQUENCE_CONFIG.get((p.head_dim, p.causal), (0, {}))
    if p.kv_len <= short:
        num_wg = short_config.get("num_wg") if num_wg is None else num_wg
        tile_n = short_config.get("tile_n") if tile_n is None else tile_n
    long_from, long_tile_n = LONG_SEQUENCE_TILE_N.get((p.head_dim, p.causal), (float("inf"), None))
    if tile_n is None and not overlap and p.kv_len >= long_from:  # measured without the overlap (d=64's)
        tile_n = long_tile_n
    if tile_n is None and overlap:
        tile_n = (NON_CAUSAL_TILE_N_WITH_OVERLAP if not p.causal else {}).get(p.head_dim,
                                                                              TILE_N_WITH_OVERLAP.get(p.head_dim))
    if tma_store is None and p.kv_len <= TMA_STORE_UP_TO_SEQLEN.get((p.head_dim, p.causal), 0) and not p.varlen:
        tma_store = True
    if o_store_per_wg is None:
        o_store_per_wg = p.causal or p.kv_len <= O_STORE_PER_WG_NON_CAUSAL_UP_TO_SEQLEN
    if cluster is None and p.lockstep and scheduler in (None, "static") and not split_tail and ctas is None:
        tile_m = sm90.WGMMA_M * (num_wg or k5.DEFAULT_CONFIG[p.head_dim]["num_wg"])
        pairs_whole = -(-p.seqlen // tile_m) % 2 == 0
        cluster = 2 if pairs_whole and p.kv_len >= CLUSTER_FROM_SEQLEN.get(p.head_dim, float("inf")) else None
    cfg = k5.config(p, dict(overrides, num_wg=num_wg, tile_n=tile_n, tma_store=tma_store, pingpong=pingpong,
                            overlap=overlap, o_store_per_wg=o_store_per_wg, cluster=cluster))
    return cfg.with_(o_store_per_wg=bool(cfg["o_store_per_wg"] and cfg["tma_store"]))  # only a TMA store has one
