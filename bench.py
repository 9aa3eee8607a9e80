"""Time a kernel stage beside its peers.

    python bench.py k2                     # one kernel on the configured workload
    CHECK=1 SEQLEN=512 HEADDIM=64 python bench.py k1
    python bench.py all --out results/bench.json
    python bench.py --sweep --out results/sweep.json k2 k4
    python bench.py k4 --compile-only      # no GPU needed: compile for sm_90a and inspect
    python bench.py k6 --softcap 30 --causal 1   # a logit softcap, beside flash-attn-4 with the same cap
    python bench.py k6 --window 1024,0 --seqlen 16384   # a sliding window, beside flash-attn-4's
    python bench.py --decode --out results/decode.json   # decode over a KV cache, TB/s, graph-timed
    python bench.py --decode --batch 1 --nheads-kv 8      # part of the decode grid
    python bench.py --decode --splits-curve               # decode: TB/s against the split count
    python bench.py --decode --pages-curve                # decode on a paged cache: TB/s against the page size

Workload: SEQLEN, HEADDIM, CAUSAL, BATCH, NHEADS, DTYPE (env) or the equivalent flags (a flag
wins). CHECK=1 (or --check) runs the correctness check on the same shape first and stops on
failure. With --out, the result file is rewritten after every row: an interrupted run keeps
what it did. With --sweep and the peers, a summary of each kernel against the faster peer of
each cell ends the run.
"""

from __future__ import annotations

import argparse
import os
import sys

from harness.api import fp8_inputs
from harness.config import (DEFAULTS, SWEEP_HEAD_DIMS, SWEEP_SEQLENS, parse_bool, parse_window, problem_from,
                            sweep_problems)
from harness.peers import BEST_OF, BEST_OF_FP8, best_peer
from kernels import get_kernel, kernel_names
from kernels.contract import FP8_DTYPES, UnsupportedProblem, as_softcap, as_window


def decode_grid_text() -> str:
    from harness.decode_bench import GRID, HEAD_DIM, NHEADS, Q_LEN

    axes = ["/".join(str(v) for v in sorted({r[i] for r in GRID})) for i in range(3)]
    return (f"batch {axes[0]} x kv_len {axes[1]} x K/V heads {axes[2]} ({len(GRID)} rows), {NHEADS} query heads,\n"
            f"  d {HEAD_DIM}, q_len {Q_LEN}, bf16; --batch/--seqlen-k/--nheads-kv restrict it to their value.")


