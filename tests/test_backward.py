"""Autograd through ``attention`` and the public ``attention_backward``: refusals before any launch
(CPU), gradients and torch.compile (GPU)."""

import pytest
import torch

from harness import attention, attention_backward
from kernels.contract import UnsupportedProblem


def _qkv(shape=(1, 2, 16, 64), device="cpu", grad=True, kv_heads=None, kv_len=None):
    b, h, n, d = shape
    q = torch.randn(shape, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv_heads or h, kv_len or n, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("name,shape,kv_heads,match", [
    ("k7", (1, 2, 16, 64), None, "k7 is forward-only"),
    ("k8", (1, 2, 16, 64), None, "k8 is forward-only"),
    ("k6", (1, 2, 16, 256), None, "q must be a CUDA tensor"),  # d = 256 has a backward (K10's): the device next
])
def test_a_forward_no_backward_can_follow_is_refused_before_it_runs(name, shape, kv_heads, match):
    with pytest.raises(UnsupportedProblem, match=match):
        attention(name, *_qkv(shape, kv_heads=kv_heads))


def test_an_unknown_backward_stage_is_refused_by_name():
    with pytest.raises(UnsupportedProblem, match="backward must be one of \\['k9', 'k10', 'k10_overlap', 'k10_flat', 'k10_stmatrix', 'k10_fa3'\\]"):
        attention("k6", *_qkv(), backward="k11")
    with pytest.raises(UnsupportedProblem, match="K9 \\(backward\\): head_dim 256 not supported"):
        attention("k6", *_qkv((1, 2, 16, 256)), backward="k9")
    q, k, v = _qkv(grad=False)
    with pytest.raises(UnsupportedProblem, match="backward must be one of"):
        attention_backward(q, k, v, torch.randn_like(q), torch.randn(1, 2, 16), torch.randn_like(q), backward="k8")


def test_a_differentiable_call_goes_on_to_the_device_check():
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
        attention("k6", *_qkv())
    with torch.no_grad():  # no graph wanted: a forward-only stage runs too
        with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
            attention("k7", *_qkv())


def test_attention_backward_refuses_bad_saved_tensors_by_name():
    q, k, v = _qkv(grad=False)
    out, dout, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(1, 2, 16)
    with pytest.raises(UnsupportedProblem, match="out must be a torch.bfloat16 tensor of shape \\(1, 2, 16, 64\\)"):
        attention_backward(q, k, v, out[:, :, :8], lse, dout)
    with pytest.raises(UnsupportedProblem, match="lse must be a torch.float32 tensor"):
        attention_backward(q, k, v, out, lse.half(), dout)
    with pytest.raises(UnsupportedProblem, match="K9 \\(backward\\): head_dim 256"):
        attention_backward(*_qkv((1, 2, 16, 256), grad=False), torch.randn(1, 2, 16, 256, dtype=torch.bfloat16),
                           lse, torch.randn(1, 2, 16, 256, dtype=torch.bfloat16), backward="k9")
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
        attention_backward(q, k, v, out, lse, dout)


def test_deterministic_mode_refuses_k9_before_the_forward():
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(UnsupportedProblem, match="the deterministic backward is K10's"):
            attention("k6", *_qkv(), backward="k9")
        with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):  # K10 goes on to the checks
            attention("k6", *_qkv())
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_len", [1000, 1700])  # causal: the last key tile seeing a query tile moves
@pytest.mark.parametrize("d", [128, 256])  # 256: K10BackwardSplitD's own step
def test_the_deterministic_backward_repeats_bit_for_bit_and_is_right(causal, kv_len, d):
    q, k, v = _qkv((2, 8, 1000, d), "cuda", grad=False, kv_heads=2, kv_len=kv_len)
    dout = torch.randn_like(q)
    out, lse = attention("k6", q, k, v, causal=causal, return_lse=True)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [attention_backward(q, k, v, out, lse, dout, causal=causal) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
    want = _reference(q, k, v, dout, causal, d ** -0.5)
    for got, ref in zip(runs[0], want):
        assert torch.isfinite(got).all() and float((got.double() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads,n,nk", [(4, 4, 33, 33), (4, 2, 20, 50), (6, 2, 7, 7)])
def test_the_float64_reference_gradients_are_sdpas(heads, kv_heads, n, nk, causal):
    # The reference the backward is held to, against SDPA's own float64 backward (GQA, bottom-right).
    from harness.reference import causal_keep, reference_grads

    q = torch.randn(2, heads, n, 32, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, nk, 32, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = causal_keep(n, nk, "cpu") if causal else None
    torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=0.3,
                                                     enable_gqa=heads != kv_heads).backward(dout)
    for got, t in zip(reference_grads(q, k, v, dout, causal, 0.3), leaves):
        assert torch.allclose(got, t.grad, rtol=1e-10, atol=1e-12)


# ---- GPU --------------------------------------------------------------------------------------

def _reference(q, k, v, dout, causal, scale):
    from harness.reference import reference_grads

    return reference_grads(q, k, v, dout, causal, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,backward", [("k4", None), ("k6", None), ("k6", "k9"), ("k6", "k10")])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_through_autograd_matches_float64(name, backward, causal):
    q, k, v = _qkv((2, 4, 300, 128), "cuda")
    dout = torch.randn_like(q)
    attention(name, q, k, v, causal=causal, backward=backward).backward(dout)
    want = _reference(q, k, v, dout, causal, 128 ** -0.5)
    for t, ref in zip((q, k, v), want):
        assert torch.isfinite(t.grad).all()
        assert float((t.grad.double() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_backward_is_what_autograd_computes():
    q, k, v = _qkv((1, 2, 200, 64), "cuda")
    dout = torch.randn_like(q)
    out, lse = attention("k6", q, k, v, causal=True, return_lse=True)
    out.backward(dout)
    grads = attention_backward(q, k, v, out, lse, dout, causal=True)
    for got, t in zip(grads, (q, k, v)):
        assert torch.equal(got, t.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_compiled_forward_backpropagates_as_the_eager_one():
    def loss(q, k, v, w):
        return (attention("k6", q, k, v, causal=True) * w).sum()  # w: a gradient that is not all ones

    q, k, v = _qkv((1, 2, 256, 64), "cuda")
    w = torch.randn_like(q)
    loss(q, k, v, w).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.compile(loss, fullgraph=True)(q, k, v, w).backward()
    for got, want in zip((q.grad, k.grad, v.grad), eager):
        assert torch.equal(got, want)


def test_the_backward_sweep_names_what_no_stage_of_ours_runs():
    from harness.backward_bench import SWEEP, refusals
    from kernels.contract import Problem

    assert 256 in SWEEP["head_dims"]  # the peers' d = 256 cells stand in the table, ours (K10) beside them
    assert refusals(Problem(2, 8, 1024, 128), ("k9", "k10")) == {}
    why = refusals(Problem(2, 8, 1024, 256), ("k9", "k10"))
    assert set(why) == {"k9"} and "K9 (backward): head_dim 256 not supported" in why["k9"]


def test_a_configuration_joins_the_backward_stages_for_this_process_only(monkeypatch):
    import harness.backward as hb

    for name in ("VARIANTS", "STAGES", "DETERMINISTIC"):
        monkeypatch.setattr(hb, name, dict(hb.VARIANTS) if name == "VARIANTS" else getattr(hb, name))
    hb.add_configuration("k10_try", {"overlap": True})
    assert hb.stage_overrides("k10_try") == {"overlap": True} and hb.stage_module("k10_try").__name__ == "kernels.k10"
    assert "k10_try" in hb.STAGES and "k10_try" in hb.DETERMINISTIC  # K10's deterministic mode comes with it
    with pytest.raises(ValueError, match="already"):
        hb.add_configuration("k10_fa3", {})
