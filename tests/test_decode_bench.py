"""bench.py --decode on a CPU machine: flags and refusals, the grid, the TB/s arithmetic, the
per-row bookkeeping (with made-up steps in place of GPU work) and the docs tables."""

import json
from pathlib import Path

import pytest
import torch

import bench
from harness import decode_bench as db
from harness import results
from harness.results import WORKLOAD_ENV
from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent
make_docs = load_script("make_docs")


@pytest.fixture(autouse=True)
def no_workload_env(monkeypatch):
    for var in WORKLOAD_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A visible "H100" and decode_bench's three parts replaced by recorders: what is tested is the
    CLI's wiring and its result file, not GPU work."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    calls = []

    def run_grid(rows, emit, peers=True, head_dim=128, q_len=1, num_splits=0):
        calls.append(("grid", rows, dict(peers=peers, head_dim=head_dim, q_len=q_len, num_splits=num_splits)))
        for b, n, hk in rows:
            emit(dict(mode="grid", kernel="decode", batch=b, seqlen_k=n, nheads_kv=hk, ms=0.05, tbps=2.0,
                      num_splits=16, status="ok"))

    def run_splits(emit, **shape):
        calls.append(("splits", shape))
        emit(dict(mode="splits", kernel="decode", batch=1, seqlen_k=32768, nheads_kv=8, num_splits=4, ms=0.1,
                  tbps=1.3, status="ok"))

    def run_host(emit, **shape):
        calls.append(("host", shape))
        emit(dict(mode="host", kernel="decode plan.run", batch=1, seqlen_k=32768, nheads_kv=8, host_us=15.0,
                  call_us=52.0, status="ok"))

    def run_pages(emit, **shape):
        calls.append(("pages", shape))
        emit(dict(mode="pages", kernel="decode", batch=8, seqlen_k=32768, nheads_kv=8, page_size=128, ms=0.3,
                  tbps=3.6, status="ok"))

    for name, fn in (("run_grid", run_grid), ("run_splits", run_splits), ("run_host", run_host),
                     ("run_pages", run_pages)):
        monkeypatch.setattr(db, name, fn)
    return calls


# --- the CLI ---------------------------------------------------------------------------------

def test_help_describes_the_decode_mode_and_its_flags(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ("--decode", "--seqlen-k", "--nheads-kv", "--q-len", "--num-splits", "--grid-only", "--splits-curve",
                 "--host-times", "--pages-curve"):
        assert flag in text
    assert "decode: batch 1/8/64 x kv_len 4096/32768/131072 x K/V heads 8/32 (14 rows)" in text


def test_decode_flags_parse():
    args = bench.parse_args(["--decode", "--batch", "8", "--seqlen-k", "32768", "--nheads-kv", "32", "--headdim", "64",
                             "--q-len", "4", "--num-splits", "2", "--out", "x.json"])
    assert (args.decode, args.batch, args.seqlen_k, args.nheads_kv, args.headdim, args.q_len, args.num_splits,
            args.out) == (True, 8, 32768, 32, 64, 4, 2, "x.json")
    assert bench.decode_refusal(args) is None
    args = bench.parse_args(["--decode"])
    assert (args.splits_curve, args.grid_only, args.q_len, args.num_splits) == (False, False, None, None)


def test_decode_without_a_gpu_exits_2_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "decode.json"
    assert bench.main(["--decode", "--out", str(out)]) == 2
    assert "No CUDA GPU is visible" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv,says", [
    (["--decode", "k4"], "own grid"),
    (["--decode", "--seqlen", "4096"], "not --seqlen"),
    (["--decode", "--causal", "1"], "not --causal"),
    (["--decode", "--batch", "0"], "--batch must be positive"),
    (["--decode", "--q-len", "0"], "--q-len must be positive"),
    (["--decode", "--headdim", "96"], "--headdim must be one of (64, 128, 256)"),
    (["--decode", "--num-splits", "129"], "--num-splits must be in [0, 128]"),
    (["--decode", "--splits-curve", "--grid-only"], "not with --grid-only"),
    (["--decode", "--splits-curve", "--num-splits", "4"], "not with --grid-only or --num-splits"),
    (["--decode", "--host-times", "--batch", "8"], "not with --grid-only, --splits-curve"),
    (["--decode", "--host-times", "--splits-curve"], "runs only the host times"),
    (["--decode", "--pages-curve", "--splits-curve"], "runs only the page-size curve"),
    (["--decode", "--pages-curve", "--num-splits", "2"], "runs only the page-size curve"),
    (["k4", "--q-len", "2"], "--q-len, --num-splits, --grid-only, --splits-curve and --pages-curve to --decode"),
    (["--splits-curve"], "to --decode"),
    (["--pages-curve"], "to --decode"),
    (["--host-times", "--batch", "8"], "--host-times times its own calls"),  # the prefill calls' host times
    (["--grid-only"], "to --decode"),
])
def test_decode_refusals_come_before_any_work(fake_gpu, capsys, argv, says):
    assert bench.main(argv) == 2
    assert says in capsys.readouterr().err
    assert fake_gpu == []


