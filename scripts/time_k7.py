"""K7's (and K8's) time split: the FP8 pre-pass (quantize q, k, v; transpose V) and the kernel alone, beside
cuDNN's FP8 attention on the same e4m3 inputs (GPU).

    python scripts/time_k7.py --out results/k7-time-h100.json

FA papers' workload (batch 16384/N, heads 2048/d), d 128/256 x causal x N 2k..16k. Each row: the
pre-pass (``kernels.k7.prepare_fp8``; pre-passes by CUDA-graph replay, so no host time), the
kernel on pre-quantized inputs, and the sum (what
``bench.py k7`` times), in ms and TFLOP/s, beside bf16 cuDNN (SDPA) and cuDNN FP8 (cudnn-frontend
``sdpa_fp8``, where installed) in the same run. "+V^T" is the kernel plus the V transpose only:
the like-for-like number against cuDNN FP8, which takes V as it is (inputs already in e4m3).
K8 on the same inputs: its pre-pass (rotation and block quantization of Q, K; V^T) and kernel.
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
    from harness.timing import benchmark, graph_ms, tflops
    from kernels.contract import Problem
    from harness.peers import cudnn_fp8_sdpa
    from kernels.k7 import prepare_fp8, quantize_fp8, transpose_v_fp8
    from kernels.k8 import prepare_fp8_blocks

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (H100/H200)", file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, results.command_line("scripts/time_k7.py", argv))
    print(f"{'d':>4}{'causal':>7}{'N':>7}{'pre-pass ms':>13}{'kernel ms':>11}{'kernel TF/s':>13}{'+V^T TF/s':>12}"
          f"{'total TF/s':>12}{'k8 kern':>9}{'k8 total':>9}{'cuDNN bf16':>12}{'cuDNN FP8':>12}")
    for d in args.headdim:
        for causal in (False, True):
            for n in args.seqlen:
                b, h = default_batch_heads(n, d)
                p = Problem(b, h, n, d, causal=causal)
                q, k, v = random_inputs(p)
                compiled = compiled_for("k7", p)
                o, lse = empty_outputs(p)
                q8, k8, vt8, descale = prepare_fp8(q, k, v)
                # The pre-passes are several launches and torch ops whose host time can pass their GPU
                # time: timed by CUDA-graph replay (the kernels, 0.18 ms and more, by events).
                pre = graph_ms(lambda i: prepare_fp8(q, k, v))
                kern = benchmark(lambda: compiled.launch(q8, k8, vt8, o, lse, descale, p.scale))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = benchmark(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                v8, _ = quantize_fp8(v)
                vt_ms = graph_ms(lambda i: transpose_v_fp8(v8))  # what k7 needs and cuDNN FP8 does not
                fp8_ms, fp8_status = None, "ok"
                for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                    try:
                        fp8_ms = benchmark(cudnn_fp8_sdpa(q8, k8, v8, descale, causal, p.scale, out_dtype))
                        fp8_status = f"ok ({str(out_dtype).replace('torch.', '')} out)"
                        break
                    except Exception as e:  # missing frontend, unsupported graph: say so, go on
                        fp8_status = f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:160]
                # K8 on the same inputs: its pre-pass (rotation, block quantization, V^T) and kernel.
                k8c = compiled_for("k8", p)
                k8_in = prepare_fp8_blocks(q, k, v, k8c.info["tile_m"], k8c.info["tile_n"])
                k8_pre = graph_ms(lambda i: prepare_fp8_blocks(q, k, v, k8c.info["tile_m"], k8c.info["tile_n"]))
                k8_kern = benchmark(lambda: k8c.launch(*k8_in[:3], o, lse, k8_in[3], p.scale))
                row = dict(head_dim=d, causal=int(causal), seqlen=n, batch=b, nheads=h, prepass_ms=pre,
                           k8_prepass_ms=k8_pre, k8_kernel_ms=k8_kern, k8_kernel_tflops=tflops(p.flops, k8_kern),
                           k8_total_tflops=tflops(p.flops, k8_pre + k8_kern),
                           vt_pass_ms=vt_ms, cudnn_fp8_ms=fp8_ms, cudnn_fp8_status=fp8_status,
                           cudnn_fp8_tflops=tflops(p.flops, fp8_ms) if fp8_ms else None,
                           k7_with_vt_tflops=tflops(p.flops, kern + vt_ms),
                           kernel_ms=kern, kernel_tflops=tflops(p.flops, kern), total_tflops=tflops(p.flops, pre + kern),
                           cudnn_bf16_tflops=tflops(p.flops, cudnn), config=compiled.info)
                fp8 = f"{row['cudnn_fp8_tflops']:>12.1f}" if fp8_ms else f"  {fp8_status}"
                print(f"{d:>4}{int(causal):>7}{n:>7}{pre:>13.3f}{kern:>11.3f}{row['kernel_tflops']:>13.1f}"
                      f"{row['k7_with_vt_tflops']:>12.1f}{row['total_tflops']:>12.1f}{row['k8_kernel_tflops']:>9.1f}"
                      f"{row['k8_total_tflops']:>9.1f}{row['cudnn_bf16_tflops']:>12.1f}"
                      + fp8, flush=True)
                if out:
                    out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
