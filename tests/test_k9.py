"""K9, the backward pass: the compiled kernels hold the instructions its lesson claims (CPU), and
its gradients match float64 autograd through an explicit masked softmax (GPU)."""

import re

import pytest
import torch

from harness.inspect_ptx import count_instructions
from kernels.contract import Problem, UnsupportedProblem, compiled_ptx


@pytest.mark.parametrize("d", [64, 128])
def test_k9_is_five_wgmmas_on_tma_tiles_with_dq_added_atomically(d):
    from kernels.k9 import compile_backward

    pre, main, post = compile_backward(Problem(2, 4, 1000, d, causal=True), keep_ptx=True)
    ptx = compiled_ptx(main)
    counts = count_instructions(ptx)
    # Per query tile: S^T and dP^T (d/16 k-blocks each), dV and dK (64 query rows: 4 each), dQ
    # (128 keys: 8).
    assert counts["wgmma.mma_async"] == 2 * (d // 16) + 2 * 4 + 8
    assert counts["cp.async.bulk.tensor"] > 0 and counts["mbarrier"] > 0
    assert set(re.findall(r"\b(?:red|atom)\.[a-z0-9.]+", ptx)) == {"atom.global.add.f32"}
    assert "wgmma" not in compiled_ptx(pre) and "wgmma" not in compiled_ptx(post)


@pytest.mark.parametrize("bad,match", [
    (dict(head_dim=256), "head_dim 256 not supported"),
    (dict(dtype="float8_e4m3fn"), "dtype float8_e4m3fn not supported"),
])
def test_k9_refuses_what_it_does_not_do(bad, match):
    from kernels.k9 import check

    with pytest.raises(UnsupportedProblem, match=match):
        check(Problem(**dict(dict(batch=1, nheads=4, seqlen=1000, head_dim=64), **bad)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ["n1", "n17", "n128", "n1000", "gqa", "unequal"])
def test_k9_gradients_match_float64_autograd(shape, causal, d):
    # ref_check.py --backward's criterion: each gradient within twice the max error of SDPA's own
    # bf16 backward (+1e-3) of float64 autograd, outputs NaN-poisoned.
    from harness.check import check_backward

    p = dict(n1=Problem(2, 4, 1, d), n17=Problem(2, 4, 17, d), n128=Problem(2, 4, 128, d),
             n1000=Problem(2, 4, 1000, d), gqa=Problem(2, 8, 1000, d, nheads_kv=2),
             unequal=Problem(2, 4, 300, d, seqlen_k=1000, nheads_kv=2))[shape].with_(causal=causal)
    row = check_backward(p)
    assert row["ok"], row


@pytest.mark.parametrize("batch,heads,rows", [(1, 1, 4), (1, 3, 12), (2, 4, 1000), (1, 25, 1004), (3, 1, 1)])
def test_the_lse2_and_d_rows_start_where_the_kernels_assume(batch, heads, rows):
    from kernels.k9 import row_buffers

    lse2, dot = row_buffers(batch, heads, rows, "cpu")
    for t in (lse2, dot):
        assert t.shape == (batch, heads, rows) and t.data_ptr() % 32 == 0  # the pre-pass's alignment claim
        assert t.stride(-1) == 1 and all(s * 4 % 16 == 0 for s in t.stride()[:-1])  # TMA: 16-byte rows
    assert dot.data_ptr() >= lse2[-1, -1, -1:].data_ptr() + 4  # no overlap
