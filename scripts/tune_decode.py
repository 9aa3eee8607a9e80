"""Time the decode kernel's tile configurations and split counts (GPU).

    python scripts/tune_decode.py --out results/decode-tune-h100.json
    python scripts/tune_decode.py --headdim 128 --configs 128:2,128:3 --splits 0,16
    python scripts/tune_decode.py --fixed-shares --configs 128:2:0,128:2:2:1 --headdim 128   # l2_prefetch, refill_at_release
    python scripts/tune_decode.py --configs 128:2:4:0:0,128:2:4:0:16 --headdim 128   # merge_prefetch
    python scripts/tune_decode.py --fixed-shares --configs 128:2:4:0:0:0,128:2:4:0:0:2 --headdim 128   # prefetch_ahead
    python scripts/tune_decode.py --fixed-shares --configs 128:2:4:0:0:0:0,128:2:4:0:0:0:4 --headdim 128   # prefetch_after_wait
    python scripts/tune_decode.py --configs 128:2:4:0:0:0:0:0,128:2:4:0:0:0:0:4 --headdim 128   # claim_after

Each row: one (head dim, batch, K/V heads, cache length,
tile_n:kv_stages[:l2_prefetch[:refill_at_release[:merge_prefetch[:prefetch_ahead[:prefetch_after_wait
[:claim_after]]]]]]], num_splits), 32 query
heads, q_len 1, bf16, checked against an explicit float64 reference before it is timed, then
timed by CUDA-graph replay over enough cache copies that every replay reads several times the
50 MB L2 (``harness.timing.graph_ms``), and checked once more after the replays, on the
buffers they used (a merge or claim counter left non-zero would show there). TB/s counts K and
V read once.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

NHEADS = 32
SHAPES = {  # head dim -> (batch, nheads_kv, cache length) rows
    128: ((1, 8, 4096), (1, 8, 32768), (1, 32, 32768), (8, 8, 32768)),
    64: ((1, 8, 32768), (8, 8, 32768)),
    256: ((1, 8, 32768), (8, 8, 32768)),
}
CONFIGS = {128: ((128, 2), (128, 3), (192, 2)), 64: ((128, 2), (128, 4), (256, 2)), 256: ((64, 2), (64, 3), (96, 2))}
# --configs fields after tile_n:kv_stages, in order (a field left out: the head dim's default)
FIELDS = ("l2_prefetch", "refill_at_release", "merge_prefetch", "prefetch_ahead", "prefetch_after_wait", "claim_after")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, choices=sorted(SHAPES), help="one head dim (default: all)")
    ap.add_argument("--configs", help="tile_n:kv_stages[:l2_prefetch[:refill_at_release[:merge_prefetch"
                    "[:prefetch_ahead[:prefetch_after_wait[:claim_after]]]]]] list, "
                    "e.g. 128:2,128:3:2:1 (default: per head dim; a field left out: the head dim's default)")
    ap.add_argument("--shapes", help="batch:kv_heads:cache_len list, e.g. 1:8:32768,1:8:131072 (default: per head dim)")
    ap.add_argument("--splits", default="0", help="num_splits list; 0 is the heuristic's choice (default: 0)")
    ap.add_argument("--merge", default=None,
                    help="how splits merge, a list of: last_cta (decode's default: whichever CTA counts last merges), "
                         "last_split (the group's last split waits and merges), combine (a second launch); "
                         "each configuration is timed with each, in turn (default: the decode kernel's)")
    ap.add_argument("--fixed-shares", action="store_true",
                    help="claim_after=0 wherever a configuration leaves it out: the fixed split shares that the "
                         "tuning runs before claiming measured")
    ap.add_argument("--out", help="write the rows as JSON here, each as it is done")
    return ap.parse_args(argv)


def check_once(launcher, q, k, v, lens, num_splits, scale, buffers=None) -> float:
    """Max |O - reference| of one launch on NaN-poisoned outputs (float64 reference, no split),
    on the launcher's own buffers or on ``buffers``."""
    import torch

    from harness.reference import reference_kvcache

    b, q_len, h, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, q_len), float("nan"), device=q.device)
    if buffers is None:
        launcher(q, k, v, out, lse, lens, scale)
    else:
        launcher.launch(q, k, v, out, lse, lens, scale, buffers)
    o_ref, _ = reference_kvcache(q, k, v, lens, False, scale)
    return (out.double() - o_ref.double()).abs().max().item()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from harness import results
    from harness.decode_bench import cache_copies
    from harness.timing import graph_ms
    from kernels import decode

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (H100/H200)", file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, results.command_line("scripts/tune_decode.py", argv))
    splits_list = [int(s) for s in args.splits.split(",")]
    merges = args.merge.split(",") if args.merge else [decode.DEFAULT_MERGE]
    device = torch.cuda.get_device_name()
    for d in ([args.headdim] if args.headdim else sorted(SHAPES)):
        configs = ([tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")] if args.configs
                   else CONFIGS[d])
        shapes = ([tuple(int(x) for x in c.split(":")) for c in args.shapes.split(",")] if args.shapes
                  else SHAPES[d])
        for b, h_kv, kv_len in shapes:
            kv_bytes = 2 * b * h_kv * kv_len * d * 2
            copies = cache_copies(kv_bytes)  # enough to read past 4x the L2 (decode_bench's rule)
            caches = [(torch.randn(b, kv_len, h_kv, d, device="cuda", dtype=torch.bfloat16),
                       torch.randn(b, kv_len, h_kv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
            q = torch.randn(b, 1, NHEADS, d, device="cuda", dtype=torch.bfloat16)
            lens = torch.full((b,), kv_len, dtype=torch.int32, device="cuda")
            o = torch.empty_like(q)
            lse = torch.empty((b, NHEADS, 1), device="cuda")
            for tile_n, stages, *rest in configs:
                given = dict(zip(FIELDS, rest))
                if args.fixed_shares:
                    given.setdefault("claim_after", 0)
                cfg = decode.config(d, dict(given, tile_n=tile_n, kv_stages=stages))
                cfg = cfg.with_(refill_at_release=bool(cfg["refill_at_release"]))
                for asked, merge in ((a, m) for a in splits_list for m in merges):
                    splits = asked or decode.choose_num_splits(b, h_kv, NHEADS // h_kv, 1, kv_len,
                                                               decode.num_sms(), tile_n)
                    row = dict(device=device, head_dim=d, batch=b, nheads=NHEADS, nheads_kv=h_kv, seqlen_k=kv_len,
                               **cfg, num_splits=splits, auto_splits=asked == 0)
                    try:
                        la = decode.make_launcher(d, "bfloat16", False, NHEADS // h_kv, splits, True, merge=merge,
                                                  **cfg)
                        row.update(la.config)  # what runs: a fixed share where claiming cannot (Combine, no split)
                    except Exception as e:  # a configuration that does not fit: a row that says so
                        row.update(status=f"refused: {e}")
                        print(row)
                        if out:
                            out.append(row)
                        continue
                    err = check_once(la, q, *caches[0], lens, splits, d ** -0.5)
                    row["max_abs_err"] = err
                    if not err < 2e-2:
                        row.update(status=f"failed check: max |O - ref| = {err}")
                    else:
                        buffers = la.buffers(b, 1, NHEADS, "cuda")

                        def step(i):
                            la.launch(q, *caches[i % copies], o, lse, lens, d ** -0.5, buffers)

                        ms = graph_ms(step)
                        row.update(status="ok", merge=merge, ms=ms, tbps=kv_bytes / (ms * 1e-3) / 1e12)
                        err = check_once(la, q, *caches[0], lens, splits, d ** -0.5, buffers)
                        row["max_abs_err_after_replay"] = err
                        if not err < 2e-2:
                            row.update(status=f"failed check after the replays: max |O - ref| = {err}")
                    print(f"{merge} d={d} b={b} h_kv={h_kv} kv_len={kv_len} "
                          + " ".join(f"{k}={int(v)}" for k, v in la.config.items()) + f" S={splits}: "
                          + (f"{row['ms'] * 1e3:.1f} us {row['tbps']:.2f} TB/s" if row.get("ms") else row["status"]),
                          flush=True)
                    if out:
                        out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
