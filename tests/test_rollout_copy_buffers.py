"""A rollout copy built from the config alone (``RolloutCopy.from_config``: what the verl rollout
builds) holds, after one publish of the trainer's state dict, every tensor the forward reads:
parameters, persistent buffers (router correction biases, DeepSeek-V4's hash-routing table) and
non-persistent ones (rotary tables), so its logprobs equal the trainer's bit for bit, for every
registered family. Controls: a trainer buffer changed after the publish changes the logprobs (the
buffers are read, so the equality is not vacuous); a publish without the buffers is refused by
name; a write into a published buffer makes ``require_ready`` refuse."""
from __future__ import annotations

import pytest
import torch

import bitmatch
import bitmatch.sync as bsync
from bitmatch.models.registry import families
from bitmatch.sync.rollout_copy import named_buffers_by_kind
from bitmatch.testing.models import pad_batch, random_prompts

BF16, F32 = torch.bfloat16, torch.float32
FAMILIES = {f.name: f for f in families()}


def _trainer(name):
    lm = FAMILIES[name].tiny_model(dtype=F32, seed=3)  # the families' tiny models randomize their buffers
    bitmatch.patch(lm, compute_dtype=BF16)
    return lm


def _logprobs(model):
    ids, mask = pad_batch(random_prompts(3, 4, 12, seed=1))
    with torch.no_grad():
        return bitmatch.token_logprobs(model, ids, mask, compute_dtype=BF16)


def _copy(lm):
    copy = bsync.RolloutCopy.from_config(lm.config, BF16, "cpu")
    copy.publish(1, list(lm.state_dict().items()))
    return copy


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_from_config_copy_matches_trainer(name):
    lm = _trainer(name)
    copy = _copy(lm)
    assert copy.require_ready(1) == 1
    kept, derived = named_buffers_by_kind(copy.model)
    src = dict(lm.named_buffers())
    for n, b in {**kept, **derived}.items():
        assert torch.equal(b, src[n].to(b.dtype)), f"{name}: buffer {n} differs from the trainer's"
    want, got = _logprobs(lm), _logprobs(copy.model)
    assert torch.equal(got, want), f"{name}: copy vs trainer max diff {(got - want).abs().max().item()}"


@pytest.mark.parametrize("name", ["nemotron_h", "deepseek_v4"])
def test_buffers_change_the_forward(name):
    lm = _trainer(name)
    copy = _copy(lm)
    with torch.no_grad():
        for n, b in lm.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(-b * 10)
    assert not torch.equal(_logprobs(copy.model), _logprobs(lm)), "the control proves nothing"


def test_publish_without_buffers_is_refused():
    lm = _trainer("deepseek_v4")
    copy = _copy(lm)
    with pytest.raises(ValueError, match=r"lack the buffers \['model.layers.0.mlp.gate.tid2eid'.*state_dict"):
        copy.publish(2, list(lm.named_parameters()))
    assert copy.require_ready() == 1  # the previous version stays


def test_write_into_published_buffer_is_caught():
    lm = _trainer("nemotron_h")
    copy = _copy(lm)
    bias = next(b for n, b in copy.model.named_buffers() if n.endswith("e_score_correction_bias"))
    bias.add_(1.0)
    with pytest.raises(bsync.WeightsNotReadyError, match="e_score_correction_bias"):
        copy.require_ready()


def test_mismatched_rotary_table_is_refused():
    lm = _trainer("qwen3_moe")
    copy = bsync.RolloutCopy.from_config(lm.config, BF16, "cpu")
    inv = lm.model.rotary_emb.inv_freq
    with pytest.raises(ValueError, match="rotary_emb.inv_freq.*differs"):
        copy.publish(1, [*lm.state_dict().items(), ("model.rotary_emb.inv_freq", inv * 2)])
    copy.publish(1, [*lm.state_dict().items(), ("model.rotary_emb.inv_freq", inv)])


def test_tied_config_is_tied_in_the_copy():
    lm = _trainer("dense")
    assert lm.config.tie_word_embeddings
    copy = bsync.RolloutCopy.from_config(lm.config, BF16, "cpu")
    assert copy.model.lm_head.weight is copy.model.get_input_embeddings().weight
    copy.publish(1, list(lm.named_parameters()))            # the tied tensor once, as named_parameters has it
    assert torch.equal(_logprobs(copy.model), _logprobs(lm))
    with pytest.raises(ValueError, match="tied to 'model.embed_tokens.weight'"):  # control: two different values
        copy.publish(2, [*lm.named_parameters(), ("lm_head.weight", lm.lm_head.weight * 2)])
