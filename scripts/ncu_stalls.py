"""Where the warps of one kernel wait, instruction by instruction (Nsight Compute PC sampling).

    python scripts/ncu_stalls.py --seqlen 16384 --headdim 128 --causal 0 --out results/ncu-stalls-d128-n16k-h100.json

Runs ``ncu`` (on PATH, GPU machine) on one launch of k6 and one of flash-attn-4 for the same
workload as bench.py (``--backward``: the main kernels of K10's default backward and of
flash-attn-4's, in bench.py --backward's autograd backward; ``--config``: K10's with compile
overrides on top of k10_fa3's, e.g. a knob measured and left off), with the SourceCounters section (PC sampling), prints the SASS page as CSV,
and sums the samples per instruction. The summary per kernel: total samples, samples per stall
reason, and the instructions with the most samples (address, opcode, samples, the top reasons),
so that e.g. a named-barrier wait shows which ``BAR.SYNC`` it is. Rows go to --out as they are made.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import results  # noqa: E402

KERNELS = {"k6": "FMHA", "fa4": "FlashAttentionForwardSm90"}
BACKWARD_KERNELS = {"k10_fa3": "K10Backward", "fa4": "FlashAttentionBackwardSm90"}


# bench.py --backward's cell, with K10 under a configuration of its own (``--config``)
CONFIGURED = """import sys, json
import harness.backward as hb
from harness import backward_bench
hb.add_configuration("k10_config", dict(hb.stage_overrides("k10_fa3"), **json.loads(sys.argv[1])))
d, causal, n = (int(x) for x in sys.argv[2:])
backward_bench.run(lambda row: print(backward_bench.format_row(row)), (d,), (causal,), (n,), ("k10_config",))
"""


def profile(regex: str, seqlen: int, d: int, causal: int, raw_dir: str | None, backward: bool = False,
            config: dict | None = None, softcap: float = 0.0) -> str:
    """The SASS source page of one launch, as ncu's CSV text."""
    if config is not None:
        workload = ["-c", CONFIGURED, json.dumps(config), str(d), str(causal), str(seqlen)]
    else:
        workload = ["bench.py", *(["--backward", "k10_fa3"] if backward else ["k6"]), "--seqlen", str(seqlen),
                    "--headdim", str(d), "--causal", str(causal), *(["--softcap", str(softcap)] if softcap else [])]
    cmd = ["ncu", "--clock-control", "none", "--section", "SourceCounters", "--section", "WarpStateStats",
           "--kernel-name", f"regex:{regex}", "--launch-count", "1", "--page", "source", "--print-source", "sass",
           "--csv", sys.executable, *workload]
    text = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent).stdout
    if raw_dir:
        cap = f"-cap{softcap:g}" if softcap else ""
        Path(raw_dir, f"ncu-source-{regex}-d{d}-n{seqlen}-c{causal}{cap}.csv").write_text(text)
    return text


def parse(text: str) -> list:
    """Rows of the source page: dicts keyed by ncu's column names (the CSV starts at the header)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"Address"') or l.startswith('"#"')), None)
    if start is None:
        raise SystemExit("no source page in ncu's output:\n" + text[-2000:])
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def number(x) -> float:
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def summarize(kernel: str, rows: list, top: int) -> dict:
    sample_col = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
    reasons = [c for c in rows[0] if c.startswith("stall_") or c.startswith("smsp__pcsamp_warps_issue_stalled_")]
    total = sum(number(r[sample_col]) for r in rows)
    by_reason = {c: sum(number(r[c]) for r in rows) for c in reasons}
    hot = sorted(rows, key=lambda r: -number(r[sample_col]))[:top]
    return dict(kernel=kernel, samples=total,
                by_reason={k: v for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v},
                hot=[dict(address=r.get("Address", r.get("#")), source=r.get("Source", ""),
                          samples=number(r[sample_col]), share=number(r[sample_col]) / total if total else 0,
                          reasons={c: number(r[c]) for c in sorted(reasons, key=lambda c: -number(r[c]))[:3]
                                   if number(r[c])})
                     for r in hot])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", type=int, default=0, choices=(0, 1))
    ap.add_argument("--backward", action="store_true", help="the backward's main kernels (k10_fa3, fa4)")
    ap.add_argument("--kernels", nargs="+", choices=sorted(set(KERNELS) | set(BACKWARD_KERNELS)),
                    help="default: both of the pass's")
    ap.add_argument("--config", type=json.loads,
                    help="--backward: profile K10 under these compile overrides (JSON) on top of k10_fa3's, as "
                         "k10_config (with --kernels k10_fa3 alone, or beside fa4)")
    ap.add_argument("--softcap", type=float, default=0.0, help="the workload with this logit softcap (both kernels)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--raw-dir", help="keep ncu's CSV pages here")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    names = BACKWARD_KERNELS if args.backward else KERNELS
    wrong = [name for name in args.kernels or () if name not in names]
    if wrong:  # before any profile
        ap.error(f"--kernels {wrong}: not among {list(names)}{' with --backward' if args.backward else ''}")
    if args.config is not None and not (args.backward and isinstance(args.config, dict)):
        ap.error("--config takes a JSON object of K10's compile overrides, with --backward")
    if args.softcap and args.config is not None:
        ap.error("--softcap is for bench.py's workloads; a --config profile runs uncapped")
    out = results.open_result_file(args.out, results.command_line("scripts/ncu_stalls.py", argv))
    for name in args.kernels or list(names):
        config = args.config if name == "k10_fa3" else None
        text = profile(names[name], args.seqlen, args.headdim, args.causal, args.raw_dir, args.backward, config,
                       args.softcap)
        s = summarize("k10_config" if config is not None else name, parse(text), args.top)
        s.update(head_dim=args.headdim, seqlen=args.seqlen, causal=args.causal, backward=args.backward,
                 **({"config": config} if config is not None else {}),
                 **({"softcap": args.softcap} if args.softcap else {}))
        if out:
            out.append(s)
        print(f"== {name}: {s['samples']:.0f} samples; by reason: "
              + ", ".join(f"{k.split('_', 1)[1]} {v / s['samples']:.1%}" for k, v in list(s["by_reason"].items())[:8]))
        for h in s["hot"]:
            print(f"  {h['address']:>8} {h['share']:6.1%}  {h['source'][:60]:<60} {h['reasons']}")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
