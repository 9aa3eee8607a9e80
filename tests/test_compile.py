"""Every registered kernel compiles for sm_90a on the CPU, and its PTX holds what its stage claims.

Without a GPU, ``kernels`` sets CUTE_DSL_ARCH=sm_90a; the DSL compiles against fake tensors with
symbolic batch/heads/seqlen, so these run anywhere the DSL installs.
"""

import re

import pytest

from harness.inspect_ptx import count_instructions, wgmma_a_sources
from kernels import get_kernel, kernel_names
from kernels.contract import Problem, UnsupportedProblem

# The instructions each stage introduces, at least once, and what it must not contain yet.
CLAIMS = {
    "k1": dict(has=["ld.global", "st.global", "ex2.approx"],
               lacks=["ld.shared", "cp.async.bulk.tensor", "wgmma.mma_async"]),
    "k2": dict(has=["ld.shared", "st.shared", "shfl.sync", "ex2.approx"],
               lacks=["cp.async.bulk.tensor", "wgmma.mma_async"]),
    "k3": dict(has=["cp.async.bulk.tensor", "mbarrier", "shfl.sync", "ex2.approx"], lacks=["wgmma.mma_async"]),
    "k4_qk": dict(has=["cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async"], lacks=["setmaxnreg"]),
    "k4": dict(has=["cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async"], lacks=["setmaxnreg"]),
    "k5": dict(has=["cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async", "setmaxnreg"], lacks=["e4m3 wgmma"]),
    "k6_pp": dict(has=["cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async", "setmaxnreg"], lacks=["e4m3 wgmma"]),
    "k6_overlap": dict(has=["cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async", "setmaxnreg"], lacks=["e4m3 wgmma"]),
    "k6": dict(has=["cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async", "setmaxnreg"], lacks=["e4m3 wgmma"]),
}
CLAIMS["k4_seed"] = CLAIMS["k4"]  # the same kernel at K4.1's tile shape
# K7: K6's kernel in FP8 (every WGMMA e4m3: checked below); k7_k4 the same seams on K4's loop.
CLAIMS["k7"] = dict(has=["cp.async.bulk.tensor", "mbarrier", "e4m3 wgmma", "setmaxnreg"], lacks=[])
CLAIMS["k7_k4"] = dict(has=["cp.async.bulk.tensor", "mbarrier", "e4m3 wgmma"], lacks=["setmaxnreg"])
CLAIMS["k8"] = CLAIMS["k7"]  # K7's kernel with a descale per tile
# Flash decode: K4's loads and GEMMs at one warpgroup, launched with PDL (griddepcontrol); these
# small problems need no split, the split paths are checked below.
CLAIMS["decode"] = dict(has=["cp.async.bulk.tensor", "mbarrier", "wgmma.mma_async", "griddepcontrol"],
                        lacks=["setmaxnreg"])
CLAIMS["decode_combine"] = CLAIMS["decode"]
CLAIMS["decode_nosplit"] = CLAIMS["decode"]


def claims_for(name):
    return CLAIMS[name.split("_")[0] if name.startswith("k3") else name]


def variants(name):
    caps = get_kernel(name).caps
    dims = [d for d in caps.head_dims if d in (64, 128)]
    for d in dims:
        for causal in (False, True):
            yield Problem(1, 1, 128, d, dtype="bfloat16", causal=causal)
    if "float16" in caps.dtypes:
        yield Problem(1, 1, 128, dims[-1], dtype="float16", causal=True)
    for d in caps.head_dims:  # every other head dim the kernel claims: one variant each
        if d not in dims:
            yield Problem(1, 1, 128, d, dtype="bfloat16", causal=True)


CASES = [(n, p) for n in kernel_names() for p in variants(n)]


@pytest.mark.parametrize("name,problem", CASES, ids=[f"{n}-d{p.head_dim}-c{int(p.causal)}-{p.dtype}" for n, p in CASES])
def test_compiles_with_stage_instructions(name, problem):
    compiled = get_kernel(name).compile(problem, keep_ptx=True)
    assert compiled.ptx and ".target sm_90a" in compiled.ptx
    counts = count_instructions(compiled.ptx)
    claims = claims_for(name)
    for instr in claims["has"]:
        assert counts[instr] > 0, f"{name}: expected {instr} in PTX"
    for instr in claims["lacks"]:
        assert counts[instr] == 0, f"{name}: {instr} belongs to a later stage"
    assert counts["ld/st.local"] == 0, f"{name}: local memory (spills or dynamic register indexing)"


