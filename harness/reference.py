"""Reference attention: PyTorch SDPA on float32 copies of the inputs."""

from __future__ import annotations

import math

SCORE_CHUNK_BYTES = 1 << 29  # explicit scores for the LSE, at most 512 MiB at a time


def reference(q, k, v, causal: bool, scale: float):
    """O and LSE in float32 from upcast copies of q, k, v.

    O is SDPA on the float32 copies; LSE is a logsumexp over explicit float32 scores, a chunk
    of heads at a time so that long sequences and many heads both stay within memory.
    """
    import torch
    import torch.nn.functional as F

    qf, kf, vf = (t.float() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=scale)
    b, h, n, _ = q.shape
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if causal else None
    chunk = max(1, SCORE_CHUNK_BYTES // (4 * n * n))
    for bi in range(b):
        for h0 in range(0, h, chunk):
            s = (qf[bi, h0:h0 + chunk] @ kf[bi, h0:h0 + chunk].transpose(-1, -2)) * scale
            if mask is not None:
                s.masked_fill_(mask, -math.inf)
            lse[bi, h0:h0 + chunk] = torch.logsumexp(s, dim=-1)
    return o, lse
