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
    with pytest.raises(UnsupportedProblem, match="forward-only"):
        attention("k4", q.requires_grad_(), k, v)


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
