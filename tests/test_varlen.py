"""Packed batches, windows and softcap (issue 35's groundwork, CPU): bad calls refused by name,
and the float64 reference agreeing with SDPA and with a brute-force definition."""

import math
import random
import re

import pytest
import torch

from harness import varlen
from kernels.contract import UnsupportedProblem


def _packed(lengths_q, lengths_k=None, heads=4, heads_kv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths_k = lengths_k or lengths_q
    q = torch.randn(sum(lengths_q), heads, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), heads_kv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(a, cu_q=a["cu_q"].long()), "cu_seqlens_q must be int32"),
    (lambda a: dict(a, cu_q=torch.tensor([0, 5, 3, 12], dtype=torch.int32)), "must not decrease: entry 2 \\(3\\) < entry 1"),
    (lambda a: dict(a, cu_q=torch.tensor([1, 5, 7, 12], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
    (lambda a: dict(a, cu_q=torch.tensor([0, 5, 7, 11], dtype=torch.int32)), "ends at 11, but the packed tensor has 12"),
    (lambda a: dict(a, cu_k=torch.tensor([0, 5, 12], dtype=torch.int32)), "cu_seqlens_k has 3 entries.*needs 4"),
    (lambda a: dict(a, cu_q=torch.tensor([[0, 5, 7, 12]], dtype=torch.int32)), "must be 1-D"),
    (lambda a: dict(a, max_q=4), "max_seqlen_q = 4 is less than sequence 0's length 5"),
    (lambda a: dict(a, max_k=5.0), "max_seqlen_k must be an int"),
    (lambda a: dict(a, q=a["q"][None]), "q must be packed as \\(total_tokens, heads, head_dim\\)"),
    (lambda a: dict(a, k=a["k"][:, :1]), "k and v must have one shape"),
    (lambda a: dict(a, q=a["q"][:, :3]), "heads_kv \\(2\\) must divide heads \\(3\\)"),
    (lambda a: dict(a, v=a["v"].float()), "q and k must share|must share a dtype"),
])
def test_a_bad_packed_call_is_refused_by_name(change, match):
    q, k, v, cu_q, cu_k = _packed([5, 2, 5])
    args = change(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=5, max_k=5))
    with pytest.raises(UnsupportedProblem, match=match):
        varlen.check_varlen(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"], args["max_q"], args["max_k"])


def test_a_good_packing_gives_its_lengths_empty_sequences_included():
    q, k, v, cu_q, cu_k = _packed([5, 0, 1, 7], [3, 4, 0, 9])
    assert varlen.check_varlen(q, k, v, cu_q, cu_k, 7, 9) == ([5, 0, 1, 7], [3, 4, 0, 9])


@pytest.mark.parametrize("window,match", [((-2, 0), ">= -1"), ((4,), "pair of ints"), ((True, 3), "pair of ints"),
                                          ((1.5, 3), "pair of ints"), ("left", "pair of ints")])
def test_a_bad_window_is_refused(window, match):
    with pytest.raises(UnsupportedProblem, match=match):
        varlen.as_window(window)


@pytest.mark.parametrize("softcap", [-1.0, math.nan, math.inf, True, "30"])
def test_a_bad_softcap_is_refused(softcap):
    with pytest.raises(UnsupportedProblem, match="softcap must be a finite number >= 0"):
        varlen.as_softcap(softcap)


def test_causal_is_the_window_whose_right_edge_is_zero():
    assert varlen.with_causal((-1, -1), True) == (-1, 0) and varlen.with_causal((8, 4), True) == (8, 0)
    assert varlen.with_causal((8, 4), False) == (8, 4) and varlen.as_window(None) == (-1, -1)
    # bottom-right: with 3 queries and 5 keys, query 0 sees keys 0..2 under causal
    keep = varlen.keep_mask(3, 5, (-1, 0))
    assert keep.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert varlen.keep_mask(4, 4, (1, 0)).sum(1).tolist() == [1, 2, 2, 2]


@pytest.mark.parametrize("causal", [False, True])
def test_the_packed_reference_is_sdpa_per_sequence(causal):
    lengths_q, lengths_k = [5, 1, 0, 9, 3], [5, 4, 2, 9, 7]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    out, lse = varlen.reference(q, k, v, cu_q, cu_k, 0.25, causal=causal)
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        if nq == 0:
            continue
        qs, ks, vs = (t[s:s + n].transpose(0, 1)[None] for t, s, n in ((q, q0, nq), (k, k0, nk), (v, k0, nk)))
        mask = varlen.keep_mask(nq, nk, (-1, 0)) if causal else None
        want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.25, enable_gqa=True)
        assert torch.allclose(out[q0:q0 + nq], want[0].transpose(0, 1), atol=1e-12)
        s = (qs[0] @ ks[0].repeat_interleave(2, 0).transpose(-1, -2)) * 0.25
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        assert torch.allclose(lse[:, q0:q0 + nq], torch.logsumexp(s, -1), atol=1e-12)


