"""Time K9's backward beside cuDNN's and flash-attn-4's (``harness/backward_bench.py``; the same
as ``bench.py --backward``, which the newer runs use).

    python scripts/time_backward.py --out results/k9-time-h100.json
    python scripts/time_backward.py --headdim 64 --seqlen 1024 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import backward_bench, results  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    out = results.open_result_file(args.out, results.command_line("scripts/time_backward.py", argv))

    def emit(row):
        if out:
            out.append(row)
        print(backward_bench.format_row(row), flush=True)

    backward_bench.run(emit, args.headdim, args.causal, args.seqlen)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
