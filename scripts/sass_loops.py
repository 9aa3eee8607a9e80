"""Instruction census of a kernel's KV-tile loops, from its SASS (no GPU needed).

    CUTE_DSL_ARCH=sm_90a python scripts/sass_loops.py --headdim 128 --causal 1 --out results/sass-loops.json
    python scripts/sass_loops.py --headdim 128 --causal 1 --fa4 ...   # flash-attn-4's sm90 kernel beside it

The kernel is compiled for the problem (the seqlen picks K6's variant), its PTX assembled by
``ptxas`` and disassembled by ``cuobjdump`` (both on PATH: a CUDA toolkit, or the copies in
Triton's wheel under ``triton/backends/nvidia/bin``). A loop is a backward branch; the ones that
hold a tile's WGMMAs and exponentials (``HGMMA`` and at least one ``MUFU`` per 2 scores of a row)
and fewer than 1000 instructions are the per-KV-tile loops, one per masked / unmasked flavour
and per copy of the mainloop. Rows are appended to --out as they are made.

With ``--fa4`` the same census is taken of flash-attn-4's ``FlashAttentionForwardSm90`` built
with its own tile choice for the head dim (``flash_attn.cute.interface._tile_size_fwd_sm90``),
compiled the same way on fake tensors.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from harness import results  # noqa: E402

GROUPS = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP", "ISETP", "R2P")
UNIFORM = re.compile(r"^U[A-Z]")  # uniform-datapath instructions (UIADD3, UMOV, ...): descriptors, indices


def tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise SystemExit(f"{name} is not on PATH (a CUDA toolkit's bin/, or Triton's triton/backends/nvidia/bin)")
    return path


def sass_of(ptx: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        subprocess.run([tool("ptxas"), "--gpu-name", "sm_90a", str(src), "-o", str(cubin)], check=True)
        return subprocess.run([tool("cuobjdump"), "--dump-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout


def tile_loops(sass: str, d: int, tile_n: int) -> list:
    """[(start, end, Counter of opcodes)] of the KV-tile loops, in address order."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    spans = []  # (first, last) instruction index of every loop longer than a barrier spin-wait
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index and i - index[int(m.group(1), 16)] > 100:
            spans.append((index[int(m.group(1), 16)], i))
    loops = []
    for first, last in spans:
        if any(first <= f and l <= last and (f, l) != (first, last) for f, l in spans):
            continue  # not innermost: the tile loops sit inside the query-tile loop
        body = ins[first:last + 1]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
        # One KV tile: d/16 QK and tile_n/16 PV k-steps, tile_n/2 exponentials per thread (2 rows)
        # plus the rows' rescale factors. Spans that end in out-of-line code hold more.
        if ops["HGMMA"] == (d + tile_n) // 16 and tile_n // 2 <= ops["MUFU"] <= tile_n // 2 + 2:
            loops.append((body[0][0], body[-1][0], ops, exps_before_pv_wait([t for _, t in body])))
    return loops


