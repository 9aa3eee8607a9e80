"""K8: FP8 with block quantization and incoherent processing (FA3's two accuracy fixes).

K7's kernel, with two changes before and one inside:

* Block scales. K7 has one descale per tensor, so one outlier coarsens every value of the
  tensor. K8 quantizes each Q tile (tile_m rows), K tile and V tile (tile_n keys) with its own
  scale (``fp8_quant.quantize_fp8_blocks``): the blocks are the kernel's tiles, so every scale
  applies to a whole tile and costs no per-element work. Inside the loop, one seam of K5's
  (``tile_softmax``): each query tile's softmax is a ``sm90.BlockScaledSoftmax``, which folds the
  Q tile's descale into its scale and tile j's k descale into each step, keeps the row max in
  scaled units, and carries O in the units of the current V tile's descale (the ratio to the
  previous one joins the per-row rescale every tile already does).
* Incoherent processing. Q and K are multiplied by M = diag(s) H / sqrt(d) (a random sign flip and
  a normalized Hadamard matrix) before they are quantized: M is orthogonal, so Q K^T is unchanged,
  and an outlier coordinate is spread over all d coordinates, which lowers the amax that sets its
  block's scale. V and O are untouched.

The pre-pass (rotation and quantization of Q and K, quantization and transposition of V) is
three launches of the CuTe kernel ``fp8_quant.QuantizeBlocks`` and K7's ``TransposeV`` on a GPU
(the torch functions of ``fp8_quant`` elsewhere, bit for bit the same), counted in every K8 timing.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

from . import fp8_quant, k5, k7, sm90
from .contract import Capabilities, CompiledAttention, FakeShapes, FusedLaunch, Problem, cute_dtype

# 16-bit inputs, which K8 quantizes itself, or e4m3 ones quantized as it would (``quantize_inputs``)
# with their per-block descales. GQA and keys outnumbering queries as in K7: K and V keep their own
# heads and length, and each query head's descale row carries its K/V head's tile descales.
CAPS = Capabilities(head_dims=k7.HEAD_DIMS, dtypes=k7.DTYPES, gqa=True, unequal_lengths=True)
DEFAULT_CONFIG = k7.DEFAULT_CONFIG
HADAMARD_SEED = 0  # the sign vector s; any fixed choice works, Q and K must share it


def block_sizes(head_dim: int, cfg: dict | None = None) -> tuple:
    """(rows per Q block, keys per K/V block): the compiled tiles, tile_m = 64 * num_wg and tile_n."""
    cfg = cfg or DEFAULT_CONFIG[head_dim]
    return sm90.WGMMA_M * cfg["num_wg"], cfg["tile_n"]


class K8FMHA(k7.K7FMHA):
    """``mAux`` holds rows of tile descales, not K7's three numbers: the softmax applies them, so
    the scale and O are left as they are."""

    score_scale = k5.K5FMHA.score_scale  # K4's own: the scale as it is
    finish_o = k5.K5FMHA.finish_o  # K4's own: O as it is

    def tile_softmax(self, num_rows: int, scale_log2: Float32, mAux: cute.Tensor, m_block: Int32, head: Int32,
                     batch: Int32, seqlen: Int32, n_tiles: Int32, seqlen_k: Int32) -> sm90.OnlineSoftmax:
        # mAux[b, h]: q's descale per Q tile, then k's and v's per KV tile of its K/V head.
        row = mAux[batch, head, None]
        m_tiles, kv_tiles = cute.ceil_div(seqlen, self.tile_m), cute.ceil_div(seqlen_k, self.tile_n)
        k_d = cute.make_tensor(row.iterator + m_tiles, cute.make_layout(kv_tiles))
        v_d = cute.make_tensor(row.iterator + m_tiles + kv_tiles, cute.make_layout(kv_tiles))
        return sm90.BlockScaledSoftmax(num_rows, scale_log2 * row[m_block], k7.P_OFFSET, k_d, v_d, n_tiles - 1)


def quantize_inputs(q, k, v, tile_m: int, tile_n: int, rotate: bool = True, keep: bool = False) -> tuple:
    """(q8, k8, v8, dq, dk, dv): q and k rotated (with ``rotate``) and quantized per tile_m / tile_n
    rows, v per tile_n keys in its own layout; d* float32 (batch, heads, blocks). What an FP8
    caller passes to ``attention("k8", q8, k8, v8, descale_q=dq, ...)``. 16-bit CUDA tensors take
    one launch (``fp8_quant.QuantizeInputs``; ``keep``: into per-stream scratch), others the torch
    arithmetic it reproduces."""
    import torch

    signs = fp8_quant.hadamard_signs(q.shape[-1], HADAMARD_SEED, q.device) if rotate else None
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype:
        return fp8_quant.quantize_inputs_cute(q, k, v, tile_m, tile_n, signs, keep)
    q8, dq = fp8_quant.quantize_fp8_blocks(q, tile_m, signs)
    k8, dk = fp8_quant.quantize_fp8_blocks(k, tile_n, signs)
    v8, dv = fp8_quant.quantize_fp8_blocks(v, tile_n)
    return q8, k8, v8, dq, dk, dv


def prepare_fp8_blocks(q, k, v, tile_m: int, tile_n: int, rotate: bool = True, keep: bool = False):
    """The pre-pass of every K8 launch from 16-bit q, k, v: (q8, k8, vt8, descale rows). On a GPU two
    launches: the three quantizers in one (``fp8_quant.QuantizeInputs``), then V^T and the rows in
    one (``k7.transpose_v_with_descales``); ``keep``: into per-stream scratch (``contract.scratch``)."""
    q8, k8, v8, dq, dk, dv = quantize_inputs(q, k, v, tile_m, tile_n, rotate, keep)
    if v8.is_cuda:
        return (q8, k8, *k7.transpose_v_with_descales(v8, dq, dk, dv, keep))
    return q8, k8, k7.transpose_v_fp8(v8), fp8_quant.descale_rows(dq, dk, dv)


def fake_args(out_dtype, head_dim: int) -> tuple:
    from cutlass.cute.runtime import make_fake_tensor

    q, k, vt, o, lse, _, scale, stream = k7.fake_args(out_dtype, head_dim)
    f = FakeShapes()
    descale = make_fake_tensor(Float32, (f.batch, f.nheads, cute.sym_int()),
                               stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    return q, k, vt, o, lse, descale, scale, stream


def compile_kernel(p: Problem, *, keep_ptx: bool = False, rotate: bool = True, **overrides) -> CompiledAttention:
    """``rotate=False`` is block quantization alone (the accuracy ablation)."""
    CAPS.check(p)
    cfg = k7.config(p, overrides, "K8")
    compiled = k5.build("k8", K8FMHA, p, cfg, keep_ptx, fake_args=fake_args, dtype=p.out_dtype)
    # The quantizer's blocks must be the compiled tiles: run_kernel reads them from here.
    compiled.info.update(rotate=rotate, tile_m=block_sizes(p.head_dim, cfg)[0])
    return compiled


def run_kernel(compiled: CompiledAttention, q, k, v, out, lse, softmax_scale=None, descale=None,
               descales=None) -> None:
    """16-bit q, k, v: the whole pre-pass. e4m3 ones (``quantize_inputs``): either ``descale``, their
    ``fp8_quant.descale_rows``, or ``descales``, the caller's (dq, dk, dv), made into those rows in
    the V^T pass; only V^T is made here. Both of the latter in one host call (``prepare_run``);
    intermediates are per-stream scratch."""
    scale = compiled.problem.scale if softmax_scale is None else softmax_scale
    if descale is not None:
        compiled.launch(q, k, k7.transpose_v_fp8(v), out, lse, descale, scale)
    else:
        prepare_run(compiled, descales, q.device)(q, k, v, out, lse, scale, descales or ())


class QuantizeBlocksThenKernel:
    """16-bit q, k, v: K8's whole pre-pass (``fp8_quant.QuantizeInputs``, then the V^T pass with the
    descale rows), then the kernel."""

    def __init__(self, kernel, quantize: fp8_quant.QuantizeInputs):
        self.kernel, self.quantize = kernel, quantize

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSigns: cute.Tensor, mQ8: cute.Tensor, mK8: cute.Tensor, mV8: cute.Tensor, mDq: cute.Tensor,
                 mDk: cute.Tensor, mDv: cute.Tensor, mVt: cute.Tensor, mRows: cute.Tensor, softmax_scale: Float32,
                 mTileCounter: cute.Tensor, stream):
        self.quantize(mQ, mK, mV, mQ8, mK8, mV8, mDq, mDk, mDv, mSigns, stream)
        k7.TransposeV().with_descales(mV8, mVt, mDq, mDk, mDv, mRows, stream)
        self.kernel.launch(mQ8, mK8, k7.vt_view(mVt), mO, mLSE, mRows, softmax_scale, mTileCounter, stream)


def prepare_run(compiled: CompiledAttention, descales, device):
    """``k7.prepare_run`` with K8's descales, one per block; 16-bit inputs take
    ``QuantizeBlocksThenKernel`` (its sign vector made on ``device``)."""
    p, info = compiled.problem, compiled.info
    if p.dtype == "float8_e4m3fn":
        return k7.prepare_run(compiled, descales, device, per_tensor=False)
    tile_m, tile_n, rotate = info["tile_m"], info["tile_n"], info["rotate"]
    q_shape, kv_shape = (p.batch, p.nheads, p.seqlen, p.head_dim), (p.batch, p.kv_heads, p.kv_len, p.head_dim)
    (q8, dq), (k8, dk) = fp8_quant.block_specs(q_shape, tile_m), fp8_quant.block_specs(kv_shape, tile_n)
    specs = (q8, k8, k8, dq, dk, dk, *k7.v_pass_specs(kv_shape, (p.batch, p.nheads, dq[0][2] + 2 * dk[0][2])))
    signs = fp8_quant.hadamard_signs(p.head_dim, HADAMARD_SEED, device)  # unread without rotate
    quantize = fp8_quant.QuantizeInputs(p.head_dim, tile_m, tile_n, rotate)
    return FusedLaunch(compiled, ("quantize", p.dtype, rotate), lambda kernel: QuantizeBlocksThenKernel(kernel, quantize),
                       lambda dt, d: quantize_args(dt, d, cute_dtype(p.dtype)), specs, constants=(signs,))


def quantize_args(out_dtype, head_dim: int, in_dtype) -> tuple:
    """``QuantizeBlocksThenKernel``'s placeholders before the tile counter."""
    from cutlass.cute.runtime import make_fake_tensor

    q8, k8, vt, o, lse, rows, scale, _ = fake_args(out_dtype, head_dim)
    f, g = FakeShapes(), FakeShapes()
    q, k, v = (f.tensor(in_dtype, (head_dim,), kv=kv) for kv in (False, True, True))
    v8 = g.tensor(k7.FP8, (head_dim,), align_elems=16, kv=True)
    dq, dk, dv, _ = fp8_quant.fake_descale_rows()
    signs = make_fake_tensor(Float32, (head_dim,), stride=(1,), assumed_align=16)
    return (q, k, v, o, lse, signs, q8, k8, v8, dq, dk, dv, vt, rows, scale)
