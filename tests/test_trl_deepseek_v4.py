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

from test_trl import TEMPERATURE, assert_trained, ex, logged, params_snapshot, toy_reward  # noqa: E402


def _dsv4_example():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "deepseek_v4_flash_grpo.py")
    spec = importlib.util.spec_from_file_location("deepseek_v4_flash_grpo", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grpo_deepseek_v4_three_steps_diff_zero(tmp_path):
    from trl import GRPOTrainer

    import bitmatch.adapters.trl as bt

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the float64 reference is fastest on one thread; bits do not depend on it
    try:
        policy = _dsv4_example().tiny_policy(seed=0)
        args = ex.toy_config(str(tmp_path / "out"), 3, per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=6, temperature=TEMPERATURE, learning_rate=1e-2,
                             router_aux_loss_coef=0.0)
        trainer = bt.attach(GRPOTrainer(model=policy, reward_funcs=toy_reward, args=args,
                                        train_dataset=ex.toy_dataset(32), processing_class=ex.char_tokenizer()))
        before = params_snapshot(trainer.model)
        trainer.train()
    finally:
        torch.set_num_threads(n)
    hist = trainer._bitmatch.history
    assert [h.step for h in hist] == [0, 1, 2]
    assert all(h.total > 0 and h.mismatches == 0 and h.diff_max == 0.0 for h in hist), hist
    assert logged(trainer, "bitmatch/mismatch_tokens") == [0.0] * 3
    assert_trained(before, trainer.model)
    after = dict(trainer.model.named_parameters())
    for name in ("model.layers.1.attn_hc.fn", "model.layers.2.self_attn.sinks",
                 "model.layers.2.self_attn.compressor.kv_proj.weight", "model.layers.3.mlp.experts.gate_up_proj",
                 "model.layers.0.mlp.gate.weight", "model.hc_head.hc_fn"):
        assert not torch.equal(before[name], after[name].detach()), f"{name} did not train"


def test_example_refuses_quantized_checkpoint(tmp_path):
    from bitmatch.models.deepseek_v4_tiny import tiny_config

    cfg = tiny_config()
    cfg.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        d = json.load(f)
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(SystemExit, match="dequantize"):
        _dsv4_example().refuse_quantized(str(tmp_path))


def test_example_main_two_steps(tmp_path):
    """The example itself (tiny DeepSeek-V4 in code, TRL GRPO, attach with on_mismatch="raise")."""
    n = torch.get_num_threads()
    try:
        trainer = _dsv4_example().main(["--steps", "2", "--batch", "8", "--output-dir", str(tmp_path / "out")])
    finally:
        torch.set_num_threads(n)
    hist = trainer._bitmatch.history
    assert len(hist) == 2 and all(h.total > 0 and h.mismatches == 0 for h in hist)
