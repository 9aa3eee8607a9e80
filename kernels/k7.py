"""K7: FP8 (e4m3) attention forward on K6's kernel: both GEMMs as 64xNx32 e4m3 WGMMAs.

K6's producer, ping-pong, intra-warpgroup overlap and tile scheduler are unchanged; four things
change, all at seams K5/K6 already have (``k7_k4`` makes the same changes to K4's loop, where
they are easiest to read in isolation):

* Q, K and V arrive as e4m3 with per-tensor descales (x ~= x8 * descale). The tensor cores run
  twice as many FLOPs per cycle, and every tile is half the bytes.
* 8-bit WGMMA takes both operands K-major only, so V, contiguous along d, cannot be the PV GEMM's
  B operand as it stands: a pre-pass (``transpose_v_fp8``) stores V^T (batch, heads, d, keys),
  and its time is counted in every K7 measurement.
* The P handoff is no longer a pure re-indexing: an FP8 A fragment gives each lane 4 adjacent
  keys, the accumulator gives it pairs 8 apart. ``sm90.acc_frg_a_layout_fp8`` views the
  accumulator so each lane's 4 values fill its 4 A slots anyway, which permutes the keys inside
  every 16 (``sm90.FP8_KEY_ORDER``); the pre-pass writes V^T's keys in that same order, so P V is
  unchanged. One owner for the order: the pre-pass reads it from sm90.
* Scales: q and k's descales join the softmax scale (one FFMA per score, as before); P gets an
  offset of 2^8 before its conversion (``OnlineSoftmax(p_offset=8)``) so it is not flushed under
  e4m3's smallest values; v's descale multiplies O once, before O is narrowed to 16 bits (bf16 for e4m3 inputs).

Tiles: 8-bit tiles take half the SMEM, but registers, not SMEM, bind (ptxas, docs/k7.md): K6's
warpgroups and stages, with 128-key tiles at every head dim (tile_n a multiple of 32, the 8-bit
WGMMA's K step), no TMA store (it stages O in Q's 8-bit buffer).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from . import fp8_quant, k4, k5, k6, sm90, tma_pipeline
from .contract import (
    Capabilities,
    CompiledAttention,
    Config,
    FakeShapes,
    FusedLaunch,
    Problem,
    UnsupportedProblem,
    compiled_ptx,
    configure,
    cute_dtype,
    fake_stream,
    jit_compile,
    buffer,
    buffers,
)

HEAD_DIMS = (64, 128, 256)
FP8 = cutlass.Float8E4M3FN
E4M3_MAX = 448.0
P_OFFSET = 8.0  # P in [0, 2^8]: e4m3 keeps 3 mantissa bits down to 2^-6, and P's small values matter
# K6's shape where it measured best in e4m3: at d=128 wider key tiles (FA3's FP8 choice), a third
# KV stage and K6's overlap each lost (fp8-tune-h100-*; the numbers: docs/k7.md); d=256 as K6.
DEFAULT_CONFIG = {
    64: dict(num_wg=3, tile_n=128, kv_stages=2, q_stages=2, pingpong=True, overlap=False),
    128: dict(num_wg=2, tile_n=128, kv_stages=2, q_stages=2, pingpong=True, overlap=False),
    256: dict(num_wg=2, tile_n=128, kv_stages=2, q_stages=1, pingpong=False, overlap=True),
}
DTYPES = ("bfloat16", "float16", "float8_e4m3fn")  # 16-bit: quantized per tensor by the pre-pass
CAPS = Capabilities(head_dims=HEAD_DIMS, dtypes=DTYPES, gqa=True, unequal_lengths=True)


class PerTensorScales:
    """K7's four hooks, for K6's kernel and K4's alike: the scores are of q8 . k8, so q's and k's
    descales join the softmax scale; P is offset into e4m3's range and narrowed to it; O comes out
    in v's units until v's descale multiplies it. ``mAux`` is the (3,) float32 descales."""

    def score_scale(self, scale_log2: Float32, mAux: cute.Tensor) -> Float32:
        return scale_log2 * mAux[0] * mAux[1]

    def tile_softmax(self, num_rows: int, scale_log2: Float32, *tile) -> sm90.OnlineSoftmax:
        return sm90.OnlineSoftmax(num_rows, scale_log2, P_OFFSET)

    def p_to_operand(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        """K4's register handoff, in FP8: the permuted view, narrowed to e4m3."""
        sm90.convert_to_fp8(acc_S, tOrP)

    def finish_o(self, acc_O: cute.Tensor, mAux: cute.Tensor):
        acc_O.store(acc_O.load() * mAux[2])


