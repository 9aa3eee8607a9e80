"""Flash decode: K4's loop at one warpgroup, GQA heads packed into the query tile, the KV walk
split across CTAs, and the splits merged by their log-sum-exp.

Decode is a stream, not a GEMM: a query of a few rows reads the whole KV cache once, so the
kernel is judged in bytes per second, and what limits it is how many SMs are pulling bytes.
New relative to K4:
* **GQA packing.** The ``group`` query heads that share a K/V head are rows of one query tile
  (packed row r = query position r // group, head kv_head * group + r % group): each K/V tile is
  loaded once for the whole group instead of once per query head. One warpgroup's 64 rows hold
  64 // group whole query positions; more take more query tiles (m_block). Q is tiny and its
  packed rows are not one box, so it is loaded by the threads, not by TMA.
* **Split-KV.** A CTA runs (query tile, split, K/V head, batch): split s of S walks its share of
  the KV tiles (``split_range``), or its first few and then whichever tiles it claims first from a
  per-head counter (``claim_after``), so that the splits end together. S = 1 writes O and LSE as K4
  does. Otherwise each split writes an fp32 partial O (normalized by its own sum) and its LSE, merged as
  LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s: by a second kernel (``Combine``,
  registered as decode_combine), or by the last CTA of the group to finish (``merge_if_last``,
  decode). ``choose_num_splits`` picks S so the CTAs fill one wave of SMs without the partials'
  extra traffic growing past 5%.
* **The KV cache.** Each sequence has its own length (``cache_seqlens``, read on the device) in a
  cache of s_cache rows. The tail tile's rows past the length are masked in S, and zeroed in V
  before the PV GEMM: the cache may hold anything there, and P = 0 times a NaN is still NaN.
* **Paged.** The cache may be a pool of pages, (num_pages, page_size, heads_kv, d), with a page
  table per sequence: each K/V tile's TMA boxes take their page from the table (one box per page
  when pages are smaller than the tile), and nothing else in the kernel changes.
* Causal with fewer queries than keys is aligned bottom-right (query i sees key j iff
  j <= i + kv_len - q_len); a row that sees no key gives O = 0 and LSE = -inf.

Tensors are in flash-attn's decode layout: q and O (batch, q_len, heads, d), the caches
(batch, s_cache, heads_kv, d), LSE (batch, heads, q_len). Strides are symbolic, so the SDPA
layout of the ordinary contract runs on the same compiled kernel through transposed views.
"""

from __future__ import annotations

import functools
import operator
import re
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import sm90, tma_pipeline
from .contract import (
    LOG2_E,
    CompiledAttention,
    Problem,
    StreamBuffers,
    UnsupportedProblem,
    compiled_ptx,
    cute_dtype,
    fake_stream,
    jit_compile,
    num_sms,
)

HEAD_DIMS = (64, 128, 256)
TILE_M = sm90.WGMMA_M  # one warpgroup: enough rows for group * q_len of any decode step up to 16 tokens at group 4
NUM_THREADS = sm90.THREADS_PER_WARPGROUP
MAX_GROUP = TILE_M  # query heads per K/V head: one tile must hold a query position's group
# The measured defaults, each with the runs behind it (docs/decode-runs.md, "Why the defaults are what
# they are", has the numbers; every result file is in results/).
NO_CLAIM_GPUS = ("H200",)  # claims lose on an H200: decode-tune-claim-h200-d128
SHARED_SM_TILE_N = {128: 64, 256: 32}  # half-width tiles, two CTAs an SM: decode-tune-stages-h200-d128, -sharedsm-h200-*
SHARED_SM_GPUS = ("H200",)  # not measured on an H100 yet (scripts/reproduce.sh decode has the run)
# refill_at_release: decode-tune-refill-h100-d128; merge_prefetch: -mergeprefetch-h100-d128;
# prefetch_ahead: -ahead-h100-d128; prefetch_after_wait: -afterwait-h100-d128
MEASURED_AND_OFF = dict(refill_at_release=False, merge_prefetch=0, prefetch_ahead=0, prefetch_after_wait=0)
# tile_n, kv_stages: the first H100 pass (docs/decode.md); l2_prefetch: decode-tune-prefetch-h100-*;
# claim_after: decode-tune-claim5-h100-d*
DEFAULT_CONFIG = {64: dict(tile_n=256, kv_stages=2, l2_prefetch=3, claim_after=4, **MEASURED_AND_OFF),
                  128: dict(tile_n=128, kv_stages=2, l2_prefetch=3, claim_after=4, **MEASURED_AND_OFF),
                  256: dict(tile_n=64, kv_stages=2, l2_prefetch=2, claim_after=0, **MEASURED_AND_OFF)}
MAX_SPLITS = 128
# A paged cache whose pages are smaller than the tile fills each tile with one TMA box per page,
# down to pages of 16 keys (two 8-row swizzle atoms).
MIN_PAGE = 16
MAX_SPLIT_TRAFFIC = 0.05  # partials may add at most 5% to the bytes of K and V


# --------------------------------------------------------------------------------------
# Host: how many splits (pure functions, tested on the CPU)
# --------------------------------------------------------------------------------------

