"""Values that used to pass unchecked (issue 53, items 4, 7, 8, 14, 18): each test has a control
that the same path still accepts or reports the ordinary case."""
from __future__ import annotations

import math

import pytest
import torch

import bitmatch.sync as sync
from bitmatch import token_logprobs
from bitmatch.adapters.vllm import VllmColocateSender
from bitmatch.diagnostics.verify import compare
from bitmatch.engine import SamplingParams
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model
from sync_helpers import FakeVllmQwen3, bf16_target, tiny_qwen3, two_tensor_state

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


# -- token_logprobs: chunk_rows and the gradient bits; attention_mask values --------------------------

def _grads(lm, ids, mask, w, **kw):
    lm.zero_grad(set_to_none=True)
    lp = token_logprobs(lm, ids, mask, compute_dtype=torch.float32, **kw)
    (lp * w).sum().backward()
    return lp.detach(), [p.grad.clone() for p in lm.parameters()]


def test_chunk_rows_do_not_change_gradient_bits(monkeypatch):
    import bitmatch.logprobs as lpmod
    lm = tiny_model("llama-hd128-gqa8-llama3rope", dtype=torch.float32, seed=0).train()
    ids, mask = pad_batch(random_prompts(4, 5, 20, seed=2))
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(1))
    lp0, g0 = _grads(lm, ids, mask, w)
    for kw in (dict(chunk_rows=1), dict(chunk_rows=7), dict(chunk_rows=7, recompute_logits=True)):
        lp, g = _grads(lm, ids, mask, w, **kw)
        assert torch.equal(lp, lp0), kw
        bad = [n for (n, _), a, b in zip(lm.named_parameters(), g0, g) if not torch.equal(a, b)]
        assert not bad, f"{kw}: {len(bad)} of {len(g0)} gradients differ, e.g. {bad[:3]}"
    # control: another partition of the head's rows does give other gradient bits, so the equality
    # above is the fixed partition's doing, not an insensitive test
    monkeypatch.setattr(lpmod, "DEFAULT_LOGIT_ELEMENTS", 7 * lm.lm_head.weight.shape[0])
    lp, g = _grads(lm, ids, mask, w)
    assert torch.equal(lp, lp0) and not all(torch.equal(a, b) for a, b in zip(g0, g))


@pytest.mark.parametrize("value", [0.5, -1, 2])
def test_attention_mask_other_than_0_1_is_refused(value):
    lm = tiny_model(dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.tensor([[1.0, 1.0, value, 1.0]])
    with pytest.raises(ValueError, match=r"attention_mask must hold 0 \(padding\) and 1"):
        token_logprobs(lm, ids, mask)
    for ok in (torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0.0, 1.0, 1.0, 1.0]]), torch.ones(1, 4, dtype=torch.bool)):
        token_logprobs(lm, ids, ok)   # control: 0 / 1 in any dtype


# -- weight versions: one validator on every path; check_weight_version; vLLM colocate -----------------

BAD_VERSIONS = [1.9, True, -5, "3", 2 ** 70, None]


@pytest.mark.parametrize("version", BAD_VERSIONS, ids=repr)
def test_publish_refuses_a_version_that_is_not_a_step_number(version):
    state = two_tensor_state(0, n=4096, cols=64)
    rx = sync.receive(bf16_target(state))
    sync.publish(state, 3, to=rx)
    with pytest.raises(ValueError, match=r"publish: version must be an int in \[0, 2\*\*63\)"):
        sync.publish(state, version, to=rx)
    with pytest.raises(ValueError, match="weight update: version must be an int"):
        sync.InProcessSender(rx).send(state, version)      # the receiver checks it too, whatever sends
    assert rx.version == 3
    sync.publish(state, 4, to=rx)                            # control: the next ordinary version passes
    assert rx.version == 4