class K7FMHA(PerTensorScales, k6.K6FMHA):
    def __init__(self, head_dim: int, out_dtype, causal: bool, **kw):
        super().__init__(head_dim, FP8, causal, **kw)  # O's dtype is mO's (out_dtype: the compile's key)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mDescale: cute.Tensor, softmax_scale: Float32, mTileCounter: cute.Tensor, stream):
        # V^T (batch, heads, d, keys) -> (d, keys, heads, batch): K6's V view with keys contiguous,
        # which its launcher reads as K-major, the only mode 8-bit WGMMA takes.
        self.launch(mQ, mK, vt_view(mVt), mO, mLSE, mDescale, softmax_scale, mTileCounter, stream)


def vt_view(mVt: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(mVt.iterator, cute.select(mVt.layout, mode=[2, 3, 1, 0]))


# ---- k7_k4: the same seams on K4's loop (one CTA per tile, loads and math on the same warps) ----

K4_CONFIG = {  # K4's tiles, tile_n a multiple of 32; one more stage than K4 (8-bit tiles)
    64: dict(num_wg=3, tile_n=128, kv_stages=4, refill_lag=2),
    128: dict(num_wg=2, tile_n=128, kv_stages=3, refill_lag=1),
    256: dict(num_wg=2, tile_n=64, kv_stages=3, refill_lag=1),
}


def k4_smem_bytes(head_dim: int, num_wg: int, tile_n: int, kv_stages: int, **_) -> int:
    return tma_pipeline.smem_bytes(sm90.WGMMA_M * num_wg, tile_n, head_dim, 1, kv_stages)


K4_CAPS = tma_pipeline.smem_capabilities(HEAD_DIMS, lambda d: k4_smem_bytes(d, **K4_CONFIG[d]), "K4_CONFIG",
                                         dtypes=DTYPES)


class K7OnK4FMHA(PerTensorScales, k4.K4FMHA):
    def __init__(self, head_dim: int, out_dtype, causal: bool, num_wg: int, tile_n: int, kv_stages: int,
                 refill_lag: int):
        super().__init__(head_dim, FP8, causal, num_wg, tile_n, kv_stages, refill_lag)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mDescale: cute.Tensor, softmax_scale: Float32, stream):
        self.launch(mQ, mK, vt_view(mVt), mO, mLSE, mDescale, softmax_scale, stream)


# --------------------------------------------------------------------------------------
# Host: the FP8 pre-pass, compile, launch
# --------------------------------------------------------------------------------------

def quantize_fp8(x):
    """(x8, descale): per-tensor e4m3 with x ~= x8.float() * descale, descale a 0-d float32 tensor
    on x's device (no host sync). scale = 448 / amax, x * scale in float32, saturated to +-448
    (``fp8_quant.quantize_fp8_torch``). A 16-bit CUDA tensor takes the two launches of
    ``fp8_quant.QuantizeTensors``; anything else the same arithmetic in torch."""
    import torch

    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        (x8,), descale = fp8_quant.quantize_fp8_tensors(x)
        return x8, descale[0]
    return fp8_quant.quantize_fp8_torch(x)


_PERMUTATIONS: dict = {}


