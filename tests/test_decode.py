"""Flash decode: the host-side arithmetic (split counts, split ranges, the merge), the KV-cache
reference, and the public calls' refusals, on the CPU; a few KV-cache cases on a GPU (marked
``gpu``; the full grid is ``python ref_check.py --decode``)."""

import math

import pytest
import torch

from harness.check import compare, deterministic, lse_gap
from harness.kvcache import attention_with_kvcache, decode_plan
from harness.reference import reference_kvcache, sdpa_kvcache
from kernels import UnsupportedProblem
from kernels.decode import (choose_num_splits, claimed_split_range, merge_partials, num_splits_heuristic,
                            split_range, split_traffic_cap)

SMS = 132


# ---- how many splits ----------------------------------------------------------------------

@pytest.mark.parametrize("batch,kv_heads,want", [(1, 8, 16), (1, 32, 4), (8, 8, 2), (8, 32, 1), (64, 8, 1)])
def test_splits_fill_one_wave(batch, kv_heads, want):
    # 32 query heads, q_len 1 (one query tile), 32k keys in 128-key tiles.
    assert choose_num_splits(batch, kv_heads, 32 // kv_heads, 1, 32768, SMS, 128) == want
    assert batch * kv_heads * want <= SMS or want == 1


@pytest.mark.parametrize("batch,want", [(1, 16), (8, 2), (64, 1)])
def test_heuristic_on_the_briefs_worked_examples(batch, want):
    # 132 SMs, 32 query / 8 K/V heads, q_len 1 (one packed query tile), 32k keys in FA3's 176-key
    # tiles. Batch 1: 8 CTAs -> one full wave of 16 splits (128 CTAs); FA3's rule (the smallest S
    # within 85% of the best wave efficiency) stops at 15, which measured slower here (the
    # docstring). Batch 8: 64 CTAs, 2 splits. Batch 64: 512 CTAs fill the SMs, no split.
    work_tiles, n_tiles = batch * 8, math.ceil(32768 / 176)
    assert n_tiles == 187
    assert num_splits_heuristic(work_tiles, n_tiles, SMS) == want
    # and the traffic cap does not bind at 32/8, 32k: far above these counts
    assert split_traffic_cap(4, 1, 32768) > 15


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


@pytest.mark.parametrize("n_tiles", [0, 1, 7, 64, 256, 1000])
@pytest.mark.parametrize("splits,claim_after", [(1, 4), (3, 1), (16, 4), (16, 2), (40, 4), (128, 4)])
def test_claimed_ranges_leave_every_other_tile_to_the_counter(n_tiles, splits, claim_after):
    # Claiming: each split's own first tiles, then the counter hands out [base, n_tiles) in any
    # interleaving; together they must be every tile exactly once.
    own = []
    for s in range(splits):
        lo, hi, base = claimed_split_range(n_tiles, splits, s, claim_after)
        assert 0 <= lo <= hi <= base <= n_tiles and hi - lo == min(claim_after, n_tiles // splits)
        own.extend(range(lo, hi))
    assert sorted(own + list(range(base, n_tiles))) == list(range(n_tiles))


def test_deterministic_algorithms_turn_claiming_off(monkeypatch):
    # torch.use_deterministic_algorithms(True): fixed shares, unless claim_after is set by the caller.
    from kernels import decode

    monkeypatch.setattr(decode, "listed_gpu", lambda gpus: False)  # an H100's defaults, whatever this host has

    assert decode.config(128)["claim_after"] > 0
    assert decode.make_launcher(128, "bfloat16", False, 4, 16, True, merge="last_cta").claim
    with deterministic():
        fixed = decode.make_launcher(128, "bfloat16", False, 4, 16, True, merge="last_cta")
        asked = decode.make_launcher(128, "bfloat16", False, 4, 16, True, merge="last_cta", claim_after=4)
    assert not fixed.claim and fixed.config["claim_after"] == 0 and asked.claim
    # and through the ordinary contract (compile_kernel), whose info reports what runs
    from kernels.contract import Problem

    p = Problem(1, 32, 1, 128, nheads_kv=8, seqlen_k=32768)
    assert decode.compile_kernel(p, num_splits=16).info["claim_after"] == 4
    with deterministic():
        assert decode.compile_kernel(p, num_splits=16).info["claim_after"] == 0
    assert decode.compile_kernel(p, num_splits=16, merge="combine").info["claim_after"] == 0  # Combine: fixed
    assert not torch.are_deterministic_algorithms_enabled()  # restored


def test_claiming_is_off_on_gpus_where_it_measured_slower(monkeypatch):
    # An H200: fixed shares by default (NO_CLAIM_GPUS), claim_after still honoured when asked for.
    from kernels import decode

    monkeypatch.setattr(decode, "listed_gpu", lambda gpus: gpus is decode.NO_CLAIM_GPUS)
    fixed = decode.make_launcher(128, "bfloat16", False, 4, 16, True, merge="last_cta")
    asked = decode.make_launcher(128, "bfloat16", False, 4, 16, True, merge="last_cta", claim_after=4)
    assert not fixed.claim and fixed.config["claim_after"] == 0 and asked.claim
    assert decode.gpu_listed(decode.NO_CLAIM_GPUS, "NVIDIA H200")
    assert decode.gpu_listed(decode.NO_CLAIM_GPUS, "NVIDIA H200 NVL")
    assert not decode.gpu_listed(decode.NO_CLAIM_GPUS, "NVIDIA H100 80GB HBM3")
    assert not decode.gpu_listed(decode.NO_CLAIM_GPUS, "NVIDIA GH200 480GB")


def test_two_ctas_share_an_sm_only_on_a_wide_unsplit_grid(monkeypatch):
    # SHARED_SM_GPUS: half-width tiles where S = 1 and the grid has more CTAs than SMs; a split
    # grid (one wave of one CTA per SM by design) and a caller's tile_n keep theirs.
    from kernels import decode

    assert decode.shared_sm_tile_n(128, 1, 133, 132) == 64
    assert decode.shared_sm_tile_n(128, 1, 132, 132) is None
    assert decode.shared_sm_tile_n(128, 2, 512, 132) is None
    assert decode.shared_sm_tile_n(64, 1, 2048, 132) is None  # d=64: three CTAs would share an SM
    for d, tile_n in decode.SHARED_SM_TILE_N.items():  # two fit in an SM's 227 KB (1 KB reserved each), not three
        assert tile_n < decode.DEFAULT_CONFIG[d]["tile_n"] and tile_n % 16 == 0
        cta = decode.smem_bytes(d, tile_n, decode.DEFAULT_CONFIG[d]["kv_stages"], merge="last_cta") + 1024
        assert 2 * cta <= 227 * 1024 < 3 * cta
    monkeypatch.setattr(decode, "listed_gpu", lambda gpus: gpus is decode.SHARED_SM_GPUS)
    wide = decode.make_launcher(128, "bfloat16", False, 1, 1, True, merge="last_cta", ctas=64 * 32)
    narrow = decode.make_launcher(128, "bfloat16", False, 4, 16, True, merge="last_cta", ctas=8)
    asked = decode.make_launcher(128, "bfloat16", False, 1, 1, True, merge="last_cta", ctas=64 * 32, tile_n=128)
    assert (wide.config["tile_n"], narrow.config["tile_n"], asked.config["tile_n"]) == (64, 128, 128)
    assert decode.grid_ctas(64, 32, 1, 1) == 2048 and decode.grid_ctas(1, 8, 4, 17) == 16  # 16 positions a tile
    # through the ordinary contract too: batch 64 x 32 K/V heads is 2048 CTAs, no split
    from kernels.contract import Problem

    monkeypatch.setattr(decode, "num_sms", lambda: 132)
    assert decode.compile_kernel(Problem(64, 32, 1, 128, nheads_kv=32, seqlen_k=4096)).info["tile_n"] == 64
    assert decode.compile_kernel(Problem(1, 32, 1, 128, nheads_kv=8, seqlen_k=4096)).info["tile_n"] == 128


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


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16])
def test_merge_of_random_cuts_with_empty_splits_and_rows(splits):
    gen = torch.Generator().manual_seed(splits)
    rows, d, n = 6, 8, 50
    s = 3 * torch.randn(rows, n, generator=gen, dtype=torch.float64)  # spread scores: the max matters
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    cuts = torch.randint(0, n + 1, (splits - 1,), generator=gen).sort().values.tolist()
    bounds = [0, *cuts, n]
    o_parts = torch.full((splits, rows, d), float("nan"), dtype=torch.float64)  # what an empty split holds: never read
    lse_parts = torch.full((splits, rows), -math.inf, dtype=torch.float64)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if lo < hi:
            o_parts[i] = torch.softmax(s[:, lo:hi], dim=-1) @ v[lo:hi]
            lse_parts[i] = torch.logsumexp(s[:, lo:hi], dim=-1)
    lse_parts[:, 2] = -math.inf  # row 2 sees no key in any split
    o, lse = merge_partials(o_parts, lse_parts)
    live = [r for r in range(rows) if r != 2]
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.allclose(o[live], torch.softmax(s[live], dim=-1) @ v, atol=1e-12)
    assert torch.allclose(lse[live], torch.logsumexp(s[live], dim=-1), atol=1e-12)
    assert bool((o[2] == 0).all()) and lse[2] == -math.inf


