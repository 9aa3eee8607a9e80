"""K10's knobs that were measured and left off, apart from the lesson they would clutter.

Each is a mixin over K10's kernel (``kernels/k10.py``), overriding the hooks it offers; each stays
built, tested on the CPU (``tests/test_k10.py``: its PTX) and on the GPU (the same file's ``gpu``
tests: its gradients), and reachable as a compile override of ``k10.compile_backward``
(``scripts/ab_backward.py --config``, ``harness.backward.VARIANTS``). The runs that left them off
are under Variants and Profiling in docs/k10.md.

* ``ds_free_once`` (K10's step before ``early_dq``): the wait for sdS to be free only before step 1;
  later, the DQ_EMPTY sync that ends each step has met both warpgroups after their dQ GEMMs.
* ``dq_swapab`` (FA3's dQ_swapAB): dQ^T = K^T . dS^T, the warpgroups split d, so a step may take a
  query tile that is not a multiple of 64 (FA3's 80 at d = 128); its post-pass reads dQ^T's order.
* ``select_rows``: an edge step reads every column's LSE2 and D, then sets the defaults past the
  sequence, rather than reading under the guard (whose SMEM address ptxas rebuilt under the guard's
  predicate: 4 instructions a read, 32 reads a step at d = 128).
* ``rows_ahead`` (flash-attn-4's order): the overlapped start reads its columns' LSE2 between the
  S^T and dP^T issues and their D before dP^T's wait, on steps whose reads need no guard.
* ``early_dv``: the overlapped start issues dV's GEMM before dP^T's wait, so P's exponentials
  cannot sink below that wait. Not under a softcap (``capped_overlap`` reads P back from dV's
  operand registers after the wait; a running WGMMA's A registers may not be read).
* ``scale_at_end`` (flash-attn-4's): dS without softmax_scale, one multiply a score fewer; dK
  scaled once after the walk and dQ in the post-pass (both are linear in dS).
* ``dq_stages=2`` (``early_dq``): sdQ twice, step t's shares in stage t % 2 on barrier pairs of
  their own, so a warpgroup waits for the writer's read of the share two steps back, not one.
* ``dkv_tma_packed``: packed sequences' dK and dV by TMA too, a sequence's whole key tiles as
  boxes at its rows and its last, partial one by rows (a box there would reach the next sequence).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from . import k9, k10, sm90
from .contract import Problem, UnsupportedProblem

# dq_stages = 2: the second sdQ stage's DQ_FULL/DQ_EMPTY pairs, this many ids above the first's
# (6 to 9, above the ids k10.Barrier names)
DQ_STAGE_IDS = 4
assert max(k10.Barrier) < k10.Barrier.DQ_FULL + DQ_STAGE_IDS, "the second stage's ids must be free"


def settle(cfg, p: Problem, split_d: bool, dq_flat: bool):
    """``cfg`` with these knobs checked against ``p`` (an UnsupportedProblem naming what one
    needs) and dropped where they would build the kernel they are off in. Runs before K10's own
    checks, whose drops (d = 256's) it anticipates."""
    if cfg.get("dq_swapab") and p.head_dim != sm90.WGMMA_M * cfg["num_wg"]:
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: dq_swapab splits d over the warpgroups, 64 rows "
                                 f"each (head_dim {sm90.WGMMA_M * cfg['num_wg']} here, not {p.head_dim})")
    if cfg.get("dq_swapab") and cfg.get("dq_split_queries"):
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: dq_split_queries gives each warpgroup 64 of the "
                                 "step's queries, dq_swapab 64 rows of d: not both")
    if split_d:  # K10BackwardSplitD: its own step, none of these built into it
        cfg = cfg.with_(**{k: False for k in ("dkv_tma_packed", "scale_at_end") if cfg.get(k)})
        if cfg.get("dq_stages", 1) != 1:  # early_dq's, which d = 256 drops
            cfg = cfg.with_(dq_stages=1)
        if cfg.get("ds_free_once"):
            raise UnsupportedProblem(f"K10 (backward) config {cfg}: ds_free_once is K10Backward's step; at head_dim "
                                     "256 K10BackwardSplitD has its own (P^T and dS^T both in SMEM)")
    if cfg.get("ds_free_once") and cfg.get("early_dq"):
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: early_dq keeps its own sdS per stage, so it has no "
                                 "wait for sdS to take off (no ds_free_once)")
    if cfg.get("dq_stages", 1) not in (1, 2) or (cfg.get("dq_stages", 1) == 2 and not cfg.get("early_dq")):
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: dq_stages is 1 or 2, and 2 is early_dq's (a warpgroup's "
                                 "share to a stage of sdQ on a barrier pair of its own)")
    if cfg.get("scale_at_end") and not dq_flat:
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: scale_at_end scales dQ in dq_flat's post-pass")
    if cfg.get("dkv_tma_packed") and not cfg.get("dkv_tma_store"):
        raise UnsupportedProblem(f"K10 (backward) config {cfg}: dkv_tma_packed takes dkv_tma_store's TMA stores to "
                                 "packed sequences: set both")
    if not p.varlen and cfg.get("dkv_tma_packed"):
        cfg = cfg.with_(dkv_tma_packed=False)  # rectangular: dkv_tma_store alone is the same kernel
    return cfg