def fp8_key_permutation(seqlen: int, device=None):
    """Index into keys (padded to a multiple of 16) that puts every 16 in ``sm90.FP8_KEY_ORDER``.
    Kept per length and device: building it copies from the host, which CUDA-graph capture forbids
    (the warm-up call before a capture makes it)."""
    import torch

    key = (-(-seqlen // 16), str(device))
    if key not in _PERMUTATIONS:
        order = torch.tensor(sm90.FP8_KEY_ORDER, device=device)
        _PERMUTATIONS[key] = (torch.arange(key[0], device=device)[:, None] * 16 + order[None, :]).reshape(-1)
    return _PERMUTATIONS[key]


def transpose_v_fp8(v8, keep: bool = False):
    """(batch, heads, seqlen, d) e4m3 -> V^T (batch, heads, d, seqlen padded to 16) with the keys
    of every 16 in the FP8 P order; pad keys are 0 (P is 0 there, and 0 * NaN would not be). On a
    GPU by ``TransposeV`` (below), into a new tensor, or with ``keep`` into scratch that the next
    call on the stream overwrites (``contract.scratch``); elsewhere by the same arithmetic in torch."""
    if not v8.is_cuda:
        return transpose_v_fp8_torch(v8)
    b, h, n, d = v8.shape
    shape = (b, h, d, n + (-n % 16))
    vt = buffer(v8, "vt", shape, v8.dtype, keep)
    compile_transpose_v()(v8, vt)
    return vt


def transpose_v_with_descales(v8, dq, dk, dv, keep: bool = False, per_tensor: bool = False) -> tuple:
    """(V^T, descale rows): ``transpose_v_fp8`` and ``fp8_quant.descale_rows`` in one launch (CUDA).
    dq, dk, dv: K8's float32 (batch, heads, blocks), or with ``per_tensor`` K7's three one-element
    float32 tensors of any shape, read as they are, and rows (3,) (a view costs a call 1 us)."""
    vt, rows = buffers(v8, "vt+rows", v_pass_specs(v8.shape, rows_shape(dq, dk, per_tensor)), keep)
    ranks = (dq.dim(), dk.dim(), dv.dim()) if per_tensor else None
    compile_transpose_v(with_descales=True, ranks=ranks)(v8, vt, dq, dk, dv, rows)
    return vt, rows


def v_pass_specs(v_shape, rows_shape) -> tuple:
    """(shape, dtype) of V^T and of the descale rows ``TransposeV.with_descales`` writes: (3,) for
    K7's three numbers, (batch, heads, q blocks + 2 * kv blocks) for K8's tiles."""
    import torch

    b, h, n, d = v_shape
    return ((b, h, d, n + (-n % 16)), torch.float8_e4m3fn), (tuple(rows_shape), torch.float32)


def rows_shape(dq, dk, per_tensor: bool) -> tuple:
    return (3,) if per_tensor else (*dq.shape[:2], dq.shape[2] + 2 * dk.shape[2])


def transpose_v_fp8_torch(v8):
    """``transpose_v_fp8`` as torch ops: the reference for ``TransposeV``."""
    import torch

    b, h, n, d = v8.shape
    pad = -n % 16
    v = v8.view(torch.uint8)  # index and pad the bytes: no float8 kernels needed
    if pad:
        v = torch.cat([v, v.new_zeros(b, h, pad, d)], dim=2)
    # One gather writes the transposed, permuted copy (index_select's output is contiguous): on an
    # H100 173 us at 16k tokens x 2048, against 334 for a row gather and then a transposing copy.
    return v.transpose(2, 3).index_select(3, fp8_key_permutation(n, v.device)).view(torch.float8_e4m3fn)


def prepare_fp8(q, k, v, keep: bool = False):
    """The pre-pass every K7 launch times: (q8, k8, vt8, descales[3]) from 16-bit q, k, v. On a GPU
    three launches: the two of ``QuantizeTensors`` for all three tensors, then ``TransposeV``; with
    ``keep`` into per-stream scratch (``transpose_v_fp8``)."""
    import torch

    if q.is_cuda:
        (q8, k8, v8), descales = fp8_quant.quantize_fp8_tensors(q, k, v, keep=keep)
        return q8, k8, transpose_v_fp8(v8, keep), descales
    (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in (q, k, v))
    return q8, k8, transpose_v_fp8(v8), torch.stack([dq, dk, dv])


def fake_args(out_dtype, head_dim: int, kv_heads: bool = True) -> tuple:
    """(q8, k8, vt8, o, lse, descale, softmax_scale, stream) placeholders; ``kv_heads``: K and V^T
    with heads and a length of their own (GQA, seqlen_k)."""
    from cutlass.cute.runtime import make_fake_tensor

    f = FakeShapes()
    q = f.tensor(FP8, (head_dim,), align_elems=16)
    k = f.tensor(FP8, (head_dim,), align_elems=16, kv=kv_heads)
    vt = make_fake_tensor(FP8, (f.batch, f.nheads_kv if kv_heads else f.nheads, head_dim, cute.sym_int()),
                          stride=tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,), assumed_align=16)
    descale = make_fake_tensor(Float32, (3,), stride=(1,), assumed_align=4)
    return q, k, vt, f.tensor(out_dtype, (head_dim,)), f.tensor(Float32, ()), descale, Float32(1.0), fake_stream()


def fake_descales(ranks: tuple | None) -> tuple:
    """(dq, dk, dv, rows) placeholders for ``TransposeV.with_descales``: K7's one-element tensors of
    these ranks and rows (3,), or with ``ranks`` None K8's (``fp8_quant.fake_descale_rows``)."""
    from cutlass.cute.runtime import make_fake_tensor

    if ranks is None:
        return fp8_quant.fake_descale_rows()
    ones = (make_fake_tensor(Float32, (1,) * r, stride=tuple(cute.sym_int64() for _ in range(r)), assumed_align=4)
            for r in ranks)
    return (*ones, make_fake_tensor(Float32, (3,), stride=(1,), assumed_align=4))


def config(p: Problem, overrides: dict = None, name: str = "K7") -> Config:
    """DEFAULT_CONFIG with K6's schedule (k5.schedule_config), then the overrides."""
    cfg = configure(dict(DEFAULT_CONFIG[p.head_dim], **k5.schedule_config(p), tma_store=False), overrides)
    check_tile_n(cfg, name)
    if cfg["tma_store"]:
        raise UnsupportedProblem(f"{name} config {cfg}: tma_store stages O in Q's buffer, which is 8-bit here")
    if cfg.get("q_in_regs"):
        raise UnsupportedProblem(f"{name} config {cfg}: q_in_regs loads Q with K6's 16-bit ldmatrix, not checked for e4m3")
    if cfg.get("cluster", 1) != 1:
        raise UnsupportedProblem(f"{name} config {cfg}: cluster (K/V multicast) is checked for K6's 16-bit tiles "
                                 "only; not for the FP8 ones")
    if cfg.get("split_tail"):  # its merge would also need the pieces' own V descales (K8's are per tile)
        raise UnsupportedProblem(f"{name} config {cfg}: split_tail is checked for K6's 16-bit tiles only; not for "
                                 "the FP8 ones")
    return cfg


def check_tile_n(cfg: dict, name: str) -> None:
    if cfg["tile_n"] % 32:
        raise UnsupportedProblem(f"{name} config {cfg}: tile_n must be a multiple of 32 (the 8-bit WGMMA's K step)")


def compile_kernel(p: Problem, *, keep_ptx: bool = False, structure: str = "k6", **overrides) -> CompiledAttention:
    """K7 takes e4m3 q, k, v with descales (``attention("k7", q8, k8, v8, descale_q=...)``), or
    16-bit ones, which the timed pre-pass quantizes per tensor; O comes back in 16 bits."""
    if structure == "k4":
        return compile_on_k4(p, keep_ptx, overrides)
    CAPS.check(p)
    return k5.build("k7", K7FMHA, p, config(p, overrides), keep_ptx, fake_args=fake_args, dtype=p.out_dtype)


def compile_on_k4(p: Problem, keep_ptx: bool, overrides: dict) -> CompiledAttention:
    K4_CAPS.check(p)
    cfg = k4.config(p, overrides, K4_CONFIG)  # from K7_K4's tiles (one more stage), not K4's
    k4.check_config(cfg)
    check_tile_n(cfg, "K7_K4")
    out_dt = cute_dtype(p.out_dtype)
    key = ("k7_k4", p.head_dim, p.out_dtype, p.causal, tuple(sorted(cfg.items())))
    fn = jit_compile(key, lambda: (K7OnK4FMHA(p.head_dim, out_dt, p.causal, **cfg),
                                   fake_args(out_dt, p.head_dim, kv_heads=False)), keep_ptx)
    return CompiledAttention("k7_k4", p, fn, {}, compiled_ptx(fn) if keep_ptx else None,
                             dict(cfg, smem_bytes=k4_smem_bytes(p.head_dim, **cfg)))


def capabilities(structure: str = "k6") -> Capabilities:
    return K4_CAPS if structure == "k4" else CAPS


def run_kernel(compiled: CompiledAttention, q, k, v, out, lse, softmax_scale=None, descale=None,
               descales=None) -> None:
    """e4m3 q, k, v with either ``descale``, the kernel's (3,) float32 descales, or ``descales``, the
    caller's three as one-element float32 tensors, which the V^T pass checks as it copies them
    (``transpose_v_with_descales``: one that is not a finite number > 0 turns to NaN, and O with
    it); 16-bit q, k, v: the whole pre-pass. Both of the latter in one host call (``prepare_run``);
    intermediates are per-stream scratch."""
    import torch

    scale = compiled.problem.scale if softmax_scale is None else softmax_scale
    if descale is not None:
        compiled.launch(q, k, transpose_v_fp8(v, keep=True), out, lse, descale, scale)
    elif compiled.compile_entry is not None:
        prepare_run(compiled, descales, q.device)(q, k, v, out, lse, scale, descales or ())
    elif q.dtype != torch.float8_e4m3fn:  # k7_k4: a launch each
        q8, k8, vt8, descale = prepare_fp8(q, k, v, keep=True)
        compiled.launch(q8, k8, vt8, out, lse, descale, scale)
    else:
        vt, rows = transpose_v_with_descales(v, *descales, keep=True, per_tensor=True)
        compiled.launch(q, k, vt, out, lse, rows, scale)


# --------------------------------------------------------------------------------------
# One host call: the pre-pass kernels, then the attention kernel
# --------------------------------------------------------------------------------------

class VPassThenKernel:
    """e4m3 V as the caller has it: the V^T pass, which also writes the descale rows (K7's three
    numbers or K8's tile descales), then the kernel reading both."""

    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mVt: cute.Tensor, mRows: cute.Tensor,
                 softmax_scale: Float32, mTileCounter: cute.Tensor, stream):
        TransposeV().with_descales(mV, mVt, mDq, mDk, mDv, mRows, stream)
        self.kernel.launch(mQ, mK, vt_view(mVt), mO, mLSE, mRows, softmax_scale, mTileCounter, stream)


