"""Time K9's backward (its three launches) beside cuDNN's and flash-attn-4's autograd backward.

    python scripts/time_backward.py --out results/k9-time-h100.json
    python scripts/time_backward.py --headdim 64 --seqlen 1024 4096

Workload as bench.py's: bf16, batch = 16384/N, heads = 2048/d; FLOPs 2.5 x the forward's
(10 B H N^2 d, halved for causal). Each candidate: a warm-up, then the median of 20 timings of
one backward between CUDA events (the peers' backward through autograd after one forward,
``retain_graph`` so the same graph is timed; K9's from the forward's O and LSE). Rows go to --out
as they are made.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import results  # noqa: E402


def median_ms(fn, reps: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def candidates(q, k, v, do, causal: bool, scale: float) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harness import attention
    from kernels.contract import Problem
    from kernels.k9 import compile_backward, run_backward

    b, h, n, d = q.shape
    out, lse = attention("k6", q, k, v, causal=causal, return_lse=True)
    compiled = compile_backward(Problem(b, h, n, d, causal=causal))
    calls = {"k9": lambda: run_backward(compiled, q, k, v, out, lse, do, scale)}
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


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    out = results.open_result_file(args.out, results.command_line("scripts/time_backward.py", argv))
    for d in args.headdim:
        for causal in args.causal:
            for n in args.seqlen:
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                flops = 10 * b * h * n * n * d / (2 if causal else 1)
                for name, fn in candidates(q, k, v, do, bool(causal), d ** -0.5).items():
                    ms = median_ms(fn)
                    row = dict(kernel=name, batch=b, nheads=h, seqlen=n, head_dim=d, causal=causal, ms=ms,
                               tflops=flops / ms / 1e9, status="ok")
                    if out:
                        out.append(row)
                    print(f"d={d} causal={causal} N={n:>5} {name:<11} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s",
                          flush=True)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
