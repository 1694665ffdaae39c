"""TRL + PEFT LoRA on tied and untied embeddings (issue 24, item 12): the rollout copy ties its LM
head to its embedding exactly as the trainer's model does, so the fingerprint-verified publish
covers every parameter once (a tied model once failed the first step with "weight update must
cover every parameter exactly once: missing ['lm_head.weight']") and Diff = 0 on every step.
The default rollout ("shared": the engine on the policy, LoRA layers on kept merged weights
refreshed when A / B change) likewise, on fp32 masters with bf16-free compute."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bitmatch.testing.models import tiny_model  # noqa: E402
from bitmatch.testing.trl import assert_diff_zero, assert_trained, grpo_trainer, params_snapshot  # noqa: E402

STEPS = 2


@pytest.mark.parametrize("tied,mode", [(True, "copy"), (False, "copy"), (True, "auto")],
                         ids=["tied-copy", "untied-copy", "tied-shared"])
def test_grpo_lora_diff_zero_with_tied_and_untied_embeddings(tmp_path, tied, mode):
    from peft import LoraConfig

    import bitmatch.adapters.trl as bt

    policy = tiny_model("qwen3", dtype=torch.float32, seed=0, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                        tie_word_embeddings=tied)
    policy.train()
    assert (policy.lm_head.weight is policy.model.embed_tokens.weight) == tied
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    trainer = bt.attach(grpo_trainer(policy, tmp_path / "out", STEPS, peft_config=lora, per_device_train_batch_size=8,
                                     num_generations=4, max_completion_length=6, learning_rate=2e-2),
                       rollout_weights=mode)
    before = params_snapshot(trainer.model)
    trainer.train()
    assert_diff_zero(trainer, STEPS)
    assert_trained(before, trainer.model)
    if mode == "auto":
        assert trainer._bitmatch.rollout_weights == "shared" and trainer._bitmatch.rollout_model is None
        return
    copy = trainer._bitmatch.rollout_model
    assert (copy.lm_head.weight is copy.model.embed_tokens.weight) == tied
    assert trainer._bitmatch.receiver.version == STEPS - 1
