"""Real launches against SDPA, also under torch.compile and CUDA-graph replay. Marked ``gpu``;
skipped where no CUDA GPU is visible.

On the GPU machine: ``python -m pytest -m gpu -q``. The full grid is ``python ref_check.py all``.
"""

import pytest
import torch

from harness import attention
from harness.check import check_kernel, compare, is_fp8_kernel
from harness.reference import reference
from kernels import get_kernel, kernel_names
from kernels.contract import Problem, UnsupportedProblem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", kernel_names())
@pytest.mark.parametrize("seqlen,causal", [(17, True), (1000, False), (1000, True)])
def test_kernel_matches_sdpa(name, seqlen, causal):
    d = 128 if 128 in get_kernel(name).caps.head_dims else get_kernel(name).caps.head_dims[0]
    res = check_kernel(name, Problem(2, 3, seqlen, d, causal=causal))
    assert res.ok, res.reason


@pytest.mark.parametrize("name", kernel_names())
def test_public_call_with_lse_and_strided_heads(name):
    # (batch, seqlen, heads, d) storage viewed as SDPA layout: non-contiguous heads, contiguous d.
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    out, lse = attention(name, q, k, v, causal=True, softmax_scale=0.2, return_lse=True)
    if _fp8(name):  # its error is checked against an emulation (check_fp8_kernel); here: layout-blind
        want = attention(name, *(t.contiguous() for t in (q, k, v)), causal=True, softmax_scale=0.2, return_lse=True)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        return
    ref, ref_lse = reference(q, k, v, True, 0.2)
    assert compare(out, ref, lse, ref_lse, "bfloat16").verdict == ""


def _fp8(name):
    """FP8 stages are held to their own criterion (harness.check.check_fp8_kernel), not bf16's."""
    return is_fp8_kernel(name)


