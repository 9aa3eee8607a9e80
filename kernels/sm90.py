"""Hopper (SM90) building blocks shared by the WGMMA stages (K4 onward).

Everything here is about one fact: after a WGMMA the result lives in registers, spread
over the 128 threads of a warpgroup in a hardware-defined pattern (the C fragment). The
helpers below name that pattern so kernels can work on it without an SMEM round trip:

* ``acc_mn_view``        the accumulator re-viewed as (rows, cols) of the tile this thread owns
* ``acc_as_operand_a``   the C fragment of GEMM-I re-viewed as the A operand of GEMM-II
  (the QK -> PV register handoff), plus ``convert_to`` to narrow it to bf16/fp16
* ``row_reduce``         max or sum over the columns of one row this thread owns
* ``quad_allreduce``     a row is split over 4 sibling lanes: reduce over them with shuffles
* ``OnlineSoftmax``      the FA2 online softmax, run directly on a C fragment
* ``mask_tile``          seqlen / causal masking: an identity-tensor coordinate probe, a keep-bitmask
* ``gemm``               issue one tile's WGMMAs (fence, k-loop, commit, optional wait)

TMA descriptors, views and mbarrier pipelines live in ``kernels/tma_pipeline.py``.
"""

from __future__ import annotations

import enum
import operator

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass._mlir.dialects import llvm

from . import simt
from .contract import LN_2, LOG2_E

# The largest softcap whose known-max softmax keeps P = e^(c*t - c) >= e^-2c a normal float32 (and
# bf16, which shares its exponent range; not fp16): 2c * log2(e) < 126, with room for rounding.
KNOWN_MAX_SOFTCAP = 40.0

THREADS_PER_WARPGROUP = 128  # four warps: the unit that issues a WGMMA and owns its accumulator
WGMMA_M = 64  # rows of a warpgroup's WGMMA: each consumer warpgroup owns 64 query rows of a tile


class NamedBarrier(enum.IntEnum):
    """Named-barrier ids (0 is sync_threads). One table for the whole kernel: a barrier id used for
    two purposes at once deadlocks or releases the wrong threads."""

    EPILOGUE = 1  # every consumer is done reading the buffer sO aliases
    WARP_SCHEDULER = 2  # 2, 3, 4: one per consumer warpgroup, passing the tensor-core turn (ping-pong, K6)
    # sO is written and fenced: the storing warp may issue the TMA store; 5, 6, 7 per consumer
    # warpgroup when each stores its own rows (store_o_tma_and_lse)
    EPILOGUE_STORE = 5


# --------------------------------------------------------------------------------------
# Fragment layouts
# --------------------------------------------------------------------------------------