def test_decode_refuses_workload_variables_it_would_ignore(fake_gpu, monkeypatch, capsys):
    monkeypatch.setenv("HEADDIM", "64")
    assert bench.main(["--decode"]) == 2
    assert "ignore HEADDIM=64" in capsys.readouterr().err and fake_gpu == []


def test_decode_runs_grid_curve_and_host_and_writes_each_row(fake_gpu, tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert bench.main(["--decode", "--batch", "8", "--nheads-kv", "32", "--out", str(out)]) == 0
    assert [c[0] for c in fake_gpu] == ["grid", "splits", "host"]
    assert fake_gpu[0][1] == [(8, 4096, 32), (8, 32768, 32), (8, 131072, 32)]
    assert fake_gpu[0][2] == dict(peers=True, head_dim=128, q_len=1, num_splits=0)
    data = results.load(out)
    assert data["meta"]["complete"] and "--decode" in data["meta"]["command"]
    assert [r["mode"] for r in data["rows"]] == ["grid"] * 3 + ["splits", "host"]
    assert "2.00 TB/s" in capsys.readouterr().out


def test_decode_flags_reach_the_runs(fake_gpu):
    assert bench.main(["--decode", "--grid-only", "--no-peers", "--headdim", "64", "--q-len", "4",
                       "--num-splits", "2", "--seqlen-k", "4096"]) == 0
    assert [c[0] for c in fake_gpu] == ["grid"]
    assert fake_gpu[0][1] == [(1, 4096, 8), (1, 4096, 32), (8, 4096, 8), (8, 4096, 32), (64, 4096, 8), (64, 4096, 32)]
    assert fake_gpu[0][2] == dict(peers=False, head_dim=64, q_len=4, num_splits=2)


def test_splits_curve_runs_the_curve_alone_at_the_given_shape(fake_gpu):
    assert bench.main(["--decode", "--splits-curve"]) == 0
    assert fake_gpu == [("splits", dict(batch=1, kv_len=32768, nheads_kv=8, head_dim=128, q_len=1))]
    fake_gpu.clear()
    assert bench.main(["--decode", "--splits-curve", "--seqlen-k", "131072"]) == 0
    assert fake_gpu[0][1]["kv_len"] == 131072 and fake_gpu[0][1]["batch"] == 1


def test_pages_curve_runs_alone_at_the_given_shape(fake_gpu, capsys):
    assert bench.main(["--decode", "--pages-curve"]) == 0
    assert fake_gpu == [("pages", dict(batches=(1, 8), kv_len=32768, nheads_kv=8, head_dim=128, q_len=1))]
    assert "pages=128" in capsys.readouterr().out
    fake_gpu.clear()
    assert bench.main(["--decode", "--pages-curve", "--batch", "4", "--headdim", "64"]) == 0
    assert fake_gpu[0][1]["batches"] == (4,) and fake_gpu[0][1]["head_dim"] == 64


def test_host_times_run_alone(fake_gpu):
    assert bench.main(["--decode", "--host-times", "--headdim", "64"]) == 0
    assert fake_gpu == [("host", dict(head_dim=64, q_len=1))]


# --- the grid and the arithmetic --------------------------------------------------------------

def test_grid_is_the_issues_grid():
    assert len(db.GRID) == len(set(db.GRID)) == 14
    assert {(b, n) for b, n, _ in db.GRID if b == 64} == {(64, 4096)}  # batch 64 with 4k keys only
    assert {hk for _, _, hk in db.GRID} == {8, 32} and db.grid() == db.GRID


def test_grid_restriction():
    assert db.grid(batch=64) == [(64, 4096, 8), (64, 4096, 32)]
    assert db.grid(seqlen_k=131072, nheads_kv=8) == [(1, 131072, 8), (8, 131072, 8)]
    assert db.grid(batch=1, seqlen_k=32768, nheads_kv=8) == [(1, 32768, 8)]
    # A value the grid lacks replaces its axis; an explicit shape outside the grid is one row.
    assert db.grid(batch=2) == [(2, n, hk) for n in (4096, 32768, 131072) for hk in (8, 32)]
    assert db.grid(batch=64, seqlen_k=32768) == [(64, 32768, 8), (64, 32768, 32)]
    assert db.grid(batch=4, seqlen_k=1000, nheads_kv=1) == [(4, 1000, 1)]


def test_kv_bytes_and_tbps():
    # batch 1, 8 K/V heads, 32k keys, d 128, bf16: K and V of 64 MiB each.
    assert db.kv_bytes(1, 8, 32768) == 2 * 8 * 32768 * 128 * 2 == 134217728
    assert db.kv_bytes(1, 8, 32768, head_dim=64) == 67108864
    assert db.tbps(134217728, 0.028) == pytest.approx(4.7935, rel=1e-4)  # 134 MB in 28 us
    assert db.tbps(2 * 10**12, 1000.0) == pytest.approx(2.0)


def test_hbm_peak_and_percentage():
    assert db.hbm_peak("NVIDIA H100 80GB HBM3") == 3.35
    assert db.hbm_peak("NVIDIA H200") == 4.8
    assert db.hbm_peak("NVIDIA A100-SXM4-80GB") is None
    r = db.rates(134217728, 0.05, 3.35)
    assert r["tbps"] == pytest.approx(2.684, rel=1e-3) and r["pct_peak"] == pytest.approx(80.13, rel=1e-3)
    assert db.rates(134217728, 0.05, None) == dict(tbps=pytest.approx(2.684, rel=1e-3))  # unknown GPU: no %
    assert db.rates(134217728, None, 3.35) == dict(tbps=None)  # not timed


def test_cache_copies_read_past_four_l2s_within_free_memory():
    assert db.cache_copies(16777216) == 12  # 1 x 4k x 8 heads: 16.8 MB, 12 copies = 201 MB >= 4 x 50 MB
    assert db.cache_copies(134217728) == 2
    assert db.cache_copies(17 * 10**9) == 1
    assert db.cache_copies(16777216, free_bytes=100 * 2**20) == 3  # half of 100 MiB holds three
    assert db.cache_copies(10**9, free_bytes=10**6) == 1  # never none
    assert db.cache_copies(16777216, free_bytes=80 * 2**30) == 12


# --- one grid row's bookkeeping, with CPU tensors for outputs ---------------------------------

def test_time_candidates_checks_then_times_and_keeps_statuses(monkeypatch):
    monkeypatch.setattr(db, "graph_ms", lambda step: step.ms)
    o_ref = torch.zeros(1, 1, 32, 128)

    def step(ms, err=0.0):
        s = lambda i: torch.full_like(o_ref, err)  # noqa: E731
        s.ms = ms
        return s

    def broken(i):
        raise RuntimeError("No available kernel. Aborting execution.")

    nbytes = db.kv_bytes(1, 8, 32768)
    base = dict(mode="grid", batch=1, seqlen_k=32768, nheads_kv=8, kv_bytes=nbytes)
    entries = {"sdpa-cudnn": (step(0.06), db.contextlib.nullcontext, {}),
               "sdpa-flash": (broken, db.contextlib.nullcontext, {}),
               "fa4": "unavailable (ImportError: no flash_attn)",
               "decode": (step(0.05), db.contextlib.nullcontext, dict(num_splits=16)),
               "decode_combine": (step(0.04, err=0.5), db.contextlib.nullcontext, dict(num_splits=16))}
    rows = []
    db.time_candidates(base, entries, o_ref, 3.35, rows.append)
    got = {r["kernel"]: r for r in rows}
    assert list(got) == list(entries)
    assert got["sdpa-cudnn"]["ms"] == 0.06 and "vs_cudnn" not in got["sdpa-cudnn"]
    assert got["sdpa-flash"]["ms"] is None and got["sdpa-flash"]["status"].startswith("failed (RuntimeError: No avail")
    assert got["fa4"]["status"].startswith("unavailable")
    mine = got["decode"]
    assert mine["status"] == "ok" and mine["num_splits"] == 16 and mine["vs_cudnn"] == pytest.approx(1.2)
    assert mine["tbps"] == pytest.approx(db.tbps(nbytes, 0.05)) and mine["pct_peak"] == pytest.approx(
        100 * mine["tbps"] / 3.35)
    wrong = got["decode_combine"]  # fast but wrong: never timed
    assert wrong["ms"] is None and wrong["max_abs_err"] == 0.5 and wrong["status"].startswith("failed check")


def test_summary_gives_each_kernels_ratio_to_cudnn():
    rows = [dict(mode="grid", batch=1, seqlen_k=4096, nheads_kv=8, kernel="sdpa-cudnn", ms=0.02, tbps=1.0),
            dict(mode="grid", batch=1, seqlen_k=4096, nheads_kv=8, kernel="decode", ms=0.01, tbps=2.0),
            dict(mode="grid", batch=8, seqlen_k=4096, nheads_kv=8, kernel="sdpa-cudnn", ms=0.02, tbps=1.0),
            dict(mode="grid", batch=8, seqlen_k=4096, nheads_kv=8, kernel="decode", ms=0.04, tbps=0.5)]
    text = db.summary(rows)
    assert "x cuDNN 2.000" in text and "x cuDNN 0.500" in text
    assert text.splitlines()[-1] == "geomean x cuDNN 1.000, worst 0.500"


# --- the docs tables --------------------------------------------------------------------------

META = {"device": "NVIDIA H100 80GB HBM3", "command": "python bench.py --decode --out results/decode-h100.json",
        "date": "2026-11-22T12:00:00+00:00", "version": 2, "complete": True}


def grid_row(kernel, ms, tbps, **extra):
    return dict(mode="grid", batch=1, nheads=32, nheads_kv=8, seqlen_k=32768, q_len=1, head_dim=128, kernel=kernel,
                ms=ms, tbps=tbps, status="ok" if ms else extra.pop("status"), **extra)


BENCH = {"meta": META, "rows": [
    grid_row("sdpa-cudnn", 0.051, 2.63, pct_peak=78.5),
    grid_row("sdpa-flash", None, None, status="failed (RuntimeError: No available kernel)"),
    grid_row("fa4", 0.33, 0.41),
    grid_row("decode", 0.0425, 3.16, pct_peak=94.3, num_splits=16, vs_cudnn=1.2),
    grid_row("decode_combine", 0.05, 2.68, pct_peak=80.1, num_splits=16),
    dict(mode="splits", kernel="decode", batch=1, nheads_kv=8, seqlen_k=32768, num_splits=1, auto=False, ms=0.31,
         tbps=0.43, status="ok"),
    dict(mode="splits", kernel="decode", batch=1, nheads_kv=8, seqlen_k=32768, num_splits=16, auto=True, ms=0.051,
         tbps=2.63, status="ok"),
    dict(mode="host", kernel="decode plan.run", batch=1, nheads_kv=8, seqlen_k=32768, host_us=15.4, call_us=52.8,
         status="ok"),
    dict(mode="host", kernel="fa4 flash_attn_func", batch=1, nheads_kv=8, seqlen_k=32768,
         status="failed (ImportError: x)")]}


def test_decode_table_rows_give_rates_peak_and_ratio_to_cudnn():
    table = make_docs.decode_table(BENCH)
    assert "H100" in table and "python bench.py --decode" in table
    header = next(line for line in table.splitlines() if line.startswith("| batch"))
    for col in ("K/V heads", "splits", "TB/s", "% of HBM peak", "× cuDNN", "cuDNN TB/s", "fa4 TB/s"):
        assert col in header
    rows = {line.split(" | ")[3]: line for line in table.splitlines() if line.startswith("| 1 | 32k")}
    assert rows["`decode`"] == ("| 1 | 32k | 8 | `decode` | 16 | 3.16 | 94% | 1.20× | 2.63 | 0.41 | "
                                "failed (RuntimeError: No |")
    assert "| 2.68 | 80% | 1.02× |" in rows["`decode_combine`"]
    assert not any("sdpa" in line or "fa4" in line.split(" | ")[3] for line in rows.values())  # peers are columns


def test_decode_splits_and_host_tables():
    splits = make_docs.decode_splits_table(BENCH)
    assert "batch 1, 8 K/V heads, 32k keys, H100: `python bench.py --decode" in splits
    assert "| 1 | 310.0 | 0.43 |" in splits and "| 16 (auto) | 51.0 | 2.63 |" in splits
    host = make_docs.decode_host_table(BENCH)
    assert host.startswith("H100, `python bench.py --decode")
    assert "| `decode plan.run` | 1 | 32k | 8 | 15.4 | 52.8 |" in host
    assert "| `fa4 flash_attn_func` | 1 | 32k | 8 | failed (ImportError: x) | — |" in host


def test_decode_page_blocks_come_from_the_runs_that_have_them(monkeypatch, tmp_path):
    page = "# Decode\n\n" + "\n\n".join(f"<!-- table:{n} -->\nold\n<!-- /table:{n} -->"
                                       for n in ("decode", "decode-splits", "decode-host"))
    (tmp_path / "results").mkdir()
    monkeypatch.setattr(make_docs, "ROOT", tmp_path)
    runs = {mode: make_docs.latest_with_mode("decode-h*.json", mode) for mode in ("grid", "splits", "host")}
    assert runs == dict(grid=None, splits=None, host=None)
    assert make_docs.fill_decode_page(page, runs) == page  # no result file yet: every block left as it is
    # A full run, then a newer run of the split curve alone: the curve comes from the newer file,
    # the grid and host tables stay with the full run.
    curve = {"meta": dict(META, date="2026-11-23T00:00:00+00:00"),
             "rows": [dict(r, tbps=9.99) for r in BENCH["rows"] if r["mode"] == "splits"]}
    unfinished = {"meta": dict(META, date="2026-11-24T00:00:00+00:00", complete=False), "rows": BENCH["rows"]}
    for name, data in (("decode-h100.json", BENCH), ("decode-h100-curve.json", curve),
                       ("decode-h100-partial.json", unfinished)):
        (tmp_path / "results" / name).write_text(json.dumps(data))
    runs = {mode: make_docs.latest_with_mode("decode-h*.json", mode) for mode in ("grid", "splits", "host")}
    text = make_docs.fill_decode_page(page, runs)
    assert "old" not in text and text.startswith("# Decode\n\n<!-- table:decode -->\nOn an H100")
    assert "| 16 (auto) | 51.0 | 9.99 |" in text and "| 3.16 | 94% |" in text and "| 15.4 | 52.8 |" in text
