"""K1: naive materialized attention, the "before" picture.

Three launches with the full score matrix S = Q K^T * scale in global memory between them:

1. ``K1Score``   one thread per S[i, j]: a d-long FP32 dot product read straight from GMEM;
                 causal entries above the diagonal are written as -inf.
2. ``K1Softmax`` one thread per row: three passes over the row (max, sum of exponentials,
                 normalize), writing P over S in place, plus the row's log-sum-exp.
3. ``K1Output``  one thread per O[i, c]: P[i, :] . V[:, c] in FP32, stored in the input dtype.

No shared memory, no tensor cores. S costs batch*heads*seqlen^2*4 bytes, allocated once in
``compile_kernel``; a problem whose S would not fit in free GPU memory is refused there.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .contract import (
    AMPERE_AND_LATER,
    Capabilities,
    CompiledAttention,
    FakeShapes,
    Problem,
    UnsupportedProblem,
    compiled_ptx,
    cute_dtype,
    fake_stream,
    jit_compile,
    run_kernel,  # noqa: F401  (the contract's launch-only entry)
)

# Plain loads and stores run on any CUDA GPU the DSL targets; batch*heads shares one grid dim.
CAPS = Capabilities(head_dims=(32, 64, 96, 128, 256), sweep_max_seqlen=4096, folds_batch_heads=True,
                    archs=AMPERE_AND_LATER)

TILE = 16  # score/output kernels: 16x16 threads per block
ROWS_PER_BLOCK = 256  # softmax kernel: one thread per row


class K1Score:
    def __init__(self, head_dim: int, causal: bool):
        self.head_dim = head_dim
        self.causal = causal

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mS: cute.Tensor, scale: Float32):
        tx, ty, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        nheads, seqlen = mQ.shape[1], mQ.shape[2]
        b, h = bz // nheads, bz % nheads
        i = by * TILE + ty  # query row
        j = bx * TILE + tx  # key column: neighbouring threads write neighbouring S entries
        if i < seqlen and j < seqlen:
            acc = Float32(0.0)
            for c in cutlass.range_constexpr(self.head_dim):
                acc += mQ[b, h, i, c].to(Float32) * mK[b, h, j, c].to(Float32)
            s = acc * scale
            if cutlass.const_expr(self.causal):
                if j > i:
                    s = -Float32.inf
            mS[b, h, i, j] = s

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mS: cute.Tensor, scale: Float32, stream):
        n = mQ.shape[2]
        grid = [cute.ceil_div(n, TILE), cute.ceil_div(n, TILE), mQ.shape[0] * mQ.shape[1]]
        self.kernel(mQ, mK, mS, scale).launch(grid=grid, block=[TILE, TILE, 1], stream=stream)


class K1Softmax:
    @cute.kernel
    def kernel(self, mS: cute.Tensor, mLSE: cute.Tensor):
        tx, _, _ = cute.arch.thread_idx()
        bx, bz, _ = cute.arch.block_idx()
        nheads, seqlen = mS.shape[1], mS.shape[2]
        b, h = bz // nheads, bz % nheads
        i = bx * ROWS_PER_BLOCK + tx
        if i < seqlen:
            row_max = -Float32.inf
            for j in cutlass.range(seqlen):  # pass 1: max
                row_max = cute.arch.fmax(row_max, mS[b, h, i, j])
            row_sum = Float32(0.0)
            for j in cutlass.range(seqlen):  # pass 2: sum of exponentials
                row_sum += cute.math.exp(mS[b, h, i, j] - row_max)
            inv_sum = 1.0 / row_sum
            for j in cutlass.range(seqlen):  # pass 3: normalize, P over S in place
                mS[b, h, i, j] = cute.math.exp(mS[b, h, i, j] - row_max) * inv_sum
            mLSE[b, h, i] = row_max + cute.math.log(row_sum)

    @cute.jit
    def __call__(self, mS: cute.Tensor, mLSE: cute.Tensor, stream):
        grid = [cute.ceil_div(mS.shape[2], ROWS_PER_BLOCK), mS.shape[0] * mS.shape[1], 1]
        self.kernel(mS, mLSE).launch(grid=grid, block=[ROWS_PER_BLOCK, 1, 1], stream=stream)


class K1Output:
    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor):
        tx, ty, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        nheads, seqlen = mV.shape[1], mV.shape[2]
        b, h = bz // nheads, bz % nheads
        c = bx * TILE + tx  # output column (head dim)
        i = by * TILE + ty  # output row
        if i < seqlen and c < self.head_dim:
            acc = Float32(0.0)
            for j in cutlass.range(seqlen):
                acc += mS[b, h, i, j] * mV[b, h, j, c].to(Float32)
            mO[b, h, i, c] = acc.to(mO.element_type)

    @cute.jit
    def __call__(self, mS: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, stream):
        grid = [cute.ceil_div(self.head_dim, TILE), cute.ceil_div(mV.shape[2], TILE), mV.shape[0] * mV.shape[1]]
        self.kernel(mS, mV, mO).launch(grid=grid, block=[TILE, TILE, 1], stream=stream)


def s_bytes(p: Problem) -> int:
    return p.batch * p.nheads * p.seqlen * p.seqlen * 4


def check_s_fits(p: Problem, free_bytes: int) -> None:
    """Refuse a problem whose materialized S would not fit (with 10% headroom)."""
    if s_bytes(p) > 0.9 * free_bytes:
        raise UnsupportedProblem(
            f"K1 materializes S ({s_bytes(p) / 2**30:.1f} GiB for batch*heads={p.batch * p.nheads}, "
            f"seqlen={p.seqlen}), more than fits in the {free_bytes / 2**30:.1f} GiB free on the GPU"
        )


def _compile_all(p: Problem, keep_ptx: bool):
    dt = cute_dtype(p.dtype)
    key = ("k1", p.head_dim, p.dtype, p.causal)

    def build_score():
        f = FakeShapes()
        args = (f.tensor(dt, (p.head_dim,)), f.tensor(dt, (p.head_dim,)), f.tensor(Float32, (f.seqlen,), 4),
                Float32(1.0), fake_stream())
        return K1Score(p.head_dim, p.causal), args

    def build_softmax():
        f = FakeShapes()
        return K1Softmax(), (f.tensor(Float32, (f.seqlen,), 4), f.tensor(Float32, (), 4), fake_stream())

    def build_output():
        f = FakeShapes()
        args = (f.tensor(Float32, (f.seqlen,), 4), f.tensor(dt, (p.head_dim,)), f.tensor(dt, (p.head_dim,)), fake_stream())
        return K1Output(p.head_dim), args

    return (
        jit_compile(key + ("score",), build_score, keep_ptx),
        jit_compile(key[:3] + ("softmax",), build_softmax, keep_ptx),
        jit_compile(key[:3] + ("output",), build_output, keep_ptx),
    )


def compile_kernel(p: Problem, *, keep_ptx: bool = False) -> CompiledAttention:
    score, softmax, output = _compile_all(p, keep_ptx)
    buffers = {}
    import torch

    if torch.cuda.is_available():  # a CPU-only compile (tests, --compile-only) allocates nothing
        # On the current device, which the harness sets to the inputs' device. One S per compiled
        # problem: two streams running the same compiled K1 at once would share it.
        check_s_fits(p, torch.cuda.mem_get_info()[0])
        buffers["S"] = torch.empty((p.batch, p.nheads, p.seqlen, p.seqlen), dtype=torch.float32,
                                   device=torch.cuda.current_device())

    def launch(q, k, v, out, lse, softmax_scale):
        S = buffers["S"]
        score(q, k, S, softmax_scale)
        softmax(S, lse)
        output(S, v, out)

    ptx = None
    if keep_ptx:
        ptx = "\n".join(filter(None, (compiled_ptx(c) for c in (score, softmax, output))))
    return CompiledAttention("k1", p, launch, buffers, ptx)

