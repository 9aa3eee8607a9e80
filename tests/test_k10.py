"""K10, K9 warp-specialized: its PTX holds what the stage claims (CPU); its gradients
match float64 autograd as K9's must (GPU)."""

import re

import pytest
import torch

from harness.inspect_ptx import count_instructions, without_kernel_names
from kernels.contract import Problem, compiled_ptx


@pytest.mark.parametrize("d", [64, 128])
def test_k10_adds_dq_by_tma_reduce_from_a_warp_specialized_kernel(d):
    from kernels.k10 import compile_backward

    main = compile_backward(Problem(2, 4, 1000, d, causal=True), keep_ptx=True)[1]
    ptx = compiled_ptx(main)
    counts = count_instructions(ptx)
    assert counts["wgmma.mma_async"] == 2 * (d // 16) + 2 * 4 + 8 and counts["setmaxnreg"] == 2
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)  # the producer warpgroup
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)  # the MMA warpgroups
    # the reduce's element type is the tensor map's (fp32: the dQ accumulator), not a PTX suffix
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor[.a-z0-9:]*\.add", ptx)
    assert not re.search(r"\b(?:red|atom)\.global", ptx)  # no dQ atomics left
    barriers = set(re.findall(r"bar\.(sync|arrive)\s+(\d+), (\d+)", ptx))
    assert {("arrive", "2", "288"), ("sync", "2", "288"), ("arrive", "3", "288"), ("sync", "3", "288")} <= barriers


@pytest.mark.parametrize("causal", [False, True])
def test_ds_free_once_takes_the_sds_wait_off_the_steps(causal):
    from kernels.contract import UnsupportedProblem
    from kernels.k10 import compile_backward

    fa3 = dict(overlap=True, dq_flat=True, ds_stmatrix=True, mask_edges=True)
    p = Problem(2, 4, 1000, 128, causal=causal)
    syncs = [len(re.findall(r"bar\.sync\s+1, 256;", compiled_ptx(compile_backward(p, keep_ptx=True, **fa3,
                                                                                       ds_free_once=once)[1])))
             for once in (False, True)]
    # one per copy of the step (edge and not) gone, one before step 1 added
    assert syncs[1] == syncs[0] - 1 and syncs[1] > 0, syncs
    with pytest.raises(UnsupportedProblem, match="ds_free_once"):
        compile_backward(p.with_(head_dim=256), ds_free_once=True)


def test_dq_swapab_lets_a_step_take_80_queries_at_d128():
    # FA3's dQ_swapAB: dQ^T = K^T . dS^T, so dQ's M is d (64 rows a warpgroup) and the step's
    # queries only need to be a multiple of 16 (FA3 takes 80 at d = 128, non-causal)
    from kernels.contract import UnsupportedProblem
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 128)
    compiled = compile_backward(p, keep_ptx=True, overlap=True, ds_stmatrix=True, dq_swapab=True, tile_m=80)
    ptx = compiled_ptx(compiled[1])
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)
    # S^T, dP^T: n80 over d (2 x 8); dV, dK: n128 over 80 queries (2 x 5); dQ^T: n80 over 128 keys (8)
    assert len(shapes) == 2 * 8 + 2 * 5 + 8 and set(shapes) == {"m64n80k16", "m64n128k16"}
    assert count_instructions(ptx)["ld/st.local"] <= 4
    with pytest.raises(UnsupportedProblem, match="dq_swapab splits d over the warpgroups"):
        compile_backward(p.with_(head_dim=64), dq_swapab=True, tile_m=80)
    with pytest.raises(UnsupportedProblem, match="tile_m must be a multiple of 64"):
        compile_backward(p, tile_m=80)


@pytest.mark.parametrize("d", [64, 128])
def test_ptxas_keeps_the_default_steps_wgmmas_in_flight(d):
    # ptxas serializes WGMMAs (each waits for the one before, its C7512) when the accumulators do
    # not fit the registers; the default must not come near that
    from harness.backward import stage_overrides
    from harness.inspect_ptx import wgmma_serialized
    from kernels.k10 import compile_backward

    for causal in (False, True):
        ptx = compiled_ptx(compile_backward(Problem(2, 4, 1000, d, causal=causal), keep_ptx=True,
                                            **stage_overrides("k10_fa3"))[1])
        serialized = wgmma_serialized(ptx)
        if serialized is None:
            pytest.skip("no ptxas on PATH")
        assert not serialized, (d, causal)


