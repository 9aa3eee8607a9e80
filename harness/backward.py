"""The backward pass as callers use it: ``attention_backward`` (O and LSE from the caller, as
ring/context-parallel attention needs), and autograd for ``attention``.

Autograd is registered on the custom op ``fa3_cute::attention`` (``torch.library.register_autograd``):
the forward saves q, k, v, O and LSE; the backward is K9's or K10's (``kernels/k9.py``, ``k10.py``) on
them, as the call's ``backward=`` names (``DEFAULT`` when it names none). An eager
``attention(...)`` whose inputs need gradients goes through the op (the prepared fast path is for
calls that do not); torch.compile sees the same op. The LSE output is not differentiable.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Optional

import torch

from kernels.contract import UnsupportedProblem, as_softcap, as_window

from .inputs import problem_from_tensors, require_cuda

# Stages whose forward has no backward here: the FP8 ones (a gradient through quantized inputs is
# another question) and decode (a KV-cache read).
FORWARD_ONLY = ("k7_k4", "k7", "k8", "decode_nosplit", "decode_combine", "decode")
_COMPILED: "OrderedDict[tuple, tuple]" = OrderedDict()
# name -> (kernel module, compile overrides): the stages, and variants of them still being measured
VARIANTS = {"k9": ("k9", {}), "k10": ("k10", {}), "k10_overlap": ("k10", dict(overlap=True)),
            "k10_flat": ("k10", dict(dq_flat=True)), "k10_stmatrix": ("k10", dict(ds_stmatrix=True)),
            "k10_fa3": ("k10", dict(overlap=True, dq_flat=True, ds_stmatrix=True, mask_edges=True, early_dq=True,
                                    step_counter=True, plain_first=True, dkv_tma_store=True, tanh_under_dp=True,
                                    wide_prepass=True,
                                    by_head_dim={64: dict(tile_m=128, dq_split_queries=True, unguarded_rows=True,
                                                     pin_descriptors=True),
                                                 128: dict(capped_overlap=True),
                                                 256: dict(step_counter=False, plain_first=False)}))}
STAGES = tuple(VARIANTS)
MAIN_STAGES = ("k9", "k10", "k10_fa3")  # what ref_check --backward and bench.py --backward run unless told
DETERMINISTIC = tuple(name for name, (module, _) in VARIANTS.items() if module == "k10")  # with a deterministic mode
# K10 with FA3's changes: the fastest at d 64/128, causal or not, bar d128 causal where
# k10_stmatrix led by 4% (results/backward-variants-h100.json), and masks on edge steps only
# (mask_edges: results/ab-k10-edges-*.json); flash-attn-4's step order and, at d = 64, its 128 x 128
# tile (early_dq, dq_split_queries: results/ab-k10-early-*.json); fewer instructions a step and
# dK/dV out by TMA (step_counter, plain_first, dkv_tma_store: results/ab-k10-knobs-*.json); the
# softcap's tanh under dP's GEMM (tanh_under_dp: results/ab-k10-tanhdp-d128-h100.json); at d = 64 no
# guard on rows past the sequence and the staged descriptors built once (unguarded_rows,
# pin_descriptors: results/ab-k10-edge-d64-h100.json; at d = 128 neither moved); at d = 128 under
# a softcap the overlapped start all the same (capped_overlap: results/ab-k10-capov-d128-h100.json;
# at d = 64 ptxas serializes its WGMMAs); d = 256's own step keeps the division and its order (not
# measured there); the pre-pass 16 bytes a thread (wide_prepass: 67 to 68 us for K9's 73 to 103 at
# d 64/128/256, results/backward-kernels-wide-h200.json)
DEFAULT = "k10_fa3"


def add_configuration(name: str, overrides: dict) -> None:
    """K10 with ``overrides`` (its compile overrides) as the backward stage ``name``, for this
    process only: a script's ``--config``, a knob measured before it joins the stages."""
    global STAGES, DETERMINISTIC
    if name in VARIANTS:
        raise ValueError(f"{name!r} is a backward stage already")
    VARIANTS[name] = ("k10", dict(overrides))
    STAGES, DETERMINISTIC = tuple(VARIANTS), DETERMINISTIC + (name,)


def require_stage(stage) -> str:
    """The backward stage a call names ("" or None: ``DEFAULT``), or a clear error."""
    if stage in (None, ""):
        return DEFAULT
    if stage not in STAGES:
        raise UnsupportedProblem(f"backward must be one of {list(STAGES)} (or None for {DEFAULT}), got {stage!r}")
    return stage


def stage_module(stage):
    import importlib

    return importlib.import_module(f"kernels.{VARIANTS[require_stage(stage)][0]}")


def stage_overrides(stage) -> dict:
    return VARIANTS[require_stage(stage)][1]


def needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))


def check_deterministic(stage: str) -> bool:
    """Under ``torch.use_deterministic_algorithms(True)``: whether ``stage`` runs its deterministic
    mode (K10), or, for K9, which has none, an error (a warning and False in warn-only mode), as
    torch's own non-deterministic kernels do."""
    if stage in DETERMINISTIC:
        return True
    why = (f"{stage.upper()}'s backward adds dQ from every key tile with fp32 atomics, in an order that varies from "
           f"run to run; the deterministic backward is K10's (backward={DETERMINISTIC[0]!r}, or None)")
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        raise UnsupportedProblem(f"torch.use_deterministic_algorithms(True): {why}")
    warnings.warn(why)
    return False


