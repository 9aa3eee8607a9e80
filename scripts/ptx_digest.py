"""The PTX of every registered kernel, as digests: the check that a refactor moved code and changed
no instruction (no GPU needed).

    python scripts/ptx_digest.py --out /tmp/before.json      # before a move
    python scripts/ptx_digest.py --check /tmp/before.json    # after it: exit 1 where any PTX differs
    python scripts/ptx_digest.py --backward --out ...        # the backward's builds instead

Every kernel is compiled for sm_90a at each of its head dims among 64/128/256, causal and not, in
bf16 (and e4m3 for the FP8 stages), with the default configuration of a problem of 4096 rows (the
configuration can depend on the length: ``--seqlen`` picks another), plus the FP8 pre-pass
kernels. ``--backward``: the pre-pass, main kernel and post-pass of every backward stage
(``harness.backward.VARIANTS``) at d 64/128/256, causal and not, of 1000 rows; K10's default
(``k10_fa3``) also deterministic, packed, under a softcap and with a window; and each of K10's knobs
measured and left off (``BACKWARD_KNOBS``, spelled as overrides so that a tree from before
``kernels/k10_experiments.py`` builds them too). A digest is the sha256 of the PTX text, the
kernels' entry names set aside.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.inspect_ptx import without_kernel_names  # noqa: E402
from kernels import get_kernel, kernel_names  # noqa: E402
from kernels.contract import FP8_DTYPES, Problem, UnsupportedProblem, compiled_ptx  # noqa: E402


def digest(ptx: str) -> str:
    """sha256 of the PTX with the kernels' entry names set aside (``without_kernel_names``)."""
    return hashlib.sha256(without_kernel_names(ptx).encode()).hexdigest()


def kernel_digests(seqlen: int) -> dict:
    out = {}
    for name in kernel_names():
        caps = get_kernel(name).caps
        for d in (64, 128, 256):
            if d not in caps.head_dims:
                continue
            for dtype in [t for t in caps.dtypes if t == "bfloat16" or t in FP8_DTYPES]:
                for causal in (False, True):
                    key = f"{name} d={d} {dtype} causal={int(causal)}"
                    try:
                        compiled = get_kernel(name).compile(Problem(1, 2, seqlen, d, dtype=dtype, causal=causal),
                                                            keep_ptx=True)
                    except UnsupportedProblem as e:
                        out[key] = f"refused: {e}"
                        continue
                    out[key] = digest(compiled.ptx or "")
                    print(f"{key}: {out[key][:12]}", flush=True)
    return out


# K10's knobs measured and left off, as compile overrides over the stage they were measured on:
# (label, base stage or overrides, the knob's overrides, head dims, problem changes)
_PACKED = dict(varlen=True, nheads_kv=2)
BACKWARD_KNOBS = tuple((f"k10_fa3+{name}", "k10_fa3", knob, (64, 128), {}) for name, knob in (
    ("rows_ahead", dict(rows_ahead=True)), ("select_rows", dict(select_rows=True)), ("early_dv", dict(early_dv=True)),
    ("scale_at_end", dict(scale_at_end=True)), ("dq_stages=2", dict(dq_stages=2)),
    ("scale_at_end+early_dv", dict(scale_at_end=True, early_dv=True)))) + (
    ("k10_fa3+scale_at_end packed", "k10_fa3", dict(scale_at_end=True), (64, 128), _PACKED),
    ("k10_fa3+dkv_tma_packed packed", "k10_fa3", dict(dkv_tma_packed=True), (64, 128), _PACKED),
    ("k10_fa3+select_rows+dq_stages=2 deterministic", "k10_fa3", dict(select_rows=True, dq_stages=2,
                                                                     deterministic=True), (64, 128), {}),
    ("k10 edges+ds_free_once", dict(overlap=True, dq_flat=True, ds_stmatrix=True, mask_edges=True),
     dict(ds_free_once=True), (64, 128), {}),
    ("k10_fa3+dq_swapab tile_m=80", "k10_fa3", dict(dq_swapab=True, tile_m=80), (128,), {}),
    ("k10_fa3+dq_swapab tile_m=80 packed", "k10_fa3", dict(dq_swapab=True, tile_m=80), (128,), _PACKED),
    ("k10_overlap+dq_swapab tile_m=80", dict(overlap=True, ds_stmatrix=True), dict(dq_swapab=True, tile_m=80),
     (128,), {}))