def test_dq_swapab_takes_the_flat_dq_shares_and_early_dq_at_80_queries():
    # flash-attn-4's d = 128 non-causal tile, on k10_fa3's step: dQ^T's shares go out in its own
    # register order (flat) and the post-pass reads them back with the same swapped tiled MMA
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 128, causal=True)
    compiled = compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"), tile_m=80, dq_swapab=True))
    cfg = compiled[3]
    assert cfg["tile_m"] == 80 and cfg["dq_swapab"] and cfg["dq_flat"] and cfg["early_dq"]
    ptx = compiled_ptx(compiled[1])
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)
    # per copy of the step (mask_edges: two): S^T, dP^T and dQ^T n80 (3 x 8), dV and dK n128 over 80 queries (2 x 5)
    assert shapes.count("m64n80k16") == 2 * 3 * 8 and shapes.count("m64n128k16") == 2 * 2 * 5
    # each warpgroup's flat half: 64 rows of d x 80 queries = 20 rows of 256 floats, a reduce-add each
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)) == 2
    post = compiled_ptx(compiled[2])  # 80 x 128 floats over 256 threads, 16 bytes a load
    assert len(re.findall(r"ld\.global\.v4\.[fb]32", post)) == 80 * 128 // 256 // 4
    # 80 queries hold 248 floats of accumulators a thread: the overlapped start (S^T and dP^T both in
    # flight) makes ptxas serialize the WGMMAs; the sequential one with pinned descriptors does not
    from harness.inspect_ptx import wgmma_serialized

    lean = dict(stage_overrides("k10_fa3"), tile_m=80, dq_swapab=True, overlap=False, pin_descriptors=True,
                unguarded_rows=True)
    verdicts = (wgmma_serialized(ptx), wgmma_serialized(compiled_ptx(compile_backward(p, keep_ptx=True, **lean)[1])))
    if None in verdicts:
        pytest.skip("no ptxas on PATH")
    assert verdicts == (True, False)


@pytest.mark.parametrize("causal", [False, True])
def test_mask_edges_gives_steps_off_every_edge_a_copy_without_masks_or_guards(causal):
    from kernels.k10 import compile_backward

    fa3 = dict(overlap=True, dq_flat=True, ds_stmatrix=True)
    plain, edges = (compiled_ptx(compile_backward(Problem(2, 4, 1000, 128, causal=causal), keep_ptx=True,
                                                  mask_edges=m, **fa3)[1]) for m in (False, True))
    count = lambda ptx, pattern: len(re.findall(pattern, ptx))  # noqa: E731
    # two copies of the step, the second with no causal compare or select and LSE2/D read in pairs, unguarded
    assert count(edges, r"wgmma\.mma_async") == 2 * count(plain, r"wgmma\.mma_async")
    assert count(edges, r"ex2\.approx") == 2 * count(plain, r"ex2\.approx")
    assert count(edges, r"selp\.") == count(plain, r"selp\.") and count(edges, r"setp\.gt\.s32") == count(plain, r"setp\.gt\.s32")
    assert count(plain, r"ld\.shared\.v2") == 0 < count(edges, r"ld\.shared\.v2")


@pytest.mark.parametrize("causal", [False, True])
def test_k10_at_d256_splits_the_head_dim_over_the_warpgroups_with_p_and_ds_from_smem(causal):
    from kernels import k9
    from kernels.contract import UnsupportedProblem
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 256, causal=causal)
    compiled = compile_backward(p, keep_ptx=True, overlap=True, dq_flat=True, ds_stmatrix=True)
    ptx = compiled_ptx(compiled[1])
    counts = count_instructions(ptx)
    # a warpgroup's step: S^T and dP^T of its 32 queries over d (2 x 16), dV and dK of its 128
    # columns over the tile's 64 queries (2 x 4), dQ's 128 columns over the 64 keys (4)
    assert counts["wgmma.mma_async"] == 2 * 16 + 2 * 4 + 4 and counts["ld/st.local"] == 0
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)) == {"m64n32k16", "m64n128k16"}
    # every A operand from SMEM (a descriptor after the accumulators), none from registers as at d = 128
    assert not re.search(r"wgmma\.mma_async[^;]*\}\s*,\s*\{", ptx)
    assert re.search(r"wgmma\.mma_async[^;]*\}\s*,\s*\{", compiled_ptx(compile_backward(p.with_(head_dim=128),
                                                                                   keep_ptx=True)[1]))
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor[.a-z0-9:]*\.add", ptx)
    assert compiled[3]["q_stages"] == 1 and not compiled[3]["overlap"]  # its own step; one Q/dO stage fits
    with pytest.raises(UnsupportedProblem, match="head_dim 256"):
        k9.check(p)  # K9 keeps its two head dims
    with pytest.raises(UnsupportedProblem, match="one Q/dO stage"):
        compile_backward(p, q_stages=2)


@pytest.mark.parametrize("causal", [False, True])
def test_k10s_deterministic_mode_takes_turns_on_a_semaphore_per_query_tile(causal):
    from kernels.k10 import compile_backward

    plain = compiled_ptx(compile_backward(Problem(2, 4, 1000, 128, causal=causal), keep_ptx=True)[1])
    ptx = compiled_ptx(compile_backward(Problem(2, 4, 1000, 128, causal=causal), keep_ptx=True, deterministic=True)[1])
    # the dQ writer's lane 0 spins on an acquire load for its turn, and passes it on with a release add
    assert "ld.acquire.gpu" in ptx and re.search(r"red\.release\.gpu(\.global)?\.add\.[su]32", ptx)
    assert "ld.acquire.gpu" not in plain and "red.release.gpu" not in plain


def test_the_deterministic_order_is_last_key_tile_first_only_where_it_cannot_deadlock():
    from kernels.contract import num_sms
    from kernels.k10 import compile_backward

    def order(causal, kv_len, deterministic=True):
        p = Problem(1, 4, 1000, 128, causal=causal, seqlen_k=kv_len)
        return compile_backward(p, deterministic=deterministic)[3]["last_first"]

    # causal shares arrive last key tile first; that order waits on CTAs launched later, so only
    # while one (batch, head)'s key tiles all fit on the GPU (128 keys a tile at d = 128)
    assert order(True, 1000) and order(True, 128 * num_sms())
    assert not order(True, 128 * num_sms() + 1) and not order(False, 1000) and not order(True, 1000, False)


