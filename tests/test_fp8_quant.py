"""K8's quantizers on the CPU: the rotation is orthogonal and keeps Q K^T, block scales stay
local, and the arithmetic the CuTe kernels must match is what the docstring says."""

import math

import re

import pytest
import torch

from kernels import sm90
from kernels.fp8_quant import (
    E4M3_MAX,
    fwht,
    hadamard_matrix,
    hadamard_signs,
    quantize_fp8_blocks,
    rotate,
)
from kernels.k7 import fp8_key_permutation


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwht_is_the_sylvester_hadamard_product(d):
    x = torch.randn(3, d, dtype=torch.float64)
    assert torch.allclose(fwht(x.float()).double(), x @ hadamard_matrix(d), atol=1e-4)
    h = hadamard_matrix(d)
    assert torch.equal(h @ h.T, d * torch.eye(d, dtype=torch.float64))


def test_fwht_refuses_a_dim_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of 2"):
        fwht(torch.randn(2, 96))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_rotation_is_orthogonal_and_keeps_scores(d):
    s = hadamard_signs(d, seed=3)
    assert set(s.tolist()) == {-1.0, 1.0} and torch.equal(s, hadamard_signs(d, seed=3))
    q, k = torch.randn(2, 1, 40, d), torch.randn(2, 1, 50, d)
    qr, kr = rotate(q, s), rotate(k, s)
    assert torch.allclose(qr @ kr.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-3)
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), rtol=1e-5)


def test_rotation_spreads_an_outlier():
    d = 128
    x = torch.zeros(1, 1, 1, d)
    x[..., 5] = 100.0
    y = rotate(x, hadamard_signs(d))
    assert torch.allclose(y.abs(), torch.full_like(y, 100 / math.sqrt(d)), rtol=1e-6)


def test_block_scales_are_local_and_fill_the_range():
    x = torch.randn(2, 3, 300, 64)
    x[1, 2, 130, 7] = 1000.0  # an outlier in block 1 of (1, 2) only
    x8, descale = quantize_fp8_blocks(x, 128)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (2, 3, 3) and descale.dtype == torch.float32
    assert float(descale[1, 2, 1]) == pytest.approx(1000.0 / E4M3_MAX)
    assert float(descale[1, 2, 0]) < 0.02 and float(descale[1, 2, 2]) < 0.02
    blocks = x8.float().abs().reshape(2, 3, -1)
    for b in range(2):
        for h in range(3):
            for lo, hi in ((0, 128), (128, 256), (256, 300)):
                assert float(x8[b, h, lo:hi].float().abs().max()) == E4M3_MAX  # amax maps to 448 exactly
    back = x8.float() * descale.repeat_interleave(128, dim=-1)[..., :300, None]
    assert torch.allclose(back, x, rtol=2**-4, atol=float(descale.max()) * 2**-9)
    assert not blocks.isnan().any()


