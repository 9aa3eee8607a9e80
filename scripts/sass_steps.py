"""Static instruction count of K10's backward step, per warp, from its SASS (no GPU needed).

    CUTE_DSL_ARCH=sm_90a python scripts/sass_steps.py --headdim 64 128 --causal 0 \
        --configs '{}' '{"step_counter": true}' '{"plain_first": true}' \
        --out results/sass-steps-k10.json

Each configuration (compile overrides on top of ``k10_fa3``'s) is compiled for a
(2, 16, 8192, d) problem, its main kernel's PTX assembled by ``ptxas`` and disassembled by
``cuobjdump`` (both on PATH, as for scripts/sass_loops.py). The MMA warps' step loop is the
innermost backward branch whose body holds the WGMMAs (HGMMA); with ``mask_edges`` it holds two copies of
the step, split by one conditional forward branch (the edge test) and joined by the first copy's
jump over the second. A row counts the instructions a warp issues for one step that takes the
plain copy (no masks: every step of a non-causal walk whose length is a tile multiple) and one
that takes the edge copy: the loop's head and tail plus the copy, not counting spins in waits.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import results  # noqa: E402
from sass_loops import UNIFORM, sass_of  # noqa: E402

BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\b.*?(0x[0-9a-f]+)")


def instructions(sass: str) -> list:
    """[(address, instruction text)] in address order."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def step_paths(ins: list) -> dict:
    """The step loop's instructions on the plain and the edge path (and the loop's size)."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, t) in enumerate(ins):
        m = BRANCH.match(t)
        if m and int(m.group(2), 16) <= a and int(m.group(2), 16) in index:
            body = ins[index[int(m.group(2), 16)]:i + 1]
            if sum(opcode(x) == "HGMMA" for _, x in body) >= 10:
                loops.append(body)
    if not loops:
        raise SystemExit("no loop holds the WGMMAs")
    # the innermost: a wait's out-of-line retry (after the kernel's end) branches back into the
    # loop and so spans it too
    body = min(loops, key=len)
    last = body[-1][0]
    split = next(((a, int(m.group(2), 16)) for a, t in body for m in [BRANCH.match(t)]
                  if m and m.group(1) and a < int(m.group(2), 16) <= last), None)
    count = lambda part: collections.Counter(opcode(t) for _, t in part)  # noqa: E731
    if split is None:  # one copy of the step
        return {"plain": count(body), "edge": count(body), "loop": len(body)}
    first = [(a, t) for a, t in body if split[0] < a < split[1]]
    jump = next((a, int(BRANCH.match(t).group(2), 16)) for a, t in reversed(first)
                if BRANCH.match(t) and not BRANCH.match(t).group(1))
    head = [(a, t) for a, t in body if a <= split[0]]
    tail = [(a, t) for a, t in body if a >= jump[1]]
    copy1 = [(a, t) for a, t in first if a <= jump[0]]
    copy2 = [(a, t) for a, t in body if split[1] <= a < jump[1]]
    # which copy is the plain one: the one with fewer instructions is not enough (plain_first
    # changes their sizes); the edge copy compares keys and queries, so it holds more ISETP
    isetp = lambda part: sum(opcode(t) == "ISETP" for _, t in part)  # noqa: E731
    plain, edge = (copy1, copy2) if isetp(copy1) < isetp(copy2) else (copy2, copy1)
    return {"plain": count(head + plain + tail), "edge": count(head + edge + tail), "loop": len(body),
            "plain_first": plain is copy1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdim", type=int, nargs="+", default=[128], choices=(64, 128))
    ap.add_argument("--causal", type=int, nargs="+", default=[0], choices=(0, 1))
    ap.add_argument("--configs", type=json.loads, nargs="+", default=[{}],
                    help="compile overrides (JSON) on top of k10_fa3's, one per build")
    ap.add_argument("--out", help="write the rows as JSON here, each as it is done")
    args = ap.parse_args(argv)
    from harness.backward import stage_overrides
    from kernels.contract import Problem, compiled_ptx
    from kernels.k10 import compile_backward

    out = results.open_result_file(args.out, results.command_line("scripts/sass_steps.py", argv))
    print(f"{'d':>3} {'causal':>6} {'config':40} {'plain':>6} {'edge':>6} {'uniform (plain)':>15}")
    for d in args.headdim:
        for causal in args.causal:
            for extra in args.configs:
                overrides = dict(stage_overrides("k10_fa3"), **extra)
                main_kernel = compile_backward(Problem(2, 16, 8192, d, causal=bool(causal)), keep_ptx=True,
                                               **overrides)[1]
                paths = step_paths(instructions(sass_of(compiled_ptx(main_kernel))))
                plain, edge = paths["plain"], paths["edge"]
                uniform = sum(v for k, v in plain.items() if UNIFORM.match(k))
                row = dict(head_dim=d, causal=causal, config=extra, plain=sum(plain.values()),
                           edge=sum(edge.values()), plain_uniform=uniform, loop=paths["loop"],
                           plain_opcodes=dict(plain.most_common()))
                print(f"{d:>3} {causal:>6} {json.dumps(extra):40} {row['plain']:>6} {row['edge']:>6} {uniform:>15}",
                      flush=True)
                if out:
                    out.append(row)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
