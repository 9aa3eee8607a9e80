"""The docs generator builds its tables from result files (synthetic ones here)."""

from pathlib import Path

from kernels import get_kernel, kernel_names
from script_loader import load_script

make_docs = load_script("make_docs")


def row(kernel, seqlen, causal, tflops, d=128):
    return dict(kernel=kernel, seqlen=seqlen, head_dim=d, causal=causal, tflops=tflops, ms=1.0, status="ok",
                dtype="bfloat16")


SWEEP = {"meta": {"device": "NVIDIA H200", "command": "python bench.py all --sweep", "date": "2026-11-21T00:00:00"},
         "rows": [row("k1", 4096, 0, 2.5), row("k1", 8192, 0, None), row("sdpa-cudnn", 4096, 0, 600.0),
                  row("k1", 4096, 1, 1.25)]}
REFCHECK = {"meta": {"device": "NVIDIA H200", "command": "python ref_check.py all"},
            "rows": [dict(kernel="k1", dtype="bfloat16", batch=2, nheads=3, head_dim=64, causal=0, seqlen=17,
                          max_abs=1e-3, peer_max_abs=2e-3, rel_l2=2e-3, lse_max_abs=1e-6, ok=True),
                     dict(kernel="k1", dtype="bfloat16", batch=2, nheads=3, head_dim=64, causal=1, seqlen=17,
                          max_abs=1.0, peer_max_abs=2e-3, rel_l2=1.0, lse_max_abs=1.0, ok=False)]}


def test_readme_table_takes_numbers_from_the_sweep():
    table = make_docs.readme_table(SWEEP, REFCHECK)
    assert "H200" in table
    k1 = next(line for line in table.splitlines() if line.startswith("| `k1`"))
    assert "| 2.5 | 1.2 | — | — |" in k1 and "1/2 pass" in k1
    assert "| 600.0 |" in next(line for line in table.splitlines() if "sdpa-cudnn" in line)


def test_family_table_names_device_and_command():
    table = make_docs.family_table(SWEEP, ["k1"])
    assert "H200" in table and "python bench.py all --sweep" in table
    assert "| 128 | 0 | `k1` | 2.5 |" in table and "| 128 | 1 | `k1` | 1.2 |" in table


def test_refcheck_table_marks_failures():
    table = make_docs.refcheck_table(REFCHECK, ["k1"])
    assert table.count("| ok |") == 1 and table.count("| FAIL |") == 1


def test_tune_table_marks_seed_and_default():
    cfg_seed, cfg_def = dict(num_wg=1, tile_n=64), dict(num_wg=2, tile_n=128)
    tune = {"meta": {"device": "NVIDIA H100 80GB HBM3", "command": "python scripts/k4_tune.py"},
            "rows": [dict(kernel="k4", head_dim=128, causal=c, seqlen=8192, config=cfg, seed=cfg is cfg_seed,
                          default=cfg is cfg_def, tflops=t)
                     for c, cfg, t in ((0, cfg_seed, 300.0), (1, cfg_seed, 250.0), (0, cfg_def, 560.0),
                                       (1, cfg_def, 520.0))]
            + [dict(kernel="fa4", head_dim=128, causal=0, seqlen=8192, config=None, tflops=640.0)]}
    table = make_docs.tune_table(tune)
    assert "H100" in table
    assert "| 128 | num_wg=1, tile_n=64 (seed) | 300.0 | 250.0 |" in table
    assert "| 128 | **num_wg=2, tile_n=128 (default)** | 560.0 | 520.0 |" in table
    assert "| 128 | *fa4* | 640.0 | — |" in table


def test_k3_depth_table_gives_ratios_to_one_stage():
    sweep = {"meta": {}, "rows": [row("k3_1", 1024, 0, 10.0), row("k3_2", 1024, 0, 10.5), row("k3_3", 1024, 0, 9.0)]}
    table = make_docs.k3_depth_table(sweep)
    assert "| 128 | 0 | 1024 | 10.0 | 10.5 | 9.0 | 1.050 | 0.900 |" in table


