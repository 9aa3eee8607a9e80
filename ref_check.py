"""Correctness grid against PyTorch SDPA on float32 copies of the inputs.

    python ref_check.py k2            # one kernel
    python ref_check.py all           # every registered kernel
    python ref_check.py k4 --quick    # a smaller grid
    python ref_check.py --decode      # attention over a KV cache: decode_nosplit, decode_combine, decode
    python ref_check.py --decode --quick   # one KV-cache case per behaviour (about a minute)
    python ref_check.py --backward    # the backward (K9 and K10): dq, dk, dv against float64 autograd
    python ref_check.py --varlen      # packed sequences (attention_varlen) against a per-sequence reference
    python ref_check.py --varlen --backward   # their gradients (K10's packed backward), sequence by sequence
    python ref_check.py k6 --features # only the softcap and window cases (with --backward, --decode too)
    python ref_check.py all --jobs 16 # the forward grid, a process per kernel and head dim, over the GPUs

Kernels that take a logit softcap or a sliding window also run them (softcaps 0.5, 5, 50; windows
with edges inside and across tiles, one key wide, one-sided, with more keys than queries; GQA,
causal and not) against explicit scores.

For each kernel: causal and non-causal, every head dim it supports among 64 and 128 (all of
them with --all-head-dims), seqlens that are and are not multiples of the tiles, batch*heads > 1
plus one case with thousands of (batch, head) pairs, fp16 beside bf16, a softmax_scale of the
caller's (0.3) once per head dim, fresh random inputs per case and NaN-poisoned outputs. A case
passes when O is within twice SDPA's own 16-bit error of the float32 reference (see
harness/check.py) and LSE within 1e-4. Prints one row per case and
exits non-zero if any case fails. The grid is fixed: the workload variables of bench.py
(SEQLEN, HEADDIM, ...) are refused rather than ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness.backward import MAIN_STAGES
from harness.backward import STAGES as BACKWARD_STAGES
from harness.backward import VARIANTS as BACKWARD_VARIANTS
from harness.config import KNOBS
from kernels import get_kernel, kernel_names
from kernels.contract import Problem, UnsupportedProblem

# Ragged lengths (1, 17, 100, 1000, 4097) exercise the masked last tile; multiples of every tile
# (64, 128, 4096) exercise the path where no tile is masked at all (non-causal).
SEQLENS = (1, 17, 64, 100, 128, 1000, 4096, 4097)
QUICK_SEQLENS = (1, 17, 128, 1000)
HEAD_DIMS = (64, 128)


def cases(name: str, seqlens, all_head_dims: bool):
    caps = get_kernel(name).caps
    head_dims = caps.head_dims if all_head_dims else [d for d in caps.head_dims if d in HEAD_DIMS]
    for d in head_dims:
        for causal in ((False, True) if caps.causal else (False,)):
            for n in seqlens:
                yield Problem(2, 3, n, d, dtype="bfloat16", causal=causal)
    if "float16" in caps.dtypes:  # fp16 on one shape per causal mode
        for causal in ((False, True) if caps.causal else (False,)):
            yield Problem(1, 4, 1000, head_dims[0], dtype="float16", causal=causal)
    yield Problem(8, 1024, 80, head_dims[0], causal=True)  # many CTAs along heads and batch
    for d in head_dims:  # a softmax_scale of the caller's (every case above takes 1/sqrt(d))
        yield Problem(2, 3, 1000, d, causal=caps.causal, softmax_scale=0.3)
    for d in head_dims:  # grouped-query attention and keys outnumbering queries, where the kernel takes them
        for causal in ((False, True) if caps.causal else (False,)):
            if caps.gqa:
                for nheads, nheads_kv in GQA_HEADS:
                    yield Problem(2, nheads, 1000, d, causal=causal, nheads_kv=nheads_kv)
            if caps.unequal_lengths:
                for seqlen_q, seqlen_k in UNEQUAL_LENGTHS:
                    yield Problem(2, 4, seqlen_q, d, causal=causal, seqlen_k=seqlen_k,
                                  nheads_kv=2 if caps.gqa else None)
            if caps.softcap:  # with GQA and an odd length; 0.5 saturates most scores, 50 almost none
                for softcap in SOFTCAPS:
                    yield Problem(2, 8, 1000, d, causal=causal, nheads_kv=2 if caps.gqa else None, softcap=softcap)
            if caps.window:  # edges inside tiles, across tiles, one key only, one side only; more keys than queries
                windows = sorted({(left, -1 if causal else right) for left, right in WINDOWS} - {(-1, -1)})
                for window in windows:
                    for seqlen_q, seqlen_k in ((1000, 1000), (1000, 4097)):
                        yield Problem(2, 4, seqlen_q, d, causal=causal, seqlen_k=seqlen_k,
                                      nheads_kv=2 if caps.gqa else None, window=window)


# (query heads, K/V heads): group 4, MQA, group 8.
GQA_HEADS = ((8, 2), (4, 1), (16, 2))
# (seqlen_q, seqlen_k): decode-like, short and long chunks of a longer context, a 3x ratio.
UNEQUAL_LENGTHS = ((1, 4097), (17, 1000), (1000, 4097), (128, 384))
SOFTCAPS = (0.5, 5.0, 50.0)
WINDOWS = ((256, 0), (0, 0), (100, 300), (-1, 64), (511, -1))  # (left, right); causal keeps the left


def decode_cases(quick: bool):
    """The KV-cache grid (docs/decode.md): GQA / MQA / MHA shapes, q_len 1-17, cache lengths around
    the tile and up to 128k, per-sequence lengths including 0, an int length, NaN/inf planted past
    every length, causal bottom-right, forced split counts, fp16, graph replay. ``quick``: one
    case per behaviour, at d=128 bf16, few compiled variants (under a minute on an H100)."""
    from harness.check import KVCacheCase as C
    from harness.kvcache import kv_tile

    tiles = -(-4000 // kv_tile(128))  # KV tiles of the forced-split cases' longer sequence
    if quick:
        yield from quick_decode_cases(tiles)
        return
    shapes = [(1, 32, 8, 1), (4, 32, 8, 1), (2, 32, 32, 1), (1, 32, 1, 1), (1, 64, 8, 1), (3, 32, 8, 4),
              (1, 32, 8, 16), (1, 32, 8, 17), (2, 28, 4, 3)]
    for kernel in ("decode", "decode_combine"):
        for b, h, hk, q_len in shapes:
            for causal in (False, True):
                yield C(kernel, b, h, hk, q_len, 1000, 128, causal, [1000 - 37 * i for i in range(b)])
        for s_cache in (1, 2, 127, 128, 129, 1000, 8191, 32768, 131072):
            yield C(kernel, 1, 32, 8, 1, s_cache, 128, False, [s_cache])
        for d in (64, 256):
            yield C(kernel, 2, 32, 8, 4, 3000, d, True, [3000, 1111])
            yield C(kernel, 1, 32, 4, 1, 4097, d, False, [4097])
        yield C(kernel, 4, 32, 8, 1, 8192, 128, False, [0, 1, 127, 8192], graph=True)
        yield C(kernel, 3, 32, 8, 1, 4096, 128, False, [0, 0, 0])
        yield C(kernel, 2, 32, 8, 1, 5000, 128, False, 4321)  # an int length: the caches sliced, no tensor
        yield C(kernel, 2, 32, 8, 1, 5000, 128, False, None)
        yield C(kernel, 1, 32, 8, 5, 2, 128, True, [2])  # 5 queries, 2 keys: three rows see nothing
        yield C(kernel, 1, 32, 8, 4, 2000, 128, True, [2000], dtype="float16")
        # No split and more CTAs than SMs (34 x 4 K/V heads on 132): two CTAs per SM on SHARED_SM_GPUS.
        for d in (128, 256):
            yield C(kernel, 34, 32, 4, 1, 1000, d, d == 256, [0, 1] + [1000 - 29 * i for i in range(32)])
        # Forced split counts, each also against the automatic one: one per tile, more splits than
        # tiles (empty trailing splits; the 2500-key sequence has fewer tiles still), 128.
        for splits in (1, 2, 3, 7, tiles, tiles + 8, 128):
            yield C(kernel, 2, 32, 8, 1, 4000, 128, False, [4000, 2500], num_splits=splits)
        # A paged cache, its pages shuffled: pages of one and two tiles, and pages smaller than a
        # tile (16 keys, the smallest), at every head dim; a 128k sequence; an int length.
        for d, page in ((128, 128), (128, 256), (128, 16), (64, 256), (64, 64), (64, 16), (256, 64), (256, 16)):
            yield C(kernel, 3, 32, 8, 4, 3000, d, True, [3000, 1111, 0], page_size=page, graph=True)
        yield C(kernel, 1, 32, 8, 1, 131072, 128, False, [131072], page_size=256)
        yield C(kernel, 2, 32, 8, 1, 5000, 128, False, 4321, page_size=128)
        # A sliding window: the splits share only its key tiles. Edges inside a tile and across
        # tiles, a window wider than the cache, several queries, GQA, paged, forced splits, non-causal.
        for left in (0, 100, 1000, 10000):
            yield C(kernel, 3, 32, 8, 4, 8192, 128, True, [8192, 3001, 0], window=(left, -1))
        yield C(kernel, 2, 32, 8, 1, 8192, 64, True, [8192, 1500], window=(700, -1), graph=True)
        yield C(kernel, 2, 32, 8, 1, 8192, 256, True, [8192, 1500], window=(700, -1))
        yield C(kernel, 3, 32, 8, 4, 3000, 128, True, [3000, 1111, 0], page_size=16, window=(300, -1), graph=True)
        yield C(kernel, 2, 32, 8, 1, 4000, 128, False, [4000, 2500], num_splits=7, window=(1000, -1))
        yield C(kernel, 2, 32, 8, 3, 4000, 128, False, [4000, 2500], window=(200, 1))
    yield C("decode_nosplit", 2, 32, 8, 4, 3000, 128, True, [3000, 10])


def quick_decode_cases(tiles: int):
    """The default kernel (decode) once per behaviour of the full grid; decode_combine and
    decode_nosplit once each."""
    from harness.check import KVCacheCase as C

    k = "decode"
    yield C(k, 1, 32, 8, 1, 1000, 128, True, [1000])  # causal at q_len 1: also bitwise equal to non-causal
    yield C(k, 3, 32, 8, 4, 1000, 128, True, [1000, 963, 926])
    yield C(k, 1, 32, 8, 17, 3000, 128, True, [3000])  # 68 packed rows: two query tiles
    yield C(k, 2, 32, 32, 1, 1000, 128, False, [1000, 963])
    for s_cache in (1, 129, 8191):
        yield C(k, 1, 32, 8, 1, s_cache, 128, False, [s_cache])
    yield C(k, 4, 32, 8, 1, 8192, 128, False, [0, 1, 127, 8192], graph=True)
    yield C(k, 3, 32, 8, 1, 4096, 128, False, [0, 0, 0])
    yield C(k, 2, 32, 8, 1, 5000, 128, False, 4321)
    yield C(k, 1, 32, 8, 5, 2, 128, True, [2])
    for splits in (1, 3, tiles + 8, 128):
        yield C(k, 2, 32, 8, 1, 4000, 128, False, [4000, 2500], num_splits=splits)
    yield C(k, 3, 32, 8, 4, 3000, 128, True, [3000, 1111, 0], page_size=128, graph=True)
    yield C(k, 3, 32, 8, 4, 3000, 128, True, [3000, 1111, 0], page_size=16, graph=True)
    yield C(k, 3, 32, 8, 4, 8192, 128, True, [8192, 3001, 0], window=(100, -1))
    yield C("decode_combine", 4, 32, 8, 1, 8192, 128, False, [0, 1, 127, 8192], graph=True)
    yield C("decode_nosplit", 2, 32, 8, 4, 3000, 128, True, [3000, 10])


def run_decode(quick: bool, out, features_only: bool = False) -> tuple:
    from harness.check import check_kvcache

    rows, failures = [], 0
    print("decode grid: O vs a float64 reference within twice SDPA's own 16-bit error (+1e-4) and relative L2; "
          "LSE within 1e-4 (-inf where a row sees no key); forced splits vs auto, causal q_len 1 vs non-causal, "
          "repeated plan runs and graph replay (harness/check.py check_kvcache)")
    print(f"{'case':<100}{'max_abs':>11}{'sdpa_err':>11}{'lse_err':>11}  result")
    for case in decode_cases(quick):
        if features_only and tuple(case.window) == (-1, -1):
            continue
        try:
            row = check_kvcache(case)
        except Exception as e:  # a crash is a failure of this case
            row = dict(kernel=case.kernel, case=case.label(), ok=False, reason=f"{type(e).__name__}: {e}"[:300],
                       max_abs=None, lse_max_abs=None)
        row["status"] = "ok" if row["ok"] else "failed"
        rows.append(row)
        failures += not row["ok"]
        if out:
            out.append(row)
        print(f"{row['case']:<100}{_e(row['max_abs'])}{_e(row.get('peer_max_abs'))}{_e(row['lse_max_abs'])}  "
              f"{'ok' if row['ok'] else 'FAIL ' + row['reason']}", flush=True)
    return rows, failures


def backward_cases(seqlens, features: bool = False, head_dims=(64, 128)):
    """K9's grid: d 64/128 x causal x seqlens, batch 2 x heads 3, bf16; fp16 once per causal mode;
    the forward grid's GQA heads and (seqlen_q, seqlen_k) pairs; inputs 8x larger once per head dim
    (larger scores, a sharper softmax), and a caller's softmax_scale once; batch 8 x 1024 heads.
    ``features`` (K10): the forward grid's softcaps and windows too; ``head_dims``: the stage's (K10
    adds 256)."""
    for d in head_dims:
        for causal in (False, True):
            for n in seqlens:
                yield Problem(2, 3, n, d, causal=causal), 1.0
            yield Problem(1, 4, 1000, d, dtype="float16", causal=causal), 1.0
            for nheads, nheads_kv in GQA_HEADS:
                yield Problem(2, nheads, 1000, d, causal=causal, nheads_kv=nheads_kv), 1.0
            for seqlen_q, seqlen_k in UNEQUAL_LENGTHS:
                yield Problem(2, 4, seqlen_q, d, causal=causal, seqlen_k=seqlen_k, nheads_kv=2), 1.0
            if features:
                for softcap in SOFTCAPS:
                    yield Problem(2, 8, 1000, d, causal=causal, nheads_kv=2, softcap=softcap), 1.0
                for window in sorted({(left, -1 if causal else right) for left, right in WINDOWS} - {(-1, -1)}):
                    for seqlen_q, seqlen_k in ((1000, 1000), (1000, 4097)):
                        yield Problem(2, 4, seqlen_q, d, causal=causal, seqlen_k=seqlen_k, nheads_kv=2,
                                      window=window), 1.0
        yield Problem(2, 3, 1000, d, causal=True), 8.0
        yield Problem(2, 3, 1000, d, causal=True, softmax_scale=0.3), 1.0  # a scale of the caller's
    yield Problem(8, 1024, 80, 64, causal=True), 1.0


def varlen_cases(quick: bool = False):
    """Packed calls: (lengths_q, lengths_k, heads, heads_kv, d, causal, softcap, window, dtype, cu on the CPU).
    Per head dim and causal mode: one long sequence; empty, one-row and ragged sequences with keys
    outnumbering queries in every second one (GQA); a long one beside tiny ones; a random packing
    (a fixed draw, zeros included); a softcap and a window on the ragged packing; fp16 once."""
    import random

    ragged = [0, 17, 1, 300, 0, 1000, 128, 255]
    # keys outnumber queries in every second sequence; the first has 64 keys and no query (its dK
    # and dV must come back 0)
    keys = [64] + [n + 64 * (i % 2) for i, n in enumerate(ragged)][1:]
    far = keys[:3] + [700] + keys[4:]  # window: 300 queries on the last of 700 keys leave key tiles unreached
    for d in (64, 128) if quick else (64, 128, 256):
        for causal in (False, True):
            rnd = random.Random(d * 2 + causal)
            drawn = [rnd.choice((0, rnd.randint(1, 64), rnd.randint(1, 3000))) for _ in range(10)]
            packings = [([1000], None, 4, 4), (ragged, keys, 8, 2), ([4097, 64, 3], None, 8, 2), (drawn, None, 6, 3)]
            for i, (lengths_q, lengths_k, h, h_kv) in enumerate(packings[:2] if quick else packings):
                yield lengths_q, lengths_k or lengths_q, h, h_kv, d, causal, 0.0, (-1, -1), "bfloat16", i % 2 == 1
            yield ragged, keys, 8, 2, d, causal, 5.0, (-1, -1), "bfloat16", False
            yield ragged, far, 8, 2, d, causal, 0.0, (100, 0 if causal else 300), "bfloat16", False
    yield ragged, ragged, 4, 4, 64, True, 0.0, (-1, -1), "float16", False


def run_varlen_grid(names, quick: bool, out, backward: bool = False) -> tuple:
    """The packed grid's cases through ``attention_varlen`` (harness.check.check_varlen_case), or
    with ``backward`` through ``attention_varlen_backward`` (check_varlen_backward_case)."""
    from harness.check import check_varlen_backward_case, check_varlen_case

    rows, failures = [], 0
    print("packed backward grid: each sequence's dq, dk, dv within twice the max error of a 16-bit backward of that "
          "sequence (SDPA's; softcap: capped_grads_16bit's flash backward) + 1e-3 of float64 autograd; NaN-poisoned"
          if backward else
          "packed grid (attention_varlen): O within twice the max error of SDPA's own 16-bit output, sequence by "
          "sequence (softcap: the elementwise bound), of the float64 reference; LSE within 1e-4; outputs NaN-poisoned")
    check = check_varlen_backward_case if backward else check_varlen_case
    for name in names:
        for lengths_q, lengths_k, h, h_kv, d, causal, softcap, window, dtype, on_cpu in varlen_cases(quick):
            try:
                row = check(name, lengths_q, lengths_k, h, h_kv, d, causal, softcap, window, dtype, on_cpu)
            except Exception as e:  # a crash is a failure of this case
                row = dict(kernel=name, lengths_q=lengths_q, lengths_k=lengths_k, head_dim=d, causal=int(causal),
                           softcap=softcap, window=list(window), dtype=dtype, ok=False, status="crashed",
                           max_abs=None, peer_max_abs=None, lse_max_abs=None, reason=f"{type(e).__name__}: {e}"[:300],
                           **({"backward": True} if backward else {}))
            rows.append(row)
            failures += not row["ok"]
            if out:
                out.append(row)
            case = f"{name} {dtype} d={d} causal={int(causal)} heads {h}/{h_kv} q {lengths_q} k {lengths_k}"
            case += (f" softcap {softcap:g}" if softcap else "") + (f" window {window}" if window != (-1, -1) else "")
            errors = (" ".join(f"{g} {row[g + '_max_abs']:.2e}/{row[g + '_sdpa_max_abs']:.2e}"
                               for g in ("dq", "dk", "dv") if row.get(g + "_max_abs") is not None) if backward
                      else f"{_e(row['max_abs'])}{_e(row['peer_max_abs'])}{_e(row['lse_max_abs'])}")
            print(f"{case[:110]:<110}{errors}  {'ok' if row['ok'] else 'FAIL ' + row['reason']}", flush=True)
    return rows, failures


def run_backward_grid(seqlens, out, stages, features_only: bool = False, head_dim: int = None,
                      causal: int = None) -> tuple:
    rows, failures = [], 0
    print(f"backward grid ({', '.join(stages)}; O and LSE from k6): dq, dk, dv each within twice the max error of "
          "SDPA's own 16-bit backward + 1e-3 of float64 autograd (harness/check.py check_backward), outputs NaN-poisoned")
    print(f"{'stage':<6}{'dtype':<10}{'b':>3}{'h':>6}{'seqlen':>7}{'d':>5}{'causal':>7}{'kv h/len':>11}{'x':>4}"
          f"{'dq_err':>11}{'sdpa':>11}{'dk_err':>11}{'sdpa':>11}{'dv_err':>11}{'sdpa':>11}  result")
    from harness.backward import stage_module

    for stage in stages:
        k10 = BACKWARD_VARIANTS[stage][0] == "k10"
        for p, magnitude in backward_cases(seqlens, features=k10, head_dims=stage_module(stage).HEAD_DIMS):
            if not picked(p, features_only, head_dim, causal):
                continue
            row = backward_row(stage, p, magnitude)
            rows.append(row)
            failures += not row["ok"]
            if out:
                out.append(row)
            errs = "".join(_e(row.get(f"{g}{sfx}")) for g in ("dq", "dk", "dv") for sfx in ("_max_abs", "_sdpa_max_abs"))
            print(f"{stage:<6}{p.dtype:<10}{p.batch:>3}{p.nheads:>6}{p.seqlen:>7}{p.head_dim:>5}{int(p.causal):>7}"
                  f"{f'{p.kv_heads}/{p.kv_len}':>11}{magnitude:>4g}"
                  f"{errs}  {'ok' if row['ok'] else 'FAIL ' + row['reason']}", flush=True)
    return rows, failures


def backward_row(stage, p, magnitude) -> dict:
    from harness.check import backward_case, check_backward

    try:
        return check_backward(p, magnitude=magnitude, backward=stage)
    except Exception as e:  # a crash is a failure of this case
        return dict(backward_case(p, magnitude, backward=stage), ok=False, status="crashed",
                    reason=f"{type(e).__name__}: {e}"[:300])


def has_feature(p: Problem) -> bool:
    return bool(p.softcap) or p.window != (-1, -1)


def no_case(args, names) -> int:
    """The error of --headdim/--causal filters that leave no case of the grid: exit status 2."""
    chosen = "".join(f" {name} {value}" for name, value in (("head_dim", args.headdim), ("causal", args.causal))
                     if value is not None)
    print(f"error: no case of the {'backward ' * args.backward}grid has{chosen} for {', '.join(names)}",
          file=sys.stderr)
    return 2


def picked(p: Problem, features_only: bool, head_dim: int = None, causal: int = None) -> bool:
    """Whether a grid case passes the --features, --headdim and --causal filters."""
    return (has_feature(p) or not features_only) and head_dim in (None, p.head_dim) and causal in (None, int(p.causal))


def describe_grid(seqlens, all_head_dims: bool) -> str:
    dims = "every head dim it supports" if all_head_dims else f"the head dims it supports among {HEAD_DIMS}"
    return (f"grid per kernel: {dims} x causal 0/1 x seqlen {', '.join(map(str, seqlens))}, batch 2 x heads 3, "
            "bf16; plus fp16 at seqlen 1000 (batch 1 x heads 4), batch 8 x heads 1024 at seqlen 80 and softmax_scale "
            "0.3 at seqlen 1000; kernels that "
            f"take them: GQA (heads q/kv {', '.join(f'{a}/{b}' for a, b in GQA_HEADS)}) at seqlen 1000, and "
            f"(seqlen_q, seqlen_k) in {', '.join(map(str, UNEQUAL_LENGTHS))} with 4/2 heads, causal bottom-right")


def job_units(names, seqlens, args) -> list:
    """``--jobs``' units of work: (label, ref_check.py arguments), the caller's grid options passed
    on: for the forward grid a kernel and head dim each; for the backward grid (slower by far: a
    float64 autograd reference a case) a stage, head dim and causal mode each. Only units with a
    case after the filters."""
    options = (["--quick"] * args.quick + ["--all-head-dims"] * args.all_head_dims + ["--features"] * args.features
               + (["--config", json.dumps(args.config)] if args.config is not None else []))
    causal = [] if args.causal is None else ["--causal", str(args.causal)]
    units = []
    for name in names:
        if args.backward:
            from harness.backward import stage_module

            grid = [p for p, _ in backward_cases(seqlens, features=BACKWARD_VARIANTS[name][0] == "k10",
                                                 head_dims=stage_module(name).HEAD_DIMS)]
        else:
            grid = list(cases(name, seqlens, args.all_head_dims))
        grid = [p for p in grid if picked(p, args.features, args.headdim, args.causal)]
        for d in sorted({p.head_dim for p in grid}):
            if not args.backward:
                units.append((f"{name}-d{d}", [name, *options, "--headdim", str(d), *causal]))
                continue
            for c in sorted({int(p.causal) for p in grid if p.head_dim == d}):
                units.append((f"{name}-d{d}-c{c}",
                              ["--backward", name, *options, "--headdim", str(d), "--causal", str(c)]))
    return units


def run_jobs(units, jobs: int, gpus: int, out, script: str = __file__) -> int:
    """``--jobs``: ``script <arguments> --out ...`` (this file) for each unit (label, arguments), up
    to ``jobs`` at once, each on the visible GPU with the fewest running. Each writes its rows and log into
    ``<out>.parts/`` as it goes; ``out`` gets them all, in the units' order, every few seconds and at
    the end (the parts are then removed, unless a unit did not finish). Exit 1 if a case failed or
    a process ended without finishing its cases."""
    import shutil
    import signal
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    from harness import results

    parts = Path(f"{out.path}.parts") if out else Path(tempfile.mkdtemp(prefix="ref_check."))
    parts.mkdir(parents=True, exist_ok=True)
    names, waiting, running, finished = [label for label, _ in units], list(units), {}, True
    for stale in parts.glob("*"):  # a run before this one, stopped part way: its parts are not this run's
        stale.unlink()
    # the GPUs this process sees, by the names a child's CUDA_VISIBLE_DEVICES takes
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(gpus)))).split(",")[:max(gpus, 1)]

    def part(name):
        try:
            return results.parse((parts / f"{name}.json").read_text())
        except (OSError, ValueError):  # not started yet
            return None

    def merged():
        return [r for name in names for r in (part(name) or {"rows": []})["rows"]]

    def flush():  # --out with every row the units have written so far
        if out:
            out.rows[:] = merged()
            out.save()

    def stop(*_):  # a timeout's SIGTERM: the children stop too, and --out keeps what they wrote
        raise SystemExit(124)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                name, unit_args = waiting.pop(0)
                gpu = min(visible, key=lambda g: sum(g == on for _, _, on in running.values()))
                log = open(parts / f"{name}.log", "w")
                cmd = [sys.executable, os.path.abspath(script), *unit_args, "--out", str(parts / f"{name}.json")]
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu))
                running[name] = (proc, log, gpu)
            time.sleep(2)
            for name, (proc, log, _) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[name]
                done = proc.returncode in (0, 1) and (part(name) or {"meta": {}})["meta"].get("complete")
                finished &= bool(done)
                last = (parts / f"{name}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
                print(f"{name}: exit {proc.returncode}, {last[0] if done else 'did not finish'}", flush=True)
            flush()
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc, log, _ in running.values():
            proc.terminate()
            proc.wait()
            log.close()
        if running:
            flush()
    rows = merged()
    failures = [r for r in rows if not r["ok"]]
    for r in failures:
        print(f"FAIL {r['kernel']} {r['dtype']} b={r['batch']} h={r['nheads']} n={r['seqlen']} d={r['head_dim']} "
              f"causal={int(r['causal'])}: {r['reason']}")
    if out and finished:
        out.close()
    if finished:
        shutil.rmtree(parts)
    print(f"\n{len(rows) - len(failures)}/{len(rows)} cases passed" + (f", {len(failures)} FAILED" if failures else "")
          + ("" if finished else f"; a unit did not finish (logs in {parts})"))
    return 0 if finished and not failures else 1


def _e(x) -> str:
    return f"{x:>11.2e}" if x is not None else f"{'—':>11}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="*", default=["all"])
    ap.add_argument("--quick", action="store_true",
                    help=f"seqlens {QUICK_SEQLENS} only; with --decode, one case per behaviour")
    ap.add_argument("--all-head-dims", action="store_true")
    ap.add_argument("--out", help="write the per-case rows as JSON here, each as it is done")
    ap.add_argument("--decode", action="store_true", help="the KV-cache grid of the decode kernels instead")
    ap.add_argument("--backward", action="store_true",
                    help="the backward's grid against float64 autograd instead, for the backward stages named "
                         f"(default {', '.join(MAIN_STAGES)}; any of {', '.join(BACKWARD_STAGES)})")
    ap.add_argument("--varlen", action="store_true",
                    help="the packed-sequence grid (attention_varlen) of the kernels named (default k6)")
    ap.add_argument("--features", action="store_true",
                    help="only the cases with a softcap or a window (the grids' other cases unchanged)")
    ap.add_argument("--headdim", type=int, default=None,
                    help="only the cases at this head dim (the forward and --backward grids; e.g. K10's d = 256)")
    ap.add_argument("--config", type=json.loads, default=None,
                    help="compile_kernel keywords for every case, as JSON (e.g. '{\"tile_n\": 128}'): check a "
                         "configuration before timing it; cases it cannot run are failures")
    ap.add_argument("--causal", type=int, choices=(0, 1), default=None,
                    help="only the cases with this causal mode (the forward and --backward grids)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="the forward and --backward grids: check them in up to this many processes at once (a "
                         "kernel and head dim each; a backward stage, head dim and causal mode each), handed to the "
                         "visible GPUs in turn, their rows merged into --out")
    args = ap.parse_args(argv)
    # The grid is fixed: a workload variable meant for bench.py would be silently ignored here.
    ignored = [f"{var}={os.environ[var]}" for var in KNOBS.values() if var in os.environ]
    if ignored:
        print(f"error: ref_check runs its own grid and would ignore {', '.join(ignored)}: unset them, or check "
              "one workload with `CHECK=1 python bench.py`", file=sys.stderr)
        return 2
    if args.decode + args.backward + args.varlen > 1 and not (args.varlen and args.backward and not args.decode):
        print("error: --decode, --backward and --varlen are three grids: name one (or --varlen --backward, the "
              "packed backward's)", file=sys.stderr)
        return 2
    if args.features and args.varlen:
        print("error: --features picks cases of the forward, --backward and --decode grids", file=sys.stderr)
        return 2
    if args.jobs < 1 or (args.jobs > 1 and (args.decode or args.varlen)):
        print("error: --jobs takes a count of 1 or more, and splits the forward and --backward grids only",
              file=sys.stderr)
        return 2
    if (args.headdim is not None or args.causal is not None) and (args.decode or args.varlen):
        print("error: --headdim and --causal pick cases of the forward and --backward grids", file=sys.stderr)
        return 2
    stages = list(MAIN_STAGES) if args.kernels in ([], ["all"]) else args.kernels
    unknown = [n for n in stages if n not in BACKWARD_STAGES]
    if args.backward and unknown:
        print(f"error: --backward checks the backward stages {list(BACKWARD_STAGES)}, not {unknown}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("ref_check needs a CUDA GPU (H100/H200); without one, `pytest` compiles every kernel for sm_90a.",
              file=sys.stderr)
        return 2
    from harness import results
    from harness.check import CheckResult, check_kernel

    names = kernel_names() if args.kernels in ([], ["all"]) else args.kernels
    seqlens = QUICK_SEQLENS if args.quick else SEQLENS
    out = results.open_result_file(args.out, results.command_line("ref_check.py", argv))
    print(f"device: {torch.cuda.get_device_name()}")
    if args.jobs > 1:
        try:
            units = job_units(stages if args.backward else names, seqlens, args)
        except UnsupportedProblem as e:  # a kernel with no grid
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not units:
            return no_case(args, stages if args.backward else names)
        return run_jobs(units, args.jobs, torch.cuda.device_count(), out)
    if args.varlen and args.backward:
        rows, failures = run_varlen_grid(["k10_fa3"] if args.kernels in ([], ["all"]) else stages, args.quick, out,
                                         backward=True)
    elif args.varlen:
        rows, failures = run_varlen_grid(["k6"] if args.kernels in ([], ["all"]) else args.kernels, args.quick, out)
    elif args.decode or args.backward:
        rows, failures = (run_decode(args.quick, out, args.features) if args.decode
                          else run_backward_grid(seqlens, out, stages, args.features, args.headdim, args.causal))
    if args.backward and (args.headdim, args.causal) != (None, None) and not rows:
        return no_case(args, stages)
    if args.decode or args.backward or args.varlen:
        if out:
            out.close()
        print(f"\n{len(rows) - failures}/{len(rows)} cases passed" + (f", {failures} FAILED" if failures else ""))
        return 1 if failures else 0
    rows, failures = [], 0
    print(describe_grid(seqlens, args.all_head_dims))
    print(f"{'kernel':<8}{'dtype':<10}{'b':>3}{'h':>5}{'seqlen':>7}{'d':>5}{'causal':>7}{'kv h/len':>11}"
          f"{'max_abs':>11}{'sdpa_err':>11}{'rel_l2':>11}{'lse_err':>11}  result")
    for name in names:
        try:
            grid = list(cases(name, seqlens, args.all_head_dims))
        except UnsupportedProblem as e:
            print(f"{name}: {e}")
            failures += 1
            continue
        for p in grid:
            if not picked(p, args.features, args.headdim, args.causal):
                continue
            try:
                res = check_kernel(name, p, config=args.config)
                row = dict(res.row(), status="ok" if res.ok else "failed")
            except Exception as e:  # a crash is a failure of this case, not of the whole grid
                row = dict(CheckResult(name, p, None, None, None, False, f"{type(e).__name__}: {e}"[:200], None).row(),
                           status="crashed")
            rows.append(row)
            if out:
                out.append(row)
            failures += not row["ok"]
            print(f"{name:<8}{p.dtype:<10}{p.batch:>3}{p.nheads:>5}{p.seqlen:>7}{p.head_dim:>5}{int(p.causal):>7}"
                  f"{f'{p.kv_heads}/{p.kv_len}':>11}{_e(row['max_abs'])}{_e(row['peer_max_abs'])}{_e(row['rel_l2'])}{_e(row['lse_max_abs'])}  "
                  f"{'ok' if row['ok'] else 'FAIL ' + row['reason']}", flush=True)
    if out:
        out.close()
    if (args.headdim, args.causal) != (None, None) and not rows:
        return no_case(args, names)
    print(f"\n{len(rows) - failures}/{len(rows)} cases passed" + (f", {failures} FAILED" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
