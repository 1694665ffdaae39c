"""No silent wrong answers (issue 24, items 8-13): each bad input is refused by name with its
fix, or gives the documented behaviour; never NaN counted as a match, never a traceback for a
user error."""
from __future__ import annotations

import pytest
import torch

import bitmatch
from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing_models import tiny_model
from bitmatch.verify import compare


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=3, num_hidden_layers=1)


# -- item 8: temperatures that underflow float32; NaN is never a match ---------------------------

@pytest.mark.parametrize("t", [1e-46, 1e-45, 1e-39, 1.1754942e-38])
def test_temperature_below_the_smallest_normal_float32_is_refused(model, t):
    rng = r"\[1.1754944e-38, 3.4028235e\+38\]"
    with pytest.raises(ValueError, match=rf"SamplingParams: temperature must be 0 \(greedy\) or a float in {rng}, "
                                         rf"got {t!r}: below the smallest normal float32 its reciprocal overflows"):
        SamplingParams(temperature=t)
    ids = torch.tensor([[1, 5, 6, 7]])
    with pytest.raises(ValueError, match=rf"token_logprobs: temperature must be a float in {rng}, got {t!r}"):
        bitmatch.token_logprobs(model, ids, temperature=t)


@pytest.mark.parametrize("t", [float("inf"), 1e39, float("nan"), -1.0, -0.0 - 1e-300])
def test_temperature_not_finite_in_float32_is_refused(t):
    with pytest.raises(ValueError, match=r"SamplingParams: temperature must be (>= 0, got \S+ \(valid: )?0 "
                                         r"\(greedy\) or a float in \[1.1754944e-38, 3.4028235e\+38\]"):
        SamplingParams(temperature=t)


def test_smallest_normal_temperature_is_accepted():
    assert SamplingParams(temperature=2.0 ** -126).temperature == 2.0 ** -126
    assert SamplingParams(temperature=0).greedy


def test_scaled_logits_overflowing_float32_are_refused_not_nan(model):
    """T = 2**-126 is valid, but logits above 4 divided by it overflow float32: both sides refuse
    the NaN logprobs (the engine drops the step's requests) instead of reporting them."""
    big = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=3, num_hidden_layers=1)
    with torch.no_grad():
        big.lm_head.weight.mul_(1e3)
    t = 2.0 ** -126
    with pytest.raises(ValueError, match=r"token_logprobs: \d+ of 3 logprobs are NaN: the logits divided by "
                                         r"temperature=1.1754943508222875e-38 are not finite in float32; raise"):
        bitmatch.token_logprobs(big, torch.tensor([[1, 5, 6, 7]]), temperature=t)
    eng = Engine(big)
    with pytest.raises(ValueError, match=r"Engine: request \S+ \(and 0 more in this step\) sampled a token with a "
                                         r"NaN logprob: its logits divided by temperature=1.17\S+ are not finite"):
        eng.generate([[1, 5, 6]], SamplingParams(temperature=t, max_tokens=2, seed=1))
    assert not eng.has_unfinished_requests()
    out = eng.generate([[1, 5, 6]], SamplingParams(temperature=1.0, max_tokens=2, seed=1))  # the engine still works
    assert len(out[0].outputs[0].token_ids) == 2


def test_compare_counts_nan_as_a_mismatch():
    nan = float("nan")
    r = compare([[-1.0, nan]], [[-1.0, nan]])  # the same NaN bits on both sides
    assert not r.bitmatched and r.mismatches == 1 and r.first_divergence == (0, 1)
    assert r.max_abs_diff == float("inf")
    r = compare([[-1.0, -2.0]], [[-1.0, nan]])
    assert r.mismatches == 1 and r.first_trainer_hex == "0x7fc00000"
    r = compare(torch.tensor([[nan, -0.5]]), torch.tensor([[-0.25, -0.5]]))
    assert r.mismatches == 1 and r.first_divergence == (0, 0)
    ninf = float("-inf")  # masked tokens on both sides are still a match
    assert compare([[ninf, -1.0]], [[ninf, -1.0]]).bitmatched
