"""Time the backward as a user runs it (``bench.py --backward``): K9's three launches beside
cuDNN's and flash-attn-4's autograd backward, in the same process.

Workload as the forward sweep's: bf16, batch = 16384/N, heads = 2048/d; FLOPs 2.5 x the
forward's (10 B H N^2 d, halved for causal). Each candidate: a warm-up, then the median of 20
timings of one backward between CUDA events (``harness.timing.benchmark``; the peers through
autograd after one forward, ``retain_graph`` so that one graph is timed; K9 from the forward's O
and LSE).
"""

from __future__ import annotations

SWEEP = dict(head_dims=(64, 128), causals=(0, 1), seqlens=(1024, 4096, 16384))


def candidates(q, k, v, do, causal: bool, scale: float) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harness import attention
    from kernels.contract import Problem
    from kernels.k9 import compile_backward, run_backward

    b, h, n, d = q.shape
    out, lse = attention("k6", q, k, v, causal=causal, return_lse=True)
    from kernels import k10

    p = Problem(b, h, n, d, causal=causal)
    compiled, compiled10 = compile_backward(p), k10.compile_backward(p)
    calls = {"k9": lambda: run_backward(compiled, q, k, v, out, lse, do, scale),
             "k10": lambda: run_backward(compiled10, q, k, v, out, lse, do, scale)}
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o_cudnn = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
    calls["sdpa-cudnn"] = lambda: torch.autograd.grad(o_cudnn, leaves, do, retain_graph=True)
    try:
        from flash_attn.cute import flash_attn_func

        fa_leaves = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        o_fa = flash_attn_func(*fa_leaves, softmax_scale=scale, causal=causal)
        o_fa = o_fa[0] if isinstance(o_fa, tuple) else o_fa
        do_fa = do.transpose(1, 2).contiguous()
        calls["fa4"] = lambda: torch.autograd.grad(o_fa, fa_leaves, do_fa, retain_graph=True)
    except Exception as e:  # noqa: BLE001  (not installed: no row)
        print(f"fa4: {type(e).__name__}: {e}"[:200])
    return calls


def run(emit, head_dims, causals, seqlens) -> None:
    """One row per candidate and cell, emitted as it is timed."""
    import torch

    from .config import default_batch_heads
    from .timing import benchmark, tflops

    for d in head_dims:
        for causal in causals:
            for n in seqlens:
                b, h = default_batch_heads(n, d)
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                flops = 10 * b * h * n * n * d / (2 if causal else 1)
                for name, fn in candidates(q, k, v, do, bool(causal), d ** -0.5).items():
                    ms = benchmark(fn, min_reps=20, max_reps=20)
                    emit(dict(kernel=name, batch=b, nheads=h, seqlen=n, head_dim=d, causal=int(causal), ms=ms,
                              tflops=tflops(flops, ms), status="ok"))


def format_row(row: dict) -> str:
    return (f"d={row['head_dim']} causal={row['causal']} N={row['seqlen']:>5} {row['kernel']:<11} "
            f"{row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s")
