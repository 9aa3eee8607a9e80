"""Tune the FP8 stages on e4m3 inputs, beside cuDNN's FP8 attention, in one run (GPU).

    python scripts/tune_fp8.py --out results/tune-fp8.json
    python scripts/tune_fp8.py --kernels k7 --headdim 128 --configs '[{"tile_n": 128}, {"tile_n": 192}]'

FA papers' workload (bf16 source tensors, batch 16384/N, heads 2048/d), quantized once per workload
with per-tensor scales (``kernels.k7.quantize_fp8``). What is timed is what an FP8 caller pays
(``attention("k7", q8, k8, v8, descale_q=...)``): the V^T pass plus the kernel. cuDNN FP8
(cudnn-frontend ``sdpa_fp8``) takes the same e4m3 tensors and V as it is. Every configuration is
first checked: its O, against SDPA on the dequantized inputs, may not be more than 1.5x as far
from it as the first kernel's O (by default k7_k4, checked against the emulation by ref_check) plus 1e-3. Rows are
written to --out as they are produced; the table printed last gives each row's ratio to cuDNN FP8.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["k7_k4", "k7"])
    ap.add_argument("--headdim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=(0, 1))
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--configs", default="[{}]",
                    help='JSON list of configurations tried for every kernel, or {"kernel": [configs], ...}')
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from harness import results
    from harness.config import default_batch_heads
    from harness.inputs import empty_outputs, random_inputs
    from harness.peers import cudnn_fp8_peer
    from harness.timing import benchmark, tflops
    from kernels import get_kernel
    from kernels.contract import Problem, UnsupportedProblem
    from kernels.k7 import quantize_fp8, transpose_v_fp8

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (H100/H200)", file=sys.stderr)
        return 2
    configs = json.loads(args.configs)
    out = results.open_result_file(args.out, results.command_line("scripts/tune_fp8.py", argv))
    rows = []

    def rel_l2(o, ref):
        return float(torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref))

    for d in args.headdim:
        for causal in map(bool, args.causal):
            for n in args.seqlen:
                b, h = default_batch_heads(n, d)
                p = Problem(b, h, n, d, causal=causal)
                q, k, v = random_inputs(p)
                (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in (q, k, v))
                descale = torch.stack([dq, dk, dv])
                vt8 = transpose_v_fp8(v8)
                vt_ms = benchmark(lambda: transpose_v_fp8(v8))
                deq = [(x8.float() * s).to(q.dtype) for x8, s in ((q8, dq), (k8, dk), (v8, dv))]
                ref = F.scaled_dot_product_attention(*deq, is_causal=causal).float()
                del deq
                peer = cudnn_fp8_peer(q8, k8, v8, descale, causal, p.scale)
                fp8_ms = benchmark(peer) if callable(peer) else None
                if not callable(peer):
                    print(f"cuDNN FP8: {peer}", file=sys.stderr)
                base_err = None
                for name in args.kernels:
                    entry = get_kernel(name)
                    for cfg in (configs.get(name, [{}]) if isinstance(configs, dict) else configs):
                        row = dict(kernel=name, config=cfg, head_dim=d, causal=int(causal), seqlen=n, batch=b,
                                   nheads=h, vt_ms=vt_ms, cudnn_fp8_ms=fp8_ms,
                                   cudnn_fp8_tflops=tflops(p.flops, fp8_ms) if fp8_ms else None)
                        try:
                            compiled = entry.compile(p, **cfg)
                        except UnsupportedProblem as e:
                            row.update(status=f"refused: {e}")
                            rows.append(row)
                            continue
                        o, lse = empty_outputs(p)
                        o.fill_(float("nan"))
                        compiled.launch(q8, k8, vt8, o, lse, descale, p.scale)
                        err = rel_l2(o, ref) if torch.isfinite(o).all() else float("inf")
                        if base_err is None:
                            base_err = err  # the first kernel's first configuration: K7 on K4 by default
                        if not err <= 1.5 * base_err + 1e-3:
                            row.update(status=f"check failed: rel_l2 {err:.3g} vs {base_err:.3g}")
                        else:
                            ms = benchmark(lambda: compiled.launch(q8, k8, vt8, o, lse, descale, p.scale)) + vt_ms
                            row.update(status="ok", rel_l2=err, ms=ms, tflops=tflops(p.flops, ms),
                                       vs_cudnn_fp8=fp8_ms / ms if fp8_ms else None, config_used=compiled.info)
                        rows.append(row)
                        print(json.dumps({k: row.get(k) for k in ("kernel", "config", "head_dim", "causal", "seqlen",
                                                                  "tflops", "cudnn_fp8_tflops", "vs_cudnn_fp8",
                                                                  "status")}), flush=True)
                        if out:
                            out.append(row)
    print(f"\n{'kernel':<8}{'config':<44}{'d':>4}{'c':>3}{'N':>7}{'TF/s':>8}{'cuDNN FP8':>11}{'ratio':>7}")
    for r in rows:
        if r.get("status") == "ok":
            ratio = f"{r['vs_cudnn_fp8']:>7.3f}" if r["vs_cudnn_fp8"] else "      -"
            fp8 = f"{r['cudnn_fp8_tflops']:>11.1f}" if r["cudnn_fp8_tflops"] else "          -"
            print(f"{r['kernel']:<8}{json.dumps(r['config']):<44}{r['head_dim']:>4}{r['causal']:>3}{r['seqlen']:>7}"
                  f"{r['tflops']:>8.1f}{fp8}{ratio}")
        else:
            print(f"{r['kernel']:<8}{json.dumps(r['config']):<44}{r['head_dim']:>4}{r['causal']:>3}{r['seqlen']:>7}  "
                  f"{r['status'][:80]}")
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
