"""Packed batches (varlen), sliding windows and softcap: what a call may ask, checked before any
launch, and what it means, as one mask over (query, key) positions.

A packed batch is flash-attn's layout: q (total_q, heads, d), k and v (total_k, heads_kv, d), and
``cu_seqlens_q``/``cu_seqlens_k``, int32 prefix sums (batch + 1,) starting at 0, so that sequence
b holds rows cu[b]:cu[b + 1]. Within a sequence, causal and the window are aligned bottom-right:
query i of a sequence with n_q queries and n_k keys sees key j where, with j' = j - (n_k - n_q),
i - left <= j' <= i + right (left, right = -1: unbounded; causal: right = 0). A softcap c > 0
turns a scaled score s into c * tanh(s / c) before the softmax.
"""

from __future__ import annotations

import functools
import math
import numbers

from kernels.contract import UnsupportedProblem, as_softcap, as_window  # noqa: F401 (this module's API too)


def with_causal(window: tuple, causal: bool) -> tuple:
    """The window a causal call keeps: its right edge at most 0."""
    left, right = window
    return (left, 0 if causal and (right == -1 or right > 0) else right)


_READ: dict = {}  # id(cu_seqlens) -> (weak reference, version counter when read, its values)
_READ_KEPT = 64


def known_prefix_sums(cu_seqlens) -> list:
    """``cu_seqlens.tolist()``, kept for a GPU tensor that tracks versions: torch bumps a tensor's
    version on every in-place change (its views share the counter), so the same object at the
    same version holds the same values. (A kernel writing into it behind torch's back would not
    bump it.) Inference-mode tensors have no counter and are read every time."""
    import weakref

    if cu_seqlens.device.type == "cpu" or cu_seqlens.is_inference():
        return cu_seqlens.tolist()
    kept = _READ.get(id(cu_seqlens))
    if kept is not None and kept[0]() is cu_seqlens and kept[1] == cu_seqlens._version:
        return kept[2]
    values = cu_seqlens.tolist()
    if len(_READ) >= _READ_KEPT:
        _READ.pop(next(iter(_READ)))
    _READ[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, values)
    return values


