"""TRL GRPO with a Nemotron-H policy (Mamba2, MoE, attention, MLP blocks; chunk_size 8) through
bitmatch.adapters.trl.attach: the adapter checks every generation step (on_mismatch="raise"), so a
finished run is Diff = 0 on each step; the Mamba parameters, router and experts train."""
from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from test_trl import TEMPERATURE, assert_trained, ex, logged, params_snapshot, toy_reward  # noqa: E402

_EX = pathlib.Path(__file__).resolve().parents[1] / "examples" / "nemotron_h_grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("bitmatch_example_nemotron_h_grpo", _EX)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grpo_nemotron_h_two_steps_diff_zero(tmp_path):
    from trl import GRPOTrainer

    import bitmatch.adapters.trl as bt

    nx = _example()
    policy = nx.tiny_policy(seed=1)
    args = ex.toy_config(str(tmp_path / "out"), 2, per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=10, temperature=TEMPERATURE, learning_rate=1e-2)
    trainer = bt.attach(GRPOTrainer(model=policy, reward_funcs=toy_reward, args=args,
                                    train_dataset=ex.toy_dataset(16), processing_class=ex.char_tokenizer()))
    before = params_snapshot(trainer.model)
    trainer.train()
    hist = trainer._bitmatch.history
    assert [h.step for h in hist] == [0, 1]
    assert all(h.total > 0 and h.mismatches == 0 and h.diff_max == 0.0 for h in hist), hist
    assert logged(trainer, "bitmatch/mismatch_tokens") == [0.0] * 2
    assert_trained(before, trainer.model)
    after = dict(trainer.model.named_parameters())
    for name in ("model.layers.0.mixer.A_log", "model.layers.0.mixer.in_proj.weight",
                 "model.layers.1.mixer.gate.weight", "model.layers.1.mixer.experts.up_proj"):
        assert not torch.equal(before[name], after[name].detach()), f"{name} did not train"
