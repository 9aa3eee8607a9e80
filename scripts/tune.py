"""Tune the warp-specialized stages (K5, K6): configurations timed beside the peers, in one run.

    python scripts/tune.py --out results/tune-k6.json                       # the default grid
    python scripts/tune.py --kernels k6 --headdim 128 --seqlen 512 8192 \
        --configs '[{"tile_n": 128}, {"tile_n": 176}]'                      # a custom one

For each (head dim, causal, seqlen) workload (bf16, batch = 16384/N, heads = 2048/d, the FA papers'
convention) every (kernel, configuration) is first checked against SDPA on the same inputs (the
ref_check criterion) and only then timed; cuDNN (through SDPA) and flash-attn-4 are timed on the
same inputs. A configuration is a dict of the kernel's compile_kernel keywords; {} is its
DEFAULT_CONFIG. Rows are written to --out as they are produced, and the table printed last gives
each row's ratio to the best peer of its workload.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import results  # noqa: E402
from harness.check import compare  # noqa: E402
from harness.config import default_batch_heads  # noqa: E402
from harness.inputs import poisoned_outputs, random_inputs  # noqa: E402
from harness.peers import BEST_OF, peer_callables  # noqa: E402
from harness.reference import reference, sdpa  # noqa: E402
from harness.timing import benchmark, gpu_fields, more_rounds, tflops  # noqa: E402
from kernels import get_kernel  # noqa: E402
from kernels.contract import Problem, UnsupportedProblem  # noqa: E402

def time_config(name, cfg, p, q, k, v, ref, ref_lse, peer) -> dict:
    entry = get_kernel(name)
    try:
        compiled = entry.compile(p, **cfg)
    except UnsupportedProblem as e:
        return dict(ms=None, tflops=None, status=f"refused: {e}")
    out, lse = poisoned_outputs(p)
    entry.run(compiled, q, k, v, out, lse)
    verdict = compare(out, ref, lse, ref_lse, p.dtype, peer).verdict
    if verdict:
        return dict(ms=None, tflops=None, status=f"check failed: {verdict}")
    launch = lambda: entry.run(compiled, q, k, v, out, lse)  # noqa: E731
    state = {}
    ms = benchmark(launch, state=state)
    return dict(ms=ms, tflops=tflops(p.flops, ms), status="ok", config_used=compiled.info, launch=launch,
                states=[state])


def retime(rows: list, rounds: int, flops: float) -> None:
    """Rounds 2..n for every timed row of one workload (``harness.timing.more_rounds``, as
    ``bench.py --rounds``); each row keeps the median (``ms_rounds``: all of them). Configurations
    that differ by a few percent need this: one pass has shown an identical configuration 5% away
    from itself."""
    import statistics

    timed = [r for r in rows if r.get("launch")]
    if rounds > 1:
        all_ms = more_rounds([r["launch"] for r in timed], [r["ms"] for r in timed], rounds,
                             [r["states"] for r in timed])
        for r, ms_rounds in zip(timed, all_ms):
            r.update(ms_rounds=ms_rounds, ms=statistics.median(ms_rounds))
            r["tflops"] = tflops(flops, r["ms"])
    for r in rows:
        r.pop("launch", None)
        r.update(gpu_fields(r.pop("states", [])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["k4", "k5", "k6"])
    ap.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=(0, 1))
    ap.add_argument("--seqlen", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--configs", default="[{}]",
                    help='JSON list of configurations tried for every kernel, or {"kernel": [configs], ...}')
    ap.add_argument("--nheads", type=int, help="query heads (default 2048/d; batch stays 16384/N)")
    ap.add_argument("--kv-group", type=int, default=1,
                    help="query heads per K/V head (GQA); >1 times the kernels only (the peers take MHA here)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every candidate this many times, the order reversed each round; report the median")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    configs = json.loads(args.configs)
    result_file = results.open_result_file(args.out, results.command_line("scripts/tune.py", argv))
    rows = []
    for d in args.headdim:
        for causal in args.causal:
            for n in args.seqlen:
                b, h = default_batch_heads(n, d)
                h = args.nheads or h
                p = Problem(b, h, n, d, causal=bool(causal), nheads_kv=h // args.kv_group if args.kv_group > 1 else None)
                q, k, v = random_inputs(p)
                ref, ref_lse = reference(q, k, v, p.causal, p.scale)
                peer = sdpa(q, k, v, p.causal, p.scale)
                base = dict(batch=b, nheads=h, nheads_kv=p.kv_heads, seqlen=n, head_dim=d, causal=causal, dtype=p.dtype)
                here = []
                for name in args.kernels:
                    for cfg in (configs.get(name, [{}]) if isinstance(configs, dict) else configs):
                        here.append(dict(base, kernel=name, config=cfg,
                                         **time_config(name, cfg, p, q, k, v, ref, ref_lse, peer)))
                        print(f"d={d} causal={causal} N={n} {name} {cfg}: {here[-1]['status']} "
                              f"{here[-1]['tflops'] or 0:.1f}", flush=True)
                peers = peer_callables(q, k, v, p.causal, p.scale) if args.kv_group == 1 else {}
                for name, fn in peers.items():
                    if name in BEST_OF and callable(fn):
                        state = {}
                        ms = benchmark(fn, state=state)
                        here.append(dict(base, kernel=name, config=None, ms=ms, tflops=tflops(p.flops, ms),
                                         status="ok", launch=fn, states=[state]))
                retime(here, args.rounds, p.flops)
                best = max((r["tflops"] for r in here if r["kernel"] in BEST_OF), default=None)
                for r in here:
                    r["vs_best_peer"] = r["tflops"] / best if best and r["tflops"] else None
                rows += here
                for r in here if result_file else ():  # as they come: an interrupted run keeps what it measured
                    result_file.append(r)
                del q, k, v, ref, peer
                torch.cuda.empty_cache()
    if result_file:
        result_file.close()
    print(f"\n{torch.cuda.get_device_name()}: bf16, TFLOP/s (x best of {'/'.join(BEST_OF)})")
    for r in rows:
        label = r["kernel"] + (" " + json.dumps(r["config"]) if r["config"] else "")
        t = f"{r['tflops']:.1f}" + (f" ({r['vs_best_peer']:.2f}x)" if r["vs_best_peer"] else "") \
            if r["tflops"] else r["status"][:60]
        clock = f"  {r['sm_clock_mhz']:.0f} MHz {r['power_w']:.0f} W" if r.get("sm_clock_mhz") else ""
        print(f"  d={r['head_dim']:<4}c={r['causal']} N={r['seqlen']:<6}{label:<50}{t}{clock}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
