"""Top-k / top-p, bit for bit: one mask (kernels.top_k_top_p_mask) on both sides.

The engine's ``sampled_logprobs`` (the distribution a token was drawn from) equal
``bitmatch.token_logprobs(model, ids, mask, T, top_k=, top_p=)`` at several k, p and T; the
control (the unmasked trainer logprob) differs. The mask follows its documented rules, is
row-invariant, and gradients flow through the kept logits as in float64. The trainer's input
errors name the argument and the fix.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch.engine import Engine, SamplingParams
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model


def bits(t):
    return t.float().contiguous().view(torch.int32)


def kept(z, **kw):
    return K.top_k_top_p_mask(torch.tensor([z], dtype=torch.float32), **kw)[0].nonzero().flatten().tolist()


def test_mask_rules_ties_at_least_one_and_off_values():
    assert kept([1.0, 3.0, 3.0, 3.0, 0.0], top_k=2) == [1, 2, 3]           # ties with the k-th all kept
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.5) == [0, 1]                 # equal mass: lower index first
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.5000001) == [0, 1, 2]        # mass must reach p
    assert kept([5.0, 0.0, 0.0], top_p=0.01) == [0]                        # at least one
    assert kept([0.5, 2.0, 1.0], top_k=3) == kept([0.5, 2.0, 1.0], top_k=-1) == [0, 1, 2]  # k >= V, -1: off
    assert kept([0.5, 2.0, 1.0], top_p=1.0) == [0, 1, 2]
    # top-p runs on the top-k renormalized distribution: 2 of the 3 kept by k = 3 reach p = 0.7
    z = [3.0, 2.9, 2.8, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0]
    assert kept(z, top_k=3, top_p=0.6) == [0, 1]
    # temperature reshapes the distribution before the mask
    assert kept([1.0, 0.0, -1.0], top_p=0.8) == [0, 1]
    assert kept([1.0, 0.0, -1.0], temperature=0.3, top_p=0.8) == [0]


def _float64_rule(z, k, p):
    """The documented rule in plain float64 (no integer weights): for rows far from a boundary."""
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))
    vals = torch.tensor([z[i] for i in order], dtype=torch.float64)
    keep = torch.ones(len(z), dtype=torch.bool)
    if 0 < k < len(z):
        keep &= vals >= vals[k - 1]
    margin = float("inf")
    if p < 1:
        e = torch.where(keep, torch.exp(vals - vals[0]), torch.zeros_like(vals))
        before = (torch.cumsum(e, 0) - e) / e.sum()
        keep &= (before < p) | (torch.arange(len(z)) == 0)
        margin = float((before[keep.nonzero().flatten()].max() - p).abs().min()) if keep.any() else margin
        margin = min(margin, float((before - p).abs().min()))
    out = torch.zeros(len(z), dtype=torch.bool)
    out[torch.tensor(order)] = keep
    return out, margin


def test_mask_equals_the_float64_rule_on_random_rows():
    g = torch.Generator().manual_seed(1)
    compared = 0
    for trial in range(60):
        z = (torch.randn(300, generator=g) * (0.5 + trial / 20)).tolist()
        k = [0, 1, 7, 50, 299, 300][trial % 6]
        p = [1.0, 0.9, 0.5, 0.99, 0.2][trial % 5]
        ref, margin = _float64_rule(z, k, p)
        if margin < 1e-9:  # a boundary closer than the rounding: the rule's order decides
            continue
        got = K.top_k_top_p_mask(torch.tensor([z]), 1.0, k, p)[0]
        assert torch.equal(got, ref), (trial, k, p)
        compared += 1
    assert compared >= 50


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mask_row_invariant_alone_vs_any_batch(dtype):
    g = torch.Generator().manual_seed(2)
    n, vocab = 24, 500
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    logits[::3] = torch.round(logits[::3].float() * 2).to(dtype) / 2  # many exact ties
    temps = torch.rand(n, generator=g) + 0.4
    ks = torch.tensor([[-1, 0, 1, 5, 40, 499, 500, 1000][i % 8] for i in range(n)])
    ps = torch.tensor([[1.0, 0.95, 0.6, 0.3, 0.9, 0.05][i % 6] for i in range(n)])
    batch = K.top_k_top_p_mask(logits, temps, ks, ps)
    masked = K.apply_top_k_top_p(logits, temps, ks, ps)
    for i in range(n):
        alone = K.top_k_top_p_mask(logits[i:i + 1], float(temps[i]), int(ks[i]), float(ps[i]))
        assert torch.equal(alone, batch[i:i + 1]), i
    for size in (2, 7, 17):
        perm = torch.randperm(n, generator=g)[:size]
        assert torch.equal(K.top_k_top_p_mask(logits[perm], temps[perm], ks[perm], ps[perm]), batch[perm])
        assert torch.equal(K.apply_top_k_top_p(logits[perm], temps[perm], ks[perm], ps[perm]).view(-1).view(
            torch.int16 if dtype == torch.bfloat16 else torch.int32), masked[perm].view(-1).view(
            torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert batch.sum(1).min() >= 1 and (batch.sum(1) < vocab).sum() >= n // 2


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-hd128-gqa8-llama3rope", seed=5, num_hidden_layers=1)


GRID = [(0.6, 5, 1.0), (1.0, -1, 0.8), (1.3, 20, 0.9), (1.0, 3, 0.5), (0.8, 40, 0.95)]


def test_engine_sampled_logprobs_equal_trainer_top_k_top_p(model):
    prompts = random_prompts(2 * len(GRID), 2, 30, seed=8)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=5, ignore_eos=True, seed=i)
              for i, (t, k, p) in enumerate(GRID * 2)]
    outs = Engine(model, num_gpu_blocks=128, max_num_seqs=6, max_num_batched_tokens=40).generate(
        prompts, params, use_tqdm=False)
    total = control_diff = 0
    for gi, (t, k, p) in enumerate(GRID):
        group = [outs[gi], outs[gi + len(GRID)]]
        seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in group]
        ids, mask = pad_batch(seqs, "left")
        with torch.no_grad():
            masked = bitmatch.token_logprobs(model, ids, mask, temperature=t, top_k=k, top_p=p)
            full = bitmatch.token_logprobs(model, ids, mask, temperature=t)
        for b, o in enumerate(group):
            c = o.outputs[0]
            a = ids.shape[1] - len(seqs[b]) + len(o.prompt_token_ids) - 1
            sl = slice(a, a + len(c.token_ids))
            got_s = torch.tensor(c.sampled_logprobs, dtype=torch.float32)
            assert torch.isfinite(got_s).all(), "a token was drawn from outside its mask"
            assert torch.equal(bits(got_s), bits(masked[b, sl])), (t, k, p, got_s, masked[b, sl])
            assert torch.equal(bits(torch.tensor(c.logprobs)), bits(full[b, sl])), (t, k, p)
            control_diff += int((bits(got_s) != bits(full[b, sl])).sum())
            total += len(c.token_ids)
    assert total == 2 * len(GRID) * 5
    # the control: the full-vocabulary trainer logprob is not the sampled distribution's
    assert control_diff > total // 2, (control_diff, total)


def test_gradients_through_kept_logits_vs_float64():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 64, generator=g) * 2).requires_grad_(True)
    temps = torch.tensor([0.7, 1.0, 1.3, 0.9, 1.0, 0.5])
    ks, ps = torch.tensor([5, -1, 20, 3, 64, 10]), torch.tensor([1.0, 0.8, 0.9, 0.7, 0.95, 1.0])
    keep = K.top_k_top_p_mask(logits.detach(), temps, ks, ps)
    tokens = torch.stack([row.nonzero()[-1, 0] for row in keep])  # the lowest-ranked kept token
    w = torch.randn(6, generator=g)
    (K.token_logprobs(K.apply_top_k_top_p(logits, temps, ks, ps), tokens, temps) * w).sum().backward()
    x64 = logits.detach().double().requires_grad_(True)
    z = (x64 / temps.double()[:, None]).masked_fill(~keep, float("-inf"))
    (torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0] * w.double()).sum().backward()
    assert torch.equal(logits.grad[~keep], torch.zeros_like(logits.grad[~keep]))
    assert torch.allclose(logits.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)


def test_model_gradients_with_top_k_top_p_match_float64():
    m = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=4, num_hidden_layers=1)
    m64 = copy.deepcopy(m).to(torch.float64)
    T, k, p = 0.9, 12, 0.85
    outs = Engine(m, num_gpu_blocks=64).generate(random_prompts(3, 4, 10, seed=6), SamplingParams(
        temperature=T, top_k=k, top_p=p, max_tokens=4, ignore_eos=True, seed=1), use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    ids, mask = pad_batch(seqs, "right")
    lp = bitmatch.token_logprobs(m, ids, mask, temperature=T, top_k=k, top_p=p)
    comp = torch.zeros_like(lp, dtype=torch.bool)
    for b, o in enumerate(outs):
        a = len(o.prompt_token_ids) - 1
        comp[b, a:a + 4] = True
    lp[comp].sum().backward()
    # float64 reference: the stock HF forward, bitmatch's mask (from its own logits) applied
    from bitmatch.models import compute_logits, forward_hidden, pack
    pk = pack(ids, mask)
    with torch.no_grad():
        keep = K.top_k_top_p_mask(compute_logits(m, forward_hidden(m, pk.input_ids, pk.context())), T, k, p)
    z64 = (m64(ids, attention_mask=mask).logits[pk.rows, pk.cols] / T).masked_fill(~keep, float("-inf"))
    src = (~pk.seq_end & comp[pk.rows, pk.cols.clamp(max=comp.shape[1] - 1)]).nonzero().flatten()
    torch.log_softmax(z64[src], -1).gather(1, pk.input_ids[src + 1, None]).sum().backward()
    for (n, p32), (_, p64) in zip(m.named_parameters(), m64.named_parameters()):
        assert p32.grad is not None, n
        err = (p32.grad.double() - p64.grad).norm() / p64.grad.norm().clamp(min=1e-30)
        assert err < 1e-3, (n, float(err))


@pytest.mark.parametrize("kwargs, text", [
    (dict(input_ids=torch.tensor([3, 4, 5])), "input_ids must be 2-D [batch, seq_len], got shape (3,) "
                                              "(one sequence: pass input_ids.unsqueeze(0)"),
    (dict(input_ids=torch.tensor([[3.0, 4.0]])), "input_ids must hold integer token ids (torch.long), got dtype "
                                                 "torch.float32; pass input_ids.long()"),
    (dict(input_ids=torch.tensor([[3, 4, 999]])), "input_ids must be token ids in [0, vocab_size=128) wherever "
                                                  "attention_mask is 1, got min 3 max 999"),
    (dict(input_ids=torch.tensor([[3, -100]])), "got min -100 max 3; mask out padding / label sentinels"),
    (dict(temperature=0.0), "temperature=0 is greedy decoding, which has no distribution to score: greedy rows "
                            "are scored at T = 1 (as vLLM and bitmatch.Engine report them); pass temperature=1.0"),
    (dict(temperature=-1.0), "temperature must be > 0, got -1.0"),
    (dict(input_ids=torch.ones(1, 300, dtype=torch.long)), "a sequence has 300 tokens, more than the model's "
                                                           "max_position_embeddings=256; truncate input_ids"),
    (dict(top_k=2.5), "top_k must be an int >= 1 (or None / -1 / 0 for no top-k), got 2.5"),
    (dict(top_p=0.0), "top_p must be a float in (0, 1] (or None / 1.0 for no top-p), got 0.0"),
])
def test_token_logprobs_input_errors_name_argument_and_fix(kwargs, text):
    m = tiny_model("qwen3-hd64-gqa4-tied", seed=1, num_hidden_layers=1, max_position_embeddings=256)
    args = {"input_ids": torch.tensor([[3, 4, 5]]), **kwargs}
    with pytest.raises(ValueError) as e:
        bitmatch.token_logprobs(m, **args)
    assert text in str(e.value), str(e.value)
    assert str(e.value).startswith("token_logprobs: ")


def test_masked_padding_sentinels_and_long_padding_are_accepted():
    m = tiny_model("qwen3-hd64-gqa4-tied", seed=1, num_hidden_layers=1, max_position_embeddings=8)
    ids = torch.tensor([[-100] * 6 + [3, 4, 5, 6]])  # 10 columns, 4 real tokens: fits 8 positions
    mask = (ids >= 0).long()
    lp = bitmatch.token_logprobs(m, ids, mask, temperature=1.0, top_p=0.9)
    assert lp.shape == (1, 9) and torch.isfinite(lp[0, 6:]).any()
    lp, ent = bitmatch.token_logprobs(m, ids.clamp(min=0), mask, temperature=1.0, top_k=4, return_entropy=True)
    assert torch.isfinite(ent).all()


def test_grid_covers_top_k_only_top_p_only_and_both():
    kinds = {(k > 0, p < 1) for _, k, p in GRID}
    assert kinds == set(itertools.product([True, False], [True, False])) - {(False, False)}


@pytest.mark.parametrize("trainer_masks", [True, False], ids=["masked", "control-unmasked-trainer"])
def test_trl_adapter_passes_top_k_top_p_to_both_sides(tmp_path, monkeypatch, trainer_masks):
    pytest.importorskip("trl")
    import bitmatch.adapters.trl as bt
    from test_trl import make_trainer

    if not trainer_masks:  # the control: the trainer side ignores top_k / top_p
        orig = bitmatch.token_logprobs
        monkeypatch.setattr(bitmatch, "token_logprobs",
                            lambda *a, top_k=None, top_p=None, **kw: orig(*a, **kw))
    trainer = bt.attach(make_trainer(tmp_path, steps=1, top_k=8, top_p=0.9,
                                         max_completion_length=4), on_mismatch="log")
    trainer.train()
    hist = trainer._bitmatch.history
    assert len(hist) == 1 and all(h.total > 0 for h in hist)
    if trainer_masks:
        assert all(h.mismatches == 0 and h.diff_max == 0.0 for h in hist), hist
    else:
        assert sum(h.mismatches for h in hist) > sum(h.total for h in hist) // 2, hist