def test_the_overlapped_step_waits_for_s_alone_before_p():
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 64, causal=True)
    waits = [re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", compiled_ptx(compile_backward(p, keep_ptx=True, **kw)[1]))
             for kw in ({}, dict(overlap=True))]
    # K9's order waits for everything three times a step; the overlapped one lets dP run on once
    assert waits[0] == ["0"] * 3 and sorted(waits[1]) == ["0", "0", "1"]


@pytest.mark.parametrize("causal", [False, True])
def test_early_dq_hands_each_warpgroups_half_over_on_its_own_barriers(causal):
    from kernels.k10 import compile_backward

    fa3 = dict(overlap=True, dq_flat=True, ds_stmatrix=True, mask_edges=True)
    p = Problem(2, 4, 1000, 128, causal=causal)
    before, early = (compiled_ptx(compile_backward(p, keep_ptx=True, **fa3, early_dq=e)[1]) for e in (False, True))
    count = lambda pattern, ptx: len(re.findall(pattern, ptx))  # noqa: E731
    # the writer: a barrier pair per warpgroup (its 128 threads and the writer's 32), a reduce-add per half
    writer = set(re.findall(r"bar\.(sync|arrive)\s+(\d+), 160;", early))
    assert writer == {("sync", "2"), ("arrive", "3"), ("sync", "4"), ("arrive", "5")}, writer
    assert count(r"bar\.\w+\s+\d+, 288;", early) == 0 < count(r"bar\.\w+\s+\d+, 288;", before)
    reduces = r"cp\.reduce\.async\.bulk\.tensor"
    assert count(reduces, early) == 2 * count(reduces, before) == 2
    # sdS a tile per stage: no wait for it to be free, one MMA barrier a copy of the step (every dS^T stored)
    assert count(r"bar\.sync\s+1, 256;", early) == count(r"bar\.sync\s+1, 256;", before) // 2 == 2
    # dQ's GEMM (n64 over d / 2, 8 k-blocks of 16 keys) before dK's, waited for alone: wait_group 1 after dK's
    assert count(r"wgmma\.wait_group\.sync\.aligned\s+1;", early) > count(r"wgmma\.wait_group\.sync\.aligned\s+1;",
                                                                           before)


def test_early_dq_and_dq_split_queries_refuse_what_they_cannot_run():
    from kernels.contract import UnsupportedProblem
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 64)
    with pytest.raises(UnsupportedProblem, match="early_dq hands over flat dQ shares"):
        compile_backward(p, early_dq=True)
    with pytest.raises(UnsupportedProblem, match="early_dq keeps a dS tile per Q/dO stage"):
        compile_backward(p, dq_flat=True, early_dq=True, q_stages=1)
    with pytest.raises(UnsupportedProblem, match="dq_split_queries gives each warpgroup 64"):
        compile_backward(p, dq_split_queries=True)  # 64 queries a step for two warpgroups
    # d = 256 has its own step: both knobs are dropped there, as overlap is
    cfg = compile_backward(p.with_(head_dim=256), dq_flat=True, overlap=True, early_dq=True)[3]
    assert not cfg.get("early_dq") and not cfg.get("overlap")


def test_the_default_backward_takes_flash_attn_4s_128_query_tile_at_d64_only():
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward, config

    overrides = stage_overrides("k10_fa3")
    cfg64, cfg128 = (config(Problem(2, 4, 1000, d), overrides) for d in (64, 128))
    assert cfg64["tile_m"] == 128 and cfg64.get("dq_split_queries") and cfg64.get("early_dq")
    assert cfg128["tile_m"] == 64 and not cfg128.get("dq_split_queries") and cfg128.get("early_dq")
    # and, at d = 64 only, no guard on rows past the sequence (results/ab-k10-edge-d64-h100.json)
    assert cfg64.get("unguarded_rows") and cfg64.get("pin_descriptors") and not cfg128.get("unguarded_rows")
    compiled = compile_backward(Problem(2, 4, 1000, 64, causal=True), keep_ptx=True, **overrides)
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", compiled_ptx(compiled[1]))
    # per copy of the step: S^T, dP^T n128 over d = 64 (2 x 4); dV, dK n64 over 128 queries (2 x 8);
    # dQ with the warpgroups side by side over the queries: n64 over 128 keys (8), no n32
    assert len(shapes) == 2 * (2 * 4 + 2 * 8 + 8) and set(shapes) == {"m64n128k16", "m64n64k16"}
    post = compiled_ptx(compiled[2])  # the post-pass reads the same register order: 128 x 64 / 256 floats
    assert len(re.findall(r"ld\.global\.v4\.[fb]32", post)) == 128 * 64 // 256 // 4


def test_step_counter_and_plain_first_change_how_the_step_is_found_and_laid_out_not_what_it_does():
    import collections

    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 128, causal=True)
    base = dict(stage_overrides("k10_fa3"), step_counter=False, plain_first=False)
    ptx = {name: compiled_ptx(compile_backward(p, keep_ptx=True, **dict(base, **extra))[1])
           for name, extra in (("base", {}), ("counter", dict(step_counter=True)), ("plain", dict(plain_first=True)))}
    ops = {name: collections.Counter(re.findall(r"^\s+(?:@!?%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", x, re.M))
           for name, x in ptx.items()}
    # step_at divides the step index by the walk's length in each of the three loops; the counter does not
    assert ops["base"]["rem.s32"] >= 2 and ops["counter"]["rem.s32"] == 0
    assert ops["counter"]["div.s32"] < ops["base"]["div.s32"]
    # plain_first only swaps the two copies of the step: the same instructions in another order, but
    # for the edge test's predicates (negated: its compares and and/or flip)
    same = lambda c: {k: v for k, v in c.items() if not k.startswith("setp") and not k.endswith(".pred")}  # noqa: E731
    assert same(ops["plain"]) == same(ops["base"]) and ptx["plain"] != ptx["base"]