def test_unsupported_head_dim_is_refused_before_launch():
    q = torch.randn(1, 1, 64, 40, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(UnsupportedProblem, match="head_dim 40"):
        attention("k2", q, q, q)


def _inputs(name):
    caps = get_kernel(name).caps
    d = 128 if 128 in caps.head_dims else caps.head_dims[0]
    return [torch.randn(2, 4, 300, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


@pytest.mark.parametrize("name", kernel_names())
def test_torch_compile_fullgraph_matches_eager(name):
    q, k, v = _inputs(name)

    def model(q, k, v):
        out, lse = attention(name, q, k, v, causal=True, softmax_scale=0.1, return_lse=True)
        return out * 2, lse

    eager = model(q, k, v)  # also JIT-compiles the kernel, outside the compiled region
    # One code object per kernel name: without a reset, Dynamo's recompile limit (8) would trip
    # once more kernels than that are registered.
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)(q, k, v)  # fullgraph: a graph break is an error
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)  # the same kernel on the same inputs


@pytest.mark.parametrize("name", kernel_names())
def test_cuda_graph_capture_and_replay_match_sdpa(name):
    q, k, v = _inputs(name)
    # Warm-up outside capture: the first call JIT-compiles the kernel (and allocates K1's S),
    # neither of which may happen while a graph is being captured.
    attention(name, q, k, v, causal=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention(name, q, k, v, causal=True, return_lse=True)
    for _ in range(2):  # replay on fresh inputs copied into the captured ones
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if _fp8(name):  # the replay must equal an eager call on the new inputs, bit for bit
            want = attention(name, q, k, v, causal=True, return_lse=True)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
            continue
        ref, ref_lse = reference(q, k, v, True, q.shape[-1] ** -0.5)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        c = compare(out, ref, lse, ref_lse, "bfloat16", sdpa)
        assert c.verdict == "", c.verdict


@pytest.mark.parametrize("cfg", [dict(emulated_exp2=8), dict(skip_unit_rescale=True), dict(rescale_o_before_gemm=True),
                                 dict(pin_pv_wait="after_softmax"), dict(pin_pv_wait="before_exp2"),
                                 dict(o_store_per_wg=False, tma_store=True), dict(o_store_per_wg=True, tma_store=True),
                                 dict(q_in_regs=True)],
                         ids=["emulated_exp2", "skip_unit_rescale", "rescale_before_gemm", "pin_after_softmax",
                              "pin_before_exp2", "o_store_whole_tile", "o_store_per_wg", "q_in_regs"])
@pytest.mark.parametrize("d,seqlen,causal", [(64, 1000, False), (128, 4097, True), (256, 1000, False)])
def test_k6_knobs_left_off_still_match_sdpa(cfg, d, seqlen, causal):
    # K6's measured-and-left knobs (docs/k6.md) must stay correct: emulated_exp2=8 sends every
    # score of an unmasked tile through the cubic.
    if "pin_pv_wait" in cfg and d == 64:
        pytest.skip("d=64 runs without the overlap, whose PV wait pin_pv_wait pins (refused there)")
    if "q_in_regs" in cfg and d == 256:
        pytest.skip("Q in registers does not fit beside O at d=256 (refused there)")
    p = Problem(2, 3, seqlen, d, causal=causal)
    verdict = _run_against_sdpa("k6", get_kernel("k6").compile(p, **cfg), p)
    assert not verdict, verdict


def _run_against_sdpa(name, compiled, p):
    """One launch of ``compiled`` on fresh inputs and poisoned outputs; the verdict against SDPA."""
    from harness.inputs import poisoned_outputs, random_inputs
    from harness.reference import sdpa

    q, k, v = random_inputs(p)
    out, lse = poisoned_outputs(p)
    get_kernel(name).run(compiled, q, k, v, out, lse)
    ref, ref_lse = reference(q, k, v, p.causal, p.scale)
    return compare(out, ref, lse, ref_lse, p.dtype, sdpa(q, k, v, p.causal, p.scale)).verdict


@pytest.mark.parametrize("d,seqlen,dtype,overlap", [(128, 4097, "bfloat16", True), (128, 1000, "float16", False),
                                                    (64, 1000, "bfloat16", False), (256, 4097, "bfloat16", True),
                                                    (128, 17, "bfloat16", True), (128, 1, "bfloat16", False),
                                                    (128, 300, "bfloat16", False)])
@pytest.mark.parametrize("ctas", [5, 7, 16])
def test_k6_split_tail_matches_sdpa_and_leaves_counters_at_zero(d, seqlen, dtype, overlap, ctas):
    # A few CTAs on a small problem: whole waves, then the leftover tiles cut into runs of KV
    # tiles, their partial O merged by the last warp (schedule.tail_runs); 300 keys on 16 CTAs
    # leave fewer KV steps in the tail than CTAs. Three launches on one counter buffer: the merging
    # warps must leave every counter at 0 for the next.
    from kernels import schedule

    p = Problem(2, 3, seqlen, d, dtype=dtype)
    compiled = get_kernel("k6").compile(p, split_tail=True, ctas=ctas, overlap=overlap)
    tile_m, tile_n = 64 * compiled.info["num_wg"], compiled.info["tile_n"]
    num_tiles = 6 * -(-seqlen // tile_m)
    runs = schedule.tail_runs(num_tiles, min(num_tiles, ctas), -(-seqlen // tile_n))
    for _ in range(3):
        verdict = _run_against_sdpa("k6", compiled, p)
        assert not verdict, verdict
    (counters,) = compiled.buffers["counters"]._pairs.values()  # the one buffer the launches used
    assert int(counters[:compiled.buffers["zeroed_ints"]].abs().sum()) == 0
    if num_tiles % min(num_tiles, ctas) and seqlen > tile_n:  # a partial last wave: there is a tail
        assert any(len(r) == 2 or (r and r[0][1:] != (0, -(-seqlen // tile_n))) for r in runs)  # pieces exist


@pytest.mark.parametrize("seqlen,seqlen_k,dtype,nheads_kv", [(16385, None, "bfloat16", None), (300, 20001, "float16", 1)])
def test_k6_long_sequence_tiles_match_sdpa(seqlen, seqlen_k, dtype, nheads_kv):
    # d=64 non-causal from 16k keys runs 176-key tiles by default; neither length is a multiple of
    # 176, so the last KV tile is a partial one (masked past the keys).
    p = Problem(1, 2, seqlen, 64, dtype=dtype, seqlen_k=seqlen_k, nheads_kv=nheads_kv)
    compiled = get_kernel("k6").compile(p)
    assert compiled.info["tile_n"] == 176
    verdict = _run_against_sdpa("k6", compiled, p)
    assert not verdict, verdict


@pytest.mark.parametrize("d,seqlen,seqlen_k,dtype,nheads_kv", [
    (128, 4097, None, "bfloat16", None),  # 33 query tiles per head: the last pair's second lies past the sequence
    (128, 1000, None, "float16", None),
    (128, 17, None, "bfloat16", None),
    (256, 4097, None, "bfloat16", None),
    (256, 300, None, "float16", None),
    (128, 300, 1000, "bfloat16", 1),  # GQA, more keys than queries
])
@pytest.mark.parametrize("cluster,ctas", [(2, 6), (2, None), (4, 8), (4, None)])
def test_k6_cluster_matches_sdpa(d, seqlen, seqlen_k, dtype, nheads_kv, cluster, ctas):
    # Two (four) CTAs per cluster share each K/V tile (multicast); 6 (8) CTAs make each cluster
    # walk several groups of query tiles. Three launches: a stage released by the wrong count
    # would hang or mix tiles by the second.
    p = Problem(2, 3, seqlen, d, dtype=dtype, seqlen_k=seqlen_k, nheads_kv=nheads_kv)
    compiled = get_kernel("k6").compile(p, cluster=cluster, ctas=ctas)
    assert compiled.info["cluster"] == cluster
    for _ in range(3):
        verdict = _run_against_sdpa("k6", compiled, p)
        assert not verdict, verdict


def test_timing_records_the_gpu_state():
    from harness.timing import benchmark

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    state = {}
    ms = benchmark(lambda: a @ a, state=state, rep_ms=200)
    assert ms > 0
    assert state["samples"] >= 3, state  # a 200 ms window at 20 ms a sample
    assert 200 <= state["sm_clock_mhz"] <= 3000 and 10 <= state["power_w"] <= 2000 and 0 < state["temp_c"] < 120
    assert set(state["clock_limited_by"]) <= {"power_cap", "hw_slowdown", "sw_thermal", "hw_thermal",
                                              "hw_power_brake"}