def test_block_arithmetic_is_the_documented_one():
    x = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    s = hadamard_signs(64)
    x8, descale = quantize_fp8_blocks(x, 32, signs=s)
    y = rotate(x, s)
    amax = torch.stack([y[:, :, i:i + 32].abs().amax(dim=(-1, -2)) for i in range(0, 70, 32)], dim=-1)
    scale = torch.full_like(amax, E4M3_MAX) / amax  # a true division (a number over a tensor is not)
    assert torch.equal(descale, scale.reciprocal())
    want = (y * scale.repeat_interleave(32, dim=-1)[..., :70, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(x8.view(torch.uint8), want.view(torch.uint8))


def test_an_all_zero_block_gets_descale_one_not_nan():
    x = torch.randn(1, 1, 256, 64)
    x[:, :, 128:] = 0
    x8, descale = quantize_fp8_blocks(x, 128)
    assert float(descale[0, 0, 1]) == 1.0 and not x8.float().isnan().any()


def test_v_blocks_come_transposed_in_the_p_key_order():
    # K8's pre-pass: V quantized per block of 16 keys, then K7's V^T; v's descales end each row.
    from kernels.k8 import prepare_fp8_blocks

    v = torch.randn(1, 2, 37, 64)
    _, _, vt8, rows = prepare_fp8_blocks(v, v, v, 16, 16, rotate=False)
    descale = rows[..., -3:]
    v8, want_descale = quantize_fp8_blocks(v, 16)
    assert torch.equal(descale, want_descale) and vt8.shape == (1, 2, 64, 48)
    perm = fp8_key_permutation(37)
    assert sorted(sm90.FP8_KEY_ORDER) == list(range(16))
    for p in range(48):
        col = vt8.view(torch.uint8)[0, 1, :, p]
        want = v8.view(torch.uint8)[0, 1, perm[p]] if perm[p] < 37 else torch.zeros(64, dtype=torch.uint8)
        assert torch.equal(col, want)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_quantizer_kernel_compiles_to_e4m3_conversions_and_butterfly_shuffles(d):
    import re

    from harness.inspect_ptx import ptxas_report
    from kernels.contract import compiled_ptx
    from kernels.fp8_quant import compile_quantize_blocks

    from kernels.fp8_quant import QuantizeBlocks

    ptx = compiled_ptx(compile_quantize_blocks(d, 128, True, "bfloat16", keep_ptx=True))
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx  # IEEE division, as torch's
    # 5 cross-lane butterfly stages x E = d/32 values, once per row a warp holds (the rows are
    # unrolled: each row is rotated once, kept in registers), + the amax reduce
    rows = QuantizeBlocks(d, 128, True).rows_per_warp
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == rows * 5 * (d // 32) + 5
    report = ptxas_report(ptx)
    assert all(spill == 0 for _, _, _, spill in report), report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("n", [1, 17, 1000, 4097])
def test_quantizer_kernel_is_bit_exact_against_torch(d, n):
    from kernels.fp8_quant import quantize_fp8_blocks_cute, quantize_fp8_blocks_torch

    x = torch.randn(2, 3, n, d, device="cuda")
    x += torch.randn_like(x) * 10 * (torch.rand_like(x) < 1e-3)
    x = x.bfloat16()
    if n > 128:
        x[1, 2, 128:256] = 0  # an all-zero block
    for signs, block in ((hadamard_signs(d, device="cuda"), 128), (None, 64), (hadamard_signs(d, device="cuda"), 192)):
        x8, descale = quantize_fp8_blocks_cute(x, block, signs)
        want8, want_descale = quantize_fp8_blocks_torch(x, block, signs)
        assert torch.equal(descale, want_descale)
        assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))
        assert not x8.float().isnan().any()


@pytest.mark.parametrize("d", [64, 128, 256])
def test_per_tensor_quantizer_compiles_to_wide_loads_and_e4m3_conversions(d):
    from harness.inspect_ptx import ptxas_report
    from kernels.contract import compiled_ptx
    from kernels.fp8_quant import QuantizeTensors, compile_quantize_tensors

    import re

    amax, cast = (compiled_ptx(f) for f in compile_quantize_tensors(d, 3, "bfloat16", keep_ptx=True))
    rows = QuantizeTensors(d, 3).rows_per_warp

    def row_loads(ptx):  # E = d/32 bf16 values a lane: one load of 2E bytes per row
        widths = [int(v or 1) * int(bits) // 8 for v, bits in re.findall(r"ld\.global\.(?:v(\d)\.)?b(\d+)", ptx)]
        return widths.count(2 * d // 32)

    # each of the three tensors: every row of the warp loaded at once (the cast also reads a partial)
    assert row_loads(amax) == 3 * rows and row_loads(cast) in (3 * rows, 3 * rows + 1)
    assert "cvt.rn.satfinite.e4m3x2.f32" not in amax and "cvt.rn.satfinite.e4m3x2.f32" in cast
    assert all(spill == 0 for _, _, _, spill in ptxas_report(amax) + ptxas_report(cast))


def test_per_tensor_arithmetic_is_the_block_quantizers_with_one_block():
    from kernels.fp8_quant import quantize_fp8_blocks_torch, quantize_fp8_torch

    x = torch.randn(2, 3, 50, 64, dtype=torch.bfloat16) * 5
    x8, descale = quantize_fp8_torch(x)
    flat = x.reshape(1, 1, -1, 64)
    want8, want = quantize_fp8_blocks_torch(flat, flat.shape[2])
    assert torch.equal(x8.view(torch.uint8).reshape(-1), want8.view(torch.uint8).reshape(-1))
    assert descale.shape == () and float(descale) == float(want.reshape(()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("n", [1, 17, 1000, 4097])
def test_per_tensor_quantizer_kernel_is_bit_exact_against_torch(d, n):
    from kernels.fp8_quant import quantize_fp8_tensors, quantize_fp8_torch

    q = torch.randn(2, n, 4, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # strided heads
    k, v = (torch.randn(2, 2, n + 5, d, device="cuda", dtype=torch.bfloat16) * s for s in (3.0, 0.01))
    k[0, 1, 0, 0] = 200.0  # an outlier sets k's scale alone
    for xs in ((q, k, v), (k,)):
        outs, descales = quantize_fp8_tensors(*xs)
        assert descales.shape == (len(xs),)
        for x, x8, descale in zip(xs, outs, descales):
            want8, want = quantize_fp8_torch(x)
            assert torch.equal(descale, want)
            assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8))
    zero8, zero = quantize_fp8_tensors(torch.zeros(1, 1, 3, d, device="cuda", dtype=torch.float16))
    assert float(zero) == 1.0 and not zero8[0].float().any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_v_transpose_with_descales_writes_the_torch_rows():
    from kernels.fp8_quant import descale_rows
    from kernels.k7 import transpose_v_fp8, transpose_v_with_descales

    dq, dk, dv = torch.rand(2, 8, 5) + 0.1, torch.rand(2, 2, 9) + 0.1, torch.rand(2, 2, 9) + 0.1
    dq[1, 3, 2], dk[0, 1, 4], dv[1, 0, 8] = -1.0, float("nan"), float("inf")
    want = descale_rows(dq, dk, dv)
    assert want.isnan().sum() == 1 + 4 + 4  # k's and v's bad values reach every query head of the group
    v8 = torch.randn(2, 2, 1000, 128, device="cuda").to(torch.float8_e4m3fn)
    vt, rows = transpose_v_with_descales(v8, *(x.cuda() for x in (dq, dk, dv)))
    assert torch.equal(rows.isnan().cpu(), want.isnan())
    assert torch.equal(rows.cpu().nan_to_num(), want.nan_to_num())
    assert torch.equal(vt.view(torch.uint8), transpose_v_fp8(v8).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shapes", [((), (), ()), ((1,), (1, 1), ())])
def test_v_transpose_reads_k7s_one_element_descales_as_they_are(shapes):
    from kernels.k7 import transpose_v_fp8, transpose_v_with_descales

    v8 = torch.randn(1, 4, 333, 64, device="cuda").to(torch.float8_e4m3fn)
    values = [0.25, 3.0, 0.5]
    ds = [torch.full(s, x, device="cuda") for s, x in zip(shapes, values)]
    vt, rows = transpose_v_with_descales(v8, *ds, per_tensor=True)
    assert rows.shape == (3,) and rows.tolist() == values
    assert torch.equal(vt.view(torch.uint8), transpose_v_fp8(v8).view(torch.uint8))
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        ds[1].fill_(bad)
        _, rows = transpose_v_with_descales(v8, *ds, per_tensor=True)
        assert rows[1].isnan() and rows[0] == 0.25 and rows[2] == 0.5


def test_k7s_one_element_descale_variants_compile():
    from kernels.contract import compiled_ptx
    from kernels.k7 import compile_transpose_v

    for ranks in ((0, 0, 0), (1, 2, 0)):  # the three descales and the (3,) rows: a bare pointer each
        ptx = compiled_ptx(compile_transpose_v(keep_ptx=True, with_descales=True, ranks=ranks))
        assert len(re.findall(r"_param_[2-5]\[8\]", ptx)) == 4, ranks


@pytest.mark.parametrize("d", [64, 128, 256])
def test_k8s_three_quantizers_compile_into_one_kernel_without_spills(d):
    from harness.inspect_ptx import ptxas_report
    from kernels.contract import compiled_ptx
    from kernels.fp8_quant import compile_quantize_inputs
    from kernels.k8 import block_sizes

    ptx = compiled_ptx(compile_quantize_inputs(d, *block_sizes(d), True, "bfloat16", keep_ptx=True))
    report = ptxas_report(ptx)
    assert len(report) == 1 and all(spill == 0 for _, _, _, spill in report), report
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ptx.count("div.rn.f32") >= 3  # a scale per tensor's blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("shape", ["mha", "gqa_longer_kv", "shorter_kv"])
def test_k8s_one_launch_quantizer_is_bit_exact_against_torch(d, shape):
    from kernels.fp8_quant import quantize_fp8_blocks_torch, quantize_inputs_cute
    from kernels.k8 import block_sizes

    heads_kv, n_kv = dict(mha=(4, 1000), gqa_longer_kv=(2, 4097), shorter_kv=(4, 17))[shape]
    q = torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # strided heads
    k, v = (torch.randn(2, heads_kv, n_kv, d, device="cuda", dtype=torch.bfloat16) * s for s in (4.0, 0.5))
    tile_m, tile_n = block_sizes(d)
    signs = hadamard_signs(d, device="cuda")
    for keep in (False, True):
        got = quantize_inputs_cute(q, k, v, tile_m, tile_n, signs, keep)
        want = [*quantize_fp8_blocks_torch(q, tile_m, signs), *quantize_fp8_blocks_torch(k, tile_n, signs),
                *quantize_fp8_blocks_torch(v, tile_n)]
        want = [want[0], want[2], want[4], want[1], want[3], want[5]]
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                               w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)
