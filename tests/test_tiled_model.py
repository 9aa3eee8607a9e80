"""The tiled online-softmax recurrence (harness/tiled_model.py) against plain softmax attention."""

import math

import pytest
import torch

from harness.tiled_model import kv_tile_count, tiled_attention, unmasked_kv_tile_count


def softmax_attention(q, k, v, causal, scale):
    s = (q @ k.T) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("seqlen", [1, 17, 64, 100, 257])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiles", [(64, 64), (128, 64), (64, 128)])
def test_tiled_recurrence_matches_softmax(seqlen, causal, tiles):
    torch.manual_seed(seqlen * 7 + causal)
    d = 32
    q, k, v = (torch.randn(seqlen, d, dtype=torch.float64) for _ in range(3))
    scale = 1 / math.sqrt(d)
    out, lse, _ = tiled_attention(q, k, v, causal, scale, *tiles)
    ref, ref_lse = softmax_attention(q, k, v, causal, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


def test_causal_skips_tiles_above_the_diagonal():
    n, tm, tn = 256, 64, 64
    q = k = v = torch.randn(n, 8, dtype=torch.float64)
    _, _, dense = tiled_attention(q, k, v, False, 1.0, tm, tn)
    _, _, causal = tiled_attention(q, k, v, True, 1.0, tm, tn)
    assert dense == 16
    assert causal == 1 + 2 + 3 + 4  # lower triangle of a 4x4 tile grid, diagonal included


@pytest.mark.parametrize("seqlen", [1, 17, 64, 65, 1000, 4097])
@pytest.mark.parametrize("tiles", [(64, 64), (128, 64), (128, 128), (64, 128)])
def test_unmasked_tiles_need_no_mask(seqlen, tiles):
    tm, tn = tiles
    for m_block in range(-(-seqlen // tm)):
        total = kv_tile_count(m_block, seqlen, tm, tn, True)
        free = unmasked_kv_tile_count(m_block, seqlen, tm, tn, True)
        assert 0 <= free <= total
        assert (total - 1) * tn <= min((m_block + 1) * tm, seqlen) - 1  # the last tile holds a visible key
        for j in range(free):  # every key of an unmasked tile is in range and at or below every row
            assert (j + 1) * tn <= seqlen and (j + 1) * tn - 1 <= m_block * tm