def test_ci_runs_the_readme_test_command():
    root = Path(__file__).parent.parent
    ci_cmd = [line for line in (root / ".ci" / "run").read_text().splitlines() if "pytest" in line and not line.startswith("#")]
    assert len(ci_cmd) == 1 and ci_cmd[0] in (root / "README.md").read_text()


def test_headline_table_gives_ratios_to_peers_of_the_same_run():
    f = {"meta": {"device": "NVIDIA H100 80GB HBM3", "command": "SEQLEN=8192 CHECK=1 python bench.py k4"},
         "rows": [dict(kernel=k, batch=2, nheads=16, seqlen=8192, head_dim=128, causal=0, tflops=t, ms=1.0)
                  for k, t in (("k4", 500.0), ("sdpa-cudnn", 625.0), ("fa4", 400.0))]}
    table = make_docs.headline_table([f])
    assert "| H100 | B=2 H=16 N=8192 d=128 | `k4` | 500.0 | — | 0.80× | 1.25× |" in table  # no public-call times
    assert "625.0 / 400.0" in table and "SEQLEN=8192 CHECK=1 python bench.py k4" in table
    # A run that timed the public calls rates those, the kernel alone beside them.
    calls = {"k4": 250.0, "sdpa-cudnn": 500.0, "fa4": 200.0}
    f["rows"] = [dict(r, call_tflops=calls[r["kernel"]]) for r in f["rows"]]
    table = make_docs.headline_table([f])
    assert "| H100 | B=2 H=16 N=8192 d=128 | `k4` | 500.0 | 250.0 | 0.50× | 1.25× |" in table
    assert "625.0 / 400.0 | 500.0 / 200.0 |" in table


def test_refcheck_table_shows_crashed_cases_without_numbers():
    crashed = dict(REFCHECK["rows"][0], ok=False, status="crashed", max_abs=None, rel_l2=None, lse_max_abs=None,
                   peer_max_abs=None)
    table = make_docs.refcheck_table(dict(REFCHECK, rows=[crashed]), ["k1"])
    assert "| — | — | — | — | FAIL |" in table


def test_caps_table_comes_from_each_registered_kernels_capabilities():
    table = make_docs.caps_table()
    for name in kernel_names():
        caps = get_kernel(name).caps
        line = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"| {', '.join(map(str, caps.head_dims))} |" in line


def test_readme_caps_table_is_generated_and_current():
    # Registering a kernel (k5, say) changes the table: run python scripts/make_docs.py.
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert f"<!-- table:caps -->\n{make_docs.caps_table()}\n<!-- /table:caps -->" in readme


def test_doc_pages_follow_the_kernel_names(monkeypatch):
    names = ["k1", "k3_1", "k3_2", "k4_qk", "k4", "k4_seed", "k5", "k6"]
    monkeypatch.setattr(make_docs, "kernel_names", lambda: names)
    assert make_docs.families() == {"k1": ["k1"], "k3": ["k3_1", "k3_2"], "k4": ["k4_qk", "k4", "k4_seed"],
                                    "k5": ["k5"], "k6": ["k6"]}


def test_unfinished_result_files_are_not_used(monkeypatch, tmp_path):
    import json

    (tmp_path / "results").mkdir()
    for name, date, complete in (("sweep-a.json", "2026-01-01", None), ("sweep-b.json", "2026-02-01", True),
                                 ("sweep-c.json", "2026-03-01", False)):
        meta = {"date": date} if complete is None else {"date": date, "version": 2, "complete": complete}
        (tmp_path / "results" / name).write_text(json.dumps({"meta": meta, "rows": []}))
    monkeypatch.setattr(make_docs, "ROOT", tmp_path)
    assert [f["meta"]["date"] for f in make_docs.finished("sweep*.json")] == ["2026-01-01", "2026-02-01"]
    assert make_docs.latest("sweep*.json")["meta"]["date"] == "2026-02-01"


