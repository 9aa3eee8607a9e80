"""The logit softcap (issue 35): scores s -> c * tanh(s / c) before the softmax, in the
warp-specialized stages' forward. CPU: the PTX, the refusals, the reference; GPU: the grid's cases."""

import math
import re

import pytest
import torch

from harness import attention, varlen
from harness.reference import reference
from kernels import get_kernel
from kernels.contract import Problem, UnsupportedProblem


@pytest.mark.parametrize("name,d,causal", [("k6", 64, False), ("k6", 128, True), ("k5", 128, False)])
def test_a_softcap_adds_one_tanh_per_score(name, d, causal):
    p = Problem(2, 8, 1000, d, causal=causal, nheads_kv=2)
    plain, online, fp16 = (get_kernel(name).compile(q, keep_ptx=True).ptx
                           for q in (p, p.with_(softcap=50.0), p.with_(softcap=30.0, dtype="float16")))
    assert "tanh.approx" not in plain
    for capped in (online, fp16):  # beyond KNOWN_MAX_SOFTCAP, or fp16: the online max as without a cap
        tanh, ex2 = (len(re.findall(pattern, capped)) for pattern in (r"tanh\.approx\.f32", r"ex2\.approx"))
        assert ex2 == len(re.findall(r"ex2\.approx", plain))
        assert 0.9 * ex2 <= tanh < ex2  # one tanh per score, ahead of its ex2; the others: the rescale factors


@pytest.mark.parametrize("name,d,causal", [("k6", 64, False), ("k6", 128, True), ("k5", 128, False)])
def test_a_softcap_up_to_40_in_bf16_needs_no_row_max_and_no_rescale(name, d, causal):
    p = Problem(2, 8, 1000, d, causal=causal, nheads_kv=2)
    plain, known = (get_kernel(name).compile(q, keep_ptx=True).ptx for q in (p, p.with_(softcap=40.0)))
    tanh, ex2 = (len(re.findall(pattern, known)) for pattern in (r"tanh\.approx\.f32", r"ex2\.approx"))
    assert tanh == ex2 > 0  # one ex2 per score and no rescale factor
    assert not re.search(r"\bmax(\.NaN)?\.f32", known) and re.search(r"\bmax(\.NaN)?\.f32", plain)
    assert known.count("shfl.sync") < plain.count("shfl.sync")  # the row max's quad reductions are gone


@pytest.mark.parametrize("softcap,match", [(-1.0, "finite number >= 0"), (math.inf, "finite number >= 0"),
                                           (True, "finite number >= 0"), ("5", "finite number >= 0")])
def test_a_bad_softcap_is_refused_by_name(softcap, match):
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(UnsupportedProblem, match=match):
        attention("k6", q, k, v, softcap=softcap)
    with pytest.raises(UnsupportedProblem, match=match):
        Problem(1, 2, 16, 64, softcap=softcap)


@pytest.mark.parametrize("name", ["k4", "k7", "k8", "decode"])
def test_a_stage_without_the_softcap_refuses_it_before_any_launch(name):
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(UnsupportedProblem, match="softcap 5.0 not supported by this kernel|dtype|float8"):
        attention(name, q, k, v, softcap=5)


def test_k9_refuses_a_softcap_before_the_forward():
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with pytest.raises(UnsupportedProblem, match="K9 \\(backward\\): no sliding window or softcap"):
        attention("k6", q, k, v, softcap=5.0, backward="k9")


@pytest.mark.parametrize("stage", ["k10", "k10_fa3"])
def test_k10s_softcap_backward_takes_one_tanh_a_score_and_overlaps_only_with_capped_overlap(stage):
    from harness.backward import stage_overrides
    from kernels.contract import compiled_ptx
    from kernels.k10 import compile_backward

    p = Problem(2, 8, 1000, 128, causal=True, softcap=5.0)
    compiled = compile_backward(p, keep_ptx=True, **stage_overrides(stage))
    ptx = compiled_ptx(compiled[1])
    # one tanh per score of the recomputed S^T tile (128 keys x 64 queries over 256 MMA threads), in
    # each copy of the step (mask_edges: the edge step and the plain one)
    copies = 2 if compiled[3].get("mask_edges") else 1
    assert len(re.findall(r"tanh\.approx\.f32", ptx)) == copies * 128 * 64 // 256
    # the overlapped start keeps the fp32 P across dP's wait and has no registers left for the slope,
    # unless capped_overlap keeps t there instead (k10_fa3 at d = 128)
    assert bool(compiled[3].get("overlap")) == bool(compiled[3].get("capped_overlap")) == (stage == "k10_fa3")


