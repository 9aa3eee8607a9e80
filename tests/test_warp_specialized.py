"""K5 and K6 on the CPU: what their PTX must hold, at every head dim and dtype, and no spills.

Register counts say little here: with launch bounds ptxas pins the launch budget (168 registers
at 384 threads, 128 at 512) and setmaxnreg moves registers at run time, so spill bytes are the
check that matters.
"""

import re

import pytest

from harness.inspect_ptx import count_instructions, ptxas_report, wgmma_a_sources
from kernels import get_kernel
from kernels.contract import Problem, UnsupportedProblem
from kernels.k5 import REGISTERS
from kernels.sm90 import NamedBarrier
from script_loader import load_script

WS_KERNELS = ("k5", "k6_pp", "k6_overlap", "k6", "k7", "k8")  # K7/K8: K6 in FP8
CASES = [(n, d, dt, c) for n in WS_KERNELS for d in (64, 128, 256) for dt in ("bfloat16", "float16")
         for c in (False, True) if dt == "bfloat16" or c]


def _compile(name, d, dtype="bfloat16", causal=True, **cfg):
    return get_kernel(name).compile(Problem(1, 1, 128, d, dtype=dtype, causal=causal), keep_ptx=True, **cfg)


@pytest.mark.parametrize("name,d,dtype,causal", CASES, ids=[f"{n}-d{d}-{dt}-c{int(c)}" for n, d, dt, c in CASES])
def test_registers_move_from_producer_to_consumers(name, d, dtype, causal):
    compiled = _compile(name, d, dtype, causal)
    ptx = compiled.ptx
    producer, consumer = REGISTERS[compiled.info["num_wg"]]
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(producer)]
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(consumer)]
    threads = 128 * (compiled.info["num_wg"] + 1)
    assert re.search(rf"\.reqntid {threads}, 1, 1", ptx) and ".minnctapersm 1" in ptx
    # The only CTA-wide barrier is the one after the mbarrier inits, before the role split.
    assert len(re.findall(r"\bbar\.sync\s+0;", ptx)) == 1
    counts = count_instructions(ptx)
    assert counts["wgmma.mma_async"] > 0 and counts["cp.async.bulk.tensor"] > 0
    assert counts["ld/st.local"] == 0
    report = ptxas_report(ptx)
    if not report:
        pytest.skip("ptxas not on PATH")
    assert all(spill == 0 for _, _, _, spill in report), report


def _named_barriers(ptx):
    return re.findall(r"\bbar\.(sync|arrive)\s+([^,;]+),\s*(\d+);", ptx)


def _ping_pong_barriers(ptx):
    # The token's barriers count two warpgroups (256 threads); a register id is the DSL's way of
    # writing an id computed from the warpgroup index (the per-warpgroup O store's count 160).
    ids = {str(NamedBarrier.WARP_SCHEDULER + i) for i in range(3)}
    return [b for b in _named_barriers(ptx)
            if b[2] == "256" and (b[1].strip() in ids or b[1].strip().startswith("%r"))]


def test_k5_has_separate_k_and_v_pipelines_and_no_ping_pong():
    ptx = _compile("k5", 128).ptx
    # Q's pair plus a full/empty pair per stage for K and for V (2 stages): 2 + 4 + 4; K4 shares
    # one pair per stage between K and V.
    assert len(re.findall(r"\bmbarrier\.init\.", ptx)) >= 10
    assert not _ping_pong_barriers(ptx)