def sequence_lengths(name: str, cu_seqlens, total: int, batch: int | None = None) -> list:
    """The lengths that ``cu_seqlens`` describes, after checking it names a packing of ``total``
    rows: a 1-D int32 tensor of batch + 1 prefix sums from 0 to ``total``, never decreasing.
    Reading the values is one small copy to the host, which waits for the GPU's queued work when
    the tensor is on the GPU; a tensor read before and unchanged since (the same object, its
    version counter unmoved: what a model's layers pass) is not read again (``known_prefix_sums``)."""
    import torch

    if not isinstance(cu_seqlens, torch.Tensor):
        raise UnsupportedProblem(f"{name} must be a torch.Tensor of int32 prefix sums, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise UnsupportedProblem(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise UnsupportedProblem(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if batch is not None and cu_seqlens.numel() != batch + 1:
        raise UnsupportedProblem(f"{name} has {cu_seqlens.numel()} entries; the other cu_seqlens describe "
                                 f"{batch} sequences, so it needs {batch + 1}")
    cu = known_prefix_sums(cu_seqlens)
    if cu[0] != 0:
        raise UnsupportedProblem(f"{name} must start at 0, got {cu[0]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        at = next(i for i, (a, b) in enumerate(zip(cu, cu[1:])) if b < a)
        raise UnsupportedProblem(f"{name} must not decrease: entry {at + 1} ({cu[at + 1]}) < entry {at} ({cu[at]})")
    if cu[-1] != total:
        raise UnsupportedProblem(f"{name} ends at {cu[-1]}, but the packed tensor has {total} rows")
    return [b - a for a, b in zip(cu, cu[1:])]


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple:
    """(lengths_q, lengths_k) of a packed call, after every check that names a constraint: shapes
    (total, heads, d) with K and V alike and heads_kv dividing heads, one dtype, one device, the
    cu_seqlens packings, and max_seqlen at least every length (it sizes the grid)."""
    import torch

    for role, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedProblem(f"{role} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise UnsupportedProblem(f"{role} must be packed as (total_tokens, heads, head_dim), got shape "
                                     f"{tuple(t.shape)}")
    if k.shape != v.shape:
        raise UnsupportedProblem(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise UnsupportedProblem(f"q and k must share head_dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise UnsupportedProblem(f"heads_kv ({k.shape[1]}) must divide heads ({q.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise UnsupportedProblem(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v)}
    devices |= {t.device for t in (cu_seqlens_q, cu_seqlens_k) if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
    if len(devices) > 1:
        raise UnsupportedProblem(f"q, k and v, and the cu_seqlens unless on the CPU, must be on one device, got "
                                 f"{sorted(map(str, devices))}")
    lengths_q = sequence_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    lengths_k = sequence_lengths("cu_seqlens_k", cu_seqlens_k, k.shape[0], batch=len(lengths_q))
    for name, most, lengths in (("max_seqlen_q", max_seqlen_q, lengths_q), ("max_seqlen_k", max_seqlen_k, lengths_k)):
        if isinstance(most, bool) or not isinstance(most, numbers.Integral):
            raise UnsupportedProblem(f"{name} must be an int, got {most!r}")
        if most < max(lengths):
            seq = lengths.index(max(lengths))
            raise UnsupportedProblem(f"{name} = {most} is less than sequence {seq}'s length {max(lengths)}")
    return lengths_q, lengths_k


def keep_mask(seqlen_q: int, seqlen_k: int, window: tuple, device=None):
    """(seqlen_q, seqlen_k) bool: True where query i sees key j (the window aligned bottom-right)."""
    import torch

    left, right = window
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :] - (seqlen_k - seqlen_q)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, causal: bool = False, window=None,
              softcap: float = 0.0) -> tuple:
    """O (q's shape) and LSE (heads, total_q) in float64 of a packed call, sequence by sequence,
    with explicit masks. A query that sees no key (a window can leave one none) gets O = 0 and
    LSE = -inf, as flash-attn returns."""
    import torch

    window = with_causal(as_window(window), causal)
    softcap = as_softcap(softcap)
    qd, kd, vd = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64, device=q.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = (cu_q[b], cu_q[b + 1]), (cu_k[b], cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        qs = qd[q0:q1].transpose(0, 1)  # (heads, n_q, d)
        ks, vs = (t[k0:k1].transpose(0, 1).repeat_interleave(group, dim=0) for t in (kd, vd))
        s = qs @ ks.transpose(-1, -2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~keep_mask(q1 - q0, k1 - k0, window, q.device), -math.inf)
        rows_lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees nothing
        p = torch.exp(s - rows_lse[..., None].clamp_min(-1e300)).nan_to_num(0.0)
        out[q0:q1] = (p @ vs).transpose(0, 1)
        lse[:, q0:q1] = rows_lse
    return out, lse


def key_tile_range(m_block: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, window: tuple) -> tuple:
    """[first, last) key tiles query tile ``m_block`` must visit under ``window`` (bottom-right):
    the union of its rows' windows is one run of keys, so the tiles outside it are skipped, not
    masked, and a kernel's time follows the window. Empty (first == last) when no row sees a key."""
    left, right = window
    offset = seqlen_k - seqlen_q
    first_row, last_row = m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q) - 1
    lo = max(0, first_row - left + offset) if left >= 0 else 0
    hi = min(seqlen_k - 1, last_row + right + offset) if right >= 0 else seqlen_k - 1
    if hi < lo or last_row < first_row:
        return 0, 0
    return lo // tile_n, hi // tile_n + 1


@functools.lru_cache(maxsize=64)
def tile_table(lengths_q: tuple, lengths_k: tuple, tile_m: int, causal: bool, window: tuple, device):
    """``varlen_tiles`` as an int32 (pairs, 2) tensor on ``device``, or None for no pairs; kept for
    the next call with the same packing (a serving batch or a benchmark repeats it)."""
    import torch

    pairs = varlen_tiles(list(lengths_q), list(lengths_k), tile_m, causal, window)
    return torch.tensor(pairs, dtype=torch.int32).to(device) if pairs else None


def varlen_tiles(lengths_q: list, lengths_k: list, tile_m: int, causal: bool, window: tuple = (-1, -1)) -> list:
    """The (sequence, query tile) pairs of a packing, heaviest first (the KV keys each one walks,
    longest first: the tail of the schedule is short work). Empty sequences have none."""
    work = []
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        offset = n_k - n_q
        left, right = with_causal(window, causal)
        for m in range(-(-n_q // tile_m)):
            last = min(n_k, (m + 1) * tile_m + offset + right) if right >= 0 else n_k  # keys below this
            first = max(0, m * tile_m + offset - left) if left >= 0 else 0
            work.append((max(last - first, 0), b, m))
    work.sort(key=lambda w: -w[0])
    return [(b, m) for _, b, m in work]


def varlen_key_tiles(lengths_q: list, lengths_k: list, tile_m: int, tile_n: int, causal: bool,
                     window: tuple = (-1, -1), heaviest_first: bool = True) -> list:
    """The backward's (sequence, key tile) pairs of a packing, heaviest first (the query tiles each
    one walks, most first): every key tile of every sequence, those that walk nothing too (they
    write dK = dV = 0). Sequences without keys have none. ``heaviest_first=False``: in (sequence,
    key tile) order, as the deterministic mode needs (a CTA waits for the key tiles launched
    before it, ``K10Backward.wait_turn``)."""
    from kernels.tiles import query_window_tiles

    work = []
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        for n in range(-(-n_k // tile_n)):
            lo, hi = query_window_tiles(n, n_q, n_k, tile_m, tile_n, causal, window)
            work.append((hi - lo, b, n))
    if heaviest_first:
        work.sort(key=lambda w: -w[0])
    return [(b, n) for _, b, n in work]


@functools.lru_cache(maxsize=64)
def key_tile_table(lengths_q: tuple, lengths_k: tuple, tile_m: int, tile_n: int, causal: bool, window: tuple, device,
                   heaviest_first: bool = True):
    """``varlen_key_tiles`` as an int32 (pairs, 2) tensor on ``device``, kept as ``tile_table``'s."""
    import torch

    pairs = varlen_key_tiles(list(lengths_q), list(lengths_k), tile_m, tile_n, causal, window, heaviest_first)
    return torch.tensor(pairs, dtype=torch.int32).view(-1, 2).to(device)


def attention_varlen(name: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, softmax_scale=None, return_lse: bool = False, *, softcap=None,
                     window_size=None, backward=None):
    """flash-attn's varlen call: q (total_q, heads, d), k and v (total_k, heads_kv, d), sequence b
    in rows cu_seqlens[b]:cu_seqlens[b + 1]; causal and the window aligned bottom-right per
    sequence. Returns O (total_q, heads, d) and, with ``return_lse``, the LSE (heads, total_q). The
    warp-specialized 16-bit stages (k5 on) take it. Every check runs before the launch, which
    needs cu_seqlens's values on the host (to list the tiles): cu_seqlens on the GPU cost a wait
    for the work queued before the call the first time a tensor is passed
    (``known_prefix_sums``), cu_seqlens on the CPU none. Differentiable: with inputs that need
    gradients, autograd runs ``attention_varlen_backward`` (K10, ``backward=`` as ``attention``
    takes it), checked before the forward."""
    import torch

    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        check_varlen_differentiable(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    softmax_scale, softcap, window_size, backward)
        out, lse = _varlen_function().apply(q, k, v, name, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          causal, softmax_scale, softcap, window_size, backward)
        return (out, lse) if return_lse else out
    launch, out, lse = prepare_varlen(name, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      softmax_scale, return_lse, softcap=softcap, window_size=window_size)
    launch()
    return (out, lse) if return_lse else out


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, softcap,
                    window_size):
    """(Problem, lengths_q, lengths_k) of a packed call, every argument checked. The Problem's
    lengths are the longest sequences', not the max_seqlen bounds (which may be loose)."""
    import torch

    from kernels.contract import Problem, as_causal, as_scale

    lengths_q, lengths_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    bounded = as_causal(causal) or as_window(window_size) != (-1, -1)
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        if n_q and (n_k == 0 or (bounded and n_q > n_k)):
            raise UnsupportedProblem(f"sequence {b} has {n_q} queries and {n_k} keys: every query must see a key "
                                     f"({'causal or windowed, aligned bottom-right, keys must not be fewer' if bounded else 'no keys'})")
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(q.dtype, str(q.dtype).replace("torch.", ""))
    p = Problem(len(lengths_q), q.shape[1], max(max(lengths_q), 1), q.shape[2], dtype=dtype, causal=as_causal(causal),
                softmax_scale=None if softmax_scale is None else as_scale(softmax_scale),
                seqlen_k=max(max(lengths_k), 1), nheads_kv=k.shape[1], softcap=as_softcap(softcap),
                window=as_window(window_size), varlen=True)
    return p, lengths_q, lengths_k


def check_varlen_differentiable(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                                softmax_scale=None, softcap=None, window_size=None, backward=None):
    """Before a packed forward whose inputs need gradients: refuse what the packed backward cannot
    do, naming the constraint, before anything is launched."""
    from .backward import require_stage, stage_module

    stage = require_stage(backward)
    module = stage_module(stage)
    if not hasattr(module, "run_varlen_backward"):
        raise UnsupportedProblem(f"backward={stage!r} takes no packed sequences (varlen): K10's stages do "
                                 f"(backward=None or 'k10_fa3')")
    p, lengths_q, lengths_k = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                              softmax_scale, softcap, window_size)
    module.check(p)
    return stage, p, lengths_q, lengths_k


def attention_varlen_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                              max_seqlen_k: int, causal: bool = False, softmax_scale=None, backward=None, *,
                              softcap=None, window_size=None, grads: tuple | None = None) -> tuple:
    """(dq, dk, dv) of ``out = attention_varlen(..., q, k, v, ...)`` for the gradient ``dout`` of
    ``out``, given the forward's ``out`` (total_q, heads, d) and ``lse`` (heads, total_q), as
    ``attention_varlen(..., return_lse=True)`` returns them (what ring/context-parallel attention
    needs). K10's backward on each sequence's rows; ``grads``: three tensors to write into."""
    import torch

    from .backward import compiled_backward, require_tensors, stage_module
    from .inputs import require_cuda, require_rows

    stage, p, lengths_q, lengths_k = check_varlen_differentiable(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                 max_seqlen_k, causal, softmax_scale, softcap,
                                                                 window_size, backward)
    wanted = [("out", out, q.shape, q.dtype), ("dout", dout, q.shape, q.dtype),
              ("lse", lse, (q.shape[1], q.shape[0]), torch.float32)]
    if grads is not None:
        if not isinstance(grads, (tuple, list)) or len(grads) != 3:
            raise UnsupportedProblem(f"grads must be three tensors (dq, dk, dv), got {type(grads).__name__}")
        wanted += [(f"grads[{i}]", g, t.shape, t.dtype) for i, (g, t) in enumerate(zip(grads, (q, k, v)))]
    require_tensors(q, wanted, contiguous=("grads[0]", "grads[1]", "grads[2]"))
    for i, g in enumerate(grads or ()):  # the kernels store dQ, dK and dV in 16-byte pieces and by TMA
        require_rows(f"grads[{i}]", g)
    require_cuda(q, k, v)
    if q.shape[0] == 0:  # no queries at all: nothing reaches any key
        dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        dk.zero_(), dv.zero_()
        return dq, dk, dv
    deterministic = torch.are_deterministic_algorithms_enabled()  # the packed stages are K10's: they have the mode
    compiled = compiled_backward(stage, p, q.get_device(), deterministic)
    with torch.cuda.device(q.device):
        cu_q, cu_k = (t.to(q.device, non_blocking=True).contiguous() for t in (cu_seqlens_q, cu_seqlens_k))
        lse = lse.detach().contiguous()
        if lse.data_ptr() % 32:  # the pre-pass reads LSE as a 32-byte aligned tensor (a view may start anywhere)
            lse = lse.clone()
        cfg = compiled[3]
        tiles = key_tile_table(tuple(lengths_q), tuple(lengths_k), cfg["tile_m"], cfg["tile_n"], p.causal,
                               p.window, q.device, heaviest_first=not deterministic)
        return stage_module(stage).run_varlen_backward(compiled, q.detach(), k.detach(), v.detach(), out.detach(),
                                                       lse, dout, p.scale, cu_q, cu_k, p.seqlen, tiles, grads)


@functools.lru_cache(maxsize=None)
def _varlen_function():
    """The torch.autograd.Function, made on first use (this module imports torch lazily)."""
    import torch

    class VarlenAttention(torch.autograd.Function):
        """attention_varlen under autograd: the forward saves q, k, v, O and LSE (the LSE output is
        not differentiable); the backward is ``attention_varlen_backward``."""

        @staticmethod
        def forward(ctx, q, k, v, name, cu_q, cu_k, max_q, max_k, causal, scale, softcap, window, backward):
            launch, out, lse = prepare_varlen(name, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, True,
                                              softcap=softcap, window_size=window)
            launch()
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = (cu_q, cu_k, max_q, max_k, causal, scale, backward, softcap, window)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            cu_q, cu_k, max_q, max_k, causal, scale, backward, softcap, window = ctx.args
            dq, dk, dv = attention_varlen_backward(q, k, v, out, lse, dout, cu_q, cu_k, max_q, max_k, causal, scale,
                                                   backward, softcap=softcap, window_size=window)
            return (dq, dk, dv) + (None,) * 10

    return VarlenAttention


def prepare_varlen(name: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                   causal: bool = False, softmax_scale=None, return_lse: bool = False, *, softcap=None,
                   window_size=None) -> tuple:
    """``attention_varlen`` up to the launch: (launch, out, lse), ``launch()`` running the compiled
    kernel alone into out and lse (what bench.py --varlen times as the kernel-only column)."""
    import torch

    from kernels import get_kernel
    from kernels.contract import as_flag

    from .api import compiled_for
    from .inputs import require_cuda, require_name

    require_name(name)
    return_lse = as_flag("return_lse", return_lse)
    p, lengths_q, lengths_k = _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                              softmax_scale, softcap, window_size)
    causal, window = p.causal, p.window
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise UnsupportedProblem("prepare_varlen launches the forward alone: for gradients call attention_varlen")
    entry = get_kernel(name)
    entry.caps.check(p, want_lse=return_lse)
    for role, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.stride(1) % 8 or t.stride(0) % 8 or t.data_ptr() % 16:
            raise UnsupportedProblem(f"{role} must start 16-byte aligned, with a contiguous last dim and other strides "
                                     f"multiples of 8 elements (TMA), got strides {t.stride()}")
    require_cuda(q, k, v)
    with torch.cuda.device(q.device):
        cu_seqlens_q, cu_seqlens_k = (t.to(q.device, non_blocking=True).contiguous() for t in (cu_seqlens_q, cu_seqlens_k))
        compiled = compiled_for(name, p)
        tiles = tile_table(tuple(lengths_q), tuple(lengths_k), 64 * compiled.info["num_wg"], causal, window, q.device)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], device=q.device, dtype=torch.float32)
        packed = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, out)]

    def launch():
        if tiles is not None:  # all sequences empty: nothing to run
            with torch.cuda.device(q.device):
                compiled.launch(*packed, lse.unsqueeze(0), cu_seqlens_q, cu_seqlens_k, tiles, p.scale)

    return launch, out, lse
