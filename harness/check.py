"""Correctness: run a kernel on fresh random inputs with poisoned outputs and compare to SDPA."""

from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass
from typing import NamedTuple

from kernels import get_kernel
from kernels.contract import FP8_DTYPES, Problem, UnsupportedProblem

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
# tanh.approx.f32's relative error (PTX ISA: 2^-10.987): a capped score c*t is off by up to c*2^-11,
# and so, at most, is the LSE (a smooth max of the scores)
TANH_APPROX_REL = 2.0 ** -11


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
                    nheads_kv=p.kv_heads, seqlen_k=p.kv_len, **problem_extras(p))


def problem_extras(p: Problem) -> dict:
    """The fields a case's result row adds where they are not the defaults: softcap, window, scale."""
    return dict(**({"softcap": p.softcap} if p.softcap else {}),
                **({"window": list(p.window)} if p.window != (-1, -1) else {}),
                **({"softmax_scale": p.softmax_scale} if p.softmax_scale is not None else {}))


class Comparison(NamedTuple):
    max_abs: float
    rel_l2: float
    lse_max_abs: float
    peer_max_abs: float
    verdict: str  # empty: pass; otherwise every failed criterion, named


def compare(out, ref, lse, ref_lse, dtype: str, peer=None, lse_slack: float = 0.0) -> Comparison:
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
        ldiff = lse_gap(lse, ref_lse)
        lse_max_abs = float(ldiff.max()) if ldiff.numel() else 0.0
        # The relative part is of a finite LSE only: where the reference is -inf, |-inf| would
        # let anything pass (NaN's infinite gap included); there the LSE must be -inf exactly.
        tol = LSE_ATOL + lse_slack + LSE_RTOL * ref_lse.float().abs().nan_to_num(posinf=0.0)
        if not bool((ldiff <= tol).all()):
            reasons.append(f"lse max_abs {lse_max_abs:.3g} beyond {LSE_ATOL + lse_slack:g} + {LSE_RTOL:g}*|lse|")
    return Comparison(max_abs, rel_l2, lse_max_abs, peer_max_abs, "; ".join(reasons))


def lse_gap(lse, ref_lse):
    """|lse - ref_lse| elementwise, where a row that sees no key has LSE -inf in both: equal, 0
    apart (not inf - inf = NaN). NaN, or -inf against a finite value, is an infinite gap."""
    import torch

    l, rl = lse.float(), ref_lse.float()
    return torch.where(l == rl, torch.zeros_like(l), (l - rl).abs()).nan_to_num(nan=math.inf, posinf=math.inf)


def launch_once(name: str, p: Problem, seed=None, config=None) -> tuple:
    """(q, k, v, out, lse): fresh random inputs, NaN-poisoned outputs, one launch, synchronized.
    ``config``: compile_kernel keywords (a non-default configuration); None: the default build."""
    import torch

    from .api import compiled_for
    from .inputs import poisoned_outputs, random_inputs

    compiled = get_kernel(name).compile(p, **config) if config else compiled_for(name, p)
    q, k, v = random_inputs(p, seed=seed)
    out, lse = poisoned_outputs(p)
    get_kernel(name).run(compiled, q, k, v, out, lse, p.scale)
    torch.cuda.synchronize()
    return q, k, v, out, lse


def check_kernel(name: str, p: Problem, seed=None, config=None) -> CheckResult:
    """One case: fresh inputs, poisoned O/LSE, one launch, compare with the float32 reference."""
    if is_fp8_kernel(name):  # FP8: its own criterion (check_fp8_kernel)
        if config:
            raise UnsupportedProblem("check_kernel: a config for the FP8 kernels is not supported")
        return check_fp8_kernel(name, p, seed)

    from .reference import reference, sdpa

    q, k, v, out, lse = launch_once(name, p, seed, config)
    ref, ref_lse = reference(q, k, v, p.causal, p.scale, p.softcap, p.window)
    plain = not p.softcap and p.window == (-1, -1)
    peer = sdpa(q, k, v, p.causal, p.scale) if plain else None  # SDPA has no softcap or window: the elementwise bar
    c = compare(out, ref, lse, ref_lse, p.dtype, peer, lse_slack=p.softcap * TANH_APPROX_REL)
    return CheckResult(name, p, c.max_abs, c.rel_l2, c.lse_max_abs, not c.verdict, c.verdict, c.peer_max_abs)


