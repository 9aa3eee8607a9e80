"""K8's quantizers, in torch: the definition that the CuTe quantizer kernels must reproduce.

Two ingredients on top of K7's per-tensor e4m3 (``k7.quantize_fp8``):

* Block quantization: one scale per block of rows of one (batch, head), the block being the
  kernel's tile (tile_m query rows, tile_n keys), so an outlier only coarsens its own tile.
* Incoherent processing: Q and K are rotated by M = diag(s) H_d / sqrt(d) (s a seeded +-1 vector,
  H_d the Sylvester Hadamard matrix) before they are quantized. M M^T = I, so Q' K'^T = Q K^T;
  an outlier coordinate is spread over all d coordinates, and the block amax drops.

Arithmetic, fixed so that a kernel can match it bit for bit: everything in float32; the rotation
is sign flip, then the fast Walsh-Hadamard butterflies with stride h = 1, 2, 4, ..., d/2 (each
stage maps (x[i], x[i+h]) to (x[i] + x[i+h], x[i] - x[i+h]) for i with bit h clear), then one
multiply by the float32 constant 1/sqrt(d); scale = 448 / amax (1 when amax is 0), x8 =
e4m3(x * scale) rounded to nearest even and saturated to +-448, descale = 1 / scale.
"""

from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .contract import H100_SMS, buffers, scratch, scratch_set

E4M3_MAX = 448.0


_SIGNS: dict = {}


def hadamard_signs(head_dim: int, seed: int = 0, device=None):
    """The +-1 diagonal s of the rotation (float32, (head_dim,)), the same for every head: Q and K
    must share it, and a fixed seed makes runs repeatable. Kept per device: making it copies from
    the host, which CUDA-graph capture forbids (the warm-up call before a capture makes it)."""
    import torch

    key = (head_dim, seed, str(device))
    if key not in _SIGNS:
        g = torch.Generator().manual_seed(seed)
        _SIGNS[key] = (torch.randint(0, 2, (head_dim,), generator=g).float() * 2 - 1).to(device)
    return _SIGNS[key]


def fwht(x):
    """Unnormalized Walsh-Hadamard transform along the last dim (a power of 2), float32 in and out,
    butterflies in the order the module docstring fixes (equals x @ H_d in exact arithmetic)."""
    import torch

    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"fwht: the last dim must be a power of 2, got {d}")
    h = 1
    while h < d:
        y = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], d)
        h *= 2
    return x


def rotate(x, signs):
    """x M = fwht(x * s) / sqrt(d), in float32."""
    import torch

    inv_sqrt_d = float(torch.tensor(1.0 / math.sqrt(x.shape[-1]), dtype=torch.float32))  # the fp32 constant
    return fwht(x.float() * signs.to(x.device)) * inv_sqrt_d


def hadamard_matrix(head_dim: int):
    """H_d (Sylvester), float64: for tests of the transform, not for the timed path."""
    import torch

    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _scales(amax):
    import torch

    amax = amax.float()
    # A tensor divide (IEEE, correctly rounded): ``448 / amax`` would be torch's reciprocal-then-
    # multiply, two roundings, which the kernel's div.rn.f32 does not reproduce.
    scale = torch.full_like(amax, E4M3_MAX).div(amax.clamp_min(torch.finfo(torch.float32).tiny))
    scale = torch.where(amax > 0, scale, torch.ones_like(amax))
    return scale, scale.reciprocal()


def _cast(y):
    import torch

    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_blocks(x, block_rows: int, signs=None):
    """(x8, descale) with x (batch, heads, seqlen, d) in 16 or 32 bits: x8 e4m3 of the same shape,
    descale float32 (batch, heads, ceil(seqlen / block_rows)); row r of a head is ~ x8[r] *
    descale[r // block_rows]. With ``signs``, the rows are rotated first (``rotate``): Q and K only,
    and with the same signs. On a GPU (16-bit x) by ``QuantizeBlocks``, bit for bit the torch
    arithmetic of ``quantize_fp8_blocks_torch``."""
    import torch

    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return quantize_fp8_blocks_cute(x, block_rows, signs)
    return quantize_fp8_blocks_torch(x, block_rows, signs)