class QuantizeThenKernel:
    """16-bit q, k, v: K7's whole pre-pass (``fp8_quant.QuantizeTensors``' two kernels for all three,
    then the V^T pass), then the kernel."""

    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mQ8: cute.Tensor, mK8: cute.Tensor, mV8: cute.Tensor, mDescale: cute.Tensor, mPartial: cute.Tensor,
                 mVt: cute.Tensor, softmax_scale: Float32, mTileCounter: cute.Tensor, stream):
        quantize = fp8_quant.QuantizeTensors(self.kernel.head_dim, 3)
        quantize.amax(mQ, mK, mV, mPartial, stream)
        quantize.cast(mQ, mK, mV, mQ8, mK8, mV8, mPartial, mDescale, stream)
        TransposeV()(mV8, mVt, stream)
        self.kernel.launch(mQ8, mK8, vt_view(mVt), mO, mLSE, mDescale, softmax_scale, mTileCounter, stream)


def prepare_run(compiled: CompiledAttention, descales, device, per_tensor: bool = True):
    """``run_kernel`` for one call signature (``harness.api``'s prepared calls), as one host call
    (``contract.FusedLaunch``) on ``device``: e4m3 inputs with the caller's descale tensors
    (``descales``; K8's per block without ``per_tensor``) take ``VPassThenKernel``, 16-bit ones
    ``QuantizeThenKernel``. None where ``run_kernel`` itself is the path (k7_k4)."""
    import torch

    if compiled.compile_entry is None:
        return None
    p = compiled.problem
    v_shape = (p.batch, p.kv_heads, p.kv_len, p.head_dim)
    if p.dtype == "float8_e4m3fn":
        ranks = tuple(x.dim() for x in descales) if per_tensor else None
        return FusedLaunch(compiled, ("v pass", ranks), VPassThenKernel, lambda dt, d: v_pass_args(dt, d, ranks),
                           v_pass_specs(v_shape, rows_shape(*descales[:2], per_tensor)))
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    rows = max(p.batch * p.nheads * p.seqlen, p.batch * p.kv_heads * p.kv_len)
    partials = fp8_quant.partial_count(rows, p.head_dim)
    specs = (((p.batch, p.nheads, p.seqlen, p.head_dim), e4m3), (v_shape, e4m3), (v_shape, e4m3), ((3,), f32),
             ((3, partials), f32), v_pass_specs(v_shape, (3,))[0])
    return FusedLaunch(compiled, ("quantize", p.dtype), QuantizeThenKernel,
                       lambda dt, d: quantize_args(dt, d, cute_dtype(p.dtype)), specs)