def check_differentiable(name: str, q, k, v, causal: bool, softmax_scale, stage=None, softcap: float = 0.0,
                         window=(-1, -1)) -> None:
    """Before a forward whose inputs need gradients: refuse what the backward cannot do, naming
    the constraint, before anything is launched."""
    if torch.are_deterministic_algorithms_enabled():
        check_deterministic(require_stage(stage))
    check = stage_module(stage).check
    if name in FORWARD_ONLY:
        raise UnsupportedProblem(f"{name} is forward-only (no backward): call it on tensors that do not require "
                                 "grad, under torch.no_grad(), or use a 16-bit stage such as k6 to train")
    check(problem_from_tensors(q, k, v, causal, softmax_scale, softcap, window))


def attention_backward(q, k, v, out, lse, dout, causal: bool = False, softmax_scale=None, backward=None,
                       softcap=None, window_size=None) -> tuple:
    """(dq, dk, dv) of ``out = attention(q, k, v, causal, softmax_scale)`` for the gradient ``dout``
    of ``out``, given the forward's ``out`` and ``lse`` (float32 (batch, heads, seqlen), the
    natural-log LSE of the scaled scores, as ``attention(..., return_lse=True)`` returns it). By
    the stage ``backward`` names, "k9" or "k10" (None: ``DEFAULT``): bf16 or fp16, head dim 64 or
    128; GQA and K/V longer than q (causal bottom-right) as the forward takes them. Under
    ``torch.use_deterministic_algorithms(True)`` K10 adds dQ's shares in a fixed order, so that a
    repeat gives the same bits; K9 has no such mode and is refused (a warning in warn-only mode).
    ``softcap`` and ``window_size`` as the forward took them (K10 only)."""
    stage = require_stage(backward)
    module = stage_module(stage)
    check, run_backward = module.check, module.run_backward

    q, k, v, out, lse, dout = (t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v, out, lse, dout))
    p = problem_from_tensors(q, k, v, causal, softmax_scale, as_softcap(softcap), as_window(window_size))
    check(p)
    require_tensors(q, [("out", out, q.shape, q.dtype), ("dout", dout, q.shape, q.dtype),
                        ("lse", lse, q.shape[:3], torch.float32)])
    require_cuda(q, k, v)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        deterministic = check_deterministic(stage)
    compiled = compiled_backward(stage, p, q.get_device(), deterministic)
    with torch.cuda.device(q.device):
        return run_backward(compiled, q, k, v, out, lse.contiguous(), dout, p.scale)  # O, dO: k9.aligned_rows


def require_tensors(q, wanted, contiguous: tuple = ()) -> None:
    """Each (name, tensor, shape, dtype) of ``wanted`` a tensor of that shape and dtype on q's
    device (and contiguous, the names in ``contiguous``), or an error naming it, before any launch."""
    for name, t, shape, dtype in wanted:
        whole = name in contiguous
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != q.device or (
                whole and not t.is_contiguous()):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise UnsupportedProblem(f"{name} must be a {'contiguous ' if whole else ''}{dtype} tensor of shape "
                                     f"{tuple(shape)} on q's device ({q.device}), got {got}")


def compiled_backward(stage: str, p, device_index: int, deterministic: bool) -> tuple:
    """``stage``'s compiled backward for ``p`` (deterministic or not), kept for the next call: the
    newest 16 (a packing's lengths are in the key)."""
    key = (stage, p.with_(softmax_scale=None), device_index, deterministic)
    if key not in _COMPILED:
        more = dict(deterministic=True) if deterministic else {}
        _COMPILED[key] = stage_module(stage).compile_backward(p, **stage_overrides(stage), **more)
        while len(_COMPILED) > 16:
            _COMPILED.popitem(last=False)
    return _COMPILED[key]


@torch.library.custom_op("fa3_cute::attention_backward", mutates_args=())
def attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          dout: torch.Tensor, causal: bool, softmax_scale: Optional[float], backward_stage: str = "",
                          softcap: float = 0.0, window_size: Optional[list[int]] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_backward`` as torch.compile sees it: opaque, its output shapes from the fake
    implementation below (the kernels cannot run on the fake tensors the backward is traced with)."""
    return attention_backward(q, k, v, out, lse, dout, causal, softmax_scale, backward_stage, softcap, window_size)


@attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, out, lse, dout, causal, softmax_scale, backward_stage="", softcap=0.0,
                             window_size=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    name, q, k, v, causal, softmax_scale = inputs[:6]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.backward_stage = inputs[11] if len(inputs) > 11 else ""
    ctx.softcap = inputs[12] if len(inputs) > 12 else 0.0
    ctx.window = inputs[13] if len(inputs) > 13 else None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fa3_cute.attention_backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.softmax_scale,
                                                       ctx.backward_stage, ctx.softcap, ctx.window)
    return None, dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def register(op) -> None:
    """Autograd for the custom op ``op`` (``harness.api.attention_op``)."""
    torch.library.register_autograd(op, _backward, setup_context=_setup_context)