# The backward's bar: each gradient's max error against float64 autograd at most twice that of
# SDPA's own 16-bit backward on the same inputs, plus GRAD_FLOOR (issue 34).
GRAD_FLOOR = 1e-3


def check_backward(p: Problem, forward: str = "k6", seed=None, magnitude: float = 1.0, backward: str = "k9",
                   overrides: dict | None = None) -> dict:
    """One backward case: fresh inputs (times ``magnitude``) and dO, O and LSE from ``forward``,
    the ``backward`` stage's (k9, k10; compiled with ``overrides``) dq, dk, dv into NaN-poisoned
    tensors, each compared with float64 autograd."""
    import torch

    from .backward import stage_module, stage_overrides

    stage = stage_module(backward)
    compile_backward, run_backward = stage.compile_backward, stage.run_backward
    overrides = dict(stage_overrides(backward), **(overrides or {}))

    from .api import attention
    from .inputs import random_inputs
    from .reference import reference_grads

    q, k, v = (t * magnitude for t in random_inputs(p, seed=seed))
    dout = torch.randn_like(q)
    out, lse = attention(forward, q, k, v, causal=p.causal, softmax_scale=p.softmax_scale, return_lse=True,
                         softcap=p.softcap, window_size=p.window)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    run_backward(compile_backward(p, **overrides), q, k, v, out, lse, dout, p.scale, grads)
    torch.cuda.synchronize()
    want = reference_grads(q, k, v, dout, p.causal, p.scale, p.softcap, p.window)
    peer, bounds = grad_peer(q, k, v, dout, p.causal, p.scale, p.softcap, p.window)
    row, reasons = backward_case(p, magnitude, forward, backward), []
    for name, max_abs, peer_max_abs, reason in grad_verdicts(grads, want, peer, bounds):
        row.update({f"{name}_max_abs": max_abs, f"{name}_sdpa_max_abs": peer_max_abs})
        reasons += [reason] if reason else []
    return dict(row, ok=not reasons, reason="; ".join(reasons), status="ok" if not reasons else "failed")


def grad_verdicts(grads, want, peer, bounds) -> list:
    """Per gradient (dq, dk, dv): (name, max_abs against the float64 ``want``, the peer's, and the
    reason it fails the bar, or None); NaN fails."""
    verdicts = []
    for name, got, ref, sdpa_grad, bound in zip(("dq", "dk", "dv"), grads, want, peer, bounds):
        err = (got.double() - ref).abs().nan_to_num(float("inf"))
        peer_max_abs = float((sdpa_grad.double() - ref).abs().max())
        ok = within_grad_bar(beyond(err, bound), peer_max_abs)
        verdicts.append((name, float(err.max()), peer_max_abs, None if ok else grad_bar_reason(name, err, peer_max_abs,
                                                                                             bound)))
    return verdicts


def grad_peer(q, k, v, dout, causal: bool, scale: float, softcap: float = 0.0, window=(-1, -1)) -> tuple:
    """(the 16-bit peer's dq, dk, dv; per gradient, None or an elementwise bound each error may
    use before the bar): SDPA's own backward, or with a softcap (SDPA has none)
    ``capped_grads_16bit``'s flash backward with ``known_max_rounding_bound``'s dq and dk terms."""
    from .reference import capped_grads_16bit, known_max_rounding_bound, sdpa_grads

    if not softcap:
        return sdpa_grads(q, k, v, dout, causal, scale, window), (None, None, None)
    bound_dq, bound_dk = known_max_rounding_bound(q, k, v, dout, causal, scale, softcap, window)
    return capped_grads_16bit(q, k, v, dout, causal, scale, softcap, window), (bound_dq, bound_dk, None)


def beyond(err, bound) -> float:
    """The largest error left once each element's ``bound`` (None: none) is taken off it."""
    return float(err.max() if bound is None else (err - bound).max())


def within_grad_bar(max_abs: float, peer_max_abs: float) -> bool:
    return max_abs <= PEER_FACTOR * peer_max_abs + GRAD_FLOOR


