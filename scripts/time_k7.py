"""K7's time split: the FP8 pre-pass (quantize q, k, v; transpose V) and the kernel alone (GPU).

    python scripts/time_k7.py --out results/k7-time-h100.json

FA papers' workload (batch 16384/N, heads 2048/d), d 128/256 x causal x N 2k..16k. Each row: the
pre-pass (``kernels.k7.prepare_fp8``), the kernel on pre-quantized inputs, and the sum (what
``bench.py k7`` times), in ms and TFLOP/s, beside bf16 cuDNN (SDPA) in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harness import results
    from harness.api import compiled_for
    from harness.config import default_batch_heads
    from harness.inputs import empty_outputs, random_inputs
    from harness.timing import benchmark, tflops
    from kernels.contract import Problem
    from kernels.k7 import prepare_fp8

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (H100/H200)", file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, results.command_line("scripts/time_k7.py", argv))
    print(f"{'d':>4}{'causal':>7}{'N':>7}{'pre-pass ms':>13}{'kernel ms':>11}{'kernel TF/s':>13}{'total TF/s':>12}"
          f"{'cuDNN bf16':>12}")
    for d in args.headdim:
        for causal in (False, True):
            for n in args.seqlen:
                b, h = default_batch_heads(n, d)
                p = Problem(b, h, n, d, causal=causal)
                q, k, v = random_inputs(p)
                compiled = compiled_for("k7", p)
                o, lse = empty_outputs(p)
                q8, k8, vt8, descale = prepare_fp8(q, k, v)
                pre = benchmark(lambda: prepare_fp8(q, k, v))
                kern = benchmark(lambda: compiled.launch(q8, k8, vt8, o, lse, descale, p.scale))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = benchmark(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                row = dict(head_dim=d, causal=int(causal), seqlen=n, batch=b, nheads=h, prepass_ms=pre,
                           kernel_ms=kern, kernel_tflops=tflops(p.flops, kern), total_tflops=tflops(p.flops, pre + kern),
                           cudnn_bf16_tflops=tflops(p.flops, cudnn), config=compiled.info)
                print(f"{d:>4}{int(causal):>7}{n:>7}{pre:>13.3f}{kern:>11.3f}{row['kernel_tflops']:>13.1f}"
                      f"{row['total_tflops']:>12.1f}{row['cudnn_bf16_tflops']:>12.1f}", flush=True)
                if out:
                    out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