def parse_args(argv=None):
    kernels = "\n".join(f"  {n:<8} {get_kernel(n).title}" for n in kernel_names())
    epilog = (f"kernels:\n{kernels}\n\nworkload defaults: seqlen {DEFAULTS['seqlen']}, head dim {DEFAULTS['headdim']}, "
              f"causal {int(DEFAULTS['causal'])}, dtype {DEFAULTS['dtype']};\n"
              "  batch = 16384/seqlen and heads = 2048/head dim unless given.\n"
              f"sweep: head dim {'/'.join(map(str, SWEEP_HEAD_DIMS))} x causal 0/1 x seqlen "
              f"{'/'.join(map(str, SWEEP_SEQLENS))};\n"
              "  --seqlen/--headdim/--causal/--dtype restrict it to their value.\n"
              f"decode: {decode_grid_text()}")
    ap = argparse.ArgumentParser(description=__doc__, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="*", help="kernel names, or 'all' (default: all)")
    ap.add_argument("--seqlen", type=int, help="(SEQLEN)")
    ap.add_argument("--headdim", type=int, help="(HEADDIM)")
    ap.add_argument("--causal", type=int, choices=(0, 1), help="(CAUSAL)")
    ap.add_argument("--softcap", type=float, help="a logit softcap c > 0 (scores -> c*tanh(s/c)); the peers: "
                    "flash-attn-4 with the same cap (SDPA has none)")
    ap.add_argument("--window", help="a sliding window LEFT,RIGHT (-1: unbounded; causal: RIGHT is 0), e.g. 1024,0; "
                    "TFLOP/s on the pairs it keeps; the peers: flash-attn-4 with the same window")
    ap.add_argument("--batch", type=int, help="(BATCH; not with --sweep)")
    ap.add_argument("--nheads", type=int, help="(NHEADS; not with --sweep)")
    ap.add_argument("--dtype", help="bf16, fp16 or fp8 (DTYPE); fp8: e4m3 inputs (per-tensor descales; k8 "
                    "its own per-block ones), beside cuDNN's FP8 attention, on d 128/256 x N 2k-16k with --sweep")
    ap.add_argument("--check", action="store_true", help="check against SDPA first (same as CHECK=1)")
    ap.add_argument("--sweep", action="store_true", help="time the sweep grid (below), not one workload")
    ap.add_argument("--no-peers", action="store_true", help="skip SDPA / flash-attn-4")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a and report; no GPU needed")
    ap.add_argument("--out", help="write the rows as JSON here, each as it is done")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every candidate of a workload this many times, in alternating order, and report "
                         "the median (default 1)")
    ap.add_argument("--decode", action="store_true",
                    help="decode mode (harness/decode_bench.py): q_len 1, 32 query heads, d 128 over KV caches of "
                         "batch 1/8/64 x 4k/32k/128k keys x 8/32 K/V heads, the split-count curve and host times; "
                         "--batch, --seqlen-k, --nheads-kv, --headdim restrict it")
    ap.add_argument("--seqlen-k", type=int, help="decode: restrict the grid to this cache length; "
                    "--compile-only: K/V's length")
    ap.add_argument("--nheads-kv", type=int, help="decode: restrict the grid to this many K/V heads; "
                    "--compile-only: K/V's heads")
    ap.add_argument("--q-len", type=int, help="decode: query rows per sequence (default 1; 2-8 for speculative steps)")
    ap.add_argument("--num-splits", type=int, help="decode: force the kernels' split count in the grid "
                    "(default 0: the heuristic's)")
    ap.add_argument("--grid-only", action="store_true", help="decode: skip the split curve and the host times")
    ap.add_argument("--splits-curve", action="store_true",
                    help="decode: only TB/s against the split count, at batch 1, 32k keys, 8 K/V heads "
                         "unless --batch/--seqlen-k/--nheads-kv say otherwise")
    ap.add_argument("--host-times", action="store_true",
                    help="only the host time per call, at a shape whose kernels take microseconds: each public "
                         "call beside SDPA's and flash-attn-4's (harness/host_times.py); with --decode the KV-cache "
                         "calls (the one call, the plan, the peers')")
    ap.add_argument("--varlen", action="store_true",
                    help="a packed batch (16 documents of 64..16k tokens, log-uniform, fixed seed; --headdim, "
                         "--causal, --nheads) through attention_varlen beside flash-attn-4's varlen call and cuDNN "
                         "on the padded batch; TFLOP/s on the real, unpadded work (harness/varlen_bench.py)")
    ap.add_argument("--backward", action="store_true",
                    help="the backward (k9, k10 or those named) beside cuDNN's and flash-attn-4's autograd backward "
                         "(harness/backward_bench.py): one workload (--seqlen, --headdim, --causal, --batch, "
                         "--nheads), or with --sweep d 64/128/256 x causal 0/1 x N 1k/4k/16k")
    ap.add_argument("--pages-curve", action="store_true",
                    help="decode: only TB/s on a paged cache against the page size (pages shuffled), at batch 1 "
                         "and 8, 32k keys, 8 K/V heads unless --batch/--seqlen-k/--nheads-kv say otherwise")
    return ap.parse_args(argv)


def resolve_kernels(names):
    if not names or names == ["all"]:
        return kernel_names()
    for n in names:
        get_kernel(n)  # raises with the list of known kernels
    return names


