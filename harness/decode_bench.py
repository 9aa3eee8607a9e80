"""Decode benchmark: ``python bench.py --decode``.

Kernel time by CUDA-graph replay (``harness.timing.graph_ms``: 20 calls per graph, rotating
through copies of the caches that add up to over 4x the 50 MB L2, so every call reads HBM), for
the decode kernels and, in the same run, cuDNN (SDPA with ``enable_gqa``), SDPA's flash backend
and flash-attn-4. Every candidate is first checked against a float32 reference on the same
inputs; the peers run first, so each kernel row carries its ratio to cuDNN (``vs_cudnn``).
TB/s counts K and V read once: 2 x batch x kv_heads x kv_len x d x 2 bytes.
Host time per call (no graph) is measured apart: for a decode step it can exceed the kernel's.
A failing or missing candidate becomes a row with a status, never a crash.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import statistics

from harness.timing import failure, graph_ms, host_rows  # module-level: the CPU tests replace graph_ms

NHEADS, HEAD_DIM, Q_LEN = 32, 128, 1
# The grid: batch x kv_len x K/V heads (batch 64 with 4k keys only).
GRID = [(b, n, hk) for b in (1, 8, 64) for n in (4096, 32768, 131072) for hk in (8, 32) if b < 64 or n == 4096]
SPLITS_CURVE = (1, 2, 4, 8, 15, 16, 32, 64, 0)  # at batch 1, 8 K/V heads, 32k keys; 0 = the heuristic
PAGES_CURVE = (0, 256, 128, 64, 32, 16)  # rows per page; 0 = the contiguous cache
KERNELS = ("decode", "decode_combine")
HBM_PEAK_TBPS = {"H100": 3.35, "H200": 4.8}
L2_BYTES = 50e6
TOLERANCE = 2e-2  # max |O - reference| for bf16 outputs of O(1) values


def kv_bytes(batch: int, nheads_kv: int, kv_len: int, head_dim: int = HEAD_DIM) -> int:
    return 2 * batch * nheads_kv * kv_len * head_dim * 2


def tbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def hbm_peak(device_name: str):
    return next((v for k, v in HBM_PEAK_TBPS.items() if k in device_name), None)


def rates(nbytes: int, ms, peak) -> dict:
    """TB/s of ``nbytes`` read in ``ms``, and its percentage of the HBM peak when the GPU's is known."""
    if not ms:
        return dict(tbps=None)
    rate = tbps(nbytes, ms)
    return dict(tbps=rate, pct_peak=100 * rate / peak) if peak else dict(tbps=rate)