def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)).

    An SM90 accumulator fragment for an M=64 x N atom holds, per thread, V = N/8 column
    pairs in each of 2 rows (rows r and r+8 of the warp's 16-row slab). Mode 0 of the atom
    is (2 columns, 2 rows, V pairs). Regrouping the modes gives a plain (rows, cols) view
    so softmax code can say "row r, column c" without knowing the hardware pattern.
    """
    flat = cute.make_layout(acc_layout.shape)  # column-major indices into the fragment
    shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[0][2], flat.shape[2]))
    stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[0][2], flat.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """The same registers (or coordinates) as ``acc``, indexed as [row, col]."""
    return cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))


def acc_frg_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (V/2, MMA_N)).

    The register A operand of a 16-bit WGMMA (M=64, K=16) holds per thread 2x2 pairs: the
    same two rows as the C fragment and the columns {c, c+1, c+8, c+9} of a 16-wide k slab.
    Those are exactly two consecutive column pairs of the C fragment, so the C fragment
    *is* an A fragment once the V pairs are split into (2 pairs per k-block, V/2 k-blocks).
    No data moves between threads; only the indexing changes.
    """
    assert acc_layout.shape[0][2] % 2 == 0, "C->A reinterpretation needs an even number of column pairs"
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    shape = (
        (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
        split.shape[1],
        (split.shape[0][2][1], split.shape[2]),
    )
    stride = (
        (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
        split.stride[1],
        (split.stride[0][2][1], split.stride[2]),
    )
    return cute.make_layout(shape, stride=stride)


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an FP32 C fragment in the A-operand order of the next GEMM."""
    return cute.make_tensor(acc.iterator, acc_frg_a_layout(acc.layout))


def acc_frg_a_layout_fp8(acc_layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), MMA_M, MMA_N) -> (((2, 2), 2, 2), MMA_M, (V/4, MMA_N)): an FP8 A fragment (K7).

    An 8-bit WGMMA (K=32) wants lane q of a quad to hold keys 4q..4q+3 (and 16 more) of a row,
    but the C fragment gives it keys {2q, 2q+1, 2q+8, 2q+9} of every 16. No re-indexing turns one
    into the other, so this view pretends instead: A slot 4q + v (v < 4) of each 16 keys takes the
    C value of key 8*(v // 2) + 2q + v % 2. Within every 16 keys P is then in the order
    ``FP8_KEY_ORDER``, and V^T's keys must be stored in that same order (K7's V pre-pass) for P V to
    be unchanged. No data moves.
    """
    s_col, s_row, s_group = acc_layout.stride[0]
    shape = (((2, 2), 2, 2), acc_layout.shape[1], (acc_layout.shape[0][2] // 4, acc_layout.shape[2]))
    stride = (((s_col, s_group), s_row, 2 * s_group), acc_layout.stride[1], (4 * s_group, acc_layout.stride[2]))
    return cute.make_layout(shape, stride=stride)


# Key order of P inside every 16 keys under ``acc_frg_a_layout_fp8``: slot p holds key FP8_KEY_ORDER[p].
FP8_KEY_ORDER = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


@cute.jit
def convert_to_fp8(acc: cute.Tensor, dst: cute.Tensor):
    """dst (an FP8 A fragment) = e4m3(acc) through the ``acc_frg_a_layout_fp8`` view, slot for slot
    (the register copies are renamings; the conversions pair up as cvt...e4m3x2)."""
    view = cute.make_tensor(acc.iterator, acc_frg_a_layout_fp8(acc.layout))
    staged = cute.make_rmem_tensor(dst.shape, Float32)
    for i in cutlass.range_constexpr(cute.size(staged)):
        staged[i] = view[i]
    dst.store(staged.load().to(dst.element_type))


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None) -> Int32:
    """Two FP32 -> one packed bf16x2/f16x2 register (lo in the low half), one instruction."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def widen_half(word: Int32, dtype, high: bool, *, loc=None, ip=None) -> Float32:
    """One half of a packed bf16x2/f16x2 register (``cvt_pair``'s lo or hi) as an FP32."""
    kind, half = ("bf16" if dtype is cutlass.BFloat16 else "f16"), ("h" if high else "l")
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(word).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; cvt.f32.{kind} $0, {half}; }}", "=f,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def convert_to(src: cute.Tensor, dst: cute.Tensor):
    """dst = dtype(src) element-wise (in each tensor's own logical order), two per instruction.

    ``TensorSSA.to`` does not always pair the conversions up; writing packed 32-bit words
    through an Int32 view of the 16-bit destination does.
    """
    src_flat = cute.make_tensor(src.iterator, cute.coalesce(src.layout))
    dst_words = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst_words)):
        dst_words[i] = cvt_pair(src_flat[2 * i], src_flat[2 * i + 1], dst.element_type)


@cute.jit
def convert_from(src: cute.Tensor, dst: cute.Tensor):
    """``convert_to`` undone: dst (FP32, laid out as that call's src) = src (its 16-bit dst)."""
    dst_flat = cute.make_tensor(dst.iterator, cute.coalesce(dst.layout))
    src_words = cute.recast_tensor(src, Int32)
    for i in cutlass.range_constexpr(cute.size(src_words)):
        dst_flat[2 * i] = widen_half(src_words[i], src.element_type, False)
        dst_flat[2 * i + 1] = widen_half(src_words[i], src.element_type, True)


# --------------------------------------------------------------------------------------
# 2^x on the FMA pipe (a K6 knob, emulated_exp2: measured on an H100 and left off, docs/k6.md)
# --------------------------------------------------------------------------------------

# 2^f on [0, 1) as 1 + f*(C1 + f*(C2 + f*C3)): a least-squares fit of the relative error, at most
# 8.6e-5 (bf16 keeps 3.9e-3), exact at f = 0. Refit: scripts/fit_exp2.py.
EXP2_POLY = (0.6951157450675964, 0.22764979302883148, 0.07706265151500702)


def _f32_hex(x: float) -> str:
    import struct

    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x with no MUFU instruction: 2^floor(x) from the exponent bits, 2^frac(x) from a cubic.

    ``add.rm`` of 1.5*2^23 leaves floor(x) in the low mantissa bits of t (x >= -126 keeps
    2^floor(x) a normal number); shifted into the exponent field and biased, they are 2^floor(x)
    as a float, and one multiply joins the two halves (so a NaN score stays NaN, as with ex2).
    Eight FP32 and two integer instructions where ex2 takes one MUFU slot: worth it only where
    the MUFU, not instruction issue, limits the softmax (not so in K6 on an H100).
    """
    c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY)
    magic = _f32_hex(1.5 * 2 ** 23)
    asm = ("{ .reg .f32 x, t, j, f, p; .reg .b32 e;\n"
           "max.NaN.f32 x, $1, 0fC2FC0000;\n"  # x >= -126
           f"add.rm.f32 t, x, {magic};\n"
           f"sub.f32 j, t, {magic};\n"  # floor(x), exact
           "sub.f32 f, x, j;\n"
           f"fma.rn.f32 p, f, {c3}, {c2};\n"
           f"fma.rn.f32 p, p, f, {c1};\n"
           "fma.rn.f32 p, p, f, 0f3F800000;\n"
           "shl.b32 e, t, 23;\n"  # floor(x) * 2^23, two's complement
           "add.s32 e, e, 1065353216;\n"  # + 127 << 23: the bits of 2^floor(x)
           "mul.f32 $0, p, e; }")
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], asm, "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


# --------------------------------------------------------------------------------------
# Row reductions over the 4 sibling lanes of a row
# --------------------------------------------------------------------------------------

@cute.jit
def quad_allreduce(x: Float32, op: cutlass.Constexpr) -> Float32:
    """The 4 lanes 4k..4k+3 own the same two rows: butterfly over lane bits 0 and 1."""
    return simt.butterfly_allreduce(x, op, 4)


@cute.jit
def row_reduce(row: cute.Tensor, op: cutlass.Constexpr, init=None) -> Float32:
    """``op`` over one row of a fragment with 4 independent chains (ILP); ``init``, if given,
    is folded in last."""
    n = cute.size(row)
    assert n % 4 == 0, f"row_reduce: row length {n} is not a multiple of 4 (the 4 ILP chains would skip columns)"
    acc = [row[0], row[1], row[2], row[3]]
    for i in cutlass.range_constexpr(4, n, 4):
        for j in cutlass.range_constexpr(4):
            acc[j] = op(acc[j], row[i + j])
    total = op(op(acc[0], acc[1]), op(acc[2], acc[3]))
    if const_expr(init is not None):
        total = op(total, init)
    return total


# --------------------------------------------------------------------------------------
# Online softmax on the accumulator fragment
# --------------------------------------------------------------------------------------

class OnlineSoftmax:
    """Per-thread running max / partial sum for the rows this thread owns.

    ``row_sum`` is each thread's *partial* sum over its own columns: every sibling lane
    rescales by the same factor (the max is quad-reduced), so the cross-lane sum can wait
    until ``finalize``. Scores stay unscaled; ``scale_log2 = softmax_scale * log2(e)`` is
    folded into one FFMA per element ahead of ``ex2``.
    """

    scaled_max = False  # K8 (BlockScaledSoftmax): a scale per KV tile, the row max in scaled units
    # K6's knobs (K6FMHA.tile_softmax sets them per instance; off: both lost on an H100).
    # emulated_exp2: of every 8 columns of a tile with no masked score, this many take
    # ``exp2_poly`` (FMA pipe) instead of ex2 (MUFU). Masked tiles keep ex2: -inf must give exactly 0.
    emulated_exp2 = 0
    # skip_unit_rescale: a warp whose rows all kept their max skips the O rescale (factor exactly 1).
    skip_unit_rescale = False
    # The logit softcap c (Problem.softcap; 0: off), set per instance by ``use_softcap``.
    softcap = 0.0
    known_max = False  # ``use_softcap(known_max=True)``: the row max is 1 throughout

    def __init__(self, num_rows: int, scale_log2: Float32, p_offset: float = 0.0):
        self.num_rows = num_rows
        self.scale_log2 = scale_log2
        # K7: P = exp2(... + p_offset) lands in [0, 2^p_offset], away from e4m3's underflow; the
        # row sum carries the same factor (O is unchanged) and the LSE takes it back out.
        self.p_offset = p_offset
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    def use_softcap(self, softcap: float, known_max: bool = False):
        """Scores become c * tanh(s * scale / c): ``cap`` leaves t = tanh(s * scale / c) in acc_S, and
        the exponent's scale becomes c * log2(e), so that the softmax (and the LSE) sees c * t.

        ``known_max``: t <= 1, so the row max may be taken as 1 from the start: P = exp2(c*log2(e)*(t - 1))
        needs no max reduction and O no rescale. P then spans [e^-2c, 1] instead of ending at 1: a
        caller asks for it only where that range is a normal float32 and bf16 (``KNOWN_MAX_SOFTCAP``)."""
        self.softcap = softcap
        self.cap_scale = self.scale_log2 * (1.0 / (softcap * LOG2_E))
        self.scale_log2 = Float32(softcap * LOG2_E)
        if known_max:
            assert softcap <= KNOWN_MAX_SOFTCAP, f"softcap {softcap}: e^-2c is not a normal float32"
            self.known_max = True
            self.row_max.fill(1.0)

    @cute.jit
    def cap(self, acc_S: cute.Tensor):
        """With a softcap, S -> tanh(S * scale / c), before any mask (the masks' -inf must stay
        -inf); one MUFU op per score beside exp2's. Nothing without."""
        if const_expr(self.softcap > 0.0):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = tanh_approx(acc_S[i] * self.cap_scale)

    @cute.jit
    def step(self, acc_S: cute.Tensor, row_scale: cute.Tensor, check_inf: cutlass.Constexpr[bool], n_block=None,
             exponentiate: cutlass.Constexpr[bool] = True):
        """Overwrite acc_S with P = exp2(S*scale_log2 - max*scale_log2); row_scale gets the
        factor exp2((old_max - new_max)*scale_log2) that O must be multiplied by. ``n_block``:
        the KV tile (K8's scales are per tile). ``exponentiate=False`` stops at the exponents
        (S*scale_log2 - max*scale_log2): ``exp2_rows_and_sum`` finishes the step."""
        acc_S_mn = acc_mn_view(acc_S)
        if const_expr(self.known_max):
            self.step_known_max(acc_S_mn, check_inf)
        else:
            self.step_online(acc_S_mn, row_scale, check_inf, n_block, exponentiate)

    @cute.jit
    def step_known_max(self, acc_S_mn: cute.Tensor, masked: cutlass.Constexpr[bool]):
        """``step`` with the max fixed at 1 (a softcap's t <= 1): one FFMA and one ex2 per score;
        masked scores are -inf and give 0, a row with none left sums to 0 (``finalize``)."""
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_S_mn[r, None]
            self.exp2_row(row, self.scale_log2, self.scale_log2, masked)
            self.row_sum[r] = self.row_sum[r] + row_reduce(row, operator.add)

    @cute.jit
    def exp2_row(self, row: cute.Tensor, scale: Float32, shift: Float32, masked: cutlass.Constexpr[bool]):
        """row <- exp2(row * scale - shift): ex2 throughout, or in a tile with no masked score (-inf
        must give exactly 0) ``emulated_exp2`` of every 8 columns on the FMA pipe (``exp2_poly``)."""
        if const_expr(self.emulated_exp2 == 0 or masked):
            row.store(cute.math.exp2(row.load() * scale - shift, fastmath=True))
        else:
            row.store(row.load() * scale - shift)
            for c in cutlass.range_constexpr(cute.size(row)):
                if const_expr(c % 8 >= 8 - self.emulated_exp2):
                    row[c] = exp2_poly(row[c])
                else:
                    row[c] = cute.math.exp2(row[c], fastmath=True)

    @cute.jit
    def step_online(self, acc_S_mn: cute.Tensor, row_scale: cute.Tensor, check_inf: cutlass.Constexpr[bool],
                    n_block, exponentiate: cutlass.Constexpr[bool]):
        scale = self.tile_scale_log2(n_block) if const_expr(self.scaled_max) else self.scale_log2
        for r in cutlass.range_constexpr(self.num_rows):
            row = acc_S_mn[r, None]
            m_prev = self.row_max[r]
            if const_expr(self.scaled_max):
                m_tile = quad_allreduce(row_reduce(row, cute.arch.fmax, -Float32.inf), cute.arch.fmax)
                m_new = cute.arch.fmax(m_prev, m_tile * scale)
            else:
                m_new = quad_allreduce(row_reduce(row, cute.arch.fmax, m_prev), cute.arch.fmax)
            self.row_max[r] = m_new
            if const_expr(check_inf):
                # A row fully masked so far has max -inf: subtract 0 instead so that
                # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
                m_new = Float32(0.0) if m_new == -Float32.inf else m_new
            if const_expr(self.scaled_max):
                m_scaled = m_new
                row_scale[r] = cute.math.exp2(m_prev - m_scaled, fastmath=True)
            else:
                m_scaled = m_new * scale
                row_scale[r] = cute.math.exp2(m_prev * scale - m_scaled, fastmath=True)
                if const_expr(self.skip_unit_rescale):
                    # exactly 1 when the max did not move (ex2 of a rounding residue need not be)
                    row_scale[r] = Float32(1.0) if self.row_max[r] == m_prev else row_scale[r]
            if const_expr(self.p_offset != 0.0):
                m_scaled = m_scaled - self.p_offset
            if const_expr(not exponentiate):
                assert self.emulated_exp2 == 0 and not self.scaled_max, "exponentiate=False: plain ex2 only"
                row.store(row.load() * scale - m_scaled)
            else:
                self.exp2_row(row, scale, m_scaled, check_inf)
            if const_expr(exponentiate):
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + row_reduce(row, operator.add)

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        if const_expr(self.known_max):
            pass  # the max never moves: nothing to rescale
        elif const_expr(self.skip_unit_rescale):
            moved = row_scale[0] != 1.0
            for r in cutlass.range_constexpr(1, self.num_rows):
                moved = moved | (row_scale[r] != 1.0)
            if cute.arch.vote_any_sync(moved):  # warp-uniform: the 16 rows of this warp
                self.multiply_rows(acc_O, row_scale)
        else:
            self.multiply_rows(acc_O, row_scale)

    def multiply_rows(self, acc_O: cute.Tensor, row_scale: cute.Tensor):  # the override point of rescale
        scale_rows(acc_O, row_scale)

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor):
        """Deferred normalization: O /= rowsum once, and lse = ln(sum) + max*scale."""
        acc_O_mn = acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            total = quad_allreduce(self.row_sum[r], operator.add)
            # Only a zero sum means "no unmasked key" (cannot happen for a valid row). A NaN
            # sum is a bug upstream: let it reach O and LSE so the checks catch it.
            empty = total == 0.0
            inv = cute.arch.rcp_approx(Float32(1.0) if empty else total)
            lse[r] = (-Float32.inf if empty
                      else ((self.row_max[r] if const_expr(self.scaled_max) else self.row_max[r] * self.scale_log2)
                            + cute.math.log2(total, fastmath=True) - self.p_offset) * LN_2)
            acc_O_mn[r, None].store(acc_O_mn[r, None].load() * inv)


