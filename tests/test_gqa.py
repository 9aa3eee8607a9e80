"""Grouped-query attention and K/V longer than Q: the contract, the refusals and the reference, on the CPU."""

import math

import pytest
import torch

from harness.inputs import problem_from_tensors
from harness.reference import reference
from kernels import get_kernel
from kernels.contract import Problem, UnsupportedProblem


def _t(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def test_problem_from_gqa_and_longer_kv():
    p = problem_from_tensors(_t(2, 8, 17, 64), _t(2, 2, 100, 64), _t(2, 2, 100, 64), True)
    assert (p.nheads, p.kv_heads, p.group, p.seqlen, p.kv_len) == (8, 2, 4, 17, 100)
    # K/V shaped like Q is exactly the self-attention problem (one cache key, one result row).
    q = _t(1, 4, 32, 64)
    assert problem_from_tensors(q, q, q, False) == Problem(1, 4, 32, 64)
    assert Problem(1, 4, 32, 64, seqlen_k=32, nheads_kv=4) == Problem(1, 4, 32, 64)
    # Changing the query length keeps the keys where they were, equal to Q's before or not.
    assert Problem(1, 4, 16, 64).with_(seqlen=8).kv_len == 16
    assert Problem(1, 4, 16, 64, nheads_kv=2).with_(nheads=8).kv_heads == 2
    assert Problem(1, 4, 16, 64, seqlen_k=64).with_(causal=True).kv_len == 64


@pytest.mark.parametrize("k_shape,v_shape,match", [
    ((2, 3, 16, 64), (2, 3, 16, 64), "multiple of k/v's"),      # 8 query heads over 3 K/V heads
    ((2, 2, 16, 64), (2, 2, 32, 64), "k and v must have one shape"),
    ((1, 2, 16, 64), (1, 2, 16, 64), "q's batch"),
    ((2, 2, 16, 32), (2, 2, 16, 32), "q's batch and head_dim"),
])
def test_bad_kv_shapes_are_refused(k_shape, v_shape, match):
    with pytest.raises(UnsupportedProblem, match=match):
        problem_from_tensors(_t(2, 8, 16, 64), _t(*k_shape), _t(*v_shape), False)


def test_capabilities_refuse_what_a_stage_cannot_run():
    gqa = Problem(1, 8, 128, 128, nheads_kv=2)
    longer = Problem(1, 8, 128, 128, seqlen_k=512)
    for name in ("k2", "k4"):
        with pytest.raises(UnsupportedProblem, match="grouped-query"):
            get_kernel(name).caps.check(gqa)
        with pytest.raises(UnsupportedProblem, match="seqlen_k == seqlen_q"):
            get_kernel(name).caps.check(longer)
    for name in ("k5", "k6", "k7", "k8"):
        get_kernel(name).caps.check(gqa)
        get_kernel(name).caps.check(longer.with_(causal=True))
        with pytest.raises(UnsupportedProblem, match="more queries than keys"):
            get_kernel(name).caps.check(Problem(1, 8, 512, 128, seqlen_k=128, causal=True))
    with pytest.raises(UnsupportedProblem, match="multiple of nheads_kv"):
        Problem(1, 8, 128, 64, nheads_kv=3)


def test_flops_count_the_bottom_right_causal_pairs():
    assert Problem(1, 1, 64, 64, causal=True).flops == 4 * 64 * 64 * 64 / 2  # the usual convention
    assert Problem(1, 1, 64, 64, seqlen_k=256).flops == 4 * 64 * 256 * 64
    assert Problem(1, 1, 64, 64, seqlen_k=256, causal=True).flops == 4 * (64 * 256 - 64 * 64 / 2) * 64


@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_grouped_and_bottom_right(causal):
    b, h, hk, nq, nk, d = 2, 6, 2, 5, 11, 16
    q, k, v = torch.randn(b, h, nq, d), torch.randn(b, hk, nk, d), torch.randn(b, hk, nk, d)
    scale = 0.3
    o, lse = reference(q, k, v, causal, scale)
    # float64 by hand: head i reads K/V head i // 3; row i sees keys j <= i + nk - nq.
    kx, vx = (t.double().repeat_interleave(h // hk, dim=1) for t in (k, v))
    s = q.double() @ kx.transpose(-1, -2) * scale
    if causal:
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        s = s.masked_fill(j > i + nk - nq, -math.inf)
    assert torch.allclose(o.double(), torch.softmax(s, -1) @ vx, atol=1e-5)
    assert torch.allclose(lse.double(), torch.logsumexp(s, -1), atol=1e-5)