def test_check_weight_version_refuses_nothing_and_non_ints():
    with pytest.raises(sync.WeightVersionError, match="no rollouts to check"):
        sync.check_weight_version([], 5)
    with pytest.raises(sync.WeightVersionError, match="not an int"):
        sync.check_weight_version([{"weight_version": 5.0}], 5)
    with pytest.raises(sync.WeightVersionError, match="not an int"):
        sync.check_weight_version([True], 1)
    with pytest.raises(ValueError, match="expected must be an int"):
        sync.check_weight_version([5], "5")
    sync.check_weight_version([{"weight_version": 5}, 5], 5)   # control


def test_vllm_colocate_versions_increase_and_live_writes_are_caught():
    m1, m2 = tiny_qwen3(seed=0), tiny_qwen3(seed=2)
    fake = FakeVllmQwen3(m1)
    tx = VllmColocateSender(model=fake)
    sync.publish(m1, 5, to=tx)
    with pytest.raises(sync.WeightVersionError, match="versions must increase"):
        sync.publish(m2, 3, to=tx)
    with pytest.raises(sync.WeightVersionError, match="holds version 5 with other bytes"):
        sync.publish(m2, 5, to=tx)
    with pytest.raises(ValueError, match="VllmColocateSender.send: version must be an int"):
        tx.send(m2, -1)
    assert tx.require_ready(5) == 5
    sync.publish(m1, 5, to=tx)                               # the live version's own bytes: accepted
    sync.publish(m2, 6, to=tx)                               # control: a newer version passes
    assert tx.require_ready(6) == 6
    next(iter(fake.holder.values())).mul_(2)               # a write outside publish
    with pytest.raises(sync.WeightsNotReadyError, match="written after version 6 was verified"):
        sync.require_ready(fake)


# -- SamplingParams: every field checked when set ----------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", float("inf")), ("top_p", 0), ("top_p", 5), ("top_p", True),
    ("max_tokens", 0), ("seed", 2 ** 70), ("seed", -1), ("top_k", True), ("top_k", 1.5),
])
def test_sampling_params_checked_after_construction(field, value):
    sp = SamplingParams()
    with pytest.raises(ValueError, match=f"SamplingParams: {field} must be"):
        setattr(sp, field, value)
    with pytest.raises(ValueError, match=f"SamplingParams: {field} must be"):
        SamplingParams(**{field: value})
    assert getattr(sp, field) == getattr(SamplingParams(), field)   # the refused value was not kept
    sp.max_tokens, sp.temperature, sp.seed = 3, 0.5, 2 ** 64 - 1      # control: valid values are taken
    assert (sp.max_tokens, sp.temperature, sp.seed) == (3, 0.5, 2 ** 64 - 1)


# -- the CLI: a bad --seed is a usage error (exit 2, one line), not an internal error ----------------

def _exit_code(argv) -> int:
    from bitmatch.cli import main
    try:
        return main(argv)
    except SystemExit as e:  # argparse and the demo's usage errors exit through SystemExit
        return e.code


@pytest.mark.parametrize("seed", ["-1", str(2 ** 64 + 5), str(2 ** 32)])
def test_cli_bad_seed_is_a_usage_error(seed, tmp_path, capsys):
    assert _exit_code(["demo", "--seed", seed, "--out", str(tmp_path), "--no-plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"bitmatch demo: --seed must be an int in [0, 2**32), got {seed}", err
    assert _exit_code(["locate", "--pair", "engine", "--family", "dense", "--seed", seed]) == 2
    assert capsys.readouterr().err.strip() == f"bitmatch locate: --seed must be an int in [0, 2**32), got {seed}"


def test_cli_largest_seed_runs(tmp_path):
    # control: the top of the range is a seed the demo runs with
    assert _exit_code(["demo", "--seed", str(2 ** 32 - 1), "--num-prompts", "1", "--max-tokens", "1", "--no-plot",
                       "--out", str(tmp_path)]) == 0
