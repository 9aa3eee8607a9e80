"""Reference attention: PyTorch SDPA on float32 copies of the inputs.

The kernels' semantics, which SDPA needs two things spelled out for: grouped-query attention
(query head h reads K/V head h // group: ``enable_gqa``), and causal masking aligned bottom-right
when there are more keys than queries (query row i sees keys j <= i + seqlen_k - seqlen_q, as
flash-attn does; SDPA's ``is_causal`` is top-left, so those get an explicit mask).
"""

from __future__ import annotations

import math

SCORE_CHUNK_BYTES = 1 << 29  # explicit scores for the LSE, at most 512 MiB at a time


def causal_keep(seqlen_q: int, seqlen_k: int, device):
    """(seqlen_q, seqlen_k) bool mask, True where query i may see key j (bottom-right diagonal)."""
    import torch

    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def sdpa(q, k, v, causal: bool, scale: float, window=(-1, -1)):
    """SDPA computing what the kernels compute (GQA; bottom-right causal; a sliding window as a
    boolean mask), in the inputs' dtype."""
    import torch.nn.functional as F

    gqa = q.shape[1] != k.shape[1]
    if tuple(window) != (-1, -1):
        from .varlen import keep_mask, with_causal

        mask = keep_mask(q.shape[2], k.shape[2], with_causal(tuple(window), causal), q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if causal and q.shape[2] != k.shape[2]:
        mask = causal_keep(q.shape[2], k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)


def reference(q, k, v, causal: bool, scale: float, softcap: float = 0.0, window=(-1, -1)):
    """O and LSE in float32 from upcast copies of q, k, v.

    O is SDPA on the float32 copies; LSE is a logsumexp over explicit float32 scores, a chunk
    of heads at a time so that long sequences and many heads both stay within memory. With a
    ``softcap`` c the scores are c * tanh(s / c), and with a sliding ``window`` (harness.varlen's
    mask) the keys outside it are dropped; O then comes from the same explicit scores.
    """
    import torch

    from .varlen import keep_mask, with_causal

    window = tuple(window)
    explicit = softcap or window != (-1, -1)
    qf, kf, vf = (t.float() for t in (q, k, v))
    o = sdpa(qf, kf, vf, causal, scale) if not explicit else torch.empty_like(qf)
    b, h, n, _ = q.shape
    nk, group = k.shape[2], h // k.shape[1]
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    masked = ~causal_keep(n, nk, q.device) if causal else None
    if window != (-1, -1):
        masked = ~keep_mask(n, nk, with_causal(window, causal), q.device)
    chunk = max(1, SCORE_CHUNK_BYTES // (4 * n * nk))
    for bi in range(b):
        for h0 in range(0, h, chunk):
            heads = torch.arange(h0, min(h0 + chunk, h), device=q.device) // group
            s = (qf[bi, h0:h0 + chunk] @ kf[bi, heads].transpose(-1, -2)) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if masked is not None:
                s.masked_fill_(masked, -math.inf)
            lse[bi, h0:h0 + chunk] = torch.logsumexp(s, dim=-1)
            if explicit:  # a row that sees no key: O = 0 (the kernels refuse such windows)
                o[bi, h0:h0 + chunk] = torch.softmax(s, dim=-1).nan_to_num(0.0) @ vf[bi, heads]
    return o, lse


def reference_grads(q, k, v, dout, causal: bool, scale: float, softcap: float = 0.0, window=(-1, -1)) -> tuple:
    """(dq, dk, dv) in float64: autograd through an explicit softmax of float64 copies (GQA by
    repeating K/V heads, whose gradients autograd then sums per group; causal bottom-right; a
    softcap and a sliding window as ``reference`` applies them)."""
    import torch

    from .varlen import keep_mask, with_causal

    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(group, dim=1) for t in (kd, vd))
    s = torch.einsum("bhqd,bhkd->bhqk", qd, kr) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if tuple(window) != (-1, -1):
        s = s.masked_fill(~keep_mask(q.shape[2], k.shape[2], with_causal(tuple(window), causal), q.device), -math.inf)
    elif causal:
        s = s.masked_fill(~causal_keep(q.shape[2], k.shape[2], q.device), -math.inf)
    torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), vr).backward(dout.double())
    return qd.grad, kd.grad, vd.grad