def grad_bar_reason(name: str, err, peer_max_abs: float, bound=None) -> str:
    over = (f"max_abs {float(err.max()):.3g}" if bound is None
            else f"max_abs beyond the rounding bound {beyond(err, bound):.3g}")
    return f"{name} {over} > {PEER_FACTOR:g} x the 16-bit peer's {peer_max_abs:.3g} + {GRAD_FLOOR:g}"


def backward_case(p: Problem, magnitude: float, forward: str = "k6", backward: str = "k9") -> dict:
    """The fields that name a backward case in its result row (``check_backward``'s, or a crash's)."""
    return dict(kernel=backward, forward=forward, batch=p.batch, nheads=p.nheads, seqlen=p.seqlen, head_dim=p.head_dim,
                dtype=p.dtype, causal=int(p.causal), nheads_kv=p.kv_heads, seqlen_k=p.kv_len, magnitude=magnitude,
                **problem_extras(p))


@dataclass
class KVCacheCase:
    """One attention_with_kvcache / decode_plan check (see ``check_kvcache``)."""

    kernel: str
    batch: int
    nheads: int
    nheads_kv: int
    q_len: int
    s_cache: int
    head_dim: int
    causal: bool = False
    lengths: object = None  # None (all rows), an int, or a list (one per sequence)
    num_splits: int = 0
    dtype: str = "bfloat16"
    graph: bool = False  # capture plan.run, change q and the lengths in place, replay
    page_size: int = 0  # > 0: the caches cut into pages of this many rows, shuffled (``paged_cache``)
    window: tuple = (-1, -1)  # a sliding window_size (left, right), bottom-right

    def label(self) -> str:
        lens = self.lengths if not isinstance(self.lengths, list) or len(self.lengths) <= 4 else "per-batch"
        return (f"{self.kernel} b={self.batch} h={self.nheads}/{self.nheads_kv} q_len={self.q_len} "
                f"s_cache={self.s_cache} d={self.head_dim} causal={int(self.causal)} lens={lens} "
                f"splits={self.num_splits or 'auto'} {self.dtype}" + (" graph" if self.graph else "")
                + (f" pages={self.page_size}" if self.page_size else "")
                + (f" window={self.window}" if tuple(self.window) != (-1, -1) else ""))


