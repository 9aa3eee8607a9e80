"""The peers every kernel is timed beside: SDPA (cuDNN and flash backends) and flash-attn-4."""

from __future__ import annotations

PEERS = ("sdpa-cudnn", "sdpa-flash", "fa4")
# The bar a kernel is held to, per workload: the faster of cuDNN and flash-attn-4 (SDPA's flash
# backend is FlashAttention-2, timed for context only).
BEST_OF = ("sdpa-cudnn", "fa4")


def best_peer(peer_tflops: dict):
    """(name, TFLOP/s) of the fastest peer in BEST_OF among those timed, or None."""
    timed = [(peer_tflops[n], n) for n in BEST_OF if peer_tflops.get(n)]
    return (max(timed)[1], max(timed)[0]) if timed else None


def peer_callables(q, k, v, causal: bool, scale: float) -> dict:
    """name -> zero-argument callable, or name -> reason string when the peer is unavailable."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    peers = {}
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        peers[name] = call
    try:
        from flash_attn.cute import flash_attn_func

        # FA4 takes (batch, seqlen, heads, dim): transpose once, outside the timed call.
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        peers["fa4"] = lambda: flash_attn_func(qt, kt, vt, softmax_scale=scale, causal=causal)
    except Exception as e:  # not installed, or not importable on this GPU
        peers["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    for name, fn in list(peers.items()):
        if callable(fn):
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:
                peers[name] = f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:120]
    return peers
