"""Regenerate every results table in README.md and docs/*.md (and the plot) from results/*.json.

    python scripts/make_docs.py            # tables
    python scripts/make_docs.py --plot     # tables + docs/plots/*.png (needs matplotlib: .[plot])

Result files come from commands run on the GPU machine:
    python bench.py all --sweep --out results/sweep.json
    python ref_check.py all --out results/refcheck.json
Nothing here is typed by hand: a table block <!-- table:NAME --> ... <!-- /table:NAME --> is
replaced whole each time. Each kernel's tables go to docs/<family>.md, the family being the
name's leading ``k<digits>`` (k3_2 -> k3, k4_qk -> k4), so a newly registered kernel needs no
change here. A page keeps the tables its text reads from; the long per-run ones (every checked
case, every tuning run) go to its companion docs/<family>-runs.md: a block is filled in whichever
of the two holds its marker (``fill``). Result files of every schema version are read (version 1 has no ``meta.version``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.backward_bench import kernel_role  # noqa: E402
from harness.peers import BEST_OF, BEST_OF_FP8, PEERS  # noqa: E402
from harness.results import fmt, gpu_short_name, load, markdown_table, replace_block  # noqa: E402
from kernels import get_kernel, kernel_names  # noqa: E402


def families() -> dict:
    """docs page stem -> its kernels, in registry order."""
    out = {}
    for name in kernel_names():
        out.setdefault(re.match(r"k\d+|[a-z]+", name).group(0), []).append(name)  # k3_2 -> k3, decode_nosplit -> decode
    return out


def _archs(archs) -> str:
    names = [f"sm_{a}{b}" for a, b in archs]
    return names[0] if len(names) == 1 else f"{names[0]} to {names[-1]}"


def caps_table() -> str:
    """README: what each registered kernel runs, from its Capabilities."""
    short = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8 e4m3"}
    header = ["kernel", "file", "head dims", "dtypes", "causal", "LSE", "GQA", "seqlen_k ≠ seqlen_q", "softcap",
              "sliding window", "packed (varlen)", "GPUs", "limits"]
    body = []
    for name in kernel_names():
        entry = get_kernel(name)
        caps = entry.caps
        limits = [f"seqlen ≤ {caps.max_seqlen}"] if caps.max_seqlen else []
        limits.append("batch·heads ≤ 65535" if caps.folds_batch_heads else "batch, heads ≤ 65535 each")
        variant = ", ".join(f"{k}={v}" for k, v in entry.variant.items())
        body.append([f"`{name}`", f"`{entry.module.replace('.', '/')}.py`" + (f" ({variant})" if variant else ""),
                     ", ".join(map(str, caps.head_dims)), ", ".join(short.get(d, d) for d in caps.dtypes),
                     "yes" if caps.causal else "no", "yes" if caps.lse else "no", "yes" if caps.gqa else "no",
                     "yes" if caps.unequal_lengths else "no",
                     *("yes" if flag else "no" for flag in (caps.softcap, caps.window, caps.varlen)),
                     _archs(caps.archs), "; ".join(limits)])
    return markdown_table(header, body)


def backward_caps_table() -> str:
    """README: what each backward stage takes, asked of its own ``check`` (the backward stages
    are not in the forward registry, so they have no ``Capabilities``)."""
    from harness.backward import DETERMINISTIC, STAGES, stage_module, stage_overrides
    from kernels.contract import Problem, UnsupportedProblem

    def takes(stage, **kw) -> bool:
        try:
            stage_module(stage).check(Problem(1, 1, 128, kw.pop("head_dim", 64), **kw))
            return True
        except UnsupportedProblem:
            return False

    body = []
    for stage in STAGES:
        overrides = dict(stage_overrides(stage))
        per_d = overrides.pop("by_head_dim", {})
        variant = ", ".join([f"{k}={v}" for k, v in overrides.items()]
                            + [f"at d = {d}: " + ", ".join(f"{k}={v}" for k, v in o.items()) for d, o in per_d.items()])
        module = stage_module(stage).__name__.replace(".", "/")
        body.append([f"`{stage}`", f"`{module}.py`" + (f" ({variant})" if variant else ""),
                     ", ".join(str(d) for d in (32, 64, 96, 128, 256) if takes(stage, head_dim=d)),
                     *("yes" if takes(stage, **kw) else "no" for kw in (dict(softcap=30.0), dict(window=(64, 0)))),
                     "yes" if hasattr(stage_module(stage), "run_varlen_backward") else "no",
                     "yes" if stage in DETERMINISTIC else "no"])
    return ("Backward stages (`attention(..., backward=...)`, `harness.attention_backward`), asked of each stage's "
            "own check; packed (varlen): the stage has a packed backward (`attention_varlen` through autograd, "
            "`harness.attention_varlen_backward`):\n\n"
            + markdown_table(["backward", "file", "head dims", "softcap", "sliding window", "packed (varlen)",
                              "deterministic mode"], body))


def sweep_rows(sweep):
    return [r for r in sweep["rows"] if r.get("tflops")]


def tflops_at(rows, kernel, seqlen, head_dim, causal, key="tflops"):
    """A cell's TFLOP/s: ``tflops`` the kernel alone, ``call_tflops`` the public call (burst-timed)."""
    for r in rows:
        if (r["kernel"], r["seqlen"], r["head_dim"], r["causal"]) == (kernel, seqlen, head_dim, causal):
            return r.get(key)
    return None


def has_calls(run) -> bool:
    """Whether a run timed the public calls too (``bench.py`` since the eager fast path)."""
    return any(r.get("call_tflops") for r in run["rows"])


ALONE = ("the kernel alone: its compiled launch between CUDA events, a peer's call likewise (`tflops` in "
         "the result file)")
CALL = ("the public call, eager, back to back: `attention(...)` and the peers' own calls, CUDA events "
        "around bursts of calls, so host time counts (`call_tflops`)")


def refcheck_summary(refcheck, kernel):
    rows = [r for r in refcheck["rows"] if r["kernel"] == kernel] if refcheck else []
    if not rows:
        return "not run"
    ok = sum(r["ok"] for r in rows)
    return f"{ok}/{len(rows)} pass" if ok < len(rows) else f"all {len(rows)} pass"


def readme_table(sweep, refcheck):
    gpu = gpu_short_name(sweep["meta"].get("device", "")) if sweep else "—"
    rows = sweep_rows(sweep) if sweep else []
    header = ["kernel", "what it adds", "ref_check", f"TFLOP/s d128 N=4096 ({gpu})", "causal", "N=8192", "causal"]
    body = []
    for name in kernel_names():
        body.append([f"`{name}`", get_kernel(name).title, refcheck_summary(refcheck, name)] +
                    [fmt(tflops_at(rows, name, n, 128, c)) for n in (4096, 8192) for c in (0, 1)])
    for peer in PEERS:
        body.append([f"*{peer}*", "peer, same run", "—"] + [fmt(tflops_at(rows, peer, n, 128, c)) for n in (4096, 8192) for c in (0, 1)])
    return markdown_table(header, body)


def headline_table(bench_files):
    """README: the CHECK=1 headline runs, each kernel with its ratio to the peers timed in the
    same run, then the peers themselves. Runs that timed the public calls rate those (a kernel's
    call against the peers' calls) and show the kernel alone beside them."""
    header = ["GPU", "workload (bf16)", "kernel", "TFLOP/s (kernel alone)", "TFLOP/s (public call)", "vs cuDNN",
              "vs flash-attn-4"]
    body = []
    for f in sorted(bench_files, key=lambda f: (gpu_short_name(f["meta"].get("device", "")), f["meta"]["command"])):
        gpu = gpu_short_name(f["meta"].get("device", ""))
        key = "call_tflops" if has_calls(f) else "tflops"
        peers = {r["kernel"]: r[key] for r in f["rows"] if r["kernel"] in PEERS and r.get(key)}
        r0 = f["rows"][0]
        work = f"B={r0['batch']} H={r0['nheads']} N={r0['seqlen']} d={r0['head_dim']}{' causal' if r0['causal'] else ''}"
        for r in f["rows"]:
            if r["kernel"] not in PEERS and r.get(key):
                ratios = [f"{r[key] / peers[p]:.2f}×" if p in peers else "—" for p in ("sdpa-cudnn", "fa4")]
                body.append([gpu, work, f"`{r['kernel']}`", fmt(r["tflops"]), fmt(r.get("call_tflops"))] + ratios)
        body.append([gpu, work, "*cuDNN / flash-attn-4*",
                     *(f"{fmt(by.get('sdpa-cudnn'))} / {fmt(by.get('fa4'))}" for by in (
                         {r["kernel"]: r.get(k) for r in f["rows"]} for k in ("tflops", "call_tflops"))), "", ""])
    commands = sorted({f["meta"]["command"] for f in bench_files})
    return ("Ratios: the public calls' where the run timed them (" + CALL + "), else the kernel alone's (older runs: "
            "a dash under public call).\n\n" + markdown_table(header, body)
            + "\n\nFrom: " + "; ".join(f"`{c}`" for c in commands))


def family_table(sweep, kernels):
    gpu = gpu_short_name(sweep["meta"].get("device", ""))
    rows = sweep_rows(sweep)
    seqlens = sorted({r["seqlen"] for r in sweep["rows"]})
    header = ["d", "causal", "kernel"] + [f"N={n}" for n in seqlens]
    body = []
    for d in sorted({r["head_dim"] for r in sweep["rows"]}):
        for c in (0, 1):
            for k in list(kernels) + list(PEERS):
                vals = [tflops_at(rows, k, n, d, c) for n in seqlens]
                if any(v is not None for v in vals):
                    body.append([d, c, f"`{k}`" if k not in PEERS else f"*{k}*"] + [fmt(v) for v in vals])
    dtypes = "/".join(sorted({r["dtype"] for r in sweep["rows"]}))
    note = (f"TFLOP/s on an {gpu} (forward, {dtypes}, batch = 16384/N, heads = 2048/d; causal counts half the FLOPs). "
            f"From `{sweep['meta'].get('command', '')}` on {sweep['meta'].get('date', '')[:10]}, "
            f"torch {sweep['meta'].get('torch', '?')}, nvidia-cutlass-dsl {sweep['meta'].get('nvidia-cutlass-dsl', '?')}. "
            f"A dash: not run (refused, or past the kernel's sweep limit). Timed: {ALONE}.")
    return note + "\n\n" + markdown_table(header, body)


def k3_depth_table(sweep):
    """docs/k3.md: the three pipeline depths side by side, as ratios to one stage."""
    rows = sweep_rows(sweep)
    body = []
    for d in sorted({r["head_dim"] for r in sweep["rows"]}):
        for c in (0, 1):
            for n in sorted({r["seqlen"] for r in sweep["rows"]}):
                t = [tflops_at(rows, k, n, d, c) for k in ("k3_1", "k3_2", "k3_3")]
                if t[0]:
                    ratios = [f"{x / t[0]:.3f}" if x else "—" for x in t[1:]]
                    body.append([d, c, n] + [fmt(x) for x in t] + ratios)
    header = ["d", "causal", "N", "k3_1", "k3_2", "k3_3", "k3_2 / k3_1", "k3_3 / k3_1"]
    return "Pipeline depth, TFLOP/s from the same sweep:\n\n" + markdown_table(header, body)


def _e(x) -> str:
    """Errors in scientific notation; a crashed case has none (null, or NaN in old files)."""
    return "—" if x is None or x != x else f"{x:.1e}"


def refcheck_table(refcheck, kernels):
    gpu = gpu_short_name(refcheck["meta"].get("device", ""))
    if any("case" in r for r in refcheck["rows"]):  # ref_check.py --decode: one labelled KV-cache case per row
        body = [[r["case"], _e(r.get("max_abs")), _e(r.get("lse_max_abs")), "ok" if r["ok"] else "FAIL"]
                for r in refcheck["rows"] if r["kernel"] in kernels]
        return (f"`{refcheck['meta'].get('command', '')}` on an {gpu}, {refcheck['meta'].get('date', '')[:10]}: "
                f"{sum(r['ok'] for r in refcheck['rows'])}/{len(refcheck['rows'])} cases pass. Against a float64 "
                "reference; NaN and inf planted in every cache row past a sequence's length.\n\n"
                + markdown_table(["case", "max_abs", "lse err", "result"], body))
    header = ["kernel", "dtype", "batch×heads", "d", "causal", "seqlen", "K/V heads, len", "max_abs", "SDPA's",
              "rel_l2", "lse err", "result"]
    body = [[r["kernel"], r["dtype"], f"{r['batch']}×{r['nheads']}", r["head_dim"], r["causal"],
             f"{r['seqlen']}" + (f" (scale {r['softmax_scale']:g})" if r.get("softmax_scale") is not None else ""),
             f"{r.get('nheads_kv', r['nheads'])}, {r.get('seqlen_k', r['seqlen'])}",
             _e(r["max_abs"]), _e(r.get("peer_max_abs")), _e(r["rel_l2"]), _e(r["lse_max_abs"]),
             "ok" if r["ok"] else "FAIL"]
            for r in refcheck["rows"] if r["kernel"] in kernels]
    if all(k in FP8_STEPS for k in kernels):  # harness.check.check_fp8_kernel's criterion
        header[8] = "emulation's"
        how = ("max_abs: largest error of the kernel against exact attention of the dequantized inputs; "
               "emulation's: the same for the torch emulation of the FP8 arithmetic (a case passes within 1.5× "
               "its max_abs and relative L2, plus 1e-3, and LSE within 4e-3, times s·√d for a softmax scale s "
               "above 1/√d).")
    else:
        how = ("max_abs and SDPA's: largest error of the kernel and of SDPA in the same 16-bit dtype against the "
               "float32 reference (a case passes within twice SDPA's).")
    return (f"`{refcheck['meta'].get('command', '')}` on an {gpu}, {refcheck['meta'].get('date', '')[:10]}. "
            + how + "\n\n" + markdown_table(header, body))


def refcheck_runs_summary(runs, kernels, stem):
    """A page's correctness in brief: per run (newest first) its GPU, command and, per kernel, the
    cases that pass; every case is in the companion page's ``refcheck`` table."""
    body = []
    for f in runs:
        mine = [r for r in f["rows"] if r["kernel"] in kernels]
        counts = ", ".join(f"`{k}` {sum(r['ok'] for r in mine if r['kernel'] == k)}/{sum(r['kernel'] == k for r in mine)}"
                           for k in dict.fromkeys(r["kernel"] for r in mine))
        body.append([gpu_short_name(f["meta"].get("device", "")), f["meta"].get("date", "")[:10],
                     f"`{f['meta'].get('command', '')}`", counts])
    features = any(feature_grid(f) for f in runs)
    return (markdown_table(["GPU", "date", "command", "cases that pass"], body)
            + f"\n\nEvery case of the newest H100 run{' of the full grid' if features else ''} (else the newest), with "
            f"its errors: [{stem}-runs.md]({stem}-runs.md#correctness) (an older run's cases are in its result file"
            + (", and so are the feature grids' (`--features`, `--varlen`), which [varlen.md](varlen.md#correctness) "
               "counts" if features else "") + ").")