def paged_cache(k, v, page_size: int, lengths: list, gen):
    """The contiguous caches (batch, s_cache, heads_kv, d) cut into pages of ``page_size`` rows,
    the pages shuffled into one pool, and the int32 page table that puts them back in order. The
    pool has one more page, all NaN; the last page of a sequence is padded with NaN, and the table
    entries of pages wholly past a sequence's length name the NaN page (no page may be loaded through them)."""
    import torch

    b, s, h, d = k.shape
    per_seq = -(-s // page_size)
    nan_page = b * per_seq
    perm = torch.randperm(b * per_seq, generator=gen, device=k.device)
    table = perm.view(b, per_seq).to(torch.int32)
    for bi, n in enumerate(lengths):
        table[bi, -(-n // page_size):] = nan_page
    pools = []
    for x in (k, v):
        padded = x.new_full((b, per_seq * page_size, h, d), float("nan"))
        padded[:, :s] = x
        pool = x.new_full((nan_page + 1, page_size, h, d), float("nan"))
        pool[perm] = padded.view(b * per_seq, page_size, h, d)
        pools.append(pool)
    return pools[0], pools[1], table


def check_kvcache(case: KVCacheCase, seed=None) -> dict:
    """One KV-cache case on fresh inputs whose cache rows past each sequence's length hold NaN and
    +inf (they must never reach the result). Checked, each against the float64 reference with
    ``compare``'s rule (O within twice SDPA's own 16-bit error, SDPA run on the same sequences:
    ``sdpa_kvcache``; relative L2; LSE, -inf where a row sees no key):
    * ``attention_with_kvcache`` (its outputs are its own: the allocator is handed NaN-filled
      blocks of their sizes first, which it usually gives back);
    * a forced split count: LSE within LSE_ATOL of the automatic count's (fp32 summation order);
    * causal at q_len 1: bitwise equal to non-causal (the one query sees every key), under
      ``torch.use_deterministic_algorithms`` (by default decode's splits claim tiles at run time);
    * per-sequence lengths: ``decode_plan(...).run`` after a warm-up, its returned (plan-owned)
      buffers NaN-filled before each run, twice; then a plan made under
      ``torch.use_deterministic_algorithms``, three runs bitwise equal;
      with ``graph``, that run captured in a CUDA graph, q and the lengths rewritten in place,
      the buffers poisoned, and the graph replayed.
    Returns a result row (the worst errors over the checks)."""
    import torch

    from .inputs import torch_dtype
    from .kvcache import attention_with_kvcache, decode_plan
    from .reference import cache_lengths, pages_to_cache, reference_kvcache, sdpa_kvcache

    c = case
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    dt = torch_dtype(c.dtype)
    q = torch.randn((c.batch, c.q_len, c.nheads, c.head_dim), generator=gen, device="cuda", dtype=dt)
    k, v = (torch.randn((c.batch, c.s_cache, c.nheads_kv, c.head_dim), generator=gen, device="cuda", dtype=dt)
            for _ in range(2))
    lens = torch.tensor(c.lengths, dtype=torch.int32, device="cuda") if isinstance(c.lengths, list) else c.lengths
    for b, n in enumerate(cache_lengths(lens, c.batch, c.s_cache)):  # stale rows: NaN and +inf in K and in V
        k[b, n:] = float("nan") if b % 2 else float("inf")
        v[b, n:] = float("inf") if b % 2 else float("nan")
    scale = c.head_dim ** -0.5
    reasons, worst = [], dict(max_abs=0.0, rel_l2=0.0, lse_max_abs=0.0, peer_max_abs=0.0)
    table = None
    if c.page_size:  # the kernels read the shuffled pages; the reference reads them through the table
        contiguous = (k, v)
        k, v, table = paged_cache(k, v, c.page_size, cache_lengths(lens, c.batch, c.s_cache), gen)

    def expected():  # for the current q, lengths (and pages)
        kc, vc = (k, v) if table is None else (pages_to_cache(k, table), pages_to_cache(v, table))
        return (*reference_kvcache(q, kc, vc, lens, c.causal, scale, window=c.window),
                sdpa_kvcache(q, kc, vc, lens, c.causal, scale, window=c.window))

    def judge(tag, out, lse, want):
        cmp = compare(out, want[0], lse, want[1], c.dtype, peer=want[2])
        for key in worst:
            worst[key] = max(worst[key], getattr(cmp, key))
        if cmp.verdict:
            reasons.append(f"{tag}: {cmp.verdict}")

    def call(num_splits=c.num_splits, causal=c.causal):
        _poison_next_alloc(q.shape, dt, (c.batch, c.nheads, c.q_len))
        return attention_with_kvcache(q, k, v, lens, page_table=table, causal=causal, num_splits=num_splits,
                                      return_lse=True, kernel=c.kernel, window_size=c.window)

    want = expected()
    out, lse = call()
    judge("attention_with_kvcache", out, lse, want)
    if c.page_size:  # the same tiles, whatever the pages: the same bits as on the contiguous cache
        with deterministic():
            o_p, lse_p = call()
            o_c, lse_c = attention_with_kvcache(q, *contiguous, lens, causal=c.causal, num_splits=c.num_splits,
                                                return_lse=True, kernel=c.kernel, window_size=c.window)
        if not (torch.equal(o_p, o_c) and torch.equal(lse_p, lse_c)):
            reasons.append("paged differs from the contiguous cache it was cut from")
    if c.num_splits and c.kernel != "decode_nosplit":
        gap = float(lse_gap(lse, call(num_splits=0)[1]).max())
        if not gap <= LSE_ATOL:
            reasons.append(f"num_splits={c.num_splits} vs auto: lse apart by {gap:.3g} > {LSE_ATOL:g}")
    if c.causal and c.q_len == 1:
        with deterministic():  # claimed tiles add up in a different order each call
            o_c, lse_c = call()
            o_nc, lse_nc = call(causal=False)
        if not (torch.equal(o_c, o_nc) and torch.equal(lse_c, lse_nc)):
            reasons.append("causal at q_len 1 differs from non-causal")
    if isinstance(c.lengths, list):  # a plan takes lengths as a tensor only
        def make_plan():
            return decode_plan(c.batch, c.nheads, c.nheads_kv, c.head_dim, c.s_cache, q_len=c.q_len, dtype=c.dtype,
                               causal=c.causal, num_splits=c.num_splits, kernel=c.kernel, page_size=c.page_size,
                               window_size=c.window)

        plan = make_plan()
        o, l = plan.run(q, k, v, lens, table)  # warm-up (compiles); o, l: the plan's buffers, the same every run
        runs = []
        for _ in range(2):
            _poison(o, l)
            o, l = plan.run(q, k, v, lens, table)
            runs.append((o.clone(), l.clone()))
        for run in runs:
            judge("plan.run", *run, want)
        with deterministic():  # the plan is fixed when made: its runs must agree to the bit
            fixed = make_plan()
        if fixed.info.get("claim_after"):
            reasons.append("deterministic plan: still claims tiles")
        same = []
        for _ in range(3):
            o_d, l_d = fixed.run(q, k, v, lens, table)
            same.append((o_d.clone(), l_d.clone()))
            _poison(o_d, l_d)
        judge("deterministic plan.run", *same[0], want)
        if not all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(same, same[1:])):
            reasons.append("deterministic plan.run: runs differ")
        if c.graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                plan.run(q, k, v, lens, table)
            q.copy_(torch.randn(q.shape, generator=gen, device="cuda", dtype=dt))
            # Shorter (the stale rows stay past them), down to 0 where a length was 0 or 1.
            lens.copy_((lens - 1 - torch.arange(c.batch, device="cuda", dtype=torch.int32)).clamp_min(0))
            if table is not None:  # the pages shuffled anew, in place: the replay must read the new table
                for now, new in zip((k, v, table), paged_cache(*contiguous, c.page_size,
                                                                cache_lengths(lens, c.batch, c.s_cache), gen)):
                    now.copy_(new)
            _poison(o, l)
            graph.replay()
            torch.cuda.synchronize()
            judge("graph replay", o, l, expected())
    torch.cuda.synchronize()
    return dict(kernel=c.kernel, case=c.label(), batch=c.batch, nheads=c.nheads, nheads_kv=c.nheads_kv, seqlen=c.q_len,
                seqlen_k=c.s_cache, head_dim=c.head_dim, dtype=c.dtype, causal=int(c.causal), num_splits=c.num_splits,
                **({"window": list(c.window)} if tuple(c.window) != (-1, -1) else {}),
                **worst, ok=not reasons, reason="; ".join(reasons)[:300])


@contextlib.contextmanager
def deterministic():
    """``torch.use_deterministic_algorithms(True)`` for the block (warn_only: torch's own ops
    inside it may stay as they are), then as it was."""
    import torch

    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _poison(*tensors):
    for t in tensors:
        t.fill_(float("nan"))


def _poison_next_alloc(o_shape, dtype, lse_shape):
    """Free NaN-filled CUDA blocks of the sizes a call is about to allocate for O and the fp32
    LSE: torch's caching allocator hands a freed block of the right size back first, so rows the
    call never writes most likely read NaN rather than whatever the last case left there."""
    import torch

    blocks = [torch.full(o_shape, float("nan"), device="cuda", dtype=dtype),
              torch.full(lse_shape, float("nan"), device="cuda", dtype=torch.float32)]
    del blocks


FP8_FACTOR, FP8_FLOOR = 1.5, 1e-3  # vs the emulation's error: same quantization points, slack for rounding order
# Hopper's FP8 WGMMA accumulates with fewer bits than fp32 (DeepSeek-V3's report: about 14), so
# scores of e4m3 inputs, and the LSE, drift from an fp32 sum (1.25e-3 on an H100 at d = 64; bf16
# kernels stay near 1e-5). A score's drift grows with its dot product's length d (more partial sums,
# each larger) and with the softmax scale, so the bar grows as scale * d from 4e-3 at d = 64's
# default scale; the figures behind it are in docs/k7.md (Correctness).
FP8_LSE_ATOL = 4e-3


def fp8_lse_bar(p: Problem) -> float:
    return FP8_LSE_ATOL * max(1.0, p.scale * p.head_dim / 8)


def is_fp8_kernel(name: str) -> bool:
    """Whether ``name`` is an FP8 stage (its capabilities take e4m3 inputs): it is checked by
    ``check_fp8_kernel``, whatever the dtype of the problem it is given."""
    return any(dt in FP8_DTYPES for dt in get_kernel(name).caps.dtypes)


def emulate_fp8(q8, k8, v8, descale, causal: bool, scale: float, p_offset: float = 8.0):
    """K7's arithmetic in float32 torch: scores of the e4m3 inputs, P = exp2(s - rowmax + offset)
    rounded to e4m3, O = (P8 . V) / sum(P) with the unrounded sum (a row max over all keys, where
    the kernel's is running: the same quantization points, up to where P's rounding falls).
    ``descale``: (q, k, v) numbers (K7), or K8's per-row tensors shaped (.., Nq, 1), (.., 1, Nk)
    and (.., Nk, 1) to broadcast over the scores and V."""
    import math

    import torch

    from .reference import causal_keep

    dq, dk, dv = (x if torch.is_tensor(x) and x.dim() > 0 else float(x) for x in descale)
    s = (q8.float() @ k8.float().transpose(-1, -2)) * dq * dk * (scale * math.log2(math.e))
    if causal:
        s = s.masked_fill(~causal_keep(q8.shape[2], k8.shape[2], q8.device), -math.inf)
    p = torch.exp2(s - s.amax(dim=-1, keepdim=True) + p_offset)
    p8 = p.clamp(max=448.0).to(torch.float8_e4m3fn).float()
    return (p8 @ (v8.float() * dv)) / p.sum(dim=-1, keepdim=True)


def check_fp8_kernel(name: str, p: Problem, seed=None) -> CheckResult:
    """An FP8 stage (K7, K8): fresh 16-bit inputs, poisoned outputs, one launch (quantization
    included); the reference is exact attention of the *dequantized* inputs (input rounding is
    the same for any FP8 kernel and not the kernel's doing). O passes within FP8_FACTOR x the
    error of ``emulate_fp8`` against that reference (+ FP8_FLOOR) in max and relative L2; LSE,
    from fp32 scores of the same e4m3 inputs, within ``fp8_lse_bar``."""
    import torch

    from .reference import reference

    q, k, v, out, lse = launch_once(name, p, seed)
    q8, k8, v8, (dq, dk, dv) = fp8_quantized(name, p, q, k, v)
    if p.group > 1:  # GQA: every query head against its K/V head (and K8's per-head tile descales)
        k8, v8, dk, dv = (x.repeat_interleave(p.group, dim=1) if x.dim() == 4 else x for x in (k8, v8, dk, dv))
    deq = [x8.float() * d for x8, d in ((q8, dq), (k8, dk.transpose(-1, -2) if dk.dim() else dk), (v8, dv))]
    ref, ref_lse = reference(*deq, p.causal, p.scale)
    emu = emulate_fp8(q8, k8, v8, (dq, dk, dv), p.causal, p.scale).to(out.dtype)  # O is stored in 16 bits too
    o, r = out.float(), ref.float()
    reasons = []
    if not torch.isfinite(o).all():
        reasons.append(f"{int((~torch.isfinite(o)).sum())} non-finite outputs")
    diff = (o - r).abs().nan_to_num(float("inf"))
    emu_diff = (emu.float() - r).abs()
    max_abs, emu_max = float(diff.max()), float(emu_diff.max())
    norm = torch.linalg.vector_norm(r).clamp_min(1e-30)
    rel_l2, emu_l2 = float(torch.linalg.vector_norm(diff) / norm), float(torch.linalg.vector_norm(emu_diff) / norm)
    if not max_abs <= FP8_FACTOR * emu_max + FP8_FLOOR:
        reasons.append(f"max_abs {max_abs:.3g} > {FP8_FACTOR:g} x emulation's {emu_max:.3g} + {FP8_FLOOR:g}")
    if not rel_l2 <= FP8_FACTOR * emu_l2 + FP8_FLOOR:
        reasons.append(f"rel_l2 {rel_l2:.3g} > {FP8_FACTOR:g} x emulation's {emu_l2:.3g} + {FP8_FLOOR:g}")
    ldiff = (lse.float() - ref_lse.float()).abs().nan_to_num(float("inf"))
    lse_max, lse_bar = float(ldiff.max()), fp8_lse_bar(p)
    if not lse_max <= lse_bar:
        reasons.append(f"lse max_abs {lse_max:.3g} > {lse_bar:.3g}")
    return CheckResult(name, p, max_abs, rel_l2, lse_max, not reasons, "; ".join(reasons), emu_max)


def fp8_quantized(name: str, p: Problem, q, k, v) -> tuple:
    """The FP8 inputs ``name``'s pre-pass makes of q, k, v (the same arithmetic, so the same
    bytes): (q8, k8, v8, descales) with V in its natural layout and descales broadcastable as
    ``emulate_fp8`` takes them. K8's Q and K come rotated; their scores are still Q K^T."""
    from harness.api import fp8_inputs
    from kernels.k8 import block_sizes

    blocks = get_kernel(name).block_descales
    q8, k8, v8, descales, _ = fp8_inputs(q, k, v, blocks)
    dq, dk, dv = descales.values()
    if not blocks:  # per-tensor scales
        return q8, k8, v8, (dq, dk, dv)
    tm, tn = block_sizes(p.head_dim)  # the default configuration's tiles, which the check compiles
    rows = lambda d, block, n: d.repeat_interleave(block, dim=-1)[..., :n, None]  # noqa: E731
    return q8, k8, v8, (rows(dq, tm, q.shape[2]), rows(dk, tn, k.shape[2]).transpose(-1, -2),
                        rows(dv, tn, v.shape[2]))


def check_varlen_case(name: str, lengths_q: list, lengths_k: list, nheads: int, nheads_kv: int, head_dim: int,
                      causal: bool, softcap: float = 0.0, window=(-1, -1), dtype: str = "bfloat16",
                      cu_on_cpu: bool = False, seed=None) -> dict:
    """One packed case: fresh random inputs, O and LSE NaN-poisoned before the launch
    (``prepare_varlen``'s own buffers), compared with the float64 reference built sequence by
    sequence (``varlen.reference``) by ``compare``'s rule; the peer is SDPA in the 16-bit dtype,
    sequence by sequence with the same mask (none with a softcap: SDPA has no cap, and the
    elementwise bound stands in). Returns a result row."""
    import torch
    import torch.nn.functional as F

    from .inputs import torch_dtype
    from .varlen import keep_mask, prepare_varlen, reference, with_causal

    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    dt = torch_dtype(dtype)
    q = torch.randn(sum(lengths_q), nheads, head_dim, device="cuda", dtype=dt, generator=gen)
    k, v = (torch.randn(sum(lengths_k), nheads_kv, head_dim, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                               device="cpu" if cu_on_cpu else "cuda") for x in (lengths_q, lengths_k))
    scale = head_dim ** -0.5
    row = dict(kernel=name, lengths_q=list(lengths_q), lengths_k=list(lengths_k), nheads=nheads, nheads_kv=nheads_kv,
               head_dim=head_dim, dtype=dtype, causal=int(causal), softcap=softcap, window=list(window),
               cu_seqlens_on_cpu=cu_on_cpu)
    launch, out, lse = prepare_varlen(name, q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                      softmax_scale=scale, return_lse=True, softcap=softcap or None,
                                      window_size=tuple(window))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, scale, causal=causal, window=tuple(window), softcap=softcap)
    peer = None
    if not softcap:
        peer = torch.zeros_like(q)
        qs, ks = cu_q.tolist(), cu_k.tolist()
        for b in range(len(lengths_q)):
            if lengths_q[b] == 0:
                continue
            mask = keep_mask(lengths_q[b], lengths_k[b], with_causal(tuple(window), causal), q.device)
            seq = [t[a:z].transpose(0, 1)[None] for t, (a, z) in ((q, qs[b:b + 2]), (k, ks[b:b + 2]), (v, ks[b:b + 2]))]
            o = F.scaled_dot_product_attention(*seq, attn_mask=mask, scale=scale, enable_gqa=nheads != nheads_kv)
            peer[qs[b]:qs[b + 1]] = o[0].transpose(0, 1).nan_to_num(0.0)  # a row that sees no key: 0, as ours
    c = compare(out, ref, lse, ref_lse, dtype, peer=peer, lse_slack=softcap * TANH_APPROX_REL)
    return dict(row, max_abs=c.max_abs, peer_max_abs=c.peer_max_abs, rel_l2=c.rel_l2, lse_max_abs=c.lse_max_abs,
                ok=not c.verdict, reason=c.verdict)


def check_varlen_backward_case(stage: str, lengths_q: list, lengths_k: list, nheads: int, nheads_kv: int,
                               head_dim: int, causal: bool, softcap: float = 0.0, window=(-1, -1),
                               dtype: str = "bfloat16", cu_on_cpu: bool = False, seed=None) -> dict:
    """One packed backward case: fresh inputs and dO, O and LSE from K6's packed forward, the
    ``stage``'s dq, dk, dv (``attention_varlen_backward``) into NaN-poisoned tensors; each
    sequence's gradients against float64 autograd of that sequence alone (``reference_grads``),
    with ``check_backward``'s bar (twice the 16-bit peer's error on that sequence, + GRAD_FLOOR);
    a sequence without queries must get dK = dV = 0 exactly. Returns a result row (the worst
    sequence's errors)."""
    import torch

    from .inputs import torch_dtype
    from .reference import reference_grads
    from .varlen import attention_varlen, attention_varlen_backward

    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    dt = torch_dtype(dtype)
    q, dout = (torch.randn(sum(lengths_q), nheads, head_dim, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    k, v = (torch.randn(sum(lengths_k), nheads_kv, head_dim, device="cuda", dtype=dt, generator=gen) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                               device="cpu" if cu_on_cpu else "cuda") for x in (lengths_q, lengths_k))
    scale, window = head_dim ** -0.5, tuple(window)
    row = dict(kernel=stage, lengths_q=list(lengths_q), lengths_k=list(lengths_k), nheads=nheads, nheads_kv=nheads_kv,
               head_dim=head_dim, dtype=dtype, causal=int(causal), softcap=softcap, window=list(window),
               cu_seqlens_on_cpu=cu_on_cpu, backward=True)
    lengths = (max(lengths_q), max(lengths_k))
    out, lse = attention_varlen("k6", q, k, v, cu_q, cu_k, *lengths, causal=causal, softmax_scale=scale,
                                return_lse=True, softcap=softcap or None, window_size=window)
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, *lengths, causal=causal, softmax_scale=scale,
                              backward=stage, softcap=softcap or None, window_size=window, grads=grads)
    torch.cuda.synchronize()
    worst, reasons = {f"{g}_{e}": 0.0 for g in ("dq", "dk", "dv") for e in ("max_abs", "sdpa_max_abs")}, []
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows_q, rows_k = slice(qs[b], qs[b + 1]), slice(ks[b], ks[b + 1])
        if lengths_q[b] == 0:  # its keys see no query: their gradients are exactly 0
            if not all(bool((g[rows_k] == 0).all()) for g in grads[1:]):
                reasons.append(f"sequence {b} (no queries): dk, dv not all 0")
            continue
        # contiguous (1, heads, n, d) copies: SDPA's 16-bit backward is the peer, as in check_backward
        seq = [t[rows].transpose(0, 1)[None].contiguous() for t, rows in ((q, rows_q), (k, rows_k), (v, rows_k),
                                                                          (dout, rows_q))]
        want = reference_grads(*seq, causal, scale, softcap, window)
        peer, bounds = grad_peer(*seq, causal, scale, softcap, window)
        got = [g[rows].transpose(0, 1)[None] for g, rows in zip(grads, (rows_q, rows_k, rows_k))]
        for name, max_abs, peer_max_abs, reason in grad_verdicts(got, want, peer, bounds):
            reasons += [f"sequence {b}: {reason}"] if reason else []
            worst[f"{name}_max_abs"] = max(worst[f"{name}_max_abs"], max_abs)
            worst[f"{name}_sdpa_max_abs"] = max(worst[f"{name}_sdpa_max_abs"], peer_max_abs)
    return dict(row, **worst, ok=not reasons, reason="; ".join(reasons)[:300], status="ok" if not reasons else "failed")