@pytest.mark.parametrize("d", [64, 128])
def test_dkv_tma_store_sends_dk_and_dv_through_smem_by_tma_not_by_4_byte_stores(d):
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, d, causal=True, seqlen_k=3000, nheads_kv=2)
    rows, tma = (compiled_ptx(compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"),
                                                                         dkv_tma_store=on))[1]) for on in (False, True))
    count = lambda pattern, ptx: len(re.findall(pattern, ptx))  # noqa: E731
    bulk_store = r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"
    assert count(r"st\.global", rows) > 0 == count(bulk_store, rows)
    assert count(r"st\.global", tma) == 0 < count(bulk_store, tma)
    # dK and dV of 128 keys x d over 256 MMA threads, 8 elements a thread per stmatrix.x4
    assert count(r"stmatrix", tma) - count(r"stmatrix", rows) == 2 * 128 * d // 256 // 8
    for q in (p.with_(varlen=True), p.with_(head_dim=256)):  # packed boxes would cross sequences; d = 256 its own
        assert not compile_backward(q, **dict(stage_overrides("k10_fa3"), dkv_tma_store=True))[3].get("dkv_tma_store")


def test_select_rows_reads_the_edge_steps_lse2_and_d_unguarded_then_selects():
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 128, causal=True)
    guarded, selected = (compiled_ptx(compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"),
                                                                                 select_rows=on))[1])
                         for on in (False, True))
    count = lambda pattern, ptx: len(re.findall(pattern, ptx))  # noqa: E731
    # the edge copy's reads, LSE2 in P's pass and D in dS's, one a column of the thread's 16 (64
    # queries over 4 threads of a quad row): a branch around each read before, a select after it now
    columns = 64 // 4
    assert count(r"\bbra", guarded) - count(r"\bbra", selected) == 2 * columns
    assert count(r"selp\.(?:f32|b32)", selected) - count(r"selp\.(?:f32|b32)", guarded) == 2 * columns


def test_unguarded_rows_leaves_the_rows_past_the_sequence_to_the_tmas_zeros():
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    count = lambda pattern, compiled: len(re.findall(pattern, compiled_ptx(compiled[1])))  # noqa: E731

    def builds(p):
        return tuple(compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"), unguarded_rows=on))
                     for on in (False, True))

    wgmma = r"wgmma\.mma_async"
    # non-causal, 1000 queries: the last query tile was an edge for its rows alone; now one copy of the step
    guarded, unguarded = builds(Problem(2, 4, 1000, 128))
    assert count(wgmma, unguarded) * 2 == count(wgmma, guarded)
    # causal: the edge copy (the diagonal) keeps its masks but reads LSE2 and D unguarded, 16 columns each
    guarded, unguarded = builds(Problem(2, 4, 1000, 128, causal=True))
    assert count(wgmma, unguarded) == count(wgmma, guarded)
    assert count(r"\bbra", guarded) - count(r"\bbra", unguarded) == 2 * 64 // 4
    # packed, a tile's rows past its sequence are the next sequence's: the knob is dropped
    guarded, unguarded = builds(Problem(2, 4, 1000, 128, causal=True, varlen=True, nheads_kv=2))
    assert not unguarded[3].get("unguarded_rows") and compiled_ptx(unguarded[1]) == compiled_ptx(guarded[1])


def test_pin_descriptors_builds_each_staged_operands_descriptor_once():
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 128, causal=True)
    pinned = lambda ptx: re.findall(r"// begin inline asm\s*\n\s*mov\.b64[^\n]*\n\s*// end inline asm", ptx)  # noqa: E731
    base, pin = (compiled_ptx(compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"),
                                                                        pin_descriptors=on))[1]) for on in (False, True))
    # Q and dO for S^T and dP^T, dO and Q again for dV and dK, and early_dq's staged dS for dQ
    assert len(pinned(base)) == 0 and len(pinned(pin)) == 5
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16"
    assert re.findall(wgmma, base) == re.findall(wgmma, pin)  # the same GEMMs


