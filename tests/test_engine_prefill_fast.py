"""Fresh-prefill steps (no cached prefix) attend over the step's own contiguous K/V with
``attention_prefill`` instead of gathering K/V through the block table per token: the same bits as
the paged path, on the CPU reference (engine end to end) and on the Triton kernel (interpreter,
random block tables and page sizes). Control: a prefill kernel with another KV block order (the
Triton kernel's with a different KV block size) does not match the paged path."""
from __future__ import annotations

import pytest
import torch

import bitmatch.kernels as K
from bitmatch.engine import Engine, SamplingParams, model_runner as mr
from bitmatch.kernels import order
from bitmatch.testing.models import random_prompts, tiny_model


def _lp_bits(outs):
    return [torch.tensor(o.outputs[0].logprobs, dtype=torch.float32).view(torch.int32) for o in outs]


def test_engine_fresh_prefill_same_bits_as_paged(monkeypatch):
    model = tiny_model()
    prompts = random_prompts(5, 10, 60, seed=21)
    params = [SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True, seed=i) for i in range(5)]
    seen = []
    orig = mr.StepInputs.__init__

    def spy(self, scheduled, bs):
        orig(self, scheduled, bs)
        seen.append(self.fresh_prefill)
    monkeypatch.setattr(mr.StepInputs, "__init__", spy)
    fast = Engine(model, num_gpu_blocks=256, max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    assert any(seen), "no step took the fresh-prefill path"

    def paged_only(self, scheduled, bs):
        orig(self, scheduled, bs)
        self.fresh_prefill = False
    monkeypatch.setattr(mr.StepInputs, "__init__", paged_only)
    slow = Engine(model, num_gpu_blocks=256, max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    for a, b in zip(_lp_bits(fast), _lp_bits(slow)):
        assert torch.equal(a, b)


def _paged_copy(k, v, lens, page, nblocks, seed):
    """k/v [T, H, D] of packed sequences written into a paged cache under a random block table."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.zeros(nblocks, page, *k.shape[1:], dtype=k.dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(nblocks, generator=g)
    width = max(-(-n // page) for n in lens)
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    s, used = 0, 0
    for b, n in enumerate(lens):
        nb = -(-n // page)
        bt[b, :nb] = perm[used:used + nb].int()
        used += nb
        pos = torch.arange(n)
        slots = bt[b, pos // page].long() * page + pos % page
        kc.view(-1, *k.shape[1:])[slots] = k[s:s + n]
        vc.view(-1, *k.shape[1:])[slots] = v[s:s + n]
        s += n
    return kc, vc, bt


@pytest.mark.interpreter
@pytest.mark.parametrize("page", [16, 64])
def test_triton_prefill_equals_paged(page):
    from bitmatch.kernels.triton import attention as TA
    torch.manual_seed(0)
    lens = [70, 5, 130]
    T, Hq, Hkv, D = sum(lens), 4, 2, 16
    q, k, v = (torch.randn(T, h, D) for h in (Hq, Hkv, Hkv))
    cu = torch.tensor([0, 70, 75, 205], dtype=torch.int32)
    kc, vc, bt = _paged_copy(k, v, lens, page, 32, seed=page)
    with K.use_backend("triton"):
        pre = K.attention_prefill(q, k, v, cu, 0.25, max_seqlen=130)
        paged = K.attention_paged(q, kc, vc, bt, cu, torch.tensor(lens, dtype=torch.int32), 0.25,
                                  max_query_len=130, max_seq_len=130)
    assert torch.equal(pre.view(torch.int32), paged.view(torch.int32))
    # control: the prefill kernel walking KV in 32-position blocks (another canonical order)
    with order.override(kv_block=32):
        other = TA.attention_prefill(q, k, v, cu, 0.25, max_seqlen=130)
    assert not torch.equal(other.view(torch.int32), paged.view(torch.int32))