def feature_row(r) -> bool:
    """A refcheck case of a packed batch, a softcap or a window."""
    return "lengths_q" in r or bool(r.get("softcap")) or bool(r.get("window"))


def feature_grid(f) -> bool:
    """Whether a refcheck run is one of the feature grids (``--varlen``: its rows name packed
    lengths; ``--features``: every row sets a softcap or a window): docs/varlen.md counts those,
    and a kernel page prints the full grid instead (its table has no column for either)."""
    return bool(f["rows"]) and all(feature_row(r) for r in f["rows"])


def printed_in_full(runs):
    """The refcheck runs (newest first) whose every case a page prints: of each grid (the KV-cache
    grid's rows name a case), the newest on the issues' GPU (TARGET_GPU), else the newest, a full
    grid before a ``--quick`` one; the feature grids are left to the summary (``feature_grid``),
    which lists them all (the tree stays small enough to travel with every GPU call)."""
    chosen = {}
    for f in runs:
        if feature_grid(f):
            continue
        grid = any("case" in r for r in f["rows"])
        rank = (gpu_short_name(f["meta"].get("device", "")) == TARGET_GPU, "--quick" not in f["meta"].get("command", ""))
        if grid not in chosen or rank > chosen[grid][1]:
            chosen[grid] = (f, rank)
    return [f for f in runs if any(f is g for g, _ in chosen.values())]


def tune_table(tune):
    """docs/k4.md: the seed's K4 configuration against the tuned ones, peers from the same run."""
    gpu = gpu_short_name(tune["meta"].get("device", ""))
    body = []
    for d in sorted({r["head_dim"] for r in tune["rows"]}):
        rows = [r for r in tune["rows"] if r["head_dim"] == d]
        for label in dict.fromkeys(_label(r) for r in rows):  # unique, in run order
            same = [r for r in rows if _label(r) == label]
            shown = label + (" (seed)" if same[0].get("seed") else "")
            if same[0].get("default"):
                shown = f"**{shown} (default)**"
            by_causal = {r["causal"]: r["tflops"] for r in same}
            body.append([d, shown] + [fmt(by_causal.get(c)) for c in (0, 1)])
    seqlen = tune["rows"][0]["seqlen"] if tune["rows"] else "?"
    return (f"seqlen {seqlen}, batch 2, heads 2048/d, bf16, on an {gpu}; `{tune['meta'].get('command', '')}`, "
            f"{tune['meta'].get('date', '')[:10]}.\n\n" + markdown_table(["d", "configuration", "TFLOP/s", "causal"], body))


WS_STEPS = ("k4", "k5", "k6_pp", "k6_overlap", "k6")  # the stages the warp-specialized sweep times side by side


def _geomean(xs):
    import math

    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _vs_best(rows, kernel, n, d, c, key="tflops"):
    """(TFLOP/s, ratio to the faster of the BEST_OF peers in the same cell) or (None, None); ``key``
    picks the timing (``tflops_at``)."""
    t = tflops_at(rows, kernel, n, d, c, key)
    best = max((x for x in (tflops_at(rows, p, n, d, c, key) for p in BEST_OF) if x), default=None)
    return t, (t / best if t and best else None)


def ws_cells(sweep):
    return sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in sweep["rows"]})


def ws_steps_table(sweep, calls: bool = True):
    """docs/k5.md, docs/k6.md: K4 -> K5 -> K6 step by step, every cell, beside the peers: the public
    calls where the run timed them and ``calls``, else the kernels alone."""
    rows = sweep_rows(sweep)
    key = "call_tflops" if calls and has_calls(sweep) else "tflops"
    steps = [k for k in WS_STEPS if any(r["kernel"] == k for r in rows)]
    header = ["d", "causal", "N"] + [f"`{k}`" for k in steps] + [f"*{p}*" for p in BEST_OF] + ["k6 / best peer"]
    body = []
    for d, c, n in ws_cells(sweep):
        _, ratio = _vs_best(rows, "k6", n, d, c, key)
        body.append([d, c, n] + [fmt(tflops_at(rows, k, n, d, c, key)) for k in steps + list(BEST_OF)]
                    + [f"{ratio:.2f}×" if ratio else "—"])
    summary = []
    for k in steps:
        ratios = [_vs_best(rows, k, n, d, c, key)[1] for d, c, n in ws_cells(sweep)]
        g = _geomean(ratios)
        known = [x for x in ratios if x]
        summary.append([f"`{k}`", f"{g:.3f}×" if g else "—", f"{min(known):.2f}×" if known else "—",
                        sum(x >= 1.0 for x in known), len(known)])
    gpu = gpu_short_name(sweep["meta"].get("device", ""))
    rounds = max((len(r.get("ms_rounds", ())) for r in sweep["rows"]), default=0)
    how = (f"every kernel and peer timed {rounds} times in one run (the order reversed each round; the median)"
           if rounds > 1 else "every kernel and peer timed in one run")
    how += f"; {CALL if key == 'call_tflops' else ALONE}"
    if not sweep["meta"].get("complete", True):
        how += (f"; **the run stopped at its time limit after {len(ws_cells(sweep))} cells** (a dash: not timed, "
                "and left out of the summary)")
    return (f"TFLOP/s on an {gpu}, bf16, batch = 16384/N, heads = 2048/d, {how}: "
            f"`{sweep['meta'].get('command', '')}`, {sweep['meta'].get('date', '')[:10]}, torch "
            f"{sweep['meta'].get('torch', '?')}, nvidia-cutlass-dsl {sweep['meta'].get('nvidia-cutlass-dsl', '?')}.\n\n"
            + markdown_table(header, body) + "\n\nAgainst the faster of cuDNN and flash-attn-4 in each cell:\n\n"
            + markdown_table(["kernel", "geomean", "worst cell", "cells ≥ 1.0×", "cells"], summary))


# K6's softmax knobs (measured and left off): their tuning runs get a table block of their own.
SOFTMAX_KNOBS = ("emulated_exp2", "skip_unit_rescale", "rescale_o_before_gemm", "pin_pv_wait")


def ws_tune_table(tune):
    """docs/k6.md: configurations from scripts/tune.py, each with its ratio to the best peer."""
    gpu = gpu_short_name(tune["meta"].get("device", ""))
    clocks = any(r.get("sm_clock_mhz") for r in tune["rows"])  # runs since the timing records the GPU state
    body = []
    for r in tune["rows"]:
        if r["kernel"] in BEST_OF and not clocks:
            continue
        label = f"`{r['kernel']}`" + (" " + ", ".join(f"{k}={v}" for k, v in r["config"].items()) if r["config"]
                                      else " (default)" if r["kernel"] not in BEST_OF else "")
        ratio = r.get("vs_best_peer")
        row = [r["head_dim"], r["causal"], r["seqlen"], label,
               fmt(r["tflops"]) if r.get("tflops") else r.get("status", "—")[:40], f"{ratio:.2f}×" if ratio else "—"]
        if clocks:
            row += ([f"{r['sm_clock_mhz']:.0f}", f"{r['power_w']:.0f}", fmt(per_ghz(r))] if r.get("sm_clock_mhz")
                    else ["—"] * 3)
        body.append(row)
    rounds = max((len(r.get("ms_rounds", ())) for r in tune["rows"]), default=0)
    timed = (f" and timed {rounds} times, the order reversed each round (the median)" if rounds > 1 else "")
    head = ["d", "causal", "N", "configuration", "TFLOP/s", "× best peer"]
    if clocks:
        head += ["SM clock (MHz)", "power (W)", "TFLOP/s per GHz"]
    commit = tune["meta"].get("commit", "")[:7]  # "(default)" is that commit's default
    return (f"On an {gpu}" + (f" at {commit}" if commit else "") + f": `{tune['meta'].get('command', '')}`, "
            f"{tune['meta'].get('date', '')[:10]}. Each "
            f"configuration was checked against SDPA on the same inputs before it was timed{timed}."
            + (" SM clock and power: medians over each timing (NVML, `harness/gpu_state.py`); per GHz: each "
               "round's TFLOP/s over its clock, the median." if clocks else "") + "\n\n" + markdown_table(head, body))


def power_table(sweep) -> str:
    """docs/k6.md: the long cells of a rounds sweep that recorded the GPU state, each candidate's
    TFLOP/s, SM clock and work per cycle side by side."""
    gpu = gpu_short_name(sweep["meta"].get("device", ""))
    kernels = ["k6", "fa4", "sdpa-cudnn"]
    cells = {}
    for r in sweep["rows"]:
        if r["seqlen"] >= 8192 and r["kernel"] in kernels and r.get("sm_clock_mhz"):
            cells.setdefault((r["head_dim"], r["causal"], r["seqlen"]), {})[r["kernel"]] = r
    body, reasons = [], set()
    for (d, causal, n), rows in sorted(cells.items()):
        line = [d, causal, n]
        for k in kernels:
            r = rows.get(k)
            line.append(f"{fmt(r['tflops'])} @ {r['sm_clock_mhz']:.0f} ({fmt(per_ghz(r))})" if r else "—")
            if r:
                reasons.update(r.get("clock_limited_by", ()))
        line.append(f"{max(r['power_w'] for r in rows.values()):.0f}")
        body.append(line)
    return (f"On an {gpu}: `{sweep['meta'].get('command', '')}`, {sweep['meta'].get('date', '')[:10]}, the cells "
            f"with 8k and 16k keys. Each entry: TFLOP/s @ median SM clock in MHz (TFLOP/s per GHz, per round, "
            f"the median). NVML's reasons for the lowered clock in these timings: "
            f"{', '.join(sorted(reasons)) or 'none'}.\n\n"
            + markdown_table(["d", "causal", "N"] + [f"`{k}`" for k in kernels] + ["max power (W)"], body))


def per_ghz(r) -> float:
    """TFLOP/s per GHz of SM clock: the work a kernel gets done per cycle, whatever clock the power
    limit left it. Per round where every round has its clock, else from the medians."""
    rounds, clocks = r.get("ms_rounds") or [], r.get("sm_clock_rounds") or []
    if rounds and len(rounds) == len(clocks):
        return statistics.median(r["tflops"] * r["ms"] / ms / (mhz / 1000) for ms, mhz in zip(rounds, clocks))
    return r["tflops"] / (r["sm_clock_mhz"] / 1000)


def sass_loops_table(files):
    """docs/k6.md: instructions per KV tile in the SASS of each loop flavour (scripts/sass_loops.py),
    one row per (file, kernel, d, causal, masked); copies of one loop (one per Q stage) as a range."""
    groups = {}
    for f in files:
        commit = (f["meta"].get("commit") or "")[:7]
        for r in f["rows"]:
            label = f"`{r['kernel']}`" + (f" at {commit}" if r["kernel"] != "fa4" else "")
            key = (r["head_dim"], r["causal"], r["masked"], r["kernel"] != "fa4", label)
            groups.setdefault(key, []).append(r)
    body = []
    for (d, causal, masked, _, label), rows in sorted(groups.items(), key=lambda kv: kv[0][:4]):
        counts = sorted({r["instructions"] for r in rows})
        uniform = sorted({r["uniform"] for r in rows})
        span = lambda xs: f"{xs[0]}" if len(xs) == 1 else f"{xs[0]}–{xs[-1]}"  # noqa: E731
        before = sorted({r["exps_before_pv_wait"] for r in rows if r.get("exps_before_pv_wait") is not None})
        body.append([d, causal, label, rows[0]["tile_n"], "masked" if masked else "unmasked", span(counts),
                     f"{counts[0] / rows[0]['tile_n']:.2f}", span(uniform), span(before) if before else "—"])
    commands = [f"`{f['meta'].get('command', '')}`" for f in files]
    return ("From " + "; ".join(commands) + " (SASS of the sm_90a build, no GPU). The last column: of a tile's "
            "`MUFU.EX2`, how many ptxas placed before the wait for the previous tile's PV (loops with the "
            "overlap only; older files do not have it).\n\n"
            + markdown_table(["d", "causal", "kernel", "tile_n", "loop", "instructions per KV tile",
                              "per key", "of them uniform", "ex2 before the PV wait"], body))


def ws_compile_table(files):
    """docs/k5.md: per kernel, head dim and causal flag, the configuration, SMEM, ptxas registers
    (the launch budget once setmaxnreg is in play) and spill bytes, from --compile-only runs."""
    body = []
    for f in sorted(files, key=lambda f: (f["rows"][0]["head_dim"], f["rows"][0]["causal"]) if f["rows"] else (0, 0)):
        for r in f["rows"]:
            if r.get("status") != "ok":
                continue
            cfg = dict(r.get("config") or {})
            smem = cfg.pop("smem_bytes", None)
            ptxas = r.get("ptxas") or [{}]
            body.append([r["head_dim"], r["causal"], f"`{r['kernel']}`", ", ".join(f"{k}={v}" for k, v in cfg.items()),
                         f"{smem // 1024} KB" if smem else "—", ptxas[0].get("registers", "—"),
                         ptxas[0].get("spill_bytes", "—"), r["instructions"].get("setmaxnreg", 0),
                         r["instructions"].get("wgmma.mma_async", 0)])
    commands = sorted({f["meta"].get("command", "") for f in files})
    return ("From " + "; ".join(f"`{c}`" for c in commands) + ".\n\n"
            + markdown_table(["d", "causal", "kernel", "configuration", "SMEM", "registers (ptxas)", "spill bytes",
                              "setmaxnreg", "wgmma"], body))