@pytest.mark.parametrize("d", [64, 128])
def test_dkv_tma_packed_stores_whole_key_tiles_by_tma_and_a_sequences_last_by_rows(d):
    from harness.backward import stage_overrides
    from kernels.contract import UnsupportedProblem
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, d, causal=True, nheads_kv=2, varlen=True)
    rows, both = (compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"), dkv_tma_packed=on))
                  for on in (False, True))
    assert not rows[3].get("dkv_tma_store") and both[3].get("dkv_tma_store") and both[3].get("dkv_tma_packed")
    count = lambda pattern, compiled: len(re.findall(pattern, compiled_ptx(compiled[1])))  # noqa: E731
    bulk_store = r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"
    # a runtime choice per CTA: the TMA stores beside the row stores, which stay for the partial tile
    assert count(bulk_store, rows) == 0 < count(bulk_store, both)
    assert count(r"st\.global", both) == count(r"st\.global", rows) > 0
    assert count(r"stmatrix", both) - count(r"stmatrix", rows) == 2 * 128 * d // 256 // 8
    # rectangular calls have the TMA stores already: the knob changes nothing there
    q = p.with_(varlen=False)
    assert compiled_ptx(compile_backward(q, keep_ptx=True, **dict(stage_overrides("k10_fa3"), dkv_tma_packed=True))[1]) \
        == compiled_ptx(compile_backward(q, keep_ptx=True, **stage_overrides("k10_fa3"))[1])
    with pytest.raises(UnsupportedProblem, match="dkv_tma_packed takes dkv_tma_store's TMA stores"):
        compile_backward(p, **dict(stage_overrides("k10_fa3"), dkv_tma_store=False, dkv_tma_packed=True))


@pytest.mark.parametrize("d", [64, 128])
def test_the_flat_dq_share_leaves_in_16_byte_stores(d):
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, d, causal=True)
    plain, flat = (compiled_ptx(compile_backward(p, keep_ptx=True, dq_flat=f)[1]) for f in (False, True))
    stores = [(len(re.findall(r"st\.shared\.v4\.[fb]32", x)), len(re.findall(r"st\.shared\.v2\.[fb]32", x)))
              for x in (plain, flat)]
    share = 64 * d // 256  # floats of the dQ tile per MMA thread
    # at [row, col]: column pairs, 8 bytes a store (bank conflicts across a warp's 8 rows); flat: 16
    assert stores == [(0, share // 2), (share // 4, 0)], stores



@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("varlen", [False, True])
def test_the_flat_post_pass_reads_and_writes_16_bytes_a_thread(d, varlen):
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, d, causal=True, varlen=varlen)
    ptx = compiled_ptx(compile_backward(p, keep_ptx=True, dq_flat=True)[2])
    share = 64 * d // 256  # floats of a query tile per thread
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    # the shares in register order, 4 floats a load; dQ out along its rows, 8 elements a store
    assert count(r"ld\.global\.v4\.[fb]32") == share // 4 and count(r"st\.global\.v4\.b32") == share // 8
    assert count(r"st\.global\.(?:b16|b32)") == 0 and count(r"ld\.global\.[fb]32") == 2 * varlen  # cu_seqlens


def test_the_flat_accumulator_is_zeroed_past_the_rows_the_pre_pass_zeroes(monkeypatch):
    from kernels.k10 import flat_accumulator

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))  # no lucky zeros
    view, flat = flat_accumulator(2, 3, 100, 64, 2, 64, "cpu")  # 100 rows: two 64-row slots a head
    assert view.shape == (2, 3, 100, 64) and flat.shape[-1] * flat.shape[-2] == 128 * 64
    view.fill_(1.0)  # what the pre-pass zeroes lies under the view; the rest must be 0 already
    heads = flat.view(2, 3, -1)
    assert bool((heads[:, :, :100 * 64] == 1).all()) and bool((heads[:, :, 100 * 64:] == 0).all())
    view, flat = flat_accumulator(1, 2, 128, 64, 2, 64, "cpu")  # whole slots: the view covers all of it
    assert view.numel() == flat.numel()

def test_ds_leaves_by_stmatrix_in_the_variant():
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 128, causal=True)
    plain, st = (compiled_ptx(compile_backward(p, keep_ptx=True, ds_stmatrix=f)[1]) for f in (False, True))
    # 32 dS^T values a thread: 32 two-byte stores, or 4 stmatrix.x4 (8 values each)
    assert (len(re.findall(r"st\.shared\.b16", plain)), len(re.findall(r"stmatrix", plain))) == (32, 0)
    assert (len(re.findall(r"st\.shared\.b16", st)), len(re.findall(r"stmatrix\.sync\.aligned\.(?:m8n8\.)?x4", st))) == (0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ["n1", "n17", "n1000", "gqa", "unequal"])
