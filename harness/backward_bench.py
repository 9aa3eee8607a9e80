"""Time the backward as a user runs it (``bench.py --backward``): K9's and K10's through autograd
of ``attention(..., backward=...)``, beside cuDNN's and flash-attn-4's autograd backward, in the
same process.

Workload as the forward sweep's: bf16, batch = 16384/N, heads = 2048/d; FLOPs 2.5 x the
forward's (10 B H N^2 d, halved for causal). Every candidate's backward is timed after one forward
through ``torch.autograd.grad(..., retain_graph=True)`` (so one graph is timed), back to back,
eager (``call_ms``, ``harness.timing.burst_ms``): the time a training step spends. Our stages also
get ``ms``: their three launches alone (pre-pass, main kernel, post-pass) between CUDA events
(``harness.timing.benchmark``), so ``call_ms - ms`` is the host's share. ``k10_det``: K10 under
``torch.use_deterministic_algorithms(True)`` (dQ's shares added in a fixed order), timed beside
K10 whenever K10 is, to measure what the fixed order costs.
"""

from __future__ import annotations

# d = 256 too: K10 takes it (K10BackwardSplitD), K9 does not, and its rows say so beside the peers' times
SWEEP = dict(head_dims=(64, 128, 256), causals=(0, 1), seqlens=(1024, 4096, 16384))
STAGES = ("k9", "k10")  # unless told; harness.backward.STAGES lists every stage and variant
KERNEL_ROLES = (  # a backward's kernels by role (scripts/backward_kernels.py): the first pattern a name matches
    ("pre-pass", r"Prepass|preprocess|dot_do_o"),
    ("post-pass", r"Postpass|postprocess|convert_dq"),
    ("fill", r"FillFunc|Memset|fill|zero"),
    ("copy", r"elementwise_kernel|copy"),  # a torch copy of an operand
    ("main", r"."),
)


def kernel_role(kernel: str) -> str:
    import re

    return next(name for name, pattern in KERNEL_ROLES if re.search(pattern, kernel))


