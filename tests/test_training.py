"""The training check (GPU, ``harness/training.py``): the small GPT learns the look-back task
with our forward and each backward stage as with SDPA, from the same seed."""

import functools

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", ["k9", "k10", "k10_fa3"])
def test_a_small_gpt_trains_with_attention_as_with_sdpa(stage):
    from harness.training import NO_LOOK_BACK, tail, train

    ours, sdpa = train(stage), sdpa_losses()
    assert all(x == x for x in ours)  # no NaN
    # Both learn to look back (only a model that attends gets below ln 64), and the curves end
    # within 5% of each other.
    assert tail(sdpa) < NO_LOOK_BACK - 0.3 and tail(ours) < NO_LOOK_BACK - 0.3, (tail(sdpa), tail(ours))
    assert abs(tail(ours) - tail(sdpa)) <= 0.05 * tail(sdpa) + 0.02, (tail(sdpa), tail(ours))


@functools.cache
def sdpa_losses() -> list:
    from harness.training import train

    return train("sdpa")