@pytest.mark.parametrize("causal", [False, True])
def test_the_softcap_reference_agrees_with_the_packed_float64_one(causal):
    gen = torch.Generator().manual_seed(1)
    b, h, hk, n, nk, d = 2, 4, 2, 33, 47, 16
    q = torch.randn(b, h, n, d, generator=gen) * 3
    k, v = (torch.randn(b, hk, nk, d, generator=gen) * 3 for _ in range(2))
    o, lse = reference(q, k, v, causal, 0.25, softcap=2.0)
    cu_q, cu_k = (torch.arange(0, (b + 1) * x, x, dtype=torch.int32) for x in (n, nk))
    packed = [t.transpose(1, 2).reshape(-1, t.shape[1], d) for t in (q, k, v)]
    o64, lse64 = varlen.reference(*packed, cu_q, cu_k, 0.25, causal=causal, softcap=2.0)
    assert torch.allclose(o, o64.float().reshape(b, n, h, d).transpose(1, 2), atol=1e-5)
    assert torch.allclose(lse, lse64.float().reshape(h, b, n).transpose(0, 1), atol=1e-5)
    # a cap far above every score changes nothing; a small one does
    o_far, _ = reference(q, k, v, causal, 0.25, softcap=1e6)
    assert torch.allclose(o_far, reference(q, k, v, causal, 0.25)[0], atol=1e-5)
    assert not torch.allclose(o, o_far, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,d,causal,softcap", [("k6", d, causal, 0.5) for d in (64, 128, 256) for causal in (0, 1)]
                         + [("k5", 128, True, 5.0)])  # ref_check's grid has the rest
def test_a_softcapped_forward_matches_the_explicit_reference(name, d, causal, softcap):
    from harness.check import check_kernel

    res = check_kernel(name, Problem(2, 8, 1000, d, causal=bool(causal), nheads_kv=2, softcap=softcap))
    assert res.ok, res.reason


@pytest.mark.parametrize("softcap,causal", [(0.5, False), (5.0, True)])
def test_the_softcap_backwards_bar_fails_a_gradient_without_the_cap_or_its_slope(softcap, causal):
    # check_backward's bar: within twice the error of a 16-bit softcapped backward (SDPA has none)
    # once the rounding bound is off. A backward that ignored the cap, or dropped tanh's slope
    # 1 - t^2 from dS, must fail it.
    from harness.check import beyond, grad_peer, within_grad_bar
    from harness.reference import reference_grads

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    dout = torch.randn(1, 2, 256, 64, generator=gen).to(torch.bfloat16)
    scale = 64 ** -0.5
    want = reference_grads(q, k, v, dout, causal, scale, softcap)
    peer, bounds = grad_peer(q, k, v, dout, causal, scale, softcap)

    def err(grads):
        return [beyond((g.double() - w).abs(), b) for g, w, b in zip(grads, want, bounds)]

    peer_err = err(peer)
    no_cap = reference_grads(q, k, v, dout, causal, scale)
    qd, kd, vd, dd = (t.double() for t in (q, k, v, dout))  # dS without the slope, by hand
    t = torch.tanh(qd @ kd.transpose(-1, -2) * scale / softcap)
    s = (softcap * t).masked_fill(~varlen.keep_mask(256, 256, (-1, 0 if causal else -1)), -math.inf)
    p = torch.softmax(s, dim=-1)
    ds = p * (dd @ vd.transpose(-1, -2) - (dd * (p @ vd)).sum(-1, keepdim=True)) * scale
    no_slope = (ds @ kd, ds.transpose(-1, -2) @ qd, p.transpose(-1, -2) @ dd)
    assert all(within_grad_bar(e, pe) for e, pe in zip(peer_err, peer_err))
    for wrong in (no_cap, no_slope):
        assert not all(within_grad_bar(e, pe) for e, pe in zip(err(wrong), peer_err))