def num_splits_heuristic(work_tiles: int, n_tiles: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Split only when the ``work_tiles`` CTAs (batch x K/V heads x query tiles) leave SMs idle,
    and then into as many splits as still fit one wave, one CTA per SM (at most one per KV tile).

    FA3 (hopper/heuristics.h) splits under the same condition but takes the smallest S whose wave
    efficiency is within 85% of the best: 15 at batch 1 with 8 K/V heads (120 CTAs). For a stream
    every idle SM is bandwidth left on the table: 16 (128 CTAs) measured faster (docs/decode.md).
    """
    if work_tiles >= 0.8 * num_sms:
        return 1
    return max(1, min(num_sms // work_tiles, n_tiles, max_splits))


def split_traffic_cap(group: int, q_len: int, kv_len: int, max_ratio: float = MAX_SPLIT_TRAFFIC) -> int:
    """Most splits whose fp32 partials (written, then read: 2 x S x group x q_len x d x 4 bytes per
    K/V head) stay within ``max_ratio`` of the K+V bytes (2 x kv_len x d x 2): S <= max_ratio x
    kv_len / (2 x group x q_len). At least 1."""
    return max(1, int(max_ratio * kv_len / (2 * group * q_len)))


def grid_ctas(batch: int, nheads_kv: int, group: int, q_len: int, tile_m: int = TILE_M) -> int:
    """CTAs per split: batch x K/V heads x query tiles of whole query positions (packed_rows)."""
    return batch * nheads_kv * -(-q_len // (tile_m // group))


def choose_num_splits(batch: int, nheads_kv: int, group: int, q_len: int, kv_len: int, num_sms: int,
                      tile_n: int, tile_m: int = TILE_M) -> int:
    n_tiles = -(-kv_len // tile_n)
    splits = num_splits_heuristic(grid_ctas(batch, nheads_kv, group, q_len, tile_m), n_tiles, num_sms)
    return max(1, min(splits, split_traffic_cap(group, q_len, kv_len)))


def split_range(n_tiles: int, num_splits: int, split: int) -> tuple:
    """KV tiles [lo, hi) of ``split`` (the kernel's ``tile_range``, in Python): ceil(n/S) tiles
    each, so the trailing splits may be empty."""
    per = -(-n_tiles // num_splits)
    lo = min(split * per, n_tiles)
    return lo, min(lo + per, n_tiles)


def claimed_split_range(n_tiles: int, num_splits: int, split: int, claim_after: int) -> tuple:
    """Claiming (``DecodeFMHA.split_tiles`` in Python): (lo, hi, base), the split's own tiles
    [lo, hi), ``claim_after`` of them but never more than an even share (a short cache would
    otherwise go to the first splits and leave the rest idle), and the group's tiles
    [base, n_tiles) that every split claims from the counter until they run out."""
    own = min(claim_after, n_tiles // num_splits)
    return split * own, (split + 1) * own, num_splits * own


def merge_partials(o_parts, lse_parts):
    """The combine in torch (the oracle for ``Combine``): o_parts (S, ..., d) partial outputs each
    normalized by its own sum, lse_parts (S, ...) their natural-log LSEs. Empty splits carry
    LSE = -inf; a row whose splits are all empty gives O = 0 and LSE = -inf, never NaN."""
    import torch

    m = lse_parts.max(dim=0).values
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    total = torch.exp(lse_parts - m).sum(dim=0)
    lse = m + torch.log(total)  # log(0) = -inf for an all-empty row
    weights = torch.exp(lse_parts - torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse))
    weights = weights.unsqueeze(-1)  # empty splits (and every split of an all-empty row) weigh exp(-inf) = 0,
    o = torch.where(weights > 0, weights * o_parts, 0.0).sum(dim=0)  # and what they hold is never added
    return o, lse


# --------------------------------------------------------------------------------------
# Host: views
# --------------------------------------------------------------------------------------

def cache_seq_major_view(mX: cute.Tensor) -> cute.Tensor:
    """(batch, s_cache, heads_kv, d) -> (s_cache, d, heads_kv, batch): K's TMA view (K4's
    ``seq_major_view`` for the cache layout)."""
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 3, 2, 0]))


def cache_head_dim_major_view(mX: cute.Tensor) -> cute.Tensor:
    """(batch, s_cache, heads_kv, d) -> (d, s_cache, heads_kv, batch): V read MN-major, as in K4."""
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[3, 1, 2, 0]))


# --------------------------------------------------------------------------------------
# The split-KV kernel
# --------------------------------------------------------------------------------------

class DecodeFMHA:
    def __init__(self, head_dim: int, dtype, causal: bool, group: int, tile_n: int, kv_stages: int, split: bool,
                 merge: str = "combine", l2_prefetch: int = 0, refill_at_release: bool = False,
                 merge_prefetch: int = 0, prefetch_ahead: int = 0, prefetch_after_wait: int = 0,
                 claim_after: int = 0, paged: bool = False, page_boxes: int = 1):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.group = group
        self.tile_m = TILE_M
        self.tile_n = tile_n
        self.kv_stages = kv_stages
        self.split = split  # write fp32 partials for the merge (S > 1; Combine or in-kernel), or O and LSE directly
        # With a split, "last_cta": the last CTA of each (query tile, K/V head, batch) to finish
        # merges the partials itself (``merge_if_last``), instead of a second kernel; "last_split":
        # the group's last split waits for the others and merges (``merge_in_last_split``).
        self.merge = merge if split else "combine"
        # A tile packs (group, q_per_tile) rows: whole query positions, so a group that does not
        # divide 64 (7: Qwen2-7B's 28/4) leaves 64 % group rows idle.
        self.q_per_tile = TILE_M // group
        self.packed_rows = group * self.q_per_tile
        self.num_threads = NUM_THREADS
        # KV tiles per split pulled into L2 before the wait on the previous kernel (0: none).
        self.l2_prefetch = l2_prefetch
        # Refill a stage as soon as it is released (end of the iteration), not after the next
        # tile's QK as K4 does (which waits for that tile first). Measured: no gain (DEFAULT_CONFIG).
        self.refill_at_release = refill_at_release
        self.merge_prefetch = merge_prefetch
        # In the loop, the refill of tile t also prefetches tile t + prefetch_ahead into L2: more
        # bytes in flight per SM than two SMEM stages hold (0: none).
        self.prefetch_ahead = prefetch_ahead
        # Once the wait is over, the next tiles after the l2_prefetch ones are hinted into L2 too, so
        # that HBM need not wait for the ring to reach the first tile not prefetched (0: none;
        # measured: a loss, DEFAULT_CONFIG).
        self.prefetch_after_wait = prefetch_after_wait
        # Balance (0: off, every split walks its fixed share): each split walks its own first
        # claim_after tiles (the L2 prefetch hints the first of them), then claims the group's remaining tiles
        # one at a time from a counter, so that the splits end together however fast HBM serves
        # each SM. A partial covers any set of tiles: the merge does not care which.
        self.claim_after = claim_after
        assert claim_after == 0 or self.merge != "combine", "the counter is reset by the in-kernel merge"
        assert claim_after == 0 or not (refill_at_release or prefetch_ahead or prefetch_after_wait), \
            "these knobs act on the fixed shares' walk"
        # A paged cache (num_pages, page_size, heads_kv, d) and a page table (batch, max_pages). The
        # TMA moves boxes of tile_n / page_boxes keys, each inside one page: page_boxes > 1 when the
        # pages are smaller than the tile (each box then a page), 1 when a page holds whole tiles.
        self.paged = paged
        self.page_boxes = page_boxes if paged else 1
        self.box_n = tile_n // self.page_boxes
        assert self.box_n * self.page_boxes == tile_n and kv_stages * self.page_boxes <= 32, \
            "one lane of the producer warp looks up each box of the first stages"
        assert not (paged and (refill_at_release or prefetch_ahead or prefetch_after_wait)), \
            "measured and off: these knobs do not look pages up"
        self.claim_slots = kv_stages if self.claim_after else 0  # the merge's flag slot follows them
        self.tile_slots = tile_slots(kv_stages, self.merge, self.claim_after > 0)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mSeqlens: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor], mO_partial: Optional[cute.Tensor],
                 mLSE_partial: Optional[cute.Tensor], mCounters: Optional[cute.Tensor], softmax_scale: Float32,
                 num_splits: Int32, stream):
        d, dt = self.head_dim, self.dtype
        mVt = cache_head_dim_major_view(mV)
        v_major = LayoutEnum.from_tensor(mVt)
        # K4's two GEMMs at one warpgroup: S(64, tile_n) = Q K^T, O(64, d) += P V^T, P in registers.
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32, atom_layout_mnk=(1, 1, 1),
            tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, OperandMajorMode.K, v_major.sm90_mma_major_mode(), Float32, atom_layout_mnk=(1, 1, 1),
            tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)
        sQ_layout = cute.select(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt, 1), mode=[0, 1])
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, d), dt,
                                                  self.kv_stages)
        sVt_layout = sm90_utils.make_smem_layout_b(v_major, (self.tile_m, d, self.tile_n), dt, self.kv_stages)
        if const_expr(self.paged):  # boxes of box_n keys: a page's when pages are smaller than the tile
            box = self.box_n
            tma_atom_K, mK_tma = tma_pipeline.make_tma_load(cache_seq_major_view(mK), box_layout(sK_layout, (box, d)),
                                                            (box, d))
            tma_atom_V, mV_tma = tma_pipeline.make_tma_load(mVt, box_layout(sVt_layout, (d, box)), (d, box))
        else:
            tma_atom_K, mK_tma = tma_pipeline.make_tma_load(cache_seq_major_view(mK), sK_layout, (self.tile_n, d))
            tma_atom_V, mV_tma = tma_pipeline.make_tma_load(mVt, sVt_layout, (d, self.tile_n))
        SharedStorage = tma_pipeline.shared_storage(dt, sQ_layout, sK_layout, sVt_layout, self.kv_stages,
                                                    tile_slots=self.tile_slots)

        # One CTA per (query tile, split), K/V head, batch.
        m_blocks = cute.ceil_div(mQ.shape[1], self.q_per_tile)
        grid = (m_blocks * num_splits, mK.shape[2], mQ.shape[0])
        self.kernel(mQ, mK_tma, mV_tma, mO, mLSE, mSeqlens, mPageTable, mO_partial, mLSE_partial, mCounters,
                    tma_atom_K, tma_atom_V, softmax_scale * LOG2_E, num_splits, sQ_layout, sK_layout, sVt_layout,
                    tiled_mma_qk, tiled_mma_pv,
                    SharedStorage).launch(grid=grid, block=[self.num_threads, 1, 1],
                                          smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1,
                                          use_pdl=True)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK_tma: cute.Tensor, mV_tma: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSeqlens: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor], mO_partial: Optional[cute.Tensor],
               mLSE_partial: Optional[cute.Tensor], mCounters: Optional[cute.Tensor], tma_atom_K: cute.CopyAtom,
               tma_atom_V: cute.CopyAtom,
               scale_log2: Float32, num_splits: Int32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        tile_m, tile_n, d, stages = self.tile_m, self.tile_n, self.head_dim, self.kv_stages
        tidx, _, _ = cute.arch.thread_idx()
        bx, kv_head, batch = cute.arch.block_idx()
        m_block, split = bx // num_splits, bx % num_splits
        q_len = mQ.shape[1]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        hint_len = Int32(0)
        if warp_idx == 0:
            if const_expr(self.l2_prefetch > 0):  # first, so that its round trip overlaps the setup
                hint_len = self.cache_len(mK_tma, mSeqlens, mPageTable, batch, hint=True)
            tma_pipeline.prefetch_descriptors(tma_atom_K, tma_atom_V)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sK, sVt = tma_pipeline.smem_tensors(storage, sQ_layout, sK_layout, sVt_layout)
        pipeline_tile = None
        if const_expr(self.claim_after > 0):
            # K5's tile-index pipeline: one producer thread posts each tile's index in a slot, and
            # every consumer thread reads it and releases the slot (inited here, fenced below).
            pipeline_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(), num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_threads), defer_sync=True)
        pipeline_kv = tma_pipeline.make_kv_pipeline(storage, self.dtype, sK_layout, sVt_layout, stages,
                                                    self.num_threads)
        pages, page_ctx = None, None
        if const_expr(self.paged):
            # Every page of the head stays addressable: a box is at (box in the page, page).
            box = self.box_n
            tKsK, tKgK = partition_pages(tma_atom_K, mK_tma, sK, (box, d), kv_head, (None, 0))
            tVsVt, tVgVt = partition_pages(tma_atom_V, mV_tma, sVt, (d, box), kv_head, (0, None))
            page_ctx = (mPageTable, batch, mK_tma.shape[0] // box, mK_tma.shape[3])  # + the key count: ``pages``
        else:
            tKsK, tKgK = tma_pipeline.partition_for_tma(tma_atom_K, mK_tma, sK, (tile_n, d), kv_head, batch,
                                                        (None, 0))
            tVsVt, tVgVt = tma_pipeline.partition_for_tma(tma_atom_V, mV_tma, sVt, (d, tile_n), kv_head, batch,
                                                          (0, None))
        kv_loads = (tma_atom_K, tKgK, tKsK, tma_atom_V, tVgVt, tVsVt)
        if const_expr(self.l2_prefetch > 0):
            # This CTA usually starts while the previous kernel on the stream drains (PDL, below):
            # HBM would idle through that kernel's tail and this one's first round trip. Pull the
            # split's first tiles into L2 now. Only a hint: that kernel may still write the cache
            # or the lengths, but L2 is coherent, so the TMA loads after the wait see its writes;
            # a stale length merely aims the prefetch at other tiles.
            if warp_idx == 0:
                if const_expr(self.paged):  # one length for the warp: the loop below shuffles
                    hint_len = cute.arch.shuffle_sync(hint_len, 0)
                lo, hi, _ = self.split_tiles(cute.ceil_div(hint_len, tile_n), num_splits, split)
                if const_expr(self.paged):  # lane i looks up the split's box i: one round trip for all
                    boxes = self.split_boxes(page_ctx + (hint_len,), lo, hi, hint=True)
                    for t in cutlass.range(cutlass.min(min(self.l2_prefetch, 32 // self.page_boxes), hi - lo),
                                           unroll=1):
                        for j in cutlass.range_constexpr(self.page_boxes):
                            n_cache = self.lane_box(boxes, t * self.page_boxes + j)
                            with cute.arch.elect_one():
                                l2_hint(kv_loads, n_cache)
                else:
                    with cute.arch.elect_one():
                        for t in cutlass.range(cutlass.min(self.l2_prefetch, hi - lo), unroll=1):
                            l2_hint(kv_loads, lo + t)
        # Programmatic dependent launch (PDL) both ways: this grid may start while the previous
        # kernel on the stream finishes (the setup above overlaps its tail; nothing is read from
        # GMEM before the wait but the prefetch's hint), and the next one (Combine, or the next
        # step) may launch now: it waits for this grid in turn.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # ---- this CTA's keys: the sequence's cache length, then its split's share of the tiles ----
        kv_len = self.cache_len(mK_tma, mSeqlens, mPageTable, batch)
        if const_expr(self.paged):
            pages = page_ctx + (kv_len,)
        causal_offset = kv_len - q_len  # bottom-right: query i sees keys j <= i + causal_offset
        n_tiles = cute.ceil_div(kv_len, tile_n)
        n_lo, n_hi, claim_base = self.split_tiles(n_tiles, num_splits, split)
        # Tiles from n_full on need the element mask: the tail past kv_len and, causal, the tiles
        # past the first packed row's diagonal.
        n_full = kv_len // tile_n
        if const_expr(self.causal):
            first_query = m_block * self.q_per_tile
            n_full = cutlass.min(n_full, cutlass.max(first_query + causal_offset + 1, 0) // tile_n)

        # Pipeline positions count from the split's first tile (fixed shares: t = n_block - n_lo).
        counter = (batch * cute.arch.grid_dim()[1] + kv_head) * (cute.arch.grid_dim()[0] // num_splits) + m_block
        ctx, pending, live = None, Int32(0), cutlass.Boolean(True)
        if const_expr(self.claim_after > 0):
            # (the claim counter, the tile pipeline and its slots, the tile ranges): the claim
            # counters follow the merge's, one per (query tile, K/V head, batch).
            n_counters = cute.arch.grid_dim()[2] * cute.arch.grid_dim()[1] * (cute.arch.grid_dim()[0] // num_splits)
            slots = cute.make_tensor(storage.tile_idx.data_ptr(), cute.make_layout(stages))
            ctx = (mCounters.iterator + n_counters + counter, pipeline_tile, slots, n_lo, n_hi, claim_base, n_tiles,
                   pages)
            if warp_idx == 0:
                pending = self.claim(ctx[0], pending)  # its round trip overlaps the split's own tiles
                for t in cutlass.range_constexpr(stages):
                    if live:
                        pending, live = self.produce_claimed(pipeline_kv, Int32(t), kv_loads, ctx, pending)
        elif warp_idx == 0:
            if const_expr(self.paged):  # lane i looks up the split's box i, as for the prefetch
                boxes = self.split_boxes(pages, n_lo, n_hi)
                for t in cutlass.range(cutlass.min(stages, n_hi - n_lo), unroll=1):
                    self.load_boxes(pipeline_kv, tma_pipeline.pipe_state(stages, t, producer=True), boxes,
                                    t * self.page_boxes, kv_loads)
            else:
                for t in cutlass.range(cutlass.min(stages, n_hi - n_lo), unroll=1):
                    tma_pipeline.load_kv_stage(pipeline_kv, tma_pipeline.pipe_state(stages, t, producer=True),
                                               n_lo + t, *kv_loads)
            if const_expr(self.prefetch_after_wait > 0):
                first = max(self.l2_prefetch, stages)
                with cute.arch.elect_one():
                    for t in cutlass.range(first, cutlass.min(first + self.prefetch_after_wait, n_hi - n_lo), unroll=1):
                        l2_hint(kv_loads, n_lo + t)

        # ---- Q: the packed rows, by the threads, while the first K/V tiles are in flight -------
        rows = packed_rows(m_block, kv_head, self.group, self.q_per_tile, q_len)
        self.load_q(mQ, sQ, rows, batch, tidx)

        wg_mma_qk = tiled_mma_qk.get_slice(0)
        wg_mma_pv = tiled_mma_pv.get_slice(0)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((tile_m, tile_n)))
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((tile_m, d)), Float32)
        acc_O.fill(0.0)
        tScS = tiled_mma_qk.get_slice(tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        softmax = sm90.OnlineSoftmax(cute.size(sm90.acc_mn_view(acc_O), mode=[0]), scale_log2)
        row_scale = cute.make_rmem_tensor(softmax.num_rows, Float32)

        loads = (pipeline_kv, *kv_loads)
        mmas = (tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, sVt, tOrVt, tOrP, acc_O, tScS)
        lens = (kv_len, causal_offset, n_lo, n_hi)
        if const_expr(self.claim_after > 0):
            # The producer names each stage's tile in its SMEM slot (-1: no more), so the loop runs
            # until it reads -1; a tile needs the mask from n_full on, wherever it comes in the walk.
            t = Int32(0)
            n_block = self.claimed_tile(t, ctx)
            while n_block >= 0:
                if n_block >= n_full:
                    pending, live = self.kv_iteration(n_block, m_block, lens, tidx, warp_idx, loads, mmas, softmax,
                                                      row_scale, masked=True, t=t, ctx=ctx, claims=(pending, live))
                else:
                    pending, live = self.kv_iteration(n_block, m_block, lens, tidx, warp_idx, loads, mmas, softmax,
                                                      row_scale, masked=False, t=t, ctx=ctx, claims=(pending, live))
                t += 1
                n_block = self.claimed_tile(t, ctx)
        else:
            for n_block in cutlass.range(n_lo, cutlass.min(n_hi, n_full), unroll=1):
                self.kv_iteration(n_block, m_block, lens, tidx, warp_idx, loads, mmas, softmax, row_scale,
                                  masked=False, pages=pages)
            for n_block in cutlass.range(cutlass.max(n_lo, n_full), n_hi, unroll=1):
                self.kv_iteration(n_block, m_block, lens, tidx, warp_idx, loads, mmas, softmax, row_scale,
                                  masked=True, pages=pages)

        # ---- Epilogue: K4's, into O or into this split's fp32 partial ------------------------
        # An empty split (or a row that saw no key) writes O = 0 and LSE = -inf.
        if const_expr(self.split):
            mO_out, mLSE_out = mO_partial[split, None, None, None, None], mLSE_partial[split, None, None, None]
        else:
            mO_out, mLSE_out = mO, mLSE
        lse, rO = sm90.finalize_o(acc_O, softmax, mO_out.element_type)
        self.store_packed(rO, lse, tiled_mma_pv, tidx, mO_out, mLSE_out, rows, batch)
        if const_expr(self.merge != "combine"):
            # The merging CTA zeroes the counters for the next launch: the claims' too, since every
            # split's last claim came back before it counted itself done.
            reset = (mCounters.iterator + counter,) + ((ctx[0],) if const_expr(self.claim_after > 0) else ())
            if const_expr(self.merge == "last_cta"):
                self.merge_if_last(mO_partial, mLSE_partial, mO, mLSE, mCounters, counter, reset,
                                   storage.tile_idx.data_ptr() + self.claim_slots, num_splits, rows, batch, tidx)
            else:
                self.merge_in_last_split(mO_partial, mLSE_partial, mO, mLSE, mCounters, counter, reset, split,
                                         num_splits, rows, batch, tidx)

    @cute.jit
    def cache_len(self, mK_tma: cute.Tensor, mSeqlens: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor],
                  batch: Int32, hint: cutlass.Constexpr[bool] = False) -> Int32:
        """The sequence's key count: its cache length, clamped to the cache's rows (TMA reads
        nothing past them anyway; paged, the rows of its page table's pages), or all of them
        without lengths. A ``hint`` (read before the PDL wait) bypasses L1 (ld.global.cg), so that
        no stale copy is left there for the real read."""
        kv_len = mK_tma.shape[0]
        if const_expr(mPageTable is not None):
            kv_len = mK_tma.shape[0] * mPageTable.shape[1]
        if const_expr(mSeqlens is not None):
            if const_expr(hint):
                length = cute.arch.load(mSeqlens.iterator + batch, Int32, cop="cg")
            else:
                length = mSeqlens[batch]
            kv_len = cutlass.max(cutlass.min(length, kv_len), 0)
        return kv_len

    @cute.jit
    def cache_box(self, pages: tuple, box: Int32, hint: cutlass.Constexpr[bool] = False) -> Int32:
        """Paged: where the sequence's ``box`` (tile n's boxes are n * page_boxes + j) is in the
        partitioned cache: box % per_page of page table[batch, box // per_page], as the index
        page * per_page + box in the page; a page smaller than the tile is one box, and then just
        its page. A ``hint`` (before the PDL wait, when the previous kernel may still be writing
        the table) reads past L1 and clamps the page into the cache, since the prefetch has no
        bounds of its own to trust."""
        table, batch, per_page, num_pages, _ = pages
        slot = box
        if const_expr(self.page_boxes == 1):
            slot = box // per_page
        if const_expr(hint):
            page = cute.arch.load(table.iterator + cute.crd2idx((batch, slot), table.layout), Int32, cop="cg")
            page = cutlass.max(cutlass.min(page, num_pages - 1), 0)
        else:
            page = table[batch, slot]
        if const_expr(self.page_boxes == 1):
            page = page * per_page + (box - slot * per_page)
        return page

    @cute.jit
    def lane_box(self, boxes: Int32, lane):
        """The box that ``lane`` looked up (``split_boxes``), for every lane, as the coordinate of
        the partitioned cache's (box in the page, page) mode: with pages smaller than the tile,
        (0, page), which spares the division of an index by the boxes per page."""
        box = cute.arch.shuffle_sync(boxes, lane)
        if const_expr(self.page_boxes > 1):
            box = (0, box)
        return box

    @cute.jit
    def split_boxes(self, pages: tuple, n_lo: Int32, n_hi: Int32, hint: cutlass.Constexpr[bool] = False) -> Int32:
        """Lane i's ``cache_box`` of box i of the tiles from n_lo on: the first 32 / page_boxes
        tiles' pages in one round trip, handed out by shuffles. Boxes are held below n_hi and at the
        last box with a key: the tail tile's boxes past it load that box again (masked like any
        row past the length), so no page is loaded through an entry past the sequence's length,
        and no entry past the table's row is read."""
        keys = pages[4]
        last = cutlass.min(n_hi * self.page_boxes, cute.ceil_div(keys, self.box_n))
        box = in_range(n_lo * self.page_boxes + cute.arch.lane_idx(), last)
        return self.cache_box(pages, box, hint)

    @cute.jit
    def load_boxes(self, pipeline_kv, state: pipeline.PipelineState, boxes: Int32, first, kv_loads: tuple):
        """``tma_pipeline.load_kv_stage`` for a paged cache: the stage's page_boxes K and V boxes,
        box j from the page that lane first + j looked up (``split_boxes``), all on one barrier."""
        tma_atom_K, tKgK, tKsK, tma_atom_V, tVgVt, tVsVt = kv_loads
        pipeline_kv.producer_acquire(state)
        barrier = pipeline_kv.producer_get_barrier(state)
        for j in cutlass.range_constexpr(self.page_boxes):
            n_cache = self.lane_box(boxes, first + j)
            cute.copy(tma_atom_K, tKgK[None, n_cache], tKsK[None, (j, 0, state.index)], tma_bar_ptr=barrier)
            cute.copy(tma_atom_V, tVgVt[None, n_cache], tVsVt[None, (0, j, state.index)], tma_bar_ptr=barrier)

    @cute.jit
    def load_q(self, mQ: cute.Tensor, sQ: cute.Tensor, rows: tuple, batch: Int32, tidx: Int32):
        """Each thread copies 16-byte pieces of the packed Q rows into the swizzled sQ (zeros in
        the idle rows), then fences: WGMMA reads sQ through the async proxy."""
        chunks = self.head_dim // 8
        for i in cutlass.range_constexpr(self.tile_m * chunks // self.num_threads):
            idx = tidx + i * self.num_threads
            row, c = idx // chunks, idx % chunks
            dst = cute.local_tile(sQ[row, None], (8,), (c,))
            q_idx, head = row_coords(rows, row, self.group)
            if row < rows[2]:
                cute.autovec_copy(cute.local_tile(mQ[batch, q_idx, head, None], (8,), (c,)), dst)
            else:
                dst.fill(0.0)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

    @cute.jit
    def kv_iteration(self, n_block: Int32, m_block: Int32, lens: tuple, tidx: Int32, warp_idx: Int32, loads: tuple,
                     mmas: tuple, softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor,
                     masked: cutlass.Constexpr[bool], t: Optional[Int32] = None, ctx: Optional[tuple] = None,
                     claims: Optional[tuple] = None, pages: Optional[tuple] = None):
        """K4's iteration, its pipeline position counted from the split's first tile, and on the
        tail tile V's rows past the cache length zeroed before PV. Claiming, ``t`` is the
        position and the refill is ``produce_claimed``'s; returns ``claims`` (the claim in flight,
        still producing) as it leaves them."""
        pipeline_kv, *kv_loads = loads
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, sVt, tOrVt, tOrP, acc_O, tScS = mmas
        kv_len, causal_offset, n_lo, n_hi = lens
        if const_expr(t is None):
            t = n_block - n_lo
        kv_consume = tma_pipeline.pipe_state(self.kv_stages, t, producer=False)
        if const_expr(pages is not None):
            # The refill's pages are looked up before the wait for this tile, which hides the round trip.
            refill_boxes = Int32(0)
            if warp_idx == 0:
                refill_boxes = self.split_boxes(pages, n_lo + t - 1 + self.kv_stages, n_hi)
        pipeline_kv.consumer_wait(kv_consume)
        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        sm90.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_consume.index], zero_init=True, wg_wait=-1)
        if const_expr(claims is not None):
            pending, live = claims
            if warp_idx == 0 and t >= 1 and live:  # refill the stage released last iteration
                pending, live = self.produce_claimed(pipeline_kv, t - 1 + self.kv_stages, kv_loads, ctx, pending)
            claims = (pending, live)
        elif warp_idx == 0 and not self.refill_at_release:  # refill the stage released last iteration
            t_refill = t - 1 + self.kv_stages
            if t >= 1 and n_lo + t_refill < n_hi:
                refill = tma_pipeline.pipe_state(self.kv_stages, t_refill, producer=True)
                if const_expr(pages is not None):
                    self.load_boxes(pipeline_kv, refill, refill_boxes, 0, kv_loads)
                else:
                    tma_pipeline.load_kv_stage(pipeline_kv, refill, n_lo + t_refill, *kv_loads)
            if const_expr(self.prefetch_ahead > 0):
                t_ahead = t_refill + self.prefetch_ahead
                if t >= 1 and t_ahead >= self.l2_prefetch and n_lo + t_ahead < n_hi:
                    with cute.arch.elect_one():
                        l2_hint(kv_loads, n_lo + t_ahead)
        warpgroup.wait_group(0)
        if const_expr(masked):
            # Row r of query tile m_block is query position (m_block * packed_rows + r) // group.
            sm90.mask_tile(acc_S, tScS, m_block, n_block, kv_len, self.packed_rows, self.tile_n, self.causal,
                           causal_offset, rows_per_query=self.group)
            self.zero_v_tail(sVt[None, None, kv_consume.index], kv_len - n_block * self.tile_n, tidx)
        softmax.step(acc_S, row_scale, check_inf=masked)
        softmax.rescale(acc_O, row_scale)
        sm90.convert_to(sm90.acc_as_operand_a(acc_S), tOrP)
        sm90.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_consume.index], zero_init=False, wg_wait=0)
        pipeline_kv.consumer_release(kv_consume)
        if const_expr(self.refill_at_release):
            if warp_idx == 0 and n_lo + t + self.kv_stages < n_hi:
                tma_pipeline.load_kv_stage(pipeline_kv, tma_pipeline.pipe_state(self.kv_stages, t + self.kv_stages,
                                                                                producer=True),
                                           n_lo + t + self.kv_stages, *kv_loads)
        return claims

    @cute.jit
    def split_tiles(self, n_tiles: Int32, num_splits: Int32, split: Int32):
        """(lo, hi, claim_base): the split's own tiles [lo, hi), ``tile_range``'s share, or
        claiming, its first claim_after tiles (``claimed_split_range``); the tiles from
        claim_base on are claimed."""
        if const_expr(self.claim_after > 0):
            own = cutlass.min(self.claim_after, n_tiles // num_splits)
            return split * own, (split + 1) * own, num_splits * own
        lo, hi = tile_range(n_tiles, num_splits, split)
        return lo, hi, n_tiles

    @cute.jit
    def claim(self, counter_ptr, pending: Int32) -> Int32:
        """Lane 0 of the producer warp takes the next tile off the counter. The answer is only
        read at the next produce_claimed that needs it, so its round trip is hidden. Lane 0 is
        thread 0, the one that later counts the split done: program order puts every claim before
        that count, which is what lets the merging CTA reset the counter (keep both on one thread)."""
        if cute.arch.lane_idx() == 0:
            pending = cute.arch.atomic_add(counter_ptr, Int32(1), sem="relaxed", scope="gpu")
        return pending

    @cute.jit
    def produce_claimed(self, pipeline_kv, j: Int32, kv_loads: tuple, ctx: tuple, pending: Int32):
        """Producer warp: the CTA's j-th tile (its own, then claimed) posted in tile slot
        j % stages, then loaded into K/V stage j % stages; out of tiles, -1 is posted and nothing
        loaded. Returns (the claim in flight, whether it produced a tile)."""
        counter_ptr, pipeline_tile, slots, lo, hi, base, n_tiles, pages = ctx
        n_block = lo + j
        if j >= hi - lo:
            n_block = base + cute.arch.shuffle_sync(pending, 0)
            if n_block < n_tiles:
                pending = self.claim(counter_ptr, pending)
            else:
                n_block = Int32(-1)
        boxes = Int32(0)
        if const_expr(pages is not None):  # looked up before the slot's wait
            boxes = self.split_boxes(pages, n_block, n_block + 1)
        state = tma_pipeline.pipe_state(self.kv_stages, j, producer=True)
        pipeline_tile.producer_acquire(state)
        with cute.arch.elect_one():
            slots[state.index] = n_block
            pipeline_tile.producer_commit(state)
        if n_block >= 0:
            if const_expr(pages is not None):
                self.load_boxes(pipeline_kv, state, boxes, 0, kv_loads)
            else:
                tma_pipeline.load_kv_stage(pipeline_kv, state, n_block, *kv_loads)
        return pending, n_block >= 0

    @cute.jit
    def claimed_tile(self, t: Int32, ctx: tuple) -> Int32:
        """Consumers: the CTA's t-th tile, from its slot (-1: the walk is over)."""
        _, pipeline_tile, slots, *_ = ctx
        state = tma_pipeline.pipe_state(self.kv_stages, t, producer=False)
        pipeline_tile.consumer_wait(state)
        n_block = slots[state.index]
        pipeline_tile.consumer_release(state)
        return n_block

    @cute.jit
    def zero_v_tail(self, sVt_stage: cute.Tensor, keys_left: Int32, tidx: Int32):
        """Zero the keys >= keys_left of one (d, tile_n) V stage, if the tile has any. Masking made
        P = 0 there, but the cache rows past a sequence's length may hold NaN, and 0 * NaN = NaN."""
        if keys_left < self.tile_n:
            chunks = self.head_dim // 8
            for i in cutlass.range_constexpr(self.tile_n * chunks // self.num_threads):
                idx = tidx + i * self.num_threads
                key, c = idx // chunks, idx % chunks
                if key >= keys_left:
                    cute.local_tile(sVt_stage[None, key], (8,), (c,)).fill(0.0)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()


    @cute.jit
    def store_packed(self, rO: cute.Tensor, lse: cute.Tensor, tiled_mma_pv: cute.TiledMma, tidx: Int32,
                     mO: cute.Tensor, mLSE: cute.Tensor, rows: tuple, batch: Int32):
        """K4's register epilogue, each packed row sent to its own (query position, head): the
        thread's columns are those of a (64, d) tile whose every row is that one GMEM row."""
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tOcO_mn = sm90.acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
        rO_mn = sm90.acc_mn_view(rO)
        for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
            row = tOcO_mn[r, 0][0]
            if row < rows[2]:
                q_idx, head = row_coords(rows, row, self.group)
                gO_row = cute.make_tensor(mO[batch, q_idx, head, None].iterator,
                                          cute.make_layout((self.tile_m, self.head_dim), stride=(0, 1)))
                cute.autovec_copy(rO_mn[r, None], sm90.acc_mn_view(thr_mma_pv.partition_C(gO_row))[r, None])
                if tOcO_mn[r, 0][1] == 0:
                    mLSE[batch, head, q_idx] = lse[r]

    @cute.jit
    def merge_if_last(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                      mCounters: cute.Tensor, counter: Int32, reset: tuple, flag_ptr, num_splits: Int32,
                      rows: tuple, batch: Int32, tidx: Int32):
        """Count this split done; the CTA that counts the last one merges the tile's rows (a warp
        per row, as ``Combine``) and zeroes the counters (``reset``) for the next launch. Each thread's fence
        orders its partial stores before the count; the last CTA's fence after it orders its
        reads after every other CTA's stores."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        flag = cute.make_tensor(flag_ptr, cute.make_layout(1))
        if tidx == 0:
            done = cute.arch.atomic_add(mCounters.iterator + counter, Int32(1), sem="acq_rel", scope="gpu")
            flag[0] = Int32(1) if done == num_splits - 1 else Int32(0)
        cute.arch.sync_threads()
        if flag[0] == 1:
            cute.arch.fence_acq_rel_gpu()
            self.merge_rows(mO_partial, mLSE_partial, mO, mLSE, num_splits, rows, batch, tidx)
            if tidx == 0:
                zero_counters(reset)

    @cute.jit
    def merge_rows(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                   num_splits: Int32, rows: tuple, batch: Int32, tidx: Int32):
        """The tile's rows merged from every split's partial, a warp per row (as ``Combine``)."""
        lane = tidx % 32
        for row in cutlass.range(cute.arch.make_warp_uniform(tidx // 32), rows[2], self.num_threads // 32, unroll=1):
            q_idx, head = row_coords(rows, row, self.group)
            combine_row(mO_partial, mLSE_partial, mO, mLSE, num_splits, batch, q_idx, head, lane, self.merge_prefetch)

    @cute.jit
    def merge_in_last_split(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor,
                            mLSE: cute.Tensor, mCounters: cute.Tensor, counter: Int32, reset: tuple,
                            split: Int32, num_splits: Int32, rows: tuple, batch: Int32, tidx: Int32):
        """The group's last split merges; every other split counts itself done with a release
        reduction and exits without waiting for an answer, so that its SM is free for the next
        kernel's CTA at once. The last split waits (acquire) until the count says every other
        partial is written: they were all launched before it (lower block index), so none can be
        waiting for its SM."""
        cute.arch.sync_threads()  # the CTA's partial stores come before thread 0's release
        if split < num_splits - 1:
            if tidx == 0:  # the claiming thread too: program order puts its claims before this release
                cute.arch.red(mCounters.iterator + counter, Int32(1), op="add", dtype=Int32, sem="release",
                              scope="gpu")
        else:
            if tidx == 0:
                arrived = cute.arch.load(mCounters.iterator + counter, Int32, sem="acquire", scope="gpu")
                while arrived < num_splits - 1:
                    arrived = cute.arch.load(mCounters.iterator + counter, Int32, sem="acquire", scope="gpu")
                zero_counters(reset)  # every split has counted: ready for the next launch
            cute.arch.sync_threads()
            cute.arch.fence_acq_rel_gpu()
            self.merge_rows(mO_partial, mLSE_partial, mO, mLSE, num_splits, rows, batch, tidx)


def in_range(n_block: Int32, n_hi: Int32) -> Int32:
    """n_block held below n_hi (and at 0 or more): a page lookup may run ahead of the tiles."""
    return cutlass.max(cutlass.min(n_block, n_hi - 1), 0)


def partition_pages(tma_atom: cute.CopyAtom, mX_tma: cute.Tensor, sX: cute.Tensor, box: cutlass.Constexpr,
                    head: Int32, coord: tuple):
    """``tma_pipeline.partition_for_tma`` for a paged cache, whose mode 3 counts pages, in boxes:
    SMEM indexed by (box of the tile (its mode), stage), GMEM by page * per_page + box in the
    page, or by the coordinate (box in the page, page)."""
    gX = cute.local_tile(mX_tma[None, None, head, None], box, coord + (None,))
    tXsX, tXgX = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.zipped_divide(sX, box),
                                       cute.group_modes(gX, 0, 2))
    return tXsX, cute.group_modes(tXgX, 1, 3)


def box_layout(smem_layout, box: tuple):
    """The SMEM layout of the first ``box`` of a (swizzled) stage: what one TMA of that box writes.
    Every other box of the stage is the same layout at an offset (boxes of whole 8-row swizzle atoms)."""
    stage = tma_pipeline.stage_layout(smem_layout)
    return cute.make_composed_layout(stage.inner, 0, cute.slice_(cute.logical_divide(stage.outer, box),
                                                                 ((None, 0), (None, 0))))


def packed_rows(m_block: Int32, kv_head: Int32, group: int, q_per_tile: int, q_len: Int32) -> tuple:
    """GQA packing of one query tile: row r holds query position first_q + r // group of head
    first_head + r % group (the group's heads adjacent: at q_len 1 the rows are ``group``
    neighbouring heads of q). Returns (first_q, first_head, live_rows): rows past group * q_per_tile
    or past q_len are idle."""
    first_q = m_block * q_per_tile
    return first_q, kv_head * group, cutlass.min((q_len - first_q) * group, group * q_per_tile)


@cute.jit
def zero_counters(ptrs: tuple):
    for ptr in ptrs:
        cute.make_tensor(ptr, cute.make_layout(1))[0] = Int32(0)


def row_coords(rows: tuple, row, group: int) -> tuple:
    """(query position, head) of packed ``row``."""
    return rows[0] + row // group, rows[1] + row % group


@cute.jit
def tile_range(n_tiles: Int32, num_splits: Int32, split: Int32):
    """KV tiles [lo, hi) of ``split``: ``split_range`` on the device."""
    per = cute.ceil_div(n_tiles, num_splits)
    lo = cutlass.min(split * per, n_tiles)
    return lo, cutlass.min(lo + per, n_tiles)


# --------------------------------------------------------------------------------------
# The combine kernel: one warp per output row
# --------------------------------------------------------------------------------------

class Combine:
    """O[b, i, h] = sum_s exp(LSE_s - LSE) O_s with LSE = log sum_s exp(LSE_s), per row (b, i, h).

    A warp owns a row; its lanes own d/32 adjacent columns. Two passes over the splits' LSEs
    (max, then the sum of exponentials), one over the partial rows. Launched with programmatic
    dependent launch (PDL): its CTAs start while the main kernel's last ones run, and wait in
    ``griddepcontrol_wait`` until its writes are visible, so the launch gap is hidden.
    """

    ROWS_PER_CTA = 4

    def __init__(self, merge_prefetch: int = 0):
        self.merge_prefetch = merge_prefetch

    @cute.jit
    def __call__(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 num_splits: Int32, stream):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mO_partial, mLSE_partial, mO, mLSE, num_splits).launch(
            grid=(cute.ceil_div(rows, self.ROWS_PER_CTA), 1, 1), block=[32 * self.ROWS_PER_CTA, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        # The next step's main kernel may launch now (its CTAs come up and prefetch as SMs free);
        # it waits for this grid, which waits for the main kernel: the order holds.
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()  # the main kernel has finished and its partials are visible
        row = bx * self.ROWS_PER_CTA + cute.arch.make_warp_uniform(tidx // 32)
        batch_size, q_len, nheads = mO.shape[0], mO.shape[1], mO.shape[2]
        if row < batch_size * q_len * nheads:
            head, q_idx, batch = row % nheads, (row // nheads) % q_len, row // (nheads * q_len)
            combine_row(mO_partial, mLSE_partial, mO, mLSE, num_splits, batch, q_idx, head, lane,
                        self.merge_prefetch)


@cute.jit
def l2_hint(kv_loads: tuple, n_block: Int32):
    """Pull K/V tile ``n_block`` into L2 (TMA prefetch: no SMEM, no barrier; call from one thread)."""
    tma_atom_K, tKgK, _, tma_atom_V, tVgVt, _ = kv_loads
    cute.prefetch(tma_atom_K, tKgK[None, n_block])
    cute.prefetch(tma_atom_V, tVgVt[None, n_block])


@cute.jit
def combine_row(mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                num_splits: Int32, batch: Int32, q_idx: Int32, head: Int32, lane: Int32,
                prefetch: cutlass.Constexpr[int]):
    """One warp merges the splits of output row (batch, q_idx, head); lanes own d/32 columns.
    The partial rows of the first ``prefetch`` splits are loaded before the LSE passes, so that
    they and the LSEs cross from L2 in one round trip (the merge is the step's critical path)."""
    cols = cute.size(mO, mode=[3]) // 32
    parts = cute.make_rmem_tensor((cols, max(prefetch, 1)), Float32)
    for s in cutlass.range_constexpr(prefetch):
        if s < num_splits:
            parts[None, s].store(cute.local_tile(mO_partial[s, batch, q_idx, head, None], (cols,), (lane,)).load())
    lse_max = -Float32.inf
    for s in cutlass.range(lane, num_splits, 32, unroll=1):
        lse_max = cute.arch.fmax(lse_max, mLSE_partial[s, batch, head, q_idx])
    lse_max = warp_allreduce(lse_max, cute.arch.fmax)
    shift = Float32(0.0) if lse_max == -Float32.inf else lse_max  # every split empty
    total = Float32(0.0)
    for s in cutlass.range(lane, num_splits, 32, unroll=1):
        total += cute.math.exp(mLSE_partial[s, batch, head, q_idx] - shift, fastmath=True)
    lse = shift + cute.math.log(warp_allreduce(total, operator.add), fastmath=True)  # log 0 = -inf

    # Every split wrote its partial (an empty one O = 0, LSE = -inf: weight 0), so the sum
    # needs no branch, and unrolled, the loads of several splits are in flight at once.
    lse_safe = Float32(0.0) if lse == -Float32.inf else lse  # all empty: weights exp(-inf) = 0
    acc = cute.make_rmem_tensor(cols, Float32)
    acc.fill(0.0)
    for s in cutlass.range_constexpr(prefetch):
        if s < num_splits:
            weight = cute.math.exp(mLSE_partial[s, batch, head, q_idx] - lse_safe, fastmath=True)
            acc.store(acc.load() + weight * parts[None, s].load())
    for s in cutlass.range(prefetch, num_splits, unroll=4):
        weight = cute.math.exp(mLSE_partial[s, batch, head, q_idx] - lse_safe, fastmath=True)
        part = cute.local_tile(mO_partial[s, batch, q_idx, head, None], (cols,), (lane,))
        acc.store(acc.load() + weight * part.load())
    out = cute.local_tile(mO[batch, q_idx, head, None], (cols,), (lane,))
    out.store(acc.load().to(mO.element_type))
    if lane == 0:
        mLSE[batch, head, q_idx] = lse


@cute.jit
def warp_allreduce(x: Float32, op: cutlass.Constexpr) -> Float32:
    for i in cutlass.range_constexpr(5):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=16 >> i))
    return x


# --------------------------------------------------------------------------------------
# Host: compile and launch
# --------------------------------------------------------------------------------------

def tile_slots(kv_stages: int, merge: str, claim: bool) -> int:
    """SMEM index slots (each with a pair of mbarriers): claiming names each stage's tile in one,
    then the last-CTA merge broadcasts "I am last" through one more."""
    return (kv_stages if claim else 0) + int(merge == "last_cta")


def smem_bytes(head_dim: int, tile_n: int, kv_stages: int, dtype_bytes: int = 2, merge: str = "combine",
               claim: bool = False) -> int:
    return tma_pipeline.smem_bytes(TILE_M, tile_n, head_dim, dtype_bytes, kv_stages,
                                   tile_slots=tile_slots(kv_stages, merge, claim))


CAPS = tma_pipeline.smem_capabilities(
    HEAD_DIMS, lambda d: smem_bytes(d, DEFAULT_CONFIG[d]["tile_n"], DEFAULT_CONFIG[d]["kv_stages"], merge="last_cta",
                                    claim=DEFAULT_CONFIG[d]["claim_after"] > 0),
    "DEFAULT_CONFIG", gqa=True, unequal_lengths=True, max_group=MAX_GROUP)
MERGES = ("combine", "last_cta", "last_split")
DEFAULT_MERGE = "last_cta"  # the registered ``decode``


def _fake_decode_args(dtype, head_dim: int, seqlens: bool, split: bool, counters: bool = False,
                      paged: bool = False) -> tuple:
    """Placeholders in the decode layout: q/O (b, q_len, h, d), caches (b, s_cache, h_kv, d) or
    paged (num_pages, page_size, h_kv, d) with a page table (b, max_pages), LSE (b, h, q_len),
    cache_seqlens (b,), partials (S, b, q_len, h, d) and (S, b, h, q_len), the last-CTA merge's
    counters (one per query tile, K/V head and batch, or more)."""
    from cutlass.cute.runtime import make_fake_tensor

    b, q_len, h, h_kv, s_cache, splits, n_counters, num_pages, max_pages = (cute.sym_int() for _ in range(9))

    def tensor(elem, shape, rows_aligned=True):
        div = 8 if rows_aligned else 1
        stride = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
        return make_fake_tensor(elem, shape, stride=stride, assumed_align=16 if rows_aligned else 4)

    q, o = (tensor(dtype, (b, q_len, h, head_dim)) for _ in range(2))
    k, v = (tensor(dtype, (num_pages if paged else b, s_cache, h_kv, head_dim)) for _ in range(2))
    lse = tensor(Float32, (b, h, q_len), rows_aligned=False)
    lens = make_fake_tensor(Int32, (b,), stride=(1,), assumed_align=4) if seqlens else None
    table = make_fake_tensor(Int32, (b, max_pages), stride=(cute.sym_int64(), 1), assumed_align=4) if paged else None
    o_partial = tensor(Float32, (splits, b, q_len, h, head_dim)) if split else None
    lse_partial = tensor(Float32, (splits, b, h, q_len), rows_aligned=False) if split else None
    count = make_fake_tensor(Int32, (n_counters,), stride=(1,), assumed_align=4) if counters else None
    return q, k, v, o, lse, lens, table, o_partial, lse_partial, count, Float32(1.0), Int32(1), fake_stream()


def compile_decode(head_dim: int, dtype: str, causal: bool, group: int, split: bool, seqlens: bool,
                   merge: str = "combine", keep_ptx: bool = False, paged: bool = False, page_boxes: int = 1, **cfg):
    """The main kernel; ``cfg``: a ``config`` (DEFAULT_CONFIG's keys)."""
    dt = cute_dtype(dtype)
    merge = merge if split else "combine"
    in_kernel = merge != "combine"
    if not in_kernel:  # the merge's loads live in Combine then: one main kernel for every value
        cfg = dict(cfg, merge_prefetch=0, claim_after=0)
    key = ("decode", head_dim, dtype, causal, group, split, seqlens, merge, paged, page_boxes,
           tuple(sorted(cfg.items())))
    return jit_compile(key, lambda: (DecodeFMHA(head_dim, dt, causal, group, split=split, merge=merge, paged=paged,
                                                page_boxes=page_boxes, **cfg),
                                     _fake_decode_args(dt, head_dim, seqlens, split, in_kernel, paged)), keep_ptx)


def compile_combine(head_dim: int, dtype: str, merge_prefetch: int = 0, keep_ptx: bool = False):
    dt = cute_dtype(dtype)

    def build():
        _, _, _, o, lse, _, _, o_partial, lse_partial, _, _, splits, stream = _fake_decode_args(dt, head_dim, False,
                                                                                                True)
        return Combine(merge_prefetch), (o_partial, lse_partial, o, lse, splits, stream)

    return jit_compile(("decode_combine", head_dim, dtype, merge_prefetch), build, keep_ptx)


class DecodeLauncher:
    """The main kernel and (with S > 1) the merge, bound to a split count: a ``Combine`` launch,
    or the main kernel's last-CTA merge. Called with tensors in the decode layout, it reuses the
    fp32 partials and counters of the shape on the stream (``eager``); a caller that replays
    launches (a decode plan) makes its own ``buffers`` once and calls ``launch``."""

    def __init__(self, main, combine, num_splits: int, head_dim: int, group: int, merge: str, claim: bool = False):
        self.main, self.combine, self.num_splits, self.head_dim = main, combine, num_splits, head_dim
        self.group, self.merge, self.claim = group, merge, claim
        self.eager = StreamBuffers()  # eager calls' partials and counters (each merge leaves its counter at 0)

    def counters_needed(self, batch: int, q_len: int, nheads: int) -> int:
        """One merge counter per (query tile, K/V head, batch), and as many claim counters."""
        return grid_ctas(batch, nheads // self.group, self.group, q_len) * (2 if self.claim else 1)

    def buffers(self, batch: int, q_len: int, nheads: int, device) -> tuple:
        """(partial O, partial LSE, zeroed counters) for a split launch, owned by the caller."""
        import torch

        if self.num_splits == 1:
            return None, None, None
        s = self.num_splits
        counters = (torch.zeros(self.counters_needed(batch, q_len, nheads), dtype=torch.int32, device=device)
                    if self.merge != "combine" else None)
        return (torch.empty((s, batch, q_len, nheads, self.head_dim), device=device, dtype=torch.float32),
                torch.empty((s, batch, nheads, q_len), device=device, dtype=torch.float32), counters)

    def launch(self, q, k_cache, v_cache, out, lse, cache_seqlens, scale: float, buffers: tuple, page_table=None):
        o_partial, lse_partial, counters = buffers
        self.main(q, k_cache, v_cache, out, lse, cache_seqlens, page_table, o_partial, lse_partial, counters, scale,
                  self.num_splits)
        if self.num_splits > 1 and self.merge == "combine":
            self.combine(o_partial, lse_partial, out, lse, self.num_splits)

    def eager_set(self, batch: int, q_len: int, nheads: int, device) -> tuple:
        """What an eager call of this shape reuses: ``buffers`` and an LSE for callers that do not
        want one (an allocation costs about as much host time as the launch)."""
        import torch

        lse = torch.empty((batch, nheads, q_len), device=device, dtype=torch.float32)
        return (*self.buffers(batch, q_len, nheads, device), lse)

    def launch_eager(self, device_index: int, shape: tuple, make_set, q, k_cache, v_cache, out, lse, cache_seqlens,
                     scale: float, page_table=None):
        """``launch`` with the partials, counters and (for ``lse`` None) the LSE of ``shape`` (batch,
        q_len, nheads) on this stream (``eager``, filled by ``make_set``; made for the call under
        CUDA-graph capture). A caller that repeats one shape keeps ``make_set`` (kvcache._PreparedCall)."""
        o_partial, lse_partial, counters, unread = self.eager.get(device_index, shape, make_set)
        self.launch(q, k_cache, v_cache, out, unread if lse is None else lse, cache_seqlens, scale,
                    (o_partial, lse_partial, counters), page_table)

    def __call__(self, q, k_cache, v_cache, out, lse, cache_seqlens, scale: float):
        """An eager launch on q's device (the current one): ``launch_eager`` for q's shape."""
        b, q_len, h, _ = q.shape
        self.launch_eager(q.device.index, (b, q_len, h), lambda: self.eager_set(b, q_len, h, q.device), q, k_cache,
                          v_cache, out, lse, cache_seqlens, scale)


def config(head_dim: int, **overrides) -> dict:
    """DEFAULT_CONFIG of the head dim with the caller's overrides (None keeps the default)."""
    cfg = dict(DEFAULT_CONFIG[head_dim])
    unknown = sorted(set(overrides) - set(cfg))
    if unknown:
        raise TypeError(f"unknown decode configuration keys {unknown}: the keys are {sorted(cfg)}")
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def deterministic_requested() -> bool:
    """``torch.use_deterministic_algorithms(True)``: the splits walk fixed shares (claim_after=0)
    unless the caller sets claim_after, so that a launch gives the same bits every time. Claimed
    tiles land in whichever split is fastest, which changes the fp32 summation order from run to
    run (as atomics do in torch's own non-deterministic kernels)."""
    import torch

    return torch.are_deterministic_algorithms_enabled()


def gpu_listed(gpus: tuple, gpu_name: str) -> bool:
    """Whether a GPU of this name is one of ``gpus`` (NO_CLAIM_GPUS, SHARED_SM_GPUS), in whole words:
    "NVIDIA H200" is an H200, "NVIDIA GH200" is not (it was not measured)."""
    return any(re.search(rf"\b{g}\b", gpu_name) for g in gpus)


def listed_gpu(gpus: tuple) -> bool:
    """``gpu_listed`` for the current GPU (False without one)."""
    import torch

    return torch.cuda.is_available() and gpu_listed(gpus, _device_name(torch.cuda.current_device()))


@functools.lru_cache(maxsize=None)
def _device_name(device: int) -> str:
    import torch

    return torch.cuda.get_device_name(device)


def shared_sm_tile_n(head_dim: int, num_splits: int, ctas: int, num_sms: int) -> Optional[int]:
    """SHARED_SM_TILE_N's tile when an unsplit grid has more CTAs than SMs, else None."""
    return SHARED_SM_TILE_N.get(head_dim) if num_splits == 1 and ctas > num_sms else None


def page_boxes(tile_n: int, page_size: int) -> int:
    """TMA boxes per KV tile on a paged cache: 1 when each page holds whole tiles, tile_n /
    page_size when a page is smaller than the tile (one box per page). Other sizes are refused,
    naming the sizes that work."""
    if page_size % tile_n == 0:
        return 1
    if tile_n % page_size or page_size < MIN_PAGE:
        raise UnsupportedProblem(
            f"page_size must be a multiple of {tile_n} (this head dim's KV tile) or a power of two from {MIN_PAGE} "
            f"up to it, got {page_size}")
    return tile_n // page_size


def make_launcher(head_dim: int, dtype: str, causal: bool, group: int, num_splits: int, seqlens: bool,
                  keep_ptx: bool = False, merge: str = "combine", ctas: int = 0, page_size: int = 0,
                  **cfg) -> DecodeLauncher:
    """``ctas``: the grid's CTAs per split (batch x K/V heads x query tiles), for SHARED_SM_GPUS;
    ``page_size``: a paged cache's (0: contiguous)."""
    if merge not in MERGES:
        raise UnsupportedProblem(f"merge must be one of {MERGES}, got {merge!r}")
    split = num_splits > 1
    if cfg.get("claim_after") is None and (deterministic_requested() or listed_gpu(NO_CLAIM_GPUS)):
        cfg["claim_after"] = 0
    if cfg.get("tile_n") is None and listed_gpu(SHARED_SM_GPUS):
        cfg["tile_n"] = shared_sm_tile_n(head_dim, num_splits, ctas, num_sms())
    cfg = config(head_dim, **cfg)
    boxes = page_boxes(cfg["tile_n"], page_size) if page_size else 1
    if isinstance(cfg["claim_after"], bool) or not isinstance(cfg["claim_after"], int) or cfg["claim_after"] < 0:
        raise UnsupportedProblem(f"claim_after must be an int >= 0 (0: fixed shares), got {cfg['claim_after']!r}")
    claim = split and merge != "combine" and cfg["claim_after"] > 0  # Combine cannot reset a counter: fixed shares
    static_only = [k for k in ("refill_at_release", "prefetch_ahead", "prefetch_after_wait") if cfg[k]]
    if claim and static_only:
        raise UnsupportedProblem(f"{', '.join(static_only)} act on the fixed shares' walk: pass claim_after=0 with it")
    if page_size and static_only:
        raise UnsupportedProblem(f"{', '.join(static_only)}: measured and off, and not written for a paged cache")
    if cfg["kv_stages"] * boxes > 32:
        raise UnsupportedProblem(f"{page_size}-key pages give {boxes} TMA boxes per tile, and {cfg['kv_stages']} "
                                 f"stages of them are more than the producer warp's 32 lanes look up: fewer stages")
    main = compile_decode(head_dim, dtype, causal, group, split, seqlens, merge=merge, keep_ptx=keep_ptx,
                          paged=page_size > 0, page_boxes=boxes, **cfg)
    combine = (compile_combine(head_dim, dtype, cfg["merge_prefetch"], keep_ptx) if split and merge == "combine"
               else None)
    launcher = DecodeLauncher(main, combine, num_splits, head_dim, group, merge, claim=claim)
    launcher.config = dict(cfg, claim_after=cfg["claim_after"] if claim else 0)  # what the launch runs
    if page_size:
        launcher.config["page_boxes"] = boxes
    return launcher


def compile_kernel(p: Problem, *, keep_ptx: bool = False, num_splits: int = 0, merge: str = DEFAULT_MERGE,
                   **knobs) -> CompiledAttention:
    """The ordinary contract (SDPA layout, K/V of the full seqlen_k): the decode kernel with no
    cache lengths. ``num_splits`` 0 picks S for this problem on the current GPU; ``knobs``
    override DEFAULT_CONFIG's keys."""
    CAPS.check(p)
    tile_n = config(p.head_dim, **knobs)["tile_n"]
    if not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise UnsupportedProblem(f"num_splits must be an int in [0, {MAX_SPLITS}] (0: automatic), got {num_splits!r}")
    splits = num_splits or choose_num_splits(p.batch, p.kv_heads, p.group, p.seqlen, p.kv_len, num_sms(), tile_n)
    if knobs.get("claim_after") and merge == "combine" and splits > 1:
        raise UnsupportedProblem("claim_after needs an in-kernel merge (last_cta or last_split): the merging CTA "
                                 "resets the claim counter")
    launcher = make_launcher(p.head_dim, p.dtype, p.causal, p.group, splits, False, keep_ptx, merge,
                             ctas=grid_ctas(p.batch, p.kv_heads, p.group, p.seqlen), **knobs)
    cfg = launcher.config
    ptx = None
    if keep_ptx:
        ptx = "\n".join(filter(None, (compiled_ptx(launcher.main), compiled_ptx(launcher.combine))))
    name = "decode_nosplit" if num_splits == 1 else ("decode_combine" if merge == "combine" else "decode")
    info = dict(cfg, num_splits=splits, merge=merge if splits > 1 else None,
                smem_bytes=smem_bytes(p.head_dim, cfg["tile_n"], cfg["kv_stages"], merge=merge,
                                      claim=launcher.claim))
    return CompiledAttention(name, p, launcher, {}, ptx, info)


def run_kernel(compiled: CompiledAttention, q, k, v, out, lse, softmax_scale: Optional[float] = None) -> None:
    """SDPA-layout tensors, seen in the decode layout through transposed views (no copies)."""
    scale = compiled.problem.scale if softmax_scale is None else softmax_scale
    q, k, v, out = (t.transpose(1, 2) for t in (q, k, v, out))
    compiled.launch(q, k, v, out, lse, None, scale)
