"""The public call: ``attention("k2", q, k, v, causal=True)``.

Called eagerly, ``attention`` keeps one prepared launch per call signature (``_PreparedCall``):
the first call runs every check and compiles, a later one with the same signature allocates its
outputs and launches, about as much host time as SDPA's call. Under torch.compile it is the torch
custom op ``fa3_cute::attention`` (opaque to the compiler, which reads output shapes from its fake
implementation), whose body is the same eager call. The op always returns (O, LSE): a custom op
has a fixed number of outputs, and the wrapper drops LSE unless asked.
"""

from __future__ import annotations

from collections import OrderedDict
import functools
import math
import numbers
from typing import Optional

import torch

from kernels import REGISTRY, get_kernel
from kernels.contract import (FP8_DTYPES, UnsupportedProblem, as_causal, as_flag, as_scale, fresh_buffers,
                              scratch)

from . import backward as backward_module
from .varlen import as_softcap, as_window
from .inputs import (problem_from_tensors, require_cuda, require_name, require_quantizable, require_tensors,
                     torch_dtype)

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
    # decode walks fixed split shares under torch.use_deterministic_algorithms (kernels/decode.py)
    # ... and its split count, claims and tile width depend on the GPU (kernels/decode.py)
    key = (name, problem, torch.are_deterministic_algorithms_enabled(), torch.cuda.current_device())
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    compiled = get_kernel(name).compile(problem)
    _CACHE[key] = compiled
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
        _PREPARED.clear()  # a prepared call holds its compiled kernel (K1's S buffer): let it go too
    return compiled


@torch.library.custom_op("fa3_cute::attention", mutates_args=())
def attention_op(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 softmax_scale: Optional[float], return_lse: bool, descale_q: Optional[torch.Tensor] = None,
                 descale_k: Optional[torch.Tensor] = None, descale_v: Optional[torch.Tensor] = None,
                 descale_values: Optional[list[float]] = None, backward_stage: str = "",
                 softcap: float = 0.0, window_size: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE), as torch.compile and its CUDA graphs see the call: the eager path (``_call``) with
    nothing kept from its body (``kernels.contract.fresh_buffers``). e4m3 inputs take their descales
    as CUDA tensors (``descale_*``) or numbers (``descale_values``). ``backward_stage`` names the
    stage autograd's backward runs ("" for the default); the forward ignores it."""
    values = descale_values or [None] * 3
    descales = tuple(t if t is not None else x for t, x in zip((descale_q, descale_k, descale_v), values))
    with fresh_buffers():
        return _call(name, q, k, v, causal, softmax_scale, return_lse, descales, softcap, as_window(window_size))


@attention_op.register_fake
def _attention_fake(name, q, k, v, causal, softmax_scale, return_lse, descale_q=None, descale_k=None,
                    descale_v=None, descale_values=None, backward_stage="", softcap=0.0, window_size=None):
    # Shapes only: the real call does every check (at run time, under torch.compile).
    b, h, n, _ = q.shape
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty((b, h, n), dtype=torch.float32)


backward_module.register(attention_op)  # the backward (K9 or K10), through torch.library.register_autograd


_DESCALES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def _constant(values, device) -> torch.Tensor:
    """A float32 tensor of ``values`` (a tuple, or one number: 0-d) on ``device``, from a small cache:
    K7's descales given as numbers (a host-to-device copy cannot be captured in a CUDA graph: the
    warm-up call makes it)."""
    key = (values, str(device))
    if key not in _DESCALES:
        _DESCALES[key] = torch.tensor(values, dtype=torch.float32, device=device)
        while len(_DESCALES) > 64:
            _DESCALES.popitem(last=False)
    return _DESCALES[key]


