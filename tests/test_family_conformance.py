"""What every registered family owes, run over ``bitmatch.models.families()``: a new family gets
these tests by registering (and giving ``Family.tiny_config`` / a ``tiny_model``).

- its tiny config is supported, and ``problems(config)`` refuses an unsupported option by name;
- HF parity: ``token_logprobs`` in fp32 is HF's own fp32 forward within a tolerance (same math);
- gradients: ``token_logprobs``' backward in fp32 is HF's own float64 autograd within a relative
  tolerance, on most parameters (those HF gives a gradient);
- the batch axis: a sequence's trainer logprobs alone == inside right- and left-padded batches;
- the schedule axis: the engine with chunked prefill in a batch == one sequence at a time, whole
  prompts, other block size (same seeds, so the same tokens and the same bits);
- engine == trainer: the embedded engine's reported logprobs are ``token_logprobs``' bit for bit;
- the controls: HF's own bf16 forward gives other bits than the engine, and HF's own bf16 forward
  of a padded batch other bits than alone (each comparison can fail).

Tiny models, two prompts, a few tokens: the reference backend is exact and slow on CPU.
"""
from __future__ import annotations

import copy

import pytest
import torch

from bitmatch.diagnostics.family_check import tiny_model_for
from bitmatch.engine import Engine, SamplingParams
from bitmatch.logprobs import token_logprobs
from bitmatch.models import families
from bitmatch.testing import bits_equal, same_outputs
from bitmatch.testing.models import pad_batch, random_prompts

T = 0.8
FAMILIES = [pytest.param(f, id=f.name) for f in families()]
# one option per family its problems() must refuse, by the option's name; a family not listed is
# tried with the generic ones (a new family whose problems() refuses none of them fails: add its own)
UNSUPPORTED = {
    "dense": [("hidden_act", "gelu")],
    "qwen3_moe": [("output_router_logits", True)],
    "nemotron_h": [("mlp_hidden_act", "gelu")],
    "deepseek_v4": [("scoring_func", "no_such_scoring")],
}
GENERIC_UNSUPPORTED = [("hidden_act", "gelu"), ("output_router_logits", True), ("attention_dropout", 0.5)]
# fp32 HF vs bitmatch fp32: the same math in another order (max |diff| in nats)
HF_FP32_TOLERANCE = 1e-4
# fp32 token_logprobs backward vs HF's float64 autograd: relative error of each parameter's gradient
GRAD_TOLERANCE = 1e-4


def _prompts(vocab: int) -> list[list[int]]:
    return random_prompts(2, 5, 9, seed=4, vocab_hi=min(99, vocab))


