"""Result files (JSON) and the markdown tables generated from them.

A file is ``{"meta": {...}, "columns": [[key, ...], ...], "rows": [[i, value, ...], ...]}``: each
row a list whose first item says which list of ``columns`` names its values (rows that share
their keys share one list; a grid's rows repeat a dozen keys hundreds of times, and the files
travel to the GPU machine under a size cap). ``load`` and ``parse`` give back ``{"meta": ...,
"rows": [dict, ...]}``. Versions 1 and 2 (files without ``meta.version`` are version 1: less
meta) were written with ``rows`` as dicts and no ``columns``; ``load`` reads them too (``git show``
of an old result file). The files in results/ were all rewritten with columns, keeping their
meta. Since version 2 a file is rewritten whole after every row, atomically, so a run stopped at
any point leaves valid JSON with the rows done so far (``meta.complete`` says whether the run
ended); it is strict JSON: a NaN or infinity becomes null, and the row's status says why; ``meta``
records the commit and the versions of the peers.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .config import KNOBS

SCHEMA_VERSION = 3
ROOT = Path(__file__).resolve().parent.parent
# The DSL and the CUDA libraries it was installed with, and the peers timed beside the kernels.
PACKAGES = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "flash-attn-4",
            "quack-kernels", "nvidia-cudnn-frontend", "cuda-python", "cuda-bindings", "apache-tvm-ffi")


def git_commit():
    """HEAD of the checkout the harness runs from, '-dirty' when tracked files differ; None without git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    if not (ROOT / ".git").exists():  # installed without its checkout: an enclosing repo is not ours
        return None
    try:
        head = git("rev-parse", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def kernels_digest() -> str:
    """SHA-256 of kernels/*.py (names and contents): which kernel code a result came from, even
    where the checkout's git metadata is stale or missing (a copied working tree)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment() -> dict:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "commit": git_commit(), "kernels_sha256": kernels_digest()}
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available():
            meta["device"] = torch.cuda.get_device_name()
            meta["cuda"] = torch.version.cuda
    except ImportError:
        pass
    for name in PACKAGES:  # None: not installed
        try:
            meta[name] = version(name)
        except PackageNotFoundError:
            meta[name] = None
    return meta


WORKLOAD_ENV = (*KNOBS.values(), "CHECK")


def command_line(script: str, argv=None) -> str:
    """The command as it can be rerun: workload environment variables that were set, then the
    script and its arguments."""
    import shlex

    env = [f"{k}={shlex.quote(os.environ[k])}" for k in WORKLOAD_ENV if k in os.environ]
    args = list(argv) if argv is not None else sys.argv[1:]
    return " ".join(env + ["python", script] + [shlex.quote(a) for a in args])


def gpu_short_name(device: str) -> str:
    m = re.search(r"(H100|H200|H20|A100|B200|GH200)", device or "")
    return m.group(1) if m else (device or "unknown")


def strict(value):
    """``value`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


class ResultFile:
    """A result file written as the rows come. Opening it writes the file (no rows yet), so an
    unwritable path fails at once, before any work; each ``append`` rewrites it whole."""

    def __init__(self, path, command: str):
        self.path = Path(path)
        self.meta = {"version": SCHEMA_VERSION, **environment(), "command": command, "complete": False}
        self.rows = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def append(self, row: dict) -> None:
        self.rows.append(row)
        self.save()

    def close(self) -> Path:
        self.meta["complete"] = True
        self.save()
        return self.path

    def save(self) -> None:
        text = result_text(self.meta, self.rows)
        # A temporary file beside the target, then a rename: a reader (or a run killed mid-write)
        # sees the old file or the new one, never half of one.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise


def six_digits(value):
    """``value`` with every float cut to 6 significant digits, far finer than any timing or error
    here repeats (a sweep's file is about a tenth smaller)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: six_digits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [six_digits(v) for v in value]
    return value


def result_text(meta: dict, rows: list) -> str:
    """The file's JSON with no spaces, one row per line, each row's keys once per file (``columns``),
    floats to 6 significant digits: a ref_check grid has hundreds of rows, and the result files
    travel to the GPU machine with the project, under a size cap."""
    return columnar_text(meta, six_digits(strict(rows)))


def columnar_text(meta: dict, rows: list) -> str:
    """``result_text``'s layout for rows already strict, with their floats as they are."""
    columns, lines = {}, []
    for r in rows:
        assert all(isinstance(k, str) for k in r), f"a result row's keys are strings: {list(r)}"
        i = columns.setdefault(tuple(r), len(columns))
        lines.append(json.dumps([i, *r.values()], allow_nan=False, separators=(",", ":")))
    head = json.dumps({"meta": strict(meta), "columns": [list(c) for c in columns]}, allow_nan=False,
                      separators=(",", ":"))
    return head[:-1] + ',"rows":[' + ("\n" + ",\n".join(lines) + "\n" if lines else "") + "]}\n"


def parse(text: str) -> dict:
    """A result file's text as ``{"meta": ..., "rows": [dict, ...]}``, whatever its version."""
    data = json.loads(text)
    if "columns" in data:
        keys = data.pop("columns")
        if any(not 0 <= r[0] < len(keys) for r in data["rows"]):
            raise ValueError("a result row names a column list the file does not have")
        data["rows"] = [dict(zip(keys[r[0]], r[1:], strict=True)) for r in data["rows"]]
    return data


def open_result_file(path, command: str):
    """A ResultFile at ``path`` (None without one); an unwritable path ends the run at once with
    a message naming --out and exit status 2, before any work."""
    if not path:
        return None
    try:
        return ResultFile(path, command)
    except OSError as e:
        print(f"error: --out {path}: cannot write there ({e})", file=sys.stderr)
        raise SystemExit(2) from None


def write(path, rows: list, command: str) -> Path:
    """Write a finished run's rows in one go."""
    f = ResultFile(path, command)
    f.rows.extend(rows)
    return f.close()


def best_peer_summary(rows: list) -> str:
    """Each kernel's ratio to the best peer of every cell (``vs_best_peer`` in its rows: the public
    calls' ratio where the rows have one), by head dim and causal against seqlen, then its geometric
    mean over the cells and its worst cell; and the kernel alone's geomean (``kernel_vs_best_peer``)."""
    from .peers import PEERS

    kern = [r for r in rows if r["kernel"] not in PEERS]
    seqlens = sorted({r["seqlen"] for r in kern})
    lines = [f"{'kernel':<10}{'d':>5}{'causal':>7}" + "".join(f"{'N=' + str(n):>9}" for n in seqlens)]
    for kernel in dict.fromkeys(r["kernel"] for r in kern):
        mine = [r for r in kern if r["kernel"] == kernel]
        for d, c in dict.fromkeys((r["head_dim"], r["causal"]) for r in mine):
            ratio = {r["seqlen"]: r.get("vs_best_peer") for r in mine if (r["head_dim"], r["causal"]) == (d, c)}
            lines.append(f"{kernel:<10}{d:>5}{c:>7}" +
                         "".join(f"{ratio[n]:>8.2f}x" if ratio.get(n) else f"{'—':>9}" for n in seqlens))
        cells = [r for r in mine if r.get("vs_best_peer")]
        if not cells:
            lines.append(f"{kernel}: no cell timed beside a peer")
            continue
        w = min(cells, key=lambda r: r["vs_best_peer"])
        what = "public call" if any("call_ms" in r for r in cells) else "kernel"
        lines.append(f"{kernel} ({what}): geomean {geomean(cells, 'vs_best_peer'):.3f}x of the best peer over "
                     f"{len(cells)} cells; worst {w['vs_best_peer']:.3f}x (vs {w['best_peer']}) at d={w['head_dim']} "
                     f"causal={w['causal']} N={w['seqlen']}")
        alone = [r for r in mine if r.get("kernel_vs_best_peer")]
        if alone:
            w = min(alone, key=lambda r: r["kernel_vs_best_peer"])
            lines.append(f"{kernel} (kernel alone): geomean {geomean(alone, 'kernel_vs_best_peer'):.3f}x; worst "
                         f"{w['kernel_vs_best_peer']:.3f}x at d={w['head_dim']} causal={w['causal']} N={w['seqlen']}")
    return "\n".join(lines)


def geomean(rows: list, key: str) -> float:
    return math.exp(sum(math.log(r[key]) for r in rows) / len(rows))


def load(path) -> dict:
    return parse(Path(path).read_text())


def fmt(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"


def markdown_table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def replace_block(text: str, name: str, body: str) -> str:
    """Swap the text between <!-- table:NAME --> and <!-- /table:NAME --> for ``body``."""
    begin, end = f"<!-- table:{name} -->", f"<!-- /table:{name} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise KeyError(f"no block {begin} in document")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)
