"""Reference attention: PyTorch SDPA on float32 (or float64) copies of the inputs."""

from __future__ import annotations

import math


def reference(q, k, v, causal: bool, scale: float, dtype=None):
    """O and LSE in float32 (float64 if asked) from upcast inputs.

    O comes from SDPA's math on the upcast copies; LSE from a logsumexp over the explicit
    scores, computed one (batch, head) at a time so long sequences stay within memory.
    """
    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.float32
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=scale)
    b, h, n, _ = q.shape
    lse = torch.empty((b, h, n), dtype=dtype, device=q.device)
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if causal else None
    for bi in range(b):
        for hi in range(h):
            s = (qf[bi, hi] @ kf[bi, hi].transpose(0, 1)) * scale
            if mask is not None:
                s.masked_fill_(mask, -math.inf)
            lse[bi, hi] = torch.logsumexp(s, dim=-1)
    return o, lse