def compile_only(names, problems, out) -> int:
    """Compile each kernel for each distinct compile-time key among ``problems``; 1 when none compiled."""
    from kernels.contract import ensure_arch

    from harness.inspect_ptx import count_instructions, ptxas_report

    ensure_arch()
    keys = {(p.head_dim, p.dtype, p.causal): p for p in problems}  # batch, heads, seqlen are symbolic
    compiled_any = False
    for problem in keys.values():
        print(f"compile-only (sm_90a): head_dim={problem.head_dim} dtype={problem.dtype} causal={int(problem.causal)}")
        base = dict(head_dim=problem.head_dim, dtype=problem.dtype, causal=int(problem.causal))
        for name in names:
            try:
                compiled = get_kernel(name).compile(problem, keep_ptx=True)
            except UnsupportedProblem as e:
                print(f"{name}: refused: {e}")
                if out:
                    out.append(dict(base, kernel=name, status=f"refused: {e}"))
                continue
            compiled_any = True
            ptx = compiled.ptx or ""
            counts = count_instructions(ptx)
            report = [dict(entry=kern, registers=regs, spill_bytes=spill) for kern, regs, _smem, spill in ptxas_report(ptx)]
            print(f"{name}: PTX {len(ptx)} chars; " + ", ".join(f"{k}={v}" for k, v in counts.items() if v))
            if compiled.info:
                print(f"    config: {compiled.info}")
            for r in report:
                print(f"    {r['entry'][:60]}: registers={r['registers']} spill_bytes={r['spill_bytes']}")
            if out:
                out.append(dict(base, kernel=name, status="ok", ptx_chars=len(ptx), instructions=counts,
                                config=compiled.info, ptxas=report or None))
    if not compiled_any:
        print("error: no kernel compiled for this workload (every one refused it)", file=sys.stderr)
    return 0 if compiled_any else 1


def time_one(name, problem, q, k, v, state=None, **run_kw):
    """(ms, status, launch) for kernel ``name``: compile outside timing, then time launches only;
    ``launch`` times again in later rounds. ``state``: a dict for the GPU's clock and power over the
    timing. ``run_kw``: FP8's ``descale``."""
    import torch

    from harness.api import compiled_for
    from harness.inputs import poisoned_outputs
    from harness.timing import benchmark

    entry = get_kernel(name)
    try:  # compiling checks the capabilities and the GPU first
        compiled = compiled_for(name, problem)
    except UnsupportedProblem as e:
        return None, f"refused: {e}", None
    out, lse = poisoned_outputs(problem)

    def launch():
        entry.run(compiled, q, k, v, out, lse, problem.scale, **run_kw)

    ms = benchmark(launch, state=state)
    # The outputs started as NaN: a launch that silently did nothing must not be reported as fast.
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        return None, "failed: the timed launches left outputs unwritten or non-finite", None
    return ms, "ok", launch


def time_call(call, state=None) -> tuple:
    """(ms, status) of a public call, burst-timed (``timing.burst_ms``): back to back, eager, as a
    model calls it. Its last output must be finite."""
    import torch

    from harness.timing import burst_ms

    ms = burst_ms(call, state=state)
    out = call()
    out = out[0] if isinstance(out, tuple) else out
    if not torch.isfinite(out).all():
        return None, "failed: the public call's output is not finite"
    return ms, "ok"


def public_call(name, problem, q, k, v, **descales):
    """What a user calls: ``attention(name, ...)`` on the same tensors (e4m3 ones with their descales)."""
    from harness import attention
    from harness.peers import feature_options

    features = feature_options(problem.softcap, problem.window)
    return lambda: attention(name, q, k, v, causal=problem.causal, softmax_scale=problem.scale, **features, **descales)


