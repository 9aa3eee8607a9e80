"""Knobs that were measured and left off, apart from the lessons they would clutter.

Each stays built, tested (``tests/test_warp_specialized.py``, the full grid; ``tests/test_gpu.py``)
and reachable by the tuning scripts through the stage's own ``compile_kernel`` overrides; the runs
that decided against them are in docs/k6-runs.md.

``K6Knobs``, K6's kernel with three softmax-side knobs:

* ``emulated_exp2=n``: of every 8 columns of a tile with no masked score, ``n`` take
  ``sm90.exp2_poly`` (a cubic on the FMA pipe) instead of ``ex2`` (MUFU), to unload the MUFU.
* ``skip_unit_rescale``: a warp whose rows all kept their row max skips the O rescale.
* ``pin_pv_wait``: the overlap's wait for PV j, which ptxas hoists above tile j+1's exponentials
  (so PV only overlaps the row max), pinned after them behind a branch (``"after_softmax"``), or
  with the exponentials themselves after the wait (``"before_exp2"``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from . import k5, k6, sm90
from .contract import UnsupportedProblem


class K6Knobs(k6.K6FMHA):
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
