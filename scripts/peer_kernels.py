"""Which kernels the peers launch, and how: name, grid, block, registers, SMEM, duration (GPU).

    python scripts/peer_kernels.py --headdim 128 --seqlen 512 1024 --causal 1

One profiled call (after a warm-up) per peer and workload, through torch.profiler: its trace
records every kernel's launch configuration, so a peer's tile shape and CTAs per SM can be read
off without ncu. The same for a kernel of this repository (``--kernels``), for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.config import default_batch_heads  # noqa: E402
from harness.inputs import poisoned_outputs, random_inputs  # noqa: E402
from harness.peers import peer_callables  # noqa: E402
from kernels import get_kernel  # noqa: E402
from kernels.contract import Problem  # noqa: E402

FIELDS = ("grid", "block", "registers per thread", "shared memory", "blocks per SM", "est. achieved occupancy %")


def profile(fn) -> list:
    """[(name, duration us, {launch fields})] of the GPU kernels one call of ``fn`` launches."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return [(e["name"], e.get("dur"), {k: e["args"][k] for k in FIELDS if k in e.get("args", {})})
            for e in trace["traceEvents"] if e.get("cat") == "kernel"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--causal", type=int, nargs="+", default=[1], choices=(0, 1))
    ap.add_argument("--kernels", nargs="*", default=["k6"])
    args = ap.parse_args(argv)
    for d in args.headdim:
        for causal in args.causal:
            for n in args.seqlen:
                b, h = default_batch_heads(n, d)
                p = Problem(b, h, n, d, causal=bool(causal))
                q, k, v = random_inputs(p)
                calls = {name: fn for name, fn in peer_callables(q, k, v, p.causal, p.scale).items() if callable(fn)}
                for name in args.kernels:
                    entry = get_kernel(name)
                    compiled = entry.compile(p)
                    out, lse = poisoned_outputs(p)
                    calls[name] = lambda entry=entry, compiled=compiled, out=out, lse=lse: entry.run(
                        compiled, q, k, v, out, lse)
                for name, fn in calls.items():
                    for kname, dur, launch in profile(fn):
                        print(f"d={d} causal={causal} N={n} {name:10s} {dur} us  {launch}  {kname[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