def backward_sweep_table(run):
    """docs/k9.md, docs/k10.md: bench.py --backward, our backwards (K9, K10, its variants) through
    autograd (and their launches alone) beside cuDNN's and flash-attn-4's autograd backward, per
    cell and in summary."""
    cells, stages = {}, []
    for r in run["rows"]:
        if r["status"] == "ok":
            cells.setdefault((r["head_dim"], r["causal"], r["seqlen"]), {})[r["kernel"]] = r
            if r["kernel"] not in ("sdpa-cudnn", "fa4") + tuple(stages):
                stages.append(r["kernel"])
    last = "k10" if "k10" in stages else stages[-1] if stages else ""  # the ratio column's stage
    body, ratios = [], {k: [] for k in stages}
    for (d, c, n), row in sorted(cells.items()):
        best = max((row[p]["call_tflops"] for p in ("sdpa-cudnn", "fa4") if p in row), default=None)
        line = [str(d), str(c), str(n)]
        for k in stages:
            r = row.get(k)
            line += [fmt(r["call_tflops"]) if r else "—", fmt(r["tflops"]) if r and r.get("tflops") else "—"]
            if r and best:
                ratios[k].append(r["call_tflops"] / best)
        line += [fmt(row[p]["call_tflops"]) if p in row else "—" for p in ("sdpa-cudnn", "fa4")]
        line += [f"{row[last]['call_tflops'] / best:.2f}×" if last in row and best else "—"]
        body.append(line)
    meta = run["meta"]
    caps = sorted({r["softcap"] for r in run["rows"] if r.get("softcap")})
    capped = f", softcap {', '.join(f'{c:g}' for c in caps)} (cuDNN has none)" if caps else ""
    head = (f"TFLOP/s of one backward (10·B·H·N²·d FLOPs, halved for causal) on an "
            f"{gpu_short_name(meta.get('device', ''))}, bf16{capped}, batch = 16384/N, heads = 2048/d: every candidate "
            "through autograd after one forward, back to back (burst-timed, as a training step runs it); "
            "\"launches\": our three kernels alone between CUDA events. "
            f"`{meta.get('command', '')}`, {meta.get('date', '')[:10]}.")
    header = ["d", "causal", "N"] + [x for k in stages for x in (f"`{k}`", f"`{k}` launches")] + [
        "*cuDNN*", "*flash-attn-4*", f"{last} / best peer"]
    summary = [[f"`{k}`", f"{_geomean(ratios[k]):.3f}×" if ratios[k] else "—",
                f"{min(ratios[k]):.2f}×" if ratios[k] else "—", len(ratios[k])] for k in stages]
    return (head + "\n\n" + markdown_table(header, body) + "\n\nAgainst the faster peer of each cell:\n\n"
            + markdown_table(["backward", "geomean", "worst cell", "cells"], summary))


def backward_ab_table(run):
    """docs/k10.md: scripts/ab_backward.py, a K10 configuration's checks against float64 autograd,
    then its timings beside k10_fa3's and the peers' (backward_sweep_table's layout)."""
    timed = dict(run, rows=[r for r in run["rows"] if not r.get("check")])
    return ab_checks(run, "checks against float64 autograd") + " " + backward_sweep_table(timed)


def ab_checks(run, what: str) -> str:
    """scripts/ab_backward.py's configurations, each with how many of its checks (``what``) passed."""
    checks = [r for r in run["rows"] if r.get("check")]
    named = []
    for name in dict.fromkeys(r["kernel"] for r in checks):  # one or more configurations a run
        mine = [r for r in checks if r["kernel"] == name]
        named.append(f"`{name}` = `{json.dumps(mine[0].get('config'))}`: {sum(bool(r['ok']) for r in mine)} of "
                     f"{len(mine)} {what} passed before the timing.")
    return " ".join(named or ["`?`: no checks in the run."])


def refcheck_backward_table(runs):
    """docs/k9.md, docs/k10.md: every ref_check --backward run (newest first), cases that pass per
    stage, and the largest error of each gradient beside SDPA's over the run."""
    body = []
    for f in runs:
        for stage in dict.fromkeys(r["kernel"] for r in f["rows"]):
            mine = [r for r in f["rows"] if r["kernel"] == stage]
            worst = lambda g: max((r[f"{g}_max_abs"] / r[f"{g}_sdpa_max_abs"] for r in mine  # noqa: E731
                                   if r.get(f"{g}_max_abs") is not None and r.get(f"{g}_sdpa_max_abs")), default=None)
            body.append([gpu_short_name(f["meta"].get("device", "")), f["meta"].get("date", "")[:10],
                         f"`{f['meta'].get('command', '')}`", f"`{stage}`",
                         f"{sum(r['ok'] for r in mine)}/{len(mine)}",
                         *(f"{worst(g):.2f}×" if worst(g) is not None else "—" for g in ("dq", "dk", "dv"))])
    return ("Each case passes when every gradient's max error against float64 autograd is at most twice SDPA's "
            "16-bit backward's on the same inputs, plus 10⁻³; the last columns give the worst ratio of our error to "
            "SDPA's over the run (every case is in the result file).\n\n"
            + markdown_table(["GPU", "date", "command", "backward", "cases that pass", "dq / SDPA's", "dk / SDPA's",
                              "dv / SDPA's"], body))


def training_table(run):
    """docs/k10.md: harness/training.py, the small GPT's loss with SDPA and with each backward."""
    rows = {r["run"]: r for r in run["rows"]}
    sdpa = rows.get("sdpa")
    body = []
    for name, r in rows.items():
        losses = r["losses"]
        diff = f"{(r['tail'] - sdpa['tail']) / sdpa['tail'] * 100:+.1f}%" if sdpa and name != "sdpa" else "—"
        body.append([f"`{name}`" if name != "sdpa" else "SDPA", str(r["steps"]), f"{losses[0]:.3f}",
                     f"{losses[len(losses) // 2]:.3f}", f"{r['tail']:.3f}", diff])
    meta = run["meta"]
    return (f"`{meta.get('command', '')}` on an {gpu_short_name(meta.get('device', ''))}, {meta.get('date', '')[:10]} "
            "(forward K6 in our runs; the test passes when every run ends below ln 64 − 0.3 and within 5% + 0.02 of "
            "SDPA's):\n\n" + markdown_table(["attention", "steps", "first loss", "mid-run loss",
                                             "mean of the last 20", "vs SDPA"], body))


# docs/varlen.md: issue 35's runs (packed sequences, the sliding window, the softcap).
VARLEN_PEERS = {"fa4": "*flash-attn-4 varlen*", "sdpa-cudnn-padded": "*cuDNN, padded to the longest*"}
CAUSAL_NAMES = {0: "non-causal", 1: "causal"}
PEER_NAMES = {"fa4": "flash-attn-4", "sdpa-cudnn": "cuDNN"}


def _varlen_label(name: str) -> str:
    """A bench.py --varlen candidate as a table row: "k6 (cu_seqlens on CPU)" -> `k6`, cu_seqlens on CPU."""
    if name in VARLEN_PEERS:
        return VARLEN_PEERS[name]
    kernel, _, rest = name.partition(" ")
    return f"`{kernel}`" + (f", {rest.strip('()')}" if rest.startswith("(") else f" {rest}" if rest else "")


def _ok_rows(f) -> dict:
    """kernel -> row, of the rows that ran."""
    return {r["kernel"]: r for r in f["rows"] if r.get("status") == "ok"}


def _ratio(a, b, nd=3) -> str:
    return f"{a / b:.{nd}f}×" if a and b else "—"


def _from(files) -> str:
    """Runs for a caption: their GPU, commands and dates."""
    gpus = ", ".join(dict.fromkeys(gpu_short_name(f["meta"].get("device", "")) for f in files))
    dates = ", ".join(dict.fromkeys(f["meta"].get("date", "")[:10] for f in files))
    commands = "; ".join(f"`{f['meta'].get('command', '')}`" for f in files)
    return f"From {commands} (on an {gpus}, {dates})"


def _by_window(files):
    return sorted(files, key=lambda f: f["rows"][0]["window"][0])


def varlen_cells(runs) -> dict:
    """causal -> kernel -> row of bench.py --varlen (a file per causal flag)."""
    return {f["rows"][0]["causal"]: _ok_rows(f) for f in sorted(runs, key=lambda f: f["rows"][0]["causal"])}


def varlen_table(runs):
    """docs/varlen.md: bench.py --varlen, every candidate's public call (and K6's compiled launch
    alone) and its ratio to flash-attn-4's varlen call and to K6's rectangular call at the same
    lengths."""
    by = varlen_cells(runs)
    causals = list(by)
    lines = []  # (label, {causal: TFLOP/s})
    for name in dict.fromkeys(k for rows in by.values() for k in rows):
        lines.append((_varlen_label(name), {c: by[c].get(name, {}).get("call_tflops") for c in causals}))
        if any(by[c].get(name, {}).get("kernel_tflops") for c in causals):
            lines.append((f"{_varlen_label(name)}, compiled launch alone",
                          {c: by[c].get(name, {}).get("kernel_tflops") for c in causals}))
    body = [[label] + [fmt(t[c]) for c in causals]
            + [_ratio(t[c], by[c].get(peer, {}).get("call_tflops")) for peer in ("fa4", "k6 rectangular")
               for c in causals] for label, t in lines]
    r0 = runs[0]["rows"][0]
    header = (["candidate"] + [f"TFLOP/s {CAUSAL_NAMES[c]}" for c in causals]
              + [f"× flash-attn-4, {CAUSAL_NAMES[c]}" for c in causals]
              + [f"× `k6` rectangular, {CAUSAL_NAMES[c]}" for c in causals])
    return (f"TFLOP/s of a packed batch (flash-attn's layout): {r0['documents']} documents of {min(r0['lengths'])} to "
            f"{max(r0['lengths'])} tokens ({r0['tokens']} in all), {r0['nheads']} heads, d = {r0['head_dim']}, bf16; "
            "FLOPs count the unpadded work, so cuDNN's padding shows as lost speed. Every candidate is its call, "
            "burst-timed back to back as a model calls it (host time counts). `k6` passes the same cu_seqlens tensor "
            "each call, as a model's layers do (read on the host once); the compiled launch alone leaves out the "
            "host's part; `k6` rectangular: each length timed as a (tokens // n, heads, n, d) batch through "
            "`attention()`, weighted by that length's FLOPs. Ratios: against flash-attn-4's call and the rectangular "
            f"call. {_from(sorted(runs, key=lambda f: f['rows'][0]['causal']))}.\n\n" + markdown_table(header, body))


def varlen_backward_table(runs):
    """docs/varlen.md: bench.py --varlen --backward, K10's packed backward beside flash-attn-4's
    varlen backward and cuDNN's on the padded batch."""
    by = varlen_cells(runs)
    causals = list(by)
    rect = next((k for rows in by.values() for k in rows if k.endswith(" rectangular")), None)
    peers = ("fa4",) + ((rect,) if rect else ())
    body = [[_varlen_label(name)] + [fmt(by[c].get(name, {}).get("call_tflops")) for c in causals]
            + [_ratio(by[c].get(name, {}).get("call_tflops"), by[c].get(peer, {}).get("call_tflops"))
               for peer in peers for c in causals]
            for name in dict.fromkeys(k for rows in by.values() for k in rows)]
    r0 = runs[0]["rows"][0]
    header = (["backward"] + [f"TFLOP/s {CAUSAL_NAMES[c]}" for c in causals]
              + [f"× flash-attn-4, {CAUSAL_NAMES[c]}" for c in causals]
              + ([f"× {_varlen_label(rect)}, {CAUSAL_NAMES[c]}" for c in causals] if rect else []))
    return (f"TFLOP/s of one backward of the packed batch above ({r0['documents']} documents, {r0['tokens']} tokens, "
            f"{r0['nheads']} heads, d = {r0['head_dim']}, bf16; 2.5× the unpadded forward's FLOPs): each candidate "
            "through autograd after one forward, burst-timed"
            + ("; rectangular: each length timed as a (tokens // n, heads, n, d) batch through `attention()` and "
               "autograd, weighted by that length's FLOPs. " if rect else ". ")
            + f"{_from(sorted(runs, key=lambda f: f['rows'][0]['causal']))}.\n\n" + markdown_table(header, body))


def packed_ab_table(run):
    """docs/varlen.md: scripts/ab_backward.py --varlen, each configuration's packed checks, then its
    packed backward beside k10_fa3's and flash-attn-4's in the same run."""
    timed = [r for r in run["rows"] if "documents" in r and r.get("status") == "ok"]
    by = {}
    for r in timed:
        by.setdefault(r["causal"], {})[r["kernel"]] = r
    causals = sorted(by)
    body = [[_varlen_label(name)] + [fmt(by[c].get(name, {}).get("call_tflops")) for c in causals]
            + [_ratio(by[c].get(name, {}).get("call_tflops"), by[c].get(peer, {}).get("call_tflops"))
               for peer in ("k10_fa3", "fa4") for c in causals]
            for name in dict.fromkeys(r["kernel"] for r in timed)]
    header = (["backward"] + [f"TFLOP/s {CAUSAL_NAMES[c]}" for c in causals]
              + [f"× `k10_fa3`, {CAUSAL_NAMES[c]}" for c in causals]
              + [f"× flash-attn-4, {CAUSAL_NAMES[c]}" for c in causals])
    r0 = timed[0]
    return (ab_checks(run, "packed checks") + f" TFLOP/s of one packed backward ({r0['documents']} documents, {r0['tokens']} tokens, "
            f"{r0['nheads']} heads, d = {r0['head_dim']}, bf16) through autograd, burst-timed, one run. "
            f"{_from([run])}.\n\n" + markdown_table(header, body))


def _flops(r) -> float:
    from kernels.contract import Problem

    return Problem(r["batch"], r["nheads"], r["seqlen"], r["head_dim"], causal=bool(r["causal"]),
                   window=tuple(r.get("window") or (-1, -1))).flops


def same_flops(rect, window_row) -> dict:
    """The rectangle's rows (kernel -> row) if its FLOPs are within 10% of the window's, else {}."""
    rows = _ok_rows(rect) if rect else {}
    return rows if rows and abs(_flops(next(iter(rows.values()))) / _flops(window_row) - 1) < 0.1 else {}


def window_table(windows, rect):
    """docs/varlen.md: bench.py --window, K6 beside flash-attn-4 (the public call and the kernel
    alone), and each against the rectangle of about the same FLOPs (``rect``): the rectangle's
    TFLOP/s over the window's is the window's time per FLOP relative to the rectangle's."""
    body = []
    for f in _by_window(windows):
        rows, r0 = _ok_rows(f), f["rows"][0]
        same = same_flops(rect, r0)
        for key, timing in (("call_tflops", "public call"), ("tflops", "kernel alone")):
            k6, fa4 = (rows.get(k, {}).get(key) for k in ("k6", "fa4"))
            body.append([r0["window"][0], r0["seqlen"], timing, fmt(k6), fmt(fa4), _ratio(k6, fa4)]
                        + [_ratio(same[k].get(key), t) if k in same else "—" for k, t in (("k6", k6), ("fa4", fa4))])
    r0 = windows[0]["rows"][0]
    note = ""
    if rect:
        q = rect["rows"][0]
        ratios = " and ".join(f"{_flops(q) / _flops(f['rows'][0]):.2f}× W = {f['rows'][0]['window'][0]}'s"
                              for f in _by_window(windows))
        note = (f" The rectangle: B={q['batch']} H={q['nheads']} N={q['seqlen']} d={q['head_dim']}"
                f"{' causal' if q['causal'] else ' non-causal'}, no window, its FLOPs {ratios} (compared only where "
                "within 10%); time per FLOP against it: the rectangle's TFLOP/s over the window's, same candidate, "
                "same timing.")
    return (f"TFLOP/s with a sliding window (left edge W, right edge the diagonal: causal), B={r0['batch']} "
            f"H={r0['nheads']} d={r0['head_dim']}, bf16; FLOPs count the (query, key) pairs the window keeps. Timed "
            f"two ways: {CALL}; and {ALONE}.{note} {_from(_by_window(windows) + ([rect] if rect else []))}.\n\n"
            + markdown_table(["W", "N", "timing", "`k6`", "*flash-attn-4*", "`k6` / flash-attn-4",
                              "`k6` time per FLOP × the rectangle's", "flash-attn-4's × its rectangle's"], body))


