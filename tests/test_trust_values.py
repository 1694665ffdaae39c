"""Values that used to pass unchecked (issue 53, items 4, 7, 8, 14, 18): each test has a control
that the same path still accepts or reports the ordinary case."""
from __future__ import annotations

import math

import pytest
import torch

from bitmatch.verify import compare


# -- verify.compare: zero compared tokens, float64, -inf ---------------------------------------------

@pytest.mark.parametrize("args", [
    ([[-1.0, -2.0]], [[-1.0, -2.0]], [[0, 0]]),                                  # all-zero mask
    ([], [], None),                                                              # empty lists
    ([[]], [[]], None),                                                          # empty sequences
    (torch.zeros(2, 0), torch.zeros(2, 0), None),                                # empty tensors
    (torch.full((2, 3), -1.0), torch.full((2, 3), -1.0), torch.zeros(2, 3)),     # a mask that selects none
], ids=["zero-mask", "empty-lists", "empty-rows", "empty-tensors", "tensor-mask"])
def test_compare_of_nothing_is_not_a_match(args):
    r = compare(*args)
    assert r.total == 0 and not r.bitmatched
    assert "tokens compared 0" in r.reason and r.summary() == r.reason
    assert r.to_dict()["bitmatched"] is False
    # control: the same inputs with one token selected match
    assert compare([[-1.0]], [[-1.0]]).bitmatched


def test_compare_float64_is_not_rounded_to_fp32():
    a = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    b = a.clone()
    b[0, 1] += 1e-12
    r = compare(a, b)
    assert r.mismatches == 1 and r.first_divergence == (0, 1) and not r.bitmatched
    assert r.first_rollout_hex == "0xc0000000" and len(r.first_trainer_hex) == 18   # float64's pattern
    assert compare([[-2.0]], [[-2.0 + 1e-12]]).mismatches == 1                      # Python floats too
    assert compare(a, a.clone()).bitmatched                                         # control
    assert compare(a.float(), a).bitmatched          # an fp32 value and its exact float64 widening are equal


@pytest.mark.parametrize("roll, train", [(float("-inf"), -1.0), (-1.0, float("-inf"))])
def test_compare_minus_inf_against_finite_is_an_infinite_kl(roll, train):
    r = compare([[roll, -0.5]], [[train, -0.5]])
    assert r.mismatches == 1 and not r.bitmatched
    assert r.k3_kl == math.inf and r.max_abs_diff == math.inf, r
    assert not math.isnan(r.mean_abs_diff)
    both = compare([[float("-inf")]], [[float("-inf")]])       # control: -inf on both sides is equal bits
    assert both.bitmatched and both.k3_kl == 0.0