def test_k1_has_three_launches():
    ptx = get_kernel("k1").compile(Problem(1, 1, 64, 64), keep_ptx=True).ptx
    assert len(re.findall(r"\.entry\s", ptx)) == 3


def _wgmma_shapes(ptx):
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)", ptx))


@pytest.mark.skipif("k4_qk" not in kernel_names(), reason="k4_qk not built yet")
def test_k4_qk_uses_wgmma_for_qk_only():
    # QK^T contracts over d: one WGMMA shape; PV stays on CUDA cores (FFMA loop, no second GEMM).
    ptx = get_kernel("k4_qk").compile(Problem(1, 1, 128, 128), keep_ptx=True).ptx
    assert len(_wgmma_shapes(ptx)) == 1


@pytest.mark.parametrize("name", ["k4_seed", "k4"])
def test_k4_uses_wgmma_for_both_gemms(name):
    # PV's A operand comes from registers (P never touches SMEM): a register-A WGMMA must appear
    # beside the SMEM-A one used for QK^T.
    ptx = get_kernel(name).compile(Problem(1, 1, 128, 128), keep_ptx=True).ptx
    wgmmas = wgmma_a_sources(ptx)
    assert "{" in wgmmas, "no WGMMA with A from registers (the PV GEMM)"
    assert "%rd" in wgmmas, "no WGMMA with A from SMEM (the QK GEMM)"


def test_k4_seed_is_the_seed_config_and_refuses_d256_for_smem():
    from kernels import k4

    entry = get_kernel("k4_seed")
    assert entry.variant == k4.SEED_CONFIG
    assert entry.caps.head_dims == (64, 128)
    with pytest.raises(UnsupportedProblem, match=r"d=256 needs \d+ KB of SMEM"):
        entry.compile(Problem(1, 1, 128, 256))


@pytest.mark.skipif("k3_3" not in kernel_names(), reason="k3 not built yet")
def test_k3_pipeline_depth_shows_in_mbarriers():
    # Q's full/empty pair plus one full/empty pair per KV stage.
    counts = [len(re.findall(r"\bmbarrier\.init\.", get_kernel(n).compile(Problem(1, 1, 128, 64), keep_ptx=True).ptx))
              for n in ("k3_1", "k3_2", "k3_3")]
    assert counts[0] < counts[1] < counts[2], counts


def test_keep_ptx_leaves_no_folder_behind(tmp_path, monkeypatch):
    import tempfile

    from kernels import contract

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the DSL's PTX dump would land here
    monkeypatch.setattr(contract, "_JIT_CACHE", {})  # compile afresh, whatever ran before
    ptx = get_kernel("k2").compile(Problem(1, 1, 64, 64), keep_ptx=True).ptx
    assert ".target sm_90a" in ptx  # read into memory before the folder went
    assert list(tmp_path.iterdir()) == []


