"""What a logit softcap costs K6, with and without part of exp2 moved off the MUFU.

    python scripts/softcap_cost.py --out results/softcap-cost-h100.json

A softcap adds one tanh per score, on the MUFU beside exp2's ex2. ``emulated_exp2=n`` (a knob of
kernels/experiments.py) computes n of every 8 columns' exp2 on the FMA pipe instead. Each
configuration is checked against the float32 reference (on the first batch entry) and then its
compiled launch is timed (bf16, batch 16384/N, heads 2048/d). ``--rounds R`` times every
configuration of a workload R times, the order reversed each round, and keeps the median (each
round's figure is in the row). ``--configs`` adds K6 compile overrides of any kind (JSON objects,
e.g. '{"pingpong": false}'), each timed under the softcap beside the rest; ``--headdim`` and
``--causal`` keep only those workloads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import results  # noqa: E402
from harness.check import TANH_APPROX_REL, compare, launch_once  # noqa: E402
from harness.config import default_batch_heads  # noqa: E402
from harness.reference import reference  # noqa: E402
from harness.timing import benchmark, tflops  # noqa: E402
from kernels import get_kernel  # noqa: E402
from kernels.contract import Problem  # noqa: E402

WORKLOADS = ((128, True, 8192), (128, False, 4096), (64, True, 8192))  # (d, causal, N)
SOFTCAP, EMULATED = 30.0, (0, 2, 3, 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here, each as it is done")
    ap.add_argument("--rounds", type=int, default=1, help="time each configuration this many times (median)")
    ap.add_argument("--emulated", type=int, nargs="+", default=EMULATED, choices=range(9), metavar="N",
                    help=f"the emulated_exp2 settings timed under the softcap (default {' '.join(map(str, EMULATED))})")
    ap.add_argument("--configs", type=config_arg, nargs="+", default=[], metavar="JSON",
                    help="K6 compile overrides, each timed under the softcap (a row's \"config\")")
    ap.add_argument("--headdim", type=int, nargs="+", choices=sorted({w[0] for w in WORKLOADS}),
                    help="only these workloads' head dims")
    ap.add_argument("--causal", type=int, nargs="+", choices=(0, 1), help="only these workloads' causal modes")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be timed here.", file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, results.command_line("scripts/softcap_cost.py", argv))
    workloads = [(d, c, n) for d, c, n in WORKLOADS
                 if (args.headdim is None or d in args.headdim) and (args.causal is None or int(c) in args.causal)]
    for d, causal, n in workloads:
        b, h = default_batch_heads(n, d)
        runs = []  # (row, problem, launch) per configuration, checked first
        settings = [(0.0, {}, False)] + [(SOFTCAP, dict(emulated_exp2=e) if e else {}, False) for e in args.emulated]
        for cap, cfg, named in settings + [(SOFTCAP, cfg, True) for cfg in args.configs]:
            p = Problem(b, h, n, d, causal=causal, softcap=cap)
            q, k, v, o, lse = launch_once("k6", p, config=cfg or None)
            ref, ref_lse = reference(q[:1], k[:1], v[:1], causal, p.scale, softcap=cap)
            verdict = compare(o[:1], ref, lse[:1], ref_lse, "bfloat16", lse_slack=cap * TANH_APPROX_REL).verdict
            compiled = get_kernel("k6").compile(p, **cfg)
            row = dict(kernel="k6", batch=b, nheads=h, seqlen=n, head_dim=d, causal=int(causal), softcap=cap,
                       emulated_exp2=cfg.get("emulated_exp2", 0), ok=not verdict, reason=verdict, rounds_ms=[],
                       **({"config": cfg} if named else {}))
            runs.append((row, p, lambda c=compiled, t=(q, k, v, o, lse), s=p.scale: get_kernel("k6").run(c, *t, s)))
        for r in range(args.rounds):
            for row, _, launch in runs[::-1] if r % 2 else runs:
                row["rounds_ms"].append(benchmark(launch))
        for row, p, _ in runs:
            row.update(ms=statistics.median(row["rounds_ms"]))
            row.update(tflops=tflops(p.flops, row["ms"]))
            print(f"d={d} causal={int(causal)} N={n} softcap={row['softcap']:g} {setting(row)}: "
                  f"{row['ms']:.3f} ms {row['tflops']:.1f} TFLOP/s "
                  f"{'ok' if row['ok'] else 'FAIL ' + row['reason']}", flush=True)
            if out:
                out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0


def config_arg(text: str) -> dict:
    cfg = json.loads(text)
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError(f"--configs takes JSON objects of K6 compile overrides, got {text!r}")
    return cfg


def setting(row: dict) -> str:
    """A row's configuration in words: its compile overrides, or emulated_exp2=n."""
    if "config" in row:
        return json.dumps(row["config"], separators=(",", ":"))
    return f"emulated_exp2={row['emulated_exp2']}"


if __name__ == "__main__":
    sys.exit(main())