def exps_before_pv_wait(body: list):
    """With the overlap, PV of the previous tile runs under this tile's softmax until
    ``wgmma.wait_group 0`` (SASS ``WARPGROUP.DEPBAR.LE gsb0, 0x0``). ptxas may hoist that wait
    above exponentials that do not need it: how many ``MUFU.EX2`` still come before it is how much
    of the softmax can overlap PV. None for a loop without that wait (no overlap)."""
    waits = [i for i, t in enumerate(body) if re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0", t)]
    if not waits or not any(re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1", t) for t in body):
        return None
    return sum(1 for t in body[:waits[0]] if "MUFU.EX2" in t)


def census(kernel: str, d: int, causal: bool, ptx: str, tile_n: int, config: dict) -> list:
    rows = []
    for start, end, ops, exps_first in tile_loops(sass_of(ptx), d, tile_n):
        total = sum(ops.values())
        rows.append(dict(kernel=kernel, head_dim=d, causal=int(causal), tile_n=tile_n, config=config,
                         loop=f"{start:#x}-{end:#x}", masked=ops["FSEL"] >= tile_n // 4,
                         instructions=total, per_key=total / tile_n,
                         uniform=sum(v for k, v in ops.items() if UNIFORM.match(k)), exps_before_pv_wait=exps_first,
                         mix={k: ops[k] for k in GROUPS if ops[k]}))
    return rows


def ours(name: str, d: int, causal: bool, seqlen: int, cfg: dict):
    from kernels import get_kernel
    from kernels.contract import Problem

    compiled = get_kernel(name).compile(Problem(1, 1, seqlen, d, causal=causal), keep_ptx=True, **cfg)
    return compiled.ptx, compiled.info["tile_n"], compiled.info


def fa4(d: int, causal: bool):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.interface import _tile_size_fwd_sm90

    cfg = _tile_size_fwd_sm90(d, d, causal, False)
    kernel = FlashAttentionForwardSm90(
        cutlass.BFloat16, d, d, 1, is_causal=causal, is_local=False, pack_gqa=False, tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size, num_stages=2, num_threads=128 * (cfg.m_block_size // 64 + 1), Q_in_regs=False,
        intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    b, s, h = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def fake(dtype, shape, div):
        stride = tuple(1 if i == len(shape) - 1 else cute.sym_int64(divisibility=div) for i in range(len(shape)))
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)

    q, k, v, o = (fake(cutlass.BFloat16, (b, s, h, d), 8) for _ in range(4))
    lse = fake(Float32, (b, h, s), 4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    with tempfile.TemporaryDirectory() as dump:
        cute.compile(kernel, q, k, v, o, lse, Float32(0.1), None, None, None, None, None, None, None, None,
                     stream=stream, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={dump}")
        ptx = "\n".join(p.read_text() for p in Path(dump).glob("*.ptx"))
    return ptx, cfg.n_block_size, dict(tile_m=cfg.m_block_size, tile_n=cfg.n_block_size,
                                       intra_wg_overlap=cfg.intra_wg_overlap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=["k6"])
    ap.add_argument("--headdim", type=int, nargs="+", default=[128])
    ap.add_argument("--causal", type=int, nargs="+", default=[1], choices=(0, 1))
    ap.add_argument("--seqlen", type=int, default=8192, help="picks the seqlen-dependent variant (K6)")
    ap.add_argument("--config", default="{}", help="JSON overrides for the compile_kernel of every kernel in "
                    "--kernels, e.g. '{\"overlap\": true, \"tile_n\": 128}'. A loop whose tile's exponentials are "
                    "compiled twice (pin_pv_wait's two branch sides) is not recognized as a tile loop")
    ap.add_argument("--fa4", action="store_true", help="flash-attn-4's sm90 kernel too")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cfg = json.loads(args.config)
    out = results.open_result_file(args.out, results.command_line("scripts/sass_loops.py", argv))
    rows = []
    for d in args.headdim:
        for causal in map(bool, args.causal):
            builds = [(name, lambda name=name: ours(name, d, causal, args.seqlen, cfg)) for name in args.kernels]
            if args.fa4:
                builds.append(("fa4", lambda: fa4(d, causal)))
            for name, build in builds:
                ptx, tile_n, config = build()
                for row in census(name, d, causal, ptx, tile_n, config):
                    rows.append(row)
                    if out:
                        out.append(row)
    if out:
        out.close()
    for r in rows:
        print(f"d={r['head_dim']:<4}c={r['causal']} {r['kernel']:<5} tile_n={r['tile_n']:<4}"
              f"{'masked  ' if r['masked'] else 'unmasked'} {r['instructions']:5d} instructions "
              f"({r['per_key']:.2f} per key, {r['uniform']} uniform, {r['exps_before_pv_wait']} ex2 before the PV wait)"
              f"  {r['mix']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
