"""The peers every kernel is timed beside: SDPA (cuDNN and flash backends) and flash-attn-4."""

from __future__ import annotations

PEERS = ("sdpa-cudnn", "sdpa-flash", "fa4", "cudnn-fp8")
# The bar a kernel is held to, per workload: the faster of cuDNN and flash-attn-4 (SDPA's flash
# backend is FlashAttention-2, timed for context only). FP8 workloads: cuDNN's FP8 attention (the
# bf16 peers, on the 16-bit tensors the e4m3 inputs came from, are timed for scale).
BEST_OF = ("sdpa-cudnn", "fa4")
BEST_OF_FP8 = ("cudnn-fp8",)


def best_peer(peer_tflops: dict, best_of: tuple = BEST_OF):
    """(name, TFLOP/s) of the fastest peer in ``best_of`` among those timed, or None."""
    timed = [(peer_tflops[n], n) for n in best_of if peer_tflops.get(n)]
    return (max(timed)[1], max(timed)[0]) if timed else None


def feature_options(softcap: float = 0.0, window=(-1, -1)) -> dict:
    """``attention(...)``'s keywords for a softcap and a sliding window, none for what is off."""
    return dict(({"softcap": softcap} if softcap else {}),
                **({"window_size": tuple(window)} if tuple(window) != (-1, -1) else {}))


def fa4_feature_options(causal: bool, softcap: float = 0.0, window=(-1, -1)) -> dict:
    """flash-attn-4's keywords for the same: its None is our -1 (unbounded); causal: right edge 0."""
    options = {"softcap": softcap} if softcap else {}
    if tuple(window) != (-1, -1):
        options["window_size"] = (None if window[0] < 0 else window[0], 0 if causal else
                                  None if window[1] < 0 else window[1])
    return options


def peer_callables(q, k, v, causal: bool, scale: float, softcap: float = 0.0, window=(-1, -1)) -> dict:
    """name -> zero-argument callable, or name -> reason string when the peer is unavailable (SDPA
    has no softcap or window)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    peers = {}
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        peers[name] = call if not softcap and tuple(window) == (-1, -1) else "unavailable (SDPA has no softcap or window)"
    try:
        from flash_attn.cute import flash_attn_func

        # FA4 takes (batch, seqlen, heads, dim): transpose once, outside the timed call.
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        capped = fa4_feature_options(causal, softcap, window)
        peers["fa4"] = lambda: flash_attn_func(qt, kt, vt, softmax_scale=scale, causal=causal, **capped)
    except Exception as e:  # not installed, or not importable on this GPU
        peers["fa4"] = f"unavailable ({type(e).__name__}: {e})"[:120]
    return tried_once(peers)


def tried_once(calls: dict, width: int = 120) -> dict:
    """``calls`` (name -> zero-argument callable, or a reason string) after running each callable
    once: one that raises is replaced by why, so a timing loop meets only calls that work."""
    import torch

    for name, fn in list(calls.items()):
        if callable(fn):
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:
                calls[name] = f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:width]
    return calls


def cudnn_fp8_peer(q8, k8, v8, descales, causal: bool, scale: float):
    """The cuDNN FP8 peer as ``peer_callables`` gives peers: a callable (bf16 O where cuDNN builds
    it; on Hopper cuDNN 9 takes only e4m3 O), or the reason it is unavailable."""
    import torch

    reason = "unavailable"
    for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        try:
            call = cudnn_fp8_sdpa(q8, k8, v8, descales, causal, scale, out_dtype)
            call()
            torch.cuda.synchronize()
            return call
        except Exception as e:  # missing frontend, unsupported graph: say so, go on
            reason = f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:120]
    return reason


def cudnn_fp8_sdpa(q8, k8, v8, descales, causal: bool, scale: float, out_dtype):
    """cuDNN's FP8 attention forward through cudnn-frontend (``pygraph.sdpa_fp8``) on e4m3
    (batch, heads, seqlen, d) tensors, per-tensor descales (a 3-float device tensor: q, k, v), O in
    ``out_dtype`` (bf16; FP8 if cuDNN refuses it). P is quantized with scale_s = 1 (its [0, 1]
    range, cuDNN's default recipe). Returns a zero-argument callable; raises if the frontend or the
    graph is unavailable."""
    import cudnn
    import torch

    b, h, s, d = q8.shape
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    tensors = {}

    def inp(uid, t, dtype):
        tensors[uid] = t
        return graph.tensor(uid=uid, dim=tuple(t.shape), stride=tuple(t.stride()), data_type=dtype)

    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    q, k, v = inp(0, q8, fp8), inp(1, k8, fp8), inp(2, v8, fp8)
    scalars = [descales[i].reshape(1, 1, 1, 1) for i in range(3)] + [torch.ones(1, 1, 1, 1, device=q8.device)] * 3
    dq, dk, dv, ds, ss, so = (inp(10 + i, t, f32) for i, t in enumerate(scalars))
    o, _, _, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, descale_q=dq, descale_k=dk, descale_v=dv, descale_s=ds,
                                      scale_s=ss, scale_o=so, generate_stats=False, attn_scale=scale,
                                      use_causal_mask=causal)
    out = torch.empty((b, h, s, d), device=q8.device, dtype=out_dtype)
    o.set_uid(3).set_output(True).set_dim((b, h, s, d)).set_stride(tuple(out.stride())).set_data_type(
        fp8 if out_dtype == torch.float8_e4m3fn else cudnn.data_type.BFLOAT16)
    amax = torch.empty(1, 1, 1, 1, device=q8.device)
    amax_o.set_uid(4).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    tensors.update({3: out, 4: amax})
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device=q8.device, dtype=torch.uint8)
    handle = cudnn.create_handle()
    if hasattr(cudnn, "set_stream"):  # run on torch's current stream, as the other peers do
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

    def call():
        graph.execute(tensors, workspace, handle=handle)
        return out
    return call
