"""Which query tile a CTA works on, and in what order the tiles are handed out (K5 onward).

Up to K4 the grid is (m_blocks, heads, batch) and the hardware dispatches blocks x-fastest.
Two things go wrong with that order, and a linear tile index decoded here fixes both:

* Causal tail. A causal query tile near the end of the sequence visits many KV tiles, one near
  the start few. Reversing m inside each head is not enough: the heaviest tiles of the *last*
  heads still start last and run alone at the end. Here the heaviest tiles of every head come
  first (longest-processing-time first, "LPT").
* L2 reuse. Heads are grouped into sections of heads whose K and V fit in an eighth of L2
  together (``section_bytes``: all of L2 from 4k keys); a section's tiles run back to back
  (m-block-major, heads fastest), so every K/V tile is read from HBM about once however many
  query tiles read it.

``tile_coords`` is the decoding; ``l2_section_heads`` the section size. A kernel walks tile
indices ``block_idx.x, block_idx.x + grid_dim.x, ...``: with one CTA per tile (grid = all tiles)
that is a single step; with a persistent grid (one CTA per SM) each CTA loops over its share and
its producer warp loads the next tile while the consumers finish the current one.
"""

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

L2_BYTES = 50 * 1024 * 1024  # H100 (50 MB) and H200 (60 MB): size sections for the smaller
# A section's K/V get an eighth of L2, not all of it: its tiles' Q and O stream through L2 too,
# and a K/V tile must survive from its first reader to its last. Measured on an H100 (causal,
# results/ws-tune-h100-sections.json): at N = 512 a section sized to all of L2 (200 heads at
# d = 128) ran at 0.79x the best peer, an eighth of it (25 heads) at 1.04x. That run, timed once,
# showed no clear difference at 8k keys, where a head's K/V alone fills the eighth.
SECTION_BYTES = L2_BYTES // 8
# ... below 4k keys. From 4k keys a causal tile costs anywhere from 1 to N / tile_n KV tiles, and the
# LPT order holds only inside a section: the heaviest tiles of the *last* section start only when
# every earlier section has been handed out. A section of a head or two (what an eighth of L2 holds
# at these lengths) then leaves its longest tiles running alone at the end. Sections sized to all of
# L2 put the last one's heavy tiles earlier. Measured on an H100, causal, each configuration timed
# five times (results/ws-tune-h100-causal-sched-r5.json, ws-tune-h100-sections-r5.json): at 8k keys
# d=128 569 -> 598 TFLOP/s, d=256 617 -> 664.
LONG_SEQUENCE_SECTION_BYTES = L2_BYTES
LONG_SEQUENCE_FROM = 4096


def section_bytes(seqlen_k: int) -> int:
    """The L2 budget of one section's K/V for a problem with ``seqlen_k`` keys."""
    return LONG_SEQUENCE_SECTION_BYTES if seqlen_k >= LONG_SEQUENCE_FROM else SECTION_BYTES


