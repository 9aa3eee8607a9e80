"""One small launch of a kernel, checked, for compute-sanitizer (racecheck, synccheck) to watch.

    compute-sanitizer --tool racecheck python scripts/sanitize_case.py k6 --headdim 128 --causal 1

A warp-specialized kernel is where races (a stage overwritten while a WGMMA still reads it) and
barrier misuse (a named barrier with the wrong thread count) live. The shapes are small so the
sanitizer finishes in seconds, with a ragged seqlen so the masked tile and a partial query tile
run, and more than one tile per CTA when the kernel is persistent (batch*heads > #SMs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.check import check_kernel  # noqa: E402
from harness.config import parse_window  # noqa: E402
from kernels.contract import Problem, as_window  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", type=int, default=0, choices=(0, 1))
    ap.add_argument("--seqlen", type=int, default=300)
    ap.add_argument("--batch-heads", type=int, default=140, help="(batch, head) pairs: > #SMs")
    ap.add_argument("--seqlen-k", type=int, help="keys, when not --seqlen (decode: a few queries, many keys)")
    ap.add_argument("--nheads-kv", type=int, help="K/V heads, when fewer than the query heads (GQA)")
    ap.add_argument("--config", type=json.loads, default=None,
                    help='compile options, e.g. \'{"split_tail": true}\' (K6\'s stream-K tail)')
    ap.add_argument("--page-size", type=int, default=0,
                    help="decode kernels: attention_with_kvcache and a plan on a paged cache of these pages, shuffled "
                         "(harness.check.check_kvcache; --batch-heads is then the query heads of one sequence)")
    ap.add_argument("--softcap", type=float, default=0.0, help="a logit softcap (forward and backward)")
    ap.add_argument("--window", default=None, help="a sliding window LEFT,RIGHT (-1 unbounded), bottom-right")
    ap.add_argument("--backward", default=None,
                    help="the backward stage (k9, k10, k10_fa3, ...) instead of the forward: dq, dk, dv checked "
                         "(harness.check.check_backward; the forward is the kernel named)")
    ap.add_argument("--varlen", action="store_true",
                    help="attention_varlen on a ragged packing of --batch-heads heads: an empty, a one-row and "
                         "sequences that end inside tiles (harness.check.check_varlen_case)")
    ap.add_argument("--deterministic", action="store_true",
                    help="under torch.use_deterministic_algorithms (warn only: the references' ops need not have it)")
    args = ap.parse_args(argv)
    if args.deterministic:
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
    window = as_window(parse_window(args.window)) if args.window else (-1, -1)
    if args.varlen:
        from harness.check import check_varlen_backward_case, check_varlen_case

        lengths = [0, 1, 17, args.seqlen, 2 * args.seqlen + 5]
        heads = (args.batch_heads, args.nheads_kv or args.batch_heads, args.headdim, bool(args.causal), args.softcap,
                 window)
        if args.backward:  # the packed backward (its forward is K6's)
            row = check_varlen_backward_case(args.backward, lengths, lengths, *heads)
            print(f"{args.backward} packed backward {lengths} causal={args.causal} softcap={args.softcap} "
                  f"window={window}: {'ok' if row['ok'] else 'FAIL ' + row['reason']}")
            return 0 if row["ok"] else 1
        row = check_varlen_case(args.kernel, lengths, lengths, *heads)
        print(f"{args.kernel} varlen {lengths} softcap={args.softcap} window={window}: "
              f"{'ok' if row['ok'] else 'FAIL ' + row['reason']} (max_abs {row['max_abs']:.2e})")
        return 0 if row["ok"] else 1
    if args.backward:
        from harness.check import check_backward

        p = Problem(1, args.batch_heads, args.seqlen, args.headdim, causal=bool(args.causal), seqlen_k=args.seqlen_k,
                    nheads_kv=args.nheads_kv, softcap=args.softcap, window=window)
        row = check_backward(p, forward=args.kernel, backward=args.backward)
        print(f"{args.backward} backward d={args.headdim} causal={args.causal} N={args.seqlen} softcap={args.softcap} "
              f"window={window}: {'ok' if row['ok'] else 'FAIL ' + row['reason']}")
        return 0 if row["ok"] else 1
    if args.page_size or (args.kernel.startswith("decode") and window != (-1, -1)):
        from harness.check import KVCacheCase, check_kvcache

        keys = args.seqlen_k or 3000
        case = KVCacheCase(args.kernel, 2, args.batch_heads, args.nheads_kv or args.batch_heads, args.seqlen, keys,
                           args.headdim, bool(args.causal), [keys // 3, keys], page_size=args.page_size, window=window)
        row = check_kvcache(case)
        print(f"{case.label()}: {'ok' if row['ok'] else 'FAIL ' + row['reason']} (max_abs {row['max_abs']:.2e})")
        return 0 if row["ok"] else 1
    res = check_kernel(args.kernel, Problem(1, args.batch_heads, args.seqlen, args.headdim, causal=bool(args.causal),
                                            seqlen_k=args.seqlen_k, nheads_kv=args.nheads_kv, softcap=args.softcap,
                                            window=window), config=args.config)
    p = res.problem
    kv = f" K/V {p.kv_heads} heads x {p.kv_len} keys" if (p.kv_heads, p.kv_len) != (p.nheads, p.seqlen) else ""
    feats = (f" softcap={args.softcap}" if args.softcap else "") + (f" window={window}" if window != (-1, -1) else "")
    print(f"{args.kernel} d={args.headdim} causal={args.causal} N={args.seqlen}{kv}{feats}"
          f"{' ' + json.dumps(args.config) if args.config else ''}: "
          f"{'ok' if res.ok else 'FAIL ' + res.reason} (max_abs {res.max_abs:.2e})")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
