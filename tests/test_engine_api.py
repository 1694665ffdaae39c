"""Engine API: seeds, stop tokens, max_tokens, strings, weight sharing, argument errors."""
from __future__ import annotations

import pytest
import torch

from bitmatch.engine import Engine, RequestOutput, SamplingParams
from bitmatch.testing.models import CharTokenizer, random_prompts, tiny_model
from test_engine import assert_bitmatch


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-hd128-gqa8-llama3rope", seed=4, num_hidden_layers=1)


def completion(o: RequestOutput):
    return o.outputs[0].token_ids, o.outputs[0].logprobs


def test_same_seed_same_tokens_whatever_the_batch(model):
    target = random_prompts(1, 25, 25, seed=1)[0]
    sp = SamplingParams(temperature=1.0, top_k=50, max_tokens=6, ignore_eos=True, seed=1234)
    alone = Engine(model, max_num_seqs=1, num_gpu_blocks=128).generate([target], sp, use_tqdm=False)[0]
    others = random_prompts(5, 1, 40, seed=2)
    other_sp = [SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True, seed=i) for i in range(5)]
    eng = Engine(model, max_num_seqs=7, max_num_batched_tokens=48, block_size=32, num_gpu_blocks=64, seed=9)
    outs = eng.generate(others[:4] + [target] + others[4:], other_sp[:4] + [sp] + other_sp[4:], use_tqdm=False)
    assert completion(outs[4]) == completion(alone)
    # different seed: different tokens
    sp2 = SamplingParams(temperature=1.0, top_k=50, max_tokens=6, ignore_eos=True, seed=4321)
    assert completion(eng.generate([target], sp2, use_tqdm=False)[0])[0] != completion(alone)[0]


def test_seed_none_derived_from_engine_seed_and_request_index(model):
    prompts = random_prompts(3, 5, 20, seed=3)
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    a = Engine(model, seed=7, num_gpu_blocks=64).generate(prompts, sp, use_tqdm=False)
    b = Engine(model, seed=7, num_gpu_blocks=64, max_num_seqs=1).generate(prompts, sp, use_tqdm=False)
    c = Engine(model, seed=8, num_gpu_blocks=64).generate(prompts, sp, use_tqdm=False)
    assert [completion(x) for x in a] == [completion(x) for x in b]
    assert [completion(x)[0] for x in a] != [completion(x)[0] for x in c]
    # identical prompts in one batch get different samples (different request index)
    d = Engine(model, seed=7, num_gpu_blocks=64).generate([prompts[0]] * 2, sp, use_tqdm=False)
    assert completion(d[0])[0] != completion(d[1])[0]


def test_stop_tokens_max_tokens_and_eos(model):
    prompt = random_prompts(1, 12, 12, seed=5)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eng = Engine(model, num_gpu_blocks=64)
    full = eng.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length" and full.stop_reason is None
    k = next(i for i in range(2, 12) if full.token_ids[i] not in full.token_ids[:i])
    stop = full.token_ids[k]
    out = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop],
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:k + 1] and out.logprobs == full.logprobs[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    short = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert short.token_ids == full.token_ids[:3] or short.finish_reason == "stop"
    # EOS from the model config ends the request unless ignore_eos
    eos_model = tiny_model("llama-hd128-gqa8-llama3rope", seed=4, num_hidden_layers=1, eos_token_id=stop)
    e2 = Engine(eos_model, num_gpu_blocks=64)
    out = e2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:k + 1] and out.finish_reason == "stop"


def test_string_prompts_with_tokenizer_and_input_order(model):
    tok = CharTokenizer()
    eng = Engine(model, tok, num_gpu_blocks=64)
    prompts = ["hello world", "a", "the quick brown fox jumps over the lazy dog"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 2, 3)]
    outs = eng.generate(prompts, params, use_tqdm=True)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 2, 3]
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    ids = eng.generate([tok.encode(prompts[0])], params[0], use_tqdm=False)[0]
    assert completion(ids) == completion(outs[0])
    assert_bitmatch(model, outs, params)


