"""The batched sampler: noise a pure function of (seed, token index), one host sync per step, no
per-row ops, and a request's tokens and logprobs the same alone, in any batch, in any row
position and after preemption (greedy, temperature, top-k and top-p rows mixed)."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import bitmatch.kernels as K
from bitmatch.engine import Engine, SamplingParams
from bitmatch.engine.sampling import Sampler
from bitmatch.kernels.sampling import to_int64_seed
from bitmatch.testing.models import random_prompts, tiny_model

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:  # SplitMix64's finalizer on Python ints (unsigned 64-bit)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _uniform_ref(seed: int, index: int) -> float:
    key = _mix((seed + _GAMMA) & _M64)
    return (_mix((key + (index + 1) * _GAMMA) & _M64) >> 11) * 2.0 ** -53


def _noise(seeds, idx):
    return K.uniform_noise(torch.tensor([to_int64_seed(s) for s in seeds], dtype=torch.int64),
                           torch.tensor(idx, dtype=torch.int64))


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3-hd64-gqa4-tied", seed=3, num_hidden_layers=1)


def test_uniform_noise_is_splitmix64_in_int64_ops():
    # known answer: the first SplitMix64 output for seed 0 (the published test vector)
    assert _mix(_GAMMA) == 0xE220A8397B1DCDAF
    seeds = [0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, -5, 123456789123456789, 7]
    idx = [0, 1, 5, 1000, 2 ** 40, 3, 0, 2 ** 31 + 17]
    got = _noise(seeds, idx).tolist()
    assert got == [_uniform_ref(s & _M64, i) for s, i in zip(seeds, idx)]
    assert all(0.0 <= u < 1.0 for u in got)
    # a plain sanity check of the stream: 20,000 draws have mean 1/2 and variance 1/12
    u = _noise([11] * 20000, list(range(20000)))
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_uniform_noise_depends_only_on_seed_and_index():
    seeds, idx = [3, 9, 3, 2 ** 62], [4, 4, 5, 0]
    batch = _noise(seeds, idx)
    for i in range(4):
        assert torch.equal(_noise([seeds[i]], [idx[i]]), batch[i:i + 1])
    perm = [2, 0, 3, 1]
    assert torch.equal(_noise([seeds[i] for i in perm], [idx[i] for i in perm]), batch[perm])
    assert len(set(batch.tolist())) == 4


def test_categorical_sample_row_invariant_and_follows_softmax():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 50, generator=g) * 2).to(torch.bfloat16)
    logits[4, 10:] = float("-inf")  # a masked row: only tokens 0..9 may be drawn
    temps = torch.tensor([0.5, 1.0, 1.3, 0.7, 1.0, 2.0, 0.9, 1.0, 0.6])
    u = _noise(range(9), [3] * 9)
    batch = K.categorical_sample(logits, temps, u)
    for i in range(9):
        assert torch.equal(K.categorical_sample(logits[i:i + 1], temps[i:i + 1], u[i:i + 1]), batch[i:i + 1])
    perm = torch.randperm(9, generator=g)
    assert torch.equal(K.categorical_sample(logits[perm], temps[perm], u[perm]), batch[perm])
    # frequencies over many token indices follow softmax(logits / T); -inf is never drawn
    n = 40000
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), -3.0, 1.5]])
    toks = K.categorical_sample(row.expand(n, 8), 0.8, _noise([5] * n, list(range(n))))
    freq = torch.bincount(toks, minlength=8).double() / n
    p = torch.softmax(row[0].double() / 0.8, -1)
    assert freq[5] == 0
    assert bool(((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-12).all()), (freq, p)


class _CountOps(TorchFunctionMode):
    SYNCS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.ops += 1
        if name in self.SYNCS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_sampler_is_batched_one_host_sync_and_no_per_row_ops():
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.8),
             SamplingParams(temperature=1.1)]
    counts = []
    for reps in (1, 5):
        params = kinds * reps
        logits = torch.randn(len(params), 64).to(torch.bfloat16)
        with _CountOps() as c:
            toks, lps, slps = Sampler()(logits, params, list(range(len(params))), [2] * len(params))
        assert c.syncs == ["tolist"], c.syncs
        assert len(toks) == len(lps) == len(slps) == len(params)
        counts.append(c.ops)
    assert counts[0] == counts[1], f"torch ops per step grow with the batch: {counts}"


def _run(model, prompts, params, **kw):
    eng = Engine(model, **{"num_gpu_blocks": 256, "block_size": 8, **kw})
    return eng, eng.generate(prompts, params, use_tqdm=False)


def _result(o):
    c = o.outputs[0]
    return (c.token_ids, torch.tensor(c.logprobs, dtype=torch.float32).view(torch.int32).tolist(),
            torch.tensor(c.sampled_logprobs, dtype=torch.float32).view(torch.int32).tolist())


def test_request_same_alone_in_batch_any_position_and_after_preemption(model):
    kinds = [dict(temperature=0.8), dict(temperature=1.0, top_k=5), dict(temperature=0.7, top_p=0.8),
             dict(temperature=1.2, top_k=12, top_p=0.9), dict(temperature=0.0)]
    targets = random_prompts(len(kinds), 3, 14, seed=21)
    tparams = [SamplingParams(max_tokens=6, ignore_eos=True, seed=100 + i, **k) for i, k in enumerate(kinds)]
    alone = [_result(_run(model, [p], [sp], max_num_seqs=1)[1][0]) for p, sp in zip(targets, tparams)]
    others = random_prompts(6, 1, 20, seed=22)
    oparams = [SamplingParams(temperature=0.9, top_p=0.95 if i % 2 else 1.0, max_tokens=5, ignore_eos=True, seed=i)
               for i in range(6)]
    # targets interleaved with other requests, then in reversed order with other neighbours
    mixed = [x for pair in zip(targets, others) for x in pair] + others[len(targets):]
    mparams = [x for pair in zip(tparams, oparams) for x in pair] + oparams[len(targets):]
    _, outs = _run(model, mixed, mparams, max_num_seqs=8, max_num_batched_tokens=24)
    assert [_result(outs[2 * i]) for i in range(len(targets))] == alone
    rev = targets[::-1] + others[::-1]
    _, outs = _run(model, rev, tparams[::-1] + oparams[::-1], max_num_seqs=11)
    assert [_result(o) for o in outs[:len(targets)]][::-1] == alone
    # a cache too small for the batch: the requests admitted last (the targets) are preempted
    # and recomputed mid-completion
    eng, outs = _run(model, others[:3] + targets, oparams[:3] + tparams, num_gpu_blocks=5,
                     max_num_batched_tokens=16)
    assert sum(o.num_preemptions for o in outs[3:]) > 0
    assert [_result(o) for o in outs[3:]] == alone


def test_noise_depends_only_on_seed_and_token_index(model):
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=77)
    _, outs = _run(model, [prompt, prompt, prompt], [sp, SamplingParams(temperature=1.0, max_tokens=8,
                                                                         ignore_eos=True, seed=78), sp])
    assert _result(outs[0]) == _result(outs[2])        # same seed, same logits: same tokens
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # another seed: other noise
    # the engine's tokens are the kernel ops applied to (seed, completion index), row by row, on
    # the trainer's logits of the same prefixes
    from bitmatch.models import compute_logits, forward_hidden, pack
    from bitmatch.testing.models import pad_batch

    seq_tokens = outs[0].outputs[0].token_ids
    ids = prompt + seq_tokens
    p = pack(*pad_batch([ids]))
    with torch.no_grad():
        logits = compute_logits(model, forward_hidden(model, p.input_ids, p.context()))
    rows = logits[len(prompt) - 1: len(ids) - 1]
    u = _noise([77] * len(seq_tokens), list(range(len(seq_tokens))))
    assert K.categorical_sample(rows, 1.0, u).tolist() == seq_tokens