def quantize_fp8_blocks_torch(x, block_rows: int, signs=None):
    """``quantize_fp8_blocks`` as torch ops: the reference for ``QuantizeBlocks``."""
    import torch

    b, h, n, d = x.shape
    y = rotate(x, signs) if signs is not None else x.float()
    nblocks = -(-n // block_rows)
    pad = nblocks * block_rows - n
    yp = torch.nn.functional.pad(y, (0, 0, 0, pad)) if pad else y
    amax = yp.abs().reshape(b, h, nblocks, block_rows * d).amax(dim=-1)
    scale, descale = _scales(amax)
    x8 = _cast(y * scale.repeat_interleave(block_rows, dim=-1)[..., :n, None])
    return x8, descale


# --------------------------------------------------------------------------------------
# The quantizer as a kernel: a CTA per (row block, head, batch), the block held in registers
# --------------------------------------------------------------------------------------

class QuantizeBlocks:
    """x (batch, heads, seqlen, d) 16-bit -> e4m3 and one descale per ``block_rows`` rows.

    Lane l of a warp holds elements l*E .. l*E + E - 1 of a row (E = d / 32). The rotation's
    butterflies with stride h < E stay in the lane's registers; for h >= E the partner is lane
    l ^ (h / E), one ``shfl.bfly`` per element, the lane with that bit clear keeping a + b and the
    other a - b: the same fp32 operations, in the same order, as ``fwht``. The block amax needs
    every row before any row can be scaled, so a CTA holds its whole block in registers: each warp
    loads all of its rows at once (rows past the end load the last row again, which leaves the amax
    as it is, and are not stored), rotates them, and after the block's amax scales, converts and
    stores them. One read of x, and every load of a warp in flight together: a warp walking its
    rows one at a time, twice, ran at 1.1 TB/s on an H100.
    """

    def __init__(self, head_dim: int, block_rows: int, rotate: bool):
        self.head_dim, self.block_rows, self.rotate = head_dim, block_rows, rotate
        self.elems = head_dim // 32
        self.warps = 16 if block_rows % 16 == 0 else 8  # 8 rows of E fp32 values a lane at 128-row blocks
        self.rows_per_warp = -(-block_rows // self.warps)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mX8: cute.Tensor, mDescale: cute.Tensor, mSigns: cute.Tensor, stream):
        grid = (cute.ceil_div(mX.shape[2], self.block_rows), mX.shape[1], mX.shape[0])
        self.kernel(mX, mX8, mDescale, mSigns).launch(grid=grid, block=[32 * self.warps, 1, 1], stream=stream)

    @cute.jit
    def rotate_row(self, y: cute.Tensor, mSigns: cute.Tensor, lane: Int32):
        """This lane's E fp32 values of one row, rotated in place."""
        e = self.elems
        for i in cutlass.range_constexpr(e):
            y[i] = y[i] * mSigns[lane * e + i]
        for s in cutlass.range_constexpr(e.bit_length() - 1):  # strides 1 .. E/2: inside the lane
            for i in cutlass.range_constexpr(e):
                if const_expr(i & (1 << s) == 0):
                    a, b = y[i], y[i + (1 << s)]
                    y[i], y[i + (1 << s)] = a + b, a - b
        for s in cutlass.range_constexpr(5):  # strides E .. d/2: partner lane ^ 2^s
            upper = (lane & (1 << s)) != 0
            for i in cutlass.range_constexpr(e):
                other = cute.arch.shuffle_sync_bfly(y[i], offset=1 << s)
                y[i] = (other - y[i]) if upper else (y[i] + other)
        inv_sqrt_d = Float32(_inv_sqrt(self.head_dim))
        for i in cutlass.range_constexpr(e):
            y[i] = y[i] * inv_sqrt_d

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mX8: cute.Tensor, mDescale: cute.Tensor, mSigns: cute.Tensor):
        blk, head, batch = cute.arch.block_idx()
        sMax = cutlass.utils.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.warps), byte_alignment=16)
        self.quantize_block(mX, mX8, mDescale, mSigns, blk, head, batch, sMax)

    @cute.jit
    def quantize_block(self, mX: cute.Tensor, mX8: cute.Tensor, mDescale: cute.Tensor, mSigns: cute.Tensor, blk: Int32,
                       head: Int32, batch: Int32, sMax: cute.Tensor):
        """Block ``blk`` of (batch, head): its rows rotated, its amax, its descale, its e4m3 rows."""
        e, rpw, warps = self.elems, self.rows_per_warp, self.warps
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = tidx % 32, tidx // 32
        first = blk * self.block_rows
        rows = cutlass.min(self.block_rows, mX.shape[2] - first)
        raw = cute.make_rmem_tensor((e, rpw), mX.element_type)
        for j in cutlass.range_constexpr(rpw):  # every load first: no branch between them
            r = cutlass.min(warp + j * warps, rows - 1)
            cute.autovec_copy(cute.local_tile(mX[batch, head, first + r, None], (e,), (lane,)), raw[None, j])
        vals = cute.make_rmem_tensor((e, rpw), Float32)
        amax = Float32(0.0)
        for j in cutlass.range_constexpr(rpw):
            y = vals[None, j]
            y.store(raw[None, j].load().to(Float32))
            if const_expr(self.rotate):
                self.rotate_row(y, mSigns, lane)
            for i in cutlass.range_constexpr(e):
                amax = cute.arch.fmax(amax, cute.arch.fmax(y[i], -y[i]))
        scale = e4m3_scale(cta_max(amax, sMax, warps, warp, lane))
        if tidx == 0:
            mDescale[batch, head, blk] = Float32(1.0) / scale
        for j in cutlass.range_constexpr(rpw):
            y = vals[None, j]
            for i in cutlass.range_constexpr(e):
                y[i] = cute.arch.fmax(cute.arch.fmin(y[i] * scale, Float32(E4M3_MAX)), Float32(-E4M3_MAX))
            x8 = cute.make_rmem_tensor(e, mX8.element_type)
            x8.store(y.load().to(mX8.element_type))
            r = warp + j * warps
            if r < rows:
                cute.autovec_copy(x8, cute.local_tile(mX8[batch, head, first + r, None], (e,), (lane,)))



