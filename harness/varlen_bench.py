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


def candidates(q, k, v, cu, lengths: list, causal: bool, scale: float, names) -> dict:
    """name -> zero-argument callable (or a reason string): ours, flash-attn-4's, cuDNN padded."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .varlen import attention_varlen

    most, calls = max(lengths), {}
    for name in names:
        calls[name] = (lambda name=name: attention_varlen(name, q, k, v, cu, cu, most, most, causal=causal,
                                                          softmax_scale=scale))
    try:
        from flash_attn.cute import flash_attn_varlen_func

        calls["fa4"] = lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=most,
                                                      max_seqlen_k=most, softmax_scale=scale, causal=causal)
    except Exception as e:  # not installed, or not importable here
        calls["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    padded = [torch.zeros(len(lengths), most, *t.shape[1:], device=t.device, dtype=t.dtype) for t in (q, k, v)]
    for b, (start, n) in enumerate(zip(cu.tolist()[:-1], lengths)):
        for dst, src in zip(padded, (q, k, v)):
            dst[b, :n] = src[start:start + n]
    pq, pk, pv = (t.transpose(1, 2) for t in padded)  # (batch, heads, longest, d)
    gqa = q.shape[1] != k.shape[1]

    def cudnn_padded():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # the padding computed too: what a user without varlen pays
            return F.scaled_dot_product_attention(pq, pk, pv, is_causal=causal, scale=scale, enable_gqa=gqa)

    calls["sdpa-cudnn-padded"] = cudnn_padded
    for name, fn in list(calls.items()):
        if callable(fn):
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:
                calls[name] = f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:160]
    return calls


def main(args, argv) -> int:
    import sys

    import torch

    from . import results
    from .timing import burst_ms, tflops

    names = tuple(args.kernels) or ("k6",)
    if not torch.cuda.is_available():
        print("bench.py --varlen needs a CUDA GPU", file=sys.stderr)
        return 2
    d, causal = args.headdim or 128, bool(args.causal)
    heads, heads_kv = args.nheads or 16, args.nheads or 16
    lengths = document_lengths()
    total = sum(lengths)
    q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, heads_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    flops = real_flops(lengths, heads, d, causal)
    out = results.open_result_file(args.out, results.command_line("bench.py", argv))
    print(f"== {torch.cuda.get_device_name()}: varlen, {len(lengths)} documents, {total} tokens (lengths {lengths}), "
          f"heads {heads}, d {d}, causal {int(causal)}; TFLOP/s on the unpadded work")
    for name, fn in candidates(q, k, v, cu, lengths, causal, d ** -0.5, names).items():
        row = dict(kernel=name, documents=len(lengths), tokens=total, nheads=heads, head_dim=d, causal=int(causal),
                   lengths=lengths)
        if callable(fn):
            ms = burst_ms(fn)
            row.update(status="ok", call_ms=ms, call_tflops=tflops(flops, ms))
            print(f"{name:<20}{ms:>10.3f} ms {row['call_tflops']:>8.1f} TFLOP/s", flush=True)
        else:
            row.update(status=fn)
            print(f"{name:<20}{fn}", flush=True)
        if out:
            out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0