def test_tma_store_epilogue():
    # K5, d=128: stmatrix into the Q buffer, fence, all consumers sync on barrier 1 (256 threads),
    # arrive on 5 and one warp syncs there too (288), then the TMA store and its read-wait.
    ptx = _compile("k5", 128).ptx
    assert "stmatrix.sync.aligned" in ptx and "fence.proxy.async.shared::cta" in ptx
    assert re.search(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta", ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
    barriers = set(_named_barriers(ptx))
    epilogue, store = str(int(NamedBarrier.EPILOGUE)), str(int(NamedBarrier.EPILOGUE_STORE))
    assert {("sync", epilogue, "256"), ("arrive", store, "288"), ("sync", store, "288")} <= barriers, barriers


@pytest.mark.parametrize("d", [64, 128, 256])
def test_k6_stores_o_per_warpgroup(d):
    # K6 (short or causal): no barrier across warpgroups; each warpgroup's 128 threads arrive on
    # its own barrier (5 + wg, a register id) and its first warp syncs there (160), then stores.
    ptx = _compile("k6", d).ptx
    barriers = set(_named_barriers(ptx))
    assert not any(b[1].strip() == str(int(NamedBarrier.EPILOGUE)) for b in barriers), barriers
    per_wg = {(kind, count) for kind, bar_id, count in barriers if bar_id.strip().startswith("%r")}
    assert {("arrive", "160"), ("sync", "160")} <= per_wg, barriers
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
    # The defaults by length (docs/k6.md): per warpgroup for causal or up to 2k keys; d=64 keeps
    # the register stores from 4k keys non-causal, 16k causal.
    entry = get_kernel("k6")
    info = lambda n, causal: entry.compile(Problem(1, 1, n, d, causal=causal)).info  # noqa: E731
    assert info(2048, False)["o_store_per_wg"]
    assert info(16384, True)["o_store_per_wg"] == info(16384, True)["tma_store"]  # causal: wherever there is a TMA store
    assert not info(8192, False)["o_store_per_wg"]
    if d == 64:
        assert info(2048, False)["tma_store"] and not info(4096, False)["tma_store"]
        assert info(8192, True)["tma_store"] and not info(16384, True)["tma_store"]


def test_pin_pv_wait_is_checked_and_builds():
    # The measured-and-off PV-wait pinning: both forms compile without spills, and each loop copy
    # gains a second wait_group 0 (the branch's other side); what it cannot pin is refused.
    wait0 = r"wgmma\.wait_group\.sync\.aligned\s+0;"
    base = len(re.findall(wait0, _compile("k6", 128, causal=True).ptx))
    for mode in ("after_softmax", "before_exp2"):
        compiled = _compile("k6", 128, causal=True, pin_pv_wait=mode)
        assert len(re.findall(wait0, compiled.ptx)) > base
        assert all(r[3] == 0 for r in ptxas_report(compiled.ptx))
    with pytest.raises(ValueError, match="pin_pv_wait"):
        _compile("k6", 128, pin_pv_wait="sometimes")
    with pytest.raises(UnsupportedProblem, match="overlap"):
        _compile("k6", 64, pin_pv_wait="after_softmax")  # d=64 runs without the overlap
    with pytest.raises(UnsupportedProblem, match="skip_unit_rescale"):
        _compile("k6", 128, pin_pv_wait="after_softmax", skip_unit_rescale=True)


@pytest.mark.parametrize("name", ["k6_pp", "k6_overlap", "k6", "k7", "k8"])
def test_k6_passes_a_token_between_warpgroups(name):
    ptx = _compile(name, 128).ptx
    kinds = {(kind, count) for kind, _, count in _named_barriers(ptx)}
    assert ("sync", "256") in kinds and ("arrive", "256") in kinds, kinds


def test_k6_overlaps_qk_with_pv():
    # wait_group 1: QK of the next tile retired while the PV of this one may still run.
    for name in ("k6_overlap", "k6"):
        assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", _compile(name, 128).ptx), name
    assert not re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", _compile("k6_pp", 128).ptx)


def test_k6_at_d256_has_no_ping_pong():
    assert not _ping_pong_barriers(_compile("k6", 256).ptx)


def test_schedulers():
    # Static persistent: the tile index advances by gridDim.x, no atomics. Dynamic (causal
    # default): the producer claims tiles with a global atomic add.
    static = _compile("k6", 128, causal=False).ptx
    assert "%nctaid.x" in static and not re.search(r"\batom\.", static)
    dynamic = _compile("k6", 128, causal=True).ptx
    assert re.search(r"\batom\.[\w.]*add", dynamic)
    single = _compile("k6", 128, causal=True, scheduler="single").ptx
    assert not re.search(r"\batom\.", single)


def test_k6_picks_the_overlap_by_seqlen_at_d128_non_causal():
    # Short non-causal sequences at d=128 run without the overlap (measured faster), long ones with
    # it; both compile without spills.
    entry = get_kernel("k6")
    short = entry.compile(Problem(1, 1, 2048, 128), keep_ptx=True)
    long = entry.compile(Problem(1, 1, 4096, 128), keep_ptx=True)
    assert not short.info["overlap"] and long.info["overlap"]
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", long.ptx)
    report = ptxas_report(long.ptx)
    assert all(spill == 0 for _, _, _, spill in report), report


def test_k6_takes_its_short_sequence_tiles_by_head_dim_and_seqlen():
    # Up to 1k keys, causal d=64 runs 128-row tiles (two consumer warpgroups), longer ones 192-row
    # tiles (three); an explicit num_wg wins over both.
    entry = get_kernel("k6")
    assert entry.compile(Problem(1, 1, 1024, 64, causal=True)).info["num_wg"] == 2
    assert entry.compile(Problem(1, 1, 2048, 64, causal=True)).info["num_wg"] == 3
    assert entry.compile(Problem(1, 1, 1024, 64, causal=False)).info["num_wg"] == 3
    assert entry.compile(Problem(1, 1, 1024, 64, causal=True), num_wg=3).info["num_wg"] == 3
    # d=256: 64-key tiles up to 2k keys causal, 1k non-causal; 80 beyond.
    assert entry.compile(Problem(1, 1, 2048, 256, causal=True)).info["tile_n"] == 64
    assert entry.compile(Problem(1, 1, 4096, 256, causal=True)).info["tile_n"] == 80
    assert entry.compile(Problem(1, 1, 1024, 256)).info["tile_n"] == 64
    assert entry.compile(Problem(1, 1, 2048, 256)).info["tile_n"] == 80
    # d=128 non-causal: 128-key tiles without the overlap up to 2k keys, 144-key tiles with it beyond.
    assert entry.compile(Problem(1, 1, 2048, 128)).info["tile_n"] == 128
    assert entry.compile(Problem(1, 1, 4096, 128)).info["tile_n"] == 144
    assert entry.compile(Problem(1, 1, 4096, 128, causal=True)).info["tile_n"] == 128
    # d=64 non-causal: 176-key tiles from 16k keys (counted in keys: a short query chunk too), 128
    # below and causal; they build without spills.
    assert entry.compile(Problem(1, 1, 8192, 64)).info["tile_n"] == 128
    assert entry.compile(Problem(1, 1, 16384, 64, causal=True)).info["tile_n"] == 128
    assert entry.compile(Problem(1, 1, 16384, 64), tile_n=128).info["tile_n"] == 128
    assert entry.compile(Problem(1, 1, 16384, 64), overlap=True).info["tile_n"] == 112  # the overlap's own width
    assert entry.compile(Problem(2, 4, 128, 64, seqlen_k=16384, nheads_kv=1)).info["tile_n"] == 176
    long = entry.compile(Problem(1, 1, 16384, 64), keep_ptx=True)
    assert long.info["tile_n"] == 176
    report = ptxas_report(long.ptx)
    assert all(spill == 0 for _, _, _, spill in report), report
    # d=256: O through SMEM and a TMA store up to 8k keys, register stores beyond; explicit wins.
    assert entry.compile(Problem(1, 1, 8192, 256, causal=True)).info["tma_store"] is True
    assert entry.compile(Problem(1, 1, 16384, 256)).info["tma_store"] is False
    assert entry.compile(Problem(1, 1, 512, 256), tma_store=False).info["tma_store"] is False


def test_k6_softmax_knobs_measured_and_left_off():
    # Three K6 knobs lost on an H100 (docs/k6.md) and stay off; each must still build what it says.
    base = _compile("k6", 64, causal=False, tile_n=128)
    assert "add.rm.f32" not in base.ptx and "vote.sync.any" not in base.ptx
    # emulated_exp2: of every 8 columns of an unmasked tile, 2 take the cubic on the FMA pipe.
    emu = _compile("k6", 64, causal=False, tile_n=128, emulated_exp2=2)
    counts, base_counts = count_instructions(emu.ptx), count_instructions(base.ptx)
    copies = emu.info["q_stages"]  # the mainloop is compiled once per Q stage (K5's consume)
    assert emu.ptx.count("add.rm.f32") == 16 * copies and "max.NaN.f32" in emu.ptx  # 2 rows x 32 columns / 4
    assert counts["ex2.approx"] == base_counts["ex2.approx"] - 16 * copies
    # skip_unit_rescale: one warp vote per rescale decides whether the O rows are multiplied.
    skip = _compile("k6", 128, causal=True, skip_unit_rescale=True)
    assert skip.ptx.count("vote.sync.any.pred") >= 1
    assert all(r[3] == 0 for r in ptxas_report(emu.ptx) + ptxas_report(skip.ptx))


def test_k6_q_in_registers_measured_and_left_off():
    # q_in_regs (lost on an H200, docs/k6.md): every QK WGMMA takes Q from registers, loaded by
    # ldmatrix once per Q stage (64 rows x d of 16-bit values: d/16 x4 loads per thread), no spills.
    reports = []
    for d in (64, 128):
        base, regs = _compile("k6", d, causal=False), _compile("k6", d, causal=False, q_in_regs=True)
        assert "%rd" in wgmma_a_sources(base.ptx) and "ldmatrix" not in base.ptx
        assert set(wgmma_a_sources(regs.ptx)) == {"{"}  # QK and PV both RS now
        assert regs.ptx.count("ldmatrix.sync.aligned.m8n8.x4") == d // 16 * regs.info["q_stages"]
        reports += ptxas_report(regs.ptx)
    with pytest.raises(UnsupportedProblem, match="q_in_regs"):
        _compile("k6", 256, q_in_regs=True)
    with pytest.raises(UnsupportedProblem, match="q_in_regs"):
        _compile("k7", 128, q_in_regs=True)  # FP8: not checked with e4m3
    if not reports:
        pytest.skip("ptxas not on PATH")
    assert all(r[3] == 0 for r in reports), reports


def test_exp2_cubic_is_within_bf16_precision():
    # The cubic of exp2_poly, as float32 constants: under 1e-4 relative error (bf16 keeps 3.9e-3),
    # and what scripts/fit_exp2.py produces.
    from kernels.sm90 import EXP2_POLY

    fit_exp2 = load_script("fit_exp2")
    assert fit_exp2.max_relative_error(EXP2_POLY) < 1e-4
    assert fit_exp2.max_relative_error((0.69, 0.24, 0.07)) > 1e-4  # the check can fail
    assert max(abs(a - b) for a, b in zip(fit_exp2.fit(), EXP2_POLY)) < 1e-5


@pytest.mark.parametrize("num_cols", [20, 32, 36])  # tile_n 80, 128, 144: 4 columns per thread per 16 keys
def test_keep_mask_counts_the_columns_below_the_limit(num_cols):
    # mask_tile keeps a row's first columns_below(limit) columns: that must be exactly the columns
    # whose key offset 8 * (c // 2) + c % 2 (+ the thread's own offset, 0..6) is below the limit.
    from kernels.sm90 import columns_below

    for thr_col in (0, 2, 4, 6):
        for limit in range(-20, 8 * num_cols):
            below = [c for c in range(num_cols) if thr_col + 8 * (c // 2) + c % 2 < limit]
            assert below == list(range(min(columns_below(limit - thr_col), num_cols))), (limit, thr_col)


def test_masking_moves_predicates_and_q_stages_get_a_mainloop_each():
    # The keep-mask: one shr.b32 per row and 32-column chunk instead of a compare per column.
    # 2 Q stages: the mainloop (and its masked loop) exists once per stage, Q's stage a constant.
    compiled = _compile("k6", 128, causal=True)
    ptx = compiled.ptx
    masked_loops = 2 * compiled.info["q_stages"]  # prologue tile + masked loop, per mainloop copy
    assert ptx.count("shr.b32") == masked_loops * 2  # 2 rows, one chunk (a thread holds 32 of 128 keys)
    assert len(re.findall(r"setp\.\w+\.s32", ptx)) < 64  # was one per column: 135 at d=128 causal
    one_stage = _compile("k6", 128, causal=True, q_stages=1)
    wgmma = lambda c: c.ptx.count("wgmma.mma_async")  # noqa: E731
    assert wgmma(compiled) == 2 * wgmma(one_stage)


def test_long_causal_sequences_take_l2_sized_sections():
    from kernels import schedule

    entry = get_kernel("k6")
    assert entry.compile(Problem(1, 1, 2048, 128, causal=True)).info["section_bytes"] == schedule.L2_BYTES // 8
    assert entry.compile(Problem(1, 1, 4096, 128, causal=True)).info["section_bytes"] == schedule.L2_BYTES
    assert entry.compile(Problem(1, 1, 4096, 128, causal=True), section_bytes=1 << 20).info["section_bytes"] == 1 << 20
    # Chunked prefill: the key length decides.
    assert entry.compile(Problem(1, 1, 1024, 128, causal=True, seqlen_k=8192)).info["section_bytes"] == schedule.L2_BYTES
    for name in ("k7", "k8"):  # K6's schedule, sections included
        assert get_kernel(name).compile(Problem(1, 1, 2048, 128, causal=True)).info["section_bytes"] == schedule.L2_BYTES // 8
        assert get_kernel(name).compile(Problem(1, 1, 4096, 128, causal=True)).info["section_bytes"] == schedule.L2_BYTES


@pytest.mark.parametrize("num_tiles,grid,n_kv", [(2048, 132, 57), (4096, 132, 114), (12, 5, 3), (7, 5, 1),
                                                 (13, 5, 40), (6, 5, 2), (132, 132, 9), (420, 132, 3), (11, 5, 3)])
def test_split_tail_runs_cover_every_kv_tile_of_the_tail_once(num_tiles, grid, n_kv):
    from kernels.schedule import tail_runs

    runs = tail_runs(num_tiles, grid, n_kv)
    tail = num_tiles - num_tiles // grid * grid
    steps = tail * n_kv
    parts = min(grid, steps)  # (420, 132, 3) and (11, 5, 3): fewer KV steps than CTAs
    covered = [(r, k) for pieces in runs for r, lo, hi in pieces for k in range(lo, hi)]
    assert sorted(covered) == [(r, k) for r in range(tail) for k in range(n_kv)]
    for c, pieces in enumerate(runs):
        assert len(pieces) <= 2
        assert sum(hi - lo for _, lo, hi in pieces) in ((steps // parts, steps // parts + 1) if c < parts else (0,))
        for r, lo, hi in pieces:  # tail_owner finds the CTA of a piece's first step (the merge's loop)
            assert ((r * n_kv + lo + 1) * parts - 1) // steps == c
    # The merge counts a tile's pieces as the CTAs from its first step's owner to its last's: each
    # of them must hold a piece of the tile (a CTA without one would leave the count short forever).
    for r in range(tail):
        first = ((r * n_kv + 1) * parts - 1) // steps
        last = (((r + 1) * n_kv) * parts - 1) // steps
        assert [c for c, pieces in enumerate(runs) if any(t == r for t, _, _ in pieces)] == list(range(first, last + 1))


def test_split_tail_is_a_static_non_causal_knob_with_atomics_and_no_spills():
    with pytest.raises(UnsupportedProblem, match="split_tail"):
        _compile("k6", 128, causal=True, split_tail=True)
    with pytest.raises(UnsupportedProblem, match="split_tail"):
        _compile("k6", 128, causal=False, split_tail=True, scheduler="single")
    for d in (64, 128, 256):
        ptx = _compile("k6", d, causal=False, split_tail=True).ptx
        assert re.search(r"\batom\.[\w.]*add", ptx) and "fence.acq_rel.gpu" in ptx  # the merge's count
        assert all(spill == 0 for *_, spill in ptxas_report(ptx))
    assert not re.search(r"\batom\.", _compile("k6", 128, causal=False).ptx)  # off by default


def test_k_and_v_descriptors_are_made_once_not_per_kv_step():
    # sm90.StagedOperand: K's and V's WGMMA descriptors are built once per CTA, pinned by an
    # inline mov, then advanced per stage. Indexed by the runtime stage instead, the fragments
    # rebuild them from the SMEM address ((addr >> 4) & 0x3fc0, PTX and.b32 ..., 16320) in every
    # copy of the KV step.
    def extractions(ptx):
        return len(re.findall(r"and\.b32\s+%r\d+, %r\d+, 16320;", ptx))

    p = Problem(1, 1, 8192, 128)  # the long-sequence variant: overlap, 144-key tiles
    pinned = get_kernel("k6").compile(p, keep_ptx=True).ptx
    unpinned = get_kernel("k6").compile(p, keep_ptx=True, pin_descriptors=False).ptx
    assert len(re.findall(r"^\s*mov\.b64 %rd\d+, %rd\d+;", pinned, re.M)) == 2  # K and V
    assert not re.search(r"^\s*mov\.b64 %rd\d+, %rd\d+;", unpinned, re.M)
    assert extractions(pinned) <= extractions(unpinned) // 3, (extractions(pinned), extractions(unpinned))


def test_cluster_multicasts_k_and_v_in_static_non_causal_builds_only():
    # cluster=2: each CTA loads half of every K/V tile and multicasts it to both CTAs of the pair
    # (cp.async.bulk.tensor ... multicast::cluster), releases stages in both (mapa + a remote
    # mbarrier.arrive), and the pair syncs once after the barrier inits (barrier.cluster). Q stays local.
    for bad in (dict(causal=True), dict(causal=False, scheduler="single"), dict(causal=False, split_tail=True)):
        causal = bad.pop("causal")
        with pytest.raises(UnsupportedProblem, match="cluster"):
            _compile("k6", 128, causal=causal, cluster=2, **bad)
    with pytest.raises(UnsupportedProblem, match="cluster"):
        _compile("k6", 128, causal=False, cluster=3)
    with pytest.raises(UnsupportedProblem, match="ctas"):  # a grid of no whole cluster would run nothing
        _compile("k6", 128, causal=False, cluster=2, ctas=1)
    for d in (128, 256):
        ptx = _compile("k6", d, causal=False, cluster=2).ptx
        loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global[^;]*;", ptx)
        mcast = [ld for ld in loads if "multicast::cluster" in ld]
        assert mcast and len(loads) > len(mcast), loads  # Q's loads are not multicast
        assert re.search(r"mbarrier\.arrive\.shared::cluster", ptx) and "mapa.shared::cluster" in ptx
        assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
        assert not re.search(r"\bbar\.sync\s+0;", ptx)  # the cluster barrier replaces the CTA's
        assert all(spill == 0 for *_, spill in ptxas_report(ptx))
    assert "multicast::cluster" not in _compile("k6", 128, causal=False).ptx  # off by default
    # cluster=4 (a knob): the same loads, each CTA's quarter multicast to all four (CTA mask 0b1111)
    ptx = _compile("k6", 128, causal=False, cluster=4).ptx
    assert re.search(r"mov\.(u16|b16)\s+%rs\d+,\s*15;", ptx) and "multicast::cluster" in ptx
    assert all(spill == 0 for *_, spill in ptxas_report(ptx))
    assert re.search(r"mov\.(u16|b16)\s+%rs\d+,\s*3;", _compile("k6", 128, causal=False, cluster=2).ptx)
    with pytest.raises(UnsupportedProblem, match="ctas"):  # odd: one CTA would have no partner
        _compile("k6", 128, causal=False, cluster=2, ctas=7)
    with pytest.raises(UnsupportedProblem, match="ctas"):  # no cluster asked for (causal): still a clear refusal
        _compile("k6", 128, causal=True, ctas=0)
    # K6's default: d=128 from 4k keys, d=256 from 2k, non-causal, an even number of query tiles
    # per head (an odd one leaves the last pair's second CTA loading K/V for nothing), no ctas override.
    def cluster_of(problem, **cfg):
        return get_kernel("k6").compile(problem, **cfg).info.get("cluster")

    assert cluster_of(Problem(1, 1, 8192, 128)) == 2 and cluster_of(Problem(1, 1, 2048, 256)) == 2
    assert cluster_of(Problem(1, 1, 2048, 128)) is None and cluster_of(Problem(1, 1, 8192, 64)) is None
    assert cluster_of(Problem(1, 1, 8192, 128, causal=True)) is None
    assert cluster_of(Problem(1, 1, 4097, 128)) is None  # 33 query tiles
    assert cluster_of(Problem(4, 32, 128, 128, seqlen_k=8192)) is None  # a chunk of 128 queries: one tile
    assert cluster_of(Problem(1, 1, 8192, 128), ctas=6) is None and cluster_of(Problem(1, 1, 8192, 128), scheduler="single") is None
    for name in ("k7", "k8"):  # not checked on the FP8 tiles: refused there, as is the split tail
        with pytest.raises(UnsupportedProblem, match="cluster"):
            _compile(name, 128, causal=False, cluster=2)
        with pytest.raises(UnsupportedProblem, match="split_tail"):
            _compile(name, 128, causal=False, split_tail=True)
