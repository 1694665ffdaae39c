"""TRL GRPO with a Qwen3-MoE policy through bitmatch.adapters.trl.attach: the adapter checks every
generation step (on_mismatch="raise"), so a finished run is Diff = 0 on each step; the router and
the experts train (their weights change)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from test_trl import TEMPERATURE, assert_trained, ex, logged, params_snapshot, toy_reward  # noqa: E402


def test_router_aux_loss_is_refused_with_the_fix(tmp_path):
    from trl import GRPOTrainer

    import bitmatch.adapters.trl as bt
    from bitmatch.testing_models import tiny_model

    policy = tiny_model("qwen3moe-e4-k1-step2", dtype=torch.float32, seed=0, hidden_size=64).train()
    args = ex.toy_config(str(tmp_path / "out"), 1, per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=3, temperature=TEMPERATURE)
    trainer = GRPOTrainer(model=policy, reward_funcs=ex.repeat_letter_reward, args=args,
                          train_dataset=ex.toy_dataset(8), processing_class=ex.char_tokenizer())
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0\.0"):
        bt.attach(trainer)


def test_grpo_moe_three_steps_diff_zero(tmp_path):
    from trl import GRPOTrainer

    import bitmatch.adapters.trl as bt
    from bitmatch.testing_models import tiny_model

    policy = tiny_model("qwen3moe-e4-k1-step2", dtype=torch.float32, seed=0, hidden_size=64, num_experts_per_tok=2,
                        moe_intermediate_size=32, decoder_sparse_step=1).train()
    args = ex.toy_config(str(tmp_path / "out"), 3, per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=5, temperature=TEMPERATURE, learning_rate=3e-3,
                         router_aux_loss_coef=0.0)
    trainer = bt.attach(GRPOTrainer(model=policy, reward_funcs=toy_reward, args=args,
                                    train_dataset=ex.toy_dataset(32), processing_class=ex.char_tokenizer()))
    before = params_snapshot(trainer.model)
    trainer.train()
    hist = trainer._bitmatch.history
    assert [h.step for h in hist] == [0, 1, 2]
    assert all(h.total > 0 and h.mismatches == 0 and h.diff_max == 0.0 for h in hist), hist
    assert logged(trainer, "bitmatch/mismatch_tokens") == [0.0] * 3
    assert_trained(before, trainer.model)
    after = dict(trainer.model.named_parameters())
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"):
        assert not torch.equal(before[name], after[name].detach()), f"{name} did not train"
