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

``--varlen``: packed sequences instead. The checks are packings at ``--headdim``
(``harness.check.check_varlen_backward_case``: empty, one-row, ragged and tile-multiple
sequences, GQA, keys outnumbering queries, a softcap, a window), and the timing is
``bench.py --varlen --backward``'s packing, causal and not, beside flash-attn-4's varlen backward.
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
    ap.add_argument("--varlen", action="store_true",
                    help="packed sequences: packed checks, then bench.py --varlen --backward's packing")
    ap.add_argument("--out", help="write the rows as JSON here, each as it is done")
    args = ap.parse_args(argv)
    import torch

    import harness.backward as hb

    if args.varlen and args.softcap:
        print("error: --varlen times the packing uncapped (its checks take a softcap case of their own)",
              file=sys.stderr)
        return 2
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
    for name, config in configs.items():
        hb.add_configuration(name, config)
    from harness import backward_bench
    from harness.check import backward_case, check_backward

    out = results.open_result_file(args.out, results.command_line("scripts/ab_backward.py", argv))
    if args.varlen:
        return packed(args.headdim, configs, out)
    def check(name, p):
        try:
            return check_backward(p, backward=name)
        except Exception as e:  # a crash fails the configuration
            return dict(backward_case(p, 1.0, backward=name), ok=False, reason=f"{type(e).__name__}: {e}"[:300])

    cases = list(checks(args.headdim, args.softcap))
    if not all_pass(configs, cases, check, out, lambda p: f"N={p.seqlen}/{p.kv_len} causal={int(p.causal)} "
                                                         f"softcap={p.softcap:g} window={p.window}"):
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


def all_pass(configs: dict, cases: list, check, out, label) -> bool:
    """Each configuration's checks (``check(name, case)`` -> a result row), printed and written as
    they come; whether every one passed (a failure: nothing is timed)."""
    failed = 0
    for name, config in configs.items():
        for case in cases:
            row = check(name, case)
            failed += not row["ok"]
            print(f"check {name} {label(case)}: {'ok' if row['ok'] else 'FAIL ' + row['reason']}", flush=True)
            if out:
                out.append(dict(row, check=True, config=config))
    if failed:
        print(f"{failed} checks failed: not timed", file=sys.stderr)
    return not failed


def packed_checks():
    """(lengths_q, lengths_k, heads, heads_kv, causal, softcap, window): sequences of 0 and 1 rows,
    ragged ones, whole key tiles (128, 256) beside a partial last one, keys outnumbering queries."""
    ragged = [0, 17, 1, 300, 0, 1000, 128, 255]
    keys = [64] + [n + 64 * (i % 2) for i, n in enumerate(ragged)][1:]
    tiles = [256, 128, 4097, 0, 640, 129]
    for causal in (False, True):
        yield [1000], [1000], 4, 4, causal, 0.0, (-1, -1)
        yield ragged, keys, 8, 2, causal, 0.0, (-1, -1)
        yield tiles, tiles, 8, 2, causal, 0.0, (-1, -1)
        yield ragged, keys, 8, 2, causal, 5.0, (-1, -1)
        yield tiles, tiles, 4, 4, causal, 0.0, (100, 0 if causal else 300)


def packed(d: int, configs: dict, out) -> int:
    """``--varlen``: the packed checks of every configuration, then the packing's backward of each
    and of ``k10_fa3`` beside flash-attn-4's, causal 0 and 1, the order rotating."""
    from harness.check import check_varlen_backward_case
    from harness.varlen_bench import backward_candidates, packing, real_flops, timed

    def check(name, case):
        try:
            return check_varlen_backward_case(name, *case[:4], d, *case[4:])
        except Exception as e:  # a crash fails the configuration
            return dict(kernel=name, ok=False, reason=f"{type(e).__name__}: {e}"[:300])

    if not all_pass(configs, list(packed_checks()), check, out,
                    lambda c: f"packed {c[0]} causal={int(c[4])} softcap={c[5]:g} window={c[6]}"):
        return 1
    heads = 16
    lengths, (q, k, v, dout), cu = packing(d, heads)
    total, scale = sum(lengths), d ** -0.5
    order = ("k10_fa3", *configs)
    for causal in (0, 1):
        flops = 2.5 * real_flops(lengths, heads, d, bool(causal))
        calls = backward_candidates(q, k, v, dout, cu, lengths, bool(causal), scale, order)
        calls.pop("sdpa-cudnn-padded", None)  # 10x behind: bench.py --varlen --backward has it
        names = order[causal % len(order):] + order[:causal % len(order)] + ("fa4",)
        for name in names:
            row = timed(dict(kernel=name, documents=len(lengths), tokens=total, nheads=heads, head_dim=d,
                             causal=causal, backward=True, config=configs.get(name)), calls[name], flops)
            took = f"{row['call_ms']:9.3f} ms {row['call_tflops']:8.1f} TFLOP/s" if row["status"] == "ok" else row["status"]
            print(f"packed causal={causal} {name:<16}{took}", flush=True)
            if out:
                out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