@cute.jit
def exp2_rows_and_sum(acc_S: cute.Tensor, row_scale: cute.Tensor, row_sum: cute.Tensor):
    """The second half of ``OnlineSoftmax.step(..., exponentiate=False)``: P = exp2 of the
    exponents in acc_S, and each row's partial sum rescaled and extended."""
    acc_S_mn = acc_mn_view(acc_S)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        row = acc_S_mn[r, None]
        row.store(cute.math.exp2(row.load(), fastmath=True))
        row_sum[r] = row_sum[r] * row_scale[r] + row_reduce(row, operator.add)


@cute.jit
def scale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    """Row r of an accumulator (C fragment) times row_scale[r]."""
    acc_mn = acc_mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])


class BlockScaledSoftmax(OnlineSoftmax):
    """K8: every KV tile j brings its own descales, k_d[j] and v_d[j] (views of one (batch, head)'s
    row), and ``scale_log2`` already holds this Q tile's q descale.

    Raw scores of two tiles no longer compare, so the row max is kept in scaled (log2) units: a
    positive factor commutes with max, so it is still one multiply per row and one FFMA per score.
    O is carried in the units of the current tile's v_d: the ratio to the previous tile's joins
    the per-row rescale every tile gets anyway, and ``finalize`` multiplies by the last tile's.
    KV tiles are walked in descending order (K5 on): the first is ``first_block``, the last 0.
    """

    scaled_max = True

    def __init__(self, num_rows: int, scale_log2: Float32, p_offset: float, k_descale: cute.Tensor,
                 v_descale: cute.Tensor, first_block: Int32):
        super().__init__(num_rows, scale_log2, p_offset)
        self.k_descale, self.v_descale, self.first_block = k_descale, v_descale, first_block

    def tile_scale_log2(self, n_block: Int32) -> Float32:
        return self.scale_log2 * self.k_descale[n_block]

    @cute.jit
    def step(self, acc_S: cute.Tensor, row_scale: cute.Tensor, check_inf: cutlass.Constexpr[bool], n_block=None):
        OnlineSoftmax.step(self, acc_S, row_scale, check_inf, n_block)
        v_ratio = self.v_descale[cutlass.min(n_block + 1, self.first_block)] / self.v_descale[n_block]
        for r in cutlass.range_constexpr(self.num_rows):
            row_scale[r] = row_scale[r] * v_ratio

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor):
        acc_O.store(acc_O.load() * self.v_descale[0])
        OnlineSoftmax.finalize(self, acc_O, lse)