def test_smem_bytes_counts_the_shared_storage():
    # One SMEM budget: tma_pipeline.smem_bytes (used by every stage's capabilities) must equal the
    # size of the struct the launchers allocate, for K3's, K4.1's and K4's layouts.
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    from kernels import tma_pipeline

    sizes = []

    @cute.jit
    def probe():
        dt, d = cutlass.BFloat16, 128
        plain_q, plain_kv = tma_pipeline.row_major(64, d), tma_pipeline.row_major(64, d, 5)
        sQ = cute.select(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (128, 128, d), dt, 1), mode=[0, 1])
        sK = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (128, 128, d), dt, 2)
        sQ2 = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (128, 128, d), dt, 2)  # K5: two Q stages
        sVt = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (128, d, 128), dt, 2)
        for struct, budget in (
            (tma_pipeline.shared_storage(dt, plain_q, plain_kv, plain_kv, 5, swizzled="", score_tile=(64, 64)),
             tma_pipeline.smem_bytes(64, 64, d, 2, 5, swizzled="", score_tile=True)),
            (tma_pipeline.shared_storage(dt, sQ, sK, sVt, 2), tma_pipeline.smem_bytes(128, 128, d, 2, 2)),
            (tma_pipeline.shared_storage(dt, sQ, sK, sVt, 2, kv_pipelines=2),
             tma_pipeline.smem_bytes(128, 128, d, 2, 2, kv_pipelines=2)),
            (tma_pipeline.shared_storage(dt, sQ2, sK, sVt, 2, kv_pipelines=2, q_stages=2, tile_slots=2),
             tma_pipeline.smem_bytes(128, 128, d, 2, 2, kv_pipelines=2, q_stages=2, tile_slots=2)),
        ):
            sizes.append((struct.size_in_bytes(), budget))

    probe()
    assert len(sizes) == 4 and all(a == b for a, b in sizes), sizes


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_split_has_a_pdl_combine(head_dim):
    # A forced split compiles the partial-writing kernel and the combine: two modules, each with
    # its griddepcontrol (the combine waits for the main kernel), no spills.
    from harness.inspect_ptx import split_modules

    p = Problem(1, 32, 1, head_dim, nheads_kv=8, seqlen_k=32768)
    compiled = get_kernel("decode_combine").compile(p, keep_ptx=True, num_splits=4)
    modules = split_modules(compiled.ptx)
    assert compiled.info["num_splits"] == 4 and len(modules) == 2
    for module in modules:
        counts = count_instructions(module)
        assert counts["griddepcontrol"] >= 1 and counts["ld/st.local"] == 0
    assert count_instructions(modules[0])["wgmma.mma_async"] > 0


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_merges_in_the_main_kernel(head_dim):
    # decode merges in the main kernel: one module, no combine launch, the split counter bumped
    # with an acq_rel atomic between two gpu-scope fences (last_cta). The last_split variant:
    # every split but the last counts itself done with a release reduction (nothing to wait
    # for), the last split polls the count with acquire loads; no atomic with a result.
    from harness.inspect_ptx import split_modules

    p = Problem(1, 32, 1, head_dim, nheads_kv=8, seqlen_k=32768, causal=True)
    compiled = get_kernel("decode").compile(p, keep_ptx=True, num_splits=4)
    assert compiled.info["merge"] == "last_cta" and len(split_modules(compiled.ptx)) == 1
    assert re.search(r"atom\.global\.acq_rel\.add", compiled.ptx)  # gpu scope is the default
    assert compiled.ptx.count("fence.acq_rel.gpu") == 2 and "red.release" not in compiled.ptx
    assert count_instructions(compiled.ptx)["ld/st.local"] == 0
    from kernels import decode

    last_split = decode.compile_kernel(p, keep_ptx=True, num_splits=4, merge="last_split").ptx
    assert len(split_modules(last_split)) == 1 and re.search(r"red\.release\.gpu\.global\.add", last_split)
    # no atomic with a result but the claims' relaxed adds (claim_after)
    assert re.search(r"ld\.acquire\.gpu\.global", last_split) and not re.search(r"atom\.\S*(acq|rel)", last_split)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_prefetches_into_l2_before_the_pdl_wait(head_dim):
    # The default config pulls each split's first tiles into L2 (TMA prefetch, one elected
    # thread) before griddepcontrol.wait, aimed by a length read past L1 (ld.global.cg); the real
    # length is read after the wait. With l2_prefetch=0 there is no prefetch at all.
    from kernels import decode

    p = Problem(1, 32, 1, head_dim, nheads_kv=8, seqlen_k=32768)
    ptx = get_kernel("decode").compile(p, keep_ptx=True, num_splits=4).ptx
    wait = ptx.index("griddepcontrol.wait")
    prefetches = [m.start() for m in re.finditer(r"cp\.async\.bulk\.prefetch\.tensor\.\S*L2", ptx)]
    assert decode.config(head_dim)["l2_prefetch"] > 0 and prefetches and max(prefetches) < wait
    # one elected thread: an elect.sync after the CTA barrier that follows the mbarrier init
    assert ptx.rfind("elect.sync", 0, min(prefetches)) > ptx.rfind("bar.sync", 0, min(prefetches)) > 0
    # The ordinary contract has no cache lengths: the hint load exists only in the KV-cache build.
    lens = decode.compile_decode(head_dim, "bfloat16", False, 4, True, True, keep_ptx=True, merge="last_cta",
                                 **decode.config(head_dim))
    from kernels.contract import compiled_ptx

    lens_ptx = compiled_ptx(lens)
    assert lens_ptx.index("ld.global.cg") < lens_ptx.index("griddepcontrol.wait")
    off = get_kernel("decode").compile(p, keep_ptx=True, num_splits=4, l2_prefetch=0).ptx
    assert "cp.async.bulk.prefetch.tensor" not in off
    # prefetch_after_wait: more hints once the wait is over, none there by default
    after = get_kernel("decode").compile(p, keep_ptx=True, num_splits=4, prefetch_after_wait=4, claim_after=0).ptx
    hints = re.compile(r"cp\.async\.bulk\.prefetch\.tensor")
    assert decode.config(head_dim)["prefetch_after_wait"] == 0 and not hints.search(ptx, wait)
    assert hints.search(after, after.index("griddepcontrol.wait"))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("merge", ["last_cta", "last_split"])