def v_pass_args(out_dtype, head_dim: int, ranks: tuple | None) -> tuple:
    """``VPassThenKernel``'s placeholders before the tile counter."""
    q, k, vt, o, lse, _, scale, _ = fake_args(out_dtype, head_dim)
    v = FakeShapes().tensor(FP8, (head_dim,), align_elems=16, kv=True)
    *descales, rows = fake_descales(ranks)
    return (q, k, v, o, lse, *descales, vt, rows, scale)


def quantize_args(out_dtype, head_dim: int, in_dtype) -> tuple:
    """``QuantizeThenKernel``'s placeholders before the tile counter (16-bit q, k, v of ``in_dtype``)."""
    from cutlass.cute.runtime import make_fake_tensor

    q8, k8, vt, o, lse, descale, scale, _ = fake_args(out_dtype, head_dim)
    f = FakeShapes()
    q, k, v = (f.tensor(in_dtype, (head_dim,), kv=kv) for kv in (False, True, True))
    v8 = FakeShapes().tensor(FP8, (head_dim,), align_elems=16, kv=True)
    partial = make_fake_tensor(Float32, (3, cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4)
    return (q, k, v, o, lse, q8, k8, v8, descale, partial, vt, scale)


# --------------------------------------------------------------------------------------
# The V^T pass as a kernel: one read and one write of V, in 128-key x 64-byte tiles through SMEM
# --------------------------------------------------------------------------------------

class TransposeV:
    """(batch, heads, keys, d) e4m3 -> (batch, heads, d, keys padded to 16), the keys of every
    16 in ``sm90.FP8_KEY_ORDER``, pad keys 0. A CTA moves a 128-key x 64-byte tile: each thread
    loads 16 contiguous bytes of two key rows into SMEM, then gathers 16 permuted keys of one d
    column from SMEM, twice, and stores them as 16 contiguous bytes: both GMEM sides move in 16-byte
    pieces, two in flight per thread (one per thread ran at 2.0 TB/s on an H100).

    ``with_descales`` does the same and, in the same launch, writes the descales as the attention
    kernel reads them (``fp8_quant.descale_rows_job``): a launch costs the caller as much host time
    as the small kernel itself takes."""

    KEYS, BYTES = 128, 64
    THREADS = 256
    ROWS = THREADS // 4  # key rows (or d columns) one pass of the CTA covers, 4 threads x 16 bytes each

    @cute.jit
    def __call__(self, mV: cute.Tensor, mVt: cute.Tensor, stream):
        self.kernel(mV, mVt).launch(grid=self.grid(mV, mVt), block=[self.THREADS, 1, 1], stream=stream)

    @cute.jit
    def with_descales(self, mV: cute.Tensor, mVt: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor,
                      mRows: cute.Tensor, stream):
        if cutlass.const_expr(cute.rank(mRows) == 1):  # K7's three numbers: K8's rows of one block each
            mDq, mDk, mDv = (cute.make_tensor(x.iterator, cute.make_layout((1, 1, 1))) for x in (mDq, mDk, mDv))
            mRows = cute.make_tensor(mRows.iterator, cute.make_layout((1, 1, 3)))
        self.kernel_with_descales(mV, mVt, mDq, mDk, mDv, mRows).launch(grid=self.grid(mV, mVt),
                                                                         block=[self.THREADS, 1, 1], stream=stream)

    @cute.jit
    def grid(self, mV: cute.Tensor, mVt: cute.Tensor):
        return (cute.ceil_div(mVt.shape[3], self.KEYS), cute.ceil_div(mV.shape[3], self.BYTES),
                mV.shape[0] * mV.shape[1])

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mVt: cute.Tensor):
        self.transpose_tile(mV, mVt)

    @cute.kernel
    def kernel_with_descales(self, mV: cute.Tensor, mVt: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor,
                             mDv: cute.Tensor, mRows: cute.Tensor):
        self.transpose_tile(mV, mVt)
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        gx, gy, gz = cute.arch.grid_dim()
        cta = bx + gx * (by + gy * bz)
        fp8_quant.descale_rows_job(mDq, mDk, mDv, mRows, cta * self.THREADS + tidx, gx * gy * gz * self.THREADS)

    @cute.jit
    def transpose_tile(self, mV: cute.Tensor, mVt: cute.Tensor):
        keys, nbytes, rows = self.KEYS, self.BYTES, self.ROWS
        tidx, _, _ = cute.arch.thread_idx()
        k_tile, d_tile, bh = cute.arch.block_idx()
        batch, head = bh // mV.shape[1], bh % mV.shape[1]
        smem = cutlass.utils.SmemAllocator()
        sV = smem.allocate_tensor(mV.element_type, cute.make_layout((keys, nbytes), stride=(nbytes, 1)),
                                  byte_alignment=16)
        gV = cute.local_tile(mV[batch, head, None, None], (keys, nbytes), (k_tile, d_tile))  # (keys, d)
        gVt = cute.local_tile(mVt[batch, head, None, None], (nbytes, keys), (d_tile, k_tile))  # (d, keys)
        row, chunk = tidx // 4, tidx % 4  # a key row (load) or a d column (store); which 16 bytes
        for i in cutlass.range_constexpr(keys // rows):
            r = row + i * rows
            dst = cute.local_tile(sV[r, None], (16,), (chunk,))
            if k_tile * keys + r < mV.shape[2]:
                cute.autovec_copy(cute.local_tile(gV[r, None], (16,), (chunk,)), dst)
            else:
                dst.fill(0)  # pad keys: P is 0 there, and 0 * NaN would not be
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(keys // 64):
            c = chunk + 4 * i  # 16-key group within the tile
            if k_tile * keys + c * 16 < mVt.shape[3]:
                packed = cute.make_rmem_tensor(16, mV.element_type)
                for p in cutlass.range_constexpr(16):
                    packed[p] = sV[c * 16 + sm90.FP8_KEY_ORDER[p], row]
                cute.autovec_copy(packed, cute.local_tile(gVt[row, None], (16,), (c,)))


@functools.cache
def compile_transpose_v(keep_ptx: bool = False, with_descales: bool = False, ranks: tuple | None = None):
    """``TransposeV`` compiled (kept here: the JIT cache's own lookup costs a call microseconds);
    ``ranks``: K7's three one-element descales, of these ranks, and rows (3,)."""
    def build():
        from cutlass.cute.runtime import make_fake_tensor

        b, h, n, n_pad, d = (cute.sym_int() for _ in range(5))
        v = make_fake_tensor(FP8, (b, h, n, d), stride=tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,),
                             assumed_align=16)
        vt = make_fake_tensor(FP8, (b, h, d, n_pad), stride=tuple(cute.sym_int64(divisibility=16) for _ in range(3))
                              + (1,), assumed_align=16)
        if not with_descales:
            return TransposeV(), (v, vt, fake_stream())
        return TransposeV().with_descales, (v, vt, *fake_descales(ranks), fake_stream())

    return jit_compile(("k7_transpose_v", with_descales, ranks), build, keep_ptx)
