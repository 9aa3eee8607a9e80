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
    (dict(nheads_kv=2), "no GQA"),
    (dict(seqlen_k=500), "seqlen_k == seqlen_q"),
])
def test_k9_refuses_what_it_does_not_do(bad, match):
    from kernels.k9 import check

    with pytest.raises(UnsupportedProblem, match=match):
        check(Problem(**dict(dict(batch=1, nheads=4, seqlen=1000, head_dim=64), **bad)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 17, 128, 1000])
def test_k9_gradients_match_float64_autograd(n, causal, d):
    from harness import attention
    from harness.reference import reference_grads
    from kernels.k9 import compile_backward, run_backward

    p = Problem(2, 4, n, d, causal=causal)
    q, k, v, do = (torch.randn(2, 4, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = attention("k6", q, k, v, causal=causal, return_lse=True)
    grads = run_backward(compile_backward(p), q, k, v, out, lse, do, p.scale)
    want = reference_grads(q, k, v, do, causal, p.scale)
    # The same gradients from torch's own bf16 backward (SDPA), for the error a bf16 kernel makes.
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=p.scale).backward(do)
    for name, got, ref, peer in zip("qkv", grads, want, (qs.grad, ks.grad, vs.grad)):
        assert torch.isfinite(got).all(), name
        err = float((got.double() - ref).norm() / ref.norm())
        peer_err = float((peer.double() - ref).norm() / ref.norm())
        assert err <= 2 * peer_err + 2e-3, (name, err, peer_err)