def backward_digests() -> dict:
    from harness.backward import VARIANTS, stage_module, stage_overrides

    out = {}

    def add(key, p, module, overrides):
        try:
            compiled = module.compile_backward(p, keep_ptx=True, **overrides)
        except UnsupportedProblem as e:
            out[key] = f"refused: {e}"
            return
        for part, fn in zip(("pre", "main", "post"), compiled[:3]):
            out[f"{key} {part}"] = digest(compiled_ptx(fn))
        print(f"{key}: {out[key + ' main'][:12]}", flush=True)

    cases = []
    for d in (64, 128, 256):
        for causal in (False, True):
            p = Problem(2, 4, 1000, d, causal=causal)
            cases += [(f"{stage} d={d} causal={int(causal)}", p, stage, {}) for stage in VARIANTS]
            cases += [(f"k10_fa3 {label} d={d} causal={int(causal)}", q, "k10_fa3", more) for label, q, more in (
                ("deterministic", p, dict(deterministic=True)), ("packed", p.with_(**_PACKED), {}),
                ("softcap", p.with_(softcap=30.0), {}), ("window", p.with_(window=(256, 0 if causal else 128)), {}))]
    for label, base, knob, head_dims, change in BACKWARD_KNOBS:
        for d in head_dims:
            for causal in (False, True):
                p = Problem(2, 4, 1000, d, causal=causal).with_(**change)
                cases.append((f"{label} d={d} causal={int(causal)}", p, base, knob))
    for key, p, base, more in cases:
        stage = base if isinstance(base, str) else "k10"
        overrides = stage_overrides(base) if isinstance(base, str) else base
        add(key, p, stage_module(stage), dict(overrides, **more))
    return out


def helper_digests() -> dict:
    from kernels import fp8_quant, k7, k8

    out = {}
    for with_descales in (False, True):
        out[f"TransposeV with_descales={with_descales}"] = digest(
            compiled_ptx(k7.compile_transpose_v(keep_ptx=True, with_descales=with_descales)))
    for d in (64, 128, 256):
        tile_m, tile_n = k8.block_sizes(d)
        out[f"QuantizeInputs d={d}"] = digest(compiled_ptx(fp8_quant.compile_quantize_inputs(
            d, tile_m, tile_n, True, "bfloat16", keep_ptx=True)))
        out[f"QuantizeBlocks d={d}"] = digest(compiled_ptx(fp8_quant.compile_quantize_blocks(
            d, tile_m, True, "bfloat16", keep_ptx=True)))
        for i, fn in enumerate(fp8_quant.compile_quantize_tensors(d, 3, "bfloat16", keep_ptx=True)):
            out[f"QuantizeTensors d={d} {('amax', 'cast')[i]}"] = digest(compiled_ptx(fn))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the digests here")
    ap.add_argument("--check", help="compare with the digests in this file; exit 1 where any differs")
    ap.add_argument("--seqlen", type=int, default=4096, help="rows of the problem each kernel is configured for")
    ap.add_argument("--backward", action="store_true", help="the backward's builds (K9, K10 and its knobs) instead")
    args = ap.parse_args(argv)
    if not args.out and not args.check:
        ap.error("give --out, --check or both")
    if args.backward and args.seqlen != 4096:
        ap.error("--seqlen is the forward's: the backward's builds take 1000 rows")
    now = backward_digests() if args.backward else {**kernel_digests(args.seqlen), **helper_digests()}
    if args.out:
        Path(args.out).write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    if args.check:
        then = json.loads(Path(args.check).read_text())
        changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
        for k in changed:
            print(f"differs: {k}: {str(then.get(k))[:12]} -> {str(now.get(k))[:12]}")
        print(f"{len(now) - len(changed)} of {len(now)} PTX digests identical" if not changed else
              f"{len(changed)} of {len(set(now) | set(then))} differ")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
