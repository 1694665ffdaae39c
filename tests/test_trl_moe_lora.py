"""Qwen3-MoE + PEFT LoRA through TRL (issue 24, item 13): under GRPOConfig(bf16=True) with fp32
masters the rollout copy once held the router in bf16 while the trainer routes from the fp32
master (60 of 64 tokens differed at step 0, first divergent layer layers.0.mlp.gate); the copy now
holds the trainer's parameter dtype and casts at use. LoRA on the experts' stacked weights and
bad GRPOConfig sampling options are refused at attach, by name."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bitmatch.testing.models import tiny_model  # noqa: E402
from bitmatch.testing.trl import assert_diff_zero, assert_trained, grpo_trainer, params_snapshot  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _policy():
    return tiny_model("qwen3moe-e4-k1-step2", dtype=torch.float32, seed=0, hidden_size=64, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1).train()


def _trainer(tmp_path, steps, targets=None, **config):
    from peft import LoraConfig
    lora = None if targets is None else LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                   target_modules=targets)
    return grpo_trainer(_policy(), tmp_path / "out", steps, dataset_size=32, per_device_train_batch_size=8,
                        num_generations=4, max_completion_length=5, learning_rate=2e-2, router_aux_loss_coef=0.0,
                        peft_config=lora, **config)


def test_moe_lora_on_attention_under_bf16_diff_zero(tmp_path):
    import bitmatch.adapters.trl as bt

    trainer = bt.attach(_trainer(tmp_path, 2, ATTENTION, bf16=True), rollout_weights="copy")
    assert trainer._bitmatch.compute_dtype == torch.bfloat16
    before = params_snapshot(trainer.model)
    trainer.train()
    assert_diff_zero(trainer, 2)
    assert_trained(before, trainer.model)
    copy = trainer._bitmatch.rollout_model
    assert copy.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the master's dtype, cast at use


def test_lora_on_moe_experts_is_refused_at_attach(tmp_path):
    import bitmatch.adapters.trl as bt

    trainer = _trainer(tmp_path, 1, ATTENTION + ["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ValueError, match=r"^attach: the LoRA adapter on model\.layers\.0\.mlp\.experts "
                                         r"\(ParamWrapper\) wraps a Qwen3MoeExperts, not an nn\.Linear: bitmatch "
                                         r"runs LoRA on Linear layers only\. Leave it out of "
                                         r"LoraConfig\(target_modules=\.\.\.\)"):
        bt.attach(trainer)


@pytest.mark.parametrize("config, text", [
    (dict(top_p=0.0), r"attach: GRPOConfig.top_p must be a float in \(0, 1\] \(1.0: no top-p\), got 0.0"),
    (dict(top_k=-2), r"attach: GRPOConfig.top_k must be an int >= 1, or 0 / -1 / None for no top-k, got -2"),
    (dict(temperature=1e-40), r"attach: GRPOConfig.temperature must be a float in \[1.1754944e-38, "),
])
def test_grpo_config_sampling_options_are_refused_at_attach(tmp_path, config, text):
    import bitmatch.adapters.trl as bt

    with pytest.raises(ValueError, match="^" + text):
        bt.attach(_trainer(tmp_path, 1, **config))
