"""Workload configuration from environment variables and command-line flags.

Environment (as in the worklog): SEQLEN, HEADDIM, CAUSAL, BATCH, NHEADS, DTYPE, CHECK.
Flags override the environment. When BATCH/NHEADS are not given the FA papers' convention
keeps the work per call fixed: batch = 16384 / seqlen, heads = 2048 / head_dim.
"""

from __future__ import annotations

import os

from kernels.contract import DTYPES, FP8_DTYPES, Problem, UnsupportedProblem

SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_HEAD_DIMS = (64, 128, 256)
SWEEP_CAUSAL = (False, True)
# FP8 (--dtype fp8): the FA3 paper's FP8 grid, where cuDNN's FP8 attention is the peer.
FP8_SWEEP_HEAD_DIMS = (128, 256)
FP8_SWEEP_SEQLENS = (2048, 4096, 8192, 16384)
DEFAULTS = dict(seqlen=4096, headdim=128, causal=False, dtype="bfloat16")
# flag -> environment variable; a flag wins over its variable, and errors name whichever was used.
KNOBS = {"seqlen": "SEQLEN", "headdim": "HEADDIM", "causal": "CAUSAL", "batch": "BATCH", "nheads": "NHEADS",
         "dtype": "DTYPE"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_window(text: str) -> tuple:
    """A --window flag's LEFT,RIGHT as two ints (``as_window`` checks their values)."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise UnsupportedProblem(f"--window takes LEFT,RIGHT (two ints, -1 unbounded), got {text!r}") from None
    return left, right


def parse_bool(text, name="flag") -> bool:
    t = str(text).strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise UnsupportedProblem(f"{name} must be 0/1 (or true/false), got {text!r}")


def parse_int(text, name) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UnsupportedProblem(f"{name} must be an integer, got {text!r}") from None
    if value < 1:
        raise UnsupportedProblem(f"{name} must be positive, got {value}")
    return value


def parse_dtype(text, name) -> str:
    dtype = str(text).strip().lower()
    dtype = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8_e4m3fn",
             "e4m3": "float8_e4m3fn"}.get(dtype, dtype)
    if dtype not in DTYPES + FP8_DTYPES:
        raise UnsupportedProblem(f"{name} must be one of {DTYPES + FP8_DTYPES} (or bf16/fp16/fp8), got {text!r}")
    return dtype


def default_batch_heads(seqlen: int, head_dim: int) -> tuple:
    return max(1, 16384 // seqlen), max(1, 2048 // head_dim)


def workload_given(env=None, **flags) -> dict:
    """knob -> parsed value, for each knob a flag (not None) or an environment variable sets."""
    env = os.environ if env is None else env
    given = {}
    for knob, var in KNOBS.items():
        if flags.get(knob) is not None:
            raw, name = flags[knob], f"--{knob}"
        elif var in env:
            raw, name = env[var], var
        else:
            continue
        parse = {"causal": parse_bool, "dtype": parse_dtype}.get(knob, parse_int)
        given[knob] = (parse(raw, name), name)
    return given


def problem_from(env=None, **flags) -> Problem:
    """Build the benchmark Problem: flags (not None) win over env vars, then defaults."""
    given = {k: value for k, (value, _) in workload_given(env, **flags).items()}
    w = {**DEFAULTS, **given}
    b0, h0 = default_batch_heads(w["seqlen"], w["headdim"])
    return Problem(w.get("batch", b0), w.get("nheads", h0), w["seqlen"], w["headdim"], dtype=w["dtype"],
                   causal=w["causal"])


def fixed_by_sweep(given: dict) -> list:
    """The flags or variables among ``given`` (``workload_given``'s) that a sweep refuses: it keeps
    each cell's batch and heads."""
    return [given[knob][1] for knob in ("batch", "nheads") if knob in given]


def sweep_problems(env=None, **flags) -> list:
    """The sweep grid (head dim x causal x seqlen, batch = 16384/seqlen, heads = 2048/head_dim);
    a seqlen, head dim or causal flag (or variable) restricts its axis to that one value."""
    given = workload_given(env, **flags)
    refused = fixed_by_sweep(given)
    if refused:
        raise UnsupportedProblem(f"{refused[0]} cannot be combined with --sweep, which keeps the work per "
                                 "call fixed (batch = 16384/seqlen, heads = 2048/head_dim); drop it, or time "
                                 "one workload without --sweep")

    def axis(knob, values):
        return (given[knob][0],) if knob in given else values

    dtype = given["dtype"][0] if "dtype" in given else DEFAULTS["dtype"]
    head_dims, seqlens = (FP8_SWEEP_HEAD_DIMS, FP8_SWEEP_SEQLENS) if dtype in FP8_DTYPES else (SWEEP_HEAD_DIMS,
                                                                                               SWEEP_SEQLENS)
    return [Problem(*default_batch_heads(n, d), n, d, dtype=dtype, causal=c)
            for d in axis("headdim", head_dims) for c in axis("causal", SWEEP_CAUSAL)
            for n in axis("seqlen", seqlens)]
