"""K7's host side on the CPU: the quantizer, the V^T pre-pass and its key order against the P
view's, and the emulation the FP8 check compares with."""

import math

import pytest
import torch

from harness.check import emulate_fp8
from harness.reference import reference
from kernels import sm90
from kernels.k7 import E4M3_MAX, fp8_key_permutation, prepare_fp8, quantize_fp8, transpose_v_fp8


def test_quantize_fills_the_range_without_overflow_and_round_trips():
    x = torch.randn(2, 3, 100, 64, dtype=torch.bfloat16) * 7
    x8, descale = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and not torch.isnan(x8.float()).any()
    assert 0.95 * E4M3_MAX <= float(x8.float().abs().max()) <= E4M3_MAX
    # e4m3 keeps 3 mantissa bits: every value within half a step (2^-4 relative) of the original.
    back = x8.float() * descale
    assert bool(((back - x.float()).abs() <= x.float().abs() / 16 + 1e-6 + float(descale) * 2**-9).all())


def test_quantize_of_zeros_gives_zeros_not_nan():
    x8, descale = quantize_fp8(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not torch.isnan(x8.float()).any() and float(x8.float().abs().max()) == 0 and math.isfinite(float(descale))


def test_p_view_and_v_pass_agree_on_the_key_order():
    # The P view puts key FP8_KEY_ORDER[p] in slot p of every 16 (sm90.acc_frg_a_layout_fp8 does it
    # by strides (1, 4), 2, 8 over (column, group) pairs: slot 4q + v <- key 8 (v // 2) + 2q + v % 2).
    for q in range(4):
        for v in range(4):
            assert sm90.FP8_KEY_ORDER[4 * q + v] == 8 * (v // 2) + 2 * q + v % 2
    assert sorted(sm90.FP8_KEY_ORDER) == list(range(16))
    # The V pass stores key perm[p] in column p, zero past the keys: P (slot p) . V^T (column p)
    # then sums the right products.
    v8, _ = quantize_fp8(torch.randn(1, 2, 37, 64))
    vt = transpose_v_fp8(v8).view(torch.uint8)
    perm = fp8_key_permutation(37)
    assert vt.shape == (1, 2, 64, 48) and vt.is_contiguous()
    for p in range(48):
        want = v8.view(torch.uint8)[0, 1, perm[p]] if perm[p] < 37 else torch.zeros(64, dtype=torch.uint8)
        assert torch.equal(vt[0, 1, :, p], want)


def test_permuted_product_equals_the_natural_one():
    # What the kernel computes, in float64: P in the permuted order times V^T from the pass.
    torch.manual_seed(0)
    p = torch.rand(5, 37, dtype=torch.float64)
    v = torch.randn(1, 1, 37, 16)
    v8, dv = quantize_fp8(v)
    vt = transpose_v_fp8(v8).float()[0, 0].double() * float(dv)  # (16, 48)
    perm = fp8_key_permutation(37)
    p_slots = torch.zeros(5, 48, dtype=torch.float64)
    p_slots[:, perm < 37] = p[:, perm[perm < 37]]
    assert torch.allclose(p_slots @ vt.T, p @ (v8[0, 0].double() * float(dv)), atol=1e-12)


def test_fp8_emulation_error_is_p_rounding_sized():
    # The FP8 check's yardstick: against exact attention of the dequantized inputs, the
    # emulation's error is the P rounding's (~2-3% relative L2 at 3 mantissa bits), not more.
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 300, 128, dtype=torch.bfloat16) for _ in range(3))
    q8, k8, vt8, descale = prepare_fp8(q, k, v)
    (_, dq), (_, dk), (v8, dv) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    ref, _ = reference(q8.float() * dq, k8.float() * dk, v8.float() * dv, False, 128**-0.5)
    emu = emulate_fp8(q8, k8, v8, (dq, dk, dv), False, 128**-0.5)
    rel = float((emu - ref).norm() / ref.norm())
    assert 0.005 < rel < 0.05
    assert vt8.shape == (1, 2, 128, 304) and descale.shape == (3,)


def test_the_fp8_criterion_rejects_planted_faults():
    # check_fp8_kernel's rule (relative L2 within FP8_FACTOR x the emulation's + FP8_FLOOR) passes
    # the emulation itself and fails the three mistakes an FP8 kernel can make quietly: P without
    # its 2^8 offset, V^T's keys out of the P order, v's descale lost. The inputs have an attention
    # sink (key 0 scores 8 for every query, the rest about 0): every other key's P is e^-8, under
    # e4m3's smallest value unless P is offset, yet together they hold up to 40% of a row's weight.
    from harness.check import FP8_FACTOR, FP8_FLOOR

    torch.manual_seed(2)
    n, d = 2048, 128
    u = torch.ones(d)
    q = (u + 0.1 * torch.randn(1, 2, n, d)).bfloat16()
    k = 0.3 * torch.randn(1, 2, n, d)
    k[:, :, 0] = u * 8 / math.sqrt(d)  # q . k0 * d^-0.5 = 8
    k = k.bfloat16()
    v = torch.randn(1, 2, n, d, dtype=torch.bfloat16)
    (q8, dq), (k8, dk), (v8, dv) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    scale = d**-0.5
    ref, _ = reference(q8.float() * dq, k8.float() * dk, v8.float() * dv, True, scale)

    def rel(o):
        return float((o - ref).norm() / ref.norm())

    bound = FP8_FACTOR * rel(emulate_fp8(q8, k8, v8, (dq, dk, dv), True, scale)) + FP8_FLOOR
    swapped = v8.view(torch.uint8)[:, :, fp8_key_permutation(n)].view(torch.float8_e4m3fn)
    faults = {
        "no P offset": emulate_fp8(q8, k8, v8, (dq, dk, dv), True, scale, p_offset=0.0),
        "keys out of order": emulate_fp8(q8, k8, swapped, (dq, dk, dv), True, scale),
        "v descale lost": emulate_fp8(q8, k8, v8, (dq, dk, 1.0), True, scale),
    }
    for name, out in faults.items():
        assert rel(out) > 2 * bound, (name, rel(out), bound)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,d", [(1, 64), (37, 128), (200, 64), (1000, 256), (4096, 128)])
def test_transpose_kernel_matches_the_torch_pass(n, d):
    from kernels.k7 import transpose_v_fp8_torch

    v8, _ = quantize_fp8(torch.randn(2, 3, n, d, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(transpose_v_fp8(v8).view(torch.uint8), transpose_v_fp8_torch(v8).view(torch.uint8))


def test_transpose_kernel_compiles_to_16_byte_global_accesses():
    import re

    from kernels.contract import compiled_ptx
    from kernels.k7 import compile_transpose_v

    ptx = compiled_ptx(compile_transpose_v(keep_ptx=True))
    accesses = set(re.findall(r"(?:ld|st)\.global[.a-z0-9]*", ptx))
    assert accesses == {"ld.global.v4.b32", "st.global.v4.b32"}  # both GMEM sides in 16-byte pieces