def window_backward_table(runs, rect=None):
    """docs/varlen.md: bench.py --backward --window, K10 beside flash-attn-4's backward, and each
    against the backward of the rectangle of about the same FLOPs (``rect``), as the forward's table."""
    body = []
    for f in _by_window(runs):
        rows, r0 = _ok_rows(f), f["rows"][0]
        same = same_flops(rect, r0)
        fa4 = rows.get("fa4", {}).get("call_tflops")
        for k in (k for k in rows if k not in PEERS):
            body.append([r0["window"][0], r0["seqlen"], f"`{k}`", fmt(rows[k]["call_tflops"]),
                         fmt(rows[k].get("tflops")), fmt(fa4), _ratio(rows[k]["call_tflops"], fa4)]
                        + [_ratio(same[c].get(key), rows[c].get(key)) if c in same and c in rows else "—"
                           for c, key in ((k, "call_tflops"), (k, "tflops"), ("fa4", "call_tflops"))])
    r0 = runs[0]["rows"][0]
    note = ""
    if rect:
        q = rect["rows"][0]
        note = (f" The rectangle: B={q['batch']} H={q['nheads']} N={q['seqlen']} d={q['head_dim']}"
                f"{' causal' if q['causal'] else ' non-causal'}, no window, its backward timed the same way; time per "
                "FLOP against it: the rectangle's TFLOP/s over the window's, same candidate, same timing.")
    return (f"TFLOP/s of one backward (2.5× the forward's FLOPs, the window's pairs only), B={r0['batch']} "
            f"H={r0['nheads']} d={r0['head_dim']}, causal, bf16: each candidate through autograd after one forward, "
            f"back to back (burst-timed); \"launches\": our three kernels alone between CUDA events.{note} "
            f"{_from(_by_window(runs) + ([rect] if rect else []))}.\n\n"
            + markdown_table(["W", "N", "backward", "TFLOP/s", "launches", "*flash-attn-4*", "ours / flash-attn-4",
                              "time per FLOP × the rectangle's", "launches: the same",
                              "flash-attn-4's × its rectangle's"], body))


def decode_window_table(runs):
    """docs/varlen.md: bench.py --decode --window, the decode kernels with a window on a long cache
    beside flash-attn-4 with the same window and beside themselves on a cache of only the window's keys."""
    body = []
    for f in _by_window(runs):
        rows, r0 = _ok_rows(f), f["rows"][0]
        fa4 = rows.get("fa4", {}).get("ms")
        for k, r in rows.items():
            if k == "fa4" or "cache)" in k:
                continue
            short = next((x for name, x in rows.items() if name.startswith(f"{k} (a ")), None)
            body.append([r0["window"][0], r0["seqlen_k"], f"`{k}`", f"{1000 * r['ms']:.1f}", f"{r['tbps']:.2f}",
                         f"{1000 * fa4:.1f}" if fa4 else "—", _ratio(fa4, r["ms"]),
                         f"{1000 * short['ms']:.1f}" if short else "—", _ratio(short and short["ms"], r["ms"])])
    r0 = runs[0]["rows"][0]
    return (f"One decode step (q_len {r0['q_len']}, {r0['nheads']} query heads on {r0['nheads_kv']} K/V heads, "
            f"d={r0['head_dim']}, batch {r0['batch']}, bf16) with a window (W, 0) on a cache of N keys; a plan's run, "
            "burst-timed; TB/s on the window's K/V bytes. The last columns: the same kernel without a window on a "
            f"cache of only the window's W + 1 keys, what reading only the window should cost. {_from(_by_window(runs))}.\n\n"
            + markdown_table(["W", "N", "kernel", "µs", "TB/s", "*flash-attn-4* µs", "flash-attn-4 / ours",
                              "W + 1-key cache µs", "that / ours"], body))


def softcap_costs(pair) -> dict:
    """kernel -> {timing key: (TFLOP/s without, with, cost)} of a (with softcap, without) pair of runs."""
    capped, plain = (_ok_rows(f) for f in pair)
    out = {}
    for k, r in capped.items():
        out[k] = {}
        for key in ("call_tflops", "tflops"):
            w, wo = r.get(key), plain.get(k, {}).get(key)
            out[k][key] = (wo, w, 1 - w / wo if w and wo else None)
    return out


def softcap_table(forward, backward):
    """docs/varlen.md: what a softcap costs (1 − TFLOP/s with it / without), ours and flash-attn-4's,
    forward (bench.py --softcap) and backward (bench.py --backward --softcap); ``forward`` and
    ``backward`` are (with, without) pairs of result files, or None."""
    body, files = [], []
    for what, pair in (("forward", forward), ("backward", backward)):
        if not pair:
            continue
        files += list(pair)
        costs = softcap_costs(pair)
        fa4 = costs.get("fa4", {}).get("call_tflops", (None, None, None))[1]
        for k in [k for k in costs if k not in PEERS] + [p for p in PEERS if p in costs]:
            line = [what, f"`{k}`" if k not in PEERS else f"*{PEER_NAMES.get(k, k)}*"]
            for key in ("call_tflops", "tflops"):
                wo, w, cost = costs[k][key]
                line += [fmt(wo), fmt(w), f"{100 * cost:.1f}%" if cost is not None else "—"]
            body.append(line + [_ratio(costs[k]["call_tflops"][1], fa4) if k not in PEERS else "—"])
    r0 = files[0]["rows"][0]
    return (f"TFLOP/s with softcap {r0['softcap']:g} and without, B={r0['batch']} H={r0['nheads']} N={r0['seqlen']} "
            f"d={r0['head_dim']}{', causal' if r0['causal'] else ''}, bf16; cost: 1 − TFLOP/s with / without. "
            f"Forward: {CALL}, and {ALONE}; backward: through autograd after one forward, and (alone) our three "
            f"launches between CUDA events. {_from(files)}.\n\n"
            + markdown_table(["pass", "candidate", "without", "with softcap", "cost", "alone: without",
                              "alone: with", "alone: cost", "with softcap × flash-attn-4's"], body))


def softcap_cost_table(run):
    """docs/varlen.md: scripts/softcap_cost.py, K6's compiled launch without a softcap and with
    one, for each setting of the emulated_exp2 knob (part of exp2 on the FMA pipe)."""
    def setting(r):  # emulated_exp2 alone (an int), or other compile overrides (their JSON)
        return json.dumps(r["config"], separators=(", ", ": ")) if "config" in r else r["emulated_exp2"]

    cells = {}
    for r in run["rows"]:
        cells.setdefault((r["head_dim"], r["causal"], r["seqlen"], r["batch"], r["nheads"]), {})[
            (r["softcap"], setting(r))] = r
    capped = [e for cell in cells.values() for cap, e in cell if cap]
    settings = sorted({e for e in capped if isinstance(e, int)})  # emulated_exp2=n, then the named configs
    settings += list(dict.fromkeys(e for e in capped if isinstance(e, str)))
    body = []
    for (d, c, n, b, h), cell in cells.items():
        plain = next((r["tflops"] for (cap, _), r in cell.items() if not cap and r["ok"]), None)
        line = [d, c, n, f"{b}×{h}", fmt(plain)]
        for e in settings:
            r = next((r for (cap, e2), r in cell.items() if cap and e2 == e), None)
            t = r["tflops"] if r and r["ok"] else None
            line.append(f"{fmt(t)} ({100 * (1 - t / plain):.1f}%)" if t and plain else "FAIL" if r else "—")
        body.append(line)
    cap = next(r["softcap"] for r in run["rows"] if r["softcap"])
    return (f"TFLOP/s of `k6`'s compiled launch (CUDA events), bf16, without a softcap and with softcap {cap:g} "
            "(in brackets: its cost against none) for each setting of `emulated_exp2=n`, n of every 8 columns' exp2 "
            "on the FMA pipe" + (", and each set of K6 compile overrides a column names"
                                 if any("config" in r for r in run["rows"]) else "")
            + "; each configuration checked against the float32 reference first "
            f"({sum(r['ok'] for r in run['rows'])}/{len(run['rows'])} pass). {_from([run])}.\n\n"
            + markdown_table(["d", "causal", "N", "batch×heads", "no softcap"]
                             + [f"softcap, emulated_exp2={e}" + (" (the default)" if e == 0 else "")
                                if isinstance(e, int) else f"softcap, `{e}`" for e in settings], body))


def issue35_targets(varlen, windows, rect, backward, softcap, varlen_backward=(), backward_rect=None) -> str:
    """docs/varlen.md: issue 35's targets (public calls), each with what was measured and whether it
    is met; ``softcap``: the forward and backward (with, without) pairs, either may be None."""
    body = []

    def target(what, values, met):
        body.append([what, ", ".join(values), "yes" if met else "**no**"])

    for runs, ours, call, peers in (
            (varlen, "k6", "packed call", (("fa4", 1.0, "flash-attn-4's varlen call"),
                                           ("k6 rectangular", 0.95, "the rectangular call at the same lengths"))),
            (varlen_backward, "k10_fa3", "packed backward (`k10_fa3`)",
             (("fa4", 1.0, "flash-attn-4's varlen backward"),
              ("k10_fa3 rectangular", 0.95, "the rectangular backward at the same lengths")))):
        by = varlen_cells(runs) if runs else {}
        for peer, bar, what in peers:
            r = {c: by[c][ours]["call_tflops"] / by[c][peer]["call_tflops"] for c in by if ours in by[c] and peer in by[c]}
            if r:
                target(f"{call} ≥ {bar:.2f}× {what}", [f"{CAUSAL_NAMES[c]} {x:.3f}×" for c, x in r.items()],
                       min(r.values()) >= bar)
    w1k = next((f for f in windows if f["rows"][0]["window"][0] == 1024), None)
    if w1k:
        rows, r0 = _ok_rows(w1k), w1k["rows"][0]
        if "k6" in rows and "fa4" in rows:
            x = rows["k6"]["call_tflops"] / rows["fa4"]["call_tflops"]
            target(f"window W = 1024, N = {r0['seqlen']}, forward ≥ 1.00× flash-attn-4", [f"{x:.3f}×"], x >= 1.0)
        same = same_flops(rect, r0)
        if "k6" in same and "k6" in rows:
            x = same["k6"]["call_tflops"] / rows["k6"]["call_tflops"]
            target("the same, forward time ≤ 1.15× the rectangular call doing the same FLOPs",
                   [f"{x:.2f}× (per FLOP)"], x <= 1.15)
    b1k = next((f for f in backward if f["rows"][0]["window"][0] == 1024), None)
    if b1k:
        rows, r0 = _ok_rows(b1k), b1k["rows"][0]
        for k in (k for k in rows if k not in PEERS and "fa4" in rows):
            x = rows[k]["call_tflops"] / rows["fa4"]["call_tflops"]
            target(f"window W = 1024, N = {r0['seqlen']}, backward (`{k}`) ≥ 1.00× flash-attn-4", [f"{x:.3f}×"],
                   x >= 1.0)
        same = same_flops(backward_rect, r0)
        for k in (k for k in rows if k not in PEERS and k in same):
            x = same[k]["call_tflops"] / rows[k]["call_tflops"]
            target("the same, backward time ≤ 1.15× the rectangular backward doing the same FLOPs",
                   [f"{x:.2f}× (per FLOP)"], x <= 1.15)
    for what, pair in zip(("forward", "backward"), softcap):
        if pair:
            for k, cost in softcap_costs(pair).items():
                if k not in PEERS and cost["call_tflops"][2] is not None:
                    c = cost["call_tflops"][2]
                    target(f"softcap costs ≤ 10%, {what} (`{k}`)", [f"{100 * c:.1f}%"], c <= 0.10)
    gpus = {gpu_short_name(f["meta"].get("device", "")) for f in varlen + list(varlen_backward) + windows + backward
            + [rect, backward_rect]
            + [f for pair in softcap if pair for f in pair] if f}
    return (f"On an {', '.join(sorted(gpus))}, the public calls, from the tables below:\n\n"
            + markdown_table(["issue 35's target", "measured", "met"], body))


def feature_refcheck_table(runs):
    """docs/varlen.md: the ref_check runs with feature cases (``feature_row``; a full grid's are
    counted apart from its other cases), cases that pass per kernel; every case is in the result file."""
    body = []
    for f in sorted(runs, key=lambda f: f["meta"].get("date", "")):
        rows = [r for r in f["rows"] if feature_row(r)]
        only = "" if feature_grid(f) else " (its softcap and window cases)"
        for k in dict.fromkeys(r["kernel"] for r in rows):
            mine = [r for r in rows if r["kernel"] == k]
            body.append([gpu_short_name(f["meta"].get("device", "")), f["meta"].get("date", "")[:10],
                         f"`{f['meta'].get('command', '')}`{only}", f"`{k}`",
                         f"{sum(r['ok'] for r in mine)}/{len(mine)}"])
    return markdown_table(["GPU", "date", "command", "kernel", "cases that pass"], body)