def test_weights_shared_update_seen_at_next_generate():
    model = tiny_model("qwen2-hd64-gqa1-bias-sw", seed=6, num_hidden_layers=1)
    eng = Engine(model, num_gpu_blocks=64, enable_prefix_caching=True)
    prompts = random_prompts(3, 20, 40, seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    before = eng.generate(prompts, sp, use_tqdm=False)
    a = before[0].outputs[0].token_ids[0]
    b = 77 if a != 77 else 78
    with torch.no_grad():  # an "optimizer step" on the module's own tensors: swap two logits
        w = model.lm_head.weight
        w[[a, b]] = w[[b, a]]
    after = eng.generate(prompts, sp, use_tqdm=False)
    assert after[0].outputs[0].token_ids[0] == b
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    again = eng.generate(prompts, sp, use_tqdm=False)  # prefix cache on: must not reuse stale K/V
    assert [completion(o) for o in after] != [completion(o) for o in again]
    assert_bitmatch(model, again, [sp] * 3)
    assert eng.model is model and eng.model_runner.model is model


def test_greedy_matches_stock_hf_generate(model):
    """Same model, so the same greedy tokens; the kernels differ in rounding, so a divergence is
    allowed only at a near-tie of the stock HF logits (within 2 bf16 ulps)."""
    prompts = random_prompts(4, 5, 30, seed=12)
    outs = Engine(model, num_gpu_blocks=64).generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)
    exact = 0
    for p, o in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        got = o.outputs[0].token_ids
        if got == ref:
            exact += 1
            continue
        k = next(i for i in range(6) if got[i] != ref[i])
        with torch.no_grad():
            logits = model(torch.tensor([p + got[:k]])).logits[0, -1].float()
        gap = float(logits[ref[k]] - logits[got[k]])
        assert 0 <= gap <= 2 * 2.0 ** -7 * max(1.0, abs(float(logits[ref[k]]))), (p, got, ref, gap)
    assert exact >= 2


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(seed=1.5), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_errors_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(block_size=0), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(num_gpu_blocks=0), "num_gpu_blocks"),
    (dict(kv_cache_bytes=10), "kv_cache_bytes"), (dict(num_gpu_blocks=4, kv_cache_bytes=10 ** 6), "num_gpu_blocks"),
    (dict(memory_share="all"), "memory_share"),
])
def test_engine_errors_name_the_argument(model, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Engine(model, **kwargs)


def test_generate_errors(model):
    eng = Engine(model, num_gpu_blocks=16)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.generate(["text"], use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        eng.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        eng.generate([[1, 500]], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        eng.generate([[1, 2], [3]], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match=r"unsupported architecture.*docs/porting\.md"):
        Engine(torch.nn.Linear(2, 2))
    assert not eng.has_unfinished_requests()
    assert len(eng.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_requests_join_mid_flight_with_step(model):
    prompts = random_prompts(3, 5, 30, seed=13)
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=i) for i, m in enumerate((3, 8, 5))]
    ref = Engine(model, num_gpu_blocks=64).generate(prompts, params, use_tqdm=False)
    eng = Engine(model, num_gpu_blocks=64)
    ids = [eng.add_request(prompts[0], params[0]), eng.add_request(prompts[1], params[1])]
    done = {}
    for _ in range(2):
        done.update({o.request_id: o for o in eng.step()})
    ids.append(eng.add_request(prompts[2], params[2]))  # joins while the others decode
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step()})
    assert [completion(done[i]) for i in ids] == [completion(o) for o in ref]


def test_kv_budget_shares():
    # a GPU of 80 units: the trainer holds 40 (in use before the engine), the engine's step adds 2
    # of derived weights and peaks at 6 of activations, other processes hold 1
    from bitmatch.engine.model_runner import kv_budget
    fig = dict(total=80, other=1, base=40, in_use=42, peak=6)
    # vLLM's rule: 0.9 of the device minus everything in use: what the trainer needs is gone
    assert kv_budget(utilization=0.9, share="device", **fig) == 72 - 1 - 42 - 6
    # TRL's colocate rule: 0.3 of the device is the engine's own, the trainer's memory not counted
    assert kv_budget(utilization=0.3, share="engine", **fig) == 24 - 6 - 2
    assert kv_budget(utilization=0.1, share="engine", **fig) == 0  # never negative
    with pytest.raises(ValueError, match="memory_share"):
        kv_budget(utilization=0.3, share="process", **fig)