def test_decode_host_runs_compare_calls_within_each_run():
    def host(kernel, batch, us):
        return dict(mode="host", kernel=kernel, batch=batch, host_us=us, status="ok")

    def run(name, date, one, plan, sdpa):
        rows = [host(k, b, us[i]) for k, us in (("decode attention_with_kvcache", one), ("decode plan.run", plan),
                                                 ("sdpa (default backend)", sdpa)) for i, b in enumerate((1, 64))]
        return {"file": name, "meta": {"date": date}, "rows": rows}

    newer = run("decode-h200-b.json", "2026-11-25T02", (20.0, 18.0), (10.0, 9.0), (40.0, 24.0))
    older = run("decode-h200-a.json", "2026-11-25T01", (30.0, 33.0), (10.0, 11.0), (25.0, 30.0))
    grid_only = {"file": "decode-h200-c.json", "meta": {"date": "2026-11-25T03"}, "rows": [dict(mode="grid")]}
    lines = make_docs.decode_host_runs_table([newer, grid_only, older]).splitlines()
    assert len(lines) == 4  # header, rule, the two runs with host rows, oldest first
    assert lines[2] == "| `decode-h200-a.json` | 1 / 64 | 30.0 / 33.0 | 10.0 / 11.0 | 25.0 / 30.0 | 20.0 / 22.0 | 1.20 / 1.10 |"
    assert lines[3] == "| `decode-h200-b.json` | 1 / 64 | 20.0 / 18.0 | 10.0 / 9.0 | 40.0 / 24.0 | 10.0 / 9.0 | 0.50 / 0.75 |"
    assert "No host-time rows" in make_docs.decode_host_runs_table([grid_only])


def test_refcheck_runs_summary_counts_each_kernels_cases_and_links_the_companion():
    runs = [REFCHECK, {"meta": {"device": "NVIDIA H100 80GB HBM3", "command": "python ref_check.py k1 k2"},
                       "rows": [dict(REFCHECK["rows"][0], kernel="k2"), REFCHECK["rows"][0]]}]
    table = make_docs.refcheck_runs_summary(runs, ["k1"], "k1")
    lines = [line for line in table.splitlines() if line.startswith("| H")]
    assert lines[0].startswith("| H200 |") and lines[0].endswith("| `k1` 1/2 |")
    assert lines[1].startswith("| H100 |") and lines[1].endswith("| `k1` 1/1 |")  # k2's case is another page's
    assert "(k1-runs.md#correctness)" in table