def test_the_reference_window_and_softcap_are_their_definitions():
    q, k, v, cu_q, cu_k = _packed([6], [9], heads=2, heads_kv=1, d=4, seed=3)
    out, lse = varlen.reference(q, k, v, cu_q, cu_k, 0.5, window=(2, 1), softcap=1.5)
    for h in range(2):
        for i in range(6):
            seen = [j for j in range(9) if i - 2 <= j - 3 <= i + 1]  # bottom-right: j' = j - (9 - 6)
            s = torch.stack([1.5 * torch.tanh(0.5 * (q[i, h] @ k[j, 0]) / 1.5) for j in seen])
            p = torch.softmax(s, 0)
            assert torch.allclose(out[i, h], sum(pj * v[j, 0] for pj, j in zip(p, seen)), atol=1e-12)
            assert math.isclose(lse[h, i], torch.logsumexp(s, 0), abs_tol=1e-12)


def test_a_query_that_sees_no_key_gets_zero_and_minus_inf():
    q, k, v, cu_q, cu_k = _packed([4], [4], heads=2, heads_kv=2, d=4)
    out, lse = varlen.reference(q, k, v, cu_q, cu_k, 1.0, window=(-1, -1))
    assert torch.isfinite(out).all()
    # a window that ends before a query's first key: (left 0, right 0) on 2 queries over 4 keys sees one key each
    out, lse = varlen.reference(q[:2], k, v, torch.tensor([0, 2], dtype=torch.int32), cu_k, 1.0, window=(0, 0))
    assert torch.allclose(out[0], v[2].double()) and torch.allclose(out[1], v[3].double())
    out, lse = varlen.reference(q, k[:0], v[:0], cu_q, torch.tensor([0, 0], dtype=torch.int32), 1.0)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 17), (100, 300), (300, 100), (257, 1000)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (32, 0), (0, 0), (64, 16), (-1, 40), (200, -1)])
