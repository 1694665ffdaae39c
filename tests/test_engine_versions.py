"""An Engine fed by a bitmatch.sync receiver: no generation before a verified version, every output
carries the version and fingerprint it was sampled with, no request spans two versions."""
from __future__ import annotations

import pytest
import torch

import bitmatch.sync as bsync
from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing.models import tiny_model

SP = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13], [1, 40]]


@pytest.fixture()
def setup():
    rollout = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1)
    trainer = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=1, num_hidden_layers=1)
    rx = bsync.receive(rollout)
    return rollout, trainer, rx, Engine(rollout, num_gpu_blocks=16)


def test_refuses_until_a_verified_version_then_stamps_version_and_fingerprint(setup):
    rollout, trainer, rx, eng = setup
    with pytest.raises(bsync.WeightsNotReadyError, match="no verified weight version loaded yet.*publish a version "
                                                          "first.*initial_version"):
        eng.generate(PROMPTS, SP, use_tqdm=False)
    assert not eng.has_unfinished_requests()
    with pytest.raises(bsync.WeightsNotReadyError):  # step() by hand is refused as well
        eng.add_request(PROMPTS[0], SP)
        eng.step()
    eng.abort_all()
    man3 = bsync.publish(trainer, 3, to=rx)
    outs = eng.generate(PROMPTS, SP, use_tqdm=False)
    assert [(o.weight_version, o.weight_fingerprint) for o in outs] == [(3, man3.digest())] * 2
    bsync.check_weight_version(outs, 3)
    with pytest.raises(bsync.WeightVersionError, match="sampled with weight version 3, trainer expects 4"):
        bsync.check_weight_version(outs, 4)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.01)
    man4 = bsync.publish(trainer, 4, to=rx)
    outs4 = eng.generate(PROMPTS, SP, use_tqdm=False)
    assert {(o.weight_version, o.weight_fingerprint) for o in outs4} == {(4, man4.digest())}
    assert man4.digest() != man3.digest()


def test_failed_or_running_update_refuses_generation(setup):
    rollout, trainer, rx, eng = setup
    bsync.publish(trainer, 1, to=rx)
    specs = {k: bsync.TensorSpec(tuple(v.shape), torch.bfloat16) for k, v in trainer.named_parameters()}
    upd = rx.begin(2, specs, order=rx.order())
    with pytest.raises(bsync.WeightsNotReadyError, match="update to version 2 in progress"):
        eng.generate(PROMPTS, SP, use_tqdm=False)
    upd.abort("transport died")
    with pytest.raises(bsync.WeightsNotReadyError, match="transport died.*version 1 is still loaded"):
        eng.generate(PROMPTS, SP, use_tqdm=False)
    bsync.publish(trainer, 2, to=rx)
    assert {o.weight_version for o in eng.generate(PROMPTS, SP, use_tqdm=False)} == {2}


def test_no_request_spans_two_versions(setup):
    rollout, trainer, rx, eng = setup
    bsync.publish(trainer, 1, to=rx)
    eng.add_request(PROMPTS[0], SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True))
    eng.step()  # prefill + first token under version 1
    bsync.publish(trainer, 2, to=rx)
    with pytest.raises(bsync.WeightVersionError, match="switched from version 1 to 2 while request 0 was running"):
        eng.step()
    assert not eng.has_unfinished_requests() and eng.block_manager.num_free_blocks == eng.num_gpu_blocks
    assert {o.weight_version for o in eng.generate(PROMPTS, SP, use_tqdm=False)} == {2}


def test_engine_without_receiver_generates_and_stamps_none():
    model = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1)
    outs = Engine(model, num_gpu_blocks=16).generate(PROMPTS, SP, use_tqdm=False)
    assert [(o.weight_version, o.weight_fingerprint) for o in outs] == [(None, None)] * 2
    with pytest.raises(bsync.WeightVersionError, match="carries no weight version"):
        bsync.check_weight_version(outs, 0)


def test_initial_version_accepts_loaded_weights():
    model = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, num_hidden_layers=1)
    rx = bsync.receive(model, initial_version=0)
    outs = Engine(model, num_gpu_blocks=16).generate(PROMPTS, SP, use_tqdm=False)
    assert {(o.weight_version, o.weight_fingerprint) for o in outs} == {(0, rx.state.manifest.digest())}


def test_publish_during_generate_names_the_right_fix(setup):
    """Issue 24 item 14: an update staged while the engine steps is not 'no version yet'."""
    rollout, trainer, rx, eng = setup
    bsync.publish(trainer, 1, to=rx)
    specs = {k: bsync.TensorSpec(tuple(v.shape), torch.bfloat16) for k, v in trainer.named_parameters()}
    upd = rx.begin(2, specs, order=rx.order())
    with pytest.raises(bsync.WeightsNotReadyError, match="in progress.*publish between generate\\(\\) calls") as ei:
        eng.generate(PROMPTS, SP, use_tqdm=False)
    assert "initial_version" not in str(ei.value)
    upd.abort("test")
    eng.abort_all()
    with pytest.raises(bsync.WeightsNotReadyError, match="publish a full version again"):
        eng.generate(PROMPTS, SP, use_tqdm=False)
