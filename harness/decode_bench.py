"""Decode benchmark: ``python bench.py --decode``.

Kernel time by CUDA-graph replay (``harness.timing.graph_ms``: 20 calls per graph, rotating
through copies of the caches that add up to over 4x the 50 MB L2, so every call reads HBM), for
the decode kernels and, in the same run, cuDNN (SDPA with ``enable_gqa``), SDPA's flash backend
and flash-attn-4. Every candidate is first checked against a float32 reference on the same
inputs. TB/s counts K and V read once: 2 x batch x kv_heads x kv_len x d x 2 bytes.
Host time per call (no graph) is measured apart: for a decode step it can exceed the kernel's.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time

NHEADS, HEAD_DIM, Q_LEN = 32, 128, 1
# The grid: batch x kv_len x K/V heads (batch 64 with 4k keys only).
GRID = [(b, n, hk) for b in (1, 8, 64) for n in (4096, 32768, 131072) for hk in (8, 32) if b < 64 or n == 4096]
SPLITS_CURVE = (1, 2, 4, 8, 15, 16, 32, 64, 0)  # at batch 1, 8 K/V heads, 32k keys; 0 = the heuristic
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


def grid(batch=None, seqlen_k=None, nheads_kv=None) -> list:
    """GRID restricted to the given values; a value outside it is a row of its own."""
    rows = [r for r in GRID if (batch is None or r[0] == batch) and (seqlen_k is None or r[1] == seqlen_k)
            and (nheads_kv is None or r[2] == nheads_kv)]
    return rows or [(batch or 1, seqlen_k or 32768, nheads_kv or 8)]


class Inputs:
    """q (b, 1, h, d) and enough (k, v) cache copies, (b, kv_len, h_kv, d), to read past L2."""

    def __init__(self, batch: int, kv_len: int, nheads_kv: int):
        import torch

        self.copies = max(1, math.ceil(4 * L2_BYTES / kv_bytes(batch, nheads_kv, kv_len)))
        shape = (batch, kv_len, nheads_kv, HEAD_DIM)
        self.caches = [tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                       for _ in range(self.copies)]
        self.q = torch.randn(batch, Q_LEN, NHEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
        self.scale = HEAD_DIM ** -0.5

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


def kernel_step(name: str, inputs: Inputs, num_splits: int = 0):
    """(plan, step(i)) for a decode kernel through its plan (validated once, then launch only)."""
    from harness.kvcache import decode_plan

    b, _, h, d = inputs.q.shape
    k0, _ = inputs.cache(0)
    plan = decode_plan(b, h, k0.shape[2], d, k0.shape[1], num_splits=num_splits, kernel=name)
    return plan, lambda i: plan.run(inputs.q, *inputs.cache(i), inputs.lens)[0]


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
    """(ms, max_abs_err, status): checked on copy 0 first; a wrong or failing candidate is not timed."""
    import torch

    try:
        with context():
            err = (step(0).float() - o_ref).abs().max().item()
            if not err <= TOLERANCE:  # NaN fails too
                return None, err, f"failed check: max |O - ref| = {err:.3g}"
            return graph_ms(step), err, "ok"
    except Exception as e:
        torch.cuda.synchronize()
        return None, None, f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:120]


def graph_ms(step):
    from harness.timing import graph_ms as timed

    return timed(step)


def host_us(call, n: int = 200) -> float:
    """Mean host time of ``call`` over n back-to-back calls, nothing synchronized in between."""
    import torch

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def run_grid(rows: list, emit, peers: bool = True) -> None:
    import torch

    device = torch.cuda.get_device_name()
    peak = hbm_peak(device)
    for batch, kv_len, nheads_kv in rows:
        inputs = Inputs(batch, kv_len, nheads_kv)
        nbytes = kv_bytes(batch, nheads_kv, kv_len)
        base = dict(mode="grid", batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len, q_len=Q_LEN,
                    head_dim=HEAD_DIM, dtype="bfloat16", kv_bytes=nbytes, cache_copies=inputs.copies)
        o_ref = inputs.reference()
        candidates = {}
        for name in KERNELS:
            plan, step = kernel_step(name, inputs)
            candidates[name] = (step, contextlib.nullcontext, dict(num_splits=plan.num_splits))
        for name, entry in (peer_steps(inputs).items() if peers else ()):
            candidates[name] = entry if isinstance(entry, str) else (*entry, {})
        for name, entry in candidates.items():
            if isinstance(entry, str):
                emit(dict(base, kernel=name, ms=None, tbps=None, status=entry))
                continue
            step, context, extra = entry
            ms, err, status = check_and_time(step, context, o_ref)
            row = dict(base, kernel=name, ms=ms, tbps=tbps(nbytes, ms) if ms else None, max_abs_err=err,
                       status=status, **extra)
            if ms and peak:
                row["pct_peak"] = 100 * row["tbps"] / peak
            emit(row)
        del inputs, o_ref
        torch.cuda.empty_cache()


def run_splits(emit) -> None:
    """TB/s of ``decode`` against its split count at batch 1, 8 K/V heads, 32k keys."""
    batch, kv_len, nheads_kv = 1, 32768, 8
    inputs = Inputs(batch, kv_len, nheads_kv)
    o_ref = inputs.reference()
    nbytes = kv_bytes(batch, nheads_kv, kv_len)
    for splits in SPLITS_CURVE:
        plan, step = kernel_step("decode", inputs, num_splits=splits)
        ms, err, status = check_and_time(step, contextlib.nullcontext, o_ref)
        emit(dict(mode="splits", kernel="decode", batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len,
                  head_dim=HEAD_DIM, num_splits=plan.num_splits, auto=splits == 0, ms=ms,
                  tbps=tbps(nbytes, ms) if ms else None, max_abs_err=err, status=status))


def run_host(emit) -> None:
    """Host microseconds per call (no graph, no sync inside the loop) at two shapes, and the same
    calls' per-call time on the GPU clock (event pair around 200 calls: max of host and kernel)."""
    import torch
    import torch.nn.functional as F

    from harness.kvcache import attention_with_kvcache

    for batch, kv_len, nheads_kv in ((1, 32768, 8), (64, 4096, 8)):
        inputs = Inputs(batch, kv_len, nheads_kv)
        k, v = inputs.cache(0)
        plan, _ = kernel_step("decode", inputs)
        q_t, k_t, v_t = (t.transpose(1, 2) for t in (inputs.q, k, v))
        calls = {
            "decode plan.run": lambda: plan.run(inputs.q, k, v, inputs.lens),
            "decode attention_with_kvcache": lambda: attention_with_kvcache(inputs.q, k, v, inputs.lens),
            "sdpa (default backend)": lambda: F.scaled_dot_product_attention(q_t, k_t, v_t, scale=inputs.scale,
                                                                              enable_gqa=True),
        }
        try:
            from flash_attn.cute import flash_attn_func

            calls["fa4 flash_attn_func"] = lambda: flash_attn_func(inputs.q, k, v, softmax_scale=inputs.scale)
        except Exception:
            pass
        for name, call in calls.items():
            try:
                host = host_us(call)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(200):
                    call()
                end.record()
                torch.cuda.synchronize()
                emit(dict(mode="host", kernel=name, batch=batch, nheads=NHEADS, nheads_kv=nheads_kv, seqlen_k=kv_len,
                          head_dim=HEAD_DIM, host_us=host, call_us=start.elapsed_time(end) / 200 * 1e3,
                          status="ok"))
            except Exception as e:
                emit(dict(mode="host", kernel=name, batch=batch, nheads_kv=nheads_kv, seqlen_k=kv_len,
                          status=f"failed ({type(e).__name__}: {e})"[:120]))
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