def test_the_key_tile_range_is_exactly_the_tiles_some_row_sees(nq, nk, window):
    keep = varlen.keep_mask(nq, nk, window)
    tile_m, tile_n = 64, 48
    for m in range(-(-nq // tile_m)):
        rows = keep[m * tile_m:(m + 1) * tile_m]
        seen = {j // tile_n for j in range(nk) if rows[:, j].any()}
        first, last = varlen.key_tile_range(m, nq, nk, tile_m, tile_n, window)
        assert seen == set(range(first, last)), (m, first, last, sorted(seen))


# ---- the packed call (K5/K6) -----------------------------------------------------------------


def test_the_tile_list_has_every_sequences_tiles_heaviest_first():
    pairs = varlen.varlen_tiles([0, 300, 1, 128], [0, 300, 1, 1000], 128, causal=True)
    assert sorted(pairs) == [(1, 0), (1, 1), (1, 2), (2, 0), (3, 0)]  # none for the empty sequence
    assert pairs[0] == (3, 0)  # 128 queries on the last 128 of 1000 keys: the most keys to walk
    assert varlen.varlen_tiles([1000], [1000], 128, causal=False, window=(100, 0))[0][1] > 0  # window: equal-ish work


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 30)), (True, (200, -1))])
def test_the_backwards_key_tile_list_has_every_key_tile_once_heaviest_walk_first(causal, window):
    # K10's packed grid: one CTA per listed pair. A key tile left out would leave its dK/dV unwritten
    # (also the ones no query reaches: they write zeros); the walk lengths are the kernel's own bounds.
    from kernels.tiles import query_window_tiles

    rnd = random.Random(7)
    lengths_q = [rnd.choice((0, 1, 17, rnd.randint(1, 3000))) for _ in range(12)]
    lengths_k = [n + (rnd.randint(0, 300) if causal or i % 2 else 0) for i, n in enumerate(lengths_q)]
    pairs = varlen.varlen_key_tiles(lengths_q, lengths_k, 64, 128, causal, window)
    assert sorted(pairs) == [(b, n) for b, nk in enumerate(lengths_k) for n in range(-(-nk // 128))]
    walks = [(lambda lo_hi: lo_hi[1] - lo_hi[0])(query_window_tiles(n, lengths_q[b], lengths_k[b], 64, 128, causal,
                                                                     window)) for b, n in pairs]
    assert walks == sorted(walks, reverse=True) and walks[0] > 0
    # the deterministic mode's order: a key tile's CTA waits only for ones launched before it
    assert varlen.varlen_key_tiles(lengths_q, lengths_k, 64, 128, causal, window, heaviest_first=False) == sorted(pairs)


@pytest.mark.parametrize("name,kwargs,match", [
    ("k4", {}, "packed sequences \\(varlen\\) not supported by this kernel"),
    ("k6", dict(causal=True, lengths_k=[5, 1, 5]), "sequence 1 has 2 queries and 1 keys"),
    ("k6", dict(lengths_k=[5, 0, 5]), "sequence 1 has 2 queries and 0 keys"),
])
def test_a_packed_call_the_kernels_cannot_take_is_refused_by_name(name, kwargs, match):
    lengths_k = kwargs.pop("lengths_k", None)
    q, k, v, cu_q, cu_k = (t.to(torch.bfloat16) if t.is_floating_point() else t
                           for t in _packed([5, 2, 5], lengths_k, d=64))
    with pytest.raises(UnsupportedProblem, match=match):
        varlen.attention_varlen(name, q, k, v, cu_q, cu_k, 5, max(lengths_k or [5]), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(backward="k9"), "backward='k9' takes no packed sequences"),
    (dict(deterministic=True), "q must be a CUDA tensor"),  # the deterministic mode takes it: the device next
])
def test_a_packed_call_whose_backward_cannot_run_is_refused_before_the_forward(kwargs, match):
    d = kwargs.pop("d", 64)
    q, k, v, cu_q, cu_k = (t.to(torch.bfloat16).requires_grad_() if t.is_floating_point() else t
                           for t in _packed([5, 2, 5], d=d))
    deterministic = kwargs.pop("deterministic", False)
    torch.use_deterministic_algorithms(deterministic)
    try:
        with pytest.raises(UnsupportedProblem, match=match):
            varlen.attention_varlen("k6", q, k, v, cu_q, cu_k, 5, 5, **kwargs)
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_packed_backward_refuses_a_bad_lse_by_name():
    q, k, v, cu_q, cu_k = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _packed([5, 2, 5], d=64))
    with pytest.raises(UnsupportedProblem, match="lse must be a torch.float32 tensor of shape \\(4, 12\\)"):
        varlen.attention_varlen_backward(q, k, v, q, torch.zeros(12, 4), q, cu_q, cu_k, 5, 5)


def test_the_packed_backward_refuses_grads_it_cannot_store_by_tma():
    q, k, v, cu_q, cu_k = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _packed([5, 2, 5], d=64))
    lse = torch.zeros(q.shape[1], q.shape[0])
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # contiguous, 2 bytes off 16
    with pytest.raises(UnsupportedProblem, match="grads\\[1\\] must be 16-byte aligned"):
        varlen.attention_varlen_backward(q, k, v, q, lse, q, cu_q, cu_k, 5, 5,
                                         grads=(torch.empty_like(q), shifted, torch.empty_like(v)))


@pytest.mark.parametrize("causal", [False, True])
def test_k10_builds_the_packed_backward_at_d256_from_64_key_tiles(causal):
    from kernels.contract import Problem, compiled_ptx
    from kernels.k10 import compile_backward
    from harness.inspect_ptx import count_instructions

    p = Problem(4, 8, 1000, 256, causal=causal, nheads_kv=2, varlen=True)
    compiled = compile_backward(p, keep_ptx=True, overlap=True, dq_flat=True, ds_stmatrix=True, mask_edges=True)
    assert compiled[3]["tile_n"] == 64 and compiled[3]["dq_flat"]  # K10BackwardSplitD's: the key-tile table's unit
    counts = count_instructions(compiled_ptx(compiled[1]))
    assert counts["ld/st.local"] == 0 and re.search(r"cp\.reduce\.async\.bulk\.tensor[.a-z0-9:]*\.add",
                                                     compiled_ptx(compiled[1]))


