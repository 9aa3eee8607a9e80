"""A plain-PyTorch model of the tiled online-softmax recurrence that K2 onward implement.

It walks the same tiles in the same order as the kernels (query tiles of ``tile_m`` rows,
KV tiles of ``tile_n`` keys, causal tiles above the diagonal skipped, masks only where a tile
crosses the diagonal or seqlen) and keeps the same per-row state: running max ``m``, running
sum ``l`` and an unnormalized accumulator ``acc``. Read it beside docs/k2.md; the tests check
it against plain softmax attention, so the recurrence is right before any kernel runs it.
"""

from __future__ import annotations

import math


def kv_tile_count(m_block: int, seqlen: int, tile_m: int, tile_n: int, causal: bool) -> int:
    """Python twin of ``kernels.tiles.kv_tile_count``."""
    n = -(-seqlen // tile_n)
    if causal:
        n = min(n, -(-((m_block + 1) * tile_m) // tile_n))
    return n


def unmasked_kv_tile_count(m_block: int, seqlen: int, tile_m: int, tile_n: int, causal: bool) -> int:
    """Python twin of ``kernels.tiles.unmasked_kv_tile_count``."""
    n = seqlen // tile_n
    if causal:
        n = min(n, (m_block * tile_m + 1) // tile_n)
    return n


def tiled_attention(q, k, v, causal: bool, scale: float, tile_m: int = 64, tile_n: int = 64):
    """(O, LSE, tiles_visited) for one head: q, k, v are (seqlen, d) float tensors."""
    import torch

    n, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(n, dtype=q.dtype)
    scale_log2 = scale * math.log2(math.e)  # exp(x*scale) == exp2(x*scale*log2(e))
    # The kernels load whole KV tiles; keys past seqlen arrive as zeros (TMA's out-of-bounds
    # fill) and must be masked, exactly like the padding here.
    n_pad = -(-n // tile_n) * tile_n
    k = torch.cat([k, k.new_zeros(n_pad - n, d)])
    v = torch.cat([v, v.new_zeros(n_pad - n, d)])
    visited = 0
    for m_block in range(-(-n // tile_m)):
        rows = torch.arange(m_block * tile_m, min((m_block + 1) * tile_m, n))
        m = torch.full((len(rows),), -math.inf, dtype=q.dtype)
        l = torch.zeros(len(rows), dtype=q.dtype)
        acc = torch.zeros(len(rows), d, dtype=q.dtype)
        n_tiles = kv_tile_count(m_block, n, tile_m, tile_n, causal)
        n_unmasked = unmasked_kv_tile_count(m_block, n, tile_m, tile_n, causal)
        for j in range(n_tiles):
            visited += 1
            cols = torch.arange(j * tile_n, (j + 1) * tile_n)
            s = (q[rows] @ k[cols].T) * scale_log2  # scores in the log2 domain
            if j >= n_unmasked:  # only tiles crossing seqlen or the diagonal carry a mask
                masked = cols[None, :] >= n
                if causal:
                    masked = masked | (cols[None, :] > rows[:, None])
                s = s.masked_fill(masked, -math.inf)
            m_new = torch.maximum(m, s.max(dim=1).values)
            # A row with every key masked so far keeps m = -inf: use 0 so exp2 sees -inf - 0.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp2(s - m_safe[:, None])
            correction = torch.exp2(m - m_safe)  # rescales what was accumulated so far
            l = l * correction + p.sum(dim=1)
            acc = acc * correction[:, None] + p @ v[cols]
            m = m_new
        l_safe = torch.where(l == 0, torch.ones_like(l), l)  # deferred normalization, guarded
        out[rows] = acc / l_safe[:, None]
        lse[rows] = (m + torch.log2(l_safe)) / math.log2(math.e)
    return out, lse, visited