# --------------------------------------------------------------------------------------
# Epilogue: O and LSE straight from the accumulator
# --------------------------------------------------------------------------------------

@cute.jit
def store_o_and_lse(acc_O: cute.Tensor, softmax: OnlineSoftmax, tiled_mma_pv: cute.TiledMma, tidx: Int32,
                    mO: cute.Tensor, mLSE: cute.Tensor, m_block: Int32, head: Int32, batch: Int32,
                    tile_m: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """Normalize once, narrow O to ``dtype`` and write O and LSE from registers, rows predicated.

    Each row segment of the C fragment is (2 adjacent columns) x (pairs 8 apart): 4-byte stores.
    Lane 0 of each quad owns column 0 and writes that row's LSE.
    """
    lse, rO = finalize_o(acc_O, softmax, dtype)
    store_rows(rO, lse, tiled_mma_pv, tidx, mO, mLSE, m_block, head, batch, tile_m)


@cute.jit
def store_rows(rO: cute.Tensor, lse: cute.Tensor, tiled_mma_pv: cute.TiledMma, tidx: Int32, mO: cute.Tensor,
               mLSE: cute.Tensor, m_block: Int32, head: Int32, batch: Int32, tile_m: cutlass.Constexpr):
    """This thread's rows of O (already narrowed) and their LSE, rows past the sequence skipped."""
    d = cute.size(mO, mode=[3])
    thr_mma_pv = tiled_mma_pv.get_slice(tidx)
    gO = cute.local_tile(mO[batch, head, None, None], (tile_m, d), (m_block, 0))
    tOgO_mn = acc_mn_view(thr_mma_pv.partition_C(gO))
    tOcO_mn = acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((tile_m, d))))
    rO_mn = acc_mn_view(rO)
    rows_left = mO.shape[2] - m_block * tile_m
    for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
        row = tOcO_mn[r, 0][0]
        if row < rows_left:
            cute.autovec_copy(rO_mn[r, None], tOgO_mn[r, None])
            if const_expr(mLSE is not None):  # K9's dK and dV: rows without an LSE
                if tOcO_mn[r, 0][1] == 0:
                    mLSE[batch, head, m_block * tile_m + row] = lse[r]


