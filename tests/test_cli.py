"""bench.py, ref_check.py and make_docs.py on a CPU machine: help, flags, refusals, result files."""

import json
import sys
from pathlib import Path

import pytest
import torch

import bench
import ref_check
from harness.config import SWEEP_HEAD_DIMS, SWEEP_SEQLENS, default_batch_heads, sweep_problems
from harness import results
from harness.results import WORKLOAD_ENV
from kernels import kernel_names
from kernels.contract import Problem, UnsupportedProblem
from script_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_workload_env(monkeypatch):
    for var in WORKLOAD_ENV:
        monkeypatch.delenv(var, raising=False)


def test_help_lists_kernels_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for name in kernel_names():
        assert f"\n  {name} " in text
    assert "seqlen 4096, head dim 128, causal 0" in text and "16384/seqlen" in text


def test_sweep_grid_is_the_papers_grid():
    grid = sweep_problems(env={})
    assert {(p.head_dim, p.causal, p.seqlen) for p in grid} == \
        {(d, c, n) for d in (64, 128, 256) for c in (False, True) for n in (512, 1024, 2048, 4096, 8192, 16384)}
    assert len(grid) == len(SWEEP_HEAD_DIMS) * 2 * len(SWEEP_SEQLENS)
    assert all((p.batch, p.nheads) == default_batch_heads(p.seqlen, p.head_dim) for p in grid)


def test_sweep_flags_and_variables_restrict_the_grid():
    assert {p.head_dim for p in sweep_problems(env={}, headdim=128)} == {128}
    grid = sweep_problems(env={"CAUSAL": "1", "SEQLEN": "2048"}, dtype="fp16")
    assert {(p.causal, p.seqlen, p.dtype) for p in grid} == {(True, 2048, "float16")}
    assert {p.head_dim for p in grid} == set(SWEEP_HEAD_DIMS)
    assert {p.head_dim for p in sweep_problems(env={"HEADDIM": "64"}, headdim=256)} == {256}  # flag wins


@pytest.mark.parametrize("flags,named", [(dict(batch=2), "--batch"), (dict(nheads=4), "--nheads")])
def test_sweep_refuses_batch_and_heads_by_the_name_used(flags, named):
    with pytest.raises(UnsupportedProblem, match=f"{named} cannot be combined with --sweep"):
        sweep_problems(env={}, **flags)
    with pytest.raises(UnsupportedProblem, match="NHEADS cannot be combined"):
        sweep_problems(env={"NHEADS": "4"})


def test_errors_name_the_flag_or_variable_used(capsys, monkeypatch):
    assert bench.main(["k4", "--compile-only", "--seqlen", "0"]) == 2
    assert "--seqlen must be positive" in capsys.readouterr().err
    assert bench.main(["k4", "--compile-only", "--dtype", "e5m2"]) == 2
    assert "--dtype must be one of" in capsys.readouterr().err
    assert bench.main(["k4", "--compile-only", "--dtype", "fp8"]) == 1  # valid, but K4 refuses it by name
    assert "dtype float8_e4m3fn not supported" in capsys.readouterr().out
    monkeypatch.setenv("SEQLEN", "0")
    assert bench.main(["k4", "--compile-only"]) == 2
    assert "SEQLEN must be positive" in capsys.readouterr().err


