"""Workload configuration from environment variables and command-line flags.

Environment (as in the worklog): SEQLEN, HEADDIM, CAUSAL, BATCH, NHEADS, DTYPE, CHECK.
Flags override the environment. When BATCH/NHEADS are not given the FA papers' convention
keeps the work per call fixed: batch = 16384 / seqlen, heads = 2048 / head_dim.
"""

from __future__ import annotations

import os

from kernels.contract import DTYPES, Problem, UnsupportedProblem

SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SWEEP_HEAD_DIMS = (64, 128)
SWEEP_CAUSAL = (False, True)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


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


def default_batch_heads(seqlen: int, head_dim: int) -> tuple:
    return max(1, 16384 // seqlen), max(1, 2048 // head_dim)


def problem_from(env=None, **flags) -> Problem:
    """Build the benchmark Problem: flags (not None) win over env vars, then defaults."""
    env = os.environ if env is None else env

    def pick(flag, var, default):
        if flags.get(flag) is not None:
            return flags[flag]
        return env.get(var, default)

    seqlen = parse_int(pick("seqlen", "SEQLEN", 4096), "SEQLEN")
    head_dim = parse_int(pick("headdim", "HEADDIM", 128), "HEADDIM")
    causal = parse_bool(pick("causal", "CAUSAL", 0), "CAUSAL")
    dtype = str(pick("dtype", "DTYPE", "bfloat16")).strip().lower()
    dtype = {"bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)
    if dtype not in DTYPES:
        raise UnsupportedProblem(f"DTYPE must be one of {DTYPES} (or bf16/fp16), got {dtype!r}")
    b0, h0 = default_batch_heads(seqlen, head_dim)
    batch = parse_int(pick("batch", "BATCH", b0), "BATCH")
    nheads = parse_int(pick("nheads", "NHEADS", h0), "NHEADS")
    return Problem(batch, nheads, seqlen, head_dim, dtype=dtype, causal=causal)


def sweep_problems(dtype="bfloat16"):
    for head_dim in SWEEP_HEAD_DIMS:
        for causal in SWEEP_CAUSAL:
            for seqlen in SWEEP_SEQLENS:
                b, h = default_batch_heads(seqlen, head_dim)
                yield Problem(b, h, seqlen, head_dim, dtype=dtype, causal=causal)
