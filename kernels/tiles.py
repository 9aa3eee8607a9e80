"""Tile index math shared by the fused kernels (K2 onward).

A CTA owns query rows [m_block * tile_m, (m_block + 1) * tile_m) and walks KV tiles of
tile_n keys. Non-causal it visits all ceil(N / tile_n) of them; causal it stops at the tile
holding the last query row's diagonal, so tiles entirely above the diagonal are never
touched. Only the last visited tiles need element masks: the one holding the diagonal
(causal) and the one running past seqlen (any N that is not a multiple of tile_n).

From K5 on, keys may outnumber queries (``seqlen_k``; chunked prefill): the causal diagonal is
then aligned bottom-right, query row i seeing keys j <= i + (seqlen_k - seqlen), as flash-attn
does. Without ``seqlen_k`` (K2-K4) the code is what it was.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def kv_tile_count(m_block: Int32, seqlen: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                  causal: cutlass.Constexpr, seqlen_k=None) -> Int32:
    """Number of KV tiles query tile ``m_block`` must visit (always >= 1 for a valid tile)."""
    n_tiles = cute.ceil_div(seqlen if cutlass.const_expr(seqlen_k is None) else seqlen_k, tile_n)
    if cutlass.const_expr(causal):
        last_row_key = (m_block + 1) * tile_m  # one past the last key the tile's last row sees
        if cutlass.const_expr(seqlen_k is not None):
            last_row_key = last_row_key + seqlen_k - seqlen
        n_tiles = cutlass.min(n_tiles, cute.ceil_div(last_row_key, tile_n))
    return n_tiles


@cute.jit
def unmasked_kv_tile_count(m_block: Int32, seqlen: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                           causal: cutlass.Constexpr, seqlen_k=None) -> Int32:
    """Leading KV tiles that need no mask at all: fully inside seqlen and, causal, fully
    at or below the diagonal for every row of the query tile."""
    n_full = (seqlen if cutlass.const_expr(seqlen_k is None) else seqlen_k) // tile_n
    if cutlass.const_expr(causal):
        first_row_key = m_block * tile_m + 1  # one past the last key the tile's first row sees
        if cutlass.const_expr(seqlen_k is not None):
            first_row_key = first_row_key + seqlen_k - seqlen
        n_full = cutlass.min(n_full, first_row_key // tile_n)
    return n_full