def is_on(cfg, knob: str) -> bool:
    value = cfg.get(knob)
    return bool(value) and value != OFF_VALUES.get(knob, False)


def kernel_class(cfg, base: type) -> type:
    """The kernel class for K10's configuration ``cfg``: ``base``, or ``base`` with the mixins its
    knobs ask for (a knob at its off value asks for none)."""
    mixins = tuple(mixin for knob, mixin in MIXINS.items() if is_on(cfg, knob))
    return _with(mixins, base) if mixins else base


def kernel_args(cfg) -> dict:
    """``cfg`` as ``kernel_class``'s class takes it: without the knobs at their off values (no
    class takes them) and the passes' knobs (``k10.PASS_KNOBS``)."""
    return {k: v for k, v in cfg.items() if (k not in MIXINS or is_on(cfg, k)) and k not in k10.PASS_KNOBS}


@functools.cache
def _with(mixins: tuple, base: type) -> type:
    return type(base.__name__ + "".join(m.__name__ for m in mixins), (*mixins, base), {})


def flat_postpass(cfg, varlen: bool, args: tuple) -> tuple:
    """(dq_flat's post-pass entry point for ``cfg``, the fake arguments its variant adds): the
    shares in dq_swapab's order, and scaled by softmax_scale after ``scale_at_end``."""
    mixins = (SwappedShares,) * bool(cfg.get("dq_swapab")) + (ScaledShares,) * bool(cfg.get("scale_at_end"))
    post = (_with(mixins, k10.FlatPostpass) if mixins else k10.FlatPostpass)(*args)
    if cfg.get("scale_at_end"):
        return (post.call_varlen_scaled if varlen else post.call_scaled), (Float32(1.0),)
    return (post.call_varlen if varlen else post), ()


def post_args(cfg, softmax_scale: float) -> tuple:
    """What ``flat_postpass``'s entry takes after the tensors: softmax_scale after ``scale_at_end``."""
    return (softmax_scale,) if cfg.get("scale_at_end") else ()


def swapped_dq_mma(dtype, num_wg: int, tile_m: int) -> cute.TiledMma:
    """``dq_swapab``'s dQ GEMM: dQ^T (d, tile_m) = K^T (d, tile_n) . dS^T, A and B both read
    MN-major, the warpgroups 64 rows of d each."""
    mn = warpgroup.OperandMajorMode.MN
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, mn, mn, Float32, atom_layout_mnk=(num_wg, 1, 1),
                                             tiler_mn=(sm90.WGMMA_M, tile_m))


class DsFreeOnce:
    def __init__(self, *args, ds_free_once: bool = True, **kw):
        super().__init__(*args, **kw)
        assert not self.early_dq, "early_dq keeps an sdS per stage"

    @cute.jit
    def before_step(self, t: Int32):
        if t == 1:  # step 0 ended with no DQ_EMPTY sync
            cute.arch.barrier(barrier_id=k10.Barrier.MMA, number_of_threads=self.mma_threads)

    def wait_ds_free(self):
        pass  # DQ_EMPTY's sync at the end of the step before met both warpgroups after their dQ GEMMs