def save_png(fig, path) -> None:
    """The figure as a 64-colour palette PNG: a line plot loses nothing visible, and the file is
    a quarter of the size (the tree travels with every GPU call, under a size cap)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def plot_training(run, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in run["rows"]:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label="SDPA" if r["run"] == "sdpa" else
                f"attention(k6), backward {r['run']}", linewidth=1)
    ax.axhline(math.log(64), color="gray", linestyle=":", linewidth=1, label="ln 64 (no look-back)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"Training check, {gpu_short_name(run['meta'].get('device', ''))}: {run['meta'].get('command', '')}",
                 fontsize=8)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    save_png(fig, path)
    plt.close(fig)


def ncu_compare_table(path):
    """docs/k6.md: scripts/ncu_compare.sh output, one row per metric, k6 beside flash-attn-4."""
    lines = path.read_text().splitlines()
    values = {}
    for line in lines[1:]:
        kernel, metric, value = line.split(maxsplit=2)
        values.setdefault(metric, {})[kernel] = float(value.replace(",", ""))
    names = {"gpu__time_duration.sum": "duration under ncu (µs)",
             "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe active (% of peak)",
             "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots used (% of peak)",
             "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "XU (MUFU) pipe (% of peak)",
             "smsp__inst_executed.sum": "instructions executed (millions)"}
    body = []
    for metric, v in values.items():
        if "k6" not in v or "fa4" not in v:
            continue
        scale = 1e-3 if metric.startswith("gpu__time") else 1e-6 if metric.endswith("inst_executed.sum") else 1
        stall = re.match(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active", metric)
        if stall and max(v["k6"], v["fa4"]) < 0.1:
            continue  # the reasons that never matter here
        label = f"stall: {stall.group(1)} (warps per issue)" if stall else names.get(metric, metric)
        body.append([label, f"{v['k6'] * scale:.2f}", f"{v['fa4'] * scale:.2f}"])
    return (f"`{path.relative_to(ROOT)}`: {lines[0]}\n\n"
            + markdown_table(["metric", "`k6`", "flash-attn-4"], body))


def ncu_profile_table(f, workload: str, top: int = 3):
    """docs/k5-k8.md, docs/decode.md: scripts/ncu_profile.py's rows of one workload (bf16, fp8,
    decode), each candidate's longest kernel: activity of the tensor, issue and MUFU pipes and the
    stall reasons with the most warp cycles per issued instruction."""
    # a softcap's rows beside the same run's plain ones
    rows = [r for r in f["rows"] if r["workload"] == workload or (workload, r["workload"]) == ("softcap", "bf16")]
    r0 = next((r for r in rows if r["status"] == "ok"), rows[0])
    shape = (f"batch {r0['batch']}, 32 query heads on {r0['nheads_kv']} K/V heads, {r0['kv_len']} keys, d=128"
             if workload == "decode" else f"batch {r0['batch']} x {r0['nheads']} heads, N={r0['seqlen']}, "
             f"d={r0['head_dim']}, non-causal, {'e4m3 inputs' if workload == 'fp8' else 'bf16'}"
             + {"backward": ", the autograd backward after one forward",
                "softcap": ", without a softcap and with softcap 30 (the online max: before the known-max "
                           "softmax)"}.get(workload, ""))
    counted = workload in ("backward", "softcap")  # instructions executed: where one call issues more work
    head = (f"`{f['meta'].get('command', '')}`, {gpu_short_name(f['meta'].get('device', ''))}, "
            f"{f['meta'].get('date', '')[:10]}: {shape}. One profiled call each, its longest kernel "
            "(ncu at the card's own clocks: read the ratios, not the durations).")
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["label"], "—", "—", "—", "—", "—", f"not profiled: {r['status'][:80]}"])
            continue
        stalls = sorted(((k[6:], v) for k, v in r.items() if k.startswith("stall_")), key=lambda kv: -kv[1])[:top]
        body.append([f"`{r['label']}`" if r["label"] in (r["job"].split("-")[0], r["job"], r["job"].split("-", 1)[-1])
                     else r["label"], str(r["kernels_in_call"]), f"{r['duration_us']:.0f}",
                     f"{r['tensor_pipe_pct']:.1f}", f"{r['issue_active_pct']:.1f}", f"{r['xu_pipe_pct']:.1f}",
                     *([f"{r['instructions'] / 1e6:.0f}"] if counted else []),
                     ", ".join(f"{name} {v:.2f}" for name, v in stalls)])
    return head + "\n\n" + markdown_table(
        ["call", "kernels", "longest kernel (µs)", "tensor pipe (% of peak)", "issue slots (% of peak)",
         "MUFU/XU pipe (% of peak)", *(["warp instructions (M)"] if counted else []),
         "top stalls (warp cycles per issue)"], body)


def backward_kernels_table(f):
    """docs/k10.md: scripts/backward_kernels.py, each backward's device time per call split by the
    role of its kernels (pre-pass, fill, main kernel, post-pass), cell by cell."""
    roles = ("pre-pass", "fill", "copy", "main", "post-pass")
    def role(r):  # a run before the script named "copy" filed torch's copy kernel as main: its name says which
        return kernel_role(r["kernel"]) if r["role"] == "main" else r["role"]

    roles = tuple(x for x in roles if x != "copy" or any(role(r) == "copy" for r in f["rows"]))
    names = {"k10_fa3": "`k10_fa3`", "sdpa-cudnn": "cuDNN", "fa4": "flash-attn-4"}
    calls = {}
    for r in f["rows"]:
        key = (r["head_dim"], r["causal"], r.get("seqlen", f"{r.get('tokens')} packed"), r["candidate"])
        calls.setdefault(key, dict.fromkeys(roles, 0.0))[role(r)] += r["us"]
    body = [[str(d), str(c), str(n), names.get(cand, f"`{cand}`"), *(f"{t[x]:.0f}" if t[x] else "—" for x in roles),
             f"{sum(t.values()):.0f}"] for (d, c, n, cand), t in calls.items()]
    meta, r0 = f["meta"], f["rows"][0]
    head = (f"`{meta.get('command', '')}`, {gpu_short_name(meta.get('device', ''))}, {meta.get('date', '')[:10]}, at "
            f"{meta.get('commit', '')[:7]}: device µs per autograd backward (torch.profiler, mean of 20), bf16, "
            + (f"the packing of `bench.py --varlen --backward` ({r0.get('documents')} documents, {r0.get('tokens')} "
               f"tokens, {r0.get('nheads')} heads)" if "tokens" in r0 else "batch 16384/N, heads 2048/d")
            + ", each kernel under its role." + (f" ({meta['note']})" if meta.get("note") else ""))
    return head + "\n\n" + markdown_table(["d", "causal", "N", "backward", *(f"{x} kernel" if x == "main" else x
                                                                            for x in roles), "total"], body)


def ncu_stalls_table(f, top: int = 8):
    """docs/k6.md, docs/k10.md (--backward): scripts/ncu_stalls.py, per kernel the SASS instructions where most warp-stall
    samples fell (share of all the kernel's samples, the leading reason)."""
    r0 = f["rows"][0]
    head = (f"`{f['meta'].get('command', '')}`, {gpu_short_name(f['meta'].get('device', ''))}, "
            f"{f['meta'].get('date', '')[:10]}: d={r0['head_dim']}, causal={r0['causal']}, N={r0['seqlen']}"
            + (f", softcap {r0['softcap']:g}." if r0.get("softcap") else "."))
    tables = []
    for r in f["rows"]:
        def reason(h):  # ncu files the samples of an issuing HGMMA under no listed reason
            name, n = next(iter(h["reasons"].items()), ("", 0))
            return name.replace("stall_", "") if n >= 0.3 * h["samples"] else "(none listed)"
        body = [[f"`{h['source'].strip()[:60]}`", f"{100 * h['share']:.1f}%", reason(h)] for h in r["hot"][:top]]
        reasons = sorted(((k.replace("stall_", ""), v) for k, v in r["by_reason"].items() if "Not Issued" not in k),
                         key=lambda kv: -kv[1])[:6]
        tables.append(f"**{r['kernel']}** ({r['samples']:.0f} samples; by reason: "
                      + ", ".join(f"{k} {100 * v / r['samples']:.1f}%" for k, v in reasons) + "):\n\n"
                      + markdown_table(["instruction", "share of samples", "main reason"], body))
    return head + "\n\n" + "\n\n".join(tables)


def gqa_table(mha, gqa):
    """docs/k6.md: the same kernel on the same query shapes with all K/V heads and with grouped ones."""
    def tf(f):
        return {(r["causal"], r["seqlen"]): r["tflops"] for r in f["rows"] if r["kernel"] == "k6" and r.get("tflops")}
    a, b = tf(mha), tf(gqa)
    r0, g0 = mha["rows"][0], gqa["rows"][0]
    body = [[c, n, fmt(a[(c, n)]), fmt(b.get((c, n))), f"{b[(c, n)] / a[(c, n)]:.2f}×" if (c, n) in b else "—"]
            for c, n in sorted(a)]
    return (f"d={r0['head_dim']}, {r0['nheads']} query heads, batch 16384/N, bf16, {gpu_short_name(mha['meta'].get('device', ''))}: "
            f"`{mha['meta'].get('command', '')}` and `{gqa['meta'].get('command', '')}`.\n\n"
            + markdown_table(["causal", "N", f"k6, {r0['nheads_kv']} K/V heads", f"k6, {g0['nheads_kv']} K/V heads (GQA)",
                              "GQA / MHA"], body))


def run_cite(bench) -> str:
    """The command and date of a result file, for a table's heading: the decode page's tables can
    each come from a different run (``latest_with_mode``)."""
    return f"`{bench['meta'].get('command', '')}`, {bench['meta'].get('date', '')[:10]}"


def decode_table(bench):
    """docs/decode.md: the decode grid, each kernel's TB/s, % of HBM peak and ratio to cuDNN,
    with the peers' TB/s, from ``bench.py --decode``."""
    gpu = gpu_short_name(bench["meta"].get("device", ""))
    shapes = {}
    for r in bench["rows"]:
        if r.get("mode") == "grid":
            shapes.setdefault((r["batch"], r["seqlen_k"], r["nheads_kv"]), {})[r["kernel"]] = r

    def rate(r):
        return f"{r['tbps']:.2f}" if r and r.get("tbps") else (r.get("status", "—")[:24] if r else "—")

    body = []
    for (b, n, hk), got in shapes.items():
        cudnn = got.get("sdpa-cudnn")
        for name in ("decode", "decode_combine"):
            r = got.get(name)
            if not r:
                continue
            ratio = f"{cudnn['ms'] / r['ms']:.2f}×" if r.get("ms") and cudnn and cudnn.get("ms") else "—"
            pct = f"{r['pct_peak']:.0f}%" if r.get("pct_peak") else "—"
            body.append([b, f"{n // 1024}k", hk, f"`{name}`", r.get("num_splits", "—"), rate(r), pct, ratio,
                         rate(cudnn), rate(got.get("fa4")), rate(got.get("sdpa-flash"))])
    return (f"On an {gpu}: {run_cite(bench)}; TB/s of K+V "
            "read, kernel time by CUDA-graph replay; every candidate checked against a float32 reference first.\n\n"
            + markdown_table(["batch", "keys", "K/V heads", "kernel", "splits", "TB/s", "% of HBM peak", "× cuDNN",
                              "cuDNN TB/s", "fa4 TB/s", "SDPA-flash TB/s"], body))


def decode_readme_table(bench):
    """README: ``decode`` per grid row, TB/s and its ratio to cuDNN, with the geomean and worst row."""
    shapes = {}
    for r in bench["rows"]:
        if r.get("mode") == "grid" and r.get("ms"):
            shapes.setdefault((r["batch"], r["seqlen_k"], r["nheads_kv"]), {})[r["kernel"]] = r
    body, ratios = [], []
    for (b, n, hk), got in shapes.items():
        mine, cudnn = got.get("decode"), got.get("sdpa-cudnn")
        if mine and cudnn:
            ratios.append(cudnn["ms"] / mine["ms"])
            body.append([b, f"{n // 1024}k", hk, f"{mine['tbps']:.2f}", f"{cudnn['tbps']:.2f}", f"{ratios[-1]:.2f}×"])
    if not ratios:
        return "No decode grid rows with cuDNN beside them yet."
    gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    return (f"{gpu_short_name(bench['meta'].get('device', ''))}, `{bench['meta'].get('command', '')}`: `decode` "
            f"geomean {gm:.3f}× cuDNN, worst row {min(ratios):.3f}×.\n\n"
            + markdown_table(["batch", "keys", "K/V heads", "decode TB/s", "cuDNN TB/s", "× cuDNN"], body))


def decode_splits_table(bench):
    """docs/decode.md: TB/s against the split count (bench.py --decode's split curve)."""
    body = [[r["num_splits"] if not r.get("auto") else f"{r['num_splits']} (auto)",
             f"{r['ms'] * 1e3:.1f}" if r.get("ms") else r.get("status", "—")[:30],
             f"{r['tbps']:.2f}" if r.get("tbps") else "—"]
            for r in bench["rows"] if r.get("mode") == "splits"]
    r0 = next((r for r in bench["rows"] if r.get("mode") == "splits"), None)
    if not r0:
        return "No split-curve rows in the newest decode result file."
    return (f"`decode`, batch {r0['batch']}, {r0['nheads_kv']} K/V heads, {r0['seqlen_k'] // 1024}k keys, "
            f"{gpu_short_name(bench['meta'].get('device', ''))}: {run_cite(bench)}.\n\n"
            + markdown_table(["splits", "µs", "TB/s"], body))


def decode_host_table(bench):
    """docs/decode.md: host µs per call and the per-call time on the GPU clock (no graph)."""
    body = [[f"`{r['kernel']}`", r["batch"], f"{r['seqlen_k'] // 1024}k", r["nheads_kv"],
             f"{r['host_us']:.1f}" if r.get("host_us") else r.get("status", "—")[:30],
             f"{r['call_us']:.1f}" if r.get("call_us") else "—"]
            for r in bench["rows"] if r.get("mode") == "host"]
    if not body:
        return "No host-time rows in the newest decode result file."
    rounds = max((r.get("rounds", 1) for r in bench["rows"] if r.get("mode") == "host"), default=1)
    host = ("mean over 200 calls with no synchronization" if rounds == 1 else
            f"the median of {rounds} bursts of 200 calls with no synchronization, the calls taking turns")
    return (f"{gpu_short_name(bench['meta'].get('device', ''))}, {run_cite(bench)}; host: {host}; "
            "per call: an event pair around the same 200 calls (whichever of host and GPU is slower).\n\n"
            + markdown_table(["call", "batch", "keys", "K/V heads", "host µs per call", "µs per call (GPU clock)"],
                             body))


def decode_pages_table(bench):
    """docs/decode.md: TB/s on a paged cache against the page size (bench.py --decode --pages-curve)."""
    rows = [r for r in bench["rows"] if r.get("mode") == "pages"]
    if not rows:
        return "No page-size rows in the newest decode result file."
    flat = {r["batch"]: r for r in rows if not r["page_size"] and r["kernel"] == "decode" and r.get("ms")}
    body = [[r["batch"], r["page_size"] or "contiguous", f"`{r['kernel']}`", r.get("page_boxes", "—"),
             f"{r['ms'] * 1e3:.1f}" if r.get("ms") else r.get("status", "—")[:60],
             f"{r['tbps']:.2f}" if r.get("tbps") else "—",
             f"{r['pct_peak']:.0f}%" if r.get("pct_peak") else "—",
             f"{flat[r['batch']]['ms'] / r['ms']:.3f}×" if r["batch"] in flat and r.get("ms") else "—"] for r in rows]
    r0 = rows[0]
    return (f"{gpu_short_name(bench['meta'].get('device', ''))}: `{bench['meta'].get('command', '')}`; "
            f"{r0['nheads_kv']} K/V heads, {r0['seqlen_k'] // 1024}k keys, d = {r0['head_dim']}, every cache copy's "
            "pages shuffled; kernel time by CUDA-graph replay, each candidate checked first.\n\n"
            + markdown_table(["batch", "page size", "kernel", "boxes per tile", "µs", "TB/s", "% of HBM peak",
                              "× contiguous `decode`"], body))


# docs/decode.md's blocks from bench.py --decode: marker, the rows' mode, generator.
DECODE_TABLES = (("decode", "grid", decode_table), ("decode-splits", "splits", decode_splits_table),
                 ("decode-host", "host", decode_host_table), ("decode-pages", "pages", decode_pages_table))


def fill_decode_page(text, runs, suffix=""):
    """``text`` with each decode block it has regenerated from ``runs`` (mode -> result file or
    None); a block whose run does not exist yet is left as it is. ``suffix`` names another GPU's
    blocks (``decode-h200``)."""
    for name, mode, make in DECODE_TABLES:
        if runs.get(mode) and f"<!-- table:{name}{suffix} -->" in text:
            text = replace_block(text, name + suffix, make(runs[mode]))
    return text


def k7_time_table(run):
    """docs/k7.md: scripts/time_k7.py rows, the pre-pass and the kernel apart, beside bf16 cuDNN."""
    body = [[r["head_dim"], r["causal"], r["seqlen"], f"{r['prepass_ms']:.3f}", f"{r['kernel_ms']:.3f}",
             fmt(r["kernel_tflops"]), fmt(r.get("k7_with_vt_tflops")), fmt(r["total_tflops"]),
             fmt(r["cudnn_bf16_tflops"]),
             fmt(r["cudnn_fp8_tflops"]) if r.get("cudnn_fp8_tflops") else r.get("cudnn_fp8_status", "—")[:30]]
            for r in run["rows"]]
    return (f"On an {gpu_short_name(run['meta'].get('device', ''))}: `{run['meta'].get('command', '')}`, "
            f"{run['meta'].get('date', '')[:10]}; batch 16384/N, heads 2048/d.\n\n"
            + markdown_table(["d", "causal", "N", "pre-pass ms", "kernel ms", "kernel TFLOP/s", "kernel + V^T TFLOP/s",
                              "with pre-pass TFLOP/s", "cuDNN bf16 TFLOP/s", "cuDNN FP8 TFLOP/s"], body))


FP8_STEPS = ("k7_k4", "k7", "k8")  # the FP8 sweep's stages (bench.py --dtype fp8 --sweep)


def fp8_sweep_table(sweep):
    """docs/k7.md: the FP8 sweep, every cell, the FP8 stages beside cuDNN FP8 (and bf16 peers for scale)."""
    rows = sweep_rows(sweep)
    steps = [k for k in FP8_STEPS if any(r["kernel"] == k for r in rows)]
    scale_peers = [p for p in ("sdpa-cudnn", "fa4") if any(r["kernel"] == p for r in rows)]
    cells = ws_cells(sweep)
    key = "call_tflops" if has_calls(sweep) else "tflops"

    def vs(k, n, d, c):
        t, best = tflops_at(rows, k, n, d, c, key), tflops_at(rows, BEST_OF_FP8[0], n, d, c, key)
        return t / best if t and best else None

    body = [[d, c, n] + [fmt(tflops_at(rows, k, n, d, c, key)) for k in steps + list(BEST_OF_FP8) + scale_peers]
            + [f"{vs('k7', n, d, c):.2f}×" if vs("k7", n, d, c) else "—"] for d, c, n in cells]
    gpu = gpu_short_name(sweep["meta"].get("device", ""))
    return (f"TFLOP/s on an {gpu}, batch = 16384/N, heads = 2048/d, all timed in one run: "
            f"`{sweep['meta'].get('command', '')}`, {sweep['meta'].get('date', '')[:10]}; "
            f"{CALL if key == 'call_tflops' else ALONE}. `k7_k4` and `k7` take "
            "e4m3 inputs (per-tensor descales) and include the V^T pass; `k8` takes the same sources quantized its "
            "own way (rotation, a scale per tile) and includes the V^T pass; cuDNN FP8 takes the same "
            "e4m3 tensors as `k7`; bf16 cuDNN and flash-attn-4 run on the bf16 sources, for scale.\n\n"
            + markdown_table(["d", "causal", "N"] + [f"`{k}`" for k in steps] + [f"*{p}*" for p in BEST_OF_FP8]
                             + [f"*{p}* (bf16)" for p in scale_peers] + ["k7 / cuDNN FP8"], body)
            + "\n\nAgainst cuDNN FP8 in each cell:\n\n" + fp8_summary(sweep))


def fp8_summary(sweep):
    """Per FP8 stage: geomean and worst ratio to cuDNN FP8 over the FP8 sweep (docs/k7.md, README):
    the public calls' where the run timed them, with the kernel alone's geomean and the worst
    cell's public call over the kernel alone beside."""
    rows = sweep_rows(sweep)
    calls = has_calls(sweep)
    body = []
    for k in (k for k in FP8_STEPS if any(r["kernel"] == k for r in rows)):
        ratio = {}
        for key in ("tflops", "call_tflops"):
            ratio[key] = [t / best for d, c, n in ws_cells(sweep)
                          if (t := tflops_at(rows, k, n, d, c, key)) and (best := tflops_at(rows, BEST_OF_FP8[0], n, d, c, key))]
        main = ratio["call_tflops" if calls else "tflops"]
        line = [f"`{k}`", f"{_geomean(main):.3f}×" if main else "—", f"{min(main):.2f}×" if main else "—",
                sum(x >= 1.0 for x in main), len(main)]
        if calls:
            own = [tflops_at(rows, k, n, d, c, "call_tflops") / tflops_at(rows, k, n, d, c)
                   for d, c, n in ws_cells(sweep) if tflops_at(rows, k, n, d, c, "call_tflops")]
            line += [f"{_geomean(ratio['tflops']):.3f}×", f"{min(own):.3f}×"]
        body.append(line)
    header = ["kernel", "geomean vs cuDNN FP8", "worst cell", "cells ≥ 1.0×", "cells"]
    if calls:
        header[1] += " (public calls)"
        header += ["geomean (kernels alone)", "worst cell: public call / kernel alone"]
    return markdown_table(header, body)


def fp8_rounds_table(runs):
    """docs/k7.md: K7's public call against its kernel alone where a single run's power cap moved them
    most (the long sequences), each cell timed in rounds."""
    body = []
    for f in sorted(runs, key=lambda f: f["file"]):
        for r in f["rows"]:
            if r["kernel"] == "k7" and r.get("call_tflops"):
                body.append([r["head_dim"], r["causal"], r["seqlen"], fmt(r["tflops"]), fmt(r["call_tflops"]),
                             f"{r['call_tflops'] / r['tflops']:.3f}×", f"{r['vs_best_peer']:.2f}×"])
    gpu = gpu_short_name(runs[0]["meta"].get("device", ""))
    return (f"{gpu}, each candidate timed 3 times per cell, the order reversed each round, the median: "
            + "; ".join(f"`{f['meta'].get('command', '')}`" for f in sorted(runs, key=lambda f: f["file"])) + ".\n\n"
            + markdown_table(["d", "causal", "N", "`k7` alone", "`k7` public call", "call / alone",
                              "call / cuDNN FP8's"], sorted(body)))


def fp8_tune_table(tunes):
    """docs/k7.md: scripts/tune_fp8.py runs, each configuration with its ratio to cuDNN FP8."""
    parts = []
    for tune in tunes:
        body = []
        for r in tune["rows"]:
            used = r.get("config_used") or {}
            default = ", ".join(f"{k}={used[k]}" for k in ("tile_n", "kv_stages", "pingpong", "overlap") if k in used)
            label = f"`{r['kernel']}`" + (" " + ", ".join(f"{k}={v}" for k, v in r["config"].items())
                                          if r["config"] else f" (the default then: {default})")
            ratio = r.get("vs_cudnn_fp8")
            body.append([r["head_dim"], r["causal"], r["seqlen"], label,
                         fmt(r["tflops"]) if r.get("tflops") else r.get("status", "—")[:40],
                         fmt(r.get("cudnn_fp8_tflops")), f"{ratio:.2f}×" if ratio else "—"])
        parts.append(f"On an {gpu_short_name(tune['meta'].get('device', ''))}: `{tune['meta'].get('command', '')}`, "
                     f"{tune['meta'].get('date', '')[:10]}; V^T pass included, each configuration checked first.\n\n"
                     + markdown_table(["d", "causal", "N", "configuration", "TFLOP/s", "cuDNN FP8", "× cuDNN FP8"], body))
    return "\n\n".join(parts)


def k8_time_table(run):
    """docs/k8.md: scripts/time_k7.py's K8 columns beside K7's, both with their pre-pass."""
    body = [[r["head_dim"], r["causal"], r["seqlen"], f"{r['k8_prepass_ms']:.3f}", f"{r['k8_kernel_ms']:.3f}",
             f"{r['kernel_ms']:.3f}", f"{r['k8_kernel_ms'] / r['kernel_ms']:.2f}",
             f"{(r['k8_kernel_ms'] + r['vt_pass_ms']) / (r['kernel_ms'] + r['vt_pass_ms']):.2f}",
             f"{(r['k8_prepass_ms'] + r['k8_kernel_ms']) / (r['prepass_ms'] + r['kernel_ms']):.2f}",
             fmt(r["k8_total_tflops"]), fmt(r["total_tflops"])]
            for r in run["rows"] if "k8_kernel_ms" in r]
    return (f"On an {gpu_short_name(run['meta'].get('device', ''))}: `{run['meta'].get('command', '')}`, "
            f"{run['meta'].get('date', '')[:10]}; batch 16384/N, heads 2048/d.\n\n"
            + markdown_table(["d", "causal", "N", "k8 pre-pass ms", "k8 kernel ms", "k7 kernel ms",
                              "k8 / k7 kernel time", "k8 / k7 time, e4m3 inputs (kernel + V^T)",
                              "k8 / k7 time from bf16, pre-passes in", "k8 TFLOP/s (with pre-pass)",
                              "k7 TFLOP/s (with pre-pass)"], body))


def fp8_accuracy_table(run):
    """docs/k8.md: scripts/fp8_accuracy.py, RMSE per method against float64, one row per input."""
    methods = ["bf16", "k7", "hadamard only", "block only", "k8", "cudnn-fp8"]
    cells, sources = {}, {}
    for r in run["rows"]:
        cells[(r["dist"], r["seqlen"], r["head_dim"])] = cells.get((r["dist"], r["seqlen"], r["head_dim"]), {})
        cells[(r["dist"], r["seqlen"], r["head_dim"])][r["method"]] = r["rmse"]
        sources[r["method"]] = r.get("source", "")
    body = []
    for (dist, n, d), e in cells.items():
        ratio = lambda a, b: f"{e[a] / e[b]:.2f}" if e.get(a) and e.get(b) else "—"  # noqa: E731
        body.append([dist, n, d] + [f"{e[m]:.2e}" if e.get(m) is not None else "—" for m in methods]
                    + [ratio("k8", "k7"), ratio("k8", "cudnn-fp8")])
    return (f"On an {gpu_short_name(run['meta'].get('device', '')) or 'CPU'}: `{run['meta'].get('command', '')}`, "
            f"{run['meta'].get('date', '')[:10]}. RMSE of O against float64 attention of the unquantized inputs; "
            f"cuDNN FP8: {sources.get('cudnn-fp8', '—')}.\n\n"
            + markdown_table(["inputs", "N", "d"] + methods + ["k8 / k7", "k8 / cuDNN FP8"], body))


DECODE_LATE_KNOBS = ("merge_prefetch", "prefetch_ahead", "prefetch_after_wait", "claim_after")


def decode_tune_table(tune):
    """docs/decode.md: scripts/tune_decode.py rows (tile configuration x split count)."""
    gpu = gpu_short_name(tune["meta"].get("device", ""))
    merges = {r.get("merge") for r in tune["rows"] if r.get("merge")}
    several_merges = len(merges) > 1
    late_knobs = any(r.get(k) for r in tune["rows"] for k in DECODE_LATE_KNOBS)
    body = []
    for r in tune["rows"]:
        split = f"{r['num_splits']}" + (" (auto)" if r.get("auto_splits") else "")
        ok = r.get("status") == "ok"
        # Runs before the L2 prefetch existed have no such field: they ran without it.
        # Knobs added later (absent: off), shown only where a run set them.
        extra = ", ".join(f"{k}={r[k]}" for k in DECODE_LATE_KNOBS if r.get(k))
        body.append([r["head_dim"], r["batch"], r["nheads_kv"], r["seqlen_k"], f"{r['tile_n']}:{r['kv_stages']}",
                     r.get("l2_prefetch", 0), "yes" if r.get("refill_at_release") else "no"]
                    + ([r.get("merge", "—")] if several_merges else []) + ([extra or "—"] if late_knobs else [])
                    + [split, f"{r['ms'] * 1e3:.1f}" if ok else r.get("status", "—")[:40],
                       f"{r['tbps']:.2f}" if ok else "—"])
    return (f"On an {gpu}: `{tune['meta'].get('command', '')}`, {tune['meta'].get('date', '')[:10]}; 32 query "
            f"heads, q_len 1, bf16{'; merged by ' + ', '.join(sorted(merges)) if merges and not several_merges else ''}.\n\n"
            + markdown_table(["d", "batch", "K/V heads", "keys", "tile_n:stages", "L2 prefetch", "refill at release"]
                             + (["merge"] if several_merges else []) + (["other"] if late_knobs else [])
                             + ["splits", "µs", "TB/s"], body))


def ws_readme_table(sweep):
    """README: the warp-specialized stages against the best peer over the whole sweep."""
    rows = sweep_rows(sweep)
    gpu = gpu_short_name(sweep["meta"].get("device", ""))
    key = "call_tflops" if has_calls(sweep) else "tflops"
    body = []
    for k in [k for k in WS_STEPS if any(r["kernel"] == k for r in rows)]:
        ratios = [_vs_best(rows, k, n, d, c, key)[1] for d, c, n in ws_cells(sweep)]
        known = [x for x in ratios if x]
        body.append([f"`{k}`", get_kernel(k).title, f"{_geomean(ratios):.3f}×" if known else "—",
                     f"{min(known):.2f}×" if known else "—", fmt(tflops_at(rows, k, 8192, 128, 0, key))])
    return (f"{len(ws_cells(sweep))} cells (d 64/128/256 × causal × N 512…16k), {gpu}, one run "
            f"(`{sweep['meta'].get('command', '')}`), {'the public calls' if has_calls(sweep) else 'the kernels alone'}:\n\n"
            + markdown_table(["kernel", "what it adds", "geomean × best peer", "worst cell", "d128 N=8k TFLOP/s"], body))


def k6_call_ratios(sweep) -> tuple:
    """Per cell of a sweep through the public call: k6's call over the faster peer's call, and k6
    alone over the faster peer alone (two lists, in ``ws_cells`` order)."""
    rows = sweep_rows(sweep)
    return tuple([_vs_best(rows, "k6", n, d, c, key)[1] for d, c, n in ws_cells(sweep)]
                 for key in ("call_tflops", "tflops"))


def ws_call_table(sweep):
    """docs/k6.md: K6 through its public call over the sweep, every cell: the kernel alone, the call,
    the peers' calls, and both ratios to the faster peer."""
    rows = sweep_rows(sweep)
    ratios, alone = k6_call_ratios(sweep)
    body = [[d, c, n, fmt(tflops_at(rows, "k6", n, d, c)), fmt(tflops_at(rows, "k6", n, d, c, "call_tflops"))]
            + [fmt(tflops_at(rows, p, n, d, c, "call_tflops")) for p in BEST_OF] + [f"{r:.2f}×", f"{a:.2f}×"]
            for (d, c, n), r, a in zip(ws_cells(sweep), ratios, alone)]
    gpu = gpu_short_name(sweep["meta"].get("device", ""))
    summary = (f"`k6` through `attention()`: geomean {_geomean(ratios):.3f}× the faster peer's call, worst cell "
               f"{min(ratios):.2f}×, {sum(x >= 1.0 for x in ratios)} of {len(ratios)} cells ≥ 1.0×; the kernel alone "
               f"{_geomean(alone):.3f}×, worst {min(alone):.2f}×.")
    return (f"TFLOP/s on an {gpu}, bf16, batch = 16384/N, heads = 2048/d, one run: "
            f"`{sweep['meta'].get('command', '')}`, {sweep['meta'].get('date', '')[:10]}. {summary}\n\n"
            + markdown_table(["d", "causal", "N", "`k6` alone", "`k6` public call"]
                             + [f"*{p}* call" for p in BEST_OF] + ["call / best peer's call", "alone / best peer"],
                             body))


def _k6_run_clause(sweep, ratios) -> str:
    """A README sentence's middle: the run, then k6's geomean and worst cell against the best peer."""
    return (f"(`{sweep['meta'].get('command', '')}`, {gpu_short_name(sweep['meta'].get('device', ''))}): "
            f"`k6` {_geomean(ratios):.3f}× geomean, worst cell {min(ratios):.2f}×")


def ws_call_readme(sweep):
    """README: one sentence on K6 through its public call."""
    ratios, alone = k6_call_ratios(sweep)
    return (f"Timed as a model calls it, `attention(\"k6\", ...)` eager and back to back beside the peers' own "
            f"calls {_k6_run_clause(sweep, ratios)} (the kernel alone in the same run: "
            f"{_geomean(alone):.3f}×, worst {min(alone):.2f}×; [K6](docs/k6.md#host-time) has every cell).")


def host_times_table(after, before=None):
    """docs/k6.md: host microseconds per call at a tiny shape, before the eager fast path and now,
    each beside SDPA's call in the same run."""
    def by_name(run):
        return {r["kernel"]: r for r in run["rows"] if r.get("host_us")} if run else {}

    now, then = by_name(after), by_name(before)
    sdpa = "sdpa (default backend)"

    def vs_sdpa(r, run):  # round by round where the run recorded it, else the medians' ratio
        if r.get("vs_baseline") is not None:
            return f"{r['vs_baseline']:.2f}×"
        return f"{r['host_us'] / run[sdpa]['host_us']:.2f}×" if sdpa in run else "—"

    body = []
    for name, r in now.items():
        was = then.get(name)
        body.append([name, fmt(was["host_us"]) if was else "—", vs_sdpa(was, then) if was else "—",
                     fmt(r["host_us"]), vs_sdpa(r, now), fmt(r.get("call_us"))])
    r0 = after["rows"][0]
    shape = f"B={r0['batch']} H={r0['nheads']} N={r0['seqlen']} d={r0['head_dim']}"
    runs = [f"`{run['meta'].get('command', '')}` ({run['meta'].get('date', '')[:10]}, commit "
            f"{(run['meta'].get('commit') or '?')[:7]})" for run in (before, after) if run]
    return (f"Host µs per call on an {gpu_short_name(after['meta'].get('device', ''))}'s host, bf16 "
            f"{shape}: the mean of 200 back-to-back calls with nothing synchronized, the median of 9 such bursts; "
            f"per call on the GPU clock: one event pair around 200 calls. From " + " and ".join(runs) + ". A host's "
            "speed moves from run to run and within one (SDPA's own call among them): the ratios compare each call's "
            "burst with SDPA's burst of the same round, the median over the rounds (runs before those were "
            "recorded: the ratio of the medians).\n\n"
            + markdown_table(["call", "µs before the fast path", "before / SDPA's call", "µs now", "now / SDPA's call",
                              "µs per call now (GPU clock)"], body))


def k6_rounds(sweep):
    """(k6's ratio to the best peer in every cell that has one, rounds per cell) of a rounds sweep."""
    rows = sweep_rows(sweep)
    ratios = [x for x in (_vs_best(rows, "k6", n, d, c)[1] for d, c, n in ws_cells(sweep)) if x]
    return ratios, max(len(r.get("ms_rounds", ())) for r in sweep["rows"])


def ws_rounds_readme(sweep):
    """README: k6 over the sweep timed in rounds (``bench.py --rounds``), one sentence."""
    ratios, rounds = k6_rounds(sweep)
    return (f"Timed again ({'the public calls' if has_calls(sweep) else 'the kernels alone'}) with each candidate "
            f"{rounds} times per cell, the order reversed each round, the median "
            f"{_k6_run_clause(sweep, ratios)} ([K6](docs/k6.md) lists every run).")


def ws_rounds_runs_table(runs):
    """docs/k6.md: every run of the rounds sweep, one line each, oldest first."""
    body = []
    for sweep in sorted(runs, key=lambda f: f["meta"].get("date", "")):
        ratios, rounds = k6_rounds(sweep)
        body.append([sweep["meta"].get("date", "")[:16].replace("T", " "), gpu_short_name(sweep["meta"].get("device", "")),
                     f"`{sweep['meta'].get('command', '')}`", rounds, f"{_geomean(ratios):.3f}×", f"{min(ratios):.2f}×",
                     sum(x >= 1.0 for x in ratios), len(ratios)])
    return markdown_table(["date (UTC)", "GPU", "command", "rounds", "`k6` geomean × best peer", "worst cell",
                           "cells ≥ 1.0×", "cells"], body)


def k4_steps_table(sweep, tune):
    """docs/k4.md: K4.1 -> K4.2 seed -> K4.2 tuned at the tuning run's seqlen. k4_qk from the
    sweep file, k4_seed and k4 from the tuning run's seed and default rows, peers from the tuning
    run: two runs, named in the caption."""
    rows = sweep_rows(sweep) if sweep else []
    n = tune["rows"][0]["seqlen"]
    body = []
    for d in sorted({r["head_dim"] for r in tune["rows"]}):
        for c in (0, 1):
            here = [r for r in tune["rows"] if r["head_dim"] == d and r["causal"] == c]
            seed = next((r["tflops"] for r in here if r.get("seed")), None)
            tuned = next((r["tflops"] for r in here if r.get("default")), None)
            qk = tflops_at(rows, "k4_qk", n, d, c)
            peers = {r["kernel"]: r["tflops"] for r in here if r["kernel"] in BEST_OF}
            ratio = lambda a, b: f"{a / b:.1f}×" if a and b else "—"  # noqa: E731
            body.append([d, c, fmt(qk), fmt(seed), fmt(tuned), ratio(seed, qk), ratio(tuned, seed)]
                        + [fmt(peers.get(p)) for p in BEST_OF])
    return (f"TFLOP/s at seqlen {n}, batch 2, heads 2048/d, bf16: `k4_qk` from `{sweep['meta'].get('command', '')}` "
            f"({gpu_short_name(sweep['meta'].get('device', ''))}, {sweep['meta'].get('date', '')[:10]}); `k4_seed`, "
            f"`k4` and the peers from `{tune['meta'].get('command', '')}` ({gpu_short_name(tune['meta'].get('device', ''))}, "
            f"{tune['meta'].get('date', '')[:10]}).\n\n"
            + markdown_table(["d", "causal", "`k4_qk`", "`k4_seed`", "`k4`", "seed / k4_qk", "k4 / seed"]
                             + [f"*{p}*" for p in BEST_OF], body))


def _label(r):
    cfg = r.get("config")
    return ", ".join(f"{k}={v}" for k, v in cfg.items()) if cfg else f"*{r['kernel']}*"


def plot(sweep, path, head_dim=128, dtype="bf16", peers=BEST_OF):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep_rows(sweep)
    gpu = gpu_short_name(sweep["meta"].get("device", ""))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, causal in zip(axes, (0, 1)):
        for k in kernel_names() + list(peers):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                         if r["kernel"] == k and r["head_dim"] == head_dim and r["causal"] == causal and r.get("tflops"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=k, linestyle="--" if k in PEERS or k in peers else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("seqlen")
        ax.set_title(f"{'causal' if causal else 'non-causal'}, d={head_dim}, {dtype}, {gpu}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)


def finished(pattern, partial=False) -> list:
    """The result files matching ``pattern`` whose run ended: one still running, or stopped part
    way, is left out (``meta.complete`` false; files before version 2 were written at the end)
    unless ``partial``."""
    paths = sorted(ROOT.glob(f"results/{pattern}"))
    found = [load(f) for f in paths]
    for f, path in zip(found, paths):  # runs on the GPU machine wrote under its $OUT; the files live in results/
        f["file"] = path.name
        f["meta"]["command"] = re.sub(r"/root/out/(results/)?", "results/", f["meta"].get("command", ""))
    return [f for f in found if partial or f["meta"].get("complete", True)]


def latest_with(pattern, kernels, partial=False):
    """The newest finished result file matching ``pattern`` that has rows of any of ``kernels``:
    a run of some stages only (the warp-specialized ones, say) leaves the others' tables be.
    ``partial``: a run stopped part way counts too (its table says so)."""
    found = [f for f in finished(pattern, partial) if any(r["kernel"] in kernels for r in f["rows"])]
    return max(found, key=lambda r: r["meta"].get("date", "")) if found else None


def merged_refcheck():
    """Every case of every finished refcheck run, for the README summary (a kernel's count adds up
    its runs: the full grid and, say, a later GQA run), but a run of a knob's build (``--config``),
    which is not the kernel a user calls."""
    return {"meta": {}, "rows": [r for f in finished("refcheck*.json") if "--config" not in f["meta"].get("command", "")
                                 for r in f["rows"]]}


HOST_RUN_CALLS = ("decode attention_with_kvcache", "decode plan.run", "sdpa (default backend)")


def decode_host_runs_table(runs) -> str:
    """Every run's host rows side by side (oldest first): host speed differs from machine to
    machine, so the one call is compared with ``plan.run`` and SDPA's call of the same run."""
    one, plan, sdpa = HOST_RUN_CALLS
    lines = []
    for f in sorted(runs, key=lambda f: f["meta"].get("date", "")):
        host = {(r["kernel"], r["batch"]): r["host_us"] for r in f["rows"] if r.get("mode") == "host" and r.get("host_us")}
        batches = sorted({b for _, b in host})
        if not batches or any((k, b) not in host for k in HOST_RUN_CALLS for b in batches):
            continue

        def per_batch(value, digits=1):
            return " / ".join(f"{value(b):.{digits}f}" for b in batches)
        lines.append([f"`{f['file']}`", " / ".join(str(b) for b in batches),
                      *(per_batch(lambda b, k=k: host[(k, b)]) for k in HOST_RUN_CALLS),
                      per_batch(lambda b: host[(one, b)] - host[(plan, b)]),
                      per_batch(lambda b: host[(one, b)] / host[(sdpa, b)], 2)])
    if not lines:
        return "No host-time rows in the result files."
    return markdown_table(["run", "batch", "one call µs", "`plan.run` µs", "SDPA's call µs", "one call − `plan.run`",
                           "one call / SDPA's"], lines)


def latest_with_mode(pattern, mode):
    """The newest finished result file matching ``pattern`` with rows of ``mode`` (``bench.py
    --decode``: grid, splits, host): a run of one part (--grid-only, --splits-curve) updates its
    tables and leaves the others' be."""
    found = [f for f in finished(pattern) if any(r.get("mode") == mode for r in f["rows"])]
    return newest(found)


def latest(pattern):
    """The finished result file matching ``pattern`` with the newest ``meta.date``."""
    return newest(finished(pattern))


TARGET_GPU = "H100"  # the issues' targets are an H100's: the main tables show its runs, other GPUs get their own
GPU_BLOCKS = ((TARGET_GPU, ""), ("H200", "-h200"))  # (GPU, suffix of the blocks its runs fill)


def newest(runs, gpu=None):
    """The newest of ``runs`` (result files), only those from a GPU whose name holds ``gpu`` if given."""
    runs = [f for f in runs if gpu is None or gpu_short_name(f["meta"].get("device", "")) == gpu]
    return max(runs, key=lambda f: f["meta"].get("date", "")) if runs else None


def fill(stem: str, name: str, make) -> None:
    """Table ``name`` from ``make()`` (called once, only if needed) into docs/<stem>.md and its
    companion docs/<stem>-runs.md, wherever the block's marker stands."""
    table = None
    for page in (ROOT / "docs" / f"{stem}.md", ROOT / "docs" / f"{stem}-runs.md"):
        if page.exists() and f"<!-- table:{name} -->" in (text := page.read_text()):
            table = make() if table is None else table
            page.write_text(replace_block(text, name, table))


def fill_varlen_page(refchecks) -> None:
    """docs/varlen.md: issue 35's tables, each from the newest run of its kind on the issues' GPU
    (TARGET_GPU); a kind not run yet leaves its block as it is. An H200's runs fill the blocks
    named with "-h200" (where the page has them)."""
    for gpu, sfx in GPU_BLOCKS:
        fill_varlen_runs(gpu, sfx)
    features = [f for f in refchecks if any(feature_row(r) for r in f["rows"])]
    if features:
        fill("varlen", "refcheck-features", lambda: feature_refcheck_table(features))


def fill_varlen_runs(gpu: str, sfx: str) -> None:
    def run(pattern):
        return newest(finished(pattern), gpu)

    varlen = [f for f in (run("varlen-noncausal-*.json"), run("varlen-causal-*.json")) if f]
    if varlen:
        fill("varlen", "varlen" + sfx, lambda: varlen_table(varlen))
    varlen_backward = [f for f in (run(f"varlen-backward-c{c}-*.json") for c in (0, 1)) if f]
    if varlen_backward:
        fill("varlen", "varlen-backward" + sfx, lambda: varlen_backward_table(varlen_backward))
    windows = [f for f in (run(f"window-{w}-*.json") for w in (1024, 4096)) if f]
    rect = run("window-same-flops-*.json")
    if windows:
        fill("varlen", "window" + sfx, lambda: window_table(windows, rect))
    backward = [f for f in (run(f"backward-window-{w}-*.json") for w in (1024, 4096)) if f]
    backward_rect = run("backward-window-same-flops-*.json")
    if backward:
        fill("varlen", "window-backward" + sfx, lambda: window_backward_table(backward, backward_rect))
    decode = [f for f in (run(f"decode-window-{w}-*.json") for w in (1024, 4096)) if f]
    if decode:
        fill("varlen", "decode-window" + sfx, lambda: decode_window_table(decode))
    pairs = [(run(f"{prefix}softcap-30-*.json"), run(f"{prefix}softcap-none-*.json")) for prefix in ("", "backward-")]
    pairs = [pair if all(pair) else None for pair in pairs]
    if any(pairs):
        fill("varlen", "softcap" + sfx, lambda: softcap_table(*pairs))
    if varlen or varlen_backward or windows or backward or any(pairs):
        fill("varlen", "targets" + sfx, lambda: issue35_targets(varlen, windows, rect, backward, pairs, varlen_backward,
                                                               backward_rect))
    packed_ab = run("ab-k10-packed-*.json")
    if packed_ab:
        fill("varlen", "packed-backward-ab" + sfx, lambda: packed_ab_table(packed_ab))
    cost = run("softcap-cost-*.json")
    if cost:
        fill("varlen", "softcap-cost" + sfx, lambda: softcap_cost_table(cost))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args(argv)
    if args.plot:  # before anything is rewritten: fail whole, not half done
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("error: --plot needs matplotlib: pip install -e \".[plot]\" (nothing was written)")
    sweep = latest("sweep*.json")
    readme = ROOT / "README.md"
    text = replace_block(readme.read_text(), "kernels", readme_table(sweep, merged_refcheck()))
    text = replace_block(text, "caps", caps_table())
    if "<!-- table:caps-backward -->" in text:
        text = replace_block(text, "caps-backward", backward_caps_table())
    bench_files = finished("bench-*.json")
    if bench_files and "<!-- table:headline -->" in text:
        text = replace_block(text, "headline", headline_table(bench_files))
    readme.write_text(text)
    refchecks = finished("refcheck*.json")
    for family, kernels in families().items():
        if sweep:
            fill(family, "sweep", lambda: family_table(sweep, kernels))
            fill(family, "k3depths", lambda: k3_depth_table(sweep))
        # Every refcheck run of the family's kernels, newest first: in brief, and one table each.
        runs = sorted((f for f in refchecks if any(r["kernel"] in kernels for r in f["rows"])),
                      key=lambda f: f["meta"].get("date", ""), reverse=True)
        if runs:
            fill(family, "refcheck-summary", lambda: refcheck_runs_summary(runs, kernels, family))
            fill(family, "refcheck", lambda: "\n\n".join(refcheck_table(f, kernels) for f in printed_in_full(runs)))
    # The step-by-step tables want a run of every stage; a run of k6 alone in rounds gets its own.
    ws_sweep = latest_with("ws-sweep*.json", ["k4", "k5"], partial=True)
    rounds_runs = [f for f in finished("ws-sweep-rounds*.json") if any(r["kernel"] == "k6" for r in f["rows"])]
    ws_rounds = newest(rounds_runs, TARGET_GPU) or newest(rounds_runs)
    h200_rounds = newest(rounds_runs, "H200")
    readme = ROOT / "README.md"
    if ws_sweep:
        if "<!-- table:ws -->" in readme.read_text():
            readme.write_text(replace_block(readme.read_text(), "ws", ws_readme_table(ws_sweep)))
    if ws_rounds and "<!-- table:ws-rounds-readme -->" in readme.read_text():
        runs = [ws_rounds] + ([h200_rounds] if h200_rounds and h200_rounds is not ws_rounds else [])
        readme.write_text(replace_block(readme.read_text(), "ws-rounds-readme",
                                        "\n\n".join(ws_rounds_readme(run) for run in runs)))
    ws_call = newest([f for f in finished("ws-sweep-call*.json") if has_calls(f)], TARGET_GPU)
    if ws_call:
        fill("k6", "ws-call", lambda: ws_call_table(ws_call))
        if "<!-- table:ws-call-readme -->" in readme.read_text():
            readme.write_text(replace_block(readme.read_text(), "ws-call-readme", ws_call_readme(ws_call)))
    host_after = newest(finished("host-times-h*.json"), TARGET_GPU)
    if host_after:
        before = newest(finished("host-times-before-*.json"), TARGET_GPU)
        fill("k6", "host-times", lambda: host_times_table(host_after, before))
    compile_files = finished("compile-ws-*.json")
    clocked = [f for f in rounds_runs if any(r.get("sm_clock_mhz") for r in f["rows"])]
    for stem in ("k5", "k6"):
        if ws_sweep:
            fill(stem, "ws-steps", lambda: ws_steps_table(ws_sweep))
        if ws_rounds:
            fill(stem, "ws-rounds", lambda: ws_steps_table(ws_rounds, calls=False))
        if h200_rounds:
            fill(stem, "ws-rounds-h200", lambda: ws_steps_table(h200_rounds, calls=False))
        if rounds_runs:
            fill(stem, "ws-rounds-runs", lambda: ws_rounds_runs_table(rounds_runs))
        if clocked:
            fill(stem, "power", lambda: power_table(newest(clocked, TARGET_GPU) or newest(clocked)))
        if compile_files:
            fill(stem, "ws-compile", lambda: ws_compile_table(compile_files))
    gqa_pairs = [(newest(finished("ws-gqa-g1-*.json"), gpu), newest(finished("ws-gqa-g4-*.json"), gpu))
                 for gpu in (TARGET_GPU, "H200")]  # the issues' GPU first
    gqa_pairs = [pair for pair in gqa_pairs if all(pair)]
    if gqa_pairs:
        fill("k6", "gqa", lambda: "\n\n".join(gqa_table(mha, gqa) for mha, gqa in gqa_pairs))
    # the K9 -> K10 step (both pages), and the default backward's own sweep
    for name, stems in (("backward-sweep", ("k9", "k10")), ("backward-default-sweep", ("k10",))):
        for gpu, sfx in GPU_BLOCKS:
            run = newest(finished(f"{name}-*.json"), gpu)
            for stem in stems if run else ():
                fill(stem, name + sfx, lambda run=run: backward_sweep_table(run))
    variants = [f for f in finished("backward-variants-*.json") if gpu_short_name(f["meta"].get("device", "")) == TARGET_GPU]
    if variants:  # one file per (d, causal) as scripts/reproduce.sh writes them, or one joined file
        joined = dict(meta=dict(newest(variants)["meta"], command=" ; ".join(f["meta"].get("command", "") for f in variants)),
                      rows=[r for f in variants for r in f["rows"]])
        fill("k10", "backward-variants", lambda: backward_sweep_table(joined))
    for gpu, sfx in GPU_BLOCKS:
        abs_ = [f for f in finished("ab-*.json") if gpu_short_name(f["meta"].get("device", "")) == gpu
                and not any("documents" in r for r in f["rows"])]  # packed ones: docs/varlen.md
        if abs_:  # scripts/ab_backward.py: a knob's checks, then its timings beside k10_fa3 and the peers
            fill("k10", "backward-ab" + sfx, lambda abs_=abs_: "\n\n".join(backward_ab_table(f) for f in abs_))
    backward_checks = sorted(finished("refcheck-backward-*.json"), key=lambda f: f["meta"].get("date", ""), reverse=True)
    if backward_checks:
        for stem in ("k9", "k10"):
            fill(stem, "refcheck-backward", lambda: refcheck_backward_table(backward_checks))
    fill_varlen_page(refchecks)
    training = newest(finished("training-*.json"), TARGET_GPU)
    if training:
        fill("k10", "training", lambda: training_table(training))
        if args.plot:
            plot_training(training, ROOT / "docs" / "plots" / "training.png")
    profiles = finished("ncu-profile-*.json")
    for stem, workload in (("k5", "bf16"), ("k6", "bf16"), ("k7", "fp8"), ("k8", "fp8"), ("decode", "decode"),
                           ("k10", "backward"), ("varlen", "softcap")):
        # the newest of the runs that profiled the most of this workload's jobs (a run of some jobs,
        # e.g. k6 and fa4 beside their softcap rows, leaves the others' table be)
        count = {id(f): sum(r["workload"] == workload for r in f["rows"]) for f in profiles}
        most = max(count.values(), default=0)
        run = newest([f for f in profiles if count[id(f)] == most], TARGET_GPU) if most else None
        if run:
            fill(stem, f"ncu-profile-{workload}", lambda run=run, workload=workload: ncu_profile_table(run, workload))
    compares = sorted(ROOT.glob("results/ncu-compare-*.txt"))
    if compares:
        fill("k6", "ncu-compare", lambda: "\n\n".join(ncu_compare_table(f) for f in compares))
    # the rectangular runs; the H200 block's prose reads the wide pre-pass's run (backward-kernels-wide-*)
    kernel_runs = [f for f in finished("backward-kernels-*.json") if "--varlen" not in f["meta"].get("command", "")]
    for stem, block, runs, gpu in (("k10", "backward-kernels", kernel_runs, TARGET_GPU),
                                   ("k10", "backward-kernels-h200", finished("backward-kernels-wide-*.json"), "H200"),
                                   ("varlen", "backward-kernels-varlen-h200", finished("backward-kernels-varlen-*.json"),
                                    "H200")):
        run = newest(runs, gpu)
        if run:
            fill(stem, block, lambda run=run: backward_kernels_table(run))
    stalls = finished("ncu-stalls-*.json")
    # a softcap's profile and the same workload's without it (the name less "-softcap"): docs/varlen.md
    capped = {f["file"] for f in stalls if f["rows"][0].get("softcap")}
    capped |= {name.replace("-softcap", "") for name in capped}
    if capped:
        pairs = [f for f in stalls if f["file"] in capped]
        fill("varlen", "ncu-stalls-softcap", lambda: "\n\n".join(ncu_stalls_table(f) for f in pairs))
    for stem, backward in (("k6", False), ("k10", True)):  # scripts/ncu_stalls.py [--backward]
        mine = [f for f in stalls if bool(f["rows"][0].get("backward")) == backward and f["file"] not in capped]
        if mine:
            fill(stem, "ncu-stalls", lambda mine=mine: "\n\n".join(ncu_stalls_table(f) for f in mine))
    sass = finished("sass-loops*.json")
    if sass:
        fill("k6", "sass-loops", lambda: sass_loops_table(sass))
    ws_tunes = finished("ws-tune*.json")
    softmax_tunes = [t for t in ws_tunes if any(k in SOFTMAX_KNOBS for r in t["rows"] for k in (r["config"] or {}))]
    cluster_tunes = [t for t in ws_tunes if any("cluster" in (r["config"] or {}) for r in t["rows"])]
    plain_tunes = [t for t in ws_tunes if t not in softmax_tunes and t not in cluster_tunes]
    for name, tunes in (("ws-tune", plain_tunes), ("ws-tune-softmax", softmax_tunes), ("ws-tune-cluster", cluster_tunes)):
        if tunes:
            fill("k6", name, lambda: "\n\n".join(ws_tune_table(t) for t in tunes))
    tune = latest("k4-tune*.json")
    if tune:
        fill("k4", "tune", lambda: tune_table(tune))
        fill("k4", "k4-steps", lambda: k4_steps_table(latest_with("sweep*.json", ["k4_qk"]), tune))
    page = ROOT / "docs" / "decode.md"
    decode_runs = {mode: latest_with_mode(f"decode-{TARGET_GPU.lower()}*.json", mode) or latest_with_mode("decode-h*.json", mode)
                   for mode in ("grid", "splits", "host", "pages")}
    if page.exists():
        h200 = {mode: latest_with_mode("decode-h200*.json", mode) for mode in ("grid", "splits", "host")}
        page.write_text(fill_decode_page(fill_decode_page(page.read_text(), decode_runs), h200, suffix="-h200"))
    for gpu in ("h100", "h200"):
        fill("decode", f"decode-host-runs-{gpu}", lambda gpu=gpu: decode_host_runs_table(finished(f"decode-{gpu}*.json")))
    if decode_runs["grid"] and "<!-- table:decode-readme -->" in readme.read_text():
        readme.write_text(replace_block(readme.read_text(), "decode-readme", decode_readme_table(decode_runs["grid"])))
    k7_compiles = finished("compile-k7-*.json")
    if k7_compiles:
        fill("k7", "k7-compile", lambda: ws_compile_table(k7_compiles))
    k7_time = latest("k7-time-*.json")
    if k7_time:
        fill("k7", "k7-time", lambda: k7_time_table(k7_time))
    fp8_sweep = latest("fp8-sweep-*.json")
    if fp8_sweep:
        fill("k7", "fp8-sweep", lambda: fp8_sweep_table(fp8_sweep))
    fp8_rounds = finished("fp8-rounds-call-*.json")
    if fp8_rounds:
        fill("k7", "fp8-rounds", lambda: fp8_rounds_table(fp8_rounds))
    if fp8_sweep and "<!-- table:fp8-readme -->" in readme.read_text():
        gpu = gpu_short_name(fp8_sweep["meta"].get("device", ""))
        readme.write_text(replace_block(readme.read_text(), "fp8-readme",
                                        f"On an {gpu}, d 128/256 × causal 0/1 × N 2k–16k, one run "
                                        f"(`{fp8_sweep['meta'].get('command', '')}`); "
                                        f"{CALL if has_calls(fp8_sweep) else ALONE}:\n\n" + fp8_summary(fp8_sweep)))
    fp8_tunes = finished("fp8-tune-*.json")
    if fp8_tunes:
        fill("k7", "fp8-tune", lambda: fp8_tune_table(fp8_tunes))
    if k7_time and any("k8_kernel_ms" in r for r in k7_time["rows"]):
        fill("k8", "k8-time", lambda: k8_time_table(k7_time))
    accuracy = latest("fp8-accuracy-*.json")
    if accuracy:
        fill("k8", "fp8-accuracy", lambda: fp8_accuracy_table(accuracy))
    decode_compiles = finished("compile-decode-*.json")
    if decode_compiles:
        fill("decode", "decode-compile", lambda: ws_compile_table(decode_compiles))
    decode_tunes = sorted(finished("decode-tune*.json"), key=lambda f: f["meta"].get("date", ""))
    if decode_tunes:
        fill("decode", "decode-tune", lambda: "\n\n".join(decode_tune_table(t) for t in decode_tunes))
    if args.plot and sweep:
        plot(sweep, ROOT / "docs" / "plots" / "tflops_vs_seqlen.png")
    if args.plot and ws_sweep:
        plot(ws_sweep, ROOT / "docs" / "plots" / "ws_vs_peers.png")
    if args.plot and fp8_sweep:  # K7/K8 beside cuDNN FP8 (and bf16 cuDNN for scale)
        for d in (128, 256):
            plot(fp8_sweep, ROOT / "docs" / "plots" / f"fp8_d{d}.png", d, "FP8 e4m3", BEST_OF_FP8 + ("sdpa-cudnn",))
    print("tables regenerated" + (" and plot written" if args.plot and sweep else ""))


if __name__ == "__main__":
    main()
