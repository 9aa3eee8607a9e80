"""Knobs that were measured and left off, apart from the lessons they would clutter.

Each stays built, tested (``tests/test_warp_specialized.py``, the full grid; ``tests/test_gpu.py``)
and reachable by the tuning scripts through K6's own ``compile_kernel`` overrides, which build
K6's kernel with the mixins below (``kernel_class``); the runs that decided against them are in
docs/k6-runs.md.

``SplitTail`` (``split_tail``, static non-causal only): when the last wave of equal tiles is
partial, the rest of the SMs idle through it. Every CTA walks the whole waves round-robin; the
tiles left over are cut along their KV tiles into one contiguous run of KV steps per CTA
(stream-K, ``schedule.tail_plan``); each piece ends with a partial O and LSE, and the last warp to
finish its rows of a tile merges them by LSE weights, as split-KV decode does.

``SoftmaxKnobs``, three softmax-side knobs:

* ``emulated_exp2=n``: of every 8 columns of a tile with no masked score, ``n`` take
  ``sm90.exp2_poly`` (a cubic on the FMA pipe) instead of ``ex2`` (MUFU), to unload the MUFU.
* ``skip_unit_rescale``: a warp whose rows all kept their row max skips the O rescale.
* ``pin_pv_wait``: the overlap's wait for PV j, which ptxas hoists above tile j+1's exponentials
  (so PV only overlaps the row max), pinned after them behind a branch (``"after_softmax"``), or
  with the exponentials themselves after the wait (``"before_exp2"``).

``QInRegisters`` (``q_in_regs``): QK reads Q from registers, loaded from SMEM once per tile,
instead of from SMEM at every KV tile. Q takes d/4 registers per thread beside O's d/2: it fits up
to d=128 (d=64's 176-key tiles spill 148 bytes), not at d=256.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from . import k5, k6, schedule, sm90
from .contract import UnsupportedProblem
from .tiles import kv_tile_count

SOFTMAX_KNOBS = ("emulated_exp2", "skip_unit_rescale", "pin_pv_wait")


def kernel_class(cfg: dict, causal: bool):
    """(kernel class, configuration it takes) for K6's configuration ``cfg``: K6FMHA, or K6FMHA with
    the mixins its knobs need (a knob left at its off value asks for none)."""
    mixins, unused = [], set()
    for mixin, knobs in ((SplitTail, ("split_tail",)), (SoftmaxKnobs, SOFTMAX_KNOBS), (QInRegisters, ("q_in_regs",))):
        if any(cfg.get(k) for k in knobs):
            mixins.append(mixin)
        else:
            unused.update(knobs)  # at their off values: K6FMHA takes no such argument
    if SplitTail in mixins:
        SplitTail.check(dict(cfg, causal=causal))
    cfg = {k: v for k, v in cfg.items() if k not in unused}
    return (_with(tuple(mixins)) if mixins else k6.K6FMHA), cfg


@functools.cache
def _with(mixins: tuple):
    return type("K6" + "".join(m.__name__ for m in mixins), (*mixins, k6.K6FMHA), {})


class SplitTail:
    def __init__(self, *args, split_tail: bool = True, **kw):
        super().__init__(*args, **kw)

    @staticmethod
    def check(cfg: dict) -> None:
        if cfg.get("causal") or cfg.get("scheduler") != "static":
            raise UnsupportedProblem(f"K6 config {cfg}: split_tail cuts the last wave of equal tiles, so it needs "
                                     "the static scheduler and a non-causal problem")
        if cfg.get("cluster", 1) > 1:
            raise UnsupportedProblem(f"K6 config {cfg}: cluster={cfg['cluster']} runs query tiles in lockstep, "
                                     "which a split tail's pieces are not: no split_tail with a cluster")

    @cute.jit
    def tail_plan(self, seqlen: Int32, seqlen_k: Int32, num_tiles: Int32, step: Int32, tile_idx: Int32) -> tuple:
        """(KV tiles per tile, then ``schedule.tail_plan``'s six values) for this CTA; the producer
        and the consumers walk the same units."""
        n_kv = kv_tile_count(0, seqlen, self.tile_m, self.tile_n, False, seqlen_k)
        return (n_kv, *schedule.tail_plan(num_tiles, step, tile_idx, n_kv))

    @cute.jit
    def load_tiles(self, tile_idx: Int32, step: Int32, num_tiles: Int32, q_produce, kv_produce, tile_produce,
                   loads: tuple, tile_slots) -> pipeline.PipelineState:
        n_kv, waves, _, _, s0, s1, n_units = self.tail_plan(loads[0], loads[4][0], num_tiles, step, tile_idx)
        for u in cutlass.range(n_units, unroll=1):
            unit_tile, lo, hi = schedule.work_unit(u, tile_idx, step, waves, s0, s1, n_kv)
            q_produce, kv_produce = self.load_tile(unit_tile, (lo, hi), q_produce, kv_produce, loads)
        return kv_produce

    @cute.jit
    def consume_tiles(self, tile_idx: Int32, step: Int32, num_tiles: Int32, q_consume, kv_consume, tile_consume,
                      ctx: k5.ConsumerContext):
        n_kv, waves, steps, parts, s0, s1, n_units = self.tail_plan(ctx.mO.shape[2], ctx.kv_shape[0], num_tiles, step,
                                                                     tile_idx)
        for u in cutlass.range(n_units, unroll=1):
            unit_tile, lo, hi = schedule.work_unit(u, tile_idx, step, waves, s0, s1, n_kv)
            # A piece of the tail: (tail tile, which of this CTA's runs, steps, CTAs sharing
            # them); whole tiles (and a tail tile one run covers) end as usual.
            piece = schedule.TailPiece(unit_tile - waves * step, Int32(0) if u == waves else Int32(1), steps,
                                       parts, n_kv)
            q_consume, kv_consume = self.consume_tile(unit_tile, (lo, hi, piece), q_consume, kv_consume, ctx)

    @cute.jit
    def end_tile(self, tile_idx: Int32, span, q_consume, acc_O: cute.Tensor, softmax: sm90.OnlineSoftmax,
                 ctx: k5.ConsumerContext, m_block: Int32, head: Int32, batch: Int32):
        n_lo, n_tiles, piece = span
        if n_lo == 0 and n_tiles == piece.n_kv:  # a whole tile
            self.epilogue(tile_idx, q_consume, acc_O, softmax, ctx, m_block, head, batch)
        else:
            ctx.pipelines[0].consumer_release(q_consume)  # this piece's QKs have retired
            self.merge_tail_piece(acc_O, softmax, piece, ctx.mmas.tiled_mma_pv, ctx.tidx, ctx.mO, ctx.mLSE,
                                  ctx.tile_slots.mTileCounter, m_block, head, batch)

    def zeroed_counter_ints(self) -> int:
        return self.tail_counters()

    def counter_ints(self) -> int:
        """The whole counter buffer with a split tail: counters, then per (CTA, run, consumer
        thread) a partial O fragment and its rows' LSE (fp32, 16-byte rows)."""
        frag = sm90.WGMMA_M * self.head_dim // sm90.THREADS_PER_WARPGROUP  # accumulator values a thread holds
        return self.tail_counters() + self.sm_count * 2 * sm90.THREADS_PER_WARPGROUP * self.num_wg * (frag + 4)

    def tail_counters(self) -> int:
        """Int32s before the split tail's workspace in the counter buffer: the dynamic scheduler's
        pair, then one merge counter per (tail tile, consumer warp), rounded to 16 bytes."""
        return (2 + self.sm_count * 4 * self.num_wg + 3) // 4 * 4

    @cute.jit
    def merge_tail_piece(self, acc_O: cute.Tensor, softmax: sm90.OnlineSoftmax, piece: tuple,
                         tiled_mma_pv: cute.TiledMma, tidx: Int32, mO: cute.Tensor, mLSE: cute.Tensor,
                         mCounter: cute.Tensor, m_block: Int32, head: Int32, batch: Int32):
        """Split tail: write this piece's O (normalized, fp32) and LSE, count it; the warp that
        counts a tile's last piece of its 16 rows merges every piece's (by LSE weights) and stores O.

        Each warp owns its 16 rows of the tile in every CTA alike (the PV MMA's layout), so warps
        merge independently: no CTA barrier, and a thread reads back exactly the fragment that the
        same thread of another CTA wrote. The fence before the count releases the stores; the
        merging warp's fence after it acquires the others'. It resets the counter for the next
        launch."""
        r, run, steps, parts, n_kv = piece
        lse, _ = sm90.finalize_o(acc_O, softmax, Float32)  # fp32: O normalized in place
        frag = cute.size(acc_O)
        stride = frag + 4
        consumers = sm90.THREADS_PER_WARPGROUP * self.num_wg
        ws = cute.recast_ptr(mCounter.iterator + self.tail_counters(), dtype=Float32)
        bx = cute.arch.block_idx()[0]
        mine = ws + ((bx * 2 + run) * consumers + tidx) * stride
        cute.make_tensor(mine, acc_O.layout).store(acc_O.load())
        for j in cutlass.range_constexpr(softmax.num_rows):
            mine[frag + j] = lse[j]
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        lane, warp = tidx % 32, tidx // 32
        counter = mCounter.iterator + 2 + r * (consumers // 32) + warp
        done = Int32(0)
        if lane == 0:
            done = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        done = cute.arch.shuffle_sync(done, 0)
        first = schedule.tail_owner(r * n_kv, steps, parts)
        last = schedule.tail_owner((r + 1) * n_kv - 1, steps, parts)
        if done == last - first:
            cute.arch.fence_acq_rel_gpu()
            if lane == 0:
                cute.make_tensor(counter, cute.make_layout(1))[0] = Int32(0)
            acc_mn = sm90.acc_mn_view(acc_O)
            total = cute.make_rmem_tensor(softmax.num_rows, Float32)
            total.fill(1.0)
            for c in cutlass.range(first, last + 1, unroll=1):
                if c != bx:
                    run_c = Int32(0) if (c * steps // parts) // n_kv == r else Int32(1)
                    theirs = ws + ((c * 2 + run_c) * consumers + tidx) * stride
                    their_mn = sm90.acc_mn_view(cute.make_tensor(theirs, acc_O.layout))
                    for j in cutlass.range_constexpr(softmax.num_rows):
                        lse_c = theirs[frag + j]
                        m_new = cute.arch.fmax(lse[j], lse_c)
                        a = cute.math.exp(lse[j] - m_new, fastmath=True)
                        b = cute.math.exp(lse_c - m_new, fastmath=True)
                        acc_mn[j, None].store(acc_mn[j, None].load() * a + their_mn[j, None].load() * b)
                        total[j] = total[j] * a + b
                        lse[j] = m_new
            for j in cutlass.range_constexpr(softmax.num_rows):
                acc_mn[j, None].store(acc_mn[j, None].load() * cute.arch.rcp_approx(total[j]))
                lse[j] = lse[j] + cute.math.log(total[j], fastmath=True)
            rO = cute.make_rmem_tensor_like(acc_O, mO.element_type)
            sm90.convert_to(acc_O, rO)
            sm90.store_rows(rO, lse, tiled_mma_pv, tidx, mO, mLSE, m_block, head, batch, self.tile_m)



class SoftmaxKnobs:
    def __init__(self, *args, emulated_exp2: int = 0, skip_unit_rescale: bool = False, pin_pv_wait=None, **kw):
        super().__init__(*args, **kw)
        pin_pv_wait = "after_softmax" if pin_pv_wait is True else pin_pv_wait  # its first form, a bool
        if pin_pv_wait not in (None, False, "after_softmax", "before_exp2"):
            raise ValueError(f"pin_pv_wait must be None, 'after_softmax' or 'before_exp2', got {pin_pv_wait!r}")
        if pin_pv_wait and not self.overlap:
            raise UnsupportedProblem(f"pin_pv_wait={pin_pv_wait!r} pins the wait for the PV of the overlap, "
                                     "which is off here (overlap=False)")
        if pin_pv_wait and skip_unit_rescale:
            raise UnsupportedProblem("pin_pv_wait rescales O with a plain multiply: not with skip_unit_rescale")
        if pin_pv_wait == "before_exp2" and emulated_exp2:
            raise UnsupportedProblem("pin_pv_wait='before_exp2' splits a plain ex2 softmax: not with emulated_exp2")
        self.emulated_exp2 = emulated_exp2
        self.skip_unit_rescale = skip_unit_rescale
        self.pin_pv_wait = pin_pv_wait

    def tile_softmax(self, *args) -> sm90.OnlineSoftmax:
        softmax = k5.K5FMHA.tile_softmax(self, *args)
        softmax.emulated_exp2 = self.emulated_exp2
        softmax.skip_unit_rescale = self.skip_unit_rescale and not softmax.scaled_max
        return softmax

    @cute.jit
    def softmax_under_pv(self, acc_S: cute.Tensor, tOrP: cute.Tensor, acc_O: cute.Tensor, softmax: sm90.OnlineSoftmax,
                         row_scale: cute.Tensor, n_block: Int32, masked: cutlass.Constexpr[bool], v_stage: tuple,
                         mask_lens: tuple):
        if const_expr(not self.pin_pv_wait):
            k6.K6FMHA.softmax_under_pv(self, acc_S, tOrP, acc_O, softmax, row_scale, n_block, masked, v_stage,
                                       mask_lens)
        else:
            pipeline_v, kv_prev = v_stage
            split = self.pin_pv_wait == "before_exp2"
            if const_expr(split and softmax.scaled_max):
                raise UnsupportedProblem("pin_pv_wait='before_exp2' splits a plain softmax: not K8's block-scaled one")
            if const_expr(split):  # the exponents only; exp2 runs after the pinned wait
                softmax.step(acc_S, row_scale, check_inf=masked, n_block=n_block, exponentiate=False)
            else:
                softmax.step(acc_S, row_scale, check_inf=masked, n_block=n_block)
            self.wait_pv_then_convert(mask_lens[0] > 0, acc_S, tOrP, acc_O, row_scale,
                                      softmax.row_sum if const_expr(split) else None)
            pipeline_v.consumer_release(kv_prev)

    @cute.jit
    def wait_pv_then_convert(self, seqlen_k_positive: cutlass.Boolean, acc_S: cute.Tensor, tOrP: cute.Tensor,
                             acc_O: cute.Tensor, row_scale: cute.Tensor, row_sum):
        """wait_group(0), P into tOrP, O rescaled, behind a branch that is always taken.

        ptxas treats the wait as free and hoists it above every exponential that does not need it:
        in the SASS of the plain version no ``MUFU.EX2`` of the tile is left before the wait, so PV
        only overlaps the row max. It does not move code across a branch, and a branch whose two
        sides differ (here, the order of the two steps) is not merged back by LLVM either. The
        other side is correct too; it just never runs (there is a KV tile, so the key length is > 0).
        """
        if seqlen_k_positive:
            warpgroup.wait_group(0)
            if const_expr(row_sum is not None):
                sm90.exp2_rows_and_sum(acc_S, row_scale, row_sum)
            self.p_to_operand(acc_S, tOrP)
            if const_expr(not self.rescale_o_before_gemm):
                sm90.scale_rows(acc_O, row_scale)
        else:
            warpgroup.wait_group(0)
            if const_expr(not self.rescale_o_before_gemm):
                sm90.scale_rows(acc_O, row_scale)
            if const_expr(row_sum is not None):
                sm90.exp2_rows_and_sum(acc_S, row_scale, row_sum)
            self.p_to_operand(acc_S, tOrP)


class QInRegisters:
    def __init__(self, *args, q_in_regs: bool = True, **kw):
        super().__init__(*args, **kw)
        if self.head_dim > 128:
            raise UnsupportedProblem(f"q_in_regs: Q in registers ({self.head_dim // 4} per thread) does not fit "
                                     f"beside O ({self.head_dim // 2}) at head_dim {self.head_dim}; head_dim <= 128 only")

    def q_source(self):
        return warpgroup.OperandSource.RMEM

    def q_fragment(self, wg_mma_qk, sQ: cute.Tensor) -> cute.Tensor:
        return wg_mma_qk.make_fragment_A(wg_mma_qk.partition_shape_A((self.tile_m, self.head_dim)))

    def q_operand(self, tiled_mma_qk, sQ: cute.Tensor, tSrQ: cute.Tensor, q_stage: int, tidx: Int32) -> cute.Tensor:
        sm90.load_a_operand(tiled_mma_qk, sQ[None, None, q_stage], tSrQ, tidx, self.dtype)  # this tile's Q
        return tSrQ
