"""EngineConfig: the engine's settings validated in one place; Engine(**kwargs) and
Engine(config=EngineConfig(**kwargs)) are the same engine, bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import bitmatch
from bitmatch.engine import Engine, EngineConfig
from bitmatch.testing.models import tiny_model


def test_config_and_keywords_build_the_same_engine():
    model = bitmatch.patch(tiny_model("qwen3", dtype=torch.float32))
    kw = dict(max_num_seqs=4, kv_cache_bytes=1 << 22, block_size=8, seed=3)
    a, b = Engine(model, **kw), Engine(model, config=EngineConfig(**kw))
    assert a.config == b.config == EngineConfig(**kw)
    assert (a.num_gpu_blocks, a.block_size, a.max_num_seqs) == (b.num_gpu_blocks, b.block_size, b.max_num_seqs)
    sp = bitmatch.SamplingParams(temperature=0.8, max_tokens=4)
    out_a = a.generate([[1, 5, 9], [2, 4]], sp, use_tqdm=False)
    out_b = b.generate([[1, 5, 9], [2, 4]], sp, use_tqdm=False)
    assert [o.outputs[0].logprobs for o in out_a] == [o.outputs[0].logprobs for o in out_b]
    assert dataclasses.replace(a.config, max_num_seqs=2).max_num_seqs == 2
    assert a.config.as_dict()["kv_cache_bytes"] == 1 << 22


@pytest.mark.parametrize("kw, err, words", [
    (dict(block_size=0), ValueError, "block_size must be an int >= 1"),
    (dict(max_num_seqs=True), ValueError, "max_num_seqs must be an int >= 1"),
    (dict(seed=2 ** 64), ValueError, "seed must be an int in [0, 2**64)"),
    (dict(num_gpu_blocks=4, kv_cache_bytes=1 << 20), ValueError, "not both"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization must be in (0, 1]"),
    (dict(memory_share="all"), ValueError, "memory_share must be 'device' or 'engine'"),
    (dict(max_model_len=0), ValueError, "max_model_len must be an int >= 1"),
    (dict(quantization="int8"), ValueError, "quantization='int8' is not supported"),
    (dict(kv_cache_dtype="fp8"), ValueError, "kv_cache_dtype= (vLLM's) is not supported"),
    (dict(max_num_seq=4), TypeError, "unexpected keyword argument(s) ['max_num_seq']"),
])
def test_each_bad_setting_is_named_before_any_model_work(kw, err, words):
    with pytest.raises(err) as e:
        EngineConfig.from_kwargs(**kw)
    assert words in str(e.value)
    with pytest.raises(err, match=None) as e2:  # the same message through Engine
        Engine(object(), **kw)
    assert words in str(e2.value)


def test_config_and_keywords_together_are_refused():
    with pytest.raises(TypeError, match="not both"):
        Engine(object(), config=EngineConfig(), max_num_seqs=2)
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(object(), config={"max_num_seqs": 2})