@pytest.mark.parametrize("causal", [False, True])
def test_k10_builds_a_packed_backward_that_starts_each_sequence_at_its_rows(causal):
    from harness.inspect_ptx import count_instructions
    from kernels.contract import Problem, compiled_ptx
    from kernels.k10 import compile_backward

    p = Problem(4, 8, 1000, 128, causal=causal, nheads_kv=2, varlen=True)
    compiled = compile_backward(p, keep_ptx=True, overlap=True, dq_flat=True, ds_stmatrix=True)
    # flat dQ shares: a slot per packed query tile (packed_tile_start), written in 16-byte stores
    assert compiled[3]["dq_flat"] and len(re.findall(r"st\.shared\.v4\.[fb]32", compiled_ptx(compiled[1]))) == 8
    ptx, plain = compiled_ptx(compiled[1]), compiled_ptx(compile_backward(p.with_(varlen=False), keep_ptx=True)[1])
    counts = count_instructions(ptx)
    assert counts["cp.async.bulk.tensor"] > 0 and re.search(r"cp\.reduce\.async\.bulk\.tensor[.a-z0-9:]*\.add", ptx)
    assert counts["ld/st.local"] <= count_instructions(plain)["ld/st.local"] + 8  # a few spilled bytes at most
    # deterministic: the dQ writer takes turns on a semaphore per head and packed query tile
    det = compiled_ptx(compile_backward(p, keep_ptx=True, deterministic=True)[1])
    assert "ld.acquire.gpu" in det and re.search(r"red\.release\.gpu(\.global)?\.add\.[su]32", det)
    assert "ld.acquire.gpu" not in ptx


def test_each_packed_sequence_numbers_its_query_tiles_apart_from_the_others():
    # K10's deterministic semaphores: sequence b's tiles from packed_tile_start(first row, b), per head
    # a table of total // tile_m + sequences + 1; two sequences sharing one would wait on each other
    from kernels.tiles import packed_tile_start

    rnd = random.Random(11)
    for _ in range(300):
        lengths = [rnd.choice((0, 1, rnd.randint(1, 300))) for _ in range(rnd.randint(1, 12))]
        tile_m = rnd.choice((64, 128))
        starts = [sum(lengths[:b]) for b in range(len(lengths))]
        spans = [(packed_tile_start(r, b, tile_m), packed_tile_start(r, b, tile_m) + -(-n // tile_m))
                 for b, (r, n) in enumerate(zip(starts, lengths))]
        assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:]))
        assert spans[-1][1] <= sum(lengths) // tile_m + len(lengths) + 1


@pytest.mark.parametrize("d,causal", [(128, False), (128, True)])  # K6 takes clusters and a TMA store here, rectangular
def test_the_packed_kernel_builds_without_a_tma_store_or_clusters(d, causal):
    from kernels import get_kernel
    from kernels.contract import Problem

    compiled = get_kernel("k6").compile(Problem(16, 16, 16384, d, causal=causal, varlen=True), keep_ptx=True)
    assert not compiled.info["tma_store"] and compiled.info.get("cluster", 1) == 1
    assert compiled.info["scheduler"] == "dynamic"  # tiles of unequal work: claimed, not dealt round-robin
    rectangular = get_kernel("k6").compile(Problem(16, 16, 16384, d, causal=causal))
    assert causal or (rectangular.info["tma_store"] or rectangular.info.get("cluster", 1) > 1)
    # the sequence's first row comes from cu_seqlens: TMA boxes at any row, O stored row by row
    assert "cp.async.bulk.tensor" in compiled.ptx and not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared",
                                                                      compiled.ptx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[1000], [0, 17, 1, 300, 0, 1000, 128, 255], [4097, 64, 3]])
