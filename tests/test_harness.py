"""Harness unit tests (CPU): FLOP counting, configuration, error metric, refusals, tables."""

import pytest
import torch

from harness.check import compare
from harness.config import default_batch_heads, parse_bool, problem_from, sweep_problems
from harness.inputs import problem_from_tensors
from harness.results import markdown_table, replace_block
from kernels import get_kernel, kernel_names
from kernels.contract import Capabilities, Problem, UnsupportedProblem
from kernels.k1 import check_s_fits, s_bytes
from script_loader import load_script


def test_flops_standard_count_and_causal_half():
    p = Problem(2, 16, 8192, 128)
    assert p.flops == 4 * 2 * 16 * 8192**2 * 128
    assert p.with_(causal=True).flops == p.flops / 2


def test_default_scale_is_inverse_sqrt_head_dim():
    assert Problem(1, 1, 8, 64).scale == pytest.approx(1 / 8)
    assert Problem(1, 1, 8, 64, softmax_scale=0.3).scale == 0.3


def test_config_env_and_flags():
    env = {"SEQLEN": "512", "HEADDIM": "64", "CAUSAL": "1", "DTYPE": "fp16"}
    p = problem_from(env)
    assert (p.seqlen, p.head_dim, p.causal, p.dtype) == (512, 64, True, "float16")
    assert (p.batch, p.nheads) == default_batch_heads(512, 64) == (32, 32)
    p = problem_from(env, seqlen=1024, causal=0, batch=3)
    assert (p.seqlen, p.causal, p.batch, p.nheads) == (1024, False, 3, 32)


@pytest.mark.parametrize("env", [{"SEQLEN": "abc"}, {"SEQLEN": "0"}, {"CAUSAL": "maybe"}, {"DTYPE": "float8"},
                                 {"HEADDIM": "-64"}])
def test_config_rejects_bad_values(env):
    with pytest.raises(UnsupportedProblem):
        problem_from(env)


def test_parse_bool():
    assert parse_bool("1") and parse_bool("TRUE") and not parse_bool("0") and not parse_bool("")


def test_sweep_grid_keeps_work_constant():
    grid = sweep_problems(env={})
    dense = [p for p in grid if not p.causal]
    assert len({p.flops / p.seqlen for p in dense}) == 1  # batch*heads*seqlen*d is fixed


def test_compare_passes_rounding_and_fails_errors():
    torch.manual_seed(0)
    ref = torch.randn(2, 3, 50, 64)
    lse = torch.randn(2, 3, 50)
    ok = compare(ref.bfloat16(), ref, lse, lse, "bfloat16")
    assert ok.verdict == "" and ok.rel_l2 < 5e-3
    bad = ref.clone()
    bad[0, 0, 0, 0] += 0.5
    assert "max_abs" in compare(bad.bfloat16(), ref, lse, lse, "bfloat16").verdict
    assert "rel_l2" in compare((ref * 1.05).bfloat16(), ref, lse, lse, "bfloat16").verdict


def test_compare_against_sdpa_error():
    torch.manual_seed(1)
    ref = torch.randn(1, 2, 40, 64)
    lse = torch.randn(1, 2, 40)
    peer = ref + 1e-3 * torch.randn_like(ref)  # SDPA's own rounding error, about 3e-3 at most
    close = ref + 0.5 * (peer - ref)
    assert compare(close, ref, lse, lse, "bfloat16", peer).verdict == ""
    far = ref.clone()
    far[0, 1, 7, 3] += 3 * float((peer - ref).abs().max())
    c = compare(far, ref, lse, lse, "bfloat16", peer)
    assert "SDPA" in c.verdict and c.peer_max_abs == pytest.approx(float((peer - ref).abs().max()))
    assert compare(ref, ref, lse, lse, "bfloat16", ref).verdict == ""  # SDPA exact (seqlen 1): floor


def test_compare_rejects_nan_and_wrong_lse():
    ref = torch.randn(1, 1, 8, 16)
    lse = torch.randn(1, 1, 8)
    poisoned = ref.clone()
    poisoned[0, 0, 3] = float("nan")  # one row the kernel never wrote
    verdict = compare(poisoned, ref, lse, lse, "float16").verdict
    assert "non-finite" in verdict
    assert "lse" in compare(ref, ref, lse + 0.01, lse, "float16").verdict
    assert "lse" in compare(ref, ref, lse * float("nan"), lse, "float16").verdict


