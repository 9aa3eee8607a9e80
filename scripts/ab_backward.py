"""A/B of K10 backward configurations against ``k10_fa3`` (the default), in one process.

    python scripts/ab_backward.py --name k10_m80 --headdim 128 \
        --config '{"overlap": true, "ds_stmatrix": true, "dq_swapab": true, "tile_m": 80}' \
        --out results/ab-k10-m80-h100.json

``--name``/``--config`` may be given more than once: each pair is checked, then all are timed
in the same cells (one run of the default and the peers for all of them).

The configuration (compile overrides of kernels/k10.py, registered as a backward stage for this
run only: a knob measured stays apart from the stages until it wins) is first checked against
float64 autograd (``harness.check.check_backward``) on N 1, 17, 1000 and 4097, causal and not,
GQA, keys outnumbering queries, a softcap and a window (``--softcap c``: every check and every
timed cell capped at c). Then it and ``k10_fa3`` are timed
through autograd beside cuDNN and flash-attn-4 on causal 0/1 x N 1k/4k/16k (batch 16384/N,
heads 2048/d), their order alternating from cell to cell. Rows are written as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import results  # noqa: E402


def config_arg(text: str) -> dict:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--config must be a JSON object of compile overrides: {e}") from None
    if not isinstance(cfg, dict) or not cfg:
        raise argparse.ArgumentTypeError(f"--config must be a non-empty JSON object, got {text!r}")
    return cfg


def checks(d: int, softcap: float = 0.0):
    """The 12 shapes; with ``softcap``, every one of them capped (what a softcap's knob changes)."""
    from kernels.contract import Problem

    cap = dict(softcap=softcap) if softcap else {}
    yield from (Problem(2, 3, n, d, causal=c, **cap) for n in (1, 17, 1000, 4097) for c in (False, True))
    yield Problem(2, 8, 1000, d, causal=True, nheads_kv=2, **cap)
    yield Problem(2, 4, 1000, d, causal=True, seqlen_k=4097, nheads_kv=2, **cap)
    yield Problem(2, 8, 1000, d, causal=True, nheads_kv=2, softcap=softcap or 5.0)
    yield Problem(2, 4, 1000, d, causal=True, window=(100, -1), **cap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, action="append",
                    help="the stage name the configuration runs under (e.g. k10_m80); once per --config")
    ap.add_argument("--config", required=True, type=config_arg, action="append", help="compile overrides as JSON")
    ap.add_argument("--headdim", type=int, default=128, choices=(64, 128, 256))
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="cap every check and every timed cell at this softcap (cuDNN has none: not timed)")
    ap.add_argument("--out", help="write the rows as JSON here, each as it is done")
    args = ap.parse_args(argv)
    import torch

    import harness.backward as hb

    if len(args.name) != len(args.config) or len(set(args.name)) != len(args.name):
        print("error: give one distinct --name for each --config", file=sys.stderr)
        return 2
    taken = [name for name in args.name if name in hb.VARIANTS]
    if taken:
        print(f"error: --name {taken[0]} is a stage already; name the configuration anew", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be checked or timed here.", file=sys.stderr)
        return 2
    configs = dict(zip(args.name, args.config))
    hb.VARIANTS.update((name, ("k10", config)) for name, config in configs.items())
    hb.STAGES = tuple(hb.VARIANTS)
    from harness import backward_bench
    from harness.check import backward_case, check_backward

    out = results.open_result_file(args.out, results.command_line("scripts/ab_backward.py", argv))
    failed = 0
    for name, config in configs.items():
        for p in checks(args.headdim, args.softcap):
            try:
                row = check_backward(p, backward=name)
            except Exception as e:  # a crash fails the configuration
                row = dict(backward_case(p, 1.0, backward=name), ok=False, reason=f"{type(e).__name__}: {e}"[:300])
            failed += not row["ok"]
            print(f"check {name} N={p.seqlen}/{p.kv_len} causal={int(p.causal)} softcap={p.softcap:g} "
                  f"window={p.window}: {'ok' if row['ok'] else 'FAIL ' + row['reason']}", flush=True)
            if out:
                out.append(dict(row, check=True, config=config))
    if failed:
        print(f"{failed} checks failed: not timed", file=sys.stderr)
        return 1

    def emit(row):
        print(backward_bench.format_row(row), flush=True)
        if out:
            out.append(dict(row, config=configs.get(row["kernel"])))

    order = ("k10_fa3", *configs)
    for i, (causal, n) in enumerate((c, n) for n in (1024, 4096, 16384) for c in (0, 1)):
        stages = order[i % len(order):] + order[:i % len(order)]  # who goes first rotates from cell to cell
        backward_bench.run(emit, (args.headdim,), (causal,), (n,), stages, softcap=args.softcap)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
