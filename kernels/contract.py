"""The contract every kernel stage implements.

A kernel module ``kernels/<name>.py`` exposes three things:

``CAPS``
    a :class:`Capabilities` saying which problems it can run. The harness calls
    ``CAPS.check(problem)`` before compiling, so an unsupported case is refused with a
    message that names the constraint instead of being launched.
``compile_kernel(problem, **variant) -> CompiledAttention``
    JIT-compiles the kernel for the problem's compile-time key (head dim, dtype, causal,
    variant) and allocates any scratch buffers the problem needs (K1's score matrix).
    Compilation uses fake tensors with symbolic batch/heads/seqlen, so it works without a
    GPU (set ``CUTE_DSL_ARCH=sm_90a``) and one compiled function serves every seqlen.
``run_kernel(compiled, q, k, v, out, lse, softmax_scale=None) -> None``
    only launches, on the current torch stream. Timings wrap this call and never include JIT.

Tensors use the SDPA layout ``(batch, heads, seqlen, head_dim)`` with a contiguous last dim;
``lse`` is float32 ``(batch, heads, seqlen)`` holding the natural-log log-sum-exp of the scaled
scores of each query row.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

DTYPES = ("bfloat16", "float16")
FP8_DTYPES = ("float8_e4m3fn",)  # K7/K8: e4m3 q, k, v with descales (per tensor; K8 per block), 16-bit O
LOG2_E = math.log2(math.e)  # exp(x) == exp2(x * LOG2_E): the kernels fold it into the scale
LN_2 = math.log(2.0)  # natural-log LSE from a log2-domain max: m * LN_2 + ln(l)
SMEM_CAPACITY = 227 * 1024  # H100 / H200: the most dynamic SMEM one CTA can opt into
GRID_YZ_LIMIT = 65535  # gridDim.y and gridDim.z (heads and batch in the fused kernels)
H100_SMS = 132  # SMs of an H100 SXM or an H200: the grid a compile without a GPU sizes for
HOPPER = ((9, 0),)
# Kernels with no Hopper-only instruction (K1, K2) may run on these; they are tested on Hopper only.
AMPERE_AND_LATER = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))


class UnsupportedProblem(ValueError):
    """A kernel cannot run this problem; the message names the violated constraint."""


class Config(Mapping):
    """A stage's configuration, frozen once made (FA4's ``tile_size_fwd_sm90`` returns one too):
    knob -> value, read as ``cfg["tile_n"]``; ``**cfg`` hands it to a kernel's constructor;
    ``cfg.with_(knob=value)`` is a changed copy. Every stage's ``config(p, overrides)`` returns one
    (``configure``)."""

    __slots__ = ("_knobs",)

    def __init__(self, knobs: Mapping = (), **more):
        object.__setattr__(self, "_knobs", dict(knobs, **more))

    def __getitem__(self, key):
        return self._knobs[key]

    def __iter__(self):
        return iter(self._knobs)

    def __len__(self) -> int:
        return len(self._knobs)

    def __setattr__(self, key, value):
        raise AttributeError(f"a Config is frozen (cfg.with_({key}=...) makes a changed copy)")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._knobs.items())))

    def __repr__(self) -> str:  # as a dict: error messages quote the configuration they refuse
        return repr(self._knobs)

    def with_(self, **changes) -> "Config":
        return Config(self._knobs, **changes)


def configure(defaults: Mapping, overrides: Optional[Mapping] = None) -> Config:
    """``defaults``, then every override that is not None (None keeps the default): the one rule
    behind every stage's ``config``."""
    return Config(defaults, **{k: v for k, v in (overrides or {}).items() if v is not None})


def as_causal(value) -> bool:
    """``causal`` as a Python bool. Only bools (Python or NumPy) are taken: a string such as
    "false" is truthy, and an int may be a seqlen passed in the wrong place."""
    return as_flag("causal", value)


def as_flag(name: str, value) -> bool:
    """A yes/no argument as a Python bool: only bools (Python or NumPy) are taken."""
    np = sys.modules.get("numpy")  # a NumPy bool exists only once numpy is imported
    if isinstance(value, bool) or (np is not None and isinstance(value, np.bool_)):
        return bool(value)
    raise UnsupportedProblem(f"{name} must be a bool (True or False), got {value!r} ({type(value).__name__})")


