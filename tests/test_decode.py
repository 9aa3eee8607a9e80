"""Flash decode: the host-side arithmetic (split counts, split ranges, the merge), the KV-cache
reference, and the public calls' refusals, on the CPU; a few KV-cache cases on a GPU (marked
``gpu``; the full grid is ``python ref_check.py --decode``)."""

import math

import pytest
import torch

from harness.kvcache import attention_with_kvcache, decode_plan
from harness.reference import reference_kvcache
from kernels import UnsupportedProblem
from kernels.decode import (choose_num_splits, merge_partials, num_splits_heuristic, split_range,
                            split_traffic_cap)

SMS = 132


# ---- how many splits ----------------------------------------------------------------------

@pytest.mark.parametrize("batch,kv_heads,want", [(1, 8, 16), (1, 32, 4), (8, 8, 2), (8, 32, 1), (64, 8, 1)])
def test_splits_fill_one_wave(batch, kv_heads, want):
    # 32 query heads, q_len 1 (one query tile), 32k keys in 128-key tiles.
    assert choose_num_splits(batch, kv_heads, 32 // kv_heads, 1, 32768, SMS, 128) == want
    assert batch * kv_heads * want <= SMS or want == 1


def test_splits_never_exceed_the_tiles_or_the_cap():
    assert num_splits_heuristic(8, 3, SMS) == 3  # 3 tiles: at most 3 splits
    assert num_splits_heuristic(1, 1000, SMS) == 128  # one CTA's worth of work: the cap
    assert num_splits_heuristic(106, 1000, SMS) == 1  # 80% of the SMs busy already


def test_split_traffic_cap():
    # Partials cost 2 * S * group * q_len / kv_len of the K/V bytes; at most 5%.
    assert split_traffic_cap(32, 1, 8192) == 6  # MQA 32/1 at 8k: 0.05 * 8192 / 64 = 6.4
    assert split_traffic_cap(4, 1, 32768) == 204  # 32/8 at 32k: no cap in practice
    assert split_traffic_cap(32, 16, 100) == 1
    assert choose_num_splits(1, 1, 32, 1, 8192, SMS, 128) == 6  # MQA: capped from 64


@pytest.mark.parametrize("n_tiles", [0, 1, 7, 32, 33, 256])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 40, 128])
def test_split_ranges_cover_every_tile_once(n_tiles, splits):
    seen = []
    for s in range(splits):
        lo, hi = split_range(n_tiles, splits, s)
        assert 0 <= lo <= hi <= n_tiles
        seen.extend(range(lo, hi))
    assert seen == list(range(n_tiles))
    if splits > n_tiles:  # the trailing splits are empty
        assert split_range(n_tiles, splits, splits - 1)[0] == split_range(n_tiles, splits, splits - 1)[1]


# ---- the merge --------------------------------------------------------------------------------

def test_merge_partials_equals_one_softmax_over_all_keys():
    torch.manual_seed(0)
    rows, d, n = 5, 16, 40
    q = torch.randn(rows, d, dtype=torch.float64)
    k, v = torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    s = q @ k.T
    full_lse = torch.logsumexp(s, dim=-1)
    full_o = torch.softmax(s, dim=-1) @ v
    bounds = [0, 7, 7, 19, 40, 40]  # splits 1 and 4 are empty
    o_parts, lse_parts = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        if lo == hi:
            o_parts.append(torch.zeros(rows, d, dtype=torch.float64))
            lse_parts.append(torch.full((rows,), -math.inf, dtype=torch.float64))
        else:
            o_parts.append(torch.softmax(s[:, lo:hi], dim=-1) @ v[lo:hi])
            lse_parts.append(torch.logsumexp(s[:, lo:hi], dim=-1))
    o, lse = merge_partials(torch.stack(o_parts), torch.stack(lse_parts))
    assert torch.allclose(o, full_o, atol=1e-12) and torch.allclose(lse, full_lse, atol=1e-12)


def test_merge_of_empty_splits_is_zero_and_minus_inf():
    o_parts = torch.full((3, 2, 4), float("nan"), dtype=torch.float64)  # never read: weight 0
    lse_parts = torch.full((3, 2), -math.inf, dtype=torch.float64)
    o, lse = merge_partials(o_parts, lse_parts)
    assert torch.equal(o, torch.zeros(2, 4, dtype=torch.float64)) and bool((lse == -math.inf).all())


# ---- the reference ------------------------------------------------------------------------------

