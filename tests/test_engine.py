"""Engine logprobs == trainer logprobs (bitmatch.token_logprobs), bit for bit.

The matrix is split across cases so that together they cover >= 200 sampled sequences:
max_num_seqs 1 / 7 / 64; prompt lengths 1..300; chunked prefill on and off; block sizes 16
and 32; temperatures 0.6 and 1.0, top-p 0.9 and greedy; Qwen2 / Qwen3 / Llama / Mistral tiny
configs (head_dim 64 and 128, GQA 1 / 4 / 8, tied and untied, RoPE-scaled, sliding window).
The control recomputes the same tokens with the stock HF forward and must mismatch.
"""
from __future__ import annotations

import pytest
import torch

from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model


def trainer_token_logprobs():
    import bitmatch
    try:
        return bitmatch.token_logprobs
    except AttributeError:  # before the lead's lazy export
        from bitmatch.logprobs import token_logprobs
        return token_logprobs


def trainer_logprobs(model, outs, temperature: float, batch: int = 5, side: str = "right"):
    """Trainer-side logprob of every completion token, recomputed in padded batches of ``batch``."""
    fn = trainer_token_logprobs()
    result = []
    for s in range(0, len(outs), batch):
        group = outs[s: s + batch]
        seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in group]
        ids, mask = pad_batch(seqs, side=side)
        with torch.no_grad():
            lp = fn(model, ids, mask, temperature=temperature)
        for b, o in enumerate(group):
            off = ids.shape[1] - len(seqs[b]) if side == "left" else 0
            p, c = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
            result.append(lp[b, off + p - 1: off + p + c - 1].float())
    return result


def hf_logprobs(model, outs, temperature: float):
    """The control: the stock HF forward, log_softmax(logits.float() / T) at each token."""
    result = []
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float() / temperature
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        p = len(o.prompt_token_ids)
        result.append(lp[p - 1:])
    return result


def temperature_of(sp: SamplingParams) -> float:
    return 1.0 if sp.greedy else sp.temperature


def assert_bitmatch(model, outs, params, batch: int = 5, side: str = "right") -> int:
    """Compare every output with the trainer, grouped by temperature; returns tokens compared."""
    groups: dict[float, list[int]] = {}
    for i, sp in enumerate(params):
        groups.setdefault(temperature_of(sp), []).append(i)
    n_tokens = 0
    for t, idx in groups.items():
        trainer = trainer_logprobs(model, [outs[i] for i in idx], t, batch, side)
        for i, ref in zip(idx, trainer):
            got = torch.tensor(outs[i].outputs[0].logprobs, dtype=torch.float32)
            assert got.shape == ref.shape
            bad = (got.view(torch.int32) != ref.view(torch.int32)).nonzero()[:, 0].tolist()
            assert not bad, (f"request {i} (T={t}, prompt {len(outs[i].prompt_token_ids)}): tokens {bad} differ; "
                             f"engine {got[bad].tolist()} trainer {ref[bad].tolist()}")
            n_tokens += got.numel()
    return n_tokens


def mixed_params(n: int, max_tokens: int, seed: int = 0) -> list[SamplingParams]:
    kinds = [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_p=0.9),
             dict(temperature=0.6, top_p=0.9, top_k=20), dict(temperature=0.0)]
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed * 1000 + i, **kinds[i % len(kinds)])
            for i in range(n)]


# (model, max_num_seqs, chunked, block_size, max_num_batched_tokens, n, max_len, max_tokens, layers)
# Sized for the float64-exact CPU reference kernels (slow per step): short completions, one or
# two layers; 204 sequences in all; the long prompts (up to 300) ride in the first case.
CASES = [
    ("qwen3-hd64-gqa4-tied", 64, True, 16, 128, 64, 20, 2, 2),
    ("llama-hd128-gqa8-llama3rope", 7, False, 32, 512, 48, 24, 2, 1),
    ("qwen2-hd64-gqa1-bias-sw", 1, True, 16, 16, 12, 40, 2, 1),
    ("mistral-hd128-gqa4-sw", 7, True, 32, 32, 40, 40, 3, 1),
    ("qwen3-hd128-gqa1-linearrope", 64, False, 16, 2048, 40, 24, 2, 1),
]
LONG_PROMPTS = (300, 203, 129)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-seqs{c[1]}-chunk{int(c[2])}-bs{c[3]}" for c in CASES])
def test_engine_logprobs_equal_trainer(case):
    name, max_seqs, chunked, bs, mbt, n, hi, max_tokens, layers = case
    model = tiny_model(name, seed=1, num_hidden_layers=layers)
    prompts = random_prompts(n, 1, hi, seed=len(name))
    prompts[0] = prompts[0][:1]  # always a 1-token prompt
    if max_seqs == 64 and chunked:
        for i, L in enumerate(LONG_PROMPTS):
            prompts[1 + 7 * i] = random_prompts(1, L, L, seed=i)[0]
    params = mixed_params(n, max_tokens, seed=max_seqs)
    engine = Engine(model, block_size=bs, max_num_seqs=max_seqs, max_num_batched_tokens=mbt,
                    enable_chunked_prefill=chunked, num_gpu_blocks=2048 // bs * 8, seed=3)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    assert assert_bitmatch(model, outs, params, batch=7 if chunked else 4,
                           side="left" if bs == 32 else "right") == n * max_tokens
    # top-k/top-p rows: the masked distribution's logprob is stored beside the full one
    masked = [i for i, sp in enumerate(params) if sp.masked]
    diff = sum(a != b for i in masked for a, b in zip(outs[i].outputs[0].logprobs, outs[i].outputs[0].sampled_logprobs))
    assert diff > 0
    plain = [i for i, sp in enumerate(params) if not sp.masked]
    assert all(outs[i].outputs[0].logprobs == outs[i].outputs[0].sampled_logprobs for i in plain)


def test_control_stock_hf_forward_mismatches():
    """The same comparison against the stock HF forward fails: the test can fail."""
    model = tiny_model("qwen3-hd64-gqa4-tied", seed=1, num_hidden_layers=1)
    prompts = random_prompts(4, 10, 30, seed=5)
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i) for i in range(4)]
    outs = Engine(model, num_gpu_blocks=256).generate(prompts, params, use_tqdm=False)
    assert_bitmatch(model, outs, params)
    hf = hf_logprobs(model, outs, 1.0)
    mism = sum(int((torch.tensor(o.outputs[0].logprobs) != h).sum()) for o, h in zip(outs, hf))
    assert mism > 0, "stock HF forward unexpectedly matched the engine bit for bit"