def test_fill_writes_a_block_into_whichever_page_of_the_stem_holds_its_marker(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    main, runs = tmp_path / "docs" / "kx.md", tmp_path / "docs" / "kx-runs.md"
    main.write_text("# KX\n<!-- table:a -->\nold\n<!-- /table:a -->\n")
    runs.write_text("# KX runs\n<!-- table:b -->\n<!-- /table:b -->\n")
    monkeypatch.setattr(make_docs, "ROOT", tmp_path)
    made = []
    make_docs.fill("kx", "a", lambda: made.append("a") or "A")
    make_docs.fill("kx", "b", lambda: made.append("b") or "B")
    make_docs.fill("kx", "c", lambda: made.append("c") or "C")  # no marker anywhere: never built
    assert "\nA\n" in main.read_text() and "old" not in main.read_text() and "\nB\n" in runs.read_text()
    assert made == ["a", "b"]


def test_backward_kernels_files_each_kernel_under_its_role_and_sums_them_per_call():
    from harness.backward_bench import kernel_role  # what scripts/backward_kernels.py files each kernel under

    assert [kernel_role(k) for k in (
        "kernel_cutlass_kernel_kernelsk9Prepass_object_at_", "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>",
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttention", "Memset (Device)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >",
        "kernel_cutlass_kernel_kernelsk10FlatPostpass_object_at_", "void cudnn::fusion::convert_dq_to_16bits<true>",
        "kernel_cutlass_kernel_kernelsk10K10Backward_object_at_", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop",
    )] == ["pre-pass"] * 3 + ["fill"] * 2 + ["post-pass"] * 2 + ["main"] * 2
    assert kernel_role("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl") == "copy"
    row = dict(head_dim=128, causal=1, seqlen=1024, batch=16, nheads=16)
    run = dict(meta=dict(command="python scripts/backward_kernels.py", device="NVIDIA H100 80GB HBM3",
                         date="2026-11-27T00:00:00", commit="abcdef0123"),
               rows=[dict(row, candidate="k10_fa3", role="main", kernel="a", us=400.0),
                     dict(row, candidate="k10_fa3", role="main", kernel="b", us=20.0),
                     dict(row, candidate="k10_fa3", role="post-pass", kernel="c", us=70.4),
                     dict(row, candidate="fa4", role="pre-pass", kernel="d", us=90.0)])
    table = make_docs.backward_kernels_table(run)
    assert "H100" in table and "abcdef0" in table
    assert "| 128 | 1 | 1024 | `k10_fa3` | — | — | 420 | 70 | 490 |" in table
    assert "| 128 | 1 | 1024 | flash-attn-4 | 90 | — | — | — | 90 |" in table


def test_softcap_cost_table_gives_compile_overrides_their_own_column():
    meta = {"device": "NVIDIA H200", "date": "2026-11-28T00:00:00", "command": "python scripts/softcap_cost.py"}
    cell = dict(kernel="k6", batch=2, nheads=16, seqlen=8192, head_dim=128, causal=1, ok=True, reason="")
    rows = [dict(cell, softcap=0.0, emulated_exp2=0, tflops=600.0), dict(cell, softcap=30.0, emulated_exp2=0, tflops=540.0),
            dict(cell, softcap=30.0, emulated_exp2=0, config={}, tflops=530.0),
            dict(cell, softcap=30.0, emulated_exp2=0, config={"pingpong": False}, tflops=510.0)]
    table = make_docs.softcap_cost_table({"meta": meta, "rows": rows})
    line = next(x for x in table.splitlines() if x.startswith("| 128 |"))
    assert line == "| 128 | 1 | 8192 | 2×16 | 600.0 | 540.0 (10.0%) | 530.0 (11.7%) | 510.0 (15.0%) |"
    assert "softcap, `{}` |" in table and 'softcap, `{"pingpong": false}`' in table and "4/4 pass" in table


def test_window_backward_table_sets_each_candidate_against_its_same_flops_rectangle():
    meta = {"device": "NVIDIA H200", "date": "2026-11-28T00:00:00", "command": "python bench.py --backward"}
    win = dict(batch=1, nheads=16, seqlen=16384, head_dim=128, causal=1, window=[1024, -1], status="ok")
    rect = dict(batch=1, nheads=16, seqlen=4096, head_dim=128, causal=0, status="ok")
    windows = [{"meta": meta, "rows": [dict(win, kernel="k10_fa3", call_tflops=400.0, tflops=410.0),
                                        dict(win, kernel="fa4", call_tflops=420.0)]}]
    rectangle = {"meta": meta, "rows": [dict(rect, kernel="k10_fa3", call_tflops=520.0, tflops=533.0),
                                        dict(rect, kernel="fa4", call_tflops=546.0)]}
    table = make_docs.window_backward_table(windows, rectangle)
    assert "| 1024 | 16384 | `k10_fa3` | 400.0 | 410.0 | 420.0 | 0.952× | 1.300× | 1.300× | 1.300× |" in table
    assert "The rectangle: B=1 H=16 N=4096 d=128 non-causal" in table
    assert "| 1024 | 16384 | `k10_fa3` | 400.0 | 410.0 | 420.0 | 0.952× | — | — | — |" in \
        make_docs.window_backward_table(windows, None)


def test_a_page_prints_in_full_the_newest_full_grid_on_the_issues_gpu_before_a_quick_one():
    def run(device, command):
        return {"meta": {"device": device, "command": command}, "rows": REFCHECK["rows"]}

    quick_h200, full_h200 = run("NVIDIA H200", "python ref_check.py k7 --quick"), run("NVIDIA H200", "python ref_check.py k7")
    quick_h100, older_full_h200 = run("NVIDIA H100 80GB HBM3", "python ref_check.py k7 --quick"), run("NVIDIA H200", "x")
    assert make_docs.printed_in_full([quick_h200, full_h200, older_full_h200]) == [full_h200]
    assert make_docs.printed_in_full([quick_h200]) == [quick_h200]
    # the issues' GPU first, then a full grid
    assert make_docs.printed_in_full([full_h200, quick_h100]) == [quick_h100]