def test_decode_claiming_takes_tiles_off_a_counter(head_dim, merge):
    # claim_after: one relaxed atomic add per claimed tile (by lane 0 of the producer warp, its
    # answer broadcast by a shuffle), each tile's index posted in an SMEM slot through K5's
    # tile-index pipeline (mbarriers with plain arrives, no bytes). On by default at
    # d=64/128; no spills; refused with the two-kernel merge, whose combine cannot reset the
    # counter (decode_combine walks fixed shares).
    from kernels import decode

    p = Problem(1, 32, 1, head_dim, nheads_kv=8, seqlen_k=32768)
    fixed = decode.compile_kernel(p, keep_ptx=True, num_splits=16, merge=merge, claim_after=0).ptx
    claim = decode.compile_kernel(p, keep_ptx=True, num_splits=16, merge=merge, claim_after=4)
    relaxed_add = re.compile(r"atom\.global\.add\.u32")  # no .sem: relaxed
    assert not relaxed_add.search(fixed)
    default = get_kernel("decode").compile(p, keep_ptx=True, num_splits=16).ptx
    assert bool(relaxed_add.search(default)) == (head_dim != 256) == (decode.config(head_dim)["claim_after"] > 0)
    assert not relaxed_add.search(get_kernel("decode_combine").compile(p, keep_ptx=True, num_splits=16).ptx)
    assert len(relaxed_add.findall(claim.ptx)) >= 2 and "shfl.sync.idx" in claim.ptx
    assert re.search(r"mbarrier\.arrive\.shared\.b64", claim.ptx)  # the tile slots' arrives
    assert count_instructions(claim.ptx)["ld/st.local"] == 0
    # the tile slots and their mbarriers on top of the fixed shares' SMEM (often inside the padding
    # before the 1 KB-aligned Q buffer)
    cfg = decode.config(head_dim)
    fixed_smem = decode.compile_kernel(p, num_splits=16, merge=merge, claim_after=0).info["smem_bytes"]
    assert claim.info["smem_bytes"] == decode.smem_bytes(head_dim, cfg["tile_n"], cfg["kv_stages"], merge=merge,
                                                         claim=True) >= fixed_smem
    with pytest.raises(UnsupportedProblem, match="in-kernel merge"):
        decode.compile_kernel(p, num_splits=16, merge="combine", claim_after=4)
    for bad in (-1, True, 2.0):
        with pytest.raises(UnsupportedProblem, match="claim_after must be"):
            decode.compile_kernel(p, num_splits=16, claim_after=bad)
    with pytest.raises(UnsupportedProblem, match="prefetch_after_wait act on the fixed shares"):
        decode.compile_kernel(p, num_splits=16, claim_after=4, prefetch_after_wait=2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("pages", ["whole tiles", "smaller than a tile"])
def test_decode_on_a_paged_cache_looks_pages_up(head_dim, pages):
    # A paged cache: TMA boxes (4-D: rows, d, K/V heads, pages), each aimed at a page read from
    # the table. Before the PDL wait the prefetch reads its pages past L1 as it reads the length
    # (two ld.global.cg instead of one), lane i looking up box i (a shuffle hands each out). A
    # page smaller than the tile keeps the tile and fills it with one box per page: more TMA
    # copies per stage, the same SMEM. No local memory in the PTX (ptxas itself spills 16-20 bytes at
    # d = 64 with pages below the tile, where the 256-key tile already takes 255 registers).
    from kernels import decode
    from kernels.contract import compiled_ptx

    tile = decode.config(head_dim)["tile_n"]
    page = 2 * tile if pages == "whole tiles" else decode.MIN_PAGE
    builds = {}
    for page_size in (0, page):
        la = decode.make_launcher(head_dim, "bfloat16", True, 4, 16, True, keep_ptx=True, merge="last_cta",
                                  claim_after=0, page_size=page_size)
        builds[page_size] = (la.config, compiled_ptx(la.main))
    (flat_cfg, flat), (cfg, ptx) = builds[0], builds[page]
    assert cfg["tile_n"] == flat_cfg["tile_n"] == tile and cfg["kv_stages"] == flat_cfg["kv_stages"]
    assert cfg["page_boxes"] == max(tile // page, 1) and "page_boxes" not in flat_cfg
    for x in (flat, ptx):
        assert set(re.findall(r"cp\.async\.bulk\.tensor\.(\d)d", x)) == {"4"}
    copies = [count_instructions(x)["cp.async.bulk.tensor"] for x in (flat, ptx)]
    assert copies[1] == copies[0] * cfg["page_boxes"]
    hint = lambda x: len(re.findall(r"ld\.global\.cg", x[:x.index("griddepcontrol.wait")]))
    assert hint(flat) == 1 and hint(ptx) == 2
    assert count_instructions(ptx)["shfl.sync"] > count_instructions(flat)["shfl.sync"]
    assert count_instructions(ptx)["ld.global"] > count_instructions(flat)["ld.global"]
    assert count_instructions(ptx)["ld/st.local"] == 0
    with pytest.raises(UnsupportedProblem, match="not written for a paged cache"):
        decode.make_launcher(head_dim, "bfloat16", False, 4, 16, True, claim_after=0, prefetch_ahead=2,
                             page_size=page)
    if pages != "whole tiles":
        # A page smaller than the tile (one box per page) is addressed as (0, page): no division per
        # copy, so there are no more integer divisions than in the contiguous kernel, however many
        # boxes (a flat index divided per copy: 3.57 -> 4.21 TB/s at d=128 with 16-key pages once
        # gone, docs/decode.md).
        half = decode.make_launcher(head_dim, "bfloat16", True, 4, 16, True, keep_ptx=True, merge="last_cta",
                                    claim_after=0, page_size=tile // 2)
        divisions = [len(re.findall(r"\b(div|rem)\.", x)) for x in (flat, compiled_ptx(half.main), ptx)]
        assert divisions[0] == divisions[1] == divisions[2]
    if pages != "whole tiles":  # more stages of boxes than the producer warp has lanes to look them up
        with pytest.raises(UnsupportedProblem, match="fewer stages"):
            decode.make_launcher(head_dim, "bfloat16", False, 4, 16, True, claim_after=0,
                                 kv_stages=32 // cfg["page_boxes"] + 1, page_size=page)


@pytest.mark.parametrize("name", ["k7_k4", "k7", "k8"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_stages_run_both_gemms_in_e4m3(name, head_dim):
    # Every WGMMA is e4m3 x e4m3 with an fp32 accumulator: QK (m64n{tile_n}k32, A from SMEM) and
    # PV (m64n{d}k32, A from registers); P is narrowed by paired cvt...e4m3x2 and never permuted
    # across lanes (no prmt, no extra shuffles: the key order lives in V^T instead).
    ptx = get_kernel(name).compile(Problem(1, 1, 128, head_dim, causal=True), keep_ptx=True).ptx
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k(\d+)\.f32\.(\w+)\.(\w+)", ptx)
    assert wgmma and all(k == "32" and a == b == "e4m3" for _, k, a, b in wgmma)
    assert str(head_dim) in {n for n, *_ in wgmma}
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "prmt" not in ptx


def test_k7_on_k4_overrides_start_from_its_own_tiles():
    # k7_k4 runs one more K/V stage than K4 (8-bit tiles); an override changes only what it names.
    from kernels import k7

    p = Problem(1, 1, 128, 128)
    info = get_kernel("k7_k4").compile(p, tile_n=64).info
    assert info["tile_n"] == 64 and info["kv_stages"] == k7.K4_CONFIG[128]["kv_stages"]
    assert get_kernel("k7_k4").compile(p).info["kv_stages"] == k7.K4_CONFIG[128]["kv_stages"]