def test_capabilities_refuse_with_named_constraint():
    caps = Capabilities(head_dims=(64, 128), dtypes=("bfloat16",), causal=False, lse=False, max_seqlen=1024)
    with pytest.raises(UnsupportedProblem, match="head_dim 96"):
        caps.check(Problem(1, 1, 16, 96))
    with pytest.raises(UnsupportedProblem, match="dtype float16"):
        caps.check(Problem(1, 1, 16, 64, dtype="float16"))
    with pytest.raises(UnsupportedProblem, match="causal"):
        caps.check(Problem(1, 1, 16, 64, causal=True))
    with pytest.raises(UnsupportedProblem, match="seqlen 2048"):
        caps.check(Problem(1, 1, 2048, 64))
    with pytest.raises(UnsupportedProblem, match="log-sum-exp"):
        caps.check(Problem(1, 1, 16, 64), want_lse=True)
    caps.check(Problem(1, 1, 16, 64))


def test_problem_rejects_nonsense():
    with pytest.raises(UnsupportedProblem, match="seqlen"):
        Problem(1, 1, 0, 64)
    with pytest.raises(UnsupportedProblem, match="dtype"):
        Problem(1, 1, 8, 64, dtype="float32")
    for bad in (0.0, -0.1, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(UnsupportedProblem, match="softmax_scale"):
            Problem(1, 1, 8, 64, softmax_scale=bad)


def test_grid_limits_and_gpu_generation_are_refused():
    fused, folded = Capabilities(head_dims=(64,)), Capabilities(head_dims=(64,), folds_batch_heads=True)
    with pytest.raises(UnsupportedProblem, match="nheads = 70000 exceeds the grid limit"):
        fused.check(Problem(1, 70000, 8, 64))
    fused.check(Problem(300, 300, 8, 64))
    with pytest.raises(UnsupportedProblem, match="batch\\*heads = 90000"):
        folded.check(Problem(300, 300, 8, 64))
    with pytest.raises(UnsupportedProblem, match="sm_90.*sm_80"):
        get_kernel("k4").caps.check_device((8, 0))
    get_kernel("k4").caps.check_device((9, 0))
    get_kernel("k2").caps.check_device((8, 0))


def _qkv(shape=(1, 2, 16, 64), dtype=torch.bfloat16):
    return [torch.randn(shape, dtype=dtype) for _ in range(3)]


def test_tensor_validation_messages():
    q, k, v = _qkv()
    with pytest.raises(UnsupportedProblem, match="4-D"):
        problem_from_tensors(q[0], k, v, False)
    with pytest.raises(UnsupportedProblem, match="contiguous last dim"):
        problem_from_tensors(*(t.transpose(2, 3) for t in (q, k, v)), False)
    with pytest.raises(UnsupportedProblem, match="multiples of 8"):
        problem_from_tensors(torch.randn(1, 2, 16, 68, dtype=torch.bfloat16)[..., :64], k, v, False)
    with pytest.raises(UnsupportedProblem, match="share a dtype"):
        problem_from_tensors(q, k.half(), v, False)
    with pytest.raises(UnsupportedProblem, match="bfloat16, float16 or float8_e4m3fn"):
        problem_from_tensors(*(t.float() for t in (q, k, v)), False)
    with pytest.raises(UnsupportedProblem, match="k and v must have one shape"):
        problem_from_tensors(q, k, _qkv((1, 2, 32, 64))[0], False)
    # Nothing above needs a GPU; the device is checked after, by attention (tests/test_api.py).
    assert problem_from_tensors(q.detach(), k, v, False) == Problem(1, 2, 16, 64)


def test_k1_refuses_s_that_does_not_fit():
    p = Problem(1, 32, 16384, 64)
    assert s_bytes(p) == 32 * 16384**2 * 4
    with pytest.raises(UnsupportedProblem, match="materializes S"):
        check_s_fits(p, free_bytes=16 * 2**30)
    check_s_fits(p, free_bytes=80 * 2**30)


def test_registry_lists_kernels_in_order_and_names_unknown():
    names = kernel_names()
    assert names == ["k1", "k2", "k3_1", "k3_2", "k3_3", "k4_qk", "k4_seed", "k4", "k5", "k6_pp", "k6_overlap", "k6", "k7_k4", "k7", "k8",
                     "decode_nosplit", "decode_combine", "decode"]
    with pytest.raises(UnsupportedProblem, match="unknown kernel 'k9'"):
        get_kernel("k9")


def test_attention_refuses_before_launch_on_cpu():
    from harness import attention

    with pytest.raises(UnsupportedProblem, match="CUDA tensor"):
        attention("k1", *_qkv(), causal=True)


def test_replace_block_and_table():
    doc = "a\n<!-- table:x -->\nold\n<!-- /table:x -->\nb"
    table = markdown_table(["k", "v"], [["k1", 1.5]])
    out = replace_block(doc, "x", table)
    assert "old" not in out and "| k1 | 1.5 |" in out and out.startswith("a\n") and out.endswith("\nb")
    with pytest.raises(KeyError):
        replace_block(doc, "y", table)


def test_bench_without_gpu_points_to_compile_only(capsys):
    import bench

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main(["k1"]) == 2
    assert "--compile-only" in capsys.readouterr().err


def test_k3_refuses_head_dims_whose_stages_do_not_fit():
    assert 256 in get_kernel("k3_1").caps.head_dims
    with pytest.raises(UnsupportedProblem, match="368 KB of SMEM"):
        get_kernel("k3_3").compile(Problem(1, 1, 64, 256))


def test_sass_loops_finds_the_kv_tile_loop_only():
    # scripts/sass_loops.py: of the backward branches, the innermost one holding one KV tile's
    # WGMMAs (d/16 + tile_n/16) and exponentials (tile_n/2); spin-waits and the enclosing
    # query-tile loop are not tile loops.
    sass_loops = load_script("sass_loops")

    lines, addr = [], 0

    def emit(text):
        nonlocal addr
        lines.append(f"        /*{addr:04x}*/                   {text} ;")
        addr += 0x10
        return addr - 0x10

    outer = emit("S2R R0, SR_TID.X")
    inner = emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R9+URZ+0x20], R0")
    emit("@!P0 BRA " + hex(inner))  # spin-wait: a short backward branch
    for _ in range((128 + 128) // 16):
        emit("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24")
    for _ in range(64):
        emit("MUFU.EX2 R5, R5")
        emit("FFMA R5, R5, R6, -R7")
    emit("@P0 BRA " + hex(inner))
    emit("STG.E [R2], R4")
    emit("@P1 BRA " + hex(outer))
    loops = sass_loops.tile_loops("\n".join(lines), 128, 128)
    assert [(start, ops["HGMMA"], ops["MUFU"], first) for start, _, ops, first in loops] == [(inner, 16, 64, None)]
    assert sass_loops.tile_loops("\n".join(lines), 64, 128) == []  # wrong WGMMA count for d=64


def test_sass_loops_counts_the_exponentials_before_the_pv_wait():
    # With the overlap (a wait_group 1 in the loop), how many MUFU.EX2 precede wait_group 0;
    # without it (wait_group 0 only: that is QK's wait) there is no such count.
    sass_loops = load_script("sass_loops")
    body = ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "MUFU.EX2 R1, R1", "MUFU.EX2 R2, R2",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R3, R3"]
    assert sass_loops.exps_before_pv_wait(body) == 2
    assert sass_loops.exps_before_pv_wait(body[1:]) is None
    assert sass_loops.exps_before_pv_wait([b for b in body if "DEPBAR" not in b]) is None


def test_gpu_state_summary_and_reasons():
    from harness.gpu_state import reasons, summarize
    from harness.timing import gpu_fields

    assert reasons(0x4 | 0x20) == ["power_cap", "sw_thermal"] and reasons(0x1) == []  # 0x1: idle, not a limit
    s = summarize([(1500, 690.5, 60, 0x4), (1400, 699.1, 62, 0x0), (1980, 120.0, 40, 0x0)])
    assert s == dict(sm_clock_mhz=1500, power_w=690.5, temp_c=62, clock_limited_by=["power_cap"], samples=3)
    assert summarize([]) is None
    # a row over rounds: median clock, hottest round, every reason; rounds NVML missed are left out
    row = gpu_fields([{}, s, dict(s, sm_clock_mhz=1300, temp_c=65, clock_limited_by=["hw_thermal"])])
    assert row["sm_clock_mhz"] == 1400 and row["temp_c"] == 65 and row["sm_clock_rounds"] == [1500, 1300]
    assert row["clock_limited_by"] == ["hw_thermal", "power_cap"]
    assert gpu_fields([{}, {}]) == {}


def test_gpu_state_window_keeps_the_samples_inside_the_timing():
    import threading

    from harness.gpu_state import Sampler

    sampler = object.__new__(Sampler)  # no NVML here: the window logic alone
    sampler.lock = threading.Lock()
    sampler.samples = [(t, 1000 + t, 100.0, 40 + t, 0x4 if t == 2 else 0) for t in range(6)]
    assert sampler.window(1.5, 3.5) == dict(sm_clock_mhz=1002.5, power_w=100.0, temp_c=43,
                                            clock_limited_by=["power_cap"], samples=2)
    assert sampler.window(7, 8) is None


def test_host_rows_ratio_is_round_by_round_and_the_order_alternates(monkeypatch):
    from harness import timing

    # The host slows down 3x in the second round: medians of each call would move, the ratio not.
    seen, speed = [], {"a": 10.0, "sdpa": 5.0}
    slow = iter([1, 1, 3, 3, 1, 1])
    monkeypatch.setattr(timing, "host_us", lambda call: (seen.append(call()), speed[seen[-1]] * next(slow))[1])
    monkeypatch.setattr(timing, "call_us", lambda call: 1.0)
    rows = []
    timing.host_rows({"a": lambda: "a", "sdpa": lambda: "sdpa"}, {}, rows.append, rounds=3, baseline="sdpa")
    assert seen == ["a", "sdpa", "sdpa", "a", "a", "sdpa"]  # the timed bursts (the warm-up calls each directly)
    a = next(r for r in rows if r["kernel"] == "a")
    assert a["host_rounds"] == [10.0, 30.0, 10.0] and a["vs_baseline"] == 2.0 and a["baseline"] == "sdpa"


def test_every_stage_config_is_frozen_and_keeps_defaults_for_none():
    from kernels import decode, k4, k5, k6, k7, k9
    from kernels.contract import Config, Problem

    p = Problem(2, 4, 1000, 128, causal=True)
    for cfg in (k4.config(p, dict(tile_n=None)), k5.config(p, dict(tile_n=None)), k6.config(p, dict.fromkeys(
            ("num_wg", "tile_n", "overlap", "pingpong", "tma_store", "o_store_per_wg", "cluster", "scheduler",
             "split_tail", "ctas"))), k7.config(p, dict(tile_n=None)), k9.config(p), decode.config(128)):
        key = "num_wg" if "num_wg" in cfg else "tile_n"  # decode's tiles are one warpgroup
        assert isinstance(cfg, Config) and cfg[key] > 1  # None kept the default
        with pytest.raises(AttributeError, match="frozen"):
            cfg.knob = 1
        with pytest.raises(TypeError):
            cfg[key] = 1
        changed = cfg.with_(**{key: 1})
        assert changed[key] == 1 and cfg[key] != 1 and dict(changed, **{key: cfg[key]}) == cfg
    assert k4.config(p, dict(tile_n=96))["tile_n"] == 96 and k4.config(p) == k4.DEFAULT_CONFIG[128]


def test_fp8_lse_bar_grows_with_the_softmax_scale_times_the_head_dim():
    from harness.check import FP8_LSE_ATOL, fp8_lse_bar

    assert fp8_lse_bar(Problem(1, 1, 64, 64)) == FP8_LSE_ATOL  # d = 64 at 1/sqrt(d): the bar as measured
    assert fp8_lse_bar(Problem(1, 1, 64, 128, softmax_scale=0.01)) == FP8_LSE_ATOL  # never below it
    assert fp8_lse_bar(Problem(1, 1, 64, 128, softmax_scale=0.3)) == pytest.approx(FP8_LSE_ATOL * 0.3 * 128 / 8)
    # 2.0e-2 drifted at d = 256, scale 0.3 (H200): inside, with room; ten times that is not
    assert 2.0e-2 < fp8_lse_bar(Problem(1, 1, 64, 256, softmax_scale=0.3)) < 0.2