@pytest.mark.parametrize("name,features", [("k6", {}), ("k5", {}), ("k6", dict(softcap=5.0, window_size=(200, 0)))])
def test_the_packed_call_matches_the_float64_reference_sequence_by_sequence(d, causal, lengths, name, features):
    from harness.check import compare

    gen = torch.Generator(device="cuda").manual_seed(sum(lengths) + d)
    heads, heads_kv = 8, 2
    lengths_k = [n + (64 if i % 2 else 0) for i, n in enumerate(lengths)]  # keys outnumber queries in some
    q = torch.randn(sum(lengths), heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(sum(lengths_k), heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for x in (lengths, lengths_k))
    out, lse = varlen.attention_varlen(name, q, k, v, cu_q, cu_k, max(lengths) + 5, max(lengths_k) + 5, causal=causal,
                                       return_lse=True, **features)  # loose max_seqlen bounds, as flash-attn takes
    ref, ref_lse = varlen.reference(q, k, v, cu_q, cu_k, d ** -0.5, causal=causal, window=features.get("window_size"),
                                    softcap=features.get("softcap", 0.0))
    c = compare(out, ref, lse, ref_lse, "bfloat16", lse_slack=features.get("softcap", 0.0) * 2.0 ** -11)
    assert not c.verdict, c.verdict


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths,features", [([1000], {}), ([0, 17, 1, 300, 0, 1000, 128, 255], {}),
                                              ([0, 17, 1, 300, 0, 1000, 128, 255], dict(softcap=5.0, window=(100, 0)))])
def test_the_packed_backward_matches_float64_autograd_sequence_by_sequence(d, causal, lengths, features):
    from harness.check import check_varlen_backward_case

    lengths_k = [n + (64 if i % 2 else 0) for i, n in enumerate(lengths)]
    row = check_varlen_backward_case("k10_fa3", lengths, lengths_k, 8, 2, d, causal, features.get("softcap", 0.0),
                                     features.get("window", (-1, -1)))
    assert row["ok"], row["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_autograd_through_the_packed_call_gives_the_packed_backwards_gradients():
    q, k, v, cu_q, cu_k = (t.to("cuda", torch.bfloat16) if t.is_floating_point() else t.cuda()
                           for t in _packed([300, 0, 17, 1000], d=128))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen.attention_varlen("k6", *leaves, cu_q, cu_k, 1000, 1000, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    o, lse = varlen.attention_varlen("k6", q, k, v, cu_q, cu_k, 1000, 1000, causal=True, return_lse=True)
    want = varlen.attention_varlen_backward(q, k, v, o, lse, dout, cu_q, cu_k, 1000, 1000, causal=True)
    for leaf, g in zip(leaves, want):  # the same kernels on the same inputs: equal up to dQ's fp32 add order
        assert torch.allclose(leaf.grad.float(), g.float(), atol=2e-2, rtol=0), float((leaf.grad - g).abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (100, -1))])
def test_the_deterministic_packed_backward_repeats_bit_for_bit_and_stays_correct(causal, window):
    from harness.check import check_varlen_backward_case

    lengths = [0, 17, 1, 300, 0, 1000, 128, 255]
    q, k, v, cu_q, cu_k = (t.to("cuda", torch.bfloat16) if t.is_floating_point() else t.cuda()
                           for t in _packed(lengths, d=128))
    o, lse = varlen.attention_varlen("k6", q, k, v, cu_q, cu_k, 1000, 1000, causal=causal, window_size=window,
                                     return_lse=True)
    dout = torch.randn_like(o)
    torch.use_deterministic_algorithms(True, warn_only=True)  # the references' torch ops may have no such mode
    try:
        runs = [varlen.attention_varlen_backward(q, k, v, o, lse, dout, cu_q, cu_k, 1000, 1000, causal=causal,
                                                 window_size=window) for _ in range(3)]
        row = check_varlen_backward_case("k10_fa3", lengths, lengths, 8, 2, 128, causal, window=window)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    assert row["ok"], row["reason"]


