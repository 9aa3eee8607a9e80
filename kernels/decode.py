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

This module is the registered stage (decode_nosplit, decode_combine, decode): the constants and
measured defaults, the host-side split arithmetic, and compiling and launching (``make_launcher``,
``compile_kernel``, ``run_kernel``). The kernels live beside it: ``DecodeFMHA`` in
kernels/decode_kernel.py, ``Combine`` and the row merge it shares with the in-kernel merges in
kernels/decode_combine.py.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import cutlass.cute as cute
from cutlass import Float32, Int32

from . import tma_pipeline
from .contract import (
    CompiledAttention,
    Config,
    Problem,
    StreamBuffers,
    UnsupportedProblem,
    compiled_ptx,
    configure,
    cute_dtype,
    fake_stream,
    jit_compile,
    num_sms,
)
from .decode_combine import Combine
from .decode_kernel import TILE_M, DecodeFMHA, tile_slots

HEAD_DIMS = (64, 128, 256)
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
# Host: compile and launch
# --------------------------------------------------------------------------------------

def smem_bytes(head_dim: int, tile_n: int, kv_stages: int, dtype_bytes: int = 2, merge: str = "combine",
               claim: bool = False) -> int:
    return tma_pipeline.smem_bytes(TILE_M, tile_n, head_dim, dtype_bytes, kv_stages,
                                   tile_slots=tile_slots(kv_stages, merge, claim))


CAPS = tma_pipeline.smem_capabilities(
    HEAD_DIMS, lambda d: smem_bytes(d, DEFAULT_CONFIG[d]["tile_n"], DEFAULT_CONFIG[d]["kv_stages"], merge="last_cta",
                                    claim=DEFAULT_CONFIG[d]["claim_after"] > 0),
    "DEFAULT_CONFIG", gqa=True, unequal_lengths=True, max_group=MAX_GROUP, window=True)
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
                   merge: str = "combine", keep_ptx: bool = False, paged: bool = False, page_boxes: int = 1,
                   window: tuple = None, **cfg):
    """The main kernel; ``cfg``: a ``config`` (DEFAULT_CONFIG's keys); ``window``: a sliding
    window's (left, right), or None."""
    dt = cute_dtype(dtype)
    merge = merge if split else "combine"
    in_kernel = merge != "combine"
    if not in_kernel:  # the merge's loads live in Combine then: one main kernel for every value
        cfg = dict(cfg, merge_prefetch=0, claim_after=0)
    key = ("decode", head_dim, dtype, causal, group, split, seqlens, merge, paged, page_boxes,
           tuple(sorted(cfg.items())), *((window,) if window else ()))
    return jit_compile(key, lambda: (DecodeFMHA(head_dim, dt, causal, group, split=split, merge=merge, paged=paged,
                                                page_boxes=page_boxes, **cfg, **({"window": window} if window else {})),
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


def config(head_dim: int, overrides: dict = None) -> Config:
    """DEFAULT_CONFIG of the head dim, then the overrides. Keyed by head dim alone: a decode
    launcher is compiled before any call's shapes are known."""
    defaults = DEFAULT_CONFIG[head_dim]
    unknown = sorted(set(overrides or {}) - set(defaults))
    if unknown:
        raise TypeError(f"unknown decode configuration keys {unknown}: the keys are {sorted(defaults)}")
    return configure(defaults, overrides)


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
                  window: tuple = None, **cfg) -> DecodeLauncher:
    """``ctas``: the grid's CTAs per split (batch x K/V heads x query tiles), for SHARED_SM_GPUS;
    ``page_size``: a paged cache's (0: contiguous); ``window``: (left, right), or None for none."""
    if merge not in MERGES:
        raise UnsupportedProblem(f"merge must be one of {MERGES}, got {merge!r}")
    split = num_splits > 1
    if cfg.get("claim_after") is None and (deterministic_requested() or listed_gpu(NO_CLAIM_GPUS)):
        cfg["claim_after"] = 0
    if cfg.get("tile_n") is None and listed_gpu(SHARED_SM_GPUS):
        cfg["tile_n"] = shared_sm_tile_n(head_dim, num_splits, ctas, num_sms())
    cfg = config(head_dim, cfg)
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
                          paged=page_size > 0, page_boxes=boxes, window=window, **cfg)
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
    tile_n = config(p.head_dim, knobs)["tile_n"]
    if not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise UnsupportedProblem(f"num_splits must be an int in [0, {MAX_SPLITS}] (0: automatic), got {num_splits!r}")
    splits = num_splits or choose_num_splits(p.batch, p.kv_heads, p.group, p.seqlen, p.kv_len, num_sms(), tile_n)
    if knobs.get("claim_after") and merge == "combine" and splits > 1:
        raise UnsupportedProblem("claim_after needs an in-kernel merge (last_cta or last_split): the merging CTA "
                                 "resets the claim counter")
    launcher = make_launcher(p.head_dim, p.dtype, p.causal, p.group, splits, False, keep_ptx, merge,
                             ctas=grid_ctas(p.batch, p.kv_heads, p.group, p.seqlen),
                             window=p.sliding_window, **knobs)
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
