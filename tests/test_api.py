"""The public call on a CPU machine: every bad argument is refused by name before the device
check, good ones of any common type are taken, and the torch custom op traces without a GPU."""

import numpy as np
import pytest
import torch

from harness import attention
from harness.inputs import problem_from_tensors
from kernels.contract import Problem, UnsupportedProblem


def _qkv(shape=(1, 2, 16, 64), dtype=torch.bfloat16):
    return [torch.randn(shape, dtype=dtype) for _ in range(3)]


def test_valid_cpu_inputs_reach_the_device_check():
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor"):
        attention("k4", *_qkv(), causal=True, softmax_scale=0.1, return_lse=True)


@pytest.mark.parametrize("causal", ["false", "True", 0, 1, None, 1.0])
def test_causal_must_be_a_bool(causal):
    with pytest.raises(UnsupportedProblem, match="causal must be a bool"):
        attention("k4", *_qkv(), causal=causal)


@pytest.mark.parametrize("causal", [True, False, np.bool_(True), np.bool_(False)])
def test_causal_bools_are_taken(causal):
    problem = problem_from_tensors(*_qkv(), causal)
    assert problem.causal is bool(causal)
    with pytest.raises(UnsupportedProblem, match="CUDA tensor"):
        attention("k4", *_qkv(), causal=causal)


@pytest.mark.parametrize("scale", [0.25, 2, np.float32(0.25), np.float64(0.25), np.int64(2), np.array(0.25),
                                   torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64), torch.tensor(2)])
def test_any_real_scalar_is_a_scale(scale):
    problem = problem_from_tensors(*_qkv(), False, scale)
    assert type(problem.softmax_scale) is float and problem.softmax_scale == pytest.approx(float(scale))
    with pytest.raises(UnsupportedProblem, match="CUDA tensor"):
        attention("k4", *_qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, np.bool_(True), 0, -1.0, float("nan"), float("inf"), 1j,
                                   torch.tensor([0.1, 0.2]), torch.tensor(True), [0.1]])
def test_bad_scales_are_refused(scale):
    with pytest.raises(UnsupportedProblem, match="softmax_scale"):
        attention("k4", *_qkv(), softmax_scale=scale)


def test_cuda_tensor_scale_is_refused_without_sync():
    class FakeCudaScalar:  # what the check reads of a CUDA tensor, with no GPU needed
        is_cuda = True
        ndim = 0

    with pytest.raises(UnsupportedProblem, match="softmax_scale .*CUDA tensor"):
        Problem(1, 1, 8, 64, softmax_scale=FakeCudaScalar())


@pytest.mark.parametrize("d", [0, 20, 4])
def test_head_dim_constraint_is_named_as_such(d):
    with pytest.raises(UnsupportedProblem, match="head_dim") as e:
        attention("k4", *_qkv((1, 2, 16, d)))
    assert ".contiguous()" not in str(e.value)


@pytest.mark.parametrize("shape", [(0, 2, 16, 64), (1, 2, 0, 64)])
def test_empty_dimensions_are_refused(shape):
    with pytest.raises(UnsupportedProblem, match="must all be positive"):
        attention("k4", *_qkv(shape))


def test_kernel_head_dims_are_checked_before_the_device():
    with pytest.raises(UnsupportedProblem, match="head_dim 96 not supported"):
        attention("k4", *_qkv((1, 2, 16, 96)))


def test_unknown_kernel_is_named_before_the_device():
    with pytest.raises(UnsupportedProblem, match="unknown kernel 'k9'"):
        attention("k9", *_qkv())


def test_dtype_and_non_tensor_inputs_are_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(UnsupportedProblem, match="bfloat16, float16 or float8_e4m3fn"):
        attention("k4", q.float(), k.float(), v.float())
    with pytest.raises(UnsupportedProblem, match="k must be a torch.Tensor"):
        attention("k4", q, [1.0], v)
    with pytest.raises(UnsupportedProblem, match="k7 is forward-only"):
        attention("k7", q.clone().requires_grad_(), k, v)


def test_fake_implementation_gives_output_shapes_without_a_gpu():
    # What torch.compile sees of the op: shapes and dtypes from fake (CUDA) tensors, no kernel.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 100, 3, 64, dtype=torch.float16, device="cuda").transpose(1, 2)  # strided heads
        out, lse = torch.ops.fa3_cute.attention("k4", q, q, q, True, None, True)
        assert (out.shape, out.dtype, out.device.type) == ((2, 3, 100, 64), torch.float16, "cuda")
        assert out.is_contiguous()
        assert (lse.shape, lse.dtype) == ((2, 3, 100), torch.float32)


def test_the_wrapper_traces_into_one_graph_around_the_op():
    # torch.export traces as torch.compile(fullgraph=True) does, on fake tensors: no graph break
    # in the wrapper, and the op stays one opaque node.
    class Model(torch.nn.Module):
        def forward(self, q, k, v):
            out, lse = attention("k4", q, k, v, causal=True, softmax_scale=0.125, return_lse=True)
            return out * 2, lse

    graph = torch.export.export(Model(), tuple(_qkv()), strict=True).graph_module.code
    assert graph.count("torch.ops.fa3_cute.attention.default(") == 1
    assert "'k4'" in graph and "0.125" in graph