@cute.jit
def l2_section_heads(seqlen_k: Int32, head_dim: cutlass.Constexpr, elem_bytes: cutlass.Constexpr,
                     num_heads: Int32, group: Int32, budget: cutlass.Constexpr = SECTION_BYTES) -> Int32:
    """How many (batch, query head) pairs share one L2 section: as many whose K+V fit in
    ``budget`` bytes, at least 1. With GQA, ``group`` query heads share one K/V head."""
    kv_bytes_per_head = seqlen_k * (2 * head_dim * elem_bytes) // group
    return cutlass.max(cutlass.min(Int32(budget) // cutlass.max(kv_bytes_per_head, 1), num_heads), 1)


@cute.jit
def tile_coords(tile_idx: Int32, num_m_blocks: Int32, nheads: Int32, num_bh: Int32, section: Int32,
                lpt: cutlass.Constexpr):
    """Linear tile index -> (m_block, head, batch).

    Sections of ``section`` (batch, head) pairs, the last one possibly shorter; inside a
    section the m block changes slowest, so all of its heads advance through the sequence
    together. With ``lpt`` the m order is reversed: the longest causal rows start first.
    """
    tiles_per_section = section * num_m_blocks
    section_idx = tile_idx // tiles_per_section
    in_section = tile_idx - section_idx * tiles_per_section
    heads_here = cutlass.min(section, num_bh - section_idx * section)
    m_block = in_section // heads_here
    bh = section_idx * section + (in_section - m_block * heads_here)
    if cutlass.const_expr(lpt):
        m_block = num_m_blocks - 1 - m_block
    batch = bh // nheads
    return m_block, bh - batch * nheads, batch


# --------------------------------------------------------------------------------------
# Clusters: how many CTAs one wave of them holds
# --------------------------------------------------------------------------------------

def max_cluster_ctas(cluster: int) -> int:
    """CTAs in the largest grid of ``cluster``-CTA clusters that runs in one wave at one CTA per SM:
    a cluster's CTAs share a GPC, and a GPC with an odd number of free SMs leaves one idle (the
    driver's occupancy query; without a GPU, or where the query fails (under compute-sanitizer), the
    SMs rounded down to whole clusters: still correct, the clusters that do not fit run later)."""
    try:
        import torch

        if torch.cuda.is_available():
            return _max_cluster_ctas_on(cluster, torch.cuda.current_device())
    except Exception:  # noqa: BLE001  (only the grid size depends on it)
        pass
    from .contract import num_sms

    return num_sms() // cluster * cluster


@functools.lru_cache(maxsize=None)
def _max_cluster_ctas_on(cluster: int, device: int) -> int:
    import torch
    from cutlass.utils import HardwareInfo

    torch.zeros(1, device=f"cuda:{device}")  # the query's driver calls need the device's context
    return cluster * max(HardwareInfo(device).get_max_active_clusters(cluster), 1)


class TileCounters:
    """Host side of the dynamic scheduler: one zeroed int32 pair in GMEM per (device, stream).

    The kernel claims tiles with atomics on element 0 and counts finished CTAs in element 1; the
    last CTA zeroes both, so the pair is ready for the next launch with no memset. Launches on one
    stream run one after another; two streams get two pairs, so concurrent launches never share
    one. Allocated on first use; under CUDA-graph capture a stream without a pair gets one for
    that launch alone (zeroed by a captured memset, owned by the graph's pool, never kept).
    """

    def __init__(self, size: int = 2):
        self._pairs = {}
        self.size = size  # more than the pair with a split tail: its merge counters and partials

    def get(self, device: int):
        """The pair of the current stream on CUDA device ``device`` (an index: cheaper than torch.device)."""
        import torch

        key = (device, torch._C._cuda_getCurrentRawStream(device))  # ints: cheap
        pair = self._pairs.get(key)
        if pair is None:
            pair = torch.zeros(self.size, dtype=torch.int32, device=device)
            if not torch.cuda.is_current_stream_capturing():
                self._pairs[key] = pair
        return pair


# --------------------------------------------------------------------------------------
# Split tail (non-causal, static persistent): the last partial wave shared out by KV steps
# --------------------------------------------------------------------------------------
# ``num_tiles`` equal tiles on ``grid`` CTAs take ceil(num_tiles / grid) tile times, and when the
# last wave is partial the rest of the SMs idle through it: 2048 tiles on 132 SMs (d=128, 8k)
# are 15.5 waves run as 16, 3% of the kernel. With ``split_tail`` every CTA walks the whole waves
# round-robin, then the tiles left over (fewer than ``grid``) are cut along their KV tiles into
# one contiguous run of KV steps per CTA, ``steps // grid`` or one more (stream-K). A run
# crosses at most one tile boundary, so a CTA gets at most two pieces; each piece ends with a
# partial O and LSE, and the last warp to finish its rows of a tile merges them (by LSE weights,
# as split-KV decode does). With fewer steps than CTAs only the first ``steps`` CTAs take one
# each ("parts"): the merge counts a tile's pieces as the CTAs from the owner of its first step to
# the owner of its last, so no CTA in that range may be left without a piece.

class TailPiece(NamedTuple):
    """One piece of a split tail, as the consumer that computes it sees it: the tail tile, which of
    this CTA's (at most two) runs it is, the tail's KV steps, the CTAs sharing them, KV tiles per tile."""

    tile: object
    run: object
    steps: object
    parts: object
    n_kv: object


def tail_runs(num_tiles: int, grid: int, n_kv: int) -> list:
    """Per CTA, its pieces of the tail: [(tail tile r, KV lo, KV hi)], at most two. The twin of
    ``tail_plan`` / ``tail_piece`` for tests."""
    waves = num_tiles // grid
    steps = (num_tiles - waves * grid) * n_kv
    parts = min(grid, steps)
    runs = []
    for c in range(grid):
        s0, s1 = (c * steps // parts, (c + 1) * steps // parts) if c < parts else (steps, steps)
        pieces = []
        s = s0
        while s < s1:
            r = s // n_kv
            hi = min(n_kv, s1 - r * n_kv)
            pieces.append((r, s - r * n_kv, hi))
            s = r * n_kv + hi
        runs.append(pieces)
    return runs


@cute.jit
def tail_plan(num_tiles: Int32, grid: Int32, bx: Int32, n_kv: Int32):
    """(whole waves, KV steps of the tail, CTAs that share them, this CTA's run [s0, s1), its
    number of work units)."""
    waves = num_tiles // grid
    steps = (num_tiles - waves * grid) * n_kv
    parts = cutlass.min(grid, steps)
    s0, s1 = steps, steps
    if bx < parts:
        s0 = bx * steps // parts
        s1 = (bx + 1) * steps // parts
    pieces = Int32(0)
    if s1 > s0:
        pieces = Int32(1) if (s1 - 1) // n_kv == s0 // n_kv else Int32(2)
    return waves, steps, parts, s0, s1, waves + pieces


@cute.jit
def tail_piece(u: Int32, waves: Int32, s0: Int32, s1: Int32, n_kv: Int32):
    """Work unit ``u`` (>= waves) of this CTA: (tail tile r, KV lo, KV hi)."""
    s = s0 if u == waves else (s0 // n_kv + 1) * n_kv
    r = s // n_kv
    return r, s - r * n_kv, cutlass.min(n_kv, s1 - r * n_kv)


@cute.jit
def tail_owner(s: Int32, steps: Int32, parts: Int32) -> Int32:
    """The CTA whose run holds KV step ``s`` of the tail (runs start at c * steps // parts)."""
    return ((s + 1) * parts - 1) // steps


@cute.jit
def work_unit(u: Int32, bx: Int32, grid: Int32, waves: Int32, s0: Int32, s1: Int32, n_kv: Int32):
    """Unit ``u`` of CTA ``bx`` with a split tail: (tile index, KV lo, KV hi). Whole tiles first
    (round-robin), then the CTA's pieces of the tail."""
    tile_idx, lo, hi = bx + u * grid, Int32(0), n_kv
    if u >= waves:
        r, lo, hi = tail_piece(u, waves, s0, s1, n_kv)
        tile_idx = waves * grid + r
    return tile_idx, lo, hi
