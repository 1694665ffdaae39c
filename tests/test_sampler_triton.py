"""The fused Triton sampler (kernels/triton/sampling.py) under TRITON_INTERPRET=1, and the engine
Sampler's split into pack / device_step / finish.

The interpreter runs the kernel's float64 ops in numpy (IEEE, no FMA), so these tests check
the formula and the structure: every int64 weight and every token equals the torch reference's
for many rows, temperatures, -inf masks, ties, u at 0 and just below 1, and u placed on both
sides of a cdf boundary (where one weight unit moves the token); chunk counts and block sizes
(speed knobs) change nothing; two wrong kernels (z = x * (1/T), exp64 with two Horner terms fewer)
fail the same checks. The GPU's bits (FMA contraction off, checked against torch on CUDA and the
CPU) are benchmarks/ops/sampler.py's: benchmarks/results/sampler_h200.json.
"""
import numpy as np
import pytest
import torch

import bitmatch.kernels as K
from bitmatch.engine.host import upload
from bitmatch.engine.sampling import Sampler, SamplingParams, reported_logprobs
from bitmatch.kernels import _exact, sampling as S
from bitmatch.kernels._backend import use_backend

interpret = pytest.mark.interpreter
F64 = torch.float64


def _ts():
    pytest.importorskip("triton")
    from bitmatch.kernels.triton import sampling as TS
    return TS


