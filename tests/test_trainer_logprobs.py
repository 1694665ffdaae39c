"""bitmatch.token_logprobs and the patched forward: bitwise invariance, correctness, gradients."""
import copy

import pytest
import torch

import bitmatch.kernels as K
from bitmatch.logprobs import token_logprobs
from bitmatch.patching import patch, unpatch
from bitmatch.precision import compute_cast
from bitmatch.testing import bits_equal
from bitmatch.testing.models import TINY_CONFIGS, pad_batch, random_prompts, tiny_model

SEQS = random_prompts(6, 1, 24, seed=7)  # lengths 1..24 (sliding windows are 8)


def _per_seq(lp, mask, seqs, side):
    """Row r of a [B, L-1] logprob tensor -> the len(seq)-1 logprobs of that sequence."""
    out = []
    L = mask.shape[1]
    for r, s in enumerate(seqs):
        n = len(s)
        a = 0 if side == "right" else L - n
        out.append(lp[r, a:a + n - 1])
    return out


def _alone(model, seqs, T=1.0, **kw):
    res = []
    for s in seqs:
        ids = torch.tensor([s])
        res.append(token_logprobs(model, ids, None, temperature=T, **kw)[0])
    return res


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0)


@torch.no_grad()
def test_batch_padding_invariance_bitwise(bf16_model):
    ref = _alone(bf16_model, SEQS, T=0.7)
    for side in ("left", "right"):
        for subset, extra in ((SEQS, 0), (SEQS[::-1][:3], 5), (SEQS[2:], 1)):
            ids, mask = pad_batch(subset, side, length=max(len(s) for s in subset) + extra)
            lp = token_logprobs(bf16_model, ids, mask, temperature=0.7)
            assert lp.dtype == torch.float32 and lp.shape == (len(subset), ids.shape[1] - 1)
            got = _per_seq(lp, mask, subset, side)
            for s, g in zip(subset, got):
                assert bits_equal(g, ref[SEQS.index(s)]), (side, len(subset), len(s))
            # padding positions and first tokens are 0
            valid = (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
            assert (lp[~valid] == 0).all()


@torch.no_grad()
def test_patched_forward_logits_match_token_logprobs(bf16_model):
    m = copy.deepcopy(bf16_model)
    patch(m)
    try:
        for side in ("left", "right"):
            ids, mask = pad_batch(SEQS, side)
            logits = m(input_ids=ids, attention_mask=mask).logits
            assert logits.shape == (*ids.shape, m.config.vocab_size)
            valid = (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
            rows, cols = valid.nonzero(as_tuple=True)
            lp_hf = K.token_logprobs(logits[rows, cols], ids[rows, cols + 1], 0.7)
            lp = token_logprobs(m, ids, mask, temperature=0.7)
            assert bits_equal(lp_hf, lp[rows, cols])
            assert (logits[mask == 0] == 0).all()
    finally:
        unpatch(m)


@torch.no_grad()
def test_chunk_rows_do_not_change_bits(bf16_model):
    ids, mask = pad_batch(SEQS, "left")
    base = token_logprobs(bf16_model, ids, mask, temperature=1.3)
    for rows in (1, 5, 16, 1000):
        assert bits_equal(token_logprobs(bf16_model, ids, mask, temperature=1.3, chunk_rows=rows), base)


def test_kept_or_recomputed_logits_same_bits_and_gradients(bf16_model, monkeypatch):
    """Keeping the logits for backward (small batches) or recomputing them per chunk (checkpointed)
    changes the work, not the bits: logprobs and every parameter gradient equal bit for bit."""
    import bitmatch.logprobs as lpmod
    ids, mask = pad_batch(SEQS, "right")
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(2))
    heads = []
    real = lpmod.compute_logits
    monkeypatch.setattr(lpmod, "compute_logits", lambda *a, **k: heads.append(1) or real(*a, **k))
    # chunks of 16 rows (under autograd the chunks are the default ones, whatever chunk_rows says)
    monkeypatch.setattr(lpmod, "DEFAULT_LOGIT_ELEMENTS", 16 * bf16_model.lm_head.weight.shape[0])

    def run(**kw):
        m = copy.deepcopy(bf16_model)
        heads.clear()
        lp = token_logprobs(m, ids, mask, temperature=0.8, **kw)
        (lp * w).sum().backward()
        return lp, [p.grad.clone() for p in m.parameters()], len(heads)
    lp_keep, g_keep, n_keep = run(recompute_logits=False)
    lp_re, g_re, n_re = run(recompute_logits=True)
    n_chunks = -(-int(((mask[:, 1:] != 0) & (mask[:, :-1] != 0)).sum()) // 16)
    assert (n_keep, n_re) == (n_chunks, 2 * n_chunks)  # the recompute ran the head again per chunk
    assert bits_equal(lp_keep, lp_re)
    assert all(bits_equal(a, b) for a, b in zip(g_keep, g_re))
    # by size: the default keeps these few logits; a zero budget recomputes
    assert run()[2] == n_chunks
    monkeypatch.setattr(lpmod, "KEEP_LOGITS_BYTES", 0)
    assert run()[2] == 2 * n_chunks
    with pytest.raises(ValueError, match="recompute_logits"):
        token_logprobs(bf16_model, ids, mask, recompute_logits="yes")


@torch.no_grad()
def test_fp32_master_bf16_compute_equals_bf16_copy():
    m32 = tiny_model("qwen2-hd64-gqa1-bias-sw", dtype=torch.float32, seed=3)
    m16 = copy.deepcopy(m32)
    for p in m16.parameters():
        p.data = compute_cast(p.data, torch.bfloat16)
    ids, mask = pad_batch(SEQS, "right")
    a = token_logprobs(m32, ids, mask, temperature=0.9, compute_dtype=torch.bfloat16)
    b = token_logprobs(m16, ids, mask, temperature=0.9)
    assert bits_equal(a, b)
    patch(m32, compute_dtype=torch.bfloat16)
    try:
        c = token_logprobs(m32, ids, mask, temperature=0.9)
        assert bits_equal(c, b)
        assert m32(ids, attention_mask=mask).logits.dtype == torch.bfloat16
    finally:
        unpatch(m32)
    # and without the compute dtype the fp32 model computes in fp32 (different bits)
    assert not bits_equal(token_logprobs(m32, ids, mask, temperature=0.9), b)


def _hf_logprobs(model, ids, mask, T=1.0):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    lp = torch.log_softmax(logits[:, :-1].to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / T, -1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_families_correct_and_invariant(name):
    """Every family config: fp32 logprobs agree with stock HF (tolerance 2e-4), and bf16
    logprobs of a sequence alone equal its logprobs inside a padded batch, bitwise."""
    m32 = tiny_model(name, dtype=torch.float32, seed=1)
    seqs = random_prompts(4, 10, 40, seed=11)  # longer than the sliding windows (8)
    ids, mask = pad_batch(seqs, "left")
    with torch.no_grad():
        ours = token_logprobs(m32, ids, mask)
        ref = _hf_logprobs(m32, ids, mask)
    valid = (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    assert (ours[valid] - ref[valid]).abs().max() < 2e-4
    m16 = m32.to(torch.bfloat16)
    with torch.no_grad():
        alone = _alone(m16, seqs)
        ids, mask = pad_batch(seqs + seqs[:1], "right")
        got = _per_seq(token_logprobs(m16, ids, mask), mask, seqs + seqs[:1], "right")
    for a, g in zip(alone + alone[:1], got):
        assert bits_equal(a, g)


@torch.no_grad()
def test_control_stock_hf_differs_under_batch_change():
    """The same check on the stock HF forward (sdpa, bf16) fails: the test can fail."""
    m = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0, attn_implementation="sdpa")
    seqs = random_prompts(12, 20, 40, seed=5)
    ids, mask = pad_batch(seqs, "right")
    batched = _hf_logprobs(m, ids, mask)
    n_diff = 0
    ours_alone = _alone(m, seqs)
    ours_b = _per_seq(token_logprobs(m, ids, mask), mask, seqs, "right")
    for r, s in enumerate(seqs):
        alone = _hf_logprobs(m, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
        n_diff += int((alone != batched[r, :len(s) - 1]).sum())
        assert bits_equal(ours_alone[r], ours_b[r])
    assert n_diff > 0


@torch.no_grad()
def test_greedy_matches_stock_hf_greedy_fp32():
    m = tiny_model("llama-hd128-gqa8-llama3rope", dtype=torch.float32, seed=2)
    prompt = random_prompts(1, 6, 6, seed=9)[0]
    horizon = 8
    hf = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=horizon, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    patch(m)
    try:
        seq = list(prompt)
        for _ in range(horizon):
            logits = m(torch.tensor([seq])).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    finally:
        unpatch(m)
    assert seq[len(prompt):] == hf


def _grads(model, ids, mask, w, use_bitmatch):
    model.zero_grad(set_to_none=True)
    if use_bitmatch:
        lp = token_logprobs(model, ids, mask, temperature=0.8)
    else:
        lp = _hf_logprobs(model, ids, mask, T=0.8)
    valid = ((mask[:, 1:] != 0) & (mask[:, :-1] != 0)).to(lp.dtype)
    (lp * w.to(lp.dtype) * valid).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradients_flow_and_match_float64_hf():
    """Gradients of sum(w * logprob) through bitmatch kernels (fp32) vs stock HF in float64:
    every parameter gets a gradient, relative error ||g - g64|| / ||g64|| < 1e-3 per tensor."""
    m = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=4)
    m64 = copy.deepcopy(m).to(torch.float64)
    seqs = random_prompts(3, 5, 16, seed=2)
    # right padding: stock HF's left-padded query rows are fully masked and give NaN gradients
    ids, mask = pad_batch(seqs, "right")
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(0))
    g = _grads(m, ids, mask, w, True)
    g64 = _grads(m64, ids, mask, w, False)
    names = [n for n, _ in m.named_parameters()]
    assert set(g) == set(names), set(names) - set(g)
    for n in names:
        ref = g64[n]
        err = (g[n].double() - ref).norm() / ref.norm().clamp(min=1e-30)
        assert err < 1e-3, (n, float(err))


def test_gradient_checkpointing_same_grads():
    m = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=4)
    seqs = random_prompts(3, 5, 16, seed=2)
    ids, mask = pad_batch(seqs, "right")
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(0))
    m.train()
    ref = _grads(m, ids, mask, w, True)
    m.gradient_checkpointing_enable()
    calls = []
    orig = m.model.layers[0]._gradient_checkpointing_func
    m.model.layers[0]._gradient_checkpointing_func = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    for patched in (False, True):
        if patched:
            patch(m)
        got = _grads(m, ids, mask, w, True)
        for n in ref:
            assert torch.equal(got[n], ref[n]), (patched, n)
    unpatch(m)
    assert len(calls) == 2  # the checkpoint path was taken, unpatched and patched


def test_pad_token_row_gets_hf_gradient():
    """A pad id used as a real token (TRL's pad == eos at the end of a completion): nn.Embedding's
    padding_idx sends no gradient into that row through the embedding, and neither does bitmatch;
    with the tied LM head the row still gets the head's gradient, as in HF (float64)."""
    m = tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=4)
    pad = m.model.embed_tokens.padding_idx
    assert pad is not None
    m64 = copy.deepcopy(m).to(torch.float64)
    seqs = [s[:4] + [pad] + s[4:] for s in random_prompts(3, 8, 14, seed=5)]
    ids, mask = pad_batch(seqs, "right")
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(1))
    name = "model.embed_tokens.weight"
    row = _grads(m, ids, mask, w, True)[name][pad].double()
    ref = _grads(m64, ids, mask, w, False)[name][pad]
    assert (row - ref).norm() / ref.norm() < 1e-4
    # control: without padding_idx the embedding path adds its gradient to the row
    m.model.embed_tokens.padding_idx = None
    bad = _grads(m, ids, mask, w, True)[name][pad].double()
    assert (bad - ref).norm() / ref.norm() > 1e-2
