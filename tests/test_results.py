"""Result files: written row by row, strict JSON, valid after an interruption at any point."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import results
from harness.peers import best_peer

ROOT = Path(__file__).resolve().parent.parent


def strict_load(path):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    text = Path(path).read_text()
    json.loads(text, parse_constant=refuse)
    return results.parse(text)


def test_file_is_valid_after_each_row_and_marked_complete_at_the_end(tmp_path):
    path = tmp_path / "out" / "sweep.json"
    f = results.ResultFile(path, "python bench.py --sweep")
    data = strict_load(path)  # written at open: rows yet, but valid
    assert data["rows"] == [] and data["meta"]["complete"] is False
    assert data["meta"]["version"] == results.SCHEMA_VERSION and data["meta"]["command"] == "python bench.py --sweep"
    for i in range(3):
        f.append(dict(kernel="k4", seqlen=512 * 2**i, tflops=100.0 + i, status="ok"))
        assert [r["seqlen"] for r in strict_load(path)["rows"]] == [512 * 2**j for j in range(i + 1)]
    f.close()
    assert strict_load(path)["meta"]["complete"] is True
    assert sorted(os.listdir(path.parent)) == ["sweep.json"]  # no temporary file left beside it


def test_nan_and_inf_become_null(tmp_path):
    path = tmp_path / "r.json"
    f = results.ResultFile(path, "cmd")
    f.append(dict(kernel="k1", max_abs=float("nan"), rel_l2=float("inf"), nested=[float("-inf"), 1.5],
                  status="crashed"))
    row = strict_load(path)["rows"][0]
    assert (row["max_abs"], row["rel_l2"], row["nested"], row["status"]) == (None, None, [None, 1.5], "crashed")


def test_file_has_no_spaces_and_one_row_per_line(tmp_path):
    f = results.ResultFile(tmp_path / "r.json", "cmd")
    rows = [{"kernel": "k6", "ms": 1.5, "ms_rounds": [1.5, 1.6]}, {"kernel": "fa4", "ms": float("nan")}]
    for row in rows:
        f.append(row)
    text = (tmp_path / "r.json").read_text()
    lines = text.splitlines()
    assert lines[0].startswith('{"meta":{"version":3,') and lines[0].endswith(
        '"complete":false},"columns":[["kernel","ms","ms_rounds"],["kernel","ms"]],"rows":[')
    assert lines[3:] == ["]}"]
    assert lines[1:3] == ['[0,"k6",1.5,[1.5,1.6]],', '[1,"fa4",null]']
    assert results.parse(text)["rows"] == [rows[0], {"kernel": "fa4", "ms": None}]
    assert results.parse(results.result_text({"a": 1}, [])) == {"meta": {"a": 1}, "rows": []}
    cut = results.parse(results.result_text({}, [{"ms": 0.04790560007095337, "n": [605.0154986317365, 3, 2e-7]}]))
    assert cut["rows"] == [{"ms": 0.0479056, "n": [605.015, 3, 2e-7]}]


def test_rows_sharing_their_keys_share_one_column_list_and_come_back_in_order():
    rows = [{"kernel": "k6", "ms": 1.0}, {"kernel": "fa4", "ms": 2.0, "status": "ok"}, {"ms": 3.0, "kernel": "k4"},
            {"kernel": "k9", "ms": 4.0}]
    data = json.loads(results.result_text({}, rows))
    assert data["columns"] == [["kernel", "ms"], ["kernel", "ms", "status"], ["ms", "kernel"]]
    assert [r[0] for r in data["rows"]] == [0, 1, 2, 0]
    back = results.parse(results.result_text({}, rows))["rows"]
    assert back == rows and [list(r) for r in back] == [list(r) for r in rows]  # key order kept too


def test_version_2_files_still_load(tmp_path):
    # A file from before the columns (git show of an old result), rows as dicts.
    path = tmp_path / "old.json"
    path.write_text('{"meta":{"version":2,"complete":true},"rows":[\n{"kernel":"k6","ms":1.5},\n{"kernel":"fa4"}\n]}\n')
    assert results.load(path) == {"meta": {"version": 2, "complete": True},
                                  "rows": [{"kernel": "k6", "ms": 1.5}, {"kernel": "fa4"}]}


def test_every_result_file_in_the_tree_is_the_current_layout():
    # the size cap on what travels to the GPU machine: a file written before the columns, copied
    # back in, would double its size
    for path in sorted((ROOT / "results").glob("*.json")):
        assert '"columns":' in path.read_text().split("\n", 1)[0], path.name


def test_interrupted_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    f = results.ResultFile(path, "cmd")
    f.append(dict(kernel="k1", status="ok"))

    def interrupted(src, dst):
        raise KeyboardInterrupt  # Ctrl-C between writing the temporary file and renaming it

    monkeypatch.setattr(results.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        f.append(dict(kernel="k2", status="ok"))
    assert [r["kernel"] for r in strict_load(path)["rows"]] == ["k1"]
    assert os.listdir(tmp_path) == ["r.json"]


def test_killed_writer_leaves_the_rows_done_so_far(tmp_path):
    # A real kill (SIGKILL: no handler, no cleanup) after three rows.
    path = tmp_path / "r.json"
    code = (f"from harness import results; import os, signal\n"
            f"f = results.ResultFile({str(path)!r}, 'cmd')\n"
            "for i in range(3):\n    f.append(dict(kernel='k%d' % i, status='ok'))\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL
    data = strict_load(path)
    assert [r["kernel"] for r in data["rows"]] == ["k0", "k1", "k2"] and data["meta"]["complete"] is False


def test_unwritable_path_fails_at_open(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError):
        results.ResultFile(blocker / "r.json", "cmd")
    with pytest.raises(SystemExit) as e:
        results.open_result_file(str(blocker / "r.json"), "cmd")
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    assert results.open_result_file(None, "cmd") is None


def test_write_keeps_its_one_call_api(tmp_path):
    path = results.write(tmp_path / "t.json", [dict(kernel="k4", ms=float("nan"), status="failed")], "cmd")
    data = strict_load(path)
    assert data["rows"] == [dict(kernel="k4", ms=None, status="failed")] and data["meta"]["complete"] is True


def test_meta_records_commit_and_peer_versions():
    meta = results.environment()
    for key in ("commit", "torch", "cudnn", "flash-attn-4", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"):
        assert key in meta
    if meta["commit"] is not None:  # None only where git or the checkout is missing
        assert len(meta["commit"].removesuffix("-dirty")) == 40


def test_meta_records_a_digest_of_the_kernels(monkeypatch, tmp_path):
    # The digest follows the kernel sources, not git: a copied tree with stale git metadata still
    # says which code ran.
    assert results.environment()["kernels_sha256"] == results.kernels_digest()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.py").write_text("a = 1\n")
    monkeypatch.setattr(results, "ROOT", tmp_path)
    first = results.kernels_digest()
    (tmp_path / "kernels" / "k.py").write_text("a = 2\n")
    assert results.kernels_digest() != first and len(first) == 64


def test_commit_is_none_without_git_or_checkout(monkeypatch, tmp_path):
    def no_git(*a, **k):
        raise FileNotFoundError("git")

    with monkeypatch.context() as m:
        m.setattr(results.subprocess, "run", no_git)
        assert results.git_commit() is None
    # Installed into a venv's site-packages that lies inside some other repository: not ours.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "other"], check=True)
    (tmp_path / "site-packages").mkdir()
    monkeypatch.setattr(results, "ROOT", tmp_path / "site-packages")
    assert results.git_commit() is None


def test_best_peer_is_the_faster_of_cudnn_and_fa4():
    assert best_peer({"sdpa-cudnn": 600.0, "fa4": 650.0, "sdpa-flash": 900.0}) == ("fa4", 650.0)
    assert best_peer({"sdpa-cudnn": 600.0, "fa4": None}) == ("sdpa-cudnn", 600.0)
    assert best_peer({"sdpa-flash": 300.0}) is None


def test_best_peer_summary_gives_every_cell_the_geomean_and_the_worst():
    def row(kernel, n, ratio, causal=0):
        return dict(kernel=kernel, head_dim=128, causal=causal, seqlen=n, best_peer="fa4",
                    vs_best_peer=ratio, tflops=None if ratio is None else 1.0)

    rows = [dict(kernel="fa4", head_dim=128, causal=0, seqlen=512, tflops=600.0),
            row("k4", 512, 0.5), row("k4", 1024, 2.0), row("k4", 512, 0.25, causal=1), row("k2", 512, None)]
    text = results.best_peer_summary(rows)
    lines = text.splitlines()
    assert "N=512" in lines[0] and "N=1024" in lines[0]
    assert "0.50x" in lines[1] and "2.00x" in lines[1] and "0.25x" in lines[2]
    k4 = next(line for line in lines if line.startswith("k4 (kernel):"))  # rows without a public-call time
    assert "geomean 0.630x" in k4 and "over 3 cells" in k4 and "worst 0.250x (vs fa4) at d=128 causal=1 N=512" in k4
    assert "k2: no cell timed beside a peer" in text


def test_best_peer_summary_names_the_public_call_and_gives_the_kernel_alone_too():
    rows = [dict(kernel="k6", head_dim=64, causal=1, seqlen=n, best_peer="sdpa-cudnn", vs_best_peer=call,
                 kernel_vs_best_peer=alone, call_ms=0.1) for n, call, alone in ((512, 0.5, 1.0), (1024, 2.0, 1.21))]
    lines = results.best_peer_summary(rows).splitlines()
    call = next(line for line in lines if line.startswith("k6 (public call):"))
    assert "geomean 1.000x" in call and "worst 0.500x (vs sdpa-cudnn) at d=64 causal=1 N=512" in call
    alone = next(line for line in lines if line.startswith("k6 (kernel alone):"))
    assert "geomean 1.100x" in alone and "worst 1.000x at d=64 causal=1 N=512" in alone
