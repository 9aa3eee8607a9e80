"""Host time per prefill call: ``bench.py --host-times``.

At a shape whose kernels take a few microseconds, a call costs what its host side costs: this is
the number that decides a model's short-sequence speed. Each public call (bf16, e4m3 with
descales, bf16 through the FP8 stages' own quantizers), K6's compiled launch alone (the floor the
public call adds to), SDPA and flash-attn-4, timed by ``timing.host_rows``.
"""

from __future__ import annotations

SHAPE = dict(batch=1, nheads=16, seqlen=128, head_dim=128)
SDPA = "sdpa (default backend)"  # every call's ratio is to this one's, round by round


def host_calls(batch: int, nheads: int, seqlen: int, head_dim: int) -> dict:
    """name -> call() on one set of random bf16 inputs (and their e4m3 versions)."""
    import torch
    import torch.nn.functional as F

    from harness import attention, quantize_fp8, quantize_fp8_blocks
    from harness.api import compiled_for
    from harness.inputs import empty_outputs, random_inputs
    from kernels import get_kernel
    from kernels.contract import Problem

    p = Problem(batch, nheads, seqlen, head_dim)
    q, k, v = random_inputs(p)
    (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in (q, k, v))
    blocks = quantize_fp8_blocks(q, k, v)
    compiled, (out, lse) = compiled_for("k6", p), empty_outputs(p)
    k6 = get_kernel("k6")
    calls = {
        "k6 compiled launch (kernel alone)": lambda: k6.run(compiled, q, k, v, out, lse, p.scale),
        "k4 attention": lambda: attention("k4", q, k, v),
        "k6 attention": lambda: attention("k6", q, k, v),
        "k6 attention, causal, return_lse": lambda: attention("k6", q, k, v, causal=True, return_lse=True),
        "k7 attention, e4m3 + descale tensors": lambda: attention("k7", q8, k8, v8, descale_q=dq, descale_k=dk,
                                                                  descale_v=dv),
        "k7 attention, e4m3 + descale numbers": lambda: attention("k7", q8, k8, v8, descale_q=0.5, descale_k=0.5,
                                                                  descale_v=0.5),
        "k8 attention, e4m3 + block descales": lambda: attention("k8", *blocks[:3], descale_q=blocks[3],
                                                                 descale_k=blocks[4], descale_v=blocks[5]),
        "k7 attention, bf16 (quantized inside)": lambda: attention("k7", q, k, v),
        "k8 attention, bf16 (quantized inside)": lambda: attention("k8", q, k, v),
        SDPA: lambda: F.scaled_dot_product_attention(q, k, v),
    }
    try:
        from flash_attn.cute import flash_attn_func

        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        calls["fa4 flash_attn_func"] = lambda: flash_attn_func(qt, kt, vt)
    except Exception:  # noqa: BLE001  (not installed: no row)
        pass
    torch.cuda.synchronize()
    return calls


def run(emit, rounds: int = 9, **shape) -> None:
    from harness.timing import host_rows

    shape = dict(SHAPE, **shape)
    host_rows(host_calls(**shape), dict(mode="host", **shape), emit, rounds, baseline=SDPA)