def test_meta_tensors_are_checked_not_passed_to_the_fake_implementation():
    q, k, v = (t.to("meta") for t in _qkv())
    with pytest.raises(UnsupportedProblem, match="q must be a CUDA tensor, got device meta"):
        attention("k4", q, k, v)
    with pytest.raises(UnsupportedProblem, match="unknown kernel 'nope'"):
        attention("nope", q, k, v)
    with pytest.raises(UnsupportedProblem, match="head_dim 96 not supported"):
        attention("k4", *(t.to("meta") for t in _qkv((1, 2, 16, 96))))


@pytest.mark.parametrize("flag", ["no", 1, 0, None, "True"])
def test_return_lse_must_be_a_bool(flag):
    with pytest.raises(UnsupportedProblem, match="return_lse must be a bool"):
        attention("k4", *_qkv(), return_lse=flag)


def test_return_lse_takes_numpy_bools():
    with pytest.raises(UnsupportedProblem, match="CUDA tensor"):
        attention("k4", *_qkv(), return_lse=np.bool_(True))


@pytest.mark.parametrize("name", [4, None, ["k4"], b"k4"])
def test_a_kernel_name_of_the_wrong_type_is_named(name):
    with pytest.raises(UnsupportedProblem, match="the kernel name must be a string, one of k1, "):
        attention(name, *_qkv())


def test_calls_whose_arguments_may_change_unseen_are_not_kept():
    # The signature cache keys on values that hash by value; anything else is checked in full each time.
    from harness.api import _signature

    q, k, v = _qkv()
    assert _signature("k4", q, k, v, False, None, False, (None,) * 3) is None  # host tensors: no fast path
    meta = [t.to("meta") for t in (q, k, v)]
    assert _signature("k4", *meta, False, None, False, (None,) * 3) is None


@pytest.mark.parametrize("case, match", [
    ("int8", "x must be bfloat16, float16, float32 to be quantized"),
    ("list", "x must be a torch.Tensor, got list"),
    ("3d", r"x must be 4-D \(batch, heads, seqlen, head_dim\)"),
    ("d80", r"x: head_dim 80 not supported by the FP8 stages \(supported: \[64, 128, 256\]\)"),
    ("strided", "x must have a contiguous last dim"),
])
def test_quantize_fp8_refuses_what_it_cannot_quantize(case, match):
    from harness import quantize_fp8

    x = dict(int8=torch.zeros(1, 2, 16, 64, dtype=torch.int8), list=[[1.0]], **{"3d": torch.randn(2, 16, 64)},
             d80=torch.randn(1, 2, 16, 80), strided=torch.randn(1, 2, 64, 16).transpose(2, 3))[case]
    with pytest.raises(UnsupportedProblem, match=match):
        quantize_fp8(x)


@pytest.mark.parametrize("case, match", [
    ("int8", "k must be bfloat16, float16, float32 to be quantized"),
    ("list", "v must be a torch.Tensor, got list"),
    ("3d", r"q must be 4-D"),
    ("d80", r"q: head_dim 80 not supported by the FP8 stages"),
    ("head_dims", r"k and v must have one shape .* with q's batch and head_dim"),
    ("heads", r"q's heads a multiple of theirs"),
])
def test_quantize_fp8_blocks_refuses_what_it_cannot_quantize(case, match):
    from harness import quantize_fp8_blocks

    q, k, v = _qkv((1, 4, 16, 128))
    if case == "int8":
        k = k.to(torch.int8)
    elif case == "list":
        v = [1.0]
    elif case == "3d":
        q = q[0]
    elif case == "d80":
        q, k, v = _qkv((1, 4, 16, 80))
    elif case == "head_dims":
        k, v = _qkv((1, 4, 16, 64))[:2]
    elif case == "heads":
        k, v = _qkv((1, 3, 16, 128))[:2]
    with pytest.raises(UnsupportedProblem, match=match):
        quantize_fp8_blocks(q, k, v)


def test_descale_rows_turn_a_bad_descale_into_nan_rows():
    # K7/K8 descales live on the GPU, where the host cannot read them without a stall: one that is
    # not a finite number > 0 makes the rows it scales NaN (never a quietly wrong answer).
    from kernels.fp8_quant import descale_rows

    dq = torch.tensor([[[0.5, -1.0]]])
    dk, dv = torch.tensor([[[float("nan"), 2.0, 0.0]]]), torch.tensor([[[float("inf"), 1.0, 3.0]]])
    rows = descale_rows(dq, dk, dv)[0, 0].tolist()
    assert rows[0] == 0.5 and rows[3] == 2.0 and rows[6:] == [1.0, 3.0]
    assert all(np.isnan(rows[i]) for i in (1, 2, 4, 5))