def test_the_varlen_benchmark_packing_is_fixed_and_counts_only_real_work():
    from harness import varlen_bench

    lengths = varlen_bench.document_lengths()
    assert lengths == varlen_bench.document_lengths() and len(lengths) == 16
    assert all(64 <= n <= 16384 for n in lengths) and max(lengths) > 8 * min(lengths)  # mixed, not a rectangle
    assert varlen_bench.real_flops([3, 5], 2, 8, causal=False) == 4 * 2 * 8 * (9 + 25)
    assert varlen_bench.real_flops([4], 1, 1, causal=True) == 4 * 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_cu_seqlens_on_the_cpu_give_the_same_output_and_the_launch_writes_every_row(causal):
    lengths = [0, 300, 17, 1000, 1]
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    on_gpu = varlen.attention_varlen("k6", q, k, v, cu.cuda(), cu.cuda(), 1000, 1000, causal=causal)
    launch, out, lse = varlen.prepare_varlen("k6", q, k, v, cu, cu, 1000, 1000, causal=causal, return_lse=True)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    assert torch.equal(out, on_gpu) and not lse.isnan().any()
    ref, ref_lse = varlen.reference(q, k, v, cu.cuda(), cu.cuda(), 128 ** -0.5, causal=causal)
    assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_cu_seqlens_is_read_again_after_an_in_place_change():
    q = torch.zeros(12, 2, 16, device="cuda")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")
    assert varlen.check_varlen(q, q, q, cu, cu, 12, 12)[0] == [5, 7]
    assert varlen.check_varlen(q, q, q, cu, cu, 12, 12)[0] == [5, 7]  # kept: no second read
    cu[1] = 6
    assert varlen.check_varlen(q, q, q, cu, cu, 12, 12)[0] == [6, 6]
    cu[1:].fill_(13)
    with pytest.raises(UnsupportedProblem, match="ends at 13"):
        varlen.check_varlen(q, q, q, cu, cu, 12, 12)
    with torch.inference_mode():
        frozen = torch.tensor([0, 3, 12], dtype=torch.int32, device="cuda")
        assert varlen.check_varlen(q, q, q, frozen, frozen, 12, 12)[0] == [3, 9]


def test_packed_row_starts_are_aligned_disjoint_and_fit_the_padded_buffer():
    import random

    from kernels.tiles import ROW_ALIGN, packed_row_start

    rnd = random.Random(7)
    for _ in range(300):
        lengths = [rnd.choice((0, 1, rnd.randint(0, 9), rnd.randint(0, 300))) for _ in range(rnd.randint(1, 12))]
        firsts = [sum(lengths[:b]) for b in range(len(lengths))]
        spans = [(packed_row_start(f, b), packed_row_start(f, b) + n) for b, (f, n) in enumerate(zip(firsts, lengths))]
        assert all(start % ROW_ALIGN == 0 for start, _ in spans)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no two sequences share a row
        assert spans[-1][1] <= sum(lengths) + ROW_ALIGN * len(lengths)


@pytest.mark.parametrize("misaligned", [False, True])
def test_the_packed_backward_hands_do_and_o_over_as_views_of_their_rows(misaligned):
    # The launches stubbed: what run_varlen_backward passes them (on the CPU: it only lays tensors out).
    from kernels import k10

    total, heads, d = 12, 2, 64
    o, do = (torch.randn(total, heads, d, dtype=torch.bfloat16) for _ in range(2))
    if misaligned:  # contiguous, 2 bytes off 16: the kernels' 16-byte loads would not take it
        do = torch.cat([torch.zeros(1, dtype=do.dtype), do.flatten()])[1:].view(total, heads, d)
    seen = {}

    def pre(o_, do_, *rest):
        seen.update(o=o_, do=do_)

    def main(q_, k_, v_, do_, *rest):
        seen["main_do"] = do_

    cfg = dict(tile_m=64, dq_flat=True, deterministic=False)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    k10.run_varlen_backward((pre, main, lambda *a: None, cfg), o, o, o, o, torch.zeros(heads, total), do, 0.125,
                            cu, cu, 7, None)
    assert seen["do"] is seen["main_do"] and seen["do"].shape == (1, heads, total, d)
    assert seen["do"].stride() == (total * heads * d, d, heads * d, 1)  # (total, heads, d) rows, not a transposed copy
    assert seen["o"].data_ptr() == o.data_ptr()
    assert (seen["do"].data_ptr() == do.data_ptr()) != misaligned and seen["do"].data_ptr() % 16 == 0
    assert torch.equal(seen["do"][0].transpose(0, 1), do)
