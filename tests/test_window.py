"""Sliding-window attention (issue 35) in the warp-specialized stages' forward. CPU: the tile
bounds against brute force, the builds, the refusals, the reference; GPU: the grid's cases."""

import itertools
import random
import re

import pytest
import torch

from harness import attention, varlen
from harness.reference import reference
from kernels import get_kernel
from kernels.contract import Problem, UnsupportedProblem
from kernels.tiles import kv_window_tiles


def _visible(m_block, seqlen, seqlen_k, tile_m, causal, window):
    """(row, key) pairs the window keeps for the query tile's rows (padding rows included, as the kernel's bounds)."""
    left, right = varlen.with_causal(window, causal)
    offset = seqlen_k - seqlen
    for row in range(m_block * tile_m, (m_block + 1) * tile_m):
        lo = 0 if left == -1 else max(row + offset - left, 0)
        hi = seqlen_k - 1 if right == -1 else min(row + offset + right, seqlen_k - 1)
        yield row, range(lo, hi + 1)


def test_the_window_tile_bounds_skip_only_invisible_tiles_and_leave_no_free_tile_masked():
    rnd = random.Random(0)
    for _ in range(400):
        tile_m, tile_n = rnd.choice([(64, 128), (128, 128), (192, 128), (128, 64), (128, 176)])
        seqlen = rnd.randint(1, 900)
        seqlen_k = seqlen + rnd.choice([0, 0, rnd.randint(1, 700)])
        causal = rnd.random() < 0.5
        window = (rnd.choice([-1, 0, 1, 63, 64, 130, 400]), rnd.choice([-1, 0, 5, 128, 300]))
        m_block = rnd.randrange(-(-seqlen // tile_m))
        first, free_lo, free_hi, end = kv_window_tiles(m_block, seqlen, seqlen_k, tile_m, tile_n, causal, window)
        rows = list(_visible(m_block, seqlen, seqlen_k, tile_m, causal, window))
        seen = {key // tile_n for _, keys in rows for key in keys}
        assert first <= free_lo <= free_hi <= end
        assert seen and min(seen) == first and max(seen) == end - 1  # exactly the tiles some row sees
        for t in range(free_lo, free_hi):  # a tile run without masks: every row sees all of its keys
            assert all(set(range(t * tile_n, (t + 1) * tile_n)) <= set(keys) for _, keys in rows)


@pytest.mark.parametrize("name,d,causal,window", [("k6", 64, False, (256, 64)), ("k6", 128, True, (256, -1)),
                                                  ("k6", 128, False, (300, 300)), ("k5", 128, False, (-1, 64))])
def test_a_window_builds_with_its_lower_edge_loop(name, d, causal, window):
    # 16k keys: K6's long-sequence configuration (the overlap at d = 128), the one a window model runs
    p = Problem(1, 8, 16384, d, causal=causal, window=window)
    capped = get_kernel(name).compile(p, keep_ptx=True)
    plain = get_kernel(name).compile(p.with_(window=(-1, -1)), keep_ptx=True)
    assert capped.info.get("cluster", 1) == 1  # a window gives each query tile its own K/V tiles
    shifts = [len(re.findall(r"shr\.b32", x.ptx)) for x in (plain, capped)]
    # the mask's keep-bits: one shift per 32 columns of a row at the upper edge; a left edge adds as many
    assert shifts[1] > shifts[0] if window[0] >= 0 else shifts[1] > 0


@pytest.mark.parametrize("window,match", [((1, 2, 3), "pair of ints"), ((-2, 0), ">= -1"), ((1.0, 2), "pair of ints"),
                                          ("64", "pair of ints")])
def test_a_bad_window_is_refused_by_name(window, match):
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(UnsupportedProblem, match=match):
        attention("k6", q, k, v, window_size=window)


def test_a_window_is_refused_where_it_cannot_run():
    q, k, v = (torch.randn(1, 2, 16, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(UnsupportedProblem, match="window_size \\(8, 8\\) not supported by this kernel"):
        attention("k4", q, k, v, window_size=(8, 8))
    with pytest.raises(UnsupportedProblem, match="more queries than keys"):
        attention("k6", q, k[:, :, :8], v[:, :, :8], window_size=(8, 8))
    from harness import attention_backward

    with pytest.raises(UnsupportedProblem, match="K10 \\(backward\\): a sliding window with more queries than keys"):
        attention_backward(q, k[:, :, :8], v[:, :, :8], q, torch.zeros(1, 2, 16), q, window_size=(8, 8))
    with pytest.raises(UnsupportedProblem, match="cluster=2"):
        get_kernel("k6").compile(Problem(1, 8, 4096, 128, window=(512, 0)), cluster=2)
    grad = [t.clone().requires_grad_() for t in (q, k, v)]
    with pytest.raises(UnsupportedProblem, match="K9 \\(backward\\): no sliding window or softcap"):
        attention("k6", *grad, window_size=(8, 0), backward="k9")


def test_the_backwards_query_tiles_are_the_forwards_key_tiles_turned_around():
    from kernels.tiles import query_window_tiles

    rnd = random.Random(1)
    for _ in range(1500):
        tile_m, tile_n = rnd.choice([(64, 128), (128, 128), (64, 64), (192, 128)])
        seqlen = rnd.randint(1, 700)
        seqlen_k = seqlen + rnd.choice([0, rnd.randint(1, 500)])
        causal, window = rnd.random() < 0.5, (rnd.choice([-1, 0, 1, 63, 130, 400]), rnd.choice([-1, 0, 5, 300]))
        args = (seqlen, seqlen_k, tile_m, tile_n, causal, window)
        forward = {(i, j) for i in range(-(-seqlen // tile_m)) for j in range(*kv_window_tiles(i, *args)[::3])}
        backward = {(i, j) for j in range(-(-seqlen_k // tile_n)) for i in range(*query_window_tiles(j, *args))}
        # K10's deterministic turns count on it: the key tiles a query tile waits for are those that visit it
        assert forward == backward


@pytest.mark.parametrize("causal,window", [(True, (256, -1)), (False, (100, 300))])
def test_k10_takes_a_window_deterministic_too(causal, window):
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 8, 1000, 64, causal=causal, window=window, nheads_kv=2)
    compiled = compile_backward(p, deterministic=True, **stage_overrides("k10_fa3"))
    assert compiled[3]["last_first"]  # both windows have a right edge: the shares arrive last key tile first


def test_a_causal_window_without_a_left_edge_is_plain_causal():
    assert Problem(1, 2, 16, 64, causal=True, window=(-1, 5)) == Problem(1, 2, 16, 64, causal=True)
    assert Problem(1, 2, 16, 64, causal=True, window=(7, 5)).window == (7, -1)


@pytest.mark.parametrize("causal,window", [(False, (3, 5)), (True, (4, -1)), (False, (-1, 0)), (False, (0, 0))])
def test_the_window_reference_agrees_with_the_packed_float64_one(causal, window):
    gen = torch.Generator().manual_seed(2)
    b, h, hk, n, nk, d = 2, 4, 2, 33, 47, 16
    q = torch.randn(b, h, n, d, generator=gen)
    k, v = (torch.randn(b, hk, nk, d, generator=gen) for _ in range(2))
    o, lse = reference(q, k, v, causal, 0.25, window=window)
    cu_q, cu_k = (torch.arange(0, (b + 1) * x, x, dtype=torch.int32) for x in (n, nk))
    packed = [t.transpose(1, 2).reshape(-1, t.shape[1], d) for t in (q, k, v)]
    o64, lse64 = varlen.reference(*packed, cu_q, cu_k, 0.25, causal=causal, window=window)
    assert torch.allclose(o, o64.float().reshape(b, n, h, d).transpose(1, 2), atol=1e-5)
    assert torch.allclose(lse, lse64.float().reshape(h, b, n).transpose(0, 1), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,d,causal,window,lengths", [  # ref_check's grid has the rest
    (name, d, causal, window, lengths)
    for name, d, (causal, window), lengths in itertools.product(
        ["k6"], [64, 128], [(False, (256, 0)), (False, (0, 0)), (True, (256, -1))], [(1000, 1000), (1000, 4097)])]
    + [("k5", 128, False, (100, 300), (1000, 4097)), ("k6", 256, True, (511, -1), (1000, 1000))])
def test_a_windowed_forward_matches_the_explicit_reference(name, d, causal, window, lengths):
    from harness.check import check_kernel

    p = Problem(2, 4, lengths[0], d, causal=causal, seqlen_k=lengths[1], nheads_kv=2, window=window)
    res = check_kernel(name, p)
    assert res.ok, res.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backward", ["k10", "k10_fa3"])
@pytest.mark.parametrize("d,causal,window,lengths", [(64, True, (256, -1), (1000, 1000)), (128, False, (100, 300), (1000, 4097)),
                                                     (128, False, (0, 0), (1000, 1000)), (128, True, (511, -1), (1000, 4097))])
def test_the_windowed_backward_matches_float64_autograd(backward, d, causal, window, lengths):
    from harness.check import check_backward

    p = Problem(2, 4, lengths[0], d, causal=causal, seqlen_k=lengths[1], nheads_kv=2, window=window)
    row = check_backward(p, backward=backward)
    assert row["ok"], row["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_windowed_deterministic_backward_repeats_bit_for_bit():
    from harness import attention_backward

    q, k, v = (torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    out, lse = attention("k6", q, k, v, causal=True, return_lse=True, window_size=(256, 0))
    torch.use_deterministic_algorithms(True)
    try:
        runs = [attention_backward(q, k, v, out, lse, dout, causal=True, window_size=(256, 0)) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_long_windowed_call_is_right_where_the_overlap_and_many_tiles_run():
    from harness.check import check_kernel

    for causal in (False, True):  # 16k keys at d = 128: K6's overlap, tiles skipped on both sides
        res = check_kernel("k6", Problem(1, 4, 16384, 128, causal=causal, window=(1024, 0 if not causal else -1)))
        assert res.ok, res.reason


def test_the_peers_get_the_window_in_flash_attns_terms_and_ours_in_ours():
    from harness.peers import fa4_feature_options, feature_options

    assert feature_options() == {} and fa4_feature_options(False) == {}
    assert feature_options(5.0, (100, -1)) == {"softcap": 5.0, "window_size": (100, -1)}
    assert fa4_feature_options(False, 5.0, (100, -1)) == {"softcap": 5.0, "window_size": (100, None)}
    assert fa4_feature_options(True, 0.0, (-1, 7)) == {"window_size": (None, 0)}  # causal: the diagonal