def test_compile_only_exits_non_zero_when_nothing_compiles(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HEADDIM", "80")
    out = tmp_path / "co.json"
    assert bench.main(["k4", "--compile-only", "--out", str(out)]) == 1
    assert "no kernel compiled" in capsys.readouterr().err
    rows = results.load(out)["rows"]
    assert [r["status"].split(":")[0] for r in rows] == ["refused"] and "head_dim 80" in rows[0]["status"]


def test_compile_only_writes_its_report(tmp_path):
    out = tmp_path / "co.json"
    assert bench.main(["k2", "--compile-only", "--headdim", "64", "--out", str(out)]) == 0
    data = results.load(out)
    row = data["rows"][0]
    assert data["meta"]["complete"] and (row["kernel"], row["head_dim"], row["status"]) == ("k2", 64, "ok")
    assert row["ptx_chars"] > 0 and row["instructions"]["shfl.sync"] > 0 and row["instructions"]["ld/st.local"] == 0
    assert "ptxas" in row  # registers and spills per entry, or null without ptxas on PATH


def test_unwritable_out_fails_before_any_work(tmp_path, capsys, monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled before checking --out")

    monkeypatch.setattr(bench, "compile_only", no_compile)
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        bench.main(["k2", "--compile-only", "--out", str(tmp_path / "f" / "x.json")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


def test_interrupted_sweep_keeps_its_rows(tmp_path, monkeypatch):
    # The GPU work is replaced by rows made up here; what is tested is that bench writes each row
    # as it comes, so Ctrl-C in the third workload leaves a valid file with the first two.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    done = []

    def fake_run_problem(names, problem, check, peers, sweep, emit, rounds=1):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(problem)
        for name in names:
            emit(dict(kernel=name, seqlen=problem.seqlen, head_dim=problem.head_dim, causal=int(problem.causal),
                      ms=1.0, tflops=float(problem.seqlen), status="ok"))

    monkeypatch.setattr(bench, "run_problem", fake_run_problem)
    out = tmp_path / "sweep.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["k2", "k4", "--sweep", "--headdim", "128", "--out", str(out)])
    data = results.load(out)
    assert data["meta"]["complete"] is False and "--sweep" in data["meta"]["command"]
    assert [(r["kernel"], r["seqlen"]) for r in data["rows"]] == [("k2", 512), ("k4", 512), ("k2", 1024), ("k4", 1024)]


def test_rounds_alternate_the_order_and_report_medians(monkeypatch):
    # Fake peers and kernel: each timing (alone: "bench", public call: "call") returns the next value
    # of its own list, and the timings are logged, so the order of the rounds and the medians (and
    # both ratios to the best peer from them) are checked.
    import harness.inputs
    import harness.peers
    import harness.timing
    from kernels.contract import Problem

    values = {("bench", "sdpa-cudnn"): [1.0, 3.0, 2.0], ("bench", "fa4"): [2.0, 2.0, 9.0],
              ("bench", "k6"): [4.0, 1.0, 1.5], ("call", "sdpa-cudnn"): [3.0, 3.0, 3.0],
              ("call", "fa4"): [2.5, 2.5, 2.5], ("call", "k6"): [5.0, 2.0, 2.0]}
    calls = []

    def timer(kind):
        def fake(fn, state=None):
            calls.append((kind, fn.name))
            if state is not None:  # the GPU state of this timing: its clock tells which call it was
                state.update(sm_clock_mhz=1000 + len(calls), power_w=700.0, temp_c=50 + len(calls),
                             clock_limited_by=["power_cap"], samples=5)
            return values[kind, fn.name][calls.count((kind, fn.name)) - 1]
        return fake

    def named(name):
        fn = lambda: None  # noqa: E731
        fn.name = name
        return fn

    monkeypatch.setattr(harness.timing, "benchmark", timer("bench"))
    monkeypatch.setattr(harness.timing, "burst_ms", timer("call"))
    monkeypatch.setattr(harness.inputs, "random_inputs", lambda p: (None, None, None))
    monkeypatch.setattr(harness.peers, "peer_callables",
                        lambda *a: {"sdpa-cudnn": named("sdpa-cudnn"), "sdpa-flash": "unavailable", "fa4": named("fa4")})

    def fake_row(name, p, *a, **kw):
        state, call_state = {}, {}
        ms = harness.timing.benchmark(named(name), state)
        return dict(ms=ms, call_ms=harness.timing.burst_ms(named(name), call_state), status="ok",
                    launch=named(name), call=named(name), states=[state], call_states=[call_state])

    monkeypatch.setattr(bench, "kernel_row", fake_row)
    rows = []
    p = Problem(batch=1, nheads=1, seqlen=1024, head_dim=128)
    bench.run_problem(["k6"], p, False, True, True, rows.append, rounds=3)
    first = [(kind, n) for n in ("sdpa-cudnn", "fa4", "k6") for kind in ("bench", "call")]
    assert calls == first + first[::-1] + first
    by_name = {r["kernel"]: r for r in rows}
    assert by_name["sdpa-cudnn"]["ms"] == 2.0 and by_name["fa4"]["ms"] == 2.0 and by_name["k6"]["ms"] == 1.5
    assert by_name["k6"]["ms_rounds"] == [4.0, 1.0, 1.5] and by_name["sdpa-flash"]["status"] == "unavailable"
    assert by_name["k6"]["call_ms"] == 2.0 and by_name["k6"]["call_ms_rounds"] == [5.0, 2.0, 2.0]
    assert by_name["k6"]["vs_best_peer"] == pytest.approx(2.5 / 2.0) and by_name["k6"]["best_peer"] == "fa4"
    assert by_name["k6"]["kernel_vs_best_peer"] == pytest.approx(2.0 / 1.5)
    # each round's GPU state stays with its row: k6 alone was the 5th, 8th and 17th timing
    assert by_name["k6"]["sm_clock_rounds"] == [1005, 1008, 1017] and by_name["k6"]["sm_clock_mhz"] == 1008
    assert by_name["fa4"]["sm_clock_rounds"] == [1003, 1010, 1015]
    assert all("states" not in r and "call_states" not in r for r in rows)
    assert bench.main(["k6", "--rounds", "0"]) == 2


def test_ref_check_refuses_workload_variables_it_would_ignore(monkeypatch, capsys):
    monkeypatch.setenv("HEADDIM", "256")
    assert ref_check.main(["k4"]) == 2
    err = capsys.readouterr().err
    assert "HEADDIM=256" in err and "own grid" in err


def test_ref_check_states_its_grid():
    text = ref_check.describe_grid(ref_check.QUICK_SEQLENS, all_head_dims=False)
    assert "1, 17, 128, 1000" in text and "(64, 128)" in text and "fp16" in text


def _make_docs():
    return load_script("make_docs")


def test_make_docs_plot_without_matplotlib_writes_nothing(monkeypatch, tmp_path):
    make_docs = _make_docs()
    monkeypatch.setattr(make_docs, "ROOT", tmp_path)  # were anything written, it would land here
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit, match="matplotlib"):
        make_docs.main(["--plot"])
    assert list(tmp_path.iterdir()) == []


def test_reproduce_script_configs_are_json():
    # Every --configs/--config list in scripts/reproduce.sh (and every list kept in a shell
    # variable) must parse: a backslash-newline inside single quotes is not a continuation.
    import re

    text = (ROOT / "scripts" / "reproduce.sh").read_text()
    quoted = re.findall(r"--configs? '([^']*)'", text) + re.findall(r"^\s*\w+='(\[[^']*\])'\s*$", text, re.M)
    assert len(quoted) > 30
    for q in quoted:
        json.loads(q)


def test_decode_refusals_name_the_flags_as_typed(capsys):
    assert bench.main(["--decode", "--compile-only"]) == 2
    err = capsys.readouterr().err
    assert "not --compile-only" in err and "compile_only" not in err


def test_host_times_refuses_a_workload_it_would_ignore(capsys):
    assert bench.main(["--host-times", "--seqlen", "4096"]) == 2
    assert "--host-times times its own calls" in capsys.readouterr().err and True
    assert bench.main(["k6", "--host-times"]) == 2


def test_reproduce_script_stops_before_making_its_folder_without_a_gpu(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would run")
    folder = tmp_path / "out"
    env = dict(__import__("os").environ, PATH=f"{Path(sys.executable).parent}:{__import__('os').environ['PATH']}")
    done = subprocess.run(["bash", "scripts/reproduce.sh", "check", str(folder)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], env=env)
    assert done.returncode == 2 and "no CUDA GPU is visible" in done.stderr and not folder.exists()


def test_ref_check_backward_takes_backward_stages_only(capsys):
    assert ref_check.main(["--backward", "k8"]) == 2
    assert "the backward stages ['k9', 'k10', 'k10_overlap', 'k10_flat', 'k10_stmatrix', 'k10_fa3'], not ['k8']" in capsys.readouterr().err


def test_backward_refuses_what_it_would_ignore_and_needs_a_gpu(capsys, monkeypatch):
    assert bench.main(["--backward", "--sweep", "--batch", "4"]) == 2
    assert "--backward times k9 and k10 and the peers" in capsys.readouterr().err
    monkeypatch.setenv("NHEADS", "8")  # the sweep keeps its own heads: a variable is refused as the flag is
    assert bench.main(["--backward", "--sweep"]) == 2
    assert "not NHEADS" in capsys.readouterr().err
    monkeypatch.delenv("NHEADS")
    assert bench.main(["--backward", "--dtype", "fp16"]) == 2
    assert "not --dtype" in capsys.readouterr().err
    assert bench.main(["k6", "--backward"]) == 2
    assert "not k6" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--backward", "--seqlen", "1024"]) == 2
        assert "No CUDA GPU" in capsys.readouterr().err
        assert bench.main(["--backward", "--seqlen", "4096", "--batch", "1", "--nheads", "16"]) == 2  # one workload
        assert "No CUDA GPU" in capsys.readouterr().err


def test_ncu_stalls_refuses_a_softcap_beside_a_configured_backward(capsys):
    ncu = load_script("ncu_stalls")
    with pytest.raises(SystemExit) as e:
        ncu.main(["--backward", "--config", '{"early_dv": true}', "--softcap", "30"])
    assert e.value.code == 2 and "--softcap" in capsys.readouterr().err


def test_ref_check_refuses_two_grids_at_once_and_features_outside_theirs(capsys):
    assert ref_check.main(["--decode", "--backward"]) == 2
    assert "three grids" in capsys.readouterr().err
    assert ref_check.main(["--varlen", "--decode"]) == 2
    assert "three grids" in capsys.readouterr().err
    assert ref_check.main(["--varlen", "--features"]) == 2


def test_ref_check_decode_features_are_the_window_cases():
    windowed = [c for c in ref_check.decode_cases(False) if tuple(c.window) != (-1, -1)]
    assert windowed and {c.kernel for c in windowed} == {"decode", "decode_combine"}


def test_ref_check_varlen_grid_is_valid_packings_with_every_feature():
    from harness.varlen import with_causal

    grid = list(ref_check.varlen_cases())
    assert len(grid) == len({repr(c) for c in grid})  # no case twice
    for lengths_q, lengths_k, h, h_kv, d, causal, softcap, window, dtype, on_cpu in grid:
        assert len(lengths_q) == len(lengths_k) and h % h_kv == 0
        bounded = causal or window != (-1, -1)
        assert all(n_k > 0 and (not bounded or n_q <= n_k) for n_q, n_k in zip(lengths_q, lengths_k) if n_q)
    assert any(0 in c[0] for c in grid) and any(1 in c[0] for c in grid)  # empty and one-row sequences
    assert {c[4] for c in grid} == {64, 128, 256} and {c[5] for c in grid} == {False, True}
    assert any(c[6] for c in grid) and any(with_causal(c[7], c[5]) != (-1, -1) for c in grid)
    assert any(c[2] != c[3] for c in grid) and any(c[9] for c in grid) and any(c[8] == "float16" for c in grid)


def test_ref_check_features_picks_the_softcap_and_window_cases():
    from kernels.contract import Problem

    assert ref_check.has_feature(Problem(1, 1, 8, 64, softcap=5.0))
    assert ref_check.has_feature(Problem(1, 1, 8, 64, window=(4, 0)))
    assert not ref_check.has_feature(Problem(1, 1, 8, 64, causal=True))


def test_backward_takes_a_softcap_or_a_window_and_refuses_bad_ones(capsys):
    assert bench.main(["--backward", "--window=-2,0"]) == 2
    assert ">= -1" in capsys.readouterr().err
    assert bench.main(["--backward", "--softcap", "-1"]) == 2
    assert "softcap must be a finite number" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--backward", "--window", "1024,0", "--softcap", "30"]) == 2
        assert "No CUDA GPU" in capsys.readouterr().err


def test_decode_window_refuses_what_it_cannot_run(capsys):
    assert bench.main(["--decode", "--window=-1,0"]) == 2
    assert "LEFT >= 0" in capsys.readouterr().err
    assert bench.main(["--decode", "--window", "1024,0", "--splits-curve"]) == 2
    assert "only the window's row" in capsys.readouterr().err
    assert bench.main(["--decode", "--window", "x"]) == 2
    assert "LEFT,RIGHT" in capsys.readouterr().err


def test_the_packed_backward_bench_takes_its_own_flags_only(capsys):
    assert bench.main(["--varlen", "--backward", "--seqlen", "4096"]) == 2
    assert "--backward and --out, not --seqlen" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--varlen", "--backward"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_backward_ab_script_refuses_a_bad_configuration_or_a_taken_name(capsys):
    ab = load_script("ab_backward")
    with pytest.raises(SystemExit) as e:
        ab.main(["--name", "k10_x", "--config", "{tile_m: 80}"])
    assert e.value.code == 2 and "--config must be a JSON object of compile overrides" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--name", "k10_x", "--config", "[]"])
    assert "non-empty JSON object" in capsys.readouterr().err
    assert ab.main(["--name", "k10_fa3", "--config", '{"tile_m": 80}']) == 2
    assert "is a stage already" in capsys.readouterr().err
    assert ab.main(["--name", "k10_x", "--config", '{"tile_m": 80}', "--config", '{"tile_m": 64}']) == 2
    assert "one distinct --name for each --config" in capsys.readouterr().err
    shapes = [(p.seqlen, p.kv_len, p.causal, p.softcap, p.window) for p in ab.checks(128)]
    assert (1, 1, False, 0.0, (-1, -1)) in shapes and (1000, 4097, True, 0.0, (-1, -1)) in shapes and len(shapes) == 12
    assert ab.main(["--varlen", "--softcap", "5", "--name", "k10_x", "--config", '{"tile_m": 80}']) == 2
    assert "--varlen times the packing uncapped" in capsys.readouterr().err
    packed = list(ab.packed_checks())  # empty, one-row, whole 128-key tiles and a partial one; both masks
    lengths = {n for case in packed for n in case[0]}
    assert {0, 1, 128, 256, 4097} <= lengths and {c[4] for c in packed} == {False, True} and len(packed) == 10


def test_ref_check_headdim_picks_the_grids_cases(monkeypatch, capsys):
    assert ref_check.main(["--decode", "--headdim", "64"]) == 2
    assert "--headdim and --causal pick cases" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(ref_check, "backward_row",
                        lambda stage, p, magnitude: seen.append(p.head_dim) or dict(ok=True, reason=""))
    rows, failures = ref_check.run_backward_grid(ref_check.QUICK_SEQLENS, None, ["k10_fa3"], head_dim=256)
    assert failures == 0 and len(rows) == len(seen) > 10 and set(seen) == {256}
    assert ref_check.run_backward_grid(ref_check.QUICK_SEQLENS, None, ["k9"], head_dim=256) == ([], 0)


def test_ptx_digest_backward_builds_every_knob_measured_and_left_off(capsys):
    from kernels import k10_experiments

    digest = load_script("ptx_digest")
    covered = {k for _, _, knob, _, _ in digest.BACKWARD_KNOBS for k in knob}
    assert set(k10_experiments.MIXINS) <= covered, set(k10_experiments.MIXINS) - covered
    with pytest.raises(SystemExit):
        digest.main(["--backward", "--seqlen", "100", "--out", "/dev/null"])
    assert "--seqlen is the forward's" in capsys.readouterr().err


def test_ref_check_jobs_merge_rows_in_order_and_fail_on_a_failure_or_an_unfinished_unit(tmp_path, capsys, monkeypatch):
    # A stand-in for ref_check.py: "bad" fails a case, "dies" ends without finishing its grid.
    child = tmp_path / "child.py"
    child.write_text(f"""import os, sys
sys.path.insert(0, {str(ROOT)!r})
from harness import results
name, out = sys.argv[1], sys.argv[sys.argv.index("--out") + 1]
if name == "early":  # a crash before its result file is opened, with ref_check's exit status for a failure
    sys.exit(1)
assert sys.argv[2:-2] == ["--quick"], sys.argv
f = results.ResultFile(out, "child")
for i in range(2):
    f.append(dict(kernel=name, i=i, gpu=os.environ["CUDA_VISIBLE_DEVICES"], ok=not (name == "bad" and i),
                  reason="x", dtype="bf16", batch=1, nheads=1, seqlen=1, head_dim=64, causal=0))
if name == "dies":
    sys.exit(3)
if name == "hangs":
    open(out + ".pid", "w").write(str(os.getpid()))
    __import__("time").sleep(120)
f.close()
sys.exit(name == "bad")
""")
    def units(*names):
        return [(name, [name, "--quick"]) for name in names]

    out = results.open_result_file(tmp_path / "all.json", "ref_check.py a b --jobs 2")
    assert ref_check.run_jobs(units("a", "b"), 2, 2, out, script=str(child)) == 0
    merged = results.parse((tmp_path / "all.json").read_text())
    assert merged["meta"]["complete"] and merged["meta"]["command"] == "ref_check.py a b --jobs 2"
    assert [(r["kernel"], r["i"], r["gpu"]) for r in merged["rows"]] == [("a", 0, "0"), ("a", 1, "0"),
                                                                          ("b", 0, "1"), ("b", 1, "1")]
    assert not (tmp_path / "all.json.parts").exists()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # a child's GPU is one this process sees
    out = results.open_result_file(tmp_path / "gpus.json", "x")
    assert ref_check.run_jobs(units("a", "b", "c"), 3, 2, out, script=str(child)) == 0
    assert [r["gpu"] for r in results.parse((tmp_path / "gpus.json").read_text())["rows"]] == ["2", "2", "3", "3", "2", "2"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    # a stopped run's parts are not this run's: a complete one of "early", which now ends before writing any
    stale = tmp_path / "again.json.parts"
    stale.mkdir()
    results.write(stale / "early.json", [dict(kernel="early", ok=True)], "an earlier run")
    out = results.open_result_file(tmp_path / "again.json", "x")
    assert ref_check.run_jobs(units("early"), 1, 1, out, script=str(child)) == 1
    assert "early: exit 1, did not finish" in capsys.readouterr().out

    out = results.open_result_file(tmp_path / "bad.json", "x")
    assert ref_check.run_jobs(units("a", "bad", "c"), 2, 2, out, script=str(child)) == 1
    assert "FAIL bad" in capsys.readouterr().out
    assert len(results.parse((tmp_path / "bad.json").read_text())["rows"]) == 6

    out = results.open_result_file(tmp_path / "dies.json", "x")
    assert ref_check.run_jobs(units("a", "dies"), 1, 1, out, script=str(child)) == 1
    text = capsys.readouterr().out
    assert "dies: exit 3, did not finish" in text and "did not finish (logs in" in text
    partial = results.parse((tmp_path / "dies.json").read_text())
    assert not partial["meta"]["complete"] and len(partial["rows"]) == 4
    assert (tmp_path / "dies.json.parts" / "dies.log").exists()

    # a timeout's SIGTERM: the children end with the parent, and --out has the rows they wrote
    import os
    import signal
    import threading

    out = results.open_result_file(tmp_path / "hangs.json", "x")
    pid_file, done = tmp_path / "hangs.json.parts" / "hangs.json.pid", threading.Event()

    def signal_once_hanging():  # once "hangs" has written its rows (and "a" has had as long), not before
        for _ in range(1200):
            if done.is_set():
                return
            if pid_file.exists() and (tmp_path / "hangs.json.parts" / "a.json").exists():
                done.wait(3.0)
                if not done.is_set():
                    os.kill(os.getpid(), signal.SIGTERM)
                return
            done.wait(0.1)

    threading.Thread(target=signal_once_hanging, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as e:
            ref_check.run_jobs(units("a", "hangs"), 2, 1, out, script=str(child))
    finally:
        done.set()
    assert e.value.code == 124
    assert len(results.parse((tmp_path / "hangs.json").read_text())["rows"]) == 4
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_ref_check_jobs_split_the_grid_by_kernel_and_head_dim_and_pass_its_options_on():
    args = ref_check.argparse.Namespace(quick=True, all_head_dims=True, features=False, headdim=None, causal=None,
                                        config={"tile_n": 128}, backward=False)
    units = ref_check.job_units(["k2", "k6"], ref_check.QUICK_SEQLENS, args)
    assert [label for label, _ in units] == ["k2-d32", "k2-d64", "k2-d96", "k2-d128", "k2-d256",
                                             "k6-d64", "k6-d128", "k6-d256"]
    assert units[3][1] == ["k2", "--quick", "--all-head-dims", "--config", '{"tile_n": 128}', "--headdim", "128"]
    args.headdim, args.features, args.config = 128, True, None
    assert ref_check.job_units(["k2", "k6"], ref_check.QUICK_SEQLENS, args) == [
        ("k6-d128", ["k6", "--quick", "--all-head-dims", "--features", "--headdim", "128"])]  # K2 has no feature
    args.features, args.causal = False, 1  # each unit is the causal cases only
    assert ref_check.job_units(["k6"], ref_check.QUICK_SEQLENS, args) == [
        ("k6-d128", ["k6", "--quick", "--all-head-dims", "--headdim", "128", "--causal", "1"])]
    args.headdim = 512
    assert ref_check.job_units(["k6"], ref_check.QUICK_SEQLENS, args) == []  # main: an error, exit 2


def test_ref_check_jobs_split_the_backward_grid_by_stage_head_dim_and_causal_mode():
    args = ref_check.argparse.Namespace(quick=False, all_head_dims=False, features=False, headdim=None, causal=None,
                                        config=None, backward=True)
    units = ref_check.job_units(["k9", "k10_fa3"], ref_check.SEQLENS, args)
    assert [label for label, _ in units] == [f"{s}-d{d}-c{c}" for s, dims in (("k9", (64, 128)), ("k10_fa3", (64, 128, 256)))
                                             for d in dims for c in (0, 1)]
    assert units[-1][1] == ["--backward", "k10_fa3", "--headdim", "256", "--causal", "1"]
    # together the units hold every case of the grid once, and a unit's filters pick its own
    k10_cases = [p for p, _ in ref_check.backward_cases(ref_check.SEQLENS, features=True, head_dims=(64, 128, 256))]
    per_unit = [[p for p in k10_cases if ref_check.picked(p, False, int(a[3]), int(a[5]))] for _, a in units[4:]]
    assert sum(map(len, per_unit)) == len(k10_cases) and all(per_unit)
    args.causal = 0
    assert [label for label, _ in ref_check.job_units(["k9"], ref_check.SEQLENS, args)] == ["k9-d64-c0", "k9-d128-c0"]


def test_ref_check_causal_picks_cases_and_is_refused_outside_its_grids(capsys):
    p = Problem(1, 1, 8, 64, causal=True)
    assert ref_check.picked(p, False, None, 1) and not ref_check.picked(p, False, None, 0)
    assert ref_check.picked(p, False, 64, None) and not ref_check.picked(p, True, 64, 1)  # --features: no feature
    assert ref_check.main(["--decode", "--causal", "1"]) == 2
    assert "--causal" in capsys.readouterr().err