class QuantizeInputs:
    """K8's pre-pass quantizers for q, k and v in one launch (a launch costs its caller as much host
    time as a small kernel takes): blockIdx.z picks the tensor and the batch, and each tensor is a
    ``QuantizeBlocks`` of its own (q per tile_m rows, k and v per tile_n; q and k rotated). A CTA past
    its tensor's blocks or heads (K/V: fewer heads with GQA, another length) has nothing to do."""

    def __init__(self, head_dim: int, tile_m: int, tile_n: int, rotate: bool):
        self.ops = (QuantizeBlocks(head_dim, tile_m, rotate), QuantizeBlocks(head_dim, tile_n, rotate),
                    QuantizeBlocks(head_dim, tile_n, False))
        self.warps = self.ops[0].warps
        if any(op.warps != self.warps for op in self.ops):
            raise ValueError(f"QuantizeInputs: tile_m {tile_m} and tile_n {tile_n} need warps of one count")

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQ8: cute.Tensor, mK8: cute.Tensor,
                 mV8: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mSigns: cute.Tensor, stream):
        blocks = cutlass.max(cute.ceil_div(mQ.shape[2], self.ops[0].block_rows),
                             cute.ceil_div(mK.shape[2], self.ops[1].block_rows))
        self.kernel(mQ, mK, mV, mQ8, mK8, mV8, mDq, mDk, mDv, mSigns).launch(
            grid=(blocks, mQ.shape[1], 3 * mQ.shape[0]), block=[32 * self.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQ8: cute.Tensor, mK8: cute.Tensor,
               mV8: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mSigns: cute.Tensor):
        blk, head, z = cute.arch.block_idx()
        batch, which = z % mQ.shape[0], z // mQ.shape[0]
        sMax = cutlass.utils.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.warps), byte_alignment=16)
        if which == 0:
            if blk < mDq.shape[2]:
                self.ops[0].quantize_block(mQ, mQ8, mDq, mSigns, blk, head, batch, sMax)
        elif head < mK.shape[1]:
            if blk < mDk.shape[2]:
                if which == 1:
                    self.ops[1].quantize_block(mK, mK8, mDk, mSigns, blk, head, batch, sMax)
                else:
                    self.ops[2].quantize_block(mV, mV8, mDv, mSigns, blk, head, batch, sMax)