class DqSwapAB:
    TILE_M_STEP = 16  # dQ^T's GEMM takes the queries as N

    def __init__(self, head_dim: int, dtype, causal: bool, num_wg: int, tile_m: int, *args, dq_swapab: bool = True,
                 **kw):
        super().__init__(head_dim, dtype, causal, num_wg, tile_m, *args, **kw)
        assert head_dim == sm90.WGMMA_M * num_wg and not self.dq_split_queries, "d split 64 rows a warpgroup"
        self.dq_tile = (head_dim, tile_m)

    def tiled_mmas(self) -> tuple:
        tiled_mma_sdp, tiled_mma_dkv, _ = super().tiled_mmas()
        return tiled_mma_sdp, tiled_mma_dkv, swapped_dq_mma(self.dtype, self.num_wg, self.tile_m)

    def dq_operands(self, wg_dq, sdS: cute.Tensor, sK: cute.Tensor) -> tuple:
        return (wg_dq.make_fragment_A(wg_dq.partition_A(k9.transpose_view(sK)))[None, None, None, 0],
                wg_dq.make_fragment_B(wg_dq.partition_B(sdS)))

    def stage_ds_operand(self, parts: list, wg_dq, sdS: cute.Tensor):
        parts[7] = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))  # dS^T is B, in tdQrK's place

    def dq_gemm_operands(self, tdQrdS, tdQrK, stage: Int32) -> tuple:
        return tdQrdS, tdQrK[None, None, None, stage]

    def pin_staged_dq(self, tdQrdS, tdQrK) -> tuple:
        return tdQrdS, sm90.StagedOperand(tdQrK)

    def dq_coord(self, coord) -> tuple:
        return coord[::-1]  # dQ^T's (d, query)


class SelectRows:
    def __init__(self, *args, select_rows: bool = True, **kw):
        super().__init__(*args, **kw)

    @cute.jit
    def guarded_row_values(self, row: Int32, q: Int32, seqlen: Int32, sLSE, sD, lse2: Float32, dot: Float32) -> tuple:
        lse2, dot = self.row_values(row, sLSE, sD, lse2, dot)  # the stage's rows are all there to read
        if q >= seqlen:
            lse2, dot = Float32(float("inf")), Float32(0.0)
        return lse2, dot


class RowsAhead:
    def __init__(self, *args, rows_ahead: bool = True, **kw):
        super().__init__(*args, **kw)

    def lse2_ahead(self, tScS: cute.Tensor, sLSE: cute.Tensor, edge: bool):
        return self.columns_of(tScS, sLSE) if not edge or self.unguarded_rows else None

    def d_ahead(self, tScS: cute.Tensor, sD: cute.Tensor, edge: bool):
        return self.columns_of(tScS, sD) if not edge or self.unguarded_rows else None

    @cute.jit
    def columns_of(self, tScS: cute.Tensor, sRow: cute.Tensor) -> cute.Tensor:
        """The value of each of this thread's S^T columns in ``sRow`` (the stage's LSE2 or D), unguarded."""
        c_mn = sm90.acc_mn_view(tScS)
        out = cute.make_rmem_tensor(cute.size(c_mn, mode=[1]), Float32)
        for c in cutlass.range_constexpr(cute.size(c_mn, mode=[1])):
            out[c] = sRow[c_mn[0, c][1]]
        return out


class EarlyDv:
    def __init__(self, *args, early_dv: bool = True, **kw):
        super().__init__(*args, **kw)
        self.early_dv = self.overlap and self.early_dq and not self.capped_overlap

    def wait_for_dp(self, dv_mma: cute.TiledMma, accs: tuple, operands: tuple, stage: Int32) -> bool:
        if not self.early_dv:
            return super().wait_for_dp(dv_mma, accs, operands, stage)
        # dP's GEMM, then dV's: wait for the first alone
        sm90.gemm(dv_mma, accs[3], operands[4], operands[5][None, None, None, stage], zero_init=False, wg_wait=1)
        return True


