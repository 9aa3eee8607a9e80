"""``bench.py --varlen``: a packed batch of documents of mixed lengths through ``attention_varlen``,
beside flash-attn-4's varlen call and cuDNN (SDPA) on the same documents padded to the longest,
all burst-timed as a user calls them. TFLOP/s count the real work, 4 * heads * d * sum of each
document's (query, key) pairs (half, causal), so padding shows up as lost speed."""

from __future__ import annotations

import math
import random

DOCUMENTS, SHORTEST, LONGEST, SEED = 16, 64, 16384, 0


def document_lengths(count: int = DOCUMENTS, seed: int = SEED) -> list:
    """``count`` lengths drawn log-uniformly from [SHORTEST, LONGEST] (a fixed seed: one packing)."""
    rnd = random.Random(seed)
    return [int(round(math.exp(rnd.uniform(math.log(SHORTEST), math.log(LONGEST))))) for _ in range(count)]


def real_flops(lengths: list, heads: int, head_dim: int, causal: bool) -> float:
    return 4.0 * heads * head_dim * sum(n * n - (n * n / 2 if causal else 0) for n in lengths)


def packing(head_dim: int, heads: int) -> tuple:
    """The documents' lengths and fresh bf16 q, k, v, dout (total, heads, d) on the GPU, with
    cu_seqlens (int32)."""
    import torch

    lengths = document_lengths()
    q, k, v, dout = (torch.randn(sum(lengths), heads, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return lengths, (q, k, v, dout), cu


def timed(row: dict, fn, flops: float) -> dict:
    """``row`` with the burst-timed call of ``fn`` (status ok, call_ms, call_tflops), or, where
    ``fn`` is a reason string (a refused or missing candidate), that reason as its status."""
    from .timing import burst_ms, tflops

    if not callable(fn):
        return dict(row, status=fn)
    ms = burst_ms(fn)
    return dict(row, status="ok", call_ms=ms, call_tflops=tflops(flops, ms))


def rectangular_equivalent(name: str, lengths: list, heads: int, head_dim: int, causal: bool, timer,
                           backward: str | None = None) -> float:
    """Milliseconds the rectangular call would take on this packing: each document's work at the
    speed ``attention`` reaches on a (total // n, heads, n, d) batch of its length n, the same
    tokens as the packing (the issue's "same total tokens at the same lengths"). ``backward``: the
    backward stage's autograd backward after one forward, timed instead of the forward."""
    import torch

    from .api import attention

    total, ms = sum(lengths), 0.0
    for n in sorted(set(lengths)):
        batch = max(1, total // n)
        q, k, v = (torch.randn(batch, heads, n, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=backward is not None) for _ in range(3))
        if backward:
            out = attention(name, q, k, v, causal=causal, backward=backward)
            grad = torch.randn_like(out)
            call = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)  # noqa: E731
        else:
            call = lambda: attention(name, q, k, v, causal=causal)  # noqa: E731
        rect_ms = timer(call)
        ms += rect_ms * real_flops([n] * lengths.count(n), heads, head_dim, causal) / real_flops([n] * batch, heads,
                                                                                               head_dim, causal)
    return ms


def padded_batch(tensors, cu, lengths: list) -> list:
    """Packed (total, heads, d) tensors as (batch, heads, longest, d) ones, zero-padded: what a
    user without a varlen call runs."""
    import torch

    padded = [torch.zeros(len(lengths), max(lengths), *t.shape[1:], device=t.device, dtype=t.dtype) for t in tensors]
    for b, (start, n) in enumerate(zip(cu.tolist()[:-1], lengths)):
        for dst, src in zip(padded, tensors):
            dst[b, :n] = src[start:start + n]
    return [t.transpose(1, 2) for t in padded]


def cudnn_sdpa(causal: bool, scale: float, gqa: bool):
    """cuDNN's SDPA on padded (batch, heads, longest, d) tensors: the padding computed too, what a
    user without a varlen call pays."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)

    return call


def candidates(q, k, v, cu, lengths: list, causal: bool, scale: float, names) -> dict:
    """name -> zero-argument callable (or a reason string): ours, flash-attn-4's, cuDNN padded."""
    from .peers import tried_once
    from .varlen import attention_varlen

    most, calls, cu_host = max(lengths), {}, cu.cpu()
    for name in names:
        calls[name] = (lambda name=name: attention_varlen(name, q, k, v, cu, cu, most, most, causal=causal,
                                                          softmax_scale=scale))
        # a new cu_seqlens tensor each call: the host waits for the GPU to read it (the plain row
        # passes one tensor again, as a model's layers do, and reads it once)
        calls[f"{name} (new cu_seqlens each call)"] = (lambda name=name: attention_varlen(
            name, q, k, v, cu.clone(), cu.clone(), most, most, causal=causal, softmax_scale=scale))
        # cu_seqlens on the CPU: the host reads them without waiting for the GPU
        calls[f"{name} (cu_seqlens on CPU)"] = (lambda name=name: attention_varlen(
            name, q, k, v, cu_host, cu_host, most, most, causal=causal, softmax_scale=scale))
    try:
        from flash_attn.cute import flash_attn_varlen_func

        calls["fa4"] = lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=most,
                                                      max_seqlen_k=most, softmax_scale=scale, causal=causal)
    except Exception as e:  # not installed, or not importable here
        calls["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    padded, cudnn = padded_batch((q, k, v), cu, lengths), cudnn_sdpa(causal, scale, q.shape[1] != k.shape[1])
    calls["sdpa-cudnn-padded"] = lambda: cudnn(*padded)
    return tried_once(calls, width=160)


def main(args, argv) -> int:
    """``bench.py --varlen [--backward]``: the packing's forward, or its backward through autograd
    (2.5x the forward's real FLOPs), beside the peers, then the rectangular call at its lengths."""
    import sys

    import torch

    from . import results
    from .timing import burst_ms, tflops
    from .varlen import prepare_varlen

    backward = bool(args.backward)
    mode = "varlen backward" if backward else "varlen"
    names = tuple(args.kernels) or (("k10_fa3",) if backward else ("k6",))
    if not torch.cuda.is_available():
        print(f"bench.py --varlen{' --backward' if backward else ''} needs a CUDA GPU", file=sys.stderr)
        return 2
    d, causal, heads = args.headdim or 128, bool(args.causal), args.nheads or 16
    lengths, (q, k, v, dout), cu = packing(d, heads)
    total, scale = sum(lengths), d ** -0.5
    flops = (2.5 if backward else 1.0) * real_flops(lengths, heads, d, causal)
    out = results.open_result_file(args.out, results.command_line("bench.py", argv))
    print(f"== {torch.cuda.get_device_name()}: {mode}, {len(lengths)} documents, {total} tokens (lengths {lengths}), "
          f"heads {heads}, d {d}, causal {int(causal)}; TFLOP/s on {'2.5x ' if backward else ''}the unpadded work")
    if backward:
        calls, kernels_alone = backward_candidates(q, k, v, dout, cu, lengths, causal, scale, names), {}
    else:
        kernels_alone = {name: prepare_varlen(name, q, k, v, cu, cu, max(lengths), max(lengths), causal, scale)[0]
                         for name in names}
        calls = candidates(q, k, v, cu, lengths, causal, scale, names)
    case = dict(documents=len(lengths), tokens=total, nheads=heads, head_dim=d, causal=int(causal), lengths=lengths,
                **({"backward": True} if backward else {}))
    for name, fn in calls.items():
        row = timed(dict(kernel=name, **case), fn, flops)
        if row["status"] == "ok":
            alone = ""
            if name in kernels_alone:  # the compiled launch with its tile table made: what the host adds
                row.update(kernel_ms=burst_ms(kernels_alone[name]))
                row.update(kernel_tflops=tflops(flops, row["kernel_ms"]))
                alone = f"   kernel alone {row['kernel_ms']:.3f} ms {row['kernel_tflops']:.1f} TFLOP/s"
            print(f"{name:<34}{row['call_ms']:>10.3f} ms {row['call_tflops']:>8.1f} TFLOP/s{alone}", flush=True)
        else:
            print(f"{name:<34}{fn}", flush=True)
        if out:
            out.append(row)
    for name in names:  # what the same documents cost the rectangular call, length by length
        row = dict(kernel=f"{name} rectangular", **case, status="ok")
        ms = rectangular_equivalent("k6" if backward else name, lengths, heads, d, causal, burst_ms,
                                    backward=name if backward else None)
        row.update(call_ms=ms, call_tflops=tflops(flops, ms))
        print(f"{row['kernel']:<34}{ms:>10.3f} ms {row['call_tflops']:>8.1f} TFLOP/s  (each length as a "
              f"(tokens // n, {heads}, n, {d}) batch{', through autograd' if backward else ''})", flush=True)
        if out:
            out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0


def backward_candidates(q, k, v, dout, cu, lengths: list, causal: bool, scale: float, stages) -> dict:
    """name -> zero-argument callable (or a reason string): one backward through autograd after one
    forward, as a training step runs it; ours (K10's packed backward), flash-attn-4's varlen call's,
    cuDNN's on the padded batch."""
    import torch

    from .peers import tried_once
    from .varlen import attention_varlen

    most, calls = max(lengths), {}

    def through_autograd(forward, inputs, grad):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = forward(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)

    for stage in stages:
        def ours(*x, stage=stage):
            return attention_varlen("k6", *x, cu, cu, most, most, causal=causal, softmax_scale=scale, backward=stage)
        try:
            calls[stage] = through_autograd(ours, (q, k, v), dout)
        except Exception as e:  # refused (a stage without the packed backward): a row that says so
            calls[stage] = f"{type(e).__name__}: {e}"[:160]
    try:
        from flash_attn.cute import flash_attn_varlen_func

        fa4 = through_autograd(lambda *x: flash_attn_varlen_func(*x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=most,
                                                                  max_seqlen_k=most, softmax_scale=scale,
                                                                  causal=causal), (q, k, v), dout)
        calls["fa4"] = fa4
    except Exception as e:  # not installed, or not importable here
        calls["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    pq, pk, pv, pdo = padded_batch((q, k, v, dout), cu, lengths)
    try:
        calls["sdpa-cudnn-padded"] = through_autograd(cudnn_sdpa(causal, scale, q.shape[1] != k.shape[1]),
                                                      (pq, pk, pv), pdo)
    except Exception as e:  # cuDNN refusing the shape: a row that says so
        calls["sdpa-cudnn-padded"] = f"{type(e).__name__}: {e}"[:160]
    return tried_once(calls, width=160)