def check_block_descales(name: str, problem, descales: dict, device) -> None:
    """K8's e4m3 inputs: each descale a float32 tensor (batch, heads, blocks) on q's device, blocks
    being the compiled tiles, heads and blocks those of its own tensor (k's and v's: the K/V heads
    and key length); ``quantize_fp8_blocks`` makes all six tensors."""
    from kernels.k8 import block_sizes

    tile_m, tile_n = block_sizes(problem.head_dim)
    p = problem
    for (key, x), rows, heads, length in zip(descales.items(), (tile_m, tile_n, tile_n),
                                             (p.nheads, p.kv_heads, p.kv_heads), (p.seqlen, p.kv_len, p.kv_len)):
        want = (p.batch, heads, -(-length // rows))
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or tuple(x.shape) != want:
            got = f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
            raise UnsupportedProblem(
                f"{name} takes float8_e4m3fn inputs with one descale per block of {rows} rows: {key} must be a "
                f"float32 tensor of shape {want} (harness.quantize_fp8_blocks makes them), got {got}")
        if x.requires_grad:
            raise UnsupportedProblem(f"{key} requires grad: these kernels are forward-only")
        if x.device != device:
            raise UnsupportedProblem(f"{key} must be on q's device ({device}), got {x.device}")


def split_descales(q, descales: dict, block: str = "") -> tuple:
    """(tensors, numbers) for the op from the caller's ``descale_q/k/v`` (a number, a 0-d or
    one-element float tensor, or None for 1.0). Only e4m3 inputs take descales."""
    given = {name: x for name, x in descales.items() if x is not None}
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn:
        if given:
            raise UnsupportedProblem(f"{', '.join(given)}: descales apply to float8_e4m3fn inputs only; "
                                     f"q is {getattr(q, 'dtype', type(q).__name__)}")
        return (None, None, None), None
    if block:  # K8 (``block`` names it): per-block tensors, whose shapes the op checks
        for key, x in descales.items():
            if not isinstance(x, torch.Tensor):
                raise UnsupportedProblem(
                    f"{block} takes float8_e4m3fn inputs with one descale per block: {key} must be a float32 tensor "
                    f"(batch, heads, blocks) (harness.quantize_fp8_blocks makes them), got {x!r}")
        return tuple(descales.values()), None
    tensors, values = [], []
    for name, x in descales.items():
        value = 1.0
        if isinstance(x, torch.Tensor):
            if x.numel() != 1 or not x.is_floating_point():
                raise UnsupportedProblem(f"{name} must be one floating-point value (a number or a one-element "
                                         f"tensor), got a {x.dtype} tensor of shape {tuple(x.shape)}")
            if x.requires_grad:
                raise UnsupportedProblem(f"{name} requires grad: these kernels are forward-only")
            if x.is_cuda:
                if x.device != q.device:
                    raise UnsupportedProblem(f"{name} must be on q's device ({q.device}), got {x.device}")
                tensors.append(x)
                values.append(value)
                continue
            x = x.item()  # a host tensor: read it here, no device sync
        if x is not None:
            value = as_descale(name, x)
        tensors.append(None)
        values.append(value)
    return tuple(tensors), values


def as_descale(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x <= 0:
        raise UnsupportedProblem(f"{name} must be a finite number > 0 (x ~= x8 * descale), got {x!r}")
    return float(x)


def attention(name: str, q, k, v, causal: bool = False, softmax_scale=None, return_lse: bool = False, *,
              descale_q=None, descale_k=None, descale_v=None, backward=None, softcap=None, window_size=None):
    """softmax(q k^T * scale) v with kernel stage ``name``.

    q: CUDA tensor (batch, heads, seqlen, head_dim), bf16 or fp16, last dim contiguous; k, v: one
    shape (batch, heads_kv, seqlen_k, head_dim). heads_kv < heads (GQA) or seqlen_k != seqlen only
    for kernels whose capabilities take them; causal is then aligned bottom-right.
    ``causal`` and ``return_lse`` are bools; ``softmax_scale`` any positive real number (default
    1/sqrt(head_dim)). FP8 stages also take float8_e4m3fn q, k, v: k7 with x ~= x8 * descale_x for
    each (a number or a one-element floating-point tensor; 1.0 when omitted; ``quantize_fp8`` makes
    both), k8 with a descale per block (``quantize_fp8_blocks``); O is then bf16. Returns O in the
    same layout (contiguous), and the float32 (batch, heads, seqlen) log-sum-exp of the scaled
    scores when ``return_lse``. Unsupported inputs raise ``kernels.UnsupportedProblem`` naming the
    constraint, before any launch.

    Called eagerly, the first call with a given signature (kernel, shapes, strides, dtypes,
    devices, stream, flags, descale kinds) runs every check and keeps what they decided; a later
    call with the same signature launches at once. Under torch.compile the call is the custom op
    ``fa3_cute::attention``, opaque to the compiler.

    Differentiable: where q, k or v require grad (and grad mode is on), the call goes through the
    custom op, whose backward is the stage ``backward`` names, "k9" or "k10" (None: the default,
    ``harness.backward.DEFAULT``); the LSE output is not differentiable. What the backward cannot do
    (the FP8 stages, head dim 256; K9 with a softcap or a window) is refused here, before the forward
    runs.

    ``softcap`` c > 0 (Gemma-2's logit softcap): the scaled scores s become c * tanh(s / c) before the
    softmax, and the LSE is that of the capped scores. ``window_size`` (left, right): query i sees
    key j' = j - (seqlen_k - seqlen_q) where i - left <= j' <= i + right (-1: unbounded; causal: right
    is 0), as flash-attn's; K/V tiles outside every row's window are skipped. Both are taken by the
    warp-specialized 16-bit stages (k5 on) and by K10's backward; None (or 0, or (-1, -1)): off.
    """
    descales = (descale_q, descale_k, descale_v)
    softcap, window = as_softcap(softcap), as_window(window_size)
    if torch.compiler.is_compiling():
        return _traced(name, q, k, v, causal, softmax_scale, return_lse, descales, backward, softcap, window)
    if backward is not None:
        backward_module.require_stage(backward)
    if backward_module.needs_grad(q, k, v):
        causal_, scale, _ = plain_arguments(name, q, k, v, causal, softmax_scale, return_lse)
        backward_module.check_differentiable(name, q, k, v, causal_, scale, backward, softcap, window)
        return _traced(name, q, k, v, causal, softmax_scale, return_lse, descales, backward, softcap, window)
    out, lse = _call(name, q, k, v, causal, softmax_scale, return_lse, descales, softcap, window)
    return (out, lse) if return_lse else out


def _traced(name, q, k, v, causal, softmax_scale, return_lse, descales, backward_stage=None, softcap=0.0,
            window=(-1, -1)):
    """What torch.compile traces: the arguments as the op's schema takes them, then the op (every
    check that needs the tensors' data runs in its body, at run time)."""
    causal, scale, return_lse = plain_arguments(name, q, k, v, causal, softmax_scale, return_lse)
    entry = REGISTRY.get(name)  # a plain lookup (torch.compile traces this function); the op names unknowns
    block = name if entry is not None and entry.block_descales else ""
    (dq, dk, dv), values = split_descales(q, dict(zip(DESCALE_NAMES, descales)), block)
    out, lse = torch.ops.fa3_cute.attention(name, q, k, v, causal, scale, return_lse, dq, dk, dv, values,
                                            backward_stage or "", softcap, list(window))
    return (out, lse) if return_lse else out


def plain_arguments(name, q, k, v, causal, softmax_scale, return_lse) -> tuple:
    """(causal, scale, return_lse) as plain Python values, after the checks that need no tensor data:
    the flags are bools, the scale a positive number, the name a string, q/k/v tensors (the op's
    own type errors would not name the argument's role)."""
    causal = as_causal(causal)
    scale = None if softmax_scale is None else as_scale(softmax_scale)
    return_lse = as_flag("return_lse", return_lse)
    require_name(name)
    require_tensors(q, k, v)
    return causal, scale, return_lse


DESCALE_NAMES = ("descale_q", "descale_k", "descale_v")
_PREPARED: dict = {}
_PREPARED_SIZE = 256  # many shapes (a varying batch, say): start over rather than grow


def _call(name, q, k, v, causal, softmax_scale, return_lse, descales, softcap: float = 0.0,
          window: tuple = (-1, -1)) -> tuple:
    """(O, LSE) of one eager call: the prepared launch of its signature, made on its first call."""
    key = _signature(name, q, k, v, causal, softmax_scale, return_lse, descales)
    key = key and (*key, softcap, window)
    prepared = _PREPARED.get(key) if key is not None else None
    if prepared is None:
        prepared = _prepare(name, q, k, v, causal, softmax_scale, return_lse, descales, softcap, window)
        if key is not None:
            if len(_PREPARED) >= _PREPARED_SIZE:
                _PREPARED.clear()
            _PREPARED[key] = prepared
    return prepared(q, k, v, descales)


_NUMBER = (float, int)


def _signature(name, q, k, v, causal, softmax_scale, return_lse, descales) -> Optional[tuple]:
    """Everything the checks look at, as one flat tuple (equal signatures pass or fail the checks
    alike), or None where an argument's value could change without its signature changing (a
    tensor subclass, a host tensor as a scale or descale, a NumPy bool): such calls are checked
    in full every time."""
    if type(name) is not str or type(causal) is not bool or type(return_lse) is not bool or \
            (softmax_scale is not None and type(softmax_scale) not in _NUMBER):
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor or not q.is_cuda:
        return None
    kinds = []
    for x in descales:
        if x is None:
            kinds.append(None)
        elif type(x) in _NUMBER:
            kinds.append((type(x), x))
        elif type(x) is torch.Tensor and x.is_cuda:
            kinds.append((x.shape, x.stride(), x.dtype, x.get_device(), x.requires_grad))
        else:
            return None
    # get_device() (an int, half the cost of .device) with is_cuda: a CUDA tensor's index
    index = q.get_device()
    return (name, causal, softmax_scale, return_lse, *kinds,
            q.shape, q.stride(), q.dtype, index, q.requires_grad, q.data_ptr() % 16,
            k.shape, k.stride(), k.dtype, k.is_cuda, k.get_device(), k.requires_grad, k.data_ptr() % 16,
            v.shape, v.stride(), v.dtype, v.is_cuda, v.get_device(), v.requires_grad, v.data_ptr() % 16,
            torch._C._cuda_getCurrentRawStream(index), torch.are_deterministic_algorithms_enabled())


def _prepare(name, q, k, v, causal, softmax_scale, return_lse, descales, softcap: float = 0.0,
             window: tuple = (-1, -1)) -> "_PreparedCall":
    """Every check, in the order that names the real problem first (nothing that needs a GPU
    before the device check), then the compiled kernel and the launch they allow."""
    causal, scale, return_lse = plain_arguments(name, q, k, v, causal, softmax_scale, return_lse)
    entry = get_kernel(name)
    block = name if entry.block_descales else ""
    tensors, values = split_descales(q, dict(zip(DESCALE_NAMES, descales)), block)
    problem = problem_from_tensors(q, k, v, causal, scale, softcap, window)
    entry.caps.check(problem, want_lse=return_lse)
    if problem.dtype in FP8_DTYPES and block:
        check_block_descales(name, problem, dict(zip(DESCALE_NAMES, tensors)), q.device)
    require_cuda(q, k, v)
    with torch.cuda.device(q.device):
        compiled = compiled_for(name, problem)
    return _PreparedCall(entry, problem, compiled, return_lse, q.device, tensors, values)


class _PreparedCall:
    """What the checks of one call signature decided, and the launch they allow: the compiled
    kernel and its scale, the outputs' shapes and dtype, and how descales reach the kernel."""

    def __init__(self, entry, problem, compiled, return_lse: bool, device, tensors: tuple, values):
        module = entry.load()
        self.scale, self.return_lse, self.device_index = problem.scale, return_lse, device.index
        self.lse_shape = (problem.batch, problem.nheads, problem.seqlen)
        self.out_dtype = torch_dtype(problem.out_dtype)
        self.descale_mode, example = None, None
        if problem.dtype in FP8_DTYPES:
            if entry.block_descales:
                self.descale_mode, example = "blocks", tensors
            else:  # checked on the GPU as the V^T pass reads them (kernels.fp8_quant.descale_rows)
                self.descale_mode = "tensors"  # numbers among them (checked): 0-d tensors made now, kept
                self.constants = tuple(None if t is not None else _constant(x, device) for t, x in zip(tensors, values))
                self.as_float = tuple(t is not None and t.dtype != torch.float32 for t in tensors)
                example = tuple(c if c is not None else t for t, c in zip(tensors, self.constants))
        # A stage may bind what the shapes decide once (K7/K8: the V pass fused with the kernel).
        prepare = getattr(module, "prepare_run", None)
        self.run = (prepare and prepare(compiled, example, device)) or functools.partial(module.run_kernel, compiled)

    def __call__(self, q, k, v, descales) -> tuple:
        if self.device_index != torch.cuda.current_device():
            with torch.cuda.device(self.device_index):  # the launch goes to the current device's stream
                return self(q, k, v, descales)
        out = torch.empty_like(q, dtype=self.out_dtype, memory_format=torch.contiguous_format)
        if self.return_lse:
            lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        else:  # written and never read: one per stream and shape, reused
            lse = scratch(q, "lse", self.lse_shape, torch.float32)
        if self.descale_mode is None:
            self.run(q, k, v, out, lse, self.scale)
        elif self.descale_mode == "tensors":
            self.run(q, k, v, out, lse, self.scale, descales=[c if c is not None else x.float() if f else x
                                                              for x, c, f in zip(descales, self.constants, self.as_float)])
        else:
            self.run(q, k, v, out, lse, self.scale, descales=descales)
        return out, lse


def fp8_inputs(q, k, v, blocks: bool = False) -> tuple:
    """16-bit q, k, v in e4m3, the one place the harness and the CLIs quantize: (q8, k8, v8,
    descales, launch_descale). Per-tensor scales (``quantize_fp8``: K7, cuDNN's FP8), or with
    ``blocks`` K8's (``quantize_fp8_blocks``; a stage's ``block_descales`` says which it takes);
    ``descales`` as ``attention`` takes them (descale_q/k/v), ``launch_descale`` as the compiled
    launch does (``run_kernel``'s ``descale``: the three numbers, or K8's rows)."""
    if blocks:
        from kernels.fp8_quant import descale_rows

        q8, k8, v8, *descales = quantize_fp8_blocks(q, k, v)
        return q8, k8, v8, dict(zip(DESCALE_NAMES, descales)), descale_rows(*descales)
    (q8, dq), (k8, dk), (v8, dv) = (quantize_fp8(x) for x in (q, k, v))
    return q8, k8, v8, dict(zip(DESCALE_NAMES, (dq, dk, dv))), torch.stack([dq, dk, dv])


def quantize_fp8_blocks(q, k, v):
    """K8's quantization, for a caller that keeps FP8 tensors: q and k rotated by K8's Hadamard
    matrix and quantized per Q / K tile, v per V tile, all float8_e4m3fn, with float32 descales
    (batch, heads, blocks). Returns (q8, k8, v8, descale_q, descale_k, descale_v) for
    ``attention("k8", q8, k8, v8, descale_q=..., descale_k=..., descale_v=...)``: the same bytes
    K8's own pre-pass makes of q, k, v, so the result is the same as ``attention("k8", q, k, v)``.
    q, k, v as ``attention`` takes them, in bf16, fp16 or float32."""
    from kernels.k8 import CAPS, block_sizes, quantize_inputs

    for role, x in (("q", q), ("k", k), ("v", v)):
        require_quantizable(role, x, CAPS.head_dims)
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise UnsupportedProblem(
            "k and v must have one shape (batch, nheads_kv, seqlen_k, head_dim) with q's batch and head_dim, and q's "
            f"heads a multiple of theirs: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not q.device == k.device == v.device:
        raise UnsupportedProblem(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    return quantize_inputs(q, k, v, *block_sizes(q.shape[-1]))


def quantize_fp8(x):
    """(x8, descale): ``x`` (bf16/fp16/fp32, (batch, heads, seqlen, head_dim)) as float8_e4m3fn with
    one per-tensor scale, x ~= x8 * descale; descale is a 0-d float32 tensor on x's device (no host
    sync). K7's own pre-pass."""
    from kernels.k7 import CAPS, quantize_fp8 as quantize

    require_quantizable("x", x, CAPS.head_dims)
    return quantize(x)