@cute.jit
def cta_max(value: Float32, sMax: cute.Tensor, warps: cutlass.Constexpr, warp: Int32, lane: Int32) -> Float32:
    """The max of ``value`` over the CTA's ``warps`` warps: a warp reduction, then one value a warp
    through ``sMax``."""
    value = cute.arch.warp_reduction_max(value)
    if lane == 0:
        sMax[warp] = value
    cute.arch.sync_threads()
    value = sMax[0]
    for w in cutlass.range_constexpr(1, warps):
        value = cute.arch.fmax(value, sMax[w])
    return value


@cute.jit
def e4m3_scale(amax: Float32) -> Float32:
    """448 / amax, 1 where amax is 0 (an all-zero block or tensor): ``_scales`` on the GPU."""
    scale = Float32(1.0)
    if amax > Float32(0.0):
        scale = Float32(E4M3_MAX) / amax
    return scale


def _inv_sqrt(d: int) -> float:
    """1/sqrt(d) rounded to float32, as ``rotate`` multiplies by it."""
    import struct

    return struct.unpack("f", struct.pack("f", 1.0 / math.sqrt(d)))[0]


@functools.cache
def compile_quantize_blocks(head_dim: int, block_rows: int, rotate: bool, dtype: str, keep_ptx: bool = False):
    from .contract import cute_dtype, fake_stream, jit_compile

    def build():
        from cutlass.cute.runtime import make_fake_tensor

        b, h, n, nb = (cute.sym_int() for _ in range(4))
        strides = lambda div: tuple(cute.sym_int64(divisibility=div) for _ in range(3)) + (1,)  # noqa: E731
        x = make_fake_tensor(cute_dtype(dtype), (b, h, n, head_dim), stride=strides(8), assumed_align=16)
        x8 = make_fake_tensor(cutlass.Float8E4M3FN, (b, h, n, head_dim), stride=strides(16), assumed_align=16)
        descale = make_fake_tensor(Float32, (b, h, nb), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
        signs = make_fake_tensor(Float32, (head_dim,), stride=(1,), assumed_align=16)
        return QuantizeBlocks(head_dim, block_rows, rotate), (x, x8, descale, signs, fake_stream())

    return jit_compile(("quantize_blocks", head_dim, block_rows, rotate, dtype), build, keep_ptx)


@functools.cache
def compile_quantize_inputs(head_dim: int, tile_m: int, tile_n: int, rotate: bool, dtype: str, keep_ptx: bool = False):
    from .contract import cute_dtype, fake_stream, jit_compile

    def build():
        from cutlass.cute.runtime import make_fake_tensor

        b, h, n, hk, nk, mq, mk = (cute.sym_int() for _ in range(7))
        strides = lambda div: tuple(cute.sym_int64(divisibility=div) for _ in range(3)) + (1,)  # noqa: E731
        xs = [make_fake_tensor(kind, (b, heads, rows, head_dim), stride=strides(div), assumed_align=16)
              for kind, div in ((cute_dtype(dtype), 8), (cutlass.Float8E4M3FN, 16))
              for heads, rows in ((h, n), (hk, nk), (hk, nk))]
        descales = [make_fake_tensor(Float32, (b, heads, blocks), stride=(cute.sym_int64(), cute.sym_int64(), 1),
                                     assumed_align=4) for heads, blocks in ((h, mq), (hk, mk), (hk, mk))]
        signs = make_fake_tensor(Float32, (head_dim,), stride=(1,), assumed_align=16)
        return QuantizeInputs(head_dim, tile_m, tile_n, rotate), (*xs, *descales, signs, fake_stream())

    return jit_compile(("quantize_inputs", head_dim, tile_m, tile_n, rotate, dtype), build, keep_ptx)


def block_specs(shape, block_rows: int) -> tuple:
    """(shape, torch dtype) of an e4m3 copy of a (batch, heads, rows, d) tensor and of its descales,
    one per ``block_rows`` rows (``QuantizeBlocks``' outputs)."""
    import torch

    b, h, n, _ = shape
    return (tuple(shape), torch.float8_e4m3fn), ((b, h, -(-n // block_rows)), torch.float32)


def quantize_inputs_cute(q, k, v, tile_m: int, tile_n: int, signs=None, keep: bool = False) -> tuple:
    """(q8, k8, v8, dq, dk, dv) from 16-bit CUDA q, k, v in one launch (``QuantizeInputs``), bit for bit
    three ``quantize_fp8_blocks``; ``signs`` None: no rotation. ``keep``: per-stream scratch."""
    d = q.shape[-1]
    specs = [spec for x, rows in ((q, tile_m), (k, tile_n), (v, tile_n)) for spec in block_specs(x.shape, rows)]
    q8, dq, k8, dk, v8, dv = buffers(q, "quantize_inputs", tuple(specs), keep)
    rotate = signs is not None
    fn = compile_quantize_inputs(d, tile_m, tile_n, rotate, str(q.dtype)[6:])
    fn(q, k, v, q8, k8, v8, dq, dk, dv, signs if rotate else hadamard_signs(d, device=q.device))
    return q8, k8, v8, dq, dk, dv


def quantize_fp8_blocks_cute(x, block_rows: int, signs=None):
    import torch

    b, h, n, d = x.shape
    if d % 32 or d > 256 or x.stride(-1) != 1:
        raise ValueError(f"quantize_fp8_blocks: head dim {d} must be a multiple of 32 up to 256, rows contiguous")
    x8 = x.new_empty((b, h, n, d), dtype=torch.float8_e4m3fn)
    descale = x.new_empty((b, h, -(-n // block_rows)), dtype=torch.float32)
    rotate = signs is not None
    if not rotate:
        signs = hadamard_signs(d, device=x.device)  # not read
    fn = compile_quantize_blocks(d, block_rows, rotate, str(x.dtype)[6:])
    fn(x, x8, descale, signs)
    return x8, descale


# --------------------------------------------------------------------------------------
# K7's per-tensor quantizer as two kernels: partial amaxes, then one scale per tensor and the cast
# --------------------------------------------------------------------------------------

def quantize_fp8_torch(x):
    """(x8, descale) with one scale for all of ``x``, in K8's arithmetic (``_scales``, ``_cast``):
    scale = 448 / amax (1 when amax is 0), x8 = e4m3(x * scale) in float32, saturated; descale a
    0-d float32 tensor. The reference for ``QuantizeTensors``."""
    amax = x.detach().abs().amax().float()
    scale, descale = _scales(amax)
    return _cast(x.detach().float() * scale), descale


class QuantizeTensors:
    """Up to three (batch, heads, seqlen, d) 16-bit tensors -> e4m3, one descale each, in two
    launches whatever their number: an amax needs every element before any can be scaled, and a
    launch is the one grid-wide barrier that cannot deadlock.

    ``amax``: a grid of ``partials`` CTAs per tensor (blockIdx.y picks it) walks that tensor's rows
    block after block, each warp loading all of its rows of a block at once (lane l holds elements
    l*E .. l*E + E - 1, E = d / 32, as in ``QuantizeBlocks``), and writes one partial amax. ``cast``:
    each CTA reduces its tensor's partials (fewer than its threads) to the amax, derives the scale,
    and converts one block of rows. Rows are (batch, head, position) flattened, so any strides work.
    """

    WARPS = 8

    def __init__(self, head_dim: int, count: int):
        self.head_dim, self.count = head_dim, count
        self.elems = head_dim // 32
        self.rows_per_warp = 32 // self.elems  # 32 values a lane: 64 bytes in flight per lane
        self.block_rows = self.rows_per_block(head_dim)

    @classmethod
    def rows_per_block(cls, head_dim: int) -> int:
        return cls.WARPS * (32 // (head_dim // 32))

    @cute.jit
    def amax(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mPartial: cute.Tensor, stream):
        grid = (mPartial.shape[1], self.count, 1)
        self.amax_kernel(mA, mB, mC, mPartial).launch(grid=grid, block=[32 * self.WARPS, 1, 1], stream=stream)

    @cute.jit
    def cast(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mA8: cute.Tensor, mB8: cute.Tensor,
             mC8: cute.Tensor, mPartial: cute.Tensor, mDescale: cute.Tensor, stream):
        rows = cutlass.max(mA.shape[0] * mA.shape[1] * mA.shape[2], mB.shape[0] * mB.shape[1] * mB.shape[2])
        grid = (cute.ceil_div(rows, self.block_rows), self.count, 1)
        self.cast_kernel(mA, mB, mC, mA8, mB8, mC8, mPartial, mDescale).launch(
            grid=grid, block=[32 * self.WARPS, 1, 1], stream=stream)

    @cute.jit
    def load_block(self, mX: cute.Tensor, first: Int32, rows: Int32, warp: Int32, lane: Int32) -> cute.Tensor:
        """This lane's E values of each of its warp's rows of the block from row ``first`` (rows past
        the end load the last row again: the amax stays, and they are not stored)."""
        raw = cute.make_rmem_tensor((self.elems, self.rows_per_warp), mX.element_type)
        for j in cutlass.range_constexpr(self.rows_per_warp):  # every load first: no branch between them
            r = cutlass.min(first + warp + j * self.WARPS, rows - 1)
            pos, bh = r % mX.shape[2], r // mX.shape[2]
            cute.autovec_copy(cute.local_tile(mX[bh // mX.shape[1], bh % mX.shape[1], pos, None], (self.elems,),
                                              (lane,)), raw[None, j])
        return raw

    @cute.jit
    def block_amax(self, mX: cute.Tensor, first: Int32, warp: Int32, lane: Int32, amax: Float32) -> Float32:
        rows = mX.shape[0] * mX.shape[1] * mX.shape[2]
        raw = self.load_block(mX, first, rows, warp, lane)
        vals = cute.make_rmem_tensor((self.elems, self.rows_per_warp), Float32)
        vals.store(raw.load().to(Float32))
        for j in cutlass.range_constexpr(self.rows_per_warp):
            for i in cutlass.range_constexpr(self.elems):
                amax = cute.arch.fmax(amax, cute.arch.fmax(vals[i, j], -vals[i, j]))
        return amax

    @cute.jit
    def tensor_amax(self, mX: cute.Tensor, warp: Int32, lane: Int32) -> Float32:
        bx, _, _ = cute.arch.block_idx()
        gx, _, _ = cute.arch.grid_dim()
        blocks = cute.ceil_div(mX.shape[0] * mX.shape[1] * mX.shape[2], self.block_rows)
        amax = Float32(0.0)
        for blk in cutlass.range(bx, blocks, gx):
            amax = self.block_amax(mX, blk * self.block_rows, warp, lane, amax)
        return amax

    @cute.kernel
    def amax_kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mPartial: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, t, _ = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        sMax = cutlass.utils.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.WARPS), byte_alignment=16)
        amax = Float32(0.0)
        if t == 0:
            amax = self.tensor_amax(mA, warp, lane)
        elif t == 1:
            amax = self.tensor_amax(mB, warp, lane)
        else:
            amax = self.tensor_amax(mC, warp, lane)
        amax = cta_max(amax, sMax, self.WARPS, warp, lane)
        if tidx == 0:
            mPartial[t, bx] = amax

    @cute.jit
    def cast_block(self, mX: cute.Tensor, mX8: cute.Tensor, scale: Float32, warp: Int32, lane: Int32):
        bx, _, _ = cute.arch.block_idx()
        rows = mX.shape[0] * mX.shape[1] * mX.shape[2]
        first = bx * self.block_rows
        if first < rows:
            raw = self.load_block(mX, first, rows, warp, lane)
            y = cute.make_rmem_tensor(self.elems, Float32)
            for j in cutlass.range_constexpr(self.rows_per_warp):
                y.store(raw[None, j].load().to(Float32))
                for i in cutlass.range_constexpr(self.elems):
                    y[i] = cute.arch.fmax(cute.arch.fmin(y[i] * scale, Float32(E4M3_MAX)), Float32(-E4M3_MAX))
                x8 = cute.make_rmem_tensor(self.elems, mX8.element_type)
                x8.store(y.load().to(mX8.element_type))
                r = first + warp + j * self.WARPS
                if r < rows:
                    pos, bh = r % mX.shape[2], r // mX.shape[2]
                    cute.autovec_copy(x8, cute.local_tile(mX8[bh // mX.shape[1], bh % mX.shape[1], pos, None],
                                                          (self.elems,), (lane,)))

    @cute.kernel
    def cast_kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mA8: cute.Tensor, mB8: cute.Tensor,
                    mC8: cute.Tensor, mPartial: cute.Tensor, mDescale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, t, _ = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        sMax = cutlass.utils.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.WARPS), byte_alignment=16)
        amax = Float32(0.0)
        if tidx < mPartial.shape[1]:
            amax = mPartial[t, tidx]
        scale = e4m3_scale(cta_max(amax, sMax, self.WARPS, warp, lane))
        if bx == 0 and tidx == 0:
            mDescale[t] = Float32(1.0) / scale
        if t == 0:
            self.cast_block(mA, mA8, scale, warp, lane)
        elif t == 1:
            self.cast_block(mB, mB8, scale, warp, lane)
        else:
            self.cast_block(mC, mC8, scale, warp, lane)


@functools.cache
def compile_quantize_tensors(head_dim: int, count: int, dtype: str, keep_ptx: bool = False):
    """(amax, cast) compiled for ``count`` tensors of ``head_dim``: the first tensor with shapes of
    its own, the other two sharing theirs (q; k and v)."""
    from cutlass.cute.runtime import make_fake_tensor

    from .contract import cute_dtype, fake_stream, jit_compile

    def tensors(kind, div):
        b, h, n = (cute.sym_int() for _ in range(3))
        h2, n2 = cute.sym_int(), cute.sym_int()
        strides = lambda: tuple(cute.sym_int64(divisibility=div) for _ in range(3)) + (1,)  # noqa: E731
        return (make_fake_tensor(kind, (b, h, n, head_dim), stride=strides(), assumed_align=16),
                *(make_fake_tensor(kind, (b, h2, n2, head_dim), stride=strides(), assumed_align=16) for _ in range(2)))

    op = QuantizeTensors(head_dim, count)
    partial = make_fake_tensor(Float32, (count, cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4)
    descale = make_fake_tensor(Float32, (count,), stride=(1,), assumed_align=4)
    key = ("quantize_tensors", head_dim, count, dtype)
    amax = jit_compile(key + ("amax",), lambda: (op.amax, (*tensors(cute_dtype(dtype), 8), partial, fake_stream())),
                       keep_ptx)
    cast = jit_compile(key + ("cast",), lambda: (op.cast, (*tensors(cute_dtype(dtype), 8),
                                                           *tensors(cutlass.Float8E4M3FN, 16), partial, descale,
                                                           fake_stream())), keep_ptx)
    return amax, cast


PARTIALS = H100_SMS  # amax CTAs per tensor: one wave on an H100, and fewer than a cast CTA's threads


def partial_count(rows: int, head_dim: int) -> int:
    """Partial amaxes per tensor (``QuantizeTensors.amax``'s CTAs) for tensors of at most ``rows`` rows."""
    return max(1, min(PARTIALS, -(-rows // QuantizeTensors.rows_per_block(head_dim))))


def quantize_fp8_tensors(*xs, keep: bool = False):
    """([x8], descales) for one to three 16-bit CUDA tensors (batch, heads, seqlen, d), the second and
    third of one shape: descales float32 (len(xs),), one per tensor, each bit for bit what
    ``quantize_fp8_torch`` gives. Two launches. ``keep``: into per-stream scratch that the next call
    on the stream overwrites (``contract.scratch``), for a pre-pass whose kernel reads them at once."""
    import torch

    x0, d = xs[0], xs[0].shape[-1]
    e4m3 = torch.float8_e4m3fn
    rows = max(x.shape[0] * x.shape[1] * x.shape[2] for x in xs)
    shape = (len(xs), partial_count(rows, d))
    specs = tuple((tuple(x.shape), e4m3) for x in xs) + (((len(xs),), torch.float32),)
    if keep:  # the partials (read by the cast launch alone) in the same lookup
        *outs, descale, partial = scratch_set(x0, "quantize_tensors", specs + ((shape, torch.float32),))
    else:
        *outs, descale = buffers(x0, "quantize_tensors", specs, keep)
        partial = scratch(x0, "amax partials", shape, torch.float32)
    amax, cast = compile_quantize_tensors(d, len(xs), str(x0.dtype)[6:])
    pad = lambda ts: list(ts) + [ts[-1]] * (3 - len(ts))  # noqa: E731  (unused slots: never read)
    amax(*pad(xs), partial)
    cast(*pad(xs), *pad(outs), partial, descale)
    return outs, descale


# --------------------------------------------------------------------------------------
# Descales as the kernels read them, with a guard: one launch
# --------------------------------------------------------------------------------------

@cute.jit
def descale_rows_job(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mRows: cute.Tensor, first: Int32,
                     step: Int32):
    """``descale_rows`` on the GPU, elements ``first``, ``first + step``, ... of the rows, for a kernel
    that does it beside its own work (``k7.TransposeV.with_descales``)."""
    q_blocks, kv_blocks, cols = mQ.shape[2], mK.shape[2], mRows.shape[2]
    group = mQ.shape[1] // mK.shape[1]
    for i in cutlass.range(first, mRows.shape[0] * mRows.shape[1] * cols, step):
        col, bh = i % cols, i // cols
        batch, head = bh // mRows.shape[1], bh % mRows.shape[1]
        x = Float32(0.0)
        if col < q_blocks:
            x = mQ[batch, head, col]
        elif col < q_blocks + kv_blocks:
            x = mK[batch, head // group, col - q_blocks]
        else:
            x = mV[batch, head // group, col - q_blocks - kv_blocks]
        row = Float32(math.nan)
        if x > Float32(0.0):
            if x < Float32(math.inf):
                row = x
        mRows[batch, head, col] = row


def fake_descale_rows() -> tuple:
    """Placeholders for ``descale_rows_job``'s tensors: dq (b, h, mq), dk and dv (b, hk, mk), rows (b, h, cols)."""
    from cutlass.cute.runtime import make_fake_tensor

    b, h, hk, mq, mk, cols = (cute.sym_int() for _ in range(6))
    three = lambda heads, n: make_fake_tensor(Float32, (b, heads, n), stride=(cute.sym_int64(), cute.sym_int64(), 1),  # noqa: E731
                                              assumed_align=4)
    return three(h, mq), three(hk, mk), three(hk, mk), three(h, cols)


def descale_rows(dq, dk, dv):
    """(dq, dk, dv) float32 (batch, heads, blocks) -> one row per (batch, query head): q's, then k's
    and v's of its K/V head (head // group), as K8's kernel reads them; K7's three numbers are the
    case of one block each. A descale that is not a finite number > 0 becomes NaN there, so a bad
    one makes the rows it scales NaN rather than quietly wrong: on the GPU its value is not read by
    the host (that would stall every call). The torch definition; on a GPU ``descale_rows_job``
    does it inside K7's V^T launch (``k7.transpose_v_with_descales``)."""
    import torch

    h = dq.shape[1]
    group = h // dk.shape[1]
    rows = torch.cat([dq, dk.repeat_interleave(group, dim=1), dv.repeat_interleave(group, dim=1)], dim=-1).float()
    return torch.where((rows > 0) & (rows < math.inf), rows, torch.full_like(rows, math.nan))