def test_k10_gradients_match_float64_autograd(shape, causal, d):
    from harness.check import check_backward

    p = dict(n1=Problem(2, 4, 1, d), n17=Problem(2, 4, 17, d), n1000=Problem(2, 4, 1000, d),
             gqa=Problem(2, 8, 1000, d, nheads_kv=2),
             unequal=Problem(2, 4, 300, d, seqlen_k=1000, nheads_kv=2))[shape].with_(causal=causal)
    row = check_backward(p, backward="k10")
    assert row["ok"], row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["k10_overlap", "k10_flat", "k10_stmatrix", "k10_fa3"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("shape", ["n17", "n1000", "gqa"])
def test_k10s_variants_match_float64_autograd(shape, d, variant):
    from harness.check import check_backward

    p = dict(n17=Problem(2, 4, 17, d, causal=True), n1000=Problem(2, 4, 1000, d),
             gqa=Problem(2, 8, 1000, d, nheads_kv=2, causal=True))[shape]
    row = check_backward(p, backward=variant)
    assert row["ok"], row


def test_rows_ahead_reads_lse2_between_the_s_and_dp_issues():
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1024, 128)
    ptx = {on: compiled_ptx(compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"), rows_ahead=on))[1])
           for on in (False, True)}
    # the plain step comes first (plain_first): from S^T's commit to the wait that leaves dP^T running
    first = {on: re.search(r"wgmma\.commit_group\.sync\.aligned;(.*?)wgmma\.wait_group\.sync\.aligned\s+1;", text,
                           re.S).group(1) for on, text in ptx.items()}
    columns = 64 // 4  # a thread's columns of the 64 x 64 S^T tile, two a 64-bit read
    assert len(re.findall(r"ld\.shared", first[True])) == columns // 2
    assert not re.findall(r"ld\.shared", first[False])


def test_dq_stages_takes_early_dqs_step_and_fits_the_smem():
    from harness.backward import stage_overrides
    from kernels.contract import UnsupportedProblem
    from harness.inspect_ptx import wgmma_serialized
    from kernels.k10 import compile_backward

    base = stage_overrides("k10_fa3")
    p = Problem(2, 4, 1000, 128, causal=True)
    with pytest.raises(UnsupportedProblem, match="dq_stages is 1 or 2, and 2 is early_dq's"):
        compile_backward(p, **dict(base, early_dq=False, dq_stages=2))
    with pytest.raises(UnsupportedProblem, match="dq_stages is 1 or 2"):
        compile_backward(p, **dict(base, dq_stages=3))
    # flash-attn-4's 80-query tile fits with one sdQ stage, not with two: refused as it compiles
    m80 = dict(base, tile_m=80, dq_swapab=True, overlap=False)
    compile_backward(p, **m80)
    with pytest.raises(UnsupportedProblem, match="bytes of SMEM, more than 232448 .dq_stages=2"):
        compile_backward(p, **dict(m80, dq_stages=2))
    assert compile_backward(p.with_(head_dim=256), **dict(base, dq_stages=2))[3].get("dq_stages") == 1  # its own step
    for q in (p, p.with_(head_dim=64), p.with_(varlen=True), p.with_(causal=False)):
        plain, staged = (compiled_ptx(compile_backward(q, keep_ptx=True, **dict(base, dq_stages=n))[1]) for n in (1, 2))
        assert staged != plain
        # the same reduce-adds (one per warpgroup's half), from a slot that alternates by step
        assert (len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", staged))
                == len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", plain)) == 2)
        serialized = wgmma_serialized(staged)
        assert serialized in (None, False), q  # None: no ptxas on PATH


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("knob", [{"dq_stages": 2}, {"rows_ahead": True}])
@pytest.mark.parametrize("d", [64, 128])
def test_the_new_knobs_gradients_match_float64_autograd_packed_and_deterministic(d, knob, monkeypatch):
    from harness.check import check_backward

    knob_stage(monkeypatch, knob)
    # causal walks of odd and even lengths (both sdQ stages), one step (n17), GQA, a window
    for p in (Problem(2, 4, 17, d, causal=True), Problem(2, 4, 1000, d), Problem(2, 4, 1000, d, causal=True),
              Problem(2, 8, 1000, d, nheads_kv=2, causal=True), Problem(2, 4, 700, d, window=(150, 90))):
        row = check_backward(p, backward="k10_knob")
        assert row["ok"], row
    packed_and_deterministic("k10_knob", d)  # the fixed dQ order through both sdQ stages


def knob_stage(monkeypatch, knob: dict, name: str = "k10_knob") -> str:
    """``name``: a backward stage for this test, k10_fa3 with ``knob`` on (deterministic mode included)."""
    import harness.backward as hb

    monkeypatch.setitem(hb.VARIANTS, name, ("k10", dict(hb.stage_overrides("k10_fa3"), **knob)))
    monkeypatch.setattr(hb, "STAGES", tuple(hb.VARIANTS))
    monkeypatch.setattr(hb, "DETERMINISTIC", hb.DETERMINISTIC + (name,))
    return name


def packed_and_deterministic(stage: str, d: int):
    """A knob's packed checks (an empty sequence, one row, partial and whole tiles; causal or not)
    and its deterministic mode's bitwise repeat (three causal backwards)."""
    from harness import attention, attention_backward
    from harness.check import check_varlen_backward_case

    for causal in (False, True):
        row = check_varlen_backward_case(stage, [0, 1, 17, 300, 605], [0, 1, 17, 300, 605], 4, 2, d, causal)
        assert row["ok"], row
    q, k, v, dout = (torch.randn(2, 4, 1000, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = attention("k6", q, k, v, causal=True, return_lse=True)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [attention_backward(q, k, v, out, lse, dout, causal=True, backward=stage) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


def test_capped_overlap_keeps_the_overlapped_start_under_a_softcap():
    from harness.backward import stage_overrides
    from harness.inspect_ptx import wgmma_serialized
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, 128, causal=True, softcap=30.0)
    base = {k: v for k, v in stage_overrides("k10_fa3").items() if k != "by_head_dim"}  # d = 128's is the knob
    plain, kept = (compile_backward(p, keep_ptx=True, **dict(base, capped_overlap=on)) for on in (False, True))
    assert plain[3].get("overlap") is False and plain[3].get("tanh_under_dp")  # the cap's sequential start
    assert kept[3].get("overlap") and not kept[3].get("tanh_under_dp")
    ptx = compiled_ptx(kept[1])
    # one tanh a score, as before; P widened back from dV's bf16 operand for dS (cvt.f32.bf16)
    tanhs = [len(re.findall(r"tanh\.approx\.f32", x)) for x in (ptx, compiled_ptx(plain[1]))]
    assert tanhs[0] == tanhs[1] > 0
    assert "cvt.f32.bf16" in ptx and "cvt.f32.bf16" not in compiled_ptx(plain[1])
    assert wgmma_serialized(ptx) in (None, False)  # None: no ptxas on PATH
    # without a softcap the knob is the same kernel
    uncapped = p.with_(softcap=0.0)
    assert compiled_ptx(compile_backward(uncapped, keep_ptx=True, **dict(base, capped_overlap=True))[1]) == \
        compiled_ptx(compile_backward(uncapped, keep_ptx=True, **base)[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_capped_overlap_gradients_match_float64_autograd(d, monkeypatch):
    from harness.check import check_backward, check_varlen_backward_case

    knob_stage(monkeypatch, {"capped_overlap": True}, "k10_capov")
    # small and large caps (t near 0 and near +-1), one step, odd lengths, GQA, a window
    for p in (Problem(2, 4, 17, d, causal=True, softcap=30.0), Problem(2, 4, 1000, d, softcap=0.5),
              Problem(2, 4, 1000, d, causal=True, softcap=5.0), Problem(2, 4, 4097, d, causal=True, softcap=30.0),
              Problem(2, 8, 1000, d, nheads_kv=2, causal=True, softcap=30.0),
              Problem(2, 4, 700, d, window=(150, 90), softcap=5.0)):
        row = check_backward(p, backward="k10_capov")
        assert row["ok"], row
    for causal in (False, True):
        row = check_varlen_backward_case("k10_capov", [0, 1, 17, 300, 605], [0, 1, 17, 300, 605], 4, 2, d, causal,
                                         softcap=5.0)
        assert row["ok"], row


def test_scale_at_end_takes_a_multiply_a_score_out_of_the_step_and_scales_dq_in_the_post_pass():
    from harness.backward import stage_overrides
    from harness.inspect_ptx import wgmma_serialized
    from kernels.contract import UnsupportedProblem
    from kernels.k10 import compile_backward

    base = stage_overrides("k10_fa3")
    for p in (Problem(2, 4, 1000, 128, causal=True), Problem(2, 4, 1000, 128, causal=True, varlen=True),
              Problem(2, 4, 1000, 128, softcap=30.0)):
        plain, scaled = (compile_backward(p, keep_ptx=True, **dict(base, scale_at_end=on)) for on in (False, True))
        muls = [len(re.findall(r"\bmul(?:\.rn)?\.f32", compiled_ptx(x[1]))) for x in (plain, scaled)]
        # two copies of the step (edge and plain) lose one multiply a score (32 a thread at
        # d = 128); the epilogue gains one per dK element (64 a thread)
        assert muls[1] == muls[0] - 2 * 32 + 64, (p, muls)
        posts = [len(re.findall(r"\bmul(?:\.rn)?\.f32", compiled_ptx(x[2]))) for x in (plain, scaled)]
        assert posts[0] == 0 and posts[1] > 0, (p, posts)  # dQ = scale * the accumulator, there
        assert wgmma_serialized(compiled_ptx(scaled[1])) in (None, False)  # None: no ptxas on PATH
    # d = 256's own step drops it; without dq_flat there is no scaled post-pass
    p = Problem(2, 4, 1000, 256, causal=True)
    assert not compile_backward(p, **dict(base, scale_at_end=True))[3].get("scale_at_end")
    with pytest.raises(UnsupportedProblem, match="scale_at_end scales dQ in dq_flat's post-pass"):
        compile_backward(Problem(2, 4, 1000, 128), overlap=True, scale_at_end=True)


def test_early_dv_issues_dvs_gemm_before_dps_wait():
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    def after_exponentials(ptx):  # what follows each run of ex2: a wait, or a GEMM (its N)
        events = []
        for line in ptx.splitlines():
            op = line.strip()
            if op.startswith("wgmma.wait_group"):
                events.append("wait" + re.search(r"(\d+);", op).group(1))
            elif op.startswith("wgmma.mma_async"):
                events.append("n" + re.search(r"m64n(\d+)k", op).group(1))
            elif op.startswith("ex2.approx") and (not events or events[-1] != "ex2"):
                events.append("ex2")
        return [events[i + 1] for i, e in enumerate(events[:-1]) if e == "ex2"]

    base = dict(stage_overrides("k10_fa3"))
    for p in (Problem(2, 4, 1000, 128, causal=True), Problem(2, 4, 1000, 128)):
        plain, early = (compiled_ptx(compile_backward(p, keep_ptx=True, **dict(base, early_dv=on))[1])
                        for on in (False, True))
        # both copies of the step (edge, plain): P's exponentials, then dP's wait (wait_group 0),
        # or with the knob dV's GEMM (n128) first, and only then the wait for dP alone
        assert after_exponentials(plain) == ["wait0", "wait0"], p
        assert after_exponentials(early) == ["n128", "n128"], p
        assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", early)) == \
            len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", plain)) - 2
    # under a softcap capped_overlap reads P back from dV's operand after dP's wait, which a running
    # dV GEMM would make undefined: the knob stands aside there
    capped = Problem(2, 4, 1000, 128, causal=True, softcap=30.0)
    assert without_kernel_names(compiled_ptx(compile_backward(capped, keep_ptx=True, **dict(base, early_dv=True))[1])) == \
        without_kernel_names(compiled_ptx(compile_backward(capped, keep_ptx=True, **base)[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("knob", [{"scale_at_end": True}, {"early_dv": True}, {"scale_at_end": True, "early_dv": True}])
@pytest.mark.parametrize("d", [64, 128])
def test_step_knobs_gradients_match_float64_autograd_packed_capped_and_deterministic(d, knob, monkeypatch):
    from harness.check import check_backward

    knob_stage(monkeypatch, knob)
    for p in (Problem(2, 4, 17, d, causal=True), Problem(2, 4, 1000, d), Problem(2, 8, 1000, d, nheads_kv=2, causal=True),
              Problem(2, 4, 1000, d, causal=True, softcap=5.0), Problem(2, 4, 700, d, window=(150, 90)),
              Problem(2, 4, 1000, d, causal=True, dtype="float16"), Problem(2, 4, 1000, d, softmax_scale=0.3)):
        row = check_backward(p, backward="k10_knob")
        assert row["ok"], (p, row["reason"])
    packed_and_deterministic("k10_knob", d)


def test_the_knobs_measured_and_left_off_live_in_k10_experiments_not_in_the_lesson():
    import inspect

    from kernels import k10, k10_experiments

    lesson = inspect.getsource(k10.K10Backward) + inspect.getsource(k10.FlatPostpass)
    for knob in k10_experiments.MIXINS:
        if knob != "dq_stages":  # the lesson's sdQ has one stage: a count the variant raises
            assert knob not in lesson, knob
    # a knob at its off value builds K10's own class and is not passed on; one set builds its mixin
    off, on = {"tile_m": 64, "dq_stages": 1, "select_rows": False}, {"tile_m": 64, "dq_stages": 2, "early_dv": True}
    assert k10_experiments.kernel_class(off, k10.K10Backward) is k10.K10Backward
    assert k10_experiments.kernel_args(off) == {"tile_m": 64}
    cls = k10_experiments.kernel_class(on, k10.K10Backward)
    assert cls.__mro__[1:4] == (k10_experiments.EarlyDv, k10_experiments.DqStages, k10.K10Backward), cls.__mro__
    assert k10_experiments.kernel_args(on) == {"tile_m": 64, "dq_stages": 2, "early_dv": True}
    assert k10_experiments.kernel_args(dict(on, wide_prepass=True)) == k10_experiments.kernel_args(on)
    with pytest.raises(TypeError):
        k10.K10Backward(128, None, False, 2, 64, 2, select_rows=True)  # the lesson takes no such knob


@pytest.mark.parametrize("d", [64, 128, 256])
def test_wide_prepass_reads_16_bytes_a_thread_packed_or_not_and_leaves_the_main_kernel_as_it_was(d):
    from harness.backward import stage_overrides
    from kernels.k10 import compile_backward

    p = Problem(2, 4, 1000, d, causal=True)
    base, wide = (compile_backward(p, keep_ptx=True, **dict(stage_overrides("k10_fa3"), wide_prepass=on))
                  for on in (False, True))
    count = lambda pattern, fn: len(re.findall(pattern, compiled_ptx(fn)))  # noqa: E731
    # a thread: one 16-byte load of O and one of dO, 8 floats of dQ's accumulator zeroed in two
    # 16-byte stores, D summed over the row's d/8 threads; K9's pre-pass loads 2 bytes at a time
    assert count(r"ld\.global[^;]*\.v4", wide[0]) == 2 and count(r"st\.global[^;]*\.v4", wide[0]) == 2
    assert count(r"shfl\.sync\.bfly", wide[0]) == (d // 8).bit_length() - 1
    assert count(r"ld\.global[^;]*\.v4", base[0]) == 0
    assert without_kernel_names(compiled_ptx(wide[1])) == without_kernel_names(compiled_ptx(base[1]))
    assert wide[3]["wide_prepass"] and not base[3].get("wide_prepass")
    # packed: the same loads and stores (WideVarlenPrepass), and 16-byte zeros past a sequence's last
    # row to the end of its last query tile's slot
    base, wide = (compile_backward(p.with_(varlen=True), keep_ptx=True,
                                   **dict(stage_overrides("k10_fa3"), wide_prepass=on)) for on in (False, True))
    assert count(r"ld\.global[^;]*\.v4", wide[0]) == 2 and count(r"st\.global[^;]*\.v4", wide[0]) == 4
    assert count(r"shfl\.sync\.bfly", wide[0]) == (d // 8).bit_length() - 1
    assert count(r"ld\.global[^;]*\.v4", base[0]) == 0
    assert without_kernel_names(compiled_ptx(wide[1])) == without_kernel_names(compiled_ptx(base[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_wide_prepass_gradients_match_float64_autograd(d, monkeypatch):
    from harness.check import check_backward

    knob_stage(monkeypatch, {"wide_prepass": True})
    # one row, odd lengths (a CTA's rows past the sequence), GQA, fp16, a window, a softcap
    for p in (Problem(2, 4, 1, d), Problem(2, 4, 17, d, causal=True), Problem(2, 4, 1000, d),
              Problem(2, 8, 1000, d, nheads_kv=2, causal=True), Problem(2, 4, 1000, d, dtype="float16"),
              Problem(2, 4, 700, d, window=(150, 90)), Problem(2, 4, 1000, d, causal=True, softcap=5.0)):
        row = check_backward(p, backward="k10_knob")
        assert row["ok"], (p, row["reason"])
