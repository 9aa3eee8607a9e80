"""Correctness: run a kernel on fresh random inputs with poisoned outputs and compare to SDPA."""

from __future__ import annotations

from dataclasses import dataclass

from kernels.contract import Problem

# |out - ref| <= atol + rtol * |ref| elementwise, and a bound on the relative L2 error.
# bf16 keeps 8 mantissa bits: rounding O alone costs ~2^-9 relative, and the tensor-core
# stages round P to bf16 before PV as well. fp16 keeps 11 bits.
TOLERANCES = {
    "bfloat16": dict(atol=1e-2, rtol=2e-2, rel_l2=1e-2),
    "float16": dict(atol=2e-3, rtol=5e-3, rel_l2=3e-3),
}
LSE_ATOL, LSE_RTOL = 2e-3, 1e-3


@dataclass
class CheckResult:
    kernel: str
    problem: Problem
    max_abs: float
    rel_l2: float
    lse_max_abs: float
    ok: bool
    reason: str = ""

    def row(self) -> dict:
        p = self.problem
        return dict(kernel=self.kernel, batch=p.batch, nheads=p.nheads, seqlen=p.seqlen, head_dim=p.head_dim,
                    dtype=p.dtype, causal=int(p.causal), max_abs=self.max_abs, rel_l2=self.rel_l2,
                    lse_max_abs=self.lse_max_abs, ok=self.ok, reason=self.reason)


def compare(out, ref, lse, ref_lse, dtype: str):
    """Error metrics and verdict. NaN or Inf anywhere (an unwritten poisoned element) fails."""
    import torch

    tol = TOLERANCES[dtype]
    o, r = out.float(), ref.float()
    reasons = []
    if not torch.isfinite(o).all():
        reasons.append(f"{int((~torch.isfinite(o)).sum())} non-finite outputs")
    diff = (o - r).abs()
    max_abs = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
    rel_l2 = float(torch.linalg.vector_norm((o - r).nan_to_num(float("inf"))) / torch.linalg.vector_norm(r).clamp_min(1e-30))
    if not bool((diff <= tol["atol"] + tol["rtol"] * r.abs()).all()):
        reasons.append(f"max_abs {max_abs:.3g} beyond atol {tol['atol']} + rtol {tol['rtol']}*|ref|")
    if not rel_l2 <= tol["rel_l2"]:
        reasons.append(f"rel_l2 {rel_l2:.3g} > {tol['rel_l2']}")
    lse_max_abs = float("nan")
    if lse is not None:
        l, rl = lse.float(), ref_lse.float()
        ldiff = (l - rl).abs()
        lse_max_abs = float(ldiff.nan_to_num(float("inf")).max()) if ldiff.numel() else 0.0
        if not bool((ldiff <= LSE_ATOL + LSE_RTOL * rl.abs()).all()):
            reasons.append(f"lse max_abs {lse_max_abs:.3g} beyond tolerance")
    return max_abs, rel_l2, lse_max_abs, "; ".join(reasons)


def check_kernel(name: str, p: Problem, seed=None) -> CheckResult:
    """One case: fresh inputs, poisoned O/LSE, one launch, compare with the float32 reference."""
    import torch

    from kernels import get_kernel

    from .api import compiled_for
    from .inputs import poisoned_outputs, random_inputs
    from .reference import reference

    entry = get_kernel(name)
    compiled = compiled_for(name, p)
    q, k, v = random_inputs(p, seed=seed)
    out, lse = poisoned_outputs(p)
    entry.caps.check_device(torch.cuda.get_device_capability())
    entry.run(compiled, q, k, v, out, lse, p.scale)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, p.causal, p.scale)
    max_abs, rel_l2, lse_err, reason = compare(out, ref, lse, ref_lse, p.dtype)
    return CheckResult(name, p, max_abs, rel_l2, lse_err, not reason, reason)