def candidates(q, k, v, do, causal: bool, scale: float, stages=STAGES, softcap: float = 0.0,
               window: tuple = (-1, -1)) -> dict:
    """name -> (the autograd backward, our launches alone or None), or for a stage that cannot
    run the problem, the reason (a string). With a softcap or a window, cuDNN (which has
    neither) sits out and flash-attn-4 gets the same options."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from harness import attention
    from harness.backward import stage_module, stage_overrides
    from harness.peers import fa4_feature_options, feature_options
    from kernels.contract import Problem

    b, h, n, d = q.shape
    p = Problem(b, h, n, d, causal=causal, softcap=softcap, window=window)
    features = feature_options(softcap, window)
    calls = dict(refusals(p, stages))
    extra = ("k10_det",) * ("k10" in stages and "k10" not in calls)
    for stage in tuple(s for s in stages if s not in calls) + extra:
        name = stage.removesuffix("_det")
        module, overrides = stage_module(name), dict(stage_overrides(name), **({"deterministic": True} if name != stage
                                                                                else {}))
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, lse = attention("k6", *leaves, causal=causal, softmax_scale=scale, return_lse=True, backward=name,
                             **features)
        compiled = module.compile_backward(p, **overrides)
        call = lambda o=out, ls=leaves: torch.autograd.grad(o, ls, do, retain_graph=True)  # noqa: E731
        calls[stage] = (deterministically(call) if stage == "k10_det" else call,
                        lambda m=module, c=compiled, o=out.detach(), lse=lse: m.run_backward(c, q, k, v, o, lse, do, scale))
    if not features:
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o_cudnn = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
        calls["sdpa-cudnn"] = (lambda: torch.autograd.grad(o_cudnn, leaves, do, retain_graph=True), None)
    try:
        from flash_attn.cute import flash_attn_func

        fa_leaves = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        o_fa = flash_attn_func(*fa_leaves, softmax_scale=scale, causal=causal,
                               **fa4_feature_options(causal, softcap, window))
        o_fa = o_fa[0] if isinstance(o_fa, tuple) else o_fa
        do_fa = do.transpose(1, 2).contiguous()
        calls["fa4"] = (lambda: torch.autograd.grad(o_fa, fa_leaves, do_fa, retain_graph=True), None)
    except Exception as e:  # noqa: BLE001  (not installed: no row)
        print(f"fa4: {type(e).__name__}: {e}"[:200])
    return calls


def refusals(p, stages) -> dict:
    """stage -> why it cannot run ``p`` (the stages that can are left out)."""
    from harness.backward import stage_module
    from kernels.contract import UnsupportedProblem

    found = {}
    for stage in stages:
        try:
            stage_module(stage).check(p)
        except UnsupportedProblem as e:
            found[stage] = str(e)
    return found


def deterministically(fn):
    """``fn`` called under ``torch.use_deterministic_algorithms(True)``."""
    import torch

    def call():
        torch.use_deterministic_algorithms(True)
        try:
            return fn()
        finally:
            torch.use_deterministic_algorithms(False)
    return call


def run(emit, head_dims, causals, seqlens, stages=STAGES, softcap: float = 0.0, window: tuple = (-1, -1),
        batch_heads=None) -> None:
    """One row per candidate and cell, emitted as it is timed; ``vs_best_peer`` compares autograd
    calls (ours against the faster of cuDNN's and flash-attn-4's). ``batch_heads``: (batch, heads)
    in place of the sweep's 16384/N and 2048/d."""
    import torch

    from kernels.contract import Problem

    from .config import default_batch_heads
    from .timing import benchmark, burst_ms, tflops

    for d in head_dims:
        for causal in causals:
            for n in seqlens:
                b, h = batch_heads or default_batch_heads(n, d)
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                # 2.5 x the forward's count, a window's on the pairs it keeps
                flops = 2.5 * Problem(b, h, n, d, causal=bool(causal), window=window).flops
                extra = dict(({"softcap": softcap} if softcap else {}), **({"window": list(window)}
                                                                         if window != (-1, -1) else {}))
                rows = []
                for name, entry in candidates(q, k, v, do, bool(causal), d ** -0.5, stages, softcap, window).items():
                    if isinstance(entry, str):
                        rows.append(dict(kernel=name, batch=b, nheads=h, seqlen=n, head_dim=d, causal=int(causal),
                                         **extra, status=f"unsupported: {entry}"[:300]))
                        continue
                    call, launches = entry
                    try:
                        call_ms = burst_ms(call)
                        ms = benchmark(launches) if launches else None
                        row = dict(status="ok", call_ms=call_ms, call_tflops=tflops(flops, call_ms),
                                   ms=ms, tflops=tflops(flops, ms) if ms else None)
                    except Exception as e:  # noqa: BLE001  (a candidate that fails: a row that says so)
                        row = dict(status=f"failed: {type(e).__name__}: {e}"[:300])
                    rows.append(dict(kernel=name, batch=b, nheads=h, seqlen=n, head_dim=d, causal=int(causal), **extra,
                                     **row))
                ours = stages + ("k10_det",)
                peers = [r["call_ms"] for r in rows if r["kernel"] not in ours and r.get("call_ms")]
                for row in rows:
                    if row["kernel"] in ours and row.get("call_ms") and peers:
                        row["vs_best_peer"] = min(peers) / row["call_ms"]
                    emit(row)


def format_row(row: dict) -> str:
    if row["status"] != "ok":
        return f"d={row['head_dim']} causal={row['causal']} N={row['seqlen']:>5} {row['kernel']:<11} {row['status']}"
    launches = f"  launches {row['tflops']:6.1f}" if row.get("tflops") else ""
    ratio = f"  {row['vs_best_peer']:.3f}x best peer" if "vs_best_peer" in row else ""
    return (f"d={row['head_dim']} causal={row['causal']} N={row['seqlen']:>5} {row['kernel']:<11} "
            f"{row['call_ms']:8.3f} ms {row['call_tflops']:7.1f} TFLOP/s{launches}{ratio}")
