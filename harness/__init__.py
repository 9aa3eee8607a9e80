"""Harness: the public ``attention`` call, correctness checks, timing and result files."""

from kernels.contract import Problem, UnsupportedProblem  # noqa: F401

from .api import attention, quantize_fp8, quantize_fp8_blocks  # noqa: F401
from .backward import attention_backward  # noqa: F401
from .varlen import attention_varlen, attention_varlen_backward  # noqa: F401
