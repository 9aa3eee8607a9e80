"""Result files (JSON) and the markdown tables generated from them."""

from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path


def environment() -> dict:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version()}
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["device"] = torch.cuda.get_device_name()
            meta["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        meta["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except Exception:
        pass
    return meta


WORKLOAD_ENV = ("SEQLEN", "HEADDIM", "CAUSAL", "BATCH", "NHEADS", "DTYPE", "CHECK")


def command_line(script: str, argv=None) -> str:
    """The command as it can be rerun: workload environment variables that were set, then the
    script and its arguments."""
    import os
    import shlex
    import sys

    env = [f"{k}={shlex.quote(os.environ[k])}" for k in WORKLOAD_ENV if k in os.environ]
    args = list(argv) if argv is not None else sys.argv[1:]
    return " ".join(env + ["python", script] + [shlex.quote(a) for a in args])


def gpu_short_name(device: str) -> str:
    m = re.search(r"(H100|H200|H20|A100|B200|GH200)", device or "")
    return m.group(1) if m else (device or "unknown")


def write(path, rows: list, command: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {**environment(), "command": command}, "rows": rows}, indent=1))
    return path


def load(path) -> dict:
    return json.loads(Path(path).read_text())


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