def test_merge_of_empty_splits_is_zero_and_minus_inf():
    o_parts = torch.full((3, 2, 4), float("nan"), dtype=torch.float64)  # never read: weight 0
    lse_parts = torch.full((3, 2), -math.inf, dtype=torch.float64)
    o, lse = merge_partials(o_parts, lse_parts)
    assert torch.equal(o, torch.zeros(2, 4, dtype=torch.float64)) and bool((lse == -math.inf).all())


# ---- the reference ------------------------------------------------------------------------------

def _explicit(q, k, v, lengths, causal, scale, window=(-1, -1)):
    """Attention row by row with Python loops: the definition, nothing shared with the reference."""
    b, q_len, h, d = q.shape
    group = h // k.shape[2]
    left, right = window
    o = torch.zeros(b, q_len, h, d, dtype=torch.float64)
    lse = torch.full((b, h, q_len), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(q_len):
                diagonal = i + lengths[bi] - q_len
                keys = [j for j in range(lengths[bi]) if (not causal or j <= diagonal)
                        and (left < 0 or j >= diagonal - left) and (right < 0 or causal or j <= diagonal + right)]
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


@pytest.mark.parametrize("causal,window", [(True, (0, -1)), (True, (3, -1)), (False, (2, 1)), (False, (-1, 0)),
                                           (True, (100, -1))])
def test_reference_kvcache_takes_a_sliding_window(causal, window):
    torch.manual_seed(4)
    q = torch.randn(3, 4, 6, 8)
    k, v = torch.randn(3, 9, 2, 8), torch.randn(3, 9, 2, 8)
    lengths = [9, 2, 0]
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = float("nan"), float("inf")
    o, lse = reference_kvcache(q, k, v, torch.tensor(lengths), causal, 0.3, window=window)
    o_want, lse_want = _explicit(q, k, v, lengths, causal, 0.3, window)
    assert not o.isnan().any() and torch.allclose(o, o_want, atol=1e-10)
    assert torch.equal(lse.isinf(), lse_want.isinf()) and torch.allclose(lse[~lse.isinf()], lse_want[~lse.isinf()])
    peer = sdpa_kvcache(q.float(), k.float(), v.float(), torch.tensor(lengths), causal, 0.3, window=window)
    assert torch.allclose(peer.double(), o_want, atol=1e-5)


def test_a_decode_window_sizes_the_split_count_by_its_keys():
    from harness.kvcache import window_keys
    from kernels.contract import Problem

    p = Problem(4, 32, 2, 128, causal=True, seqlen_k=65536, nheads_kv=8)
    assert window_keys(p) is None and window_keys(p, 4096) == 4096
    assert window_keys(p.with_(window=(1000, -1))) == 1002 and window_keys(p.with_(window=(1000, -1)), 500) == 500
    # not causal, the right edge stops at the cache's end: the same keys, so the same split count
    assert window_keys(p.with_(causal=False, window=(1000, 3))) == 1002
    assert window_keys(p.with_(causal=False, window=(1000, -1))) == 1002
    assert window_keys(p.with_(window=(-1, 0))) is None


def test_attention_with_kvcache_refuses_a_bad_window():
    q, k, v = _tensors()
    with pytest.raises(UnsupportedProblem, match=">= -1"):
        attention_with_kvcache(q, k, v, window_size=(-2, 0))
    with pytest.raises(UnsupportedProblem, match="pair of ints"):
        attention_with_kvcache(q, k, v, window_size=5)


@pytest.mark.parametrize("lengths", [None, 5, 0])
def test_reference_kvcache_takes_an_int_or_none(lengths):
    torch.manual_seed(2)
    q = torch.randn(2, 3, 4, 8)
    k, v = torch.randn(2, 7, 1, 8), torch.randn(2, 7, 1, 8)
    if lengths is not None:
        k[:, lengths:], v[:, lengths:] = float("inf"), float("nan")
    o, lse = reference_kvcache(q, k, v, lengths, True, 0.5)
    o_want, lse_want = _explicit(q, k, v, [7 if lengths is None else lengths] * 2, True, 0.5)
    assert torch.allclose(o, o_want, atol=1e-10) and torch.equal(lse.isinf(), lse_want.isinf())
    assert torch.allclose(lse[~lse.isinf()], lse_want[~lse.isinf()])
    o32, lse32 = reference_kvcache(q, k, v, lengths, True, 0.5, dtype=torch.float32)
    assert o32.dtype == torch.float32 and torch.allclose(o32.double(), o, atol=1e-5)


def test_reference_kvcache_reads_what_is_inside_the_lengths():
    # The guard against a reference that hides NaN: one planted inside a length must show.
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    v[0, 2] = float("nan")
    assert reference_kvcache(q, k, v, 3, False, 1.0)[0].isnan().all()
    assert not reference_kvcache(q, k, v, 2, False, 1.0)[0].isnan().any()


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_kvcache_is_a_16_bit_peer(causal):
    torch.manual_seed(3)
    q = torch.randn(3, 4, 8, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(3, 40, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([40, 2, 0])  # causal, q_len 4 over 2 keys: two rows see nothing
    k[1, 2:], v[1, 2:] = float("nan"), float("inf")
    ref, _ = reference_kvcache(q, k, v, lengths, causal, 0.125)
    peer = sdpa_kvcache(q, k, v, lengths, causal, 0.125)
    assert peer.dtype == torch.bfloat16 and not peer.isnan().any()
    err = (peer.double() - ref).abs().max()
    assert 0 < err < 2e-2  # 16-bit rounding: not exact, not wrong
    assert bool((peer[2] == 0).all())
    if causal:
        assert bool((peer[1, :2] == 0).all()) and bool((peer[1, 2:] != 0).any())


def test_check_counts_minus_inf_rows_as_equal_and_nan_as_failed():
    ref = torch.randn(1, 2, 3, 8)
    ref[0, 1] = 0  # query row 1 sees no key: O = 0, LSE = -inf
    ref_lse = torch.randn(1, 3, 2)
    ref_lse[0, :, 1] = -math.inf
    assert compare(ref.bfloat16(), ref, ref_lse.clone(), ref_lse, "bfloat16").verdict == ""
    assert float(lse_gap(ref_lse, ref_lse).max()) == 0
    for bad in (float("nan"), 0.0, math.inf):  # the row's LSE: NaN, finite, +inf: each a failure
        lse = ref_lse.clone()
        lse[0, 0, 1] = bad
        assert "lse" in compare(ref, ref, lse, ref_lse, "bfloat16").verdict
    lse = ref_lse.clone()
    lse[0, 0, 0] = -math.inf  # -inf where the reference sees keys
    assert "lse" in compare(ref, ref, lse, ref_lse, "bfloat16").verdict
    assert lse_gap(lse, ref_lse)[0, 0, 0] == math.inf


# ---- refusals, before anything is launched -------------------------------------------------------

def _tensors(b=2, q_len=1, h=32, hk=8, s=64, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, q_len, h, d).to(dtype), torch.randn(b, s, hk, d).to(dtype),
            torch.randn(b, s, hk, d).to(dtype))


@pytest.mark.parametrize("make,match", [
    (lambda: _tensors(h=32, hk=6), "multiple of the caches' nheads_kv"),
    (lambda: _tensors(h=8, hk=32), "multiple of the caches' nheads_kv"),
    (lambda: (*_tensors()[:2], _tensors(s=32)[2]), "one shape"),
    (lambda: (_tensors(b=3)[0], *_tensors()[1:]), "q's batch and head_dim"),
    (lambda: (_tensors(d=64)[0], *_tensors()[1:]), "q's batch and head_dim"),
    (lambda: _tensors(d=80), "head_dim 80"),
    (lambda: _tensors(dtype=torch.float32), "bfloat16, float16 or float8_e4m3fn"),
    (lambda: _tensors(dtype=torch.float8_e4m3fn), "float8_e4m3fn"),
    (lambda: (_tensors()[0][0], *_tensors()[1:]), "4-D"),
    (lambda: (*_tensors()[:2], _tensors(dtype=torch.float16)[2]), "share a dtype"),
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


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_return_lse_must_be_a_bool(flag):
    with pytest.raises(UnsupportedProblem, match="return_lse must be a bool"):
        attention_with_kvcache(*_tensors(), return_lse=flag)


def test_cpu_tensors_are_refused_after_the_shape_checks():
    with pytest.raises(UnsupportedProblem, match="CUDA"):
        attention_with_kvcache(*_tensors(), torch.full((2,), 10, dtype=torch.int32))


@pytest.mark.parametrize("kw,match", [(dict(nheads_kv=6), "multiple of nheads_kv"),
                                      (dict(max_seqlen_k=0), "max_seqlen_k"),
                                      (dict(head_dim=96), "head_dim 96"),
                                      (dict(head_dim=80), "head_dim 80"),
                                      (dict(nheads=8, nheads_kv=32), "multiple of nheads_kv"),
                                      (dict(dtype="float32"), "bfloat16"),
                                      (dict(num_splits=129), "num_splits"),
                                      (dict(kernel="k4"), "kernel must be one of"),
                                      (dict(device="cpu"), "CUDA device")])
def test_decode_plan_refuses_with_the_constraint(kw, match):
    args = dict(batch=2, nheads=32, nheads_kv=8, head_dim=128, max_seqlen_k=4096)
    args.update(kw)
    with pytest.raises(UnsupportedProblem, match=match):
        decode_plan(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_decode_plan_without_a_gpu_is_refused_not_an_assertion():
    with pytest.raises(UnsupportedProblem, match="CUDA GPU"):
        decode_plan(2, 32, 8, 128, 4096)


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
    ((2, 32, 8, 1, 4000), [4000, 2500], False, 3),  # forced splits: also against auto's LSE
    ((2, 32, 8, 1, 4000), [4000, 2500], False, 40),  # more splits than the 32 tiles
    ((2, 32, 8, 1, 3000), [3000, 17], True, 0),  # causal at q_len 1: bitwise the non-causal result
    ((1, 32, 8, 5, 64), [2], True, 0),  # 5 queries on 2 keys: three rows see nothing
])
def test_kvcache_cases(kernel, shape, lengths, causal, splits):
    from harness.check import KVCacheCase, check_kvcache

    row = check_kvcache(KVCacheCase(kernel, *shape, 128, causal, lengths, splits, graph=True))
    assert row["ok"], row["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["decode", "decode_combine"])
@pytest.mark.parametrize("shape,lengths,causal,window,extra", [
    ((3, 32, 8, 4, 8192), [8192, 3001, 0], True, (100, -1), {}),
    ((3, 32, 8, 4, 8192), [8192, 3001, 0], True, (0, -1), {}),  # one key per query: its own
    ((2, 32, 8, 1, 8192), [8192, 1500], True, (10000, -1), dict(graph=True)),  # wider than the cache
    ((3, 32, 8, 4, 3000), [3000, 1111, 0], True, (300, -1), dict(page_size=16)),
    ((2, 32, 8, 1, 4000), [4000, 2500], False, (1000, -1), dict(num_splits=7)),
    ((2, 32, 8, 3, 4000), [4000, 2500], False, (200, 1), {}),
])
def test_kvcache_with_a_sliding_window(kernel, shape, lengths, causal, window, extra):
    from harness.check import KVCacheCase, check_kvcache

    row = check_kvcache(KVCacheCase(kernel, *shape, 128, causal, lengths, window=window, **extra))
    assert row["ok"], row["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("corrupt,reason", [
    (lambda o, lse: o[0, 0, 5].add_(0.05), "max_abs"),  # one head's output slightly off
    (lambda o, lse: lse[1, :, 0].fill_(float("nan")), "lse"),  # NaN where the reference is -inf
    (lambda o, lse: o[1].fill_(float("nan")), "non-finite"),  # a sequence of length 0 never written
])
def test_check_kvcache_catches_a_wrong_result(monkeypatch, corrupt, reason):
    import harness.kvcache
    from harness.check import KVCacheCase, check_kvcache

    real = harness.kvcache.attention_with_kvcache

    def wrong(*args, **kw):
        o, lse = real(*args, **kw)
        corrupt(o, lse)
        return o, lse

    monkeypatch.setattr(harness.kvcache, "attention_with_kvcache", wrong)
    row = check_kvcache(KVCacheCase("decode", 2, 32, 8, 1, 1000, 128, False, [1000, 0]))
    assert not row["ok"] and "attention_with_kvcache" in row["reason"] and reason in row["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lengths_on_the_wrong_device_or_dtype_are_refused():
    q, k, v = (t.cuda() for t in _tensors())
    with pytest.raises(UnsupportedProblem, match="cache_seqlens must be on q's device"):
        attention_with_kvcache(q, k, v, torch.full((2,), 10, dtype=torch.int32))
    plan = decode_plan(2, 32, 8, 128, 64)
    with pytest.raises(UnsupportedProblem, match="int32"):
        plan.run(q, k, v, torch.full((2,), 10, dtype=torch.int64, device="cuda"))
    with pytest.raises(UnsupportedProblem, match="make a plan for this shape"):
        plan.run(q[:1], k[:1], v[:1], torch.full((1,), 10, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [0, 128])
def test_kvcache_call_under_torch_compile_matches_eager(page_size):
    from harness.check import paged_cache

    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 3000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    table = None
    if page_size:
        k, v, table = paged_cache(k, v, page_size, [3000, 1234], torch.Generator(device="cuda").manual_seed(1))

    def step(q, k, v, lens, table):
        out, lse = attention_with_kvcache(q, k, v, lens, page_table=table, causal=True, return_lse=True)
        return out * 2, lse

    with deterministic():  # fixed split shares: the same bits on every call (claiming is not)
        eager = step(q, k, v, lens, table)
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True)(q, k, v, lens, table)  # a graph break would be an error
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [0, 64])
@pytest.mark.parametrize("merge", ["last_cta", "last_split"])
@pytest.mark.parametrize("shape,lengths,causal,splits,claim_after", [
    ((1, 32, 8, 1, 32768), [32768], False, 16, 4),
    ((4, 32, 8, 1, 8192), [0, 1, 127, 8192], False, 16, 2),  # empty splits, a length of 0; 32 of 64 tiles claimed
    ((3, 32, 8, 4, 1000), [1000, 5, 2], True, 7, 1),
    ((2, 28, 4, 17, 3000), [2999, 1500], True, 5, 2),  # two query tiles: two counters per head
])
def test_claimed_tiles_match_the_reference_launch_after_launch(merge, shape, lengths, causal, splits, claim_after,
                                                               page_size):
    # claim_after (on by default at d=64/128): the splits take tiles off a per-head counter that the
    # merging CTA resets. Three launches on one set of buffers: a counter left non-zero would skip
    # tiles (tune_decode.py checks again after back-to-back graph replays, where PDL overlaps them).
    # Paged (64-key pages: two boxes per 128-key tile): a claimed tile's pages are looked up after its claim.
    from harness.check import paged_cache
    from kernels import decode

    b, h, h_kv, q_len, s_cache = shape
    la = decode.make_launcher(128, "bfloat16", causal, h // h_kv, splits, True, merge=merge,
                              claim_after=claim_after, page_size=page_size)
    q = torch.randn(b, q_len, h, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s_cache, h_kv, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for i, n in enumerate(lengths):  # stale rows: NaN, never read
        k[i, n:], v[i, n:] = float("nan"), float("nan")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scale = 128 ** -0.5
    want_o, want_lse = reference_kvcache(q, k, v, lens, causal, scale)
    peer = sdpa_kvcache(q, k, v, lens, causal, scale)
    table = None
    if page_size:
        k, v, table = paged_cache(k, v, page_size, lengths, torch.Generator(device="cuda").manual_seed(0))
    buffers = la.buffers(b, q_len, h, "cuda")
    for launch in range(3):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, q_len), float("nan"), device="cuda")
        la.launch(q, k, v, out, lse, lens, scale, buffers, table)
        verdict = compare(out, want_o, lse, want_lse, "bfloat16", peer=peer).verdict
        assert not verdict, f"launch {launch}: {verdict}"
    assert int(buffers[2].abs().sum()) == 0  # every counter back at 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal,q_len", [(False, 1), (True, 4)])
def test_shared_sm_tiles_match_the_reference(monkeypatch, d, causal, q_len):
    # SHARED_SM_TILE_N on any GPU: one more sequence x 4 K/V heads (group 8) than fills the SMs (34 on
    # 132 SMs: 136 CTAs), no split, so the public calls take the half-width tiles; ragged lengths (0, 1,
    # a partial last tile), NaN past them.
    from harness import kvcache
    from kernels import decode

    monkeypatch.setattr(decode, "listed_gpu", lambda gpus: gpus is decode.SHARED_SM_GPUS)
    monkeypatch.setattr(kvcache, "_LAUNCHERS", {})
    monkeypatch.setattr(kvcache, "_PREPARED", {})
    h, h_kv, s_cache = 32, 4, 1000
    b = decode.num_sms() // h_kv + 1
    q = torch.randn(b, q_len, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s_cache, h_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = [0, 1, 17, 999, 1000] + torch.randint(1, s_cache + 1, (b - 5,)).tolist()
    for i, n in enumerate(lengths):
        k[i, n:], v[i, n:] = float("nan"), float("nan")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    plan = decode_plan(b, h, h_kv, d, s_cache, q_len=q_len, causal=causal)
    assert plan.num_splits == 1 and plan.info["tile_n"] == decode.SHARED_SM_TILE_N[d]
    want_o, want_lse = reference_kvcache(q, k, v, lens, causal, d ** -0.5)
    peer = sdpa_kvcache(q, k, v, lens, causal, d ** -0.5)
    plan.out.fill_(float("nan"))
    plan.lse.fill_(float("nan"))
    out, lse = plan.run(q, k, v, lens)
    verdict = compare(out, want_o, lse, want_lse, "bfloat16", peer=peer).verdict
    assert not verdict, verdict
    got = attention_with_kvcache(q, k, v, lens, causal=causal)  # the one-call API: same kernel, same bits
    assert torch.equal(got, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_call_reuses_its_buffers_and_a_captured_call_owns_its_own(monkeypatch):
    # Eager calls reuse the split partials, counters and an unrequested LSE of their shape and
    # stream (one StreamBuffers set); a call captured in a CUDA graph makes its own and keeps none, so
    # dropping the eager sets (as MAX shapes would) cannot free what the graph replays.
    from harness import kvcache
    from kernels import decode
    from kernels.contract import StreamBuffers

    made, get = [], StreamBuffers.get

    def counting(self, device_index, shape_key, make):
        return get(self, device_index, shape_key, lambda: made.append(shape_key) or make())

    monkeypatch.setattr(StreamBuffers, "get", counting)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([8000], dtype=torch.int32, device="cuda")
    with deterministic():  # fixed split shares: eager and replayed calls give the same bits
        first = attention_with_kvcache(q, k, v, lens)
        launcher = kvcache._PREPARED[kvcache._call_signature(q, k, v, lens, None, False, None, 0, False, "decode")].launcher
        assert launcher.num_splits > 1
        n_made = len(made)
        assert torch.equal(attention_with_kvcache(q, k, v, lens), first)
        assert len(made) == n_made  # the second call made nothing

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            attention_with_kvcache(q, k, v, lens)  # warm up off the default stream before capture
        torch.cuda.current_stream().wait_stream(stream)

        kept = dict(launcher.eager._sets)
        n_made = len(made)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = attention_with_kvcache(q, k, v, lens)
        assert len(made) == n_made + 1  # the partials, counters and LSE were made for the captured call ...
        assert launcher.eager._sets == kept  # ... and not kept
        launcher.eager._sets.clear()  # the eager sets freed, then reused by a larger call
        attention_with_kvcache(*(torch.randn(2, n, 32 if n == 1 else 8, 128, device="cuda", dtype=torch.bfloat16)
                                 for n in (1, 16384, 16384)), torch.tensor([16384, 9000], dtype=torch.int32,
                                                                           device="cuda"))
        q.copy_(torch.randn_like(q))
        lens.fill_(5000)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = attention_with_kvcache(q, k, v, lens)
    assert not captured.isnan().any() and torch.equal(captured, want)


def test_fresh_buffers_keep_nothing():
    # What the custom ops' bodies run under: every set made anew, none kept (no CUDA needed).
    from kernels.contract import StreamBuffers, fresh_buffers

    sets, made = StreamBuffers(), []
    with fresh_buffers():
        for _ in range(2):
            sets.get(0, (1, 1, 32), lambda: made.append(1) or object())
    assert len(made) == 2 and not sets._sets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kvcache_call_under_reduce_overhead_compile_matches_eager():
    # torch.compile with CUDA graphs: the op's warm-up run allocates from the graph's pool, so its
    # body keeps no eager buffer set (fresh_buffers); three replays with new lengths each.
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([8000], dtype=torch.int32, device="cuda")

    def step(q, k, v, lens):
        return attention_with_kvcache(q, k, v, lens) * 1.0

    with deterministic():
        torch._dynamo.reset()
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        for n in (8000, 5000, 123, 8192):
            lens.fill_(n)
            got = compiled(q, k, v, lens).clone()
            assert torch.equal(got, step(q, k, v, lens)), n


# ---- a paged KV cache ----------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128, 256])
def test_a_tile_takes_one_box_per_page_when_pages_are_smaller(d):
    from kernels.decode import MIN_PAGE, config, page_boxes

    tile = config(d)["tile_n"]
    for page in (tile, 2 * tile, 3 * tile):
        assert page_boxes(tile, page) == 1
    for page in (tile // 2, tile // 4, MIN_PAGE):
        assert page_boxes(tile, page) == tile // page
    for page in (8, tile + 16, 3 * MIN_PAGE, 1):
        with pytest.raises(UnsupportedProblem, match=f"page_size must be a multiple of {tile}"):
            page_boxes(tile, page)


@pytest.mark.parametrize("lengths", [[40, 64, 0], [17, 1, 64]])
def test_paged_cache_reads_back_through_its_table(lengths):
    # The check's paged inputs: shuffled pages, a NaN page for entries past each length; read
    # through the table they are the contiguous caches on every row inside the lengths.
    from harness.check import paged_cache
    from harness.reference import pages_to_cache

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 64, 2, 16), torch.randn(3, 64, 2, 16)
    kp, vp, table = paged_cache(k, v, 16, lengths, gen)
    assert kp.shape == (3 * 4 + 1, 16, 2, 16) and table.dtype == torch.int32 and table.shape == (3, 4)
    assert 0 <= int(table.min()) and int(table.max()) <= 12  # every entry names a page of the pool
    for b, n in enumerate(lengths):
        live = -(-n // 16)
        assert len(set(table[b, :live].tolist())) == live and 12 not in table[b, :live].tolist()
        assert (table[b, live:] == 12).all()
        for got, want in ((pages_to_cache(kp, table), k), (pages_to_cache(vp, table), v)):
            assert torch.equal(got[b, :n], want[b, :n])
            assert got[b, live * 16:].isnan().all()
    assert kp[12].isnan().all() and vp[12].isnan().all()
    assert len(set(table[table != 12].tolist())) == int((table != 12).sum())  # no page used twice


def _paged(b=2, pages=8, page=128, hk=8, d=128, table=None):
    q, _, _ = _tensors(b=b, hk=hk, d=d)
    kp, vp = (torch.randn(pages, page, hk, d).to(torch.bfloat16) for _ in range(2))
    if table is None:
        table = torch.arange(pages, dtype=torch.int32).view(b, pages // b)
    return q, kp, vp, table


@pytest.mark.parametrize("make,match", [
    (lambda: _paged(table=torch.zeros(2, 4, dtype=torch.int64)), "page_table must be int32"),
    (lambda: _paged(table=torch.zeros(3, 4, dtype=torch.int32)), r"page_table must be \(2, max_pages\)"),
    (lambda: _paged(table=torch.zeros(2, dtype=torch.int32)), r"page_table must be \(2, max_pages\)"),
    (lambda: _paged(table=torch.zeros(2, 0, dtype=torch.int32)), r"page_table must be \(2, max_pages\)"),
    (lambda: _paged(table=torch.zeros(4, 2, dtype=torch.int32).t()), "rows must be contiguous"),
    (lambda: _paged(table=[[0, 1], [2, 3]]), "page_table must be None or an int32 tensor"),
    (lambda: _paged(page=96), "page_size must be a multiple of 128"),
    (lambda: _paged(page=8), "page_size must be a multiple of 128"),
    (lambda: _paged(d=64, page=96), "page_size must be a multiple of 256"),
])
def test_a_paged_call_refuses_with_the_constraint(make, match):
    q, kp, vp, table = make()
    with pytest.raises(UnsupportedProblem, match=match):
        attention_with_kvcache(q, kp, vp, page_table=table)


def test_a_paged_cache_is_not_taken_for_a_contiguous_one():
    # Without its table, a pool of 8 pages against a batch of 2 is a batch mismatch, named as such.
    q, kp, vp, _ = _paged()
    with pytest.raises(UnsupportedProblem, match="a paged cache needs a page_table"):
        attention_with_kvcache(q, kp, vp)
    q, kp, vp, table = _paged()  # a valid paged call on the CPU gets as far as the device check
    with pytest.raises(UnsupportedProblem, match="CUDA"):
        attention_with_kvcache(q, kp, vp, torch.full((2,), 300, dtype=torch.int32), page_table=table)
    with pytest.raises(UnsupportedProblem, match=r"\[0, s_cache = 512\]"):  # 4 pages of 128 per sequence
        attention_with_kvcache(q, kp, vp, 513, page_table=table)


@pytest.mark.parametrize("page_size,match", [(-1, "page_size must be an int"), (True, "page_size must be an int"),
                                             (96, "page_size must be a multiple of 128")])
def test_decode_plan_refuses_a_page_size(page_size, match):
    with pytest.raises(UnsupportedProblem, match=match):
        decode_plan(2, 32, 8, 128, 4096, page_size=page_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["decode", "decode_combine"])
@pytest.mark.parametrize("d,page_size,shape,lengths,causal,splits", [
    (128, 128, (4, 32, 8, 1, 8192), [0, 1, 127, 8192], False, 0),  # a page per tile: also bitwise the contiguous
    (128, 256, (3, 32, 8, 4, 1000), [1000, 5, 2], True, 0),  # 1000 rows: the last page half NaN padding
    # 16-key pages: eight boxes per 128-key tile. The last sequence is full: 188 pages, so the last
    # 4 boxes of its tail tile have no table entry (memcheck: scripts/sanitize_case.py --page-size 16)
    (128, 16, (2, 32, 8, 1, 3000), [17, 3000], False, 0),
    (128, 64, (2, 28, 4, 17, 3000), [2999, 1500], True, 5),
    (128, 128, (2, 32, 8, 1, 5000), 4321, False, 0),  # an int length: a tensor the kernel reads
    (128, 128, (34, 32, 4, 1, 1000), [0, 1] + [1000 - 29 * i for i in range(32)], False, 0),  # wide, unsplit
    (128, 32, (34, 32, 4, 1, 1000), [0, 1] + [1000 - 29 * i for i in range(32)], True, 0),  # and small pages
    (64, 16, (2, 32, 8, 2, 3000), [3000, 1500], True, 0),  # sixteen boxes per 256-key tile: every lane looks up
    (64, 256, (2, 32, 8, 1, 4096), None, False, 7),  # no lengths: every page of the table
    (64, 128, (3, 32, 8, 4, 1000), [1000, 5, 2], True, 0),
    (256, 64, (2, 32, 8, 4, 3000), [3000, 1111], True, 0),
    (256, 32, (2, 32, 4, 1, 4097), [4097, 40], False, 0),
])
def test_paged_kvcache_cases(kernel, d, page_size, shape, lengths, causal, splits):
    # check_kvcache on shuffled pages (a NaN page named past every length, NaN padding in the last
    # page): the call, bitwise against the contiguous cache; forced splits where given; with
    # per-sequence lengths the plan and a graph replay after the pages move.
    from harness.check import KVCacheCase, check_kvcache

    row = check_kvcache(KVCacheCase(kernel, *shape, d, causal, lengths, splits, graph=True, page_size=page_size))
    assert row["ok"], row["reason"]