def as_window(window_size) -> tuple:
    """A sliding window (left, right): keys j' = j - (seqlen_k - seqlen_q) with i - left <= j' <= i + right
    for query i (bottom-right, as flash-attn); ints >= -1 (-1: unbounded); None is (-1, -1)."""
    if window_size is None:
        return -1, -1
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in window_size)):
        raise UnsupportedProblem(f"window_size must be a pair of ints (left, right), -1 for unbounded, got "
                                 f"{window_size!r}")
    left, right = (int(x) for x in window_size)
    if left < -1 or right < -1:
        raise UnsupportedProblem(f"window_size entries must be >= -1 (-1: unbounded), got {window_size!r}")
    return left, right


def as_softcap(softcap) -> float:
    """softcap as a float >= 0 (0 or None: off)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise UnsupportedProblem(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    return float(softcap)


def as_scale(value) -> float:
    """``softmax_scale`` as a Python float: any real number (int, float, NumPy scalar) or a 0-d
    CPU tensor or array holding one. Bools and CUDA tensors are refused (reading a CUDA tensor
    would synchronize the device, and cannot happen inside graph capture)."""
    if getattr(value, "is_cuda", False):
        raise UnsupportedProblem("softmax_scale must be a number on the host, got a CUDA tensor; "
                                 "pass float(scale) (read it once, outside the hot path)")
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # NumPy scalar, 0-d array or tensor
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise UnsupportedProblem(f"softmax_scale must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Problem:
    """One attention call: shapes, dtype, masking and scale."""

    batch: int
    nheads: int
    seqlen: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: bool = False
    softmax_scale: Optional[float] = None
    # K/V may have their own length (more keys than queries: chunked prefill) and fewer heads
    # (grouped-query attention: query head h reads K/V head h // group). None: as Q.
    seqlen_k: Optional[int] = None
    nheads_kv: Optional[int] = None
    # Gemma-2's logit softcap: scaled scores s become softcap * tanh(s / softcap) before the
    # softmax (0: off).
    softcap: float = 0.0
    # A sliding window (left, right), as_window's; causal keeps its right edge at 0 (the window's
    # right is then dropped), and (-1, -1) is no window.
    window: tuple = (-1, -1)
    # Packed sequences (flash-attn's varlen layout, cu_seqlens): batch counts the sequences, and
    # seqlen / seqlen_k are the longest ones (max_seqlen_q / max_seqlen_k).
    varlen: bool = False

    def __post_init__(self):
        for name in ("batch", "nheads", "seqlen", "head_dim", "seqlen_k", "nheads_kv"):
            value = getattr(self, name)
            if value is None and name in ("seqlen_k", "nheads_kv"):
                continue
            if not isinstance(value, int) or value < 1:
                raise UnsupportedProblem(f"{name} must be a positive integer, got {value!r}")
        # Equal to Q's is the same problem as unset (one cache key, one result row).
        for name, same in (("seqlen_k", self.seqlen), ("nheads_kv", self.nheads)):
            if getattr(self, name) == same:
                object.__setattr__(self, name, None)
        if self.nheads % self.kv_heads:
            raise UnsupportedProblem(f"nheads (of q) must be a multiple of nheads_kv (of k, v) for grouped-query "
                                     f"attention, got {self.nheads} and {self.kv_heads}")
        if self.dtype not in DTYPES + FP8_DTYPES:
            raise UnsupportedProblem(f"dtype must be one of {DTYPES + FP8_DTYPES}, got {self.dtype!r}")
        # Frozen: normalize through object.__setattr__, so equal problems hash equal (cache keys).
        object.__setattr__(self, "causal", as_causal(self.causal))
        object.__setattr__(self, "varlen", as_flag("varlen", self.varlen))
        if self.softmax_scale is not None:
            object.__setattr__(self, "softmax_scale", as_scale(self.softmax_scale))
        object.__setattr__(self, "softcap", as_softcap(self.softcap))
        left, right = as_window(self.window)
        object.__setattr__(self, "window", (left, -1 if self.causal else right))

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def out_dtype(self) -> str:
        """O's dtype: the inputs' own, bf16 for e4m3 inputs (no kernel writes FP8 O)."""
        return "bfloat16" if self.dtype in FP8_DTYPES else self.dtype

    @property
    def kv_len(self) -> int:
        return self.seqlen if self.seqlen_k is None else self.seqlen_k

    @property
    def kv_heads(self) -> int:
        return self.nheads if self.nheads_kv is None else self.nheads_kv

    @property
    def group(self) -> int:
        """Query heads per K/V head (1 without GQA)."""
        return self.nheads // self.kv_heads

    @property
    def sliding_window(self):
        """The window as the kernels' ``window`` argument takes it: (left, right), or None for none."""
        return self.window if self.window != (-1, -1) else None

    @property
    def lockstep(self) -> bool:
        """Whether every query tile reads the same K/V tiles: no causal mask, no window, no packed
        sequences (what K6's 2-CTA clusters and split tail assume)."""
        return not self.causal and self.window == (-1, -1) and not self.varlen

    @property
    def flops(self) -> float:
        """Standard count: two GEMMs of 2*Nq*Nk*d each per head. Causal (bottom-right) keeps
        Nq*Nk - Nq^2/2 of the score pairs: half of them when Nq == Nk, the convention; a window,
        the pairs it keeps (what flash-attn's benchmarks count)."""
        pairs = self.seqlen * self.kv_len - (self.seqlen * self.seqlen / 2 if self.causal else 0)
        if self.window != (-1, -1):  # the (query, key) pairs a window keeps, counted exactly
            left, right = self.window
            right, offset, last = 0 if self.causal else right, self.kv_len - self.seqlen, self.kv_len - 1
            pairs = sum(max(0, min(last, i + offset + right if right >= 0 else last)
                            - max(0, i + offset - left if left >= 0 else 0) + 1) for i in range(self.seqlen))
        return 4.0 * self.batch * self.nheads * pairs * self.head_dim

    def with_(self, **kw) -> "Problem":
        # K/V's length and heads are carried explicitly: an unset (equal-to-Q) seqlen_k must not
        # follow a new seqlen.
        return replace(self, **{"seqlen_k": self.kv_len, "nheads_kv": self.kv_heads, **kw})


