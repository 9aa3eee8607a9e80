"""Time a kernel stage beside its peers.

    python bench.py k2                     # one kernel on the configured workload
    CHECK=1 SEQLEN=512 HEADDIM=64 python bench.py k1
    python bench.py all --out results/bench.json
    python bench.py --sweep --out results/sweep.json k2 k4
    python bench.py k4 --compile-only      # no GPU needed: compile for sm_90a and inspect

Workload: SEQLEN, HEADDIM, CAUSAL, BATCH, NHEADS, DTYPE (env) or the equivalent flags.
CHECK=1 (or --check) runs the correctness check on the same shape first and stops on failure.
"""

from __future__ import annotations

import argparse
import os
import sys

from harness.config import parse_bool, problem_from, sweep_problems
from kernels import get_kernel, kernel_names
from kernels.contract import UnsupportedProblem

PEERS = ("sdpa-cudnn", "sdpa-flash", "fa4")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="*", help="kernel names, or 'all' (default: all)")
    ap.add_argument("--seqlen", type=int)
    ap.add_argument("--headdim", type=int)
    ap.add_argument("--causal", type=int, choices=(0, 1))
    ap.add_argument("--batch", type=int)
    ap.add_argument("--nheads", type=int)
    ap.add_argument("--dtype")
    ap.add_argument("--check", action="store_true", help="check against SDPA first (same as CHECK=1)")
    ap.add_argument("--sweep", action="store_true", help="seqlen 512..16k x head dim 64/128 x causal 0/1")
    ap.add_argument("--no-peers", action="store_true", help="skip SDPA / flash-attn-4")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a and report; no GPU needed")
    ap.add_argument("--out", help="write the rows as JSON here")
    return ap.parse_args(argv)


def resolve_kernels(names):
    if not names or names == ["all"]:
        return kernel_names()
    for n in names:
        get_kernel(n)  # raises with the list of known kernels
    return names


def compile_only(names, problem) -> int:
    from kernels.contract import ensure_arch

    from harness.inspect_ptx import count_instructions, ptxas_report

    ensure_arch()
    print(f"compile-only (sm_90a): head_dim={problem.head_dim} dtype={problem.dtype} causal={int(problem.causal)}")
    for name in names:
        try:
            compiled = get_kernel(name).compile(problem, keep_ptx=True)
        except UnsupportedProblem as e:
            print(f"{name}: refused: {e}")
            continue
        counts = count_instructions(compiled.ptx or "")
        shown = ", ".join(f"{k}={v}" for k, v in counts.items() if v)
        print(f"{name}: PTX {len(compiled.ptx or '')} chars; {shown}")
        if compiled.info:
            print(f"    config: {compiled.info}")
        for kern, regs, _static_smem, spill in ptxas_report(compiled.ptx or ""):
            print(f"    {kern[:60]}: registers={regs} spill_bytes={spill}")
    return 0


def time_one(name, problem, q, k, v):
    """(ms, status) for kernel ``name``: compile outside timing, then time launches only."""
    import torch

    from harness.api import compiled_for
    from harness.inputs import poisoned_outputs
    from harness.timing import benchmark

    entry = get_kernel(name)
    try:  # compiling checks the capabilities and the GPU first
        compiled = compiled_for(name, problem)
    except UnsupportedProblem as e:
        return None, f"refused: {e}"
    out, lse = poisoned_outputs(problem)
    ms = benchmark(lambda: entry.run(compiled, q, k, v, out, lse, problem.scale))
    # The outputs started as NaN: a launch that silently did nothing must not be reported as fast.
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        return None, "failed: the timed launches left outputs unwritten or non-finite"
    return ms, "ok"


def run_problem(names, problem, check: bool, peers: bool, sweep: bool) -> list:
    from harness.check import check_kernel
    from harness.inputs import random_inputs
    from harness.peers import peer_callables
    from harness.timing import benchmark, tflops

    rows = []
    base = dict(batch=problem.batch, nheads=problem.nheads, seqlen=problem.seqlen, head_dim=problem.head_dim,
                causal=int(problem.causal), dtype=problem.dtype)
    q, k, v = random_inputs(problem)
    for name in names:
        caps = get_kernel(name).caps
        if sweep and caps.sweep_max_seqlen and problem.seqlen > caps.sweep_max_seqlen:
            rows.append(dict(base, kernel=name, ms=None, tflops=None, status="skipped: too slow for the sweep"))
            continue
        if check:
            try:
                res = check_kernel(name, problem)
            except UnsupportedProblem as e:
                res = None
                rows.append(dict(base, kernel=name, ms=None, tflops=None, status=f"refused: {e}"))
                continue
            print(f"CHECK {name}: max_abs={res.max_abs:.3g} rel_l2={res.rel_l2:.3g} lse={res.lse_max_abs:.3g} "
                  f"{'PASS' if res.ok else 'FAIL: ' + res.reason}")
            if not res.ok:
                raise SystemExit(f"correctness check failed for {name}; not timing it")
        ms, status = time_one(name, problem, q, k, v)
        rows.append(dict(base, kernel=name, ms=ms, tflops=tflops(problem.flops, ms) if ms else None, status=status))
    if peers:
        for name, fn in peer_callables(q, k, v, problem.causal, problem.scale).items():
            if callable(fn):
                ms = benchmark(fn)
                rows.append(dict(base, kernel=name, ms=ms, tflops=tflops(problem.flops, ms), status="ok"))
            else:
                rows.append(dict(base, kernel=name, ms=None, tflops=None, status=fn))
    return rows


def print_rows(rows) -> None:
    peers = {r["kernel"]: r["tflops"] for r in rows if r["kernel"] in PEERS and r["tflops"]}
    hdr = f"{'kernel':<11}{'ms':>10}{'TFLOP/s':>10}" + "".join(f"{'vs ' + p:>15}" for p in peers)
    print(hdr)
    for r in rows:
        if r["ms"] is None:
            print(f"{r['kernel']:<11}{r['status']}")
            continue
        ratios = "".join(f"{r['tflops'] / t:>14.2f}x" for t in peers.values())
        print(f"{r['kernel']:<11}{r['ms']:>10.3f}{r['tflops']:>10.1f}{ratios}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        names = resolve_kernels(args.kernels)
        problem = problem_from(seqlen=args.seqlen, headdim=args.headdim, causal=args.causal, batch=args.batch,
                               nheads=args.nheads, dtype=args.dtype)
        check = args.check or parse_bool(os.environ.get("CHECK", "0"), "CHECK")
    except UnsupportedProblem as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.compile_only:
        return compile_only(names, problem)
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be timed here. Run on an H100/H200, or inspect the "
              f"kernels without one:\n    python bench.py {' '.join(args.kernels) or 'all'} --compile-only",
              file=sys.stderr)
        return 2
    from harness import results

    device = torch.cuda.get_device_name()
    problems = list(sweep_problems(problem.dtype)) if args.sweep else [problem]
    all_rows = []
    for p in problems:
        print(f"\n== {device}: batch={p.batch} heads={p.nheads} seqlen={p.seqlen} head_dim={p.head_dim} "
              f"causal={int(p.causal)} {p.dtype} ({p.flops / 1e12:.3f} TFLOP per call)")
        rows = run_problem(names, p, check, not args.no_peers, args.sweep)
        print_rows(rows)
        all_rows += rows
    if args.out:
        path = results.write(args.out, all_rows, results.command_line("bench.py", argv))
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
