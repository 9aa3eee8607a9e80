"""The public call: ``attention("k2", q, k, v, causal=True)``.

``attention`` is a thin wrapper over the torch custom op ``fa3_cute::attention``, so that a model
can call it under ``torch.compile(fullgraph=True)`` (the op is opaque to the compiler, which reads
output shapes from its fake implementation) and inside CUDA-graph capture. The op always returns
(O, LSE): a custom op has a fixed number of outputs, and the wrapper drops LSE unless asked.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from kernels import get_kernel
from kernels.contract import as_causal, as_scale

from .inputs import empty_outputs, problem_from_tensors, require_cuda, require_tensors

_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_CACHE_SIZE = 8  # K1's compiled problems hold an S buffer each: keep few


def compiled_for(name: str, problem):
    """Compile (or reuse) kernel ``name`` for ``problem``; the JIT itself is cached per
    compile-time key inside ``kernels.contract.jit_compile``. The scale is a launch argument,
    so problems differing only in scale share one entry (and K1 one S buffer)."""
    # Every GPU path (attention, the checks, the benchmark) comes through here: refuse a GPU
    # whose generation lacks the kernel's instructions before compiling for it.
    get_kernel(name).caps.check_device(torch.cuda.get_device_capability())
    problem = problem.with_(softmax_scale=None)
    key = (name, problem)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    compiled = get_kernel(name).compile(problem)
    _CACHE[key] = compiled
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return compiled


@torch.library.custom_op("fa3_cute::attention", mutates_args=())
def attention_op(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 softmax_scale: Optional[float], return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE). Every check that needs no GPU (kernel name, shapes, dtype, layout, causal, scale,
    the kernel's head dims) comes before the device check. The first call for a problem
    JIT-compiles its kernel: make it outside CUDA-graph capture (a warm-up call)."""
    entry = get_kernel(name)
    problem = problem_from_tensors(q, k, v, causal, softmax_scale)
    entry.caps.check(problem, want_lse=return_lse)
    require_cuda(q, k, v)
    with torch.cuda.device(q.device):  # compile-time buffers and the launch follow the inputs
        compiled = compiled_for(name, problem)
        out, lse = empty_outputs(problem, device=q.device)  # the checks poison; a caller needs no fill
        entry.run(compiled, q, k, v, out, lse, problem.scale)
    return out, lse


@attention_op.register_fake
def _attention_fake(name, q, k, v, causal, softmax_scale, return_lse):
    # Shapes only: the real call does every check (at run time, under torch.compile).
    b, h, n, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32)


def attention(name: str, q, k, v, causal: bool = False, softmax_scale=None, return_lse: bool = False):
    """softmax(q k^T * scale) v with kernel stage ``name``.

    q: CUDA tensor (batch, heads, seqlen, head_dim), bf16 or fp16, last dim contiguous; k, v: one
    shape (batch, heads_kv, seqlen_k, head_dim). heads_kv < heads (GQA) or seqlen_k != seqlen only
    for kernels whose capabilities take them; causal is then aligned bottom-right.
    ``causal`` is a bool; ``softmax_scale`` any positive real number (default 1/sqrt(head_dim)).
    Returns O in the same layout (contiguous), and the float32 (batch, heads, seqlen)
    log-sum-exp of the scaled scores when ``return_lse``. Unsupported inputs raise
    ``kernels.UnsupportedProblem`` naming the constraint.
    """
    causal = as_causal(causal)
    scale = None if softmax_scale is None else as_scale(softmax_scale)
    require_tensors(q, k, v)  # the op's own type error would not name the argument's role
    out, lse = torch.ops.fa3_cute.attention(name, q, k, v, causal, scale, bool(return_lse))
    return (out, lse) if return_lse else out