@dataclass(frozen=True)
class Capabilities:
    """What a kernel supports. ``check`` raises :class:`UnsupportedProblem` otherwise."""

    head_dims: tuple
    dtypes: tuple = DTYPES
    causal: bool = True
    lse: bool = True
    max_seqlen: Optional[int] = None
    # Longest seqlen the sweep times: the CUDA-core stages take minutes beyond it.
    sweep_max_seqlen: Optional[int] = None
    # Why the lists above are what they are (an SMEM budget, say): appended to refusals.
    why: str = ""
    # K1 folds batch*heads into one grid dimension; the fused kernels use one each.
    folds_batch_heads: bool = False
    # Grouped-query attention (fewer K/V heads than Q heads), and K/V longer than Q (K5 on).
    gqa: bool = False
    unequal_lengths: bool = False
    # The logit softcap and the sliding window (Problem.softcap, .window): K5 on.
    softcap: bool = False
    window: bool = False
    varlen: bool = False
    # Most query heads per K/V head (decode packs a group into one 64-row query tile).
    max_group: Optional[int] = None
    # Compute capabilities the kernel's instructions exist on (TMA, WGMMA: Hopper only).
    archs: tuple = HOPPER

    def check(self, p: Problem, want_lse: bool = False) -> None:
        if p.head_dim not in self.head_dims:
            why = f"; {self.why}" if self.why else ""
            raise UnsupportedProblem(f"head_dim {p.head_dim} not supported (supported: {list(self.head_dims)}){why}")
        if p.dtype not in self.dtypes:
            raise UnsupportedProblem(f"dtype {p.dtype} not supported (supported: {list(self.dtypes)})")
        if p.varlen and not self.varlen:
            raise UnsupportedProblem("packed sequences (varlen) not supported by this kernel (the bf16/fp16 "
                                     "warp-specialized stages take them: k5, k6_pp, k6_overlap, k6)")
        if p.causal and not self.causal:
            raise UnsupportedProblem("causal masking not supported by this kernel")
        if want_lse and not self.lse:
            raise UnsupportedProblem("this kernel does not produce the log-sum-exp (LSE)")
        if p.kv_heads != p.nheads and not self.gqa:
            raise UnsupportedProblem(f"this kernel needs as many K/V heads as query heads (no grouped-query "
                                     f"attention), got nheads {p.nheads} and nheads_kv {p.kv_heads}")
        if self.max_group is not None and p.group > self.max_group:
            raise UnsupportedProblem(f"at most {self.max_group} query heads per K/V head (nheads {p.nheads} / nheads_kv "
                                     f"{p.kv_heads} = {p.group}): the heads of a group share one query tile")
        if p.softcap and not self.softcap:
            raise UnsupportedProblem(f"softcap {p.softcap} not supported by this kernel (the bf16/fp16 "
                                     "warp-specialized stages take it: k5, k6_pp, k6_overlap, k6)")
        if p.window != (-1, -1) and not self.window:
            raise UnsupportedProblem(f"window_size {p.window} not supported by this kernel (the bf16/fp16 "
                                     "warp-specialized stages take it: k5, k6_pp, k6_overlap, k6)")
        if p.window != (-1, -1) and p.seqlen > p.kv_len:
            raise UnsupportedProblem(f"a sliding window with more queries than keys (seqlen_q {p.seqlen} > seqlen_k "
                                     f"{p.kv_len}) is not supported: aligned bottom-right, some query rows would see no key")
        if p.kv_len != p.seqlen and not self.unequal_lengths:
            raise UnsupportedProblem(f"this kernel needs seqlen_k == seqlen_q (self-attention shapes), got "
                                     f"seqlen_q {p.seqlen} and seqlen_k {p.kv_len}")
        if p.causal and p.seqlen > p.kv_len:
            raise UnsupportedProblem(f"causal with more queries than keys (seqlen_q {p.seqlen} > seqlen_k {p.kv_len}) "
                                     "is not supported: aligned bottom-right, the first query rows would see no key")
        if self.max_seqlen is not None and max(p.seqlen, p.kv_len) > self.max_seqlen:
            raise UnsupportedProblem(f"seqlen {max(p.seqlen, p.kv_len)} exceeds this kernel's limit of {self.max_seqlen}")
        if self.folds_batch_heads and p.batch * p.nheads > GRID_YZ_LIMIT:
            raise UnsupportedProblem(f"batch*heads = {p.batch * p.nheads} exceeds the grid limit {GRID_YZ_LIMIT}")
        for name in ("nheads",) if p.varlen else ("batch", "nheads"):  # packed: one grid dimension of tiles
            if getattr(p, name) > GRID_YZ_LIMIT:
                raise UnsupportedProblem(f"{name} = {getattr(p, name)} exceeds the grid limit {GRID_YZ_LIMIT}")

    def check_device(self, capability: tuple) -> None:
        """Refuse a GPU whose compute capability lacks the kernel's instructions."""
        if tuple(capability) not in self.archs:
            names = ", ".join(f"sm_{a}{b}" for a, b in self.archs)
            raise UnsupportedProblem(
                f"this kernel is built for {names} (H100/H200); the GPU is sm_{capability[0]}{capability[1]}")


