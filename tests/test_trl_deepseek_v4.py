"""TRL GRPO with a tiny DeepSeek-V4 policy (sliding, CSA, HCA layers; hash and learned routing;
mHC) through bitmatch.adapters.trl.attach: the adapter checks every generation step
(on_mismatch="raise"), so a finished run is Diff = 0 on each step; the mHC mixes, the sinks, the
compressors and the experts train. The example's quantized-checkpoint refusal names the fix."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from bitmatch.testing.trl import assert_diff_zero, assert_trained, grpo_trainer, load_example, params_snapshot  # noqa: E402


def _dsv4_example():
    return load_example("deepseek_v4_flash_grpo")


def test_grpo_deepseek_v4_three_steps_diff_zero(tmp_path):
    import bitmatch.adapters.trl as bt

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the float64 reference is fastest on one thread; bits do not depend on it
    try:
        policy = _dsv4_example().tiny_policy(seed=0)
        trainer = bt.attach(grpo_trainer(policy, tmp_path / "out", 3, dataset_size=32, per_device_train_batch_size=8,
                                         num_generations=4, max_completion_length=6, learning_rate=1e-2,
                                         router_aux_loss_coef=0.0))
        before = params_snapshot(trainer.model)
        trainer.train()
    finally:
        torch.set_num_threads(n)
    assert_diff_zero(trainer, 3)
    assert_trained(before, trainer.model, (
        "model.layers.1.attn_hc.fn", "model.layers.2.self_attn.sinks",
        "model.layers.2.self_attn.compressor.kv_proj.weight", "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.gate.weight", "model.hc_head.hc_fn"))


def test_example_refuses_an_unreadable_quantized_checkpoint(tmp_path):
    """FP8 / FP4 checkpoints load (tests/test_quant_loader.py); a format bitmatch cannot read
    exactly is refused by name before any weight loads."""
    import transformers

    from bitmatch.models.deepseek_v4_tiny import tiny_config

    transformers.AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        d = json.load(f)
    d["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(SystemExit, match="not read by bitmatch"):
        _dsv4_example().load_checkpoint(str(tmp_path), torch.float32)


def test_example_main_two_steps(tmp_path):
    """The example itself (tiny DeepSeek-V4 in code, TRL GRPO, attach with on_mismatch="raise")."""
    n = torch.get_num_threads()
    try:
        trainer = _dsv4_example().main(["--steps", "2", "--batch", "8", "--output-dir", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(n)
    hist = trainer._bitmatch.history
    assert len(hist) == 2 and all(h.total > 0 and h.mismatches == 0 for h in hist)