def sdpa_grads(q, k, v, dout, causal: bool, scale: float, window=(-1, -1)) -> tuple:
    """(dq, dk, dv) from SDPA's own backward in the inputs' dtype: the error a 16-bit backward makes
    (a window as a boolean mask; SDPA has no softcap)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sdpa(*leaves, causal, scale, window).backward(dout)
    return tuple(t.grad for t in leaves)


def _capped_scores(q, k, v, dout, causal: bool, scale: float, softcap: float, window, dtype) -> tuple:
    """q, k, v (K/V heads repeated over their query heads) and dout as ``dtype``, t = tanh(S *
    scale / c) and the keep mask (causal bottom-right, the window): what a softcap's references
    start from."""
    import torch

    from .varlen import keep_mask, with_causal

    group = q.shape[1] // k.shape[1]
    qx, dox = q.to(dtype), dout.to(dtype)
    kx, vx = (t.repeat_interleave(group, dim=1).to(dtype) for t in (k, v))
    keep = keep_mask(q.shape[2], k.shape[2], with_causal(tuple(window), causal), q.device)
    t = torch.tanh(qx @ kx.transpose(-1, -2) * (scale / softcap))
    return qx, kx, vx, dox, t, keep


def capped_grads_16bit(q, k, v, dout, causal: bool, scale: float, softcap: float, window=(-1, -1)) -> tuple:
    """(dq, dk, dv) as a 16-bit FlashAttention computes them with a softcap c (SDPA has none): the
    error bar of a softcap case. Forward as the kernels run it: S from the 16-bit inputs (fp32
    accumulation), t = tanh(S * scale / c), P = exp(c * t - m) with m = c where the kernels take the
    max as known (bf16, ``KNOWN_MAX_SOFTCAP``) and the row max otherwise, P rounded to 16 bits for
    PV and normalized by its fp32 sum, O stored in 16 bits. Backward from that O, as a flash
    backward does: D = rowsum(dO * O), dS = P (dO V^T - D) (1 - t^2) scale; every GEMM on 16-bit
    operands with fp32 accumulation, dK and dV summed over a GQA group in fp32. (Autograd of the
    16-bit forward would not see O's rounding: a query with one key gets D = dO V^T exactly there,
    which a kernel whose known-max P is not 1 does not.)"""
    import torch

    from kernels.sm90 import KNOWN_MAX_SOFTCAP

    dt, group = q.dtype, q.shape[1] // k.shape[1]
    qf, kf, vf, dof, t, keep = _capped_scores(q, k, v, dout, causal, scale, softcap, window, torch.float32)
    s = (softcap * t).masked_fill(~keep, -math.inf)
    if dt == torch.bfloat16 and softcap <= KNOWN_MAX_SOFTCAP:
        m = torch.full_like(s[..., :1], softcap)
    else:
        m = s.amax(dim=-1, keepdim=True).clamp(min=-1e30)  # a row without keys: P = 0, not NaN
    p = torch.exp(s - m)
    row_sum = p.sum(dim=-1, keepdim=True)
    out = ((p.to(dt).float() @ vf) / row_sum.clamp(min=1e-30)).to(dt)
    p = p / row_sum.clamp(min=1e-30)  # exp(c * t - LSE)
    d_row = (dof * out.float()).sum(dim=-1, keepdim=True)
    ds = (p * (dof @ vf.transpose(-1, -2) - d_row) * (1.0 - t * t) * scale).to(dt).float()
    dq = ds @ kf
    dk, dv = ds.transpose(-1, -2) @ qf, p.to(dt).float().transpose(-1, -2) @ dof
    dk, dv = (g.unflatten(1, (k.shape[1], group)).sum(dim=2) for g in (dk, dv))
    return dq.to(dt), dk.to(dt), dv.to(dt)


def known_max_rounding_bound(q, k, v, dout, causal: bool, scale: float, softcap: float, window=(-1, -1)) -> tuple:
    """(dq, dk) elementwise bounds on what a known-max forward's 16-bit P moves a flash backward's
    gradients by through D = rowsum(dO * O), for ``capped_grads_16bit``'s bar. Where one key holds
    a row's weight (a sequence of one query and one key: the exact dq is 0), the peer's O is V
    exactly or within a rounding, and so is the kernel's, but the two roundings are independent
    draws: each component of O may sit one 16-bit step (2^-7 of it in bf16, 2^-10 in fp16) from
    the other's, and twice the peer's error alone is no bar. The bound takes that step on every
    component, D_i moving by up to step * sum_c |dO_ic| (P |V|)_ic, scaled by the row's largest P
    (where many keys share the weight, the roundings average out and the peer's error covers
    them), then carries it through dS_ij = P_ij (dP_ij - D_i) (1 - t_ij^2) scale into dQ = dS K
    and dK = dS^T Q."""
    import torch

    step = 2.0 ** -7 if q.dtype == torch.bfloat16 else 2.0 ** -10
    group = q.shape[1] // k.shape[1]
    qd, kd, vd, dod, t, keep = _capped_scores(q, k, v, dout, causal, scale, softcap, window, torch.float64)
    p = torch.softmax((softcap * t).masked_fill(~keep, -math.inf), dim=-1).nan_to_num(0.0)
    moved = step * p.amax(dim=-1, keepdim=True) * (dod.abs() * (p @ vd.abs())).sum(dim=-1, keepdim=True)
    w = moved * p * (1.0 - t * t) * scale  # a bound on |delta dS_ij|
    dq = w @ kd.abs()
    dk = (w.transpose(-1, -2) @ qd.abs()).unflatten(1, (k.shape[1], group)).sum(dim=2)
    return dq, dk


def cache_lengths(cache_seqlens, batch: int, s_cache: int) -> list:
    """Each sequence's length as a Python int in [0, s_cache] (the kernels clamp the same way):
    ``cache_seqlens`` None (all rows), an int, or a tensor (batch,)."""
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        lengths = [s_cache if cache_seqlens is None else cache_seqlens] * batch
    else:
        lengths = [int(x) for x in cache_seqlens.tolist()]
    return [max(0, min(n, s_cache)) for n in lengths]


def pages_to_cache(pool, page_table):
    """A paged cache (num_pages, page_size, heads_kv, d) read through its ``page_table`` (batch,
    max_pages) into the contiguous layout (batch, max_pages x page_size, heads_kv, d): row j of
    sequence b is row j % page_size of page page_table[b, j // page_size]. Every entry must name a
    page (the kernels load no page through an entry past a sequence's length; the reference gathers them all)."""
    import torch

    return pool[page_table.to(torch.long)].flatten(1, 2)


def reference_kvcache(q, k_cache, v_cache, cache_seqlens, causal: bool, scale: float, dtype=None, window=(-1, -1)):
    """O (batch, q_len, heads, d) and LSE (batch, heads, q_len) of attention over a KV cache, from
    upcast copies (float64 by default), one sequence at a time.

    q (batch, q_len, heads, d); caches (batch, s_cache, heads_kv, d); ``cache_seqlens`` None (all
    rows), an int, or a tensor (batch,). Rows past a sequence's length are sliced away before
    anything reads them (NaN planted there cannot reach the reference). Query head h reads K/V head
    h // group; causal is bottom-right (query i sees key j <= i + length - q_len), and so is a
    sliding ``window`` (harness.varlen's mask). A row that sees no key gets O = 0 and LSE = -inf.
    """
    import torch

    from .varlen import keep_mask, with_causal

    dtype = dtype or torch.float64
    b, q_len, h, d = q.shape
    group = h // k_cache.shape[2]
    o = torch.zeros((b, q_len, h, d), dtype=dtype, device=q.device)
    lse = torch.full((b, h, q_len), -math.inf, dtype=dtype, device=q.device)
    for bi, n in enumerate(cache_lengths(cache_seqlens, b, k_cache.shape[1])):
        if n == 0:
            continue
        k = k_cache[bi, :n].to(dtype).repeat_interleave(group, dim=1)  # (n, h, d)
        v = v_cache[bi, :n].to(dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[bi].to(dtype), k) * scale
        if causal or tuple(window) != (-1, -1):
            s.masked_fill_(~keep_mask(q_len, n, with_causal(tuple(window), causal), q.device), -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # -inf for a row that sees no key
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)  # such a row: exp(-inf + inf) -> 0
        o[bi] = torch.einsum("hqk,khd->qhd", p, v)
        lse[bi] = row_lse
    return o, lse


def sdpa_kvcache(q, k_cache, v_cache, cache_seqlens, causal: bool, scale: float, window=(-1, -1)):
    """SDPA in the inputs' own dtype over each sequence's first rows: the 16-bit peer whose error
    against ``reference_kvcache`` sets a KV-cache check's tolerance (as ``sdpa`` does for
    ``reference``). O (batch, q_len, heads, d); a row that sees no key is 0, as defined (SDPA
    would give NaN for a row with nothing to attend to). A sliding ``window`` goes in as a mask."""
    import torch

    b, q_len = q.shape[:2]
    o = torch.zeros_like(q)
    for bi, n in enumerate(cache_lengths(cache_seqlens, b, k_cache.shape[1])):
        if n == 0:
            continue
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[bi], k_cache[bi, :n], v_cache[bi, :n]))  # (1, h, len, d)
        o[bi] = sdpa(qb, kb, vb, causal, scale, window)[0].transpose(0, 1)
        if tuple(window) != (-1, -1):  # a row whose window holds no key: SDPA's NaN
            o[bi] = o[bi].nan_to_num(0.0)
        elif causal and q_len > n:  # bottom-right: query rows i < q_len - n see no key
            o[bi, :q_len - n] = 0
    return o