def _hf_logprobs(model, seq: list[int], dtype) -> torch.Tensor:
    """HF's own forward (no bitmatch), log_softmax(logits.float() / T) of each next token: [len - 1]."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits = model.to(dtype)(input_ids=ids).logits[0].float() / T
    return torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def tiny_fp32(family):
    return tiny_model_for(family.name, torch.float32, seed=0)[0]


def test_tiny_config_is_supported(family):
    cfg = family.tiny_config()
    assert family.problems(cfg) == [], f"{family.name}: its own tiny config is refused: {family.problems(cfg)}"


def test_problems_refuses_an_unsupported_option_by_name(family):
    tried = []
    for attr, value in UNSUPPORTED.get(family.name, []) + GENERIC_UNSUPPORTED:
        cfg = family.tiny_config()
        setattr(cfg, attr, value)
        found = family.problems(cfg)
        if any(attr in p for p in found):
            return
        tried.append(f"{attr}={value!r} -> {found}")
    pytest.fail(f"{family.name}: problems() refused none of: {'; '.join(tried)} (name the option it refuses; "
                "add the family's own unsupported option to UNSUPPORTED)")


def test_token_logprobs_fp32_is_hf_fp32(family, tiny_fp32):
    model = tiny_fp32
    prompts = _prompts(model.config.vocab_size)
    hf = [_hf_logprobs(model, p, torch.float32) for p in prompts]
    for p, ref in zip(prompts, hf):
        with torch.no_grad():
            got = token_logprobs(model, torch.tensor([p]), temperature=T, compute_dtype=torch.float32)[0]
        err = (got - ref).abs().max().item()
        assert err <= HF_FP32_TOLERANCE, f"{family.name}: fp32 token_logprobs vs HF fp32 forward: max |diff| {err:.3g}"


def test_gradients_match_hf_float64(family, tiny_fp32):
    m32, m64 = copy.deepcopy(tiny_fp32).train(), copy.deepcopy(tiny_fp32).double().train()
    m64.config._experts_implementation = "eager"  # HF's grouped_mm experts have no float64
    ids, mask = pad_batch(random_prompts(2, 9, 14, seed=2, vocab_hi=min(99, m32.config.vocab_size)), "right")
    lp = token_logprobs(m32, ids, mask, temperature=T, compute_dtype=torch.float32)
    (lp * mask[:, 1:]).sum().backward()
    logits = m64(input_ids=ids, attention_mask=mask).logits[:, :-1] / T
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (ref * mask[:, 1:]).sum().backward()
    want = dict(m64.named_parameters())
    checked, worst = 0, (0.0, "")
    for name, p in m32.named_parameters():
        g = want[name].grad
        if g is None or g.abs().max() == 0:  # e.g. a top-k selection HF does not differentiate
            continue
        assert p.grad is not None, f"{family.name}: {name} gets HF a gradient, not bitmatch"
        err = ((p.grad.double() - g).norm() / g.norm()).item()
        worst = max(worst, (err, name))
        checked += 1
    assert worst[0] < GRAD_TOLERANCE, f"{family.name}: relative gradient error {worst[0]:.3g} at {worst[1]}"
    assert checked >= 0.8 * sum(1 for _ in m32.parameters()), f"{family.name}: only {checked} gradients checked"


def test_trainer_batch_axis_alone_equals_padded_batches(family, tiny_fp32):
    model = copy.deepcopy(tiny_fp32).to(torch.bfloat16)
    seqs = random_prompts(3, 6, 15, seed=7, vocab_hi=min(99, model.config.vocab_size))
    with torch.no_grad():
        alone = [token_logprobs(model, torch.tensor([s]), temperature=T)[0] for s in seqs]
        for side in ("right", "left"):
            ids, mask = pad_batch(seqs, side)
            lp = token_logprobs(model, ids, mask, temperature=T)
            for i, s in enumerate(seqs):
                n = len(s) - 1
                row = lp[i, :n] if side == "right" else lp[i, lp.shape[1] - n:]
                assert bits_equal(row, alone[i]), f"{family.name}: sequence {i} alone vs {side}-padded batch"


# families whose HF forward gives a sequence the same bf16 bits alone and in padded batches on
# CPU at tiny shapes (Nemotron-H: HF's torch fallback at hidden 64): no stock batch control exists
# there; their engine-side control is test_control_hf_bf16_forward_differs_from_the_engine
STOCK_BATCH_INVARIANT_ON_CPU = {"nemotron_h"}


def test_control_hf_bf16_batch_differs_from_alone(family, tiny_fp32):
    """HF's own bf16 forward of a padded batch gives other bits than the sequences alone: the
    batch-axis comparison above can fail (counted over both padding sides)."""
    if family.name in STOCK_BATCH_INVARIANT_ON_CPU:
        pytest.skip(f"{family.name}: HF's bf16 forward is batch-invariant on CPU at tiny shapes (no stock control)")
    model = copy.deepcopy(tiny_fp32).to(torch.bfloat16)
    seqs = random_prompts(3, 6, 15, seed=7, vocab_hi=min(99, model.config.vocab_size))
    differ = 0
    with torch.no_grad():
        for side in ("right", "left"):
            ids, mask = pad_batch(seqs, side)
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            for i, s in enumerate(seqs):
                alone = model(input_ids=torch.tensor([s])).logits[0].float()
                rows = logits[i, :len(s)] if side == "right" else logits[i, ids.shape[1] - len(s):]
                differ += int((rows.view(torch.int32) != alone.view(torch.int32)).sum())
    assert differ > 0, f"{family.name}: HF's bf16 batches gave the bits alone: the control proves nothing"


@pytest.fixture(scope="module")
def engine_run(family, tiny_fp32):
    """(bf16 model, prompts, engine outputs): two prompts, chunked prefill and decode, 4 tokens each."""
    model = copy.deepcopy(tiny_fp32).to(torch.bfloat16)
    prompts = _prompts(model.config.vocab_size)
    params = [SamplingParams(temperature=T, max_tokens=4, ignore_eos=True, seed=i) for i in range(len(prompts))]
    outs = Engine(model, num_gpu_blocks=64, block_size=16, max_num_batched_tokens=7, seed=0).generate(
        prompts, params, use_tqdm=False)
    return model, prompts, outs


def test_engine_schedule_axis(family, engine_run):
    """One sequence at a time, whole prompts, blocks of 8: the same outputs bit for bit."""
    model, prompts, outs = engine_run
    params = [SamplingParams(temperature=T, max_tokens=4, ignore_eos=True, seed=i) for i in range(len(prompts))]
    other = Engine(model, num_gpu_blocks=64, block_size=8, max_num_seqs=1, enable_chunked_prefill=False,
                   seed=0).generate(prompts, params, use_tqdm=False)
    assert same_outputs(outs, other), f"{family.name}: chunked batched engine != one sequence at a time"


def _engine_lp(out) -> torch.Tensor:
    return torch.tensor(out.outputs[0].logprobs, dtype=torch.float32)


def test_engine_equals_trainer_bit_for_bit(family, engine_run):
    model, prompts, outs = engine_run
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = p + o.outputs[0].token_ids
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([seq]), temperature=T)[0, len(p) - 1:].float()
        got = _engine_lp(o)
        bad = (got.view(torch.int32) != lp.view(torch.int32)).nonzero()[:, 0].tolist()
        assert not bad, (f"{family.name} request {i}: tokens {bad} differ; engine {got[bad].tolist()} "
                         f"trainer {lp[bad].tolist()}")


def test_control_hf_bf16_forward_differs_from_the_engine(family, engine_run):
    """The same comparison against HF's own bf16 forward finds differing bits: the test can fail."""
    model, prompts, outs = engine_run
    differ = 0
    for p, o in zip(prompts, outs):
        hf = _hf_logprobs(copy.deepcopy(model), p + o.outputs[0].token_ids, torch.bfloat16)[len(p) - 1:]
        differ += int((hf.view(torch.int32) != _engine_lp(o).view(torch.int32)).sum())
    assert differ > 0, (f"{family.name}: HF's bf16 forward gave the engine's bits on every token: the control "
                        "proves nothing")