def cache_copies(nbytes: int, free_bytes=None) -> int:
    """Copies of one (k, v) pair so that a pass over all of them reads >= 4x the L2 (every call then
    streams from HBM, as a real decode step does), at most half the free memory (the reference and
    the peers need room too), and never fewer than one."""
    want = max(1, math.ceil(4 * L2_BYTES / nbytes))
    return want if free_bytes is None else max(1, min(want, int(free_bytes // 2 // nbytes)))


def grid(batch=None, seqlen_k=None, nheads_kv=None) -> list:
    """GRID restricted to the given values. When no row of GRID has them, each given value replaces
    its whole axis (batch 2: batch 2 at every kv_len and K/V head count), so any shape can be timed."""
    rows = [r for r in GRID if (batch is None or r[0] == batch) and (seqlen_k is None or r[1] == seqlen_k)
            and (nheads_kv is None or r[2] == nheads_kv)]
    if rows:
        return rows
    axes = [[given] if given is not None else sorted({r[i] for r in GRID})
            for i, given in enumerate((batch, seqlen_k, nheads_kv))]
    return list(itertools.product(*axes))


class Inputs:
    """q (b, q_len, h, d) and enough (k, v) cache copies, (b, kv_len, h_kv, d), to read past L2."""

    def __init__(self, batch: int, kv_len: int, nheads_kv: int, head_dim: int = HEAD_DIM, q_len: int = Q_LEN):
        import torch

        nbytes = kv_bytes(batch, nheads_kv, kv_len, head_dim)
        self.copies = cache_copies(nbytes, torch.cuda.mem_get_info()[0])
        shape = (batch, kv_len, nheads_kv, head_dim)
        self.caches = [tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                       for _ in range(self.copies)]
        self.q = torch.randn(batch, q_len, NHEADS, head_dim, device="cuda", dtype=torch.bfloat16)
        self.lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
        self.scale = head_dim ** -0.5

    def cache(self, i: int):
        return self.caches[i % self.copies]

    def reference(self):
        """O of copy 0 in float32, one sequence at a time (a 128k cache upcast whole is large)."""
        import torch
        import torch.nn.functional as F

        k, v = self.cache(0)
        out = torch.empty(self.q.shape, device="cuda", dtype=torch.float32)
        for b in range(self.q.shape[0]):
            qb, kb, vb = (t[b:b + 1].transpose(1, 2).float() for t in (self.q, k, v))
            out[b] = F.scaled_dot_product_attention(qb, kb, vb, scale=self.scale, enable_gqa=True).transpose(1, 2)[0]
        return out


def kernel_step(name: str, inputs: Inputs, num_splits: int = 0, pools=None):
    """(plan, step(i)) for a decode kernel through its plan (validated once, then launch only):
    on the cache copies, or on ``pools``, the copies cut into pages (``shuffled_pages``)."""
    from harness.kvcache import decode_plan

    b, q_len, h, d = inputs.q.shape
    k0, _ = inputs.cache(0)
    page_size = pools[0][0].shape[1] if pools else 0
    plan = decode_plan(b, h, k0.shape[2], d, k0.shape[1], q_len=q_len, num_splits=num_splits, kernel=name,
                       page_size=page_size)
    if pools:
        def step(i):
            k_pool, v_pool, table = pools[i % len(pools)]
            return plan.run(inputs.q, k_pool, v_pool, inputs.lens, table)[0]
        return plan, step
    return plan, lambda i: plan.run(inputs.q, *inputs.cache(i), inputs.lens)[0]


def plan_fields(plan) -> dict:
    """What a kernel row records of its plan: the split count, the tile and (paged) the boxes per tile."""
    return dict(num_splits=plan.num_splits, tile_n=plan.info["tile_n"],
                **({"page_boxes": plan.info["page_boxes"]} if "page_boxes" in plan.info else {}))


def shuffled_pages(k, v, page_size: int, seed: int = 0) -> tuple:
    """(k_pool, v_pool, page_table): full-length caches cut into pages of ``page_size`` rows and
    shuffled through a pool, as a serving engine's allocator leaves them (harness.check.paged_cache)."""
    import torch

    from harness.check import paged_cache

    gen = torch.Generator(device="cuda").manual_seed(seed)
    return paged_cache(k, v, page_size, [k.shape[1]] * k.shape[0], gen)


def peer_steps(inputs: Inputs) -> dict:
    """name -> (step(i), context manager factory) or a reason string."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q_t = inputs.q.transpose(1, 2)
    views = [tuple(t.transpose(1, 2) for t in kv) for kv in inputs.caches]  # SDPA layout, no copies
    steps = {}
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def step(i, views=views):
            k, v = views[i % len(views)]
            return F.scaled_dot_product_attention(q_t, k, v, scale=inputs.scale, enable_gqa=True).transpose(1, 2)
        steps[name] = (step, lambda backend=backend: sdpa_kernel(backend))
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(i):
            out = flash_attn_func(inputs.q, *inputs.cache(i), softmax_scale=inputs.scale, causal=False)
            return out[0] if isinstance(out, tuple) else out
        steps["fa4"] = (fa4, contextlib.nullcontext)
    except Exception as e:  # not installed, or not importable on this GPU
        steps["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    return steps


def check_and_time(step, context, o_ref) -> tuple:
    """(ms, max_abs_err, status): checked on copy 0 first; a wrong or failing candidate is not timed.
    ``context`` (SDPA's backend choice) is entered here, outside the graph capture and the timing."""
    import torch

    try:
        with context():
            err = (step(0).float() - o_ref).abs().max().item()
            if not err <= TOLERANCE:  # NaN fails too
                return None, err, f"failed check: max |O - ref| = {err:.3g}"
            return graph_ms(step), err, "ok"
    except Exception as e:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None, None, failure(e)


def candidates(inputs: Inputs, peers: bool = True, num_splits: int = 0) -> dict:
    """name -> (step(i), context factory, extra row fields), or a status string. The peers come
    first so that each kernel row can carry its ratio to cuDNN, as bench.py's rows do."""
    entries = {}
    for name, entry in (peer_steps(inputs).items() if peers else ()):
        entries[name] = entry if isinstance(entry, str) else (*entry, {})
    for name in KERNELS:
        try:
            plan, step = kernel_step(name, inputs, num_splits)
        except Exception as e:  # a refused shape or a failed compile: a status, not a crash
            entries[name] = failure(e)
            continue
        entries[name] = (step, contextlib.nullcontext, plan_fields(plan))
    return entries


def time_candidates(base: dict, entries: dict, o_ref, peak, emit) -> None:
    """Check, time and emit each candidate of one grid row (``base``: the shape's fields)."""
    cudnn_ms = None
    for name, entry in entries.items():
        if isinstance(entry, str):
            emit(dict(base, kernel=name, ms=None, tbps=None, status=entry))
            continue
        step, context, extra = entry
        ms, err, status = check_and_time(step, context, o_ref)
        row = dict(base, kernel=name, ms=ms, **rates(base["kv_bytes"], ms, peak), max_abs_err=err, status=status,
                   **extra)
        if name == "sdpa-cudnn":
            cudnn_ms = ms
        elif name in KERNELS and ms and cudnn_ms:
            row["vs_cudnn"] = cudnn_ms / ms  # > 1: faster than cuDNN
        emit(row)


def run_grid(rows: list, emit, peers: bool = True, head_dim: int = HEAD_DIM, q_len: int = Q_LEN,
             num_splits: int = 0) -> None:
    """Each (batch, kv_len, K/V heads) of ``rows``: the peers, then the decode kernels."""
    import torch

    peak = hbm_peak(torch.cuda.get_device_name())
    for batch, kv_len, nheads_kv in rows:
        base = dict(mode="grid", batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len, q_len=q_len,
                    head_dim=head_dim, dtype="bfloat16", kv_bytes=kv_bytes(batch, nheads_kv, kv_len, head_dim))
        try:
            inputs = Inputs(batch, kv_len, nheads_kv, head_dim, q_len)
            o_ref = inputs.reference()
        except torch.cuda.OutOfMemoryError:  # a shape given on the command line may not fit
            inputs = o_ref = None
            torch.cuda.empty_cache()
            emit(dict(base, kernel="inputs", ms=None, tbps=None, status="failed: the caches do not fit in memory"))
            continue
        base["cache_copies"] = inputs.copies
        time_candidates(base, candidates(inputs, peers, num_splits), o_ref, peak, emit)
        del inputs, o_ref
        torch.cuda.empty_cache()


def run_window(emit, left: int, batch: int = 8, kv_len: int = 32768, nheads_kv: int = 8, head_dim: int = HEAD_DIM,
               q_len: int = Q_LEN) -> None:
    """A sliding window (``left`` keys before each query, causal) over a ``kv_len`` cache: the
    decode kernels and flash-attn-4 with the same window, and the decode kernels without one on a
    cache of just the window's keys (what reading only the window should cost). Bandwidth counts
    the window's bytes; the check is against SDPA on the window's keys."""
    import torch
    import torch.nn.functional as F

    from harness.kvcache import decode_plan
    from harness.varlen import keep_mask

    peak = hbm_peak(torch.cuda.get_device_name())
    keys = min(kv_len, left + q_len)
    base = dict(mode="window", batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len, q_len=q_len,
                head_dim=head_dim, dtype="bfloat16", window=[left, 0], kv_bytes=kv_bytes(batch, nheads_kv, keys, head_dim))
    inputs = Inputs(batch, kv_len, nheads_kv, head_dim, q_len)
    base["cache_copies"] = inputs.copies
    k0, v0 = inputs.cache(0)
    qb, kb, vb = (t.transpose(1, 2).float() for t in (inputs.q, k0[:, -keys:], v0[:, -keys:]))
    o_ref = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep_mask(q_len, keys, (left, 0), "cuda"),
                                           scale=inputs.scale, enable_gqa=True).transpose(1, 2)
    entries = {}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(i):
            out = flash_attn_func(inputs.q, *inputs.cache(i), softmax_scale=inputs.scale, causal=True,
                                  window_size=(left, 0))
            return out[0] if isinstance(out, tuple) else out
        entries["fa4"] = (fa4, contextlib.nullcontext, {})
    except Exception as e:  # not installed, or not importable on this GPU
        entries["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    b, _, h, d = inputs.q.shape
    for name in KERNELS:
        try:
            plan = decode_plan(b, h, nheads_kv, d, kv_len, q_len=q_len, causal=True, kernel=name,
                               window_size=(left, 0))
            entries[name] = (lambda i, plan=plan: plan.run(inputs.q, *inputs.cache(i), inputs.lens)[0],
                             contextlib.nullcontext, plan_fields(plan))
            short = decode_plan(b, h, nheads_kv, d, keys, q_len=q_len, causal=True, kernel=name)
            cut = [tuple(t[:, -keys:] for t in kv) for kv in inputs.caches]  # views: the window's rows only
            window_lens = torch.full((b,), keys, dtype=torch.int32, device="cuda")
            entries[f"{name} (a {keys}-key cache)"] = (
                lambda i, short=short: short.run(inputs.q, *cut[i % len(cut)], window_lens)[0],
                contextlib.nullcontext, plan_fields(short))
        except Exception as e:  # a refused shape or a failed compile: a status, not a crash
            entries[name] = failure(e)
    time_candidates(base, entries, o_ref, peak, emit)


def run_splits(emit, batch: int = 1, kv_len: int = 32768, nheads_kv: int = 8, head_dim: int = HEAD_DIM,
               q_len: int = Q_LEN) -> None:
    """TB/s of ``decode`` against its split count (SPLITS_CURVE), by default at batch 1, 8 K/V
    heads, 32k keys: too few CTAs without a split, partials and a longer merge with too many."""
    import torch

    peak = hbm_peak(torch.cuda.get_device_name())
    inputs = Inputs(batch, kv_len, nheads_kv, head_dim, q_len)
    o_ref = inputs.reference()
    nbytes = kv_bytes(batch, nheads_kv, kv_len, head_dim)
    base = dict(mode="splits", kernel="decode", batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len,
                q_len=q_len, head_dim=head_dim)
    for splits in SPLITS_CURVE:
        try:
            plan, step = kernel_step("decode", inputs, num_splits=splits)
        except Exception as e:
            emit(dict(base, num_splits=splits, auto=splits == 0, ms=None, tbps=None, status=failure(e)))
            continue
        ms, err, status = check_and_time(step, contextlib.nullcontext, o_ref)
        emit(dict(base, num_splits=plan.num_splits, auto=splits == 0, ms=ms, **rates(nbytes, ms, peak),
                  max_abs_err=err, status=status))
    del inputs, o_ref
    torch.cuda.empty_cache()


def paged_steps(inputs: Inputs, page_size: int, num_splits: int = 0) -> dict:
    """name -> (step(i), extra row fields) or a status: ``decode`` and flash-attn-4 (its
    ``page_table``) on each cache copy cut into shuffled pages (``shuffled_pages``)."""
    pools = [shuffled_pages(k, v, page_size, seed=page_size) for k, v in inputs.caches]
    steps = {}
    try:
        plan, step = kernel_step("decode", inputs, num_splits, pools)
        steps["decode"] = (step, plan_fields(plan))
    except Exception as e:
        steps["decode"] = failure(e)
    try:
        from flash_attn.cute import flash_attn_varlen_func

        def fa4(i):
            kp, vp, table = pools[i % len(pools)]
            out = flash_attn_varlen_func(inputs.q, kp, vp, seqused_k=inputs.lens, page_table=table,
                                         softmax_scale=inputs.scale)
            return out[0] if isinstance(out, tuple) else out
        steps["fa4"] = (fa4, {})
    except Exception as e:
        steps["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    return steps


def run_pages(emit, batches=(1, 8), kv_len: int = 32768, nheads_kv: int = 8, head_dim: int = HEAD_DIM,
              q_len: int = Q_LEN, page_sizes=PAGES_CURVE) -> None:
    """TB/s of ``decode`` (and flash-attn-4) on a paged cache against the page size, the pages of
    each cache copy shuffled through the pool as a serving engine's allocator leaves them; page
    size 0 is the contiguous cache, for scale. By default batch 1 (16 splits) and 8 (2), 8 K/V
    heads, 32k keys."""
    for batch in batches:
        _run_pages(emit, batch, kv_len, nheads_kv, head_dim, q_len, page_sizes)


def _run_pages(emit, batch: int, kv_len: int, nheads_kv: int, head_dim: int, q_len: int, page_sizes) -> None:
    import torch

    peak = hbm_peak(torch.cuda.get_device_name())
    inputs = Inputs(batch, kv_len, nheads_kv, head_dim, q_len)
    o_ref = inputs.reference()
    nbytes = kv_bytes(batch, nheads_kv, kv_len, head_dim)
    base = dict(mode="pages", batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len, q_len=q_len,
                head_dim=head_dim, kv_bytes=nbytes, cache_copies=inputs.copies)
    for page_size in page_sizes:
        if page_size:
            steps = paged_steps(inputs, page_size)
        else:
            plan, step = kernel_step("decode", inputs)
            steps = {"decode": (step, plan_fields(plan))}
        for name, entry in steps.items():
            if isinstance(entry, str):
                emit(dict(base, kernel=name, page_size=page_size, ms=None, tbps=None, status=entry))
                continue
            step, extra = entry
            ms, err, status = check_and_time(step, contextlib.nullcontext, o_ref)
            emit(dict(base, kernel=name, page_size=page_size, ms=ms, **rates(nbytes, ms, peak), max_abs_err=err,
                      status=status, **extra))
        del steps
        torch.cuda.empty_cache()
    del inputs, o_ref
    torch.cuda.empty_cache()


def host_calls(inputs: Inputs) -> dict:
    """name -> call() for the host-time rows: the plan, the one-call API, eager SDPA, flash-attn-4."""
    import torch.nn.functional as F

    from harness.kvcache import attention_with_kvcache

    k, v = inputs.cache(0)
    plan, _ = kernel_step("decode", inputs)
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (inputs.q, k, v))
    calls = {
        "decode plan.run": lambda: plan.run(inputs.q, k, v, inputs.lens),
        "decode attention_with_kvcache": lambda: attention_with_kvcache(inputs.q, k, v, inputs.lens),
        "sdpa (default backend)": lambda: F.scaled_dot_product_attention(q_t, k_t, v_t, scale=inputs.scale,
                                                                          enable_gqa=True),
    }
    try:  # the same calls on the cache cut into 128-key pages: one more tensor to check and pass
        kp, vp, table = shuffled_pages(k, v, 128)
        paged, _ = kernel_step("decode", inputs, pools=[(kp, vp, table)])
        calls["decode plan.run (paged)"] = lambda: paged.run(inputs.q, kp, vp, inputs.lens, table)
        calls["decode attention_with_kvcache (paged)"] = lambda: attention_with_kvcache(inputs.q, kp, vp, inputs.lens,
                                                                                         page_table=table)
    except Exception as e:  # not timed, and said so in the row
        calls["decode (paged)"] = functools.partial(_raise, e)
    try:
        from flash_attn.cute import flash_attn_func

        calls["fa4 flash_attn_func"] = lambda: flash_attn_func(inputs.q, k, v, softmax_scale=inputs.scale)
    except Exception:
        pass
    return calls


def _raise(e: Exception):
    raise e


HOST_ROUNDS = 9


def run_host(emit, head_dim: int = HEAD_DIM, q_len: int = Q_LEN, rounds: int = HOST_ROUNDS) -> None:
    """Host microseconds per call at two shapes (``timing.host_rows``)."""
    import torch

    for batch, kv_len, nheads_kv in ((1, 32768, 8), (64, 4096, 8)):
        inputs = Inputs(batch, kv_len, nheads_kv, head_dim, q_len)
        base = dict(mode="host", batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len, q_len=q_len,
                    head_dim=head_dim)
        host_rows(host_calls(inputs), base, emit, rounds)
        del inputs
        torch.cuda.empty_cache()


def summary(rows: list) -> str:
    """Per grid row: each decode kernel's ratio to cuDNN, then the worst."""
    lines, ratios = [], []
    by_shape = {}
    for r in rows:
        if r.get("mode") == "grid" and r.get("ms"):
            by_shape.setdefault((r["batch"], r["seqlen_k"], r["nheads_kv"]), {})[r["kernel"]] = r
    for shape, got in by_shape.items():
        cudnn = got.get("sdpa-cudnn")
        for name in KERNELS:
            if name in got and cudnn:
                ratios.append(cudnn["ms"] / got[name]["ms"])
                lines.append(f"batch {shape[0]:>2} kv_len {shape[1]:>6} kv_heads {shape[2]:>2}  {name:<15}"
                             f"{got[name]['tbps']:5.2f} TB/s  x cuDNN {ratios[-1]:.3f}")
    if ratios:
        lines.append(f"geomean x cuDNN {statistics.geometric_mean(ratios):.3f}, worst {min(ratios):.3f}")
    return "\n".join(lines)