@cute.jit
def finalize_o(acc_O: cute.Tensor, softmax: OnlineSoftmax, dtype: cutlass.Constexpr):
    """(LSE per row, O normalized and narrowed to ``dtype``), both in registers. Float32 (split-KV
    partials) stays as it is."""
    lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
    softmax.finalize(acc_O, lse)
    if const_expr(dtype is Float32):
        return lse, acc_O
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    convert_to(acc_O, rO)
    return lse, rO


@cute.jit
def store_o_tma_and_lse(acc_O: cute.Tensor, softmax: OnlineSoftmax, tiled_mma_pv: cute.TiledMma, tidx: Int32,
                        sO: cute.Tensor, tOsO: cute.Tensor, tOgO: cute.Tensor, tma_atom_O: cute.CopyAtom,
                        mLSE: cute.Tensor, m_block: Int32, head: Int32, batch: Int32, seqlen: Int32,
                        tile_m: cutlass.Constexpr, dtype: cutlass.Constexpr, num_threads: cutlass.Constexpr,
                        wg_idx=None):
    """O through SMEM and one TMA store; LSE from registers as before.

    ``sO`` aliases the Q buffer of this tile, so every consumer must be done with its QK first
    (barrier 1). ``stmatrix`` writes the swizzled tile; each thread fences its writes for the
    async proxy and arrives on barrier 5; the first consumer warp syncs there (the +32) and
    issues the TMA store, which clips the rows past seqlen, and waits until the store has *read*
    sO: only then may the Q buffer be reloaded (the caller releases it after this returns).

    ``wg_idx``: each consumer warpgroup stores its own 64 rows (``tOsO`` and ``tOgO`` are its
    slice, ``num_threads`` 128, its first warp issues the store). Those rows of Q were read by its
    own QKs only, so no warpgroup waits for another: in a ping-pong the first one's epilogue runs
    under the second one's last GEMMs.
    """
    lse, rO = finalize_o(acc_O, softmax, dtype)
    warp = cute.arch.make_warp_uniform(tidx // 32)
    if const_expr(wg_idx is None):
        cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE, number_of_threads=num_threads)
        store_barrier, storing_warp = NamedBarrier.EPILOGUE_STORE, warp == 0
    else:
        store_barrier, storing_warp = NamedBarrier.EPILOGUE_STORE + wg_idx, warp % 4 == 0
    store_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    thr_store = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(tidx)
    cute.copy(store_atom, thr_store.retile(rO), thr_store.partition_D(sO))
    cute.arch.fence_view_async_shared()
    cute.arch.barrier_arrive(barrier_id=store_barrier, number_of_threads=num_threads + 32)
    thr_mma_pv = tiled_mma_pv.get_slice(tidx)
    tOcO_mn = acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((tile_m, cute.size(sO, mode=[1])))))
    rows_left = seqlen - m_block * tile_m
    for r in cutlass.range_constexpr(softmax.num_rows):
        row = tOcO_mn[r, 0][0]
        if row < rows_left and tOcO_mn[r, 0][1] == 0:
            mLSE[batch, head, m_block * tile_m + row] = lse[r]
    if storing_warp:
        cute.arch.barrier(barrier_id=store_barrier, number_of_threads=num_threads + 32)
        cute.copy(tma_atom_O, tOsO, tOgO)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """tanh.approx.f32: one MUFU op (max relative error about 2^-11, below bf16's P)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;", "=f,f",
                                   has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


# --------------------------------------------------------------------------------------
# Masking through an identity-tensor coordinate probe
# --------------------------------------------------------------------------------------

@dsl_user_op
def shr_u32(x: cutlass.Uint32, n: cutlass.Uint32, *, loc=None, ip=None) -> cutlass.Uint32:
    """x >> n with PTX's semantics: 0 for n >= 32 (in LLVM a shift by >= 32 is undefined)."""
    return cutlass.Uint32(llvm.inline_asm(
        T.i32(), [cutlass.Uint32(x).ir_value(loc=loc, ip=ip), cutlass.Uint32(n).ir_value(loc=loc, ip=ip)],
        "shr.b32 $0, $1, $2;", "=r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


def columns_below(col_limit):
    """How many of a row's C-fragment columns lie below ``col_limit`` (relative to the thread's
    first column): column c sits at 8 * (c // 2) + c % 2. Python ints or DSL integers."""
    col_limit = cutlass.max(col_limit, 0)
    return col_limit // 8 * 2 + cutlass.min(col_limit % 8, 2)


@cute.jit
def mask_tile(acc_S: cute.Tensor, tScS: cute.Tensor, m_block: Int32, n_block: Int32, seqlen: Int32,
              tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, causal: cutlass.Constexpr, causal_offset=None,
              rows_per_query: cutlass.Constexpr = 1, window: cutlass.Constexpr = None):
    """Set scores to -inf where key >= seqlen (the key length) or (causal) key > query +
    ``causal_offset`` (seqlen_k - seqlen_q when keys outnumber queries: bottom-right alignment).
    With GQA packing (decode) ``rows_per_query`` rows hold one query position. A sliding
    ``window`` (left, right; -1 unbounded, right unused when causal) also drops keys below query
    + offset - left and, not causal, above query + offset + right.

    ``tScS`` is the thread's partition of an identity tensor over the (tile_m, tile_n) tile:
    the same C-fragment layout as acc_S, but each slot holds its (row, col) coordinate.
    Column c of a row sits at key thr_col + 8 * (c // 2) + c % 2, so the keys below a limit are
    always the row's first n_keep columns: one 32-bit keep-mask per 32 columns, whose constant
    bit tests ptxas turns into predicate moves (R2P), instead of one compare per column. A
    window's lower edge drops the first n_drop columns the same way.
    """
    left, right = window if const_expr(window is not None) else (-1, -1)
    right_edge = causal or right >= 0
    acc_S_mn = acc_mn_view(acc_S)
    tScS_mn = acc_mn_view(tScS)
    num_cols = cute.size(acc_S_mn, mode=[1])
    thr_col = tScS_mn[0, 0][1]
    col_limit_seqlen = seqlen - n_block * tile_n - thr_col
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        col_limit = col_limit_seqlen
        if const_expr(right_edge or left >= 0):
            q_idx = m_block * tile_m + tScS_mn[r, 0][0]
            if const_expr(rows_per_query > 1):
                q_idx = q_idx // rows_per_query
            if const_expr(causal_offset is not None):
                q_idx = q_idx + causal_offset
        if const_expr(right_edge):
            last_key = q_idx if const_expr(causal) else q_idx + right
            col_limit = cutlass.min(col_limit, last_key + 1 - n_block * tile_n - thr_col)
        n_keep = columns_below(col_limit)
        if const_expr(left >= 0):
            n_drop = columns_below(q_idx - left - n_block * tile_n - thr_col)
        for chunk in cutlass.range_constexpr(cute.ceil_div(num_cols, 32)):
            keep = shr_u32(cutlass.Uint32(0xFFFFFFFF), cutlass.Uint32(cutlass.max(32 * (chunk + 1) - n_keep, 0)))
            if const_expr(left >= 0):
                drop = shr_u32(cutlass.Uint32(0xFFFFFFFF), cutlass.Uint32(cutlass.max(32 * (chunk + 1) - n_drop, 0)))
                keep = keep & (drop ^ cutlass.Uint32(0xFFFFFFFF))
            for i in cutlass.range_constexpr(min(32, num_cols - 32 * chunk)):
                c = 32 * chunk + i
                acc_S_mn[r, c] = acc_S_mn[r, c] if cutlass.Boolean(keep & cutlass.Uint32(1 << i)) else -Float32.inf


# --------------------------------------------------------------------------------------
# WGMMA issue
# --------------------------------------------------------------------------------------

@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
         zero_init: cutlass.Constexpr[bool], wg_wait: cutlass.Constexpr[int]):
    """acc (+)= A @ B over the k-blocks of one tile, as one async WGMMA group.

    fence: make register writes to acc/A visible to the async tensor-core proxy.
    commit_group: close the batch. wait_group(n): block until <= n batches are in flight
    (wg_wait < 0 returns immediately so the caller can overlap work with the GEMM).
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)


def load_a_operand(tiled_mma: cute.TiledMma, sA: cute.Tensor, tCrA: cute.Tensor, tidx: Int32, dtype):
    """A WGMMA A operand from SMEM into its register fragment (ldmatrix), for an RS GEMM."""
    atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    thr_copy = cute.make_tiled_copy_A(atom, tiled_mma).get_slice(tidx)
    cute.copy(atom, thr_copy.partition_S(sA), thr_copy.retile(tCrA))


@dsl_user_op
def pinned_u64(x: cutlass.Int64, *, loc=None, ip=None) -> cutlass.Int64:
    """x through a side-effecting ``mov``: LLVM may not recompute it at its uses or move it."""
    return cutlass.Int64(llvm.inline_asm(
        T.i64(), [cutlass.Int64(x).ir_value(loc=loc, ip=ip)], "mov.b64 $0, $1;", "=l,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


class StagedOperand:
    """A staged SMEM operand of WGMMA (K or V^T: ``frag[None, None, None, stage]``) whose 64-bit
    descriptor is built once, here, and advanced per stage with one multiply-add.

    Indexed with a runtime stage, the fragment itself rebuilds the descriptor from the SMEM
    address inside every KV step (add, shift, mask, then the stage), and nothing hoists that out
    of the warp-specialized kernels' loops: the descriptor is made here and pinned (an opaque
    move), so the loop keeps it in a register. Same descriptors, same WGMMAs."""

    def __init__(self, frag: cute.Tensor):
        from cutlass.cute.nvgpu.tcgen05 import smem_descriptor_to_int

        self.desc = pinned_u64(smem_descriptor_to_int(frag.iterator))
        self.layout = frag[None, None, None, 0].layout
        self.stage_stride = cute.crd2idx((0, 0, 0, 1), frag.layout)  # descriptor units (16 bytes)

    def __getitem__(self, coord: tuple) -> cute.Tensor:
        from cutlass.cute.nvgpu.tcgen05 import int_to_smem_descriptor

        *rest, stage = coord
        assert all(c is None for c in rest), "index the stage mode only"
        return cute.make_tensor(int_to_smem_descriptor(self.desc + cutlass.Int64(stage) * self.stage_stride),
                                self.layout)


# --------------------------------------------------------------------------------------
# Ping-pong between consumer warpgroups (K6): named barriers pass a token
# --------------------------------------------------------------------------------------


class Mmas(NamedTuple):
    """One consumer warpgroup's GEMM state (K4-K6): the two tiled MMAs, their operand fragments
    (Q's, K's and V's as SMEM descriptors, P's in registers), O's accumulator, and the coordinate
    probe that says which (row, col) of the S tile each accumulator register holds."""

    tiled_mma_qk: object
    tiled_mma_pv: object
    tSrQ: object
    tSrK: object
    tOrVt: object
    tOrP: object
    acc_O: object
    tScS: object


class WarpScheduler:
    """Consumer warpgroups take turns on the tensor cores.

    A warpgroup ``sync``s its own barrier right before issuing a batch of GEMMs and ``arrive``s on
    the next warpgroup's right after issuing them (before waiting for them): the next warpgroup's
    GEMMs queue behind these while this one does its softmax. Each barrier counts two
    warpgroups: its owner's sync and the previous one's arrive. ``init`` gives the first
    warpgroup the token. Every warpgroup must sync and arrive equally often, or the token stalls.
    """

    PAIR = 2 * THREADS_PER_WARPGROUP  # a barrier's count: its owner's sync and the previous one's arrive

    def __init__(self, num_wg: int, enabled: bool):
        self.num_wg = num_wg
        self.enabled = enabled and num_wg > 1

    def _wg(self):
        # Consumers are warpgroups 1..num_wg (0 is the producer).
        return cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // THREADS_PER_WARPGROUP) - 1

    @cute.jit
    def init(self):
        if const_expr(self.enabled):
            if self._wg() == 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.WARP_SCHEDULER, number_of_threads=self.PAIR)

    def sync(self):
        if const_expr(self.enabled):
            cute.arch.barrier(barrier_id=NamedBarrier.WARP_SCHEDULER + self._wg(), number_of_threads=self.PAIR)

    def arrive(self):
        if const_expr(self.enabled):
            next_wg = (self._wg() + 1) % self.num_wg
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.WARP_SCHEDULER + next_wg, number_of_threads=self.PAIR)