class ScaleAtEnd:
    def __init__(self, *args, scale_at_end: bool = True, **kw):
        super().__init__(*args, **kw)
        assert self.dq_flat, "the scaled post-pass is dq_flat's"

    def score_grad(self, p, dp, dot, softmax_scale, slope=None):
        ds = p * (dp - dot)
        return ds if slope is None else ds * slope

    def end_walk(self, acc_dK: cute.Tensor, softmax_scale: Float32):
        for i in range(cute.size(acc_dK)):  # the walk's dS carried no softmax_scale
            acc_dK[i] = acc_dK[i] * softmax_scale


class DqStages:
    dq_stages = 2

    def __init__(self, *args, dq_stages: int = 2, **kw):
        super().__init__(*args, **kw)
        assert dq_stages == 2 and self.early_dq, "a second sdQ stage is early_dq's"

    def dq_stage(self, t: Int32):
        return t % self.dq_stages

    def dq_pair(self, pair, stage):
        return pair + DQ_STAGE_IDS * stage

    @cute.jit
    def wait_dq_free(self, sdQ: cute.Tensor, t: Int32, pair, handoff: cutlass.Constexpr[int]) -> tuple:
        """Into stage t % 2, on that stage's pair, after the writer has read the share two steps before."""
        stage = self.dq_stage(t)
        pair = self.dq_pair(pair, stage)
        sdQ = cute.make_tensor(sdQ.iterator + stage * (cute.cosize(sdQ.layout) // self.dq_stages), sdQ.layout)
        if t >= self.dq_stages:
            cute.arch.barrier(barrier_id=k10.Barrier.DQ_EMPTY + pair, number_of_threads=handoff)
        return sdQ, pair


class DkvTmaPacked:
    PACKED_TMA_STORE = True

    def __init__(self, *args, dkv_tma_packed: bool = True, **kw):
        super().__init__(*args, **kw)
        assert self.varlen and self.dkv_tma_store, "dkv_tma_store's TMA stores, on packed sequences"

    @cute.jit
    def store_dkv(self, accs: tuple, smem: tuple, outs: tuple, tiled_mma_dkv: cute.TiledMma, tidx: Int32,
                  dkv_atoms: tuple, n_block: Int32, kv_head: Int32, batch: Int32, lens: tuple, starts: tuple):
        if (n_block + 1) * self.tile_n <= lens[2]:  # a box must stay inside the sequence's rows
            self.store_dkv_tma(accs, smem, tiled_mma_dkv, tidx, dkv_atoms, n_block, kv_head, batch, starts[1])
        else:
            self.store_dkv_rows(accs, outs, tiled_mma_dkv, tidx, n_block, kv_head, batch)


class SwappedShares:
    """FlatPostpass for dq_swapab's shares: dQ^T's register order."""

    def dq_mma(self) -> cute.TiledMma:
        return swapped_dq_mma(self.dtype, self.num_wg, self.tile_m)

    def share_shape(self) -> tuple:
        return self.head_dim, self.tile_m

    def share_coord(self, coord) -> tuple:
        return coord[::-1]


class ScaledShares:
    """FlatPostpass for ``scale_at_end``: dQ = softmax_scale * the accumulator."""

    @cute.jit
    def call_scaled(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32, stream):
        self.launch(mdQaccum, mdQ, stream, scale=scale)

    @cute.jit
    def call_varlen_scaled(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                           max_tiles: Int32, scale: Float32, stream):
        self.launch(mdQaccum, mdQ, stream, mCuSeqlensQ, max_tiles, scale)


OFF_VALUES = {"dq_stages": 1}  # the knobs whose off value is not False
# knob -> mixin, in the order the mixins stack (the first overrides the rest)
MIXINS = {"ds_free_once": DsFreeOnce, "dq_swapab": DqSwapAB, "select_rows": SelectRows, "rows_ahead": RowsAhead,
          "early_dv": EarlyDv, "scale_at_end": ScaleAtEnd, "dq_stages": DqStages, "dkv_tma_packed": DkvTmaPacked}
