"""Registry of kernel stages. The harness finds every kernel through ``get_kernel(name)``.

Each entry names the module implementing the contract in ``kernels/contract.py`` and the
variant keyword arguments passed to its ``compile_kernel`` (K3's pipeline depth, K4's seed
configuration).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field

from .contract import Capabilities, CompiledAttention, Problem, UnsupportedProblem, ensure_arch  # noqa: F401

# Before any kernel module imports cutlass: the DSL reads its target arch at import.
ensure_arch()


@dataclass(frozen=True)
class KernelEntry:
    name: str
    module: str
    title: str
    variant: dict = field(default_factory=dict)
    block_descales: bool = False  # e4m3 inputs come with a descale per block (K8), not three numbers

    def load(self):
        return importlib.import_module(self.module)

    @property
    def available(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    @property
    def caps(self) -> Capabilities:
        """What this entry supports. A module whose variants differ (K3's pipeline depth
        decides which head dims fit in SMEM) defines ``capabilities(**variant)``."""
        mod = self.load()
        if hasattr(mod, "capabilities"):
            return mod.capabilities(**self.variant)
        return mod.CAPS

    def compile(self, problem: Problem, **kw) -> CompiledAttention:
        self.caps.check(problem)
        return self.load().compile_kernel(problem, **self.variant, **kw)

    def run(self, compiled: CompiledAttention, q, k, v, out, lse, softmax_scale=None, **kw) -> None:
        """``kw``: what a stage's run_kernel takes beyond the contract (K7: FP8 ``descale``)."""
        self.load().run_kernel(compiled, q, k, v, out, lse, softmax_scale, **kw)


_ENTRIES = [
    KernelEntry("k1", "kernels.k1", "naive: three launches, S materialized in GMEM"),
    KernelEntry("k2", "kernels.k2", "FA2 on CUDA cores: fused tiled online softmax"),
    KernelEntry("k3_1", "kernels.k3", "TMA loads, 1 KV stage", {"kv_stages": 1}),
    KernelEntry("k3_2", "kernels.k3", "TMA loads, 2 KV stages", {"kv_stages": 2}),
    KernelEntry("k3_3", "kernels.k3", "TMA loads, 5 KV stages", {"kv_stages": 5}),
    KernelEntry("k4_qk", "kernels.k4_qk", "WGMMA for QK, scores laundered via SMEM, scalar PV"),
    KernelEntry("k4_seed", "kernels.k4", "WGMMA for PV too, P handed over in registers; K4.1's 1 warpgroup, "
                "64-key tiles, 5 KV stages", {"num_wg": 1, "tile_n": 64, "kv_stages": 5, "refill_lag": 1}),
    KernelEntry("k4", "kernels.k4", "k4_seed tuned per head dim: 2-3 warpgroups, fewer KV stages, 128-key tiles "
                "at d=64/128"),
    KernelEntry("k5", "kernels.k5", "warp specialization: a TMA producer warp, setmaxnreg, separate K/V pipelines"),
    KernelEntry("k6_pp", "kernels.k6", "ping-pong on K5's configuration: consumer warpgroups take turns on the tensor "
                "cores", {"pingpong": True, "overlap": False, "tuned": False}),
    KernelEntry("k6_overlap", "kernels.k6", "plus intra-warpgroup overlap: softmax of tile j+1 under PV of tile j",
                {"pingpong": True, "overlap": True, "tuned": False}),
    KernelEntry("k6", "kernels.k6", "K6 as measured per shape: the overlap (and ping-pong) where they pay, tile widths, "
                "TMA-store epilogue, 2-CTA clusters"),
    KernelEntry("k7_k4", "kernels.k7", "FP8 on K4's loop: both GEMMs as e4m3 WGMMAs, V^T in a timed pre-pass",
                {"structure": "k4"}),
    KernelEntry("k7", "kernels.k7", "FP8 on K6's warp-specialized ping-pong kernel; takes e4m3 inputs with descales"),
    KernelEntry("k8", "kernels.k8", "FP8 with a scale per Q/K/V tile and Q, K rotated by a random Hadamard "
                "matrix before quantization (FA3's accuracy fixes)", block_descales=True),
    KernelEntry("decode_nosplit", "kernels.decode", "flash decode without the split: K4 at 1 warpgroup, GQA heads "
                "packed into the query tile", {"num_splits": 1}),
    KernelEntry("decode_combine", "kernels.decode", "flash decode: the KV walk split across CTAs to fill the SMs, "
                "a combine kernel merges the splits by LSE", {"merge": "combine"}),
    KernelEntry("decode", "kernels.decode", "flash decode, the merge in the main kernel: the last CTA of each "
                "split group combines (one launch)", {"merge": "last_cta"}),
]

REGISTRY = {e.name: e for e in _ENTRIES}


def get_kernel(name: str) -> KernelEntry:
    entry = REGISTRY.get(name)
    if entry is None or not entry.available:
        raise UnsupportedProblem(f"unknown kernel {name!r}; available: {', '.join(kernel_names())}")
    return entry


def kernel_names() -> list:
    """Registered kernels whose module exists, in worklog order."""
    return [e.name for e in _ENTRIES if e.available]