def _rows(n, vocab, seed):
    """bf16 logits with per-row scale 0.5-6, -inf masks, a row with one finite entry, ties at
    the max, a peaky row; temperatures from 0.05 to 2.5."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * (0.5 + 5.5 * torch.rand(n, 1, generator=g))
    x[1, 7:] = float("-inf")                       # only 7 tokens may be drawn
    x[2, :] = float("-inf")
    x[2, vocab // 2] = 0.0                          # a single finite token
    x[3, 10:14] = x[3].max() + 2.0                  # ties at the max
    x[4, 100] += 40.0                               # peaky
    x[5] = torch.where(torch.rand(vocab, generator=g) < 0.5, float("-inf"), x[5])
    temps = torch.tensor([0.05, 0.3, 0.7, 1.0, 1.3, 2.5] * (n // 6 + 1))[:n]
    u = torch.rand(n, generator=g, dtype=F64)
    u[0], u[6] = 0.0, 1.0 - 2.0 ** -53
    u[7] = 2.0 ** -53
    return x.to(torch.bfloat16), temps, u


def _boundary_uniforms(x, temps, bits, rows=12):
    """For each row, u just below and just above the cdf boundary after its top token and after
    a random token (r = c - 1 and r = c): the token moves if any earlier weight is off by one."""
    x, temps = x[:rows], temps[:rows]
    z = S.scaled_logits(x, temps)
    w = S._int_weights(z, z.amax(-1, keepdim=True), bits)
    cdf, total = torch.cumsum(w, -1), w.sum(-1, keepdim=True).to(F64)
    js = torch.stack([w.argmax(-1), torch.randint(0, x.shape[1] - 1, (x.shape[0],))], 1)
    c = cdf.gather(1, js).to(F64)
    u = torch.cat([(c - 0.5) / total, (c + 0.5) / total], 1).reshape(-1)
    rows = torch.arange(x.shape[0]).repeat_interleave(4)
    return x[rows], temps[rows], u


@interpret
@pytest.mark.parametrize("vocab", [1000, 3001])
def test_triton_weights_and_tokens_equal_the_torch_reference(vocab):
    TS = _ts()
    x, temps, u = _rows(24, vocab, seed=vocab)
    bits = S._weight_bits(vocab)
    ref = S.categorical_sample_reference(x, temps, u)
    z = S.scaled_logits(x, temps)
    w_ref = S._int_weights(z, z.amax(-1, keepdim=True), bits)
    tok, w = TS.categorical_sample(x, temps, u, None, bits, return_weights=True)
    bad = (w != w_ref).nonzero()
    assert bad.numel() == 0, f"weights differ at (row, col) {bad[:8].tolist()}"
    assert torch.equal(tok, ref), (tok != ref).nonzero().squeeze(1).tolist()
    assert tok[1] < 7 and tok[2] == vocab // 2 and bool((x[torch.arange(24), tok] > float("-inf")).all())
    # the public op on the Triton backend, greedy rows mixed in, and the speed knobs
    greedy = torch.arange(24) % 3 == 0
    ref_g = S.categorical_sample_reference(x, temps, u, greedy)
    assert torch.equal(ref_g[greedy], x.float().argmax(-1)[greedy]) and ref_g[3] == 10
    with use_backend("triton"):
        assert torch.equal(K.categorical_sample(x, temps, u, greedy), ref_g)
    for block, split in ((512, 1), (1024, 3), (2048, None)):
        assert torch.equal(TS.categorical_sample(x, temps, u, greedy, bits, block=block, split=split), ref_g)
    # the sensitive case: u on both sides of a boundary
    xb, tb, ub = _boundary_uniforms(x, temps, bits)
    tk = TS.categorical_sample(xb, tb, ub, None, bits, block=512)
    assert torch.equal(tk, S.categorical_sample_reference(xb, tb, ub))
    assert bool((tk.view(-1, 4)[:, 0] != tk.view(-1, 4)[:, 2]).any())  # the boundaries do move tokens


@interpret
def test_wrong_kernels_fail_the_same_checks():
    """Controls: z = x * (1/T) instead of x / T, and exp64 with two Horner terms fewer (a few
    ulp off), each give other weights and, at boundary uniforms, other tokens."""
    TS = _ts()
    vocab = 3000
    x, temps, u = _rows(24, vocab, seed=5)
    bits = S._weight_bits(vocab)
    z = S.scaled_logits(x, temps)
    w_ref = S._int_weights(z, z.amax(-1, keepdim=True), bits)
    xb, tb, ub = _boundary_uniforms(x, temps, bits)
    ref_b = S.categorical_sample_reference(xb, tb, ub)
    for variant in (1, 2):
        _, w = TS.categorical_sample(x, temps, u, None, bits, return_weights=True, _variant=variant)
        assert int((w != w_ref).sum()) > 0, f"variant {variant}: same weights"
        assert not torch.equal(TS.categorical_sample(xb, tb, ub, None, bits, _variant=variant), ref_b), variant


@interpret
def test_int_weights_and_exp64_bits_down_to_underflow():
    """The elementwise kernel top-p uses: exp64's float64 bits (z - max from 0 down past -745,
    the subnormal scaling and the zero cut) and the int64 weights, on sorted rows."""
    TS = _ts()
    d = torch.cat([-torch.logspace(-8, np.log10(760.0), 2000, dtype=F64),
                   torch.tensor([0.0, -0.0, -744.9, -745.0, -745.1, -708.4, -709.8, -1e4, float("-inf")],
                                dtype=F64)])
    z = torch.cat([torch.zeros(1, dtype=F64), d]).float().unsqueeze(0).repeat(2, 1)
    z[1] = z[1] * 0.5
    zmax = z.amax(-1, keepdim=True)
    e = TS.int_weights(z, zmax, 44, block=256, _raw_exp=True)
    e_ref = _exact.exp64(z.to(F64) - zmax.to(F64))
    assert torch.equal(e.view(torch.int64), e_ref.view(torch.int64))
    assert bool((e_ref[0] > 0).any() & (e_ref[0] < 2.0 ** -1022).any())  # subnormals were reached
    assert torch.equal(TS.int_weights(z, zmax, 44, block=256), S._int_weights(z, zmax, 44))
    x, temps, _ = _rows(8, 2000, seed=9)
    k, p = torch.tensor([5, -1, 0, 40, 1, 3000, 2, -1]), torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 0.8, 1.0, 0.6])
    with use_backend("triton"):
        got = K.top_k_top_p_mask(x, temps, k, p)
    assert torch.equal(got, K.top_k_top_p_mask(x, temps, k, p))


def test_categorical_sample_refuses_bad_inputs():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="uniforms"):
        K.categorical_sample(x, 1.0, torch.rand(4, dtype=F64))
    with pytest.raises(ValueError, match="greedy"):
        K.categorical_sample(x, 1.0, torch.rand(3, dtype=F64), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="Sampler"):
        Sampler.pack_host([SamplingParams()] * 2, [1], [0, 0])


def _old_call(logits, params, seeds, indices):
    """The Sampler before its host/device split, frozen here as the behaviour the split must match."""
    dev, n = logits.device, len(params)
    greedy = [sp.greedy for sp in params]
    masked_rows = [sp.masked for sp in params]
    f32 = np.array([[1.0 if sp.greedy else sp.temperature for sp in params],
                    [sp.top_p if m else 1.0 for sp, m in zip(params, masked_rows)]], np.float32)
    i64 = np.array([[S.to_int64_seed(s) for s in seeds], list(indices),
                    [sp.top_k if m else -1 for sp, m in zip(params, masked_rows)], greedy], np.int64)
    f32, i64 = upload(f32.reshape(-1), dev).view(2, n), upload(i64.reshape(-1), dev).view(4, n)
    temps = f32[0]
    masked = K.apply_top_k_top_p(logits, temps, i64[2], f32[1]) if any(masked_rows) else logits
    if all(greedy):
        tokens = logits.float().argmax(-1)
    else:
        tokens = S.categorical_sample_reference(masked, temps, K.uniform_noise(i64[0], i64[1]))
        if any(greedy):
            tokens = torch.where(i64[3].bool(), logits.float().argmax(-1), tokens)
    lps = reported_logprobs(logits, tokens, temps)
    sampled = reported_logprobs(masked, tokens, temps) if masked is not logits else lps
    out = torch.stack([tokens.to(F64), lps.to(F64), sampled.to(F64)]).tolist()
    return [int(t) for t in out[0]], out[1], out[2]


_KINDS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
          SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.7),
          SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=0.9, seed=4)]


@pytest.mark.parametrize("mix", ["mixed", "greedy", "plain", "masked"])
def test_sampler_split_equals_the_old_sampler(mix):
    pick = {"mixed": _KINDS, "greedy": _KINDS[:1], "plain": [_KINDS[2], _KINDS[5]], "masked": [_KINDS[1], _KINDS[3]]}
    params = [pick[mix][i % len(pick[mix])] for i in range(13)]
    logits = (torch.randn(13, 300) * 3).to(torch.bfloat16)
    seeds, idx = [2 ** 63 + 7 * i for i in range(13)], list(range(13))
    new = Sampler()(logits, params, seeds, idx)
    assert new == _old_call(logits, params, seeds, idx)
    flags = Sampler.flags(params)
    f32, i64 = Sampler.pack(params, seeds, idx, logits.device)
    out = Sampler().device_step(logits, f32, i64, *flags)
    assert out.dtype == F64 and out.shape == (3, 13) and Sampler.finish(out) == new
    # CompletionOutput.logprobs is the trainer's function, bit for bit
    temps = torch.tensor([1.0 if sp.greedy else sp.temperature for sp in params])
    lp = K.token_logprobs(logits, torch.tensor(new[0]), temps)
    assert torch.equal(torch.tensor(new[1], dtype=torch.float32), lp)


@interpret
def test_sampler_on_the_triton_backend_draws_the_reference_tokens():
    params = [_KINDS[i % len(_KINDS)] for i in range(12)]
    logits = (torch.randn(12, 1500) * 4).to(torch.bfloat16)
    seeds, idx = list(range(12)), [5] * 12
    ref = Sampler()(logits, params, seeds, idx)
    with use_backend("triton"):
        got = Sampler()(logits, params, seeds, idx)
        temps = torch.tensor([1.0 if sp.greedy else sp.temperature for sp in params])
        lp = K.token_logprobs(logits, torch.tensor(got[0]), temps)  # the trainer, same backend
    assert got[0] == ref[0]
    assert torch.equal(torch.tensor(got[1], dtype=torch.float32), lp)


def test_device_step_has_no_host_sync():
    from test_sampling import _CountOps  # the op counter of the sampler's own tests

    params = [_KINDS[i % len(_KINDS)] for i in range(9)]
    logits = torch.randn(9, 200).to(torch.bfloat16)
    f32, i64 = Sampler.pack(params, list(range(9)), [1] * 9, logits.device)
    with _CountOps() as c:
        out = Sampler().device_step(logits, f32, i64, *Sampler.flags(params))
    assert c.syncs == [], c.syncs
    with _CountOps() as c:
        Sampler.finish(out)
    assert c.syncs == ["tolist"]
