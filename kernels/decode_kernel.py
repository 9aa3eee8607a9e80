"""The decode stage's main kernel, ``DecodeFMHA`` (registered as decode_nosplit, decode_combine and
decode through kernels/decode.py, which compiles and launches it), and its device-side helpers:
the cache views, the paged cache's TMA partitions, the GQA row packing, a split's tile range and
the L2 hint. kernels/decode.py's docstring says what the kernel does; ``DecodeFMHA.kernel`` is
the order of its steps, one ``@cute.jit`` method each.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import sm90, tma_pipeline
from .contract import LOG2_E
from .decode_combine import combine_row

TILE_M = sm90.WGMMA_M  # one warpgroup: enough rows for group * q_len of any decode step up to 16 tokens at group 4
NUM_THREADS = sm90.THREADS_PER_WARPGROUP


def tile_slots(kv_stages: int, merge: str, claim: bool) -> int:
    """SMEM index slots (each with a pair of mbarriers): claiming names each stage's tile in one,
    then the last-CTA merge broadcasts "I am last" through one more."""
    return (kv_stages if claim else 0) + int(merge == "last_cta")


def cache_seq_major_view(mX: cute.Tensor) -> cute.Tensor:
    """(batch, s_cache, heads_kv, d) -> (s_cache, d, heads_kv, batch): K's TMA view (K4's
    ``seq_major_view`` for the cache layout)."""
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 3, 2, 0]))


def cache_head_dim_major_view(mX: cute.Tensor) -> cute.Tensor:
    """(batch, s_cache, heads_kv, d) -> (d, s_cache, heads_kv, batch): V read MN-major, as in K4."""
    return cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[3, 1, 2, 0]))


class DecodeFMHA:
    """Split-KV flash decode at one warpgroup: GQA heads packed into the query tile, a CTA per
    (query tile, split, K/V head, batch), O and LSE written directly (no split) or as fp32
    partials merged by ``Combine`` or in the kernel (``merge``)."""

    def __init__(self, head_dim: int, dtype, causal: bool, group: int, tile_n: int, kv_stages: int, split: bool,
                 merge: str = "combine", l2_prefetch: int = 0, refill_at_release: bool = False,
                 merge_prefetch: int = 0, prefetch_ahead: int = 0, prefetch_after_wait: int = 0,
                 claim_after: int = 0, paged: bool = False, page_boxes: int = 1, window: tuple = None):
        self.head_dim = head_dim
        self.dtype = dtype
        self.causal = causal
        self.window = window  # (left, right) or None: the splits share only the window's key tiles
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
        """One CTA: (query tile, split) from blockIdx.x, K/V head, batch. Each step below is a
        ``@cute.jit`` method, inlined where it is called: the order of the calls is the order of
        the instructions."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, kv_head, batch = cute.arch.block_idx()
        m_block, split = bx // num_splits, bx % num_splits
        q_len = mQ.shape[1]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # ---- Set-up, before the PDL wait: SMEM, pipelines, TMA partitions, the L2 prefetch ------
        hint_len = Int32(0)
        if warp_idx == 0:
            if const_expr(self.l2_prefetch > 0):  # first, so that its round trip overlaps the setup
                hint_len = self.cache_len(mK_tma, mSeqlens, mPageTable, batch, hint=True)
            tma_pipeline.prefetch_descriptors(tma_atom_K, tma_atom_V)

        storage, sQ, sK, sVt, pipeline_tile, pipeline_kv = self.smem_and_pipelines(SharedStorage, sQ_layout,
                                                                                   sK_layout, sVt_layout)
        kv_loads, page_ctx = self.partition_kv(tma_atom_K, mK_tma, sK, tma_atom_V, mV_tma, sVt, mPageTable,
                                               kv_head, batch)
        if const_expr(self.l2_prefetch > 0):
            self.prefetch_first_tiles(kv_loads, page_ctx, hint_len, num_splits, split, warp_idx)
        # Programmatic dependent launch (PDL) both ways: this grid may start while the previous
        # kernel on the stream finishes (the setup above overlaps its tail; nothing is read from
        # GMEM before the wait but the prefetch's hint), and the next one (Combine, or the next
        # step) may launch now: it waits for this grid in turn.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # ---- This CTA's keys, and the producer's first stages ---------------------------------
        lens, tiles, n_full, pages = self.cta_tiles(mK_tma, mSeqlens, mPageTable, page_ctx, batch, m_block, q_len,
                                                    num_splits, split)
        # The merge's counter for this (query tile, K/V head, batch). Pipeline positions count from
        # the split's first tile (fixed shares: t = n_block - n_lo).
        counter = (batch * cute.arch.grid_dim()[1] + kv_head) * (cute.arch.grid_dim()[0] // num_splits) + m_block
        ctx, pending, live = self.first_loads(storage, pipeline_tile, pipeline_kv, kv_loads, mCounters, counter,
                                              tiles, pages, num_splits, warp_idx)

        # ---- Q by the threads while the first K/V tiles are in flight, then the KV walk --------
        rows = packed_rows(m_block, kv_head, self.group, self.q_per_tile, q_len)
        self.load_q(mQ, sQ, rows, batch, tidx)
        mmas, acc_O, softmax, row_scale = self.mma_operands(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, tidx,
                                                            scale_log2)
        self.kv_walk(m_block, lens, n_full, tidx, warp_idx, (pipeline_kv, *kv_loads), mmas, softmax, row_scale,
                     ctx, (pending, live), pages)

        # ---- Epilogue: K4's, into O or into this split's fp32 partial ------------------------
        # An empty split (or a row that saw no key) writes O = 0 and LSE = -inf.
        if const_expr(self.split):
            mO_out, mLSE_out = mO_partial[split, None, None, None, None], mLSE_partial[split, None, None, None]
        else:
            mO_out, mLSE_out = mO, mLSE
        lse, rO = sm90.finalize_o(acc_O, softmax, mO_out.element_type)
        self.store_packed(rO, lse, tiled_mma_pv, tidx, mO_out, mLSE_out, rows, batch)
        if const_expr(self.merge != "combine"):
            self.merge_in_kernel((mO_partial, mLSE_partial, mO, mLSE, mCounters), counter, ctx, storage, split,
                                 num_splits, rows, batch, tidx)

    @cute.jit
    def smem_and_pipelines(self, SharedStorage: cutlass.Constexpr, sQ_layout: cute.ComposedLayout,
                           sK_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout):
        """The CTA's SMEM (sQ, the K/V stages, the barriers and tile slots), the K/V pipeline and,
        claiming, the tile-index pipeline. Returns (storage, sQ, sK, sVt, pipeline_tile, pipeline_kv)."""
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sK, sVt = tma_pipeline.smem_tensors(storage, sQ_layout, sK_layout, sVt_layout)
        pipeline_tile = None
        if const_expr(self.claim_after > 0):
            # K5's tile-index pipeline: one producer thread posts each tile's index in a slot, and
            # every consumer thread reads it and releases the slot (inited here, fenced below).
            pipeline_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(), num_stages=self.kv_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_threads), defer_sync=True)
        pipeline_kv = tma_pipeline.make_kv_pipeline(storage, self.dtype, sK_layout, sVt_layout, self.kv_stages,
                                                    self.num_threads)
        return storage, sQ, sK, sVt, pipeline_tile, pipeline_kv

    @cute.jit
    def partition_kv(self, tma_atom_K: cute.CopyAtom, mK_tma: cute.Tensor, sK: cute.Tensor,
                     tma_atom_V: cute.CopyAtom, mV_tma: cute.Tensor, sVt: cute.Tensor,
                     mPageTable: Optional[cute.Tensor], kv_head: Int32, batch: Int32):
        """The K/V TMA partitions, as ``kv_loads`` (tma_atom_K, tKgK, tKsK, tma_atom_V, tVgVt,
        tVsVt), indexed by KV tile; paged, by box, with ``page_ctx`` (page table, batch, boxes per
        page, pages in the pool) for the lookups (None when contiguous)."""
        tile_n, d = self.tile_n, self.head_dim
        page_ctx = None
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
        return (tma_atom_K, tKgK, tKsK, tma_atom_V, tVgVt, tVsVt), page_ctx

    @cute.jit
    def prefetch_first_tiles(self, kv_loads: tuple, page_ctx: Optional[tuple], hint_len: Int32, num_splits: Int32,
                             split: Int32, warp_idx: Int32):
        """Warp 0, before the PDL wait: the split's first l2_prefetch tiles pulled into L2.

        This CTA usually starts while the previous kernel on the stream drains (PDL): HBM would
        idle through that kernel's tail and this one's first round trip. Only a hint: that kernel
        may still write the cache or the lengths, but L2 is coherent, so the TMA loads after the
        wait see its writes; a stale length (``hint_len``) merely aims the prefetch at other tiles."""
        # Under a window the split's tiles start at the window's first: no hint (not measured).
        if warp_idx == 0 and const_expr(self.window is None):
            if const_expr(self.paged):  # one length for the warp: the loop below shuffles
                hint_len = cute.arch.shuffle_sync(hint_len, 0)
            lo, hi, _ = self.split_tiles(cute.ceil_div(hint_len, self.tile_n), num_splits, split)
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

    @cute.jit
    def cta_tiles(self, mK_tma: cute.Tensor, mSeqlens: Optional[cute.Tensor], mPageTable: Optional[cute.Tensor],
                  page_ctx: Optional[tuple], batch: Int32, m_block: Int32, q_len: Int32, num_splits: Int32,
                  split: Int32):
        """This CTA's keys: the sequence's cache length, then its split's share of the tiles.
        Returns (lens, tiles, n_full, pages): ``lens`` (kv_len, causal_offset, n_lo, n_hi) for
        ``kv_iteration``, ``tiles`` (n_lo, n_hi, claim_base, n_tiles) for the producer, the first
        tile that needs the element mask, and paged, ``page_ctx`` with the key count."""
        tile_n = self.tile_n
        kv_len = self.cache_len(mK_tma, mSeqlens, mPageTable, batch)
        pages = None
        if const_expr(self.paged):
            pages = page_ctx + (kv_len,)
        causal_offset = kv_len - q_len  # bottom-right: query i sees keys j <= i + causal_offset
        n_tiles = cute.ceil_div(kv_len, tile_n)
        if const_expr(self.window is None):
            n_lo, n_hi, claim_base = self.split_tiles(n_tiles, num_splits, split)
        else:  # the splits share the key tiles some row of the tile sees, and only those
            n_first, n_tiles = self.window_tiles(m_block * self.q_per_tile, q_len, causal_offset, n_tiles)
            n_lo, n_hi, claim_base = self.split_tiles(n_tiles - n_first, num_splits, split)
            n_lo, n_hi, claim_base = n_lo + n_first, n_hi + n_first, claim_base + n_first
        # Tiles from n_full on need the element mask: the tail past kv_len and, causal, the tiles
        # past the first packed row's diagonal; under a window every tile (its edges are per row).
        n_full = kv_len // tile_n
        if const_expr(self.causal):
            first_query = m_block * self.q_per_tile
            n_full = cutlass.min(n_full, cutlass.max(first_query + causal_offset + 1, 0) // tile_n)
        if const_expr(self.window is not None):
            n_full = n_first
        return (kv_len, causal_offset, n_lo, n_hi), (n_lo, n_hi, claim_base, n_tiles), n_full, pages

    @cute.jit
    def window_tiles(self, first_query: Int32, q_len: Int32, causal_offset: Int32, n_tiles: Int32) -> tuple:
        """[first, end) of the key tiles a sliding window leaves the tile's query rows: from the
        first row's left edge to the last row's right edge (causal: its diagonal)."""
        left, right = self.window
        n_first, n_end = Int32(0), n_tiles
        if const_expr(left >= 0):
            n_first = cutlass.max(first_query + causal_offset - left, 0) // self.tile_n
        if const_expr(right >= 0 and not self.causal):
            last_query = cutlass.min(first_query + self.q_per_tile, q_len) - 1
            n_end = cutlass.min(n_tiles, cutlass.max(last_query + causal_offset + right + 1, 0)
                                // self.tile_n + 1)
        return n_first, cutlass.max(n_end, n_first)

    @cute.jit
    def first_loads(self, storage, pipeline_tile, pipeline_kv, kv_loads: tuple, mCounters: Optional[cute.Tensor],
                    counter: Int32, tiles: tuple, pages: Optional[tuple], num_splits: Int32, warp_idx: Int32):
        """Warp 0 fills the first K/V stages: the split's own tiles, or claiming, its own then
        claimed ones (each posted in its tile slot). Returns (ctx, pending, live): claiming, the
        claim context (claim counter, tile pipeline, slots, ``tiles``, pages), the claim in flight
        and whether the producer still has tiles; else (None, 0, True)."""
        stages = self.kv_stages
        n_lo, n_hi, claim_base, n_tiles = tiles
        ctx, pending, live = None, Int32(0), cutlass.Boolean(True)
        if const_expr(self.claim_after > 0):
            # The claim counters follow the merge's, one per (query tile, K/V head, batch).
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
        return ctx, pending, live

    @cute.jit
    def mma_operands(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, sQ: cute.Tensor,
                     sK: cute.Tensor, sVt: cute.Tensor, tidx: Int32, scale_log2: Float32):
        """K4's GEMM operands at one warpgroup, the zeroed O accumulator and the online softmax.
        Returns (mmas, acc_O, softmax, row_scale); ``mmas`` is ``kv_iteration``'s and holds acc_O too."""
        tile_m, tile_n, d = self.tile_m, self.tile_n, self.head_dim
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
        return (tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, sVt, tOrVt, tOrP, acc_O, tScS), acc_O, softmax, row_scale

    @cute.jit
    def kv_walk(self, m_block: Int32, lens: tuple, n_full: Int32, tidx: Int32, warp_idx: Int32, loads: tuple,
                mmas: tuple, softmax: sm90.OnlineSoftmax, row_scale: cute.Tensor, ctx: Optional[tuple],
                claims: tuple, pages: Optional[tuple]):
        """The split's KV tiles through ``kv_iteration``: the unmasked ones, then those from n_full
        on with the mask; claiming, in the order the producer posts them."""
        kv_len, causal_offset, n_lo, n_hi = lens
        if const_expr(self.claim_after > 0):
            # The producer names each stage's tile in its SMEM slot (-1: no more), so the loop runs
            # until it reads -1; a tile needs the mask from n_full on, wherever it comes in the walk.
            pending, live = claims
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
                           causal_offset, rows_per_query=self.group, window=self.window)
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
    def merge_in_kernel(self, tensors: tuple, counter: Int32, ctx: Optional[tuple], storage, split: Int32,
                        num_splits: Int32, rows: tuple, batch: Int32, tidx: Int32):
        """After the partial is stored: the group's merge by its last CTA (``merge_if_last``) or by
        its last split (``merge_in_last_split``). ``tensors``: (mO_partial, mLSE_partial, mO, mLSE,
        mCounters)."""
        mO_partial, mLSE_partial, mO, mLSE, mCounters = tensors
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


# The kernel's module-level helpers (the @cute.jit ones inlined like its methods, the rest plain
# Python run while tracing).

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
    """KV tiles [lo, hi) of ``split``: kernels/decode.py's ``split_range`` on the device."""
    per = cute.ceil_div(n_tiles, num_splits)
    lo = cutlass.min(split * per, n_tiles)
    return lo, cutlass.min(lo + per, n_tiles)


@cute.jit
def l2_hint(kv_loads: tuple, n_block: Int32):
    """Pull K/V tile ``n_block`` into L2 (TMA prefetch: no SMEM, no barrier; call from one thread)."""
    tma_atom_K, tKgK, _, tma_atom_V, tVgVt, _ = kv_loads
    cute.prefetch(tma_atom_K, tKgK[None, n_block])
    cute.prefetch(tma_atom_V, tVgVt[None, n_block])

