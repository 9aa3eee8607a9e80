"""Tile index math shared by the fused kernels (K2 onward).

A CTA owns query rows [m_block * tile_m, (m_block + 1) * tile_m) and walks KV tiles of
tile_n keys. Non-causal it visits all ceil(N / tile_n) of them; causal it stops at the tile
holding the last query row's diagonal, so tiles entirely above the diagonal are never
touched. Only the last visited tiles need element masks: the one holding the diagonal
(causal) and the one running past seqlen (any N that is not a multiple of tile_n).

From K5 on, keys may outnumber queries (``seqlen_k``; chunked prefill): the causal diagonal is
then aligned bottom-right, query row i seeing keys j <= i + (seqlen_k - seqlen), as flash-attn
does. Without ``seqlen_k`` (K2-K4) the code is what it was.

A sliding window (``kv_window_tiles``) bounds the walk on both sides: the tiles below the first
row's window start are skipped, and the tiles holding a window edge get masks, at either end.
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


def kv_window_tiles(m_block, seqlen, seqlen_k, tile_m: int, tile_n: int, causal: bool, window: tuple) -> tuple:
    """Under a sliding window (left, right; bottom-right, -1 unbounded; causal: right = 0), the KV
    tiles of query tile ``m_block`` as (first, free_lo, free_hi, end): it visits [first, end);
    [free_lo, free_hi) need no mask for any of its rows, the tiles around them do. Tiles outside
    [first, end) are skipped, not masked: the time follows the window. Keys never precede
    queries here (seqlen_k >= seqlen), so every bound is a non-negative integer division. Python
    ints or DSL integers (the tests run it on ints)."""
    left, right = window
    right = 0 if causal else right
    offset = seqlen_k - seqlen
    first_row, last_row = m_block * tile_m, (m_block + 1) * tile_m - 1
    end, free_hi = (seqlen_k + tile_n - 1) // tile_n, seqlen_k // tile_n
    if right >= 0:  # keys up to row + offset + right
        end = cutlass.min(end, (last_row + offset + right + tile_n) // tile_n)
        free_hi = cutlass.min(free_hi, (first_row + offset + right + 1) // tile_n)
    first, free_lo = 0, 0
    if left >= 0:  # keys from row + offset - left
        first = cutlass.max(first_row + offset - left, 0) // tile_n
        free_lo = (cutlass.max(last_row + offset - left, 0) + tile_n - 1) // tile_n
    free_lo = cutlass.min(cutlass.max(free_lo, first), end)
    free_hi = cutlass.min(cutlass.max(free_hi, free_lo), end)
    return first, free_lo, free_hi, end


def query_window_tiles(n_block, seqlen, seqlen_k, tile_m: int, tile_n: int, causal: bool, window: tuple) -> tuple:
    """The backward's view of ``kv_window_tiles``: the query tiles [lo, hi) whose walk visits key
    tile ``n_block``, i.e. those with first <= n_block < end there (the tests check the two agree
    pair by pair). May be empty: a key before every query's window. Python ints or DSL integers."""
    left, right = window
    right = 0 if causal else right
    offset = seqlen_k - seqlen
    m_tiles = (seqlen + tile_m - 1) // tile_m
    lo, hi = 0, m_tiles
    if right >= 0:  # end(i) > n_block: the tile's last row reaches the key tile's first key
        lo = cutlass.max(n_block * tile_n - offset - right, 0) // tile_m
    if left >= 0:  # first(i) <= n_block: the tile's first row starts at or before the key tile's last key
        hi = cutlass.min(hi, cutlass.max((n_block + 1) * tile_n - offset + left + tile_m - 1, 0) // tile_m)
    return lo, cutlass.max(hi, lo)


# A TMA box may start only 16 bytes into its innermost dimension: a row of floats (K10's LSE2
# and D of a packed sequence) then starts at a multiple of 4 elements.
ROW_ALIGN = 4


def packed_row_start(first_row, seq):
    """Where packed sequence ``seq``, whose rows start at ``first_row``, starts in a padded row
    buffer (K10's LSE2 and D): a multiple of ROW_ALIGN, past the previous sequence's rows; a
    buffer of total + ROW_ALIGN * sequences rows holds them all. Python ints or Int32."""
    return (first_row + seq * ROW_ALIGN) // ROW_ALIGN * ROW_ALIGN


def packed_tile_start(first_row, seq, tile_m: int):
    """Where packed sequence ``seq``, whose rows start at ``first_row``, numbers its query tiles
    in a per-head table (K10's deterministic dQ semaphores and its flat dQ slots): first_row //
    tile_m + seq. Its ceil(n / tile_m) tiles end at or before the next sequence's start, since
    (a + n) // m >= a // m + n // m and n // m + 1 >= ceil(n / m); a table of total_rows // tile_m
    + sequences + 1 per head holds them all. Python ints or Int32."""
    return first_row // tile_m + seq
