"""The eager fast path of ``attention`` (harness/api.py): a call whose signature was seen before
launches at once, and everything else is still checked. Marked ``gpu``: the fast path is taken
for CUDA tensors only (the CPU tests of test_api.py cover the refusals themselves)."""

import pytest
import torch

from harness import api, attention, quantize_fp8, quantize_fp8_blocks
from kernels.contract import UnsupportedProblem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _qkv(shape=(2, 4, 300, 128), dtype=torch.bfloat16):
    return [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3)]


def _message(call):
    with pytest.raises(UnsupportedProblem) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize("name", ["k4", "k6", "k7"])
def test_a_repeated_call_is_prepared_once_and_gives_fresh_outputs(name):
    q, k, v = _qkv()
    api._PREPARED.clear()
    first, lse = attention(name, q, k, v, causal=True, return_lse=True)
    assert len(api._PREPARED) == 1
    again, lse_again = attention(name, q, k, v, causal=True, return_lse=True)
    assert len(api._PREPARED) == 1  # the same signature: no second set of checks
    assert torch.equal(first, again) and torch.equal(lse, lse_again)
    assert first.data_ptr() != again.data_ptr() and lse.data_ptr() != lse_again.data_ptr()  # no aliasing
    third = attention(name, q, k, v, causal=True)  # return_lse is part of the signature
    assert len(api._PREPARED) == 2 and torch.equal(third, first)


@pytest.mark.parametrize("change", ["head_dim", "stride", "dtype", "requires_grad", "device", "causal_shape",
                                    "scale", "name"])
def test_a_bad_call_after_a_good_one_is_refused_as_it_would_be_first(change):
    q, k, v = _qkv((1, 2, 256, 128))
    bad = dict(
        head_dim=lambda: attention("k6", *_qkv((1, 2, 256, 96))),
        stride=lambda: attention("k6", torch.randn(1, 2, 256, 132, device="cuda", dtype=torch.bfloat16)[..., :128], k, v),
        dtype=lambda: attention("k6", q.float(), k.float(), v.float()),
        requires_grad=lambda: attention("k7", q.clone().requires_grad_(), k, v),  # forward-only
        device=lambda: attention("k6", q, k.cpu(), v),
        causal_shape=lambda: attention("k6", q, k[:, :, :100], v[:, :, :100], causal=True),
        scale=lambda: attention("k6", q, k, v, softmax_scale=-1.0),
        name=lambda: attention("k66", q, k, v),
    )[change]
    api._PREPARED.clear()
    first = _message(bad)  # refused before any good call
    attention("k6", q, k, v)
    attention("k6", q, k, v, causal=True, softmax_scale=0.5)
    assert _message(bad) == first  # refused after the good ones, with the same words


def test_a_misaligned_view_after_an_aligned_one_is_refused():
    q, k, v = _qkv((1, 2, 256, 128))
    attention("k6", q, k, v)
    base = torch.randn(1 * 2 * 256 * 128 + 8, device="cuda", dtype=torch.bfloat16)
    shifted = base[4:4 + 2 * 256 * 128].view(1, 2, 256, 128)  # same shape and strides, 8 bytes off a 16-byte boundary
    with pytest.raises(UnsupportedProblem, match="16-byte aligned"):
        attention("k6", shifted, k, v)


@pytest.mark.parametrize("name", ["k6", "k7", "k8"])
def test_each_stream_gets_its_own_prepared_call_and_the_same_answer(name):
    # K7/K8 from bf16 keep their e4m3 copies, V^T and descales in scratch per stream: two streams
    # running at once must not share it.
    q, k, v = _qkv()
    q2, k2, v2 = _qkv()
    api._PREPARED.clear()
    want, want2 = attention(name, q, k, v, causal=True), attention(name, q2, k2, v2, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    got, got2 = [], []
    for _ in range(3):
        got.append(attention(name, q, k, v, causal=True))
        with torch.cuda.stream(side):
            got2.append(attention(name, q2, k2, v2, causal=True))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert len(api._PREPARED) == 2
    assert all(torch.equal(g, want) for g in got) and all(torch.equal(g, want2) for g in got2)


def test_fp8_descales_that_are_not_positive_give_nan_not_a_wrong_answer():
    q, k, v = _qkv((1, 4, 300, 128))
    (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in (q, k, v))
    good = attention("k7", q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    assert torch.isfinite(good).all()
    for bad in (-dk, dk * float("nan"), dk * 0):
        out = attention("k7", q8, k8, v8, descale_q=dq, descale_k=bad, descale_v=dv)
        assert out.isnan().all()
    q8, k8, v8, dq, dk, dv = quantize_fp8_blocks(q, k, v)
    assert torch.isfinite(attention("k8", q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)).all()
    dv_bad = dv.clone()
    dv_bad[0, 2, 1] = -dv_bad[0, 2, 1]  # one V tile of head 2
    out = attention("k8", q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv_bad)
    assert out[0, 2].isnan().all() and torch.isfinite(out[0, :2]).all() and torch.isfinite(out[0, 3]).all()


@pytest.mark.parametrize("name", ["k7", "k8"])
def test_bf16_into_an_fp8_stage_equals_its_public_quantizer(name):
    q, k, v = _qkv((2, 4, 1000, 128))
    want = attention(name, q, k, v, causal=True)
    if name == "k7":
        (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in (q, k, v))
    else:
        q8, k8, v8, dq, dk, dv = quantize_fp8_blocks(q, k, v)
    got = attention(name, q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
    assert torch.equal(got, want)