def kernel_row(name, problem, check: bool, sweep: bool, q, k, v, descales=None, **run_kw) -> dict:
    """A kernel's row: the kernel alone (``ms``, per-launch events on the compiled launch) and the
    public call (``call_ms``, burst-timed), each with its TFLOP/s."""
    from harness.check import check_kernel
    from harness.timing import tflops

    caps = get_kernel(name).caps
    try:
        caps.check(problem)
    except UnsupportedProblem as e:  # a head dim the kernel lacks, say: a note in the table
        return dict(ms=None, tflops=None, status=f"{'skipped' if sweep else 'refused'}: {e}")
    if sweep and caps.sweep_max_seqlen and problem.seqlen > caps.sweep_max_seqlen:
        return dict(ms=None, tflops=None, status="skipped: too slow for the sweep")
    if check:
        try:  # FP8: the check quantizes fresh 16-bit inputs itself, through the same kernel
            res = check_kernel(name, problem.with_(dtype="bfloat16") if problem.dtype in FP8_DTYPES else problem)
        except UnsupportedProblem as e:
            return dict(ms=None, tflops=None, status=f"refused: {e}")
        print(f"CHECK {name}: max_abs={res.max_abs:.3g} rel_l2={res.rel_l2:.3g} lse={res.lse_max_abs:.3g} "
              f"{'PASS' if res.ok else 'FAIL: ' + res.reason}")
        if not res.ok:
            raise SystemExit(f"correctness check failed for {name}; not timing it")
    state, call_state = {}, {}
    ms, status, launch = time_one(name, problem, q, k, v, state=state, **run_kw)
    if ms is None:
        return dict(ms=None, tflops=None, status=status)
    call = public_call(name, problem, q, k, v, **(descales or {}))
    call_ms, status = time_call(call, state=call_state)
    return dict(ms=ms, tflops=tflops(problem.flops, ms), call_ms=call_ms,
                call_tflops=tflops(problem.flops, call_ms) if call_ms else None, status=status,
                launch=launch, call=call, states=[state], call_states=[call_state])


def run_problem(names, problem, check: bool, peers: bool, sweep: bool, emit, rounds: int = 1) -> None:
    """Time the peers, then each kernel beside them; ``emit`` takes each row as it is done.

    Every candidate is timed twice: alone (``ms``: a peer's call, or a kernel's compiled launch,
    each between its own events) and as a user calls it (``call_ms``: the public call back to back,
    burst-timed; a peer's public call is the same call). ``vs_best_peer`` is the public call's
    ratio to the faster peer's, ``kernel_vs_best_peer`` the kernel alone's to the faster peer's.
    With ``rounds`` > 1 every timing is repeated that many times, the order reversed each round
    (so none is always first or last as the GPU warms), and a row reports the medians of its
    rounds (``ms_rounds`` and ``call_ms_rounds`` keep them all); its rows are emitted when the
    workload is done.
    """
    from harness.inputs import random_inputs
    from harness.peers import peer_callables
    from harness.timing import benchmark, burst_ms, gpu_fields, more_rounds, tflops

    base = dict(batch=problem.batch, nheads=problem.nheads, seqlen=problem.seqlen, head_dim=problem.head_dim,
                causal=int(problem.causal), dtype=problem.dtype, **({"softcap": problem.softcap} if problem.softcap else {}),
                **({"window": list(problem.window)} if problem.window != (-1, -1) else {}))
    fp8 = problem.dtype in FP8_DTYPES
    q, k, v = random_inputs(problem.with_(dtype="bfloat16") if fp8 else problem)
    sources = (q, k, v)
    candidates, run_kw, descales, best_of = {}, {}, {}, BEST_OF
    if peers:
        candidates = peer_callables(q, k, v, problem.causal, problem.scale, problem.softcap, problem.window)
    if fp8:  # the kernels and cuDNN FP8 take the e4m3 tensors; the bf16 peers their sources, for scale
        from harness.peers import cudnn_fp8_peer

        q, k, v, descales, three = fp8_inputs(q, k, v)
        run_kw, best_of = dict(descale=three), BEST_OF_FP8
        if peers:
            candidates["cudnn-fp8"] = cudnn_fp8_peer(q, k, v, run_kw["descale"], problem.causal, problem.scale)
    rows, timed = [], {}  # the first round's rows, in order; name -> (launch, call) for later rounds

    def finish(row):  # TFLOP/s, GPU state and the ratios to the best peer, then out
        for key in ("", "call_"):
            row[f"{key}tflops"] = tflops(problem.flops, row[f"{key}ms"]) if row.get(f"{key}ms") else None
        if row["kernel"] not in candidates:
            for key, field in (("call_", "vs_best_peer"), ("", "kernel_vs_best_peer")):
                best = best_peer(peer_rate(key), best_of)
                if best and row.get(f"{key}tflops"):
                    row.update({field: row[f"{key}tflops"] / best[1]})
                    if key:
                        row["best_peer"] = best[0]
        row.update(gpu_fields(row.pop("states", [])))
        call_state = gpu_fields(row.pop("call_states", []))
        if call_state:
            row["call_sm_clock_mhz"] = call_state["sm_clock_mhz"]
        emit(row)

    def peer_rate(key):
        return {r["kernel"]: tflops(problem.flops, r[f"{key}ms"]) for r in rows
                if r["kernel"] in candidates and r.get(f"{key}ms")}

    for name, fn in candidates.items():
        if callable(fn):
            state, call_state = {}, {}
            rows.append(dict(base, kernel=name, ms=benchmark(fn, state=state), call_ms=burst_ms(fn, state=call_state),
                             status="ok", states=[state], call_states=[call_state]))
            timed[name] = (fn, fn)
        else:
            rows.append(dict(base, kernel=name, ms=None, tflops=None, status=fn))
        if rounds == 1:
            finish(rows[-1])
    for name in names:
        if fp8 and get_kernel(name).block_descales:
            # K8 gets the same sources quantized its own way (rotation, a scale per tile): e4m3 in,
            # V^T in the time, as K7 and cuDNN FP8.
            q8, k8, v8, blocks, rows = fp8_inputs(*sources, blocks=True)
            row = dict(base, kernel=name, **kernel_row(name, problem, check, sweep, q8, k8, v8, descales=blocks,
                                                       descale=rows))
        else:
            row = dict(base, kernel=name, **kernel_row(name, problem, check, sweep, q, k, v, descales, **run_kw))
        launch, call = row.pop("launch", None), row.pop("call", None)
        if launch is not None:
            timed[name] = (launch, call)
        rows.append(row)
        if rounds == 1:
            finish(row)
    if rounds == 1:
        return
    import statistics

    done = [r for r in rows if r["kernel"] in timed and r.get("call_ms")]
    fns = [timed[r["kernel"]][i] for r in done for i in (0, 1)]
    firsts = [r[key] for r in done for key in ("ms", "call_ms")]
    states = [r[key] for r in done for key in ("states", "call_states")]
    all_ms = more_rounds(fns, firsts, rounds, states, timers=[benchmark, burst_ms] * len(done))
    for i, r in enumerate(done):
        r.update(ms=statistics.median(all_ms[2 * i]), ms_rounds=all_ms[2 * i],
                 call_ms=statistics.median(all_ms[2 * i + 1]), call_ms_rounds=all_ms[2 * i + 1])
    for r in rows:
        finish(r)


