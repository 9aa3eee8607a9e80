"""Where each stage's time goes, from Nsight Compute counters, beside the peers (GPU machine, ``ncu``
on PATH):

    python scripts/ncu_profile.py --out results/ncu-profile-h100.json
    python scripts/ncu_profile.py --jobs k6 fa4          # some of the candidates

Per candidate (a stage's public call or a peer's call) one ``ncu`` process runs this script with
``--job NAME``: the job warms its call up (the JIT compile, the prepared call, the caches), then
runs it once between cudaProfilerStart and cudaProfilerStop (``--profile-from-start off``), so
only that call's kernels are profiled. Its row is the call's longest kernel (K7/K8's V^T pass and
decode's combine are the short ones; their count is in the row). Metrics: duration, tensor-pipe
and issue-slot activity, MUFU (XU) pipe use, instructions executed, and the warp-stall breakdown
(cycles per issued instruction by reason, over all warps: a warp-specialized kernel's producer
and its idle warps count too). ``--clock-control none``: the card runs at its own clocks, so read
ratios, not absolute times. Rows go to --out as they are made.

Workloads: prefill bf16 and FP8 (e4m3 inputs with descales) at d = 128, N = 8192, non-causal,
batch 2 x 16 heads (bench.py's 16384/N and 2048/d), the bf16 one also with a softcap of 30 and
through autograd's backward (``bwd-*``: the backward's main kernel); decode at batch 8, 32 query
heads on 8 K/V heads, 32k keys, d = 128 (bench.py --decode's grid).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import results  # noqa: E402

STALLS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
          "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
          "short_scoreboard", "sleeping", "tex_throttle", "wait")
METRICS = {
    "gpu__time_duration.sum": "duration_us",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu_pipe_pct",
    "smsp__inst_executed.sum": "instructions",
    **{f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio": f"stall_{s}" for s in STALLS},
}
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}  # durations to microseconds
PREFILL = dict(batch=2, nheads=16, seqlen=8192, head_dim=128)
DECODE = dict(batch=8, kv_len=32768, nheads_kv=8)
# name -> (workload, what the docs call it)
JOBS = {
    "k5": ("bf16", "k5"), "k6_pp": ("bf16", "k6_pp"), "k6_overlap": ("bf16", "k6_overlap"), "k6": ("bf16", "k6"),
    "sdpa-cudnn": ("bf16", "cuDNN (SDPA)"), "fa4": ("bf16", "flash-attn-4"),
    "k7": ("fp8", "k7"), "k8": ("fp8", "k8"), "cudnn-fp8": ("fp8", "cuDNN FP8"),
    "decode": ("decode", "decode"), "decode_combine": ("decode", "decode_combine"),
    "decode-sdpa-cudnn": ("decode", "cuDNN (SDPA)"), "decode-fa4": ("decode", "flash-attn-4"),
    "k6-softcap": ("softcap", "k6, softcap 30"), "fa4-softcap": ("softcap", "flash-attn-4, softcap 30"),
    "bwd-k9": ("backward", "k9"), "bwd-k10": ("backward", "k10"), "bwd-k10_fa3": ("backward", "k10_fa3"),
    "bwd-sdpa-cudnn": ("backward", "cuDNN (SDPA)"), "bwd-fa4": ("backward", "flash-attn-4"),
}
SOFTCAP = 30.0


def job_call(name: str):
    """The zero-argument call that job ``name`` profiles, on fresh random inputs."""
    from harness import attention
    from harness.api import fp8_inputs
    from harness.inputs import random_inputs
    from harness.peers import cudnn_fp8_peer, peer_callables
    from kernels.contract import Problem

    workload = JOBS[name][0]
    if workload == "decode":
        from harness.decode_bench import Inputs, kernel_step, peer_steps

        inputs = Inputs(**DECODE)
        if name in ("decode", "decode_combine"):
            step = kernel_step(name, inputs)[1]
            return lambda: step(0)
        step, context = peer_steps(inputs)[name.split("-", 1)[1]]

        def peer():
            with context():
                step(0)
        return peer
    p = Problem(**PREFILL)
    q, k, v = random_inputs(p)
    if workload == "softcap":
        if name.startswith("k"):
            return lambda: attention(name.split("-")[0], q, k, v, softcap=SOFTCAP)
        return peer_callables(q, k, v, False, p.scale, SOFTCAP)[name.split("-")[0]]
    if workload == "backward":  # the autograd backward after one forward, as bench.py --backward times it
        import torch

        from harness.backward_bench import candidates

        stage = name.split("-", 1)[1]
        calls = candidates(q, k, v, torch.randn_like(q), False, p.scale, stages=(stage,) if stage[0] == "k" else ())
        return calls[stage][0]
    if workload == "bf16":
        if name.startswith("k"):
            return lambda: attention(name, q, k, v)
        return peer_callables(q, k, v, False, p.scale)[name]
    q8, k8, v8, descales, three = fp8_inputs(q, k, v, blocks=name == "k8")
    if name in ("k7", "k8"):
        return lambda: attention(name, q8, k8, v8, **descales)
    call = cudnn_fp8_peer(q8, k8, v8, three, False, p.scale)
    if isinstance(call, str):
        raise SystemExit(f"cudnn-fp8: {call}")
    return call


def run_job(name: str) -> None:
    """Inside ncu: warm the call up, then run it once with the profiler on."""
    import torch

    call = job_call(name)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def number(x: str) -> float:
    return float(x.replace(",", ""))


def profile(name: str) -> dict:
    """One ncu process for job ``name``: the row of the call's longest kernel."""
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--metrics", ",".join(METRICS), "--csv",
           sys.executable, __file__, "--job", name]
    text = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                          env=dict(os.environ)).stdout
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise RuntimeError(f"{name}: no metrics in ncu's output: {text[-1500:]}")
    kernels = {}
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if r.get("Metric Name") in METRICS:
            k = kernels.setdefault(r["ID"], {"kernel_name": r["Kernel Name"]})
            value = number(r["Metric Value"])
            k[METRICS[r["Metric Name"]]] = value * TO_US.get(r["Metric Unit"], 1.0)
    if not kernels:
        raise RuntimeError(f"{name}: ncu profiled no kernel")
    main = max(kernels.values(), key=lambda k: k.get("duration_us", 0))
    workload, label = JOBS[name]
    shape = DECODE if workload == "decode" else PREFILL
    return dict(job=name, label=label, workload=workload, **shape, kernels_in_call=len(kernels),
                **{k: (v[:80] if isinstance(v, str) else v) for k, v in main.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    ap.add_argument("--job", choices=list(JOBS), help=argparse.SUPPRESS)  # inside ncu
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.job:
        run_job(args.job)
        return 0
    out = results.open_result_file(args.out, results.command_line("scripts/ncu_profile.py", argv))
    for name in args.jobs:
        try:
            row = dict(profile(name), status="ok")
        except Exception as e:  # noqa: BLE001  (a peer that will not run: a row that says so)
            row = dict(job=name, label=JOBS[name][1], workload=JOBS[name][0], status=str(e)[:300])
        if out:
            out.append(row)
        stalls = sorted(((k[6:], v) for k, v in row.items() if k.startswith("stall_")), key=lambda kv: -kv[1])[:3]
        print(f"{name:<18} {row.get('duration_us', 0):9.1f} us  tensor {row.get('tensor_pipe_pct', 0):5.1f}%  "
              f"issue {row.get('issue_active_pct', 0):5.1f}%  " + ", ".join(f"{s} {v:.2f}" for s, v in stalls)
              + ("" if row["status"] == "ok" else f"  {row['status'][:120]}"), flush=True)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
