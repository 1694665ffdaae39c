"""TRL GRPO with a Nemotron-H policy (Mamba2, MoE, attention, MLP blocks; chunk_size 16) through
bitmatch.adapters.trl.attach: the adapter checks every generation step (on_mismatch="raise"), so a
finished run is Diff = 0 on each step; the Mamba parameters, router and experts train."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bitmatch.testing.trl import assert_diff_zero, assert_trained, grpo_trainer, load_example, params_snapshot  # noqa: E402


def test_grpo_nemotron_h_two_steps_diff_zero(tmp_path):
    import bitmatch.adapters.trl as bt

    policy = load_example("nemotron_h_grpo").tiny_policy(seed=1)
    trainer = bt.attach(grpo_trainer(policy, tmp_path / "out", 2, dataset_size=16, per_device_train_batch_size=8,
                                     num_generations=4, max_completion_length=10, learning_rate=1e-2))
    before = params_snapshot(trainer.model)
    trainer.train()
    assert_diff_zero(trainer, 2)
    assert_trained(before, trainer.model, ("model.layers.0.mixer.A_log", "model.layers.0.mixer.in_proj.weight",
                                           "model.layers.1.mixer.gate.weight", "model.layers.1.mixer.experts.up_proj"))
