"""Where each backward's time goes, kernel by kernel (GPU machine):

    python scripts/backward_kernels.py --out results/backward-kernels-h100.json

The autograd backward of ``k10_fa3``, cuDNN and flash-attn-4 (``harness.backward_bench``'s
candidates, one forward each, then the backward repeated) under ``torch.profiler``: each kernel's
device time per backward, averaged over 20 backwards after 5 warm-up ones. Cells: the sweep's
short walks (1k keys at d 64/128/256, causal and not at d = 128) and one long one (d = 128, 16k,
non-causal), bf16, batch 16384/N, heads 2048/d. Each kernel is filed under its role (pre-pass,
fill, copy, main, post-pass), so the three backwards line up although their kernels differ. Rows are
written as they come. The kernels run one after another on the stream, so the roles add up to
the backward's device time, the host's gaps left out (``bench.py --backward`` times the call).

``--name k10_wide --config '{...}'``: a K10 configuration (compile overrides, as
``scripts/ab_backward.py`` takes them) profiled beside ``k10_fa3`` in the same cells.
``--varlen``: the packed backward instead (``bench.py --varlen --backward``'s packing at d = 128,
causal and not), beside flash-attn-4's varlen backward.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import results  # noqa: E402
from harness.backward_bench import kernel_role  # noqa: E402
from scripts.ab_backward import config_arg  # noqa: E402

CELLS = ((128, 0, 1024), (128, 1, 1024), (64, 1, 1024), (256, 1, 1024), (128, 0, 16384))  # (d, causal, N)
def profile(fn, reps: int = 20, warmup: int = 5) -> dict:
    """kernel name -> device µs per call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time / reps
    return dict(per_kernel)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here, each as it is done")
    ap.add_argument("--name", help="the stage name a --config runs under (not a stage already)")
    ap.add_argument("--config", type=config_arg, help="K10 compile overrides as JSON, profiled beside k10_fa3")
    ap.add_argument("--varlen", action="store_true", help="the packed backward's kernels, causal and not")
    args = ap.parse_args(argv)
    import torch

    import harness.backward as hb

    if (args.name is None) != (args.config is None) or args.name in hb.VARIANTS:
        print("error: --name and --config go together, and the name must be new", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be profiled here.", file=sys.stderr)
        return 2
    stages = ("k10_fa3",)
    if args.config:
        hb.add_configuration(args.name, args.config)
        stages += (args.name,)
    from harness.backward_bench import candidates

    out = results.open_result_file(args.out, results.command_line("scripts/backward_kernels.py", argv))

    def emit(name, call, **cell):
        for kernel, us in sorted(profile(call).items(), key=lambda kv: -kv[1]):
            row = dict(candidate=name, **({"config": args.config} if name == args.name else {}), **cell,
                       role=kernel_role(kernel), kernel=kernel[:120], us=us)
            where = " ".join(f"{k}={v}" for k, v in cell.items() if k in ("head_dim", "causal", "seqlen", "tokens"))
            print(f"{where} {name:<12} {row['role']:<9} {us:9.1f} us  {kernel[:60]}", flush=True)
            if out:
                out.append(row)

    if args.varlen:
        from harness.varlen_bench import backward_candidates, packing

        d, heads = 128, 16
        lengths, (q, k, v, dout), cu = packing(d, heads)
        for causal in (0, 1):
            calls = backward_candidates(q, k, v, dout, cu, lengths, bool(causal), d ** -0.5, stages)
            for name in (*stages, "fa4"):
                if callable(calls.get(name)):
                    emit(name, calls[name], head_dim=d, causal=causal, tokens=sum(lengths), documents=len(lengths),
                         nheads=heads)
    for d, causal, n in () if args.varlen else CELLS:
        b, h = 16384 // n, 2048 // d
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for name, entry in candidates(q, k, v, do, bool(causal), d ** -0.5, stages=stages).items():
            if not isinstance(entry, str):  # a string: a refusal
                emit(name, entry[0], head_dim=d, causal=causal, seqlen=n, batch=b, nheads=h)
        del q, k, v, do
        torch.cuda.empty_cache()
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