def _explicit(q, k, v, lengths, causal, scale):
    """Attention row by row with Python loops: the definition, nothing shared with the reference."""
    b, q_len, h, d = q.shape
    group = h // k.shape[2]
    o = torch.zeros(b, q_len, h, d, dtype=torch.float64)
    lse = torch.full((b, h, q_len), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(q_len):
                keys = [j for j in range(lengths[bi]) if not causal or j <= i + lengths[bi] - q_len]
                if not keys:
                    continue
                s = torch.stack([q[bi, i, hi].double() @ k[bi, j, hi // group].double() * scale for j in keys])
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                p = torch.exp(s - lse[bi, hi, i])
                o[bi, i, hi] = sum(p[t] * v[bi, j, hi // group].double() for t, j in enumerate(keys))
    return o, lse


@pytest.mark.parametrize("causal", [False, True])
def test_reference_kvcache_matches_the_definition_and_ignores_stale_rows(causal):
    torch.manual_seed(1)
    q = torch.randn(3, 4, 6, 8)
    k, v = torch.randn(3, 9, 2, 8), torch.randn(3, 9, 2, 8)
    lengths = [9, 2, 0]  # q_len 4 > 2 keys: causal rows 0 and 1 of sequence 1 see nothing
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = float("nan"), float("inf")
    o, lse = reference_kvcache(q, k, v, torch.tensor(lengths), causal, 0.3)
    o_want, lse_want = _explicit(q, k, v, lengths, causal, 0.3)
    assert not o.isnan().any() and torch.allclose(o, o_want, atol=1e-10)
    assert torch.equal(lse.isinf(), lse_want.isinf()) and torch.allclose(lse[~lse.isinf()], lse_want[~lse.isinf()])
    assert bool((lse[2] == -math.inf).all()) and bool((o[2] == 0).all())


# ---- refusals, before anything is launched -------------------------------------------------------

def _tensors(b=2, q_len=1, h=32, hk=8, s=64, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, q_len, h, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype),
            torch.randn(b, s, hk, d, dtype=dtype))


@pytest.mark.parametrize("make,match", [
    (lambda: _tensors(h=32, hk=6), "multiple of the caches' nheads_kv"),
    (lambda: _tensors(h=8, hk=32), "multiple of the caches' nheads_kv"),
    (lambda: (*_tensors()[:2], _tensors(s=32)[2]), "one shape"),
    (lambda: (_tensors(b=3)[0], *_tensors()[1:]), "q's batch and head_dim"),
    (lambda: (_tensors(d=64)[0], *_tensors()[1:]), "q's batch and head_dim"),
    (lambda: _tensors(d=80), "head_dim 80"),
    (lambda: _tensors(dtype=torch.float32), "bfloat16 or float16"),
    (lambda: (_tensors()[0][0], *_tensors()[1:]), "4-D"),
])
def test_attention_with_kvcache_refuses_with_the_constraint(make, match):
    q, k, v = make()
    with pytest.raises(UnsupportedProblem, match=match):
        attention_with_kvcache(q, k, v)


@pytest.mark.parametrize("lens,match", [(torch.zeros(2, dtype=torch.int64), "int32"),
                                        (torch.zeros(3, dtype=torch.int32), r"\(2,\)"),
                                        (65, r"\[0, s_cache = 64\]"), (-1, r"\[0, s_cache"),
                                        (2.0, "None, an int or an int32 tensor")])
def test_cache_seqlens_are_checked(lens, match):
    with pytest.raises(UnsupportedProblem, match=match):
        attention_with_kvcache(*_tensors(), lens)


def test_cpu_tensors_are_refused_after_the_shape_checks():
    with pytest.raises(UnsupportedProblem, match="CUDA"):
        attention_with_kvcache(*_tensors(), torch.full((2,), 10, dtype=torch.int32))


@pytest.mark.parametrize("kw,match", [(dict(nheads_kv=6), "multiple of nheads_kv"),
                                      (dict(max_seqlen_k=0), "max_seqlen_k"),
                                      (dict(head_dim=96), "head_dim 96"),
                                      (dict(num_splits=129), "num_splits"),
                                      (dict(kernel="k4"), "kernel must be one of"),
                                      (dict(device="cpu"), "CUDA device")])
def test_decode_plan_refuses_with_the_constraint(kw, match):
    args = dict(batch=2, nheads=32, nheads_kv=8, head_dim=128, max_seqlen_k=4096)
    args.update(kw)
    with pytest.raises(UnsupportedProblem, match=match):
        decode_plan(**args)


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["decode", "decode_combine"])
@pytest.mark.parametrize("shape,lengths,causal,splits", [
    ((4, 32, 8, 1, 8192), [0, 1, 127, 8192], False, 0),
    ((3, 32, 8, 4, 1000), [1000, 5, 2], True, 0),
    ((1, 28, 4, 17, 3000), [2999], True, 0),
    ((2, 32, 1, 1, 4000), [4000, 2500], False, 7),
    ((2, 32, 8, 1, 4000), [4000, 100], False, 128),
])
def test_kvcache_cases(kernel, shape, lengths, causal, splits):
    from harness.check import KVCacheCase, check_kvcache

    row = check_kvcache(KVCacheCase(kernel, *shape, 128, causal, lengths, splits, graph=True))
    assert row["ok"], row["reason"]



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kvcache_call_under_torch_compile_matches_eager():
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 3000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")

    def step(q, k, v, lens):
        out, lse = attention_with_kvcache(q, k, v, lens, causal=True, return_lse=True)
        return out * 2, lse

    eager = step(q, k, v, lens)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, k, v, lens)  # a graph break would be an error
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
