"""Attention over a KV cache, in flash-attn's ``flash_attn_with_kvcache`` layout.

    out = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens)      # one call
    plan = decode_plan(batch, nheads, nheads_kv, head_dim, max_seqlen_k)  # a serving loop:
    out, lse = plan.run(q, k_cache, v_cache, cache_seqlens)               #   validate once, then launch

q is (batch, q_len, nheads, head_dim); the caches (batch, s_cache, nheads_kv, head_dim); query head
h reads K/V head h // (nheads // nheads_kv). A paged cache (flash-attn's ``page_table``) is
(num_pages, page_size, nheads_kv, head_dim), with an int32 ``page_table`` (batch, max_pages): key
j of sequence b is row j % page_size of page page_table[b, j // page_size]. Entries past a
sequence's length may hold anything: no page is loaded through them. ``cache_seqlens`` gives each
sequence's length: None (all s_cache rows), an int, or an int32 CUDA tensor (batch,). Rows past a
sequence's length are never read into the result, whatever they hold. Causal is aligned
bottom-right: query i sees keys j <= i + cache_seqlens[b] - q_len; a row that sees no key gives
O = 0 and LSE = -inf.

``plan.run`` returns buffers the plan owns and reuses on every call, and does no host work beyond a
shape comparison and one launch (two with ``decode_combine``), so a warmed-up call can be captured
in a CUDA graph; the lengths then change in ``cache_seqlens``, never in shapes.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from kernels import get_kernel
from kernels.contract import (Problem, StreamBuffers, UnsupportedProblem, as_causal, as_flag, as_scale, as_window,
                              fresh_buffers, num_sms)

from .inputs import shared_dtype, torch_dtype

# Registered decode steps and how each merges its splits (kernels/decode.py).
MERGE = {"decode": "last_cta", "decode_combine": "combine", "decode_nosplit": "combine"}
DECODE_KERNELS = tuple(MERGE)


def _check_kernel(kernel: str):
    if kernel not in DECODE_KERNELS:
        raise UnsupportedProblem(f"kernel must be one of {DECODE_KERNELS} for a KV cache, got {kernel!r}")
    return get_kernel(kernel)


def _check_layout(name: str, t, rank_names: str):
    if not isinstance(t, torch.Tensor):
        raise UnsupportedProblem(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise UnsupportedProblem(f"{name} must be 4-D {rank_names}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise UnsupportedProblem(f"{name} must have a contiguous last dim, 16-byte alignment and strides that are "
                                 f"multiples of 8 elements (TMA rows), got strides {t.stride()}")
    if t.requires_grad:
        raise UnsupportedProblem(f"{name} requires grad: these kernels are forward-only")


def problem_from_cache(q, k_cache, v_cache, causal: bool, softmax_scale=None, page_table=None) -> Problem:
    """Check q, the caches and a page table (shapes, dtypes, layout; nothing that needs a GPU) and
    describe them as a Problem whose seqlen is q_len and whose seqlen_k is the cache capacity
    (paged: max_pages x page_size)."""
    _check_layout("q", q, "(batch, q_len, nheads, head_dim)")
    layout = "(num_pages, page_size, nheads_kv, head_dim)" if page_table is not None else \
        "(batch, s_cache, nheads_kv, head_dim)"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_layout(name, t, layout)
    if k_cache.shape != v_cache.shape:
        raise UnsupportedProblem(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                                 f"{tuple(v_cache.shape)}")
    b, q_len, h, d = q.shape
    capacity = k_cache.shape[1]
    if page_table is not None:
        check_page_table(page_table, b, q.device)
        capacity = page_table.shape[1] * k_cache.shape[1]
    elif k_cache.shape[0] != b:
        raise UnsupportedProblem(f"the caches must have q's batch and head_dim: q {tuple(q.shape)}, caches "
                                 f"{tuple(k_cache.shape)} (layout {layout}; a paged cache needs a page_table)")
    if k_cache.shape[3] != d:
        raise UnsupportedProblem(f"the caches must have q's batch and head_dim: q {tuple(q.shape)}, caches "
                                 f"{tuple(k_cache.shape)} (layout {layout})")
    if min(q.shape) < 1 or min(k_cache.shape) < 1:
        raise UnsupportedProblem(f"every dimension must be positive, got q {tuple(q.shape)}, caches "
                                 f"{tuple(k_cache.shape)}")
    h_kv = k_cache.shape[2]
    if h_kv > h or h % h_kv:
        raise UnsupportedProblem(f"q's nheads must be a multiple of the caches' nheads_kv (grouped-query attention), "
                                 f"got {h} and {h_kv}")
    dtype = shared_dtype("q and the caches", q, k_cache, v_cache)
    if not (q.device == k_cache.device == v_cache.device):
        raise UnsupportedProblem(f"q and the caches must be on one device, got {q.device}, {k_cache.device}, "
                                 f"{v_cache.device}")
    return Problem(b, h, q_len, d, dtype=dtype, causal=causal, softmax_scale=softmax_scale,
                   seqlen_k=capacity, nheads_kv=h_kv)


def check_page_table(page_table, batch: int, device) -> None:
    """An int32 (batch, max_pages) tensor, rows contiguous, on q's device (as cache_seqlens, its
    values are not checked: that would cost a sync)."""
    if not isinstance(page_table, torch.Tensor):
        raise UnsupportedProblem(f"page_table must be None or an int32 tensor, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        raise UnsupportedProblem(f"page_table must be int32, got {page_table.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
        raise UnsupportedProblem(f"page_table must be ({batch}, max_pages), one row of page indices per sequence, "
                                 f"got shape {tuple(page_table.shape)}")
    if page_table.stride(1) != 1 or page_table.data_ptr() % 4:
        raise UnsupportedProblem(f"page_table's rows must be contiguous, got strides {page_table.stride()}")
    if page_table.device != device:
        raise UnsupportedProblem(f"page_table must be on q's device ({device}), got {page_table.device}")


def check_seqlens(cache_seqlens, batch: int, device) -> None:
    """An int32 tensor (batch,) on q's device: the kernel reads it there (checking its values
    against s_cache would cost a sync: the kernel clamps them instead)."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise UnsupportedProblem(f"cache_seqlens must be None, an int or an int32 tensor, got "
                                 f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise UnsupportedProblem(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,) or cache_seqlens.stride(0) != 1:
        raise UnsupportedProblem(f"cache_seqlens must be a contiguous ({batch},) tensor, one length per sequence, "
                                 f"got shape {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise UnsupportedProblem(f"cache_seqlens must be on q's device ({device}), got {cache_seqlens.device}")


def kv_tile(head_dim: int) -> int:
    """Keys per KV tile of the decode kernels at ``head_dim`` (their default configuration)."""
    from kernels import decode

    return decode.config(head_dim)["tile_n"]


def check_page_size(head_dim: int, page_size: int) -> None:
    """Pages of whole KV tiles, or tiles of whole pages (``decode.page_boxes`` says which sizes)."""
    from kernels import decode

    decode.page_boxes(decode.config(head_dim)["tile_n"], page_size)


def _num_splits(num_splits, kernel: str) -> int:
    if kernel == "decode_nosplit":
        return 1
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= 128:
        raise UnsupportedProblem(f"num_splits must be an int in [0, 128] (0: automatic, 1: no split), got {num_splits!r}")
    return num_splits


_SPLITS: dict = {}
_CAPABILITIES: dict = {}


def _capability(device) -> tuple:
    if device not in _CAPABILITIES:
        _CAPABILITIES[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITIES[device]

_LAUNCHERS: dict = {}


def resolve_splits(p: Problem, num_splits: int, max_seqlen_k: Optional[int] = None) -> int:
    """``num_splits``, or for 0 the heuristic's choice for this shape on the current GPU (memoized:
    the heuristic is a Python loop, and a decode call has microseconds to spare)."""
    if num_splits:
        return num_splits
    key = (p.batch, p.kv_heads, p.group, p.seqlen, max_seqlen_k or p.kv_len, p.head_dim, torch.cuda.current_device())
    if key not in _SPLITS:
        from kernels import decode

        _SPLITS[key] = decode.choose_num_splits(p.batch, p.kv_heads, p.group, p.seqlen, key[4], num_sms(),
                                                decode.config(p.head_dim)["tile_n"])
    return _SPLITS[key]


def window_keys(p: Problem, max_seqlen_k: Optional[int] = None) -> Optional[int]:
    """The most keys a query tile's window can span (None: no bound below ``max_seqlen_k`` or the
    cache): what the split count should be chosen for, since the splits share only those. Aligned
    bottom-right, the last query's right edge is the cache's end whatever the right size, so the
    span is left + q_len keys, causal or not (and one split count: the same bits either way)."""
    left = p.window[0]
    if left < 0:
        return max_seqlen_k
    return min(max_seqlen_k or p.kv_len, left + p.seqlen)


def launcher_for(p: Problem, num_splits: int, seqlens: bool, kernel: str, page_size: int = 0):
    """The compiled kernel(s) for a resolved split count; lengths and scale are launch arguments
    (``page_size``: a paged cache's, which sets the TMA boxes per tile: decode.page_boxes)."""
    from kernels import decode

    ctas = decode.grid_ctas(p.batch, p.kv_heads, p.group, p.seqlen)
    window = p.sliding_window
    key = (p.head_dim, p.dtype, p.causal, p.group, num_splits, seqlens, MERGE[kernel], decode.deterministic_requested(),
           torch.cuda.current_device(),  # the defaults may differ by GPU (decode.NO_CLAIM_GPUS, SHARED_SM_GPUS)
           ctas > num_sms(), page_size, window)
    if key not in _LAUNCHERS:
        _LAUNCHERS[key] = decode.make_launcher(p.head_dim, p.dtype, p.causal, p.group, num_splits, seqlens,
                                               merge=MERGE[kernel], ctas=ctas, page_size=page_size, window=window)
    return _LAUNCHERS[key]


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, *, page_table=None, causal: bool = False,
                           softmax_scale=None, num_splits: int = 0, return_lse: bool = False, kernel: str = "decode",
                           window_size=None):
    """softmax(q k^T * scale) v over each sequence's first cache_seqlens[b] cache rows (paged:
    the rows its ``page_table`` row names, page after page).

    Returns O (batch, q_len, nheads, head_dim) in q's dtype, and with ``return_lse`` the float32
    (batch, nheads, q_len) log-sum-exp. ``num_splits``: 0 picks a split count that fills the GPU,
    1 turns the split off. ``window_size`` (left, right): a sliding window, aligned bottom-right as
    causal is (query i of q_len sees cache rows i + len - q_len - left ... + right; -1: unbounded);
    the splits share only the window's key tiles. Unsupported inputs raise ``kernels.UnsupportedProblem`` naming the
    constraint, before anything is launched. A call whose arguments look like an earlier one's
    (shapes, strides, dtypes, devices, flags) skips the checks that call passed.
    """
    if torch.compiler.is_compiling():  # under torch.compile: the opaque custom op below
        if isinstance(cache_seqlens, torch.Tensor):
            lens, length = cache_seqlens, None
        else:
            lens, length = None, cache_seqlens
        scale = None if softmax_scale is None else as_scale(softmax_scale)
        return_lse = as_flag("return_lse", return_lse)
        left, right = as_window(window_size)
        out, lse = torch.ops.fa3_cute.attention_with_kvcache(q, k_cache, v_cache, lens, length, page_table,
                                                             as_causal(causal), scale, num_splits, kernel, left, right)
        return (out, lse) if return_lse else out
    try:
        key = _call_signature(q, k_cache, v_cache, cache_seqlens, page_table, causal, softmax_scale, num_splits,
                              return_lse, kernel) + (type(window_size), window_size)
        prepared = _PREPARED.get(key)
    except (TypeError, AttributeError):  # unhashable flags or non-tensors: the full checks will say what
        key, prepared = None, None
    if prepared is None:
        prepared = _prepare(q, k_cache, v_cache, cache_seqlens, page_table, causal, softmax_scale, num_splits,
                            return_lse, kernel, window_size)
        if key is not None:
            if len(_PREPARED) >= 256:  # many shapes (a varying batch): start over rather than grow
                _PREPARED.clear()
            _PREPARED[key] = prepared
    return prepared(q, k_cache, v_cache, cache_seqlens, page_table)


class _PreparedCall:
    """What the checks of one call signature decided, and the launch they allow. Everything the
    call derives from shapes is worked out here once: a decode call has microseconds to spare."""

    def __init__(self, launcher, scale: float, kv_rows: Optional[int], return_lse: bool, q, length=None):
        b, q_len, h, _ = q.shape
        self.launcher, self.scale, self.kv_rows, self.return_lse = launcher, scale, kv_rows, return_lse
        self.make_lengths = None
        if length is not None:  # a paged cache's int length, as the tensor the kernel reads: kept per stream as
            # the split buffers are, and made anew under capture (the graph's pool owns it then)
            self.lengths = StreamBuffers()
            self.make_lengths = functools.partial(torch.full, (b,), length, dtype=torch.int32, device=q.device)
        self.device, self.device_index = q.device, q.device.index
        self.shape, self.lse_shape = (b, q_len, h), (b, h, q_len)
        if launcher is not None:
            self.make_set = functools.partial(launcher.eager_set, b, q_len, h, q.device)

    def __call__(self, q, k_cache, v_cache, cache_seqlens, page_table=None):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # cheaper than torch.empty(shape, ...)
        lse = torch.empty(self.lse_shape, device=self.device, dtype=torch.float32) if self.return_lse else None
        if self.launcher is None:  # an int length of 0: no keys, nothing to launch
            out.zero_()
            return (out, lse.fill_(-math.inf)) if self.return_lse else out
        if self.kv_rows is not None:  # one int length for all: the caches' first rows are the whole problem (views)
            k_cache, v_cache, cache_seqlens = k_cache[:, :self.kv_rows], v_cache[:, :self.kv_rows], None
        elif self.make_lengths is not None:
            cache_seqlens = self.lengths.get(self.device_index, (), self.make_lengths)
        args = (self.device_index, self.shape, self.make_set, q, k_cache, v_cache, out, lse, cache_seqlens, self.scale,
                page_table)
        if self.device_index == torch.cuda.current_device():
            self.launcher.launch_eager(*args)
        else:
            with torch.cuda.device(self.device_index):  # the launch goes to the current device's stream
                self.launcher.launch_eager(*args)
        return (out, lse) if self.return_lse else out


_PREPARED: dict = {}


@torch.library.custom_op("fa3_cute::attention_with_kvcache", mutates_args=())
def _kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: Optional[torch.Tensor],
                cache_length: Optional[int], page_table: Optional[torch.Tensor], causal: bool,
                softmax_scale: Optional[float], num_splits: int, kernel: str, window_left: int = -1,
                window_right: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.compile sees: (O, LSE) from the eager call (a custom op has a fixed number of
    outputs; the length comes as a tensor or as an int, never both)."""
    lens = cache_seqlens if cache_seqlens is not None else cache_length
    with fresh_buffers():  # nothing kept from a custom op's body (kernels.contract.fresh_buffers)
        return attention_with_kvcache(q, k_cache, v_cache, lens, page_table=page_table, causal=causal,
                                      softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True,
                                      kernel=kernel, window_size=(window_left, window_right))


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, cache_length, page_table, causal, softmax_scale, num_splits,
                  kernel, window_left=-1, window_right=-1):
    b, q_len, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, q_len), dtype=torch.float32)


def _call_signature(q, k_cache, v_cache, cache_seqlens, page_table, causal, softmax_scale, num_splits, return_lse,
                    kernel):
    """Everything the checks look at, cheaply (one flat tuple): equal signatures pass or fail the
    checks alike."""
    if isinstance(cache_seqlens, torch.Tensor):
        lens = (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
                cache_seqlens.data_ptr() % 16)
    else:
        lens = (type(cache_seqlens), cache_seqlens)
    if isinstance(page_table, torch.Tensor):
        pages = (page_table.shape, page_table.stride(), page_table.dtype, page_table.device, page_table.data_ptr() % 4)
    else:
        pages = (type(page_table),)
    return (kernel, type(causal), causal, type(softmax_scale), softmax_scale, type(num_splits), num_splits,
            type(return_lse), return_lse, lens, pages,
            q.shape, q.stride(), q.dtype, q.device, q.requires_grad, q.data_ptr() % 16,
            k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.requires_grad,
            k_cache.data_ptr() % 16,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.requires_grad,
            v_cache.data_ptr() % 16,
            torch.are_deterministic_algorithms_enabled())  # the prepared launcher walks fixed shares then


def _prepare(q, k_cache, v_cache, cache_seqlens, page_table, causal, softmax_scale, num_splits, return_lse, kernel,
             window_size=None):
    """Every check, then the call they allow (``_PreparedCall``)."""
    entry = _check_kernel(kernel)
    causal = as_causal(causal)
    return_lse = as_flag("return_lse", return_lse)
    scale = None if softmax_scale is None else as_scale(softmax_scale)
    p = problem_from_cache(q, k_cache, v_cache, causal, scale, page_table).with_(window=as_window(window_size))
    page_size = k_cache.shape[1] if page_table is not None else 0
    # Causal with q_len > a cache length is fine here: those query rows see no key (O = 0, LSE = -inf).
    entry.caps.check(p.with_(causal=False), want_lse=return_lse)
    if page_size:
        check_page_size(p.head_dim, page_size)
    splits = _num_splits(num_splits, kernel)
    if isinstance(cache_seqlens, bool) or (cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor)
                                           and not isinstance(cache_seqlens, int)):
        raise UnsupportedProblem(f"cache_seqlens must be None, an int or an int32 tensor, got {cache_seqlens!r}")
    kv_rows = None
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= p.kv_len:
            raise UnsupportedProblem(f"cache_seqlens {cache_seqlens} must be in [0, s_cache = {p.kv_len}]")
        kv_rows = cache_seqlens
    elif cache_seqlens is not None:
        check_seqlens(cache_seqlens, p.batch, q.device)
    if not q.is_cuda:
        raise UnsupportedProblem(f"q and the caches must be CUDA tensors, got device {q.device}")
    entry.caps.check_device(_capability(q.device))
    if kv_rows == 0:
        return _PreparedCall(None, p.scale, None, return_lse, q)
    length = None
    if kv_rows is not None:
        p = p.with_(seqlen_k=kv_rows)
        if page_table is not None:  # pages cannot be cut to a length as rows can: the kernel reads it
            length, kv_rows = kv_rows, None
    with torch.cuda.device(q.device):
        launcher = launcher_for(p, resolve_splits(p, splits, window_keys(p)),
                                cache_seqlens is not None and kv_rows is None, kernel, page_size)
    return _PreparedCall(launcher, p.scale, kv_rows, return_lse, q, length)


class DecodePlan:
    """A decode step compiled, sized and validated once; ``run`` only launches."""

    def __init__(self, problem: Problem, kernel: str, num_splits: int, device, max_seqlen_k: int, page_size: int = 0):
        self.problem, self.page_size = problem, page_size
        self.scale = problem.scale
        self.launcher = launcher_for(problem, resolve_splits(problem, num_splits, window_keys(problem, max_seqlen_k)),
                                     True, kernel, page_size)
        self.num_splits = self.launcher.num_splits
        b, q_len, h, d = problem.batch, problem.seqlen, problem.nheads, problem.head_dim
        self.q_shape = (b, q_len, h, d)
        self.out = torch.empty(self.q_shape, device=device, dtype=torch_dtype(problem.dtype))
        self.lse = torch.empty((b, h, q_len), device=device, dtype=torch.float32)
        self.buffers = self.launcher.buffers(b, q_len, h, device)  # partials and zeroed merge/claim counters
        self.device = torch.device(device)
        self._checked = None  # the (q, cache, lengths) signature last validated in full
        self.info = dict(self.launcher.config, num_splits=self.num_splits)

    def _signature(self, q, k_cache, v_cache, cache_seqlens, page_table):
        return (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), v_cache.shape,
                v_cache.stride(), k_cache.dtype, v_cache.dtype, k_cache.device, v_cache.device,
                getattr(cache_seqlens, "dtype", None), getattr(cache_seqlens, "shape", None),
                getattr(cache_seqlens, "device", None), type(page_table), getattr(page_table, "dtype", None),
                getattr(page_table, "shape", None), getattr(page_table, "stride", tuple)(),
                getattr(page_table, "device", None))

    def _validate(self, q, k_cache, v_cache, cache_seqlens, page_table):
        if self.page_size and page_table is None:
            raise UnsupportedProblem(f"this plan was made for a paged cache (page_size {self.page_size}): pass its "
                                     f"page_table")
        if page_table is not None and not self.page_size:
            raise UnsupportedProblem("this plan was made for a contiguous cache: make one with page_size to pass a "
                                     "page_table")
        p = problem_from_cache(q, k_cache, v_cache, self.problem.causal, self.problem.softmax_scale, page_table)
        if page_table is not None and k_cache.shape[1] != self.page_size:
            raise UnsupportedProblem(f"this plan was made for pages of {self.page_size} rows; the caches' pages "
                                     f"have {k_cache.shape[1]}")
        want = self.problem
        if (p.batch, p.seqlen, p.nheads, p.head_dim, p.kv_heads, p.dtype) != (
                want.batch, want.seqlen, want.nheads, want.head_dim, want.kv_heads, want.dtype):
            raise UnsupportedProblem(
                f"this plan was made for q {self.q_shape} {want.dtype} with {want.kv_heads} K/V heads; got q "
                f"{tuple(q.shape)} {p.dtype} and caches {tuple(k_cache.shape)}: make a plan for this shape")
        if q.device != self.device:
            raise UnsupportedProblem(f"this plan's buffers are on {self.device}; got tensors on {q.device}")
        check_seqlens(cache_seqlens, p.batch, q.device)

    def run(self, q, k_cache, v_cache, cache_seqlens, page_table=None):
        """(out, lse) for this step, in the plan's own buffers (overwritten by the next run)."""
        signature = self._signature(q, k_cache, v_cache, cache_seqlens, page_table)
        if signature != self._checked:
            self._validate(q, k_cache, v_cache, cache_seqlens, page_table)
            self._checked = signature
        self.launcher.launch(q, k_cache, v_cache, self.out, self.lse, cache_seqlens, self.scale, self.buffers,
                             page_table)
        return self.out, self.lse


def decode_plan(batch: int, nheads: int, nheads_kv: int, head_dim: int, max_seqlen_k: int, *, q_len: int = 1,
                dtype: str = "bfloat16", causal: bool = False, softmax_scale=None, num_splits: int = 0, device=None,
                kernel: str = "decode", page_size: int = 0, window_size=None) -> DecodePlan:
    """Compile and size a decode step: ``max_seqlen_k`` (the longest cache length expected) and
    the GPU's SM count choose the split count (``num_splits`` 0), which the plan then keeps.
    ``page_size``: the rows per page of a paged cache, whose ``page_table`` each run then takes."""
    entry = _check_kernel(kernel)
    if not isinstance(max_seqlen_k, int) or isinstance(max_seqlen_k, bool) or max_seqlen_k < 1:
        raise UnsupportedProblem(f"max_seqlen_k must be a positive int, got {max_seqlen_k!r}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 0:
        raise UnsupportedProblem(f"page_size must be an int >= 0 (0: a contiguous cache), got {page_size!r}")
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(str(dtype).replace("torch.", ""),
                                                          str(dtype).replace("torch.", ""))
    p = Problem(batch, nheads, q_len, head_dim, dtype=dtype, causal=as_causal(causal),
                softmax_scale=None if softmax_scale is None else as_scale(softmax_scale), seqlen_k=max_seqlen_k,
                nheads_kv=nheads_kv, window=as_window(window_size))
    if nheads_kv > nheads:
        raise UnsupportedProblem(f"nheads_kv ({nheads_kv}) cannot exceed nheads ({nheads})")
    entry.caps.check(p.with_(causal=False))  # causal with q_len > a length is allowed here: those rows see nothing
    if page_size:
        check_page_size(head_dim, page_size)
    splits = _num_splits(num_splits, kernel)
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise UnsupportedProblem(f"a decode plan needs a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise UnsupportedProblem("a decode plan needs a CUDA GPU, and none is visible")
    if device.index is None:  # tensors report cuda:N; compare like with like
        device = torch.device("cuda", torch.cuda.current_device())
    entry.caps.check_device(torch.cuda.get_device_capability(device))
    with torch.cuda.device(device):
        return DecodePlan(p, kernel, splits, device, max_seqlen_k, page_size)