@dataclass
class CompiledAttention:
    """A compiled kernel bound to one problem: the JIT function(s) plus scratch buffers."""

    name: str
    problem: Problem
    launch: Callable[..., None]
    buffers: dict = field(default_factory=dict)
    ptx: Optional[str] = None
    info: dict = field(default_factory=dict)
    # Another @cute.jit function around the same kernel object, compiled on first use (``FusedLaunch``):
    # (key, make_entry(kernel), fake leading arguments) -> its launch.
    compile_entry: Optional[Callable] = None
    entries: dict = field(default_factory=dict)  # what compile_entry made, by its key


# --------------------------------------------------------------------------------------
# Compile helpers shared by every kernel module.
# --------------------------------------------------------------------------------------

def cute_dtype(name: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}[name]


def num_sms() -> int:
    """SMs of the current GPU (persistent grids, split counts), ``H100_SMS`` without one."""
    try:
        import torch
    except ImportError:
        return H100_SMS
    if not torch.cuda.is_available():
        return H100_SMS
    return _sms_of(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sms_of(device: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def ensure_arch() -> None:
    """Without a GPU the DSL cannot query the arch: compile for Hopper (sm_90a)."""
    if "CUTE_DSL_ARCH" in os.environ:
        return
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        pass
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"


class FakeShapes:
    """Symbolic batch, heads and seqlen shared by all tensors of one compile."""

    def __init__(self):
        import cutlass.cute as cute

        self.batch, self.nheads, self.seqlen = cute.sym_int(), cute.sym_int(), cute.sym_int()
        # K and V's own heads and length, for kernels that take GQA / seqlen_k != seqlen_q.
        self.nheads_kv, self.seqlen_k = cute.sym_int(), cute.sym_int()

    def tensor(self, dtype, trailing, align_elems: int = 8, kv: bool = False):
        """A (batch, heads, seqlen, *trailing) tensor: last stride 1, others symbolic.

        ``trailing`` is a tuple of extra dims (``(d,)`` for Q/K/V/O, ``()`` for LSE,
        ``(seqlen,)`` for K1's score matrix). The strides are declared divisible by
        ``align_elems`` (what lets TMA assume 16-byte aligned rows) only when that holds
        for every seqlen: when the trailing dims are static and their product divides
        evenly. LSE and S rows have a seqlen-long stride, so they get no such claim.
        """
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor

        heads, rows = (self.nheads_kv, self.seqlen_k) if kv else (self.nheads, self.seqlen)
        shape = (self.batch, heads, rows) + tuple(trailing)
        row = math.prod(trailing) if all(isinstance(t, int) for t in trailing) else None
        div = align_elems if row is not None and row % align_elems == 0 and len(trailing) > 0 else 1
        stride = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
        align = max(align_elems * dtype.width // 8, 1)
        return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


_JIT_CACHE: dict = {}


def jit_compile(key, build: Callable[[], tuple], keep_ptx: bool = False):
    """``cute.compile`` once per compile-time key.

    ``build()`` returns ``(jit_fn, args)``; args are fake tensors and placeholders. The
    compiled function takes torch tensors directly (TVM-FFI) and launches on the current
    torch stream.
    """
    full_key = (key, keep_ptx)
    if full_key not in _JIT_CACHE:
        ensure_arch()
        import cutlass.cute as cute

        fn, args = build()
        opts = "--enable-tvm-ffi"
        if not keep_ptx:
            _JIT_CACHE[full_key] = direct(cute.compile(fn, *args, options=opts))
        else:  # the DSL writes the PTX to a file and reads it back into compiled.artifacts.PTX
            import tempfile  # when compile returns, so the folder can go at once

            with tempfile.TemporaryDirectory(prefix="cute-ptx-") as dump:
                _JIT_CACHE[full_key] = cute.compile(fn, *args, options=f"{opts} --keep-ptx --dump-dir={dump}")
    return _JIT_CACHE[full_key]


def direct(compiled):
    """The TVM-FFI function itself where the DSL's wrapper around it has nothing to do (no keyword
    or pointer-address arguments: ours take tensors and numbers by position); a launch then skips
    two Python calls, about 0.5 us of host time on an H100's host. Without a GPU, the compiled
    object as it is."""
    raw = getattr(compiled, "__tvm_ffi_object__", None)
    fn = raw() if raw is not None else None
    if fn is None or compiled.execution_args.has_pointer_address_arg_specs:
        return compiled
    return fn


_FRESH_BUFFERS = contextvars.ContextVar("fresh_buffers", default=False)


@contextlib.contextmanager
def fresh_buffers():
    """Inside, ``StreamBuffers.get`` makes every set anew and keeps nothing. For the torch custom
    ops' bodies: under torch.compile with CUDA graphs (mode="reduce-overhead") even the warm-up
    run before capture allocates from the graph's private pool, which a kept set must not hold."""
    token = _FRESH_BUFFERS.set(True)
    try:
        yield
    finally:
        _FRESH_BUFFERS.reset(token)


class StreamBuffers:
    """Buffers of eager calls, one set per (device, stream, shape), made once and reused call after
    call: an allocation costs about as much host time as the launch. Launches on one stream run one
    after another, so one set per stream is enough. Under CUDA-graph capture (and ``fresh_buffers``)
    every set is made for its call and kept by the graph's pool alone: dropping a kept set (``MAX``
    shapes, then start over) would free memory that the graph replays."""

    MAX = 64

    def __init__(self):
        self._sets = {}

    def get(self, device_index: int, shape_key: tuple, make):
        import torch

        if _FRESH_BUFFERS.get() or torch._C._cuda_isCurrentStreamCapturing():
            return make()
        key = (device_index, torch._C._cuda_getCurrentRawStream(device_index), shape_key)  # an int: cheap
        got = self._sets.get(key)
        if got is None:
            if len(self._sets) >= self.MAX:
                self._sets.clear()
            got = self._sets[key] = make()
        return got


_SCRATCH = StreamBuffers()


def scratch(like, role: str, shape: tuple, dtype):
    """A buffer for an intermediate that only kernels on the current stream read (a pre-pass's
    e4m3 copies, V^T, descale rows), on ``like``'s device: one per (device, stream, role, shape),
    reused call after call (an allocation costs about 2 us of host time)."""
    return scratch_set(like, role, ((shape, dtype),))[0]


def scratch_set(like, role: str, specs: tuple) -> tuple:
    """``scratch`` for several buffers at once, ``specs`` a tuple of (shape, dtype): one lookup
    (each costs a call about 1.5 us of host time on an H100's host)."""
    return _SCRATCH.get(like.get_device(), (role, specs), lambda: tuple(like.new_empty(s, dtype=d) for s, d in specs))


def buffer(like, role: str, shape: tuple, dtype, keep: bool):
    """An output on ``like``'s device: ``scratch`` under ``role`` with ``keep`` (the pre-pass of a
    launch), else a new tensor (a caller's own)."""
    return buffers(like, role, ((shape, dtype),), keep)[0]


def buffers(like, role: str, specs: tuple, keep: bool) -> tuple:
    """Outputs on ``like``'s device, one per (shape, dtype) in ``specs``: ``scratch_set`` with
    ``keep`` (the pre-pass of a launch), else new tensors (a caller's own)."""
    if keep:
        return scratch_set(like, role, specs)
    return tuple(like.new_empty(s, dtype=d) for s, d in specs)


class FusedLaunch:
    """Pre-pass kernels and a stage's kernel in one host call: ``make_entry(kernel)``, a @cute.jit
    function launching them in order on one stream, compiled on first use; ``specs``, the
    (shape, torch dtype) of the scratch they write (one set per device and stream); ``constants``,
    tensors made once. A launch from Python costs its caller several microseconds, about what a
    small pre-pass kernel takes on the GPU. Called as ``run_kernel`` is, less the compiled problem;
    the entry takes (q, k, v, out, lse, *descales, *constants, *scratch, softmax_scale)."""

    def __init__(self, compiled: CompiledAttention, key, make_entry, head_args, specs: tuple, constants: tuple = ()):
        self.launch = compiled.entries.get(key)
        if self.launch is None:
            self.launch = compiled.entries[key] = compiled.compile_entry(key, make_entry, head_args)
        self.role, self.specs, self.constants = key, specs, constants

    def __call__(self, q, k, v, out, lse, scale, descales=()) -> None:
        self.launch(q, k, v, out, lse, *descales, *self.constants, *scratch_set(q, self.role, self.specs), scale)


def fake_stream():
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=True)


def fake_attention_args(dtype, head_dim: int, separate_kv: bool = False) -> tuple:
    """Placeholders for one fused-kernel compile: (q, k, v, o, lse, softmax_scale, stream).
    With ``separate_kv`` K and V get heads and a length of their own (GQA, seqlen_k)."""
    import cutlass

    f = FakeShapes()
    q, o = (f.tensor(dtype, (head_dim,)) for _ in range(2))
    k, v = (f.tensor(dtype, (head_dim,), kv=separate_kv) for _ in range(2))
    return (q, k, v, o, f.tensor(cutlass.Float32, ()), cutlass.Float32(1.0), fake_stream())


def fused_attention(name: str, p: Problem, fn, keep_ptx: bool, info: Optional[dict] = None) -> CompiledAttention:
    """Bind a compiled single-launch kernel (every stage after K1) to one problem: the JIT
    function already takes (q, k, v, out, lse, softmax_scale), so it is the launch itself."""
    return CompiledAttention(name, p, fn, {}, compiled_ptx(fn) if keep_ptx else None, info or {})


def run_kernel(compiled: CompiledAttention, q, k, v, out, lse, softmax_scale: Optional[float] = None) -> None:
    """The contract's launch-only entry; every stage's ``run_kernel`` is this one.

    The scale is a runtime argument of every kernel, so one compiled problem serves any
    scale; it defaults to the problem's own.
    """
    scale = compiled.problem.scale if softmax_scale is None else softmax_scale
    compiled.launch(q, k, v, out, lse, scale)


def compiled_ptx(compiled) -> Optional[str]:
    try:
        return compiled.artifacts.PTX
    except AttributeError:
        return None