def test_the_softcap_bar_holds_a_second_rounding_draw_where_one_key_holds_a_row():
    # One query, one key, the exact dq and dk 0: a kernel's known-max P rounds apart from the
    # peer's (tanh.approx moves t), an independent draw, which twice the peer's error alone fails
    # about a third of the time. The peer's own arithmetic with c moved by 2^-11 stands in for the
    # kernel here, on 150 inputs: the bar with the rounding bound holds every draw.
    from harness.check import beyond, grad_peer, within_grad_bar
    from harness.reference import capped_grads_16bit, reference_grads

    failed = [0, 0]  # without, with the bound
    for seed in range(150):
        gen = torch.Generator().manual_seed(seed)
        q, k, v, dout = (torch.randn(1, 4, 1, 64, generator=gen).to(torch.bfloat16) for _ in range(4))
        want = reference_grads(q, k, v, dout, False, 0.125, 5.0)
        peer, bounds = grad_peer(q, k, v, dout, False, 0.125, 5.0)
        other = capped_grads_16bit(q, k, v, dout, False, 0.125, 5.0 * (1 + 2 ** -11))
        for g in (0, 1):
            err, peer_err = ((x[g].double() - want[g]).abs() for x in (other, peer))
            failed[0] += not within_grad_bar(float(err.max()), float(peer_err.max()))
            failed[1] += not within_grad_bar(beyond(err, bounds[g]), float(peer_err.max()))
    assert failed[0] > 30 and failed[1] == 0, failed


def test_the_softcap_peer_carries_the_known_max_outputs_rounding_into_a_one_key_rows_gradient():
    # One query, one key: the exact dq is 0 (a softmax of one score is 1 whatever the score). A
    # flash backward gets D from the stored O; with the known-max softmax (bf16, c <= 40) P is not
    # 1, its 16-bit rounding leaves O != V and dq != 0, which the peer must model (autograd of the
    # 16-bit forward would not). Above 40 the max is the row's own and P = 1: dq is 0 up to fp32 sums.
    from harness.reference import capped_grads_16bit, reference_grads

    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 4, 1, 64, generator=gen).to(torch.bfloat16) for _ in range(4))
    assert float(reference_grads(q, k, v, dout, False, 0.125, 5.0)[0].abs().max()) < 1e-12
    assert float(capped_grads_16bit(q, k, v, dout, False, 0.125, 5.0)[0].float().abs().max()) > 1e-4
    assert float(capped_grads_16bit(q, k, v, dout, False, 0.125, 50.0)[0].float().abs().max()) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backward", ["k10", "k10_fa3"])
@pytest.mark.parametrize("d,causal,softcap", [(64, False, 0.5), (128, True, 5.0), (128, False, 50.0)])
def test_the_softcapped_backward_matches_float64_autograd(backward, d, causal, softcap):
    from harness.check import check_backward

    row = check_backward(Problem(2, 8, 1000, d, causal=causal, nheads_kv=2, softcap=softcap), backward=backward)
    assert row["ok"], row["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_public_call_takes_the_softcap_eagerly_and_compiled():
    q, k, v = (torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    want, want_lse = reference(q, k, v, True, 128 ** -0.5, softcap=1.0)
    eager, lse = attention("k6", q, k, v, causal=True, return_lse=True, softcap=1.0)
    compiled = torch.compile(lambda *t: attention("k6", *t, causal=True, softcap=1.0), fullgraph=True)(q, k, v)
    for out in (eager, compiled):
        assert (out.float() - want).abs().max() < 2e-2
    assert (lse - want_lse).abs().max() < 1e-3
    plain = attention("k6", q, k, v, causal=True)  # the same signature without the cap: its own launch
    assert (plain.float() - want).abs().max() > 5e-2


def test_k10_fa3_takes_the_softcaps_tanh_while_dps_gemm_runs():
    from harness.backward import stage_overrides
    from kernels.contract import compiled_ptx
    from kernels.k10 import compile_backward

    p = Problem(2, 8, 1000, 128, causal=True, softcap=5.0)
    base = {k: v for k, v in stage_overrides("k10_fa3").items() if k != "by_head_dim"}  # d = 128's: capped_overlap

    def tanhs_under_a_gemm(**knobs):  # (tanh count, those between a wait for all GEMMs but one and the last)
        ptx = compiled_ptx(compile_backward(p, keep_ptx=True, **dict(base, **knobs))[1])
        running, total, hidden = False, 0, 0
        for line in ptx.splitlines():
            if re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", line):
                running = True  # S^T's GEMM done, dP^T's still running
            elif re.search(r"wgmma\.wait_group\.sync\.aligned\s+0;", line):
                running = False
            if "tanh.approx.f32" in line:
                total, hidden = total + 1, hidden + running
        return total, hidden

    sequential, under_dp = tanhs_under_a_gemm(tanh_under_dp=False), tanhs_under_a_gemm()
    assert sequential[0] == under_dp[0] > 0  # the same tanhs (one a score), elsewhere
    assert sequential[1] == 0 and under_dp[1] == under_dp[0]
    overlapped = tanhs_under_a_gemm(capped_overlap=True)  # k10_fa3's at d = 128: the overlapped start's, also hidden
    assert overlapped[0] == overlapped[1] == under_dp[0]
