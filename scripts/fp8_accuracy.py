"""FP8 accuracy: RMSE against a float64 reference, FA3's experiment (paper, Table 3).

    python scripts/fp8_accuracy.py --out results/fp8-accuracy-h100.json     # kernels (GPU)
    python scripts/fp8_accuracy.py --emulate                                # torch emulations (CPU)

Inputs: every Q, K, V entry N(0, 1) plus N(0, 100) on 0.1% of the entries ("outliers", FA3's
setting), and plain N(0, 1) ("normal"); fp32 generation, fixed seeds, non-causal, batch 1,
4 heads. Reference: exact attention of the unquantized fp32 inputs in float64. Rows:

* ``bf16``: k6 on the inputs rounded to bf16 (emulated: float32 attention of the bf16 inputs);
* ``k7``: per-tensor e4m3 (the FP8 baseline; it keeps P's offset);
* ``hadamard only``: k7 on Q and K rotated by K8's matrix (the rotation alone);
* ``block only``: k8 with ``rotate=False`` (block scales alone);
* ``k8``: both;
* ``cudnn-fp8``: cuDNN's FP8 attention (cudnn-frontend) on k7's e4m3 inputs, where it runs.

Every kernel row is a real launch on the GPU (16-bit inputs, each stage's own pre-pass); with
``--emulate`` each FP8 row is ``harness.check.emulate_fp8`` at the same quantization points.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = ((1024, 128), (2048, 64), (2048, 128), (2048, 256), (4096, 128))
METHODS = ("bf16", "k7", "hadamard only", "block only", "k8", "cudnn-fp8")


def inputs(n: int, d: int, dist: str, seed: int, heads: int = 4):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 1, heads, n, d, generator=g)
    if dist == "outliers":
        x += torch.randn(3, 1, heads, n, d, generator=g) * 10 * (torch.rand(3, 1, heads, n, d, generator=g) < 1e-3)
    return x.unbind(0)


def emulated(method: str, q, k, v, scale: float):
    """The FP8 rows in torch, at the kernels' quantization points (CPU)."""
    from harness.check import emulate_fp8, fp8_quantized
    from harness.reference import reference
    from kernels.contract import Problem
    from kernels.fp8_quant import hadamard_signs, rotate
    from kernels.k7 import quantize_fp8
    from kernels.k8 import HADAMARD_SEED

    p = Problem(1, q.shape[1], q.shape[2], q.shape[3])
    if method == "bf16":
        return reference(*(x.bfloat16().float() for x in (q, k, v)), False, scale)[0]
    if method in ("k7", "hadamard only"):
        if method == "hadamard only":
            signs = hadamard_signs(q.shape[-1], HADAMARD_SEED)
            q, k = rotate(q, signs), rotate(k, signs)
        (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in (q, k, v))
        return emulate_fp8(q8, k8, v8, (dq, dk, dv), False, scale)
    if method == "k8":
        q8, k8, v8, descales = fp8_quantized("k8", p, q, k, v)
        return emulate_fp8(q8, k8, v8, descales, False, scale)
    if method == "block only":
        from kernels.fp8_quant import quantize_fp8_blocks
        from kernels.k8 import block_sizes

        tm, tn = block_sizes(q.shape[-1])
        (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8_blocks(x, b) for x, b in ((q, tm), (k, tn), (v, tn)))
        rows = lambda dd, b, n: dd.repeat_interleave(b, dim=-1)[..., :n, None]  # noqa: E731
        n = q.shape[2]
        return emulate_fp8(q8, k8, v8, (rows(dq, tm, n), rows(dk, tn, n).transpose(-1, -2), rows(dv, tn, n)),
                           False, scale)
    return None  # cudnn-fp8: no emulation of cuDNN's internals


def on_gpu(method: str, q, k, v, scale: float):
    """The same rows as real launches (16-bit inputs in, each stage's pre-pass included)."""
    import torch

    from harness.api import attention
    from kernels import get_kernel
    from kernels.contract import Problem
    from kernels.fp8_quant import hadamard_signs, rotate
    from kernels.k8 import HADAMARD_SEED

    q, k, v = (x.cuda() for x in (q, k, v))
    b16 = [x.bfloat16() for x in (q, k, v)]
    if method == "bf16":
        return attention("k6", *b16, softmax_scale=scale)
    if method == "k7":
        return attention("k7", *b16, softmax_scale=scale)
    if method == "hadamard only":
        signs = hadamard_signs(q.shape[-1], HADAMARD_SEED, q.device)
        return attention("k7", rotate(q, signs).bfloat16(), rotate(k, signs).bfloat16(), b16[2], softmax_scale=scale)
    if method in ("k8", "block only"):
        entry = get_kernel("k8")
        p = Problem(1, q.shape[1], q.shape[2], q.shape[3], softmax_scale=scale)
        compiled = entry.compile(p, rotate=method == "k8")
        out = torch.empty_like(b16[0])
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        entry.run(compiled, *b16, out, lse, scale)
        return out
    from harness.peers import cudnn_fp8_sdpa
    from kernels.k7 import quantize_fp8

    (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in b16)
    for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):  # bf16 O where cuDNN takes it
        try:
            o = cudnn_fp8_sdpa(q8, k8, v8, torch.stack([dq, dk, dv]), False, scale, out_dtype)()
            return o if out_dtype == torch.bfloat16 else o.float(), str(out_dtype).replace("torch.", "")
        except Exception as e:  # noqa: BLE001 (missing frontend or an unsupported graph: say so)
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
    return None, f"unavailable ({err})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--emulate", action="store_true", help="torch emulations on the CPU instead of kernels")
    ap.add_argument("--dist", nargs="+", default=["outliers", "normal"], choices=("outliers", "normal"))
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{d}" for n, d in SHAPES], help="NxD pairs")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    from harness import results
    from harness.reference import reference

    if not args.emulate and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --emulate)", file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, results.command_line("scripts/fp8_accuracy.py", argv))
    print(f"{'dist':>9}{'N':>6}{'d':>5}  " + "".join(f"{m:>15}" for m in METHODS) + f"{'k7/k8':>8}")
    for dist in args.dist:
        for shape in args.shapes:
            n, d = (int(x) for x in shape.split("x"))
            q, k, v = inputs(n, d, dist, seed=n + d, heads=args.heads)
            scale = 1 / math.sqrt(d)
            ref = reference(q.double(), k.double(), v.double(), False, scale)[0]
            errs = {}
            for method in METHODS:
                note = "emulated" if args.emulate else "kernel"
                o = emulated(method, q, k, v, scale) if args.emulate else on_gpu(method, q, k, v, scale)
                if isinstance(o, tuple):  # cuDNN: (O, what its output dtype was)
                    o, note = o
                    note = f"cudnn {note} O" if o is not None else note
                rmse = None if o is None else float((o.double().cpu() - ref).pow(2).mean().sqrt())
                errs[method] = rmse
                if out:
                    out.append(dict(dist=dist, seqlen=n, head_dim=d, heads=args.heads, method=method, rmse=rmse,
                                    source=note))
            ratio = errs["k7"] / errs["k8"] if errs.get("k8") else float("nan")
            print(f"{dist:>9}{n:>6}{d:>5}  " + "".join(f"{errs[m]:>15.2e}" if errs[m] is not None else f"{'-':>15}"
                                                         for m in METHODS) + f"{ratio:>8.2f}", flush=True)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
