"""Correctness: run a kernel on fresh random inputs with poisoned outputs and compare to SDPA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kernels.contract import Problem

# Against the float32 reference, a kernel's O must be
#   * no worse than twice the max error of SDPA itself run in the same 16-bit dtype on the same
#     inputs (the flash-attention tests' criterion: whatever rounding O and P to 16 bits costs
#     SDPA, we may cost at most twice), plus PEER_FLOOR for cases where SDPA is exact (seqlen 1);
#   * within REL_L2 in relative L2 norm (bf16 keeps 8 mantissa bits, fp16 11).
# Without a peer (CPU unit tests) an elementwise atol + rtol*|ref| bound stands in for the first.
PEER_FACTOR, PEER_FLOOR = 2.0, 1e-4
REL_L2 = {"bfloat16": 5e-3, "float16": 1e-3}
ELEMENTWISE = {"bfloat16": dict(atol=1e-2, rtol=2e-2), "float16": dict(atol=2e-3, rtol=5e-3)}
# LSE is FP32 throughout in every kernel: errors seen on an H200 stay under 1e-5.
LSE_ATOL, LSE_RTOL = 1e-4, 1e-5


@dataclass
class CheckResult:
    kernel: str
    problem: Problem
    max_abs: float
    rel_l2: float
    lse_max_abs: float
    ok: bool
    reason: str = ""
    peer_max_abs: float = float("nan")

    def row(self) -> dict:
        p = self.problem
        return dict(kernel=self.kernel, batch=p.batch, nheads=p.nheads, seqlen=p.seqlen, head_dim=p.head_dim,
                    dtype=p.dtype, causal=int(p.causal), max_abs=self.max_abs, rel_l2=self.rel_l2,
                    lse_max_abs=self.lse_max_abs, peer_max_abs=self.peer_max_abs, ok=self.ok, reason=self.reason,
                    nheads_kv=p.kv_heads, seqlen_k=p.kv_len)


class Comparison(NamedTuple):
    max_abs: float
    rel_l2: float
    lse_max_abs: float
    peer_max_abs: float
    verdict: str  # empty: pass; otherwise every failed criterion, named


def compare(out, ref, lse, ref_lse, dtype: str, peer=None) -> Comparison:
    """Error metrics of ``out``/``lse`` against the reference, and the verdict.

    NaN or Inf anywhere (an element left poisoned) fails. ``peer`` is SDPA's output in the
    inputs' dtype, when a GPU ran it.
    """
    import torch

    o, r = out.float(), ref.float()
    reasons = []
    if not torch.isfinite(o).all():
        reasons.append(f"{int((~torch.isfinite(o)).sum())} non-finite outputs")
    diff = (o - r).abs().nan_to_num(float("inf"))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel_l2 = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(r).clamp_min(1e-30))
    peer_max_abs = float("nan")
    if peer is not None:
        peer_max_abs = float((peer.float() - r).abs().max()) if r.numel() else 0.0
        if not max_abs <= PEER_FACTOR * peer_max_abs + PEER_FLOOR:
            reasons.append(f"max_abs {max_abs:.3g} > {PEER_FACTOR:g} x SDPA's {peer_max_abs:.3g} + {PEER_FLOOR:g}")
    else:
        tol = ELEMENTWISE[dtype]
        if not bool((diff <= tol["atol"] + tol["rtol"] * r.abs()).all()):
            reasons.append(f"max_abs {max_abs:.3g} beyond atol {tol['atol']} + rtol {tol['rtol']}*|ref|")
    if not rel_l2 <= REL_L2[dtype]:
        reasons.append(f"rel_l2 {rel_l2:.3g} > {REL_L2[dtype]}")
    lse_max_abs = float("nan")
    if lse is not None:
        l, rl = lse.float(), ref_lse.float()
        ldiff = (l - rl).abs().nan_to_num(float("inf"))
        lse_max_abs = float(ldiff.max()) if ldiff.numel() else 0.0
        if not bool((ldiff <= LSE_ATOL + LSE_RTOL * rl.abs()).all()):
            reasons.append(f"lse max_abs {lse_max_abs:.3g} beyond {LSE_ATOL:g} + {LSE_RTOL:g}*|lse|")
    return Comparison(max_abs, rel_l2, lse_max_abs, peer_max_abs, "; ".join(reasons))


def check_kernel(name: str, p: Problem, seed=None) -> CheckResult:
    """One case: fresh inputs, poisoned O/LSE, one launch, compare with the float32 reference."""
    import torch

    from kernels import get_kernel

    from .api import compiled_for
    from .inputs import poisoned_outputs, random_inputs
    from .reference import reference, sdpa

    entry = get_kernel(name)
    compiled = compiled_for(name, p)
    q, k, v = random_inputs(p, seed=seed)
    out, lse = poisoned_outputs(p)
    entry.run(compiled, q, k, v, out, lse, p.scale)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, p.causal, p.scale)
    peer = sdpa(q, k, v, p.causal, p.scale)
    c = compare(out, ref, lse, ref_lse, p.dtype, peer)
    return CheckResult(name, p, c.max_abs, c.rel_l2, c.lse_max_abs, not c.verdict, c.verdict, c.peer_max_abs)
