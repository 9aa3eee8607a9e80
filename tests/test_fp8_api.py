"""FP8 inputs through the public call: attention("k7", q8, k8, v8, descale_q=..., ...).

CPU: what is refused (and with which message), the op's output dtype, the descale plumbing.
GPU: e4m3 inputs give exactly what K7's own pre-pass gives from the 16-bit tensors they came
from (same bytes in, same kernel), under CUDA-graph capture and torch.compile too.
"""

import pytest
import torch

from harness import attention, quantize_fp8, quantize_fp8_blocks
from harness.api import _constant, split_descales
from kernels import get_kernel
from kernels.contract import Problem, UnsupportedProblem

def _fp8(shape=(1, 2, 64, 128), device="cpu", kv_heads=None, kv_len=None):
    q = torch.randn(shape, device=device, dtype=torch.bfloat16)
    kv_shape = (shape[0], kv_heads or shape[1], kv_len or shape[2], shape[3])
    k, v = (torch.randn(kv_shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    return (q, k, v), [quantize_fp8(x) for x in (q, k, v)]


def test_valid_fp8_inputs_reach_the_device_check():
    _, ((q8, dq), (k8, dk), (v8, dv)) = _fp8()
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
        attention("k7", q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
        attention("k7", q8, k8, v8, descale_q=0.5)  # numbers, and 1.0 for the missing ones


@pytest.mark.parametrize("case, match", [
    ("e5m2", "must be float8_e4m3fn"),
    ("mixed", "must share a dtype"),
    ("descale_on_bf16", "descales apply to float8_e4m3fn inputs only"),
    ("negative_descale", "descale_k must be a finite number > 0"),
    ("nan_descale", "descale_v must be a finite number > 0"),
    ("vector_descale", "descale_q must be one floating-point value"),
    ("int_descale_tensor", "descale_q must be one floating-point value"),
    ("head_dim_48", "FP8 head_dim must be a multiple of 32"),
    ("head_dim_96", "head_dim 96 not supported"),
    ("stride_8", "multiples of 16 elements"),
    ("k8", r"k8 takes float8_e4m3fn inputs with one descale per block: descale_q must be a float32 tensor"),
    ("k6", "dtype float8_e4m3fn not supported"),
])
def test_refusals_name_the_constraint(case, match):
    (q, k, v), ((q8, dq), (k8, dk), (v8, dv)) = _fp8()
    name, args, kw = "k7", (q8, k8, v8), {}
    if case == "e5m2":
        args = tuple(x.to(torch.float8_e5m2) for x in (q, k, v))
    elif case == "mixed":
        args = (q8, k8, v)
    elif case == "descale_on_bf16":
        args, kw = (q, k, v), dict(descale_q=dq)
    elif case == "negative_descale":
        kw = dict(descale_k=-1.0)
    elif case == "nan_descale":
        kw = dict(descale_v=float("nan"))
    elif case == "vector_descale":
        kw = dict(descale_q=torch.ones(2))
    elif case == "int_descale_tensor":
        kw = dict(descale_q=torch.tensor(1))
    elif case == "head_dim_48":
        args = tuple(x[..., :48] for x in args)
    elif case == "head_dim_96":
        args = tuple(x[..., :96] for x in args)
    elif case == "stride_8":  # 8-element rows: aligned for bf16, not for 1-byte elements
        args = tuple(torch.zeros(1, 2, 64, 136, dtype=torch.float8_e4m3fn)[..., :128] for _ in range(3))
    else:
        name = case
    with pytest.raises(UnsupportedProblem, match=match):
        attention(name, *args, **kw)


def test_k8s_block_quantized_inputs_reach_the_device_check_and_bad_blocks_do_not():
    q, k, v = (torch.randn(1, 2, 300, 128, dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8, dq, dk, dv = quantize_fp8_blocks(q, k, v)
    assert q8.dtype == torch.float8_e4m3fn and dq.shape == (1, 2, 3) and dk.shape == dv.shape == (1, 2, 3)
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
        attention("k8", q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    with pytest.raises(UnsupportedProblem, match=r"descale_k must be a float32 tensor of shape \(1, 2, 3\)"):
        attention("k8", q8, k8, v8, descale_q=dq, descale_k=dk[..., :2], descale_v=dv)
    with pytest.raises(UnsupportedProblem, match="descale_v must be a float32 tensor .* got None"):
        attention("k8", q8, k8, v8, descale_q=dq, descale_k=dk)
    with pytest.raises(UnsupportedProblem, match="descale_q must be a float32 tensor .* got 0.5"):
        attention("k8", q8, k8, v8, descale_q=0.5, descale_k=dk, descale_v=dv)
    # q on a GPU, descales left on the host (a torch.device needs no GPU to exist):
    from harness.api import check_block_descales

    descales = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    with pytest.raises(UnsupportedProblem, match=r"descale_q must be on q's device \(cuda:0\), got cpu"):
        check_block_descales("k8", Problem(1, 2, 300, 128, dtype="float8_e4m3fn"), descales, torch.device("cuda:0"))


def test_k8s_block_descales_follow_the_kv_heads_and_length():
    # GQA and a longer K/V: k's and v's descales have the K/V heads and key blocks; q's, q's.
    from kernels.fp8_quant import descale_rows
    from kernels.k8 import block_sizes

    tile_m, tile_n = block_sizes(128)
    q = torch.randn(1, 4, 300, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 1000, 128, dtype=torch.bfloat16) for _ in range(2))
    q8, k8, v8, dq, dk, dv = quantize_fp8_blocks(q, k, v)
    m_blocks, kv_blocks = -(-300 // tile_m), -(-1000 // tile_n)
    assert dq.shape == (1, 4, m_blocks) and dk.shape == dv.shape == (1, 2, kv_blocks)
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
        attention("k8", q8, k8, v8, causal=True, descale_q=dq, descale_k=dk, descale_v=dv)
    wrong = dk.repeat_interleave(2, dim=1)  # one row per query head: not what k8 takes for k
    with pytest.raises(UnsupportedProblem, match=rf"descale_k must be a float32 tensor of shape \(1, 2, {kv_blocks}\)"):
        attention("k8", q8, k8, v8, descale_q=dq, descale_k=wrong, descale_v=dv)
    short = dv[..., :-(-300 // tile_n)]  # blocks of q's length, not the keys'
    with pytest.raises(UnsupportedProblem, match=rf"descale_v must be a float32 tensor of shape \(1, 2, {kv_blocks}\)"):
        attention("k8", q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=short)
    # The kernel's rows: query head h carries the tile descales of K/V head h // 2.
    rows = descale_rows(dq, dk, dv)
    assert rows.shape == (1, 4, m_blocks + 2 * kv_blocks)
    for h in range(4):
        assert torch.equal(rows[0, h], torch.cat([dq[0, h], dk[0, h // 2], dv[0, h // 2]]))


def test_problem_and_capabilities_know_the_fp8_dtype():
    p = Problem(1, 2, 100, 128, dtype="float8_e4m3fn", causal=True)
    assert p.out_dtype == "bfloat16" and Problem(1, 2, 100, 128, dtype="float16").out_dtype == "float16"
    get_kernel("k7").caps.check(p)
    get_kernel("k7_k4").caps.check(p)
    get_kernel("k8").caps.check(p)
    with pytest.raises(UnsupportedProblem, match="float8_e4m3fn not supported"):
        get_kernel("k6").caps.check(p)
    with pytest.raises(UnsupportedProblem, match="dtype must be one of"):
        Problem(1, 2, 100, 128, dtype="float8_e5m2")


def test_an_fp8_problem_compiles_k7s_one_kernel_with_e4m3_wgmmas():
    from harness.inspect_ptx import count_instructions

    p = Problem(1, 2, 100, 128, dtype="float8_e4m3fn")
    compiled = get_kernel("k7").compile(p, keep_ptx=True)
    counts = count_instructions(compiled.ptx)
    assert counts["e4m3 wgmma"] > 0 and counts["e4m3 wgmma"] == counts["wgmma.mma_async"]
    # One kernel for e4m3 and for 16-bit inputs with bf16 O: the pre-pass is the only difference.
    bf16 = get_kernel("k7").compile(p.with_(dtype="bfloat16"), keep_ptx=True)
    assert bf16.ptx == compiled.ptx


@pytest.mark.parametrize("name", ["k7", "k8"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_a_prepared_fp8_call_is_one_host_call_of_its_pre_pass_and_kernel(name, dtype):
    from harness.inspect_ptx import count_instructions
    from kernels.contract import FusedLaunch

    p = Problem(1, 2, 100, 128, dtype=dtype)
    compiled = get_kernel(name).compile(p, keep_ptx=True)
    descales = (torch.ones(()), torch.ones(1), torch.ones(())) if name == "k7" else (torch.ones(1, 2, 1),) * 3
    fused = get_kernel(name).load().prepare_run(compiled, descales if dtype != "bfloat16" else None, torch.device("cpu"))
    assert isinstance(fused, FusedLaunch)
    # e4m3: the V^T pass, then attention; bf16: K7's amax, cast and V^T passes (K8's quantizer and
    # V^T pass), then attention. Every kernel launched from one host function.
    kernels = {("k7", "float8_e4m3fn"): 2, ("k8", "float8_e4m3fn"): 2, ("k7", "bfloat16"): 4, ("k8", "bfloat16"): 3}
    assert fused.launch.ptx.count(".entry ") == kernels[name, dtype]
    counts, alone = count_instructions(fused.launch.ptx), count_instructions(compiled.ptx)
    assert counts["e4m3 wgmma"] == alone["e4m3 wgmma"] > 0 and counts["cp.async.bulk.tensor"] > 0


def test_descales_become_one_float32_vector():
    _, ((q8, dq), _, _) = _fp8()
    tensors, values = split_descales(q8, dict(descale_q=dq, descale_k=None, descale_v=torch.tensor(0.25)))
    assert tensors == (None,) * 3 and values == [float(dq), 1.0, 0.25]  # host tensors are read as numbers
    numbers = _constant((0.5, 2.0, 1.0), torch.device("cpu"))
    assert numbers.dtype == torch.float32 and numbers.tolist() == [0.5, 2.0, 1.0]
    assert _constant((0.5, 2.0, 1.0), torch.device("cpu")) is numbers  # cached


def test_fake_implementation_gives_bf16_out_for_fp8_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 3, 100, 128, dtype=torch.float8_e4m3fn, device="cuda")
        d = torch.empty((), dtype=torch.float32, device="cuda")
        out, lse = torch.ops.fa3_cute.attention("k7", q, q, q, True, None, True, d, d, d, [1.0] * 3)
        assert (out.shape, out.dtype) == ((2, 3, 100, 128), torch.bfloat16)
        assert (lse.shape, lse.dtype) == ((2, 3, 100), torch.float32)


def test_an_fp8_call_traces_into_one_graph():
    class Model(torch.nn.Module):
        def forward(self, q8, k8, v8):
            return attention("k7", q8, k8, v8, causal=True, descale_q=0.5, descale_k=0.25, descale_v=2.0) * 2

    _, quantized = _fp8()
    graph = torch.export.export(Model(), tuple(x for x, _ in quantized), strict=True).graph_module.code
    assert graph.count("torch.ops.fa3_cute.attention.default(") == 1 and "[0.5, 0.25, 2.0]" in graph


# ---- GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ["mha", "gqa", "unequal"])
def test_fp8_inputs_give_what_the_16_bit_path_gives(d, causal, shape):
    kw = dict(mha={}, gqa=dict(kv_heads=2), unequal=dict(kv_len=1500))[shape]
    (q, k, v), ((q8, dq), (k8, dk), (v8, dv)) = _fp8((2, 8, 1000, d), "cuda", **kw)
    want, want_lse = attention("k7", q, k, v, causal=causal, return_lse=True)
    out, lse = attention("k7", q8, k8, v8, causal=causal, return_lse=True, descale_q=dq, descale_k=dk, descale_v=dv)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # The same descales as numbers.
    numbers = attention("k7", q8, k8, v8, causal=causal, descale_q=float(dq), descale_k=float(dk), descale_v=float(dv))
    assert torch.equal(numbers, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("descales", ["tensors", "numbers"])
def test_an_fp8_call_is_captured_and_replayed_in_a_cuda_graph(descales):
    _, ((q8, dq), (k8, dk), (v8, dv)) = _fp8((2, 4, 777, 128), "cuda")
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    if descales == "numbers":
        kw = {name: float(x) for name, x in kw.items()}
    want = attention("k7", q8, k8, v8, causal=True, **kw)  # warm-up: compiles, caches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention("k7", q8, k8, v8, causal=True, **kw)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ["mha", "gqa", "unequal", "mha_unequal"])
def test_k8s_fp8_inputs_give_what_its_16_bit_path_gives(d, causal, shape):
    kv_heads, kv_len = dict(mha=(4, 1000), gqa=(2, 1000), unequal=(1, 1500), mha_unequal=(4, 1500))[shape]
    q = torch.randn(2, 4, 1000, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_heads, kv_len, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want, want_lse = attention("k8", q, k, v, causal=causal, return_lse=True)
    q8, k8, v8, dq, dk, dv = quantize_fp8_blocks(q, k, v)
    out, lse = attention("k8", q8, k8, v8, causal=causal, return_lse=True, descale_q=dq, descale_k=dk, descale_v=dv)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_fp8_call_runs_under_torch_compile():
    _, ((q8, dq), (k8, dk), (v8, dv)) = _fp8((1, 4, 300, 128), "cuda")

    def f(q8, k8, v8, dq, dk, dv):
        return attention("k7", q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv) * 2

    want = f(q8, k8, v8, dq, dk, dv)
    got = torch.compile(f, fullgraph=True)(q8, k8, v8, dq, dk, dv)
    assert torch.equal(got, want)


@pytest.mark.parametrize("blocks", [False, True])
def test_fp8_inputs_is_the_public_quantizers_and_the_launchs_descales(blocks):
    from harness.api import fp8_inputs
    from kernels.fp8_quant import descale_rows

    q, k, v = (torch.randn(1, 4, 100, 64, dtype=torch.bfloat16) * s for s in (1.0, 3.0, 0.5))
    q8, k8, v8, descales, launch = fp8_inputs(q, k, v, blocks)
    assert list(descales) == ["descale_q", "descale_k", "descale_v"]
    if blocks:
        want = quantize_fp8_blocks(q, k, v)
        assert torch.equal(launch, descale_rows(*want[3:]))
    else:
        pairs = [quantize_fp8(x) for x in (q, k, v)]
        want = [x8 for x8, _ in pairs] + [d for _, d in pairs]
        assert torch.equal(launch, torch.stack(want[3:]))
    for got, expected in zip((q8, k8, v8, *descales.values()), want):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected)
