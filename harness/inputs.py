"""Validation of user tensors and the per-problem buffers the harness hands to kernels."""

from __future__ import annotations

from kernels.contract import DTYPES, FP8_DTYPES, Problem, UnsupportedProblem


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "float8_e4m3fn": torch.float8_e4m3fn}[name]


def require_name(name) -> None:
    """A kernel name is a string (the op's schema would refuse anything else in its own words)."""
    if not isinstance(name, str):
        from kernels import kernel_names

        raise UnsupportedProblem(f"the kernel name must be a string, one of {', '.join(kernel_names())}; "
                                 f"got {name!r} ({type(name).__name__})")


def require_tensors(q, k, v) -> None:
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedProblem(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def shared_dtype(names: str, *tensors) -> str:
    """The one dtype of ``tensors`` (named ``names`` in the message), as a contract dtype name."""
    if any(t.dtype != tensors[0].dtype for t in tensors):
        raise UnsupportedProblem(f"{names} must share a dtype, got {', '.join(str(t.dtype) for t in tensors)}")
    dtype = str(tensors[0].dtype).replace("torch.", "")
    if dtype.startswith("float8") and dtype not in FP8_DTYPES:
        raise UnsupportedProblem(f"FP8 inputs must be float8_e4m3fn (the 8-bit WGMMA format these kernels use), "
                                 f"got {tensors[0].dtype}")
    if dtype not in DTYPES + FP8_DTYPES:
        raise UnsupportedProblem(f"dtype must be bfloat16, float16 or float8_e4m3fn, got {tensors[0].dtype}")
    return dtype


def problem_from_tensors(q, k, v, causal: bool, softmax_scale=None, softcap: float = 0.0, window=(-1, -1)) -> Problem:
    """Check q, k, v against the SDPA-layout contract and describe them as a Problem.

    Every refusal names the constraint. Nothing here needs a GPU: shapes, dtype, strides,
    causal and scale are checked first, so that a CPU machine reports the real problem;
    ``require_cuda`` and the kernel's own limits (its Capabilities) come after.
    """
    require_tensors(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise UnsupportedProblem(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise UnsupportedProblem(
            "k and v must have one shape (batch, nheads_kv, seqlen_k, head_dim) with q's batch and head_dim: "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if min(q.shape) < 1 or min(k.shape) < 1:
        raise UnsupportedProblem(f"batch, heads, seqlen and head_dim must all be positive, got shapes "
                                 f"{tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise UnsupportedProblem(f"q's heads must be a multiple of k/v's (grouped-query attention), got "
                                 f"{q.shape[1]} and {k.shape[1]}")
    dtype = shared_dtype("q, k, v", q, k, v)
    # Before the stride check, which would otherwise blame the layout.
    if dtype in FP8_DTYPES and q.shape[-1] % 32:
        raise UnsupportedProblem(f"FP8 head_dim must be a multiple of 32 (the 8-bit WGMMA's K step), got {q.shape[-1]}")
    if q.shape[-1] % 8:
        raise UnsupportedProblem(f"head_dim must be a multiple of 8 (rows are moved in 16-byte pieces), "
                                 f"got {q.shape[-1]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_rows(name, t)
    if not (q.device == k.device == v.device):
        raise UnsupportedProblem(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, h, n, d = q.shape
    return Problem(b, h, n, d, dtype=dtype, causal=causal, softmax_scale=softmax_scale, seqlen_k=k.shape[2],
                   nheads_kv=k.shape[1], softcap=softcap, window=window)


def require_rows(name: str, t) -> None:
    """A contiguous last dim and rows in 16-byte pieces: what TMA (and the quantizers' 16-byte
    loads) read."""
    if t.stride(-1) != 1:
        raise UnsupportedProblem(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    row = 16 // t.element_size()  # elements per 16 bytes: TMA strides are multiples of 16 bytes
    if any(s % row for s in t.stride()[:-1]) or t.data_ptr() % 16:
        raise UnsupportedProblem(
            f"{name} must be 16-byte aligned with strides that are multiples of {row} elements "
            f"(TMA rows), got strides {t.stride()}; call .contiguous() first"
        )


QUANTIZABLE = ("bfloat16", "float16", "float32")


def require_quantizable(role: str, x, head_dims: tuple) -> None:
    """``x`` as the FP8 quantizers take it: a floating-point (batch, heads, seqlen, head_dim) tensor
    with a head dim the FP8 stages run, a contiguous last dim and rows in 16-byte pieces."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise UnsupportedProblem(f"{role} must be a torch.Tensor, got {type(x).__name__}")
    dtype = str(x.dtype).replace("torch.", "")
    if dtype not in QUANTIZABLE:
        raise UnsupportedProblem(f"{role} must be {', '.join(QUANTIZABLE)} to be quantized to FP8, got {x.dtype}")
    if x.dim() != 4:
        raise UnsupportedProblem(f"{role} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(x.shape)}")
    if min(x.shape) < 1:
        raise UnsupportedProblem(f"{role}'s batch, heads, seqlen and head_dim must all be positive, got {tuple(x.shape)}")
    if x.shape[-1] not in head_dims:
        raise UnsupportedProblem(f"{role}: head_dim {x.shape[-1]} not supported by the FP8 stages "
                                 f"(supported: {list(head_dims)})")
    require_rows(role, x)


def require_cuda(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise UnsupportedProblem(f"{name} must be a CUDA tensor, got device {t.device}")


def random_inputs(p: Problem, device="cuda", seed=None):
    """Fresh N(0,1) q, k, v in the problem's dtype (never zeros: they hide unwritten outputs)."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    shapes = ((p.batch, p.nheads, p.seqlen, p.head_dim),) + ((p.batch, p.kv_heads, p.kv_len, p.head_dim),) * 2
    return tuple(torch.randn(shape, generator=gen, device=device, dtype=torch_dtype(p.dtype)) for shape in shapes)


def empty_outputs(p: Problem, device="cuda"):
    """Uninitialized O (the inputs' dtype; bf16 for e4m3 inputs) and LSE (float32): every kernel writes all of both."""
    import torch

    out = torch.empty((p.batch, p.nheads, p.seqlen, p.head_dim), device=device, dtype=torch_dtype(p.out_dtype))
    lse = torch.empty((p.batch, p.nheads, p.seqlen), device=device, dtype=torch.float32)
    return out, lse


def poisoned_outputs(p: Problem, device="cuda"):
    """O and LSE filled with NaN, so any element a kernel fails to write fails the check."""
    out, lse = empty_outputs(p, device)
    return out.fill_(float("nan")), lse.fill_(float("nan"))
