"""The vLLM plugin refuses, when the engine is configured, a head size vLLM's CPU attention backend
cannot lay out (issue 24, item 13): a head_dim-16 model used to start and kill vLLM at the first
generate."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (pip install -e '.[vllm]' or scripts/install_vllm.sh)"),
]


def _config(**hf):
    hf = SimpleNamespace(architectures=["Qwen3ForCausalLM"], hidden_size=64, num_attention_heads=4, **hf)
    mc = SimpleNamespace(hf_config=hf, quantization=None, logprobs_mode="processed_logprobs", dtype=torch.bfloat16)
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                                            pipeline_parallel_size=1),
                           speculative_config=None, lora_config=None, cache_config=SimpleNamespace(cache_dtype="auto"))


def test_head_dim_16_is_refused_at_engine_start():
    from vllm.platforms import current_platform

    from bitmatch.adapters.vllm.checks import BitmatchUnsupportedError, check_engine_config
    if not current_platform.is_cpu():
        pytest.skip("the CPU backend's head sizes; on GPU vLLM's selector refuses an unsupported head size itself")
    with pytest.raises(BitmatchUnsupportedError, match=r"head_dim=16 \(vLLM's CPU attention backend, which lays out "
                                                       r"the KV cache, supports head sizes 32, 64, .*; use "
                                                       r"bitmatch.Engine for this model's rollouts\)"):
        check_engine_config(_config(head_dim=16))
    with pytest.raises(BitmatchUnsupportedError, match=r"head_dim=16 "):
        check_engine_config(_config(head_dim=None))  # 64 / 4 heads
    check_engine_config(_config(head_dim=64))   # a supported size passes the same gate
