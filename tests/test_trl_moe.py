"""TRL GRPO with a Qwen3-MoE policy through bitmatch.adapters.trl.attach: the adapter checks every
generation step (on_mismatch="raise"), so a finished run is Diff = 0 on each step; the router and
the experts train (their weights change)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bitmatch.testing.trl import assert_diff_zero, assert_trained, grpo_trainer, params_snapshot, repeat_letter_reward  # noqa: E402


def test_router_aux_loss_is_refused_with_the_fix(tmp_path):
    import bitmatch.adapters.trl as bt
    from bitmatch.testing.models import tiny_model

    policy = tiny_model("qwen3moe-e4-k1-step2", dtype=torch.float32, seed=0, hidden_size=64).train()
    reward = repeat_letter_reward
    trainer = grpo_trainer(policy, tmp_path / "out", 1, dataset_size=8, reward=reward, per_device_train_batch_size=4,
                           num_generations=4, max_completion_length=3)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.0"):
        bt.attach(trainer)


def test_grpo_moe_three_steps_diff_zero(tmp_path):
    import bitmatch.adapters.trl as bt
    from bitmatch.testing.models import tiny_model

    policy = tiny_model("qwen3moe-e4-k1-step2", dtype=torch.float32, seed=0, hidden_size=64, num_experts_per_tok=2,
                        moe_intermediate_size=32, decoder_sparse_step=1).train()
    trainer = bt.attach(grpo_trainer(policy, tmp_path / "out", 3, dataset_size=32, per_device_train_batch_size=8,
                                     num_generations=4, max_completion_length=5, learning_rate=3e-3,
                                     router_aux_loss_coef=0.0))
    before = params_snapshot(trainer.model)
    trainer.train()
    assert_diff_zero(trainer, 3)
    assert_trained(before, trainer.model, ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"))