def print_row(r) -> None:
    if r["ms"] is None:
        print(f"{r['kernel']:<11}{r['status']}")
    else:
        call = f"{r['call_tflops']:>10.1f}" if r.get("call_tflops") else f"{'—':>10}"
        vs = f"{r['vs_best_peer']:>8.3f}x ({r['best_peer']})" if r.get("vs_best_peer") else ""
        kvs = f"  kernel {r['kernel_vs_best_peer']:.3f}x" if r.get("kernel_vs_best_peer") else ""
        clock = f"  [{r['sm_clock_mhz']:.0f} MHz, {r['power_w']:.0f} W]" if r.get("sm_clock_mhz") else ""
        print(f"{r['kernel']:<11}{r['ms']:>10.3f}{r['tflops']:>10.1f}{call}{vs}{kvs}{clock}", flush=True)


DECODE_ONLY = ("q_len", "num_splits", "grid_only", "splits_curve", "pages_curve")


def flags_given(args, dests) -> list:
    """The command-line flags (as typed: --compile-only) of the argparse destinations that were set."""
    return [f"--{d.replace('_', '-')}" for d in dests if getattr(args, d) not in (None, False)]


def decode_refusal(args):
    """Why ``--decode`` cannot run with these flags (a message), or None. It times its own grid, so
    the prefill workload (flags or environment) would be ignored: refused instead, as ref_check does."""
    from harness.config import KNOBS

    other = flags_given(args, ("seqlen", "causal", "nheads", "dtype", "sweep", "compile_only", "check", "softcap", "varlen"))
    if other or args.kernels:
        return (f"--decode times its own grid (harness/decode_bench.py); it takes --batch, --seqlen-k, --nheads-kv, "
                f"--headdim, --q-len, --num-splits, --no-peers, --grid-only, --splits-curve, --host-times, "
                f"--pages-curve, --window and --out, not {', '.join(other) or ' '.join(args.kernels)}")
    if args.window:
        try:
            left, _ = as_window(parse_window(args.window))
        except UnsupportedProblem as e:
            return str(e)
        if left < 0:
            return "--decode --window LEFT,RIGHT needs LEFT >= 0 (a window with no left edge reads the whole cache)"
        if args.grid_only or args.splits_curve or args.host_times or args.pages_curve:
            return "--decode --window runs only the window's row: not with --grid-only, the curves or --host-times"
    ignored = [f"{var}={os.environ[var]}" for var in (*KNOBS.values(), "CHECK") if var in os.environ]
    if ignored:
        return f"--decode would ignore {', '.join(ignored)}: unset it (--batch, --headdim, ... restrict the grid)"
    for flag in ("batch", "seqlen_k", "nheads_kv", "q_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be positive"
    head_dims = get_kernel("decode").caps.head_dims
    if args.headdim is not None and args.headdim not in head_dims:
        return f"--headdim must be one of {head_dims} for decode, got {args.headdim}"
    if args.num_splits is not None and not 0 <= args.num_splits <= 128:
        return f"--num-splits must be in [0, 128] (0: the heuristic), got {args.num_splits}"
    if args.splits_curve and (args.grid_only or args.num_splits is not None):
        return "--splits-curve runs only the split curve (every split count): not with --grid-only or --num-splits"
    if args.pages_curve and (args.grid_only or args.splits_curve or args.host_times or args.num_splits is not None):
        return ("--pages-curve runs only the page-size curve: not with --grid-only, --splits-curve, --host-times or "
                "--num-splits")
    if args.host_times and (args.grid_only or args.splits_curve or args.num_splits is not None
                            or any(getattr(args, f) is not None for f in ("batch", "seqlen_k", "nheads_kv"))):
        return ("--host-times runs only the host times, at their two shapes: not with --grid-only, --splits-curve, "
                "--num-splits, --batch, --seqlen-k or --nheads-kv")
    return None


def print_decode_row(row) -> None:
    value = (f"{row['tbps']:.2f} TB/s, {row['ms'] * 1e3:.1f} us" if row.get("tbps")
             else f"host {row['host_us']:.1f} us, per call {row['call_us']:.1f} us" if row.get("host_us")
             else row["status"])
    shape = f"b={row['batch']} kv_len={row['seqlen_k']} kv_heads={row['nheads_kv']}"
    splits = f" S={row['num_splits']}" if row.get("num_splits") else ""
    if row.get("mode") == "pages":
        splits += f" pages={row['page_size'] or 'none'}"
    print(f"{row['mode']:<7}{shape:<34}{row['kernel']:<31}{splits:<6}{value}", flush=True)


def decode_main(args, argv) -> int:
    """``--decode``: the decode grid beside its peers, then the split curve and host times."""
    refusal = decode_refusal(args)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    from harness import decode_bench, results

    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be timed here (decode needs an H100/H200).", file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, results.command_line("bench.py", argv))
    rows = []

    def emit(row):
        rows.append(row)
        if out:
            out.append(row)
        print_decode_row(row)

    shape = dict(head_dim=args.headdim or decode_bench.HEAD_DIM, q_len=args.q_len or decode_bench.Q_LEN)
    print(f"== {torch.cuda.get_device_name()}: decode, {decode_bench.NHEADS} query heads, d={shape['head_dim']}, "
          f"q_len {shape['q_len']}, bf16")
    if args.splits_curve:
        decode_bench.run_splits(emit, batch=args.batch or 1, kv_len=args.seqlen_k or 32768,
                                nheads_kv=args.nheads_kv or 8, **shape)
    elif args.host_times:
        decode_bench.run_host(emit, **shape)
    elif args.pages_curve:
        decode_bench.run_pages(emit, batches=(args.batch,) if args.batch else (1, 8), kv_len=args.seqlen_k or 32768,
                               nheads_kv=args.nheads_kv or 8, **shape)
    elif args.window:
        decode_bench.run_window(emit, parse_window(args.window)[0], batch=args.batch or 8,
                                kv_len=args.seqlen_k or 32768, nheads_kv=args.nheads_kv or 8, **shape)
    else:
        decode_bench.run_grid(decode_bench.grid(args.batch, args.seqlen_k, args.nheads_kv), emit, not args.no_peers,
                              num_splits=args.num_splits or 0, **shape)
        if not args.grid_only:
            decode_bench.run_splits(emit, **shape)
            decode_bench.run_host(emit, **shape)
        print("\n" + decode_bench.summary(rows))
    if out:
        print(f"\nwrote {out.close()}")
    return 0


def host_times_main(args, argv) -> int:
    """``--host-times``: microseconds per call of each public call, SDPA and flash-attn-4."""
    from harness import host_times, results

    other = flags_given(args, ("seqlen", "headdim", "causal", "nheads", "batch", "dtype", "sweep", "compile_only",
                                "check", "softcap", "window", "varlen", "no_peers"))
    if args.rounds != 1:
        other.append("--rounds")
    if other or args.kernels:
        print(f"error: --host-times times its own calls at {host_times.SHAPE} (harness/host_times.py); it takes "
              f"--out alone, not {', '.join(other) or ' '.join(args.kernels)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be timed here.", file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, results.command_line("bench.py", argv))
    print(f"== {torch.cuda.get_device_name()}: host time per call at {host_times.SHAPE}, bf16")

    def emit(row):
        if out:
            out.append(row)
        value = f"host {row['host_us']:7.1f} us, per call {row['call_us']:7.1f} us" if row.get("host_us") else row["status"]
        print(f"{row['kernel']:<42}{value}", flush=True)

    host_times.run(emit)
    if out:
        print(f"\nwrote {out.close()}")
    return 0


def backward_main(args, argv) -> int:
    """``--backward``: K9 and K10 (or those named) beside the peers' backward, one workload or the sweep."""
    from harness import backward as backward_module
    from harness import backward_bench, results

    other = flags_given(args, ("dtype", "compile_only", "check", "varlen", "no_peers"))
    if args.sweep:  # the sweep keeps the work per cell: a batch or head count, flag or variable, is refused
        from harness.config import fixed_by_sweep, workload_given

        try:
            other += fixed_by_sweep(workload_given(batch=args.batch, nheads=args.nheads))
        except UnsupportedProblem as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.rounds != 1:
        other.append("--rounds")
    stages = tuple(args.kernels) or backward_bench.STAGES
    unknown = [k for k in stages if k not in backward_module.STAGES]
    if other or unknown:
        print(f"error: --backward times {' and '.join(backward_bench.STAGES)} and the peers on bf16 inputs; it takes "
              f"backward stages, --seqlen, --headdim, --causal, --batch and --nheads (one workload) or --sweep (batch "
              f"16384/N, heads 2048/d), and --out, not {', '.join(other) or ' '.join(unknown)}", file=sys.stderr)
        return 2
    try:  # a softcap or a window: ours and flash-attn-4's backward with them (cuDNN has neither)
        window = as_window(parse_window(args.window)) if args.window else (-1, -1)
        softcap = as_softcap(args.softcap) if args.softcap is not None else 0.0
    except UnsupportedProblem as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be timed here.", file=sys.stderr)
        return 2
    if args.sweep:
        dims, causals, seqlens = (backward_bench.SWEEP[k] for k in ("head_dims", "causals", "seqlens"))
    else:
        try:
            p = problem_from(seqlen=args.seqlen, headdim=args.headdim, causal=args.causal, batch=args.batch,
                             nheads=args.nheads, dtype=None)
        except UnsupportedProblem as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        dims, causals, seqlens = (p.head_dim,), (int(p.causal),), (p.seqlen,)
    out = results.open_result_file(args.out, results.command_line("bench.py", argv))
    batch_heads = None if args.sweep else (p.batch, p.nheads)
    print(f"== {torch.cuda.get_device_name()}: backward, bf16, "
          + (f"batch {p.batch}, heads {p.nheads}" if batch_heads else "batch = 16384/N, heads = 2048/d"))

    def emit(row):
        if out:
            out.append(row)
        print(backward_bench.format_row(row), flush=True)

    backward_bench.run(emit, dims, causals, seqlens, stages, softcap, window, batch_heads)
    if out:
        print(f"\nwrote {out.close()}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.decode:
        return decode_main(args, argv)
    if args.rounds < 1:
        print("error: --rounds must be >= 1", file=sys.stderr)
        return 2
    if (args.seqlen_k is not None or args.nheads_kv is not None) and not args.compile_only or \
            any(getattr(args, f) not in (None, False) for f in DECODE_ONLY):
        print("error: --seqlen-k and --nheads-kv belong to --decode and --compile-only; --q-len, --num-splits, "
              "--grid-only, --splits-curve and --pages-curve to --decode", file=sys.stderr)
        return 2
    if args.host_times:
        return host_times_main(args, argv)
    if args.backward and not args.varlen:
        return backward_main(args, argv)
    if args.varlen:
        from harness import varlen_bench

        other = flags_given(args, ("seqlen", "batch", "dtype", "sweep", "compile_only", "check", "softcap", "window",
                                   "no_peers"))
        if other:
            print(f"error: --varlen times its own packing (harness/varlen_bench.py); it takes --headdim, --causal, "
                  f"--nheads, --backward and --out, not {', '.join(other)}", file=sys.stderr)
            return 2
        return varlen_bench.main(args, argv)
    try:
        names = resolve_kernels(args.kernels)
        flags = dict(seqlen=args.seqlen, headdim=args.headdim, causal=args.causal, batch=args.batch,
                     nheads=args.nheads, dtype=args.dtype)
        problems = sweep_problems(**flags) if args.sweep else [problem_from(**flags)]
        if args.softcap:
            problems = [p.with_(softcap=args.softcap) for p in problems]
        if args.window:
            problems = [p.with_(window=as_window(parse_window(args.window))) for p in problems]
        if args.seqlen_k or args.nheads_kv:  # --compile-only: K/V's own length and heads (decode's split path)
            problems = [p.with_(seqlen_k=args.seqlen_k or p.kv_len, nheads_kv=args.nheads_kv or p.kv_heads)
                        for p in problems]
        check = args.check or parse_bool(os.environ.get("CHECK", "0"), "CHECK")
    except UnsupportedProblem as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from harness import results

    command = results.command_line("bench.py", argv)
    if args.compile_only:
        out = results.open_result_file(args.out, command)
        rc = compile_only(names, problems, out)
        if out:
            print(f"wrote {out.close()}")
        return rc
    import torch

    if not torch.cuda.is_available():
        print("No CUDA GPU is visible, so nothing can be timed here. Run on an H100/H200, or inspect the "
              f"kernels without one:\n    python bench.py {' '.join(args.kernels) or 'all'} --compile-only",
              file=sys.stderr)
        return 2
    out = results.open_result_file(args.out, command)
    device = torch.cuda.get_device_name()
    all_rows = []

    def emit(row):
        print_row(row)
        all_rows.append(row)
        if out:
            out.append(row)

    for p in problems:
        print(f"\n== {device}: batch={p.batch} heads={p.nheads} seqlen={p.seqlen} head_dim={p.head_dim} "
              f"causal={int(p.causal)} {p.dtype} ({p.flops / 1e12:.3f} TFLOP per call)")
        print(f"{'kernel':<11}{'ms':>10}{'kernel':>10}{'call':>10}  (TFLOP/s; the call vs the best peer's call)")
        run_problem(names, p, check, not args.no_peers, args.sweep, emit, args.rounds)
    if args.sweep and not args.no_peers:
        best_of = BEST_OF_FP8 if problems[0].dtype in FP8_DTYPES else BEST_OF
        print(f"\nRatio to the faster of {' and '.join(best_of)} in each cell:")
        print(results.best_peer_summary(all_rows))
    if out:
        print(f"\nwrote {out.close()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
