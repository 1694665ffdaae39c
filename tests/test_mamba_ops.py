"""Mamba2 ops (causal_conv1d, mamba_chunk_scan, gated_rms_norm): parity with HF's Nemotron-H torch
functions, the canonical chunk schedule (full prefill == any chunked prefill == token-by-token
decode, across chunk boundaries, bit for bit), batch invariance (sequences alone vs packed with
neighbours in shuffled slots), gradients vs HF's autograd, input errors; and the controls: HF's
own chunked scan vs its recurrent step, and HF's prefill split in two, differ."""
from __future__ import annotations

import random

import pytest
import torch

import bitmatch.kernels as K
from bitmatch.kernels.mamba import scan_plain, scan_reference
from bitmatch.testing import assert_batch_invariant, assert_bitwise_equal
from host_reads import dispatched_ops

hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

H, P, G, N, Q = 4, 8, 2, 16, 8
DT_MIN = 0.001


def _inputs(T, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g).to(dtype)
    dt = torch.randn(T, H, generator=g).to(dtype)
    B = torch.randn(T, G, N, generator=g).to(dtype)
    C = torch.randn(T, G, N, generator=g).to(dtype)
    return x, dt, B, C


def _params(seed=1):
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(H, generator=g) * 2 - 0.1, torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5


def _cache(slots=4, dtype=torch.float32):
    return (torch.zeros(slots, H, P, N), torch.zeros(slots, Q, H, P, dtype=dtype),
            torch.zeros(slots, Q, G, N, dtype=dtype), torch.zeros(slots, Q, H))


def _full(x, dt, B, C, A, D, db):
    return K.mamba_chunk_scan(x, dt, A, B, C, Q, torch.tensor([0, x.shape[0]]), D=D, dt_bias=db, dt_min=DT_MIN)


def _split(x, dt, B, C, A, D, db, splits, slot=2, dtype=torch.float32):
    cache, p, outs = _cache(dtype=dtype), 0, []
    for n in splits:
        outs.append(K.mamba_chunk_scan(x[p:p + n], dt[p:p + n], A, B[p:p + n], C[p:p + n], Q, torch.tensor([0, n]),
                                       D=D, dt_bias=db, dt_min=DT_MIN, seq_start=torch.tensor([p]), cache=cache,
                                       state_slots=torch.tensor([slot])))
        p += n
    return torch.cat(outs), cache


def _hf_scan(x, dt, B, C, A, D, db, initial=None, final=False):
    return hf.mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], Q, D=D, dt_bias=db, dt_softplus=True,
                                dt_limit=(DT_MIN, float("inf")), initial_states=initial, return_final_states=final)


def test_scan_parity_with_hf_fp32():
    x, dt, B, C = _inputs(37)
    A, D, db = _params()
    y = _full(x, dt, B, C, A, D, db)
    ref = _hf_scan(x, dt, B, C, A, D, db)[0]
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_schedule_invariance_random_splits_and_decode(dtype):
    """Full prefill == random chunked prefills == one-token decode, over 5+ chunks; the state after
    each call is the same boundary state as the full prefill's at the end."""
    T = 45
    x, dt, B, C = _inputs(T, seed=3, dtype=dtype)
    A, D, db = _params()
    want = _full(x, dt, B, C, A, D, db)
    rng = random.Random(0)
    cases = [[1] * T, [Q] * 5 + [5], [Q - 1, 1, Q + 1] + [1] * (T - 2 * Q - 1), [T - 1, 1]]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, T), rng.randint(1, 8)))
        cases.append([b - a for a, b in zip([0] + cuts, cuts + [T])])
    for splits in cases:
        got, cache = _split(x, dt, B, C, A, D, db, splits, dtype=dtype)
        assert_bitwise_equal(got, want, f"splits {splits}")
    # the stored boundary state: equal to a full prefill's that ends on a chunk boundary
    _, c_full = _split(x[:40], dt[:40], B[:40], C[:40], A, D, db, [40], dtype=dtype)
    _, c_dec = _split(x[:40], dt[:40], B[:40], C[:40], A, D, db, [1] * 40, dtype=dtype)
    assert_bitwise_equal(c_dec[0][2], c_full[0][2], "boundary state")


def test_scan_batch_invariance_packed_sequences_shuffled_slots():
    """Sequences with different start positions, packed in one call in random orders and slots, give the
    bits each gets alone."""
    A, D, db = _params()
    seqs = [_inputs(n, seed=10 + n) for n in (3, 17, 9, 1, 26)]
    alone = [_full(*s, A, D, db) for s in seqs]
    rng = random.Random(1)
    for trial in range(4):
        order = rng.sample(range(len(seqs)), len(seqs))
        slots = rng.sample(range(8), len(seqs))
        cache = (torch.zeros(8, H, P, N), torch.zeros(8, Q, H, P), torch.zeros(8, Q, G, N), torch.zeros(8, Q, H))
        done = [0] * len(seqs)
        outs = [[] for _ in seqs]
        while any(done[i] < seqs[i][0].shape[0] for i in order):
            live = [i for i in order if done[i] < seqs[i][0].shape[0]]
            take = [min(rng.choice([1, 1, 2, 5, Q]), seqs[i][0].shape[0] - done[i]) for i in live]
            parts = [tuple(t[done[i]:done[i] + n] for t in seqs[i]) for i, n in zip(live, take)]
            cu = torch.tensor([0] + list(torch.tensor(take).cumsum(0)))
            y = K.mamba_chunk_scan(*(torch.cat([p[j] for p in parts]) for j in (0, 1)), A,
                                   *(torch.cat([p[j] for p in parts]) for j in (2, 3)), Q, cu, D=D, dt_bias=db,
                                   dt_min=DT_MIN, seq_start=torch.tensor([done[i] for i in live]), cache=cache,
                                   state_slots=torch.tensor([slots[i] for i in live]))
            for k, (i, n) in enumerate(zip(live, take)):
                outs[i].append(y[int(cu[k]):int(cu[k + 1])])
                done[i] += n
        for i in range(len(seqs)):
            assert_bitwise_equal(torch.cat(outs[i]), alone[i], f"trial {trial} seq {i}")


def test_control_hf_prefill_vs_recurrent_and_split_prefill_differ():
    """The same comparisons on HF's torch path fail: its chunked scan vs its one-token recurrence, and
    its prefill split in two (initial_states) vs in one."""
    x, dt, B, C = _inputs(30, seed=5)
    A, D, db = _params()
    full = _hf_scan(x, dt, B, C, A, D, db)[0]
    st, rec = torch.zeros(1, H, P, N), []
    for t in range(30):
        rec.append(hf.mamba2_selective_state_update(
            st, x[t][None], dt[t][None, :, None].expand(1, H, P), A[:, None, None].expand(H, P, N), B[t][None],
            C[t][None], D[:, None].expand(H, P), dt_bias=db[:, None].expand(H, P), dt_softplus=True))
    assert not torch.equal(torch.cat(rec), full)
    first, s = _hf_scan(x[:13], dt[:13], B[:13], C[:13], A, D, db, final=True)
    second = _hf_scan(x[13:], dt[13:], B[13:], C[13:], A, D, db, initial=s)
    assert not torch.equal(torch.cat([first[0], second[0]]), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_parity_and_state_splits(dtype):
    T, Cd, Kc = 23, 12, 4
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, Cd, generator=g).to(dtype)
    w, b = torch.randn(Cd, Kc, generator=g).to(dtype), torch.randn(Cd, generator=g).to(dtype)
    out = K.causal_conv1d(x, w, b, torch.tensor([0, T]))
    ref = hf.causal_conv1d_fn(x.t()[None], w, b, activation="silu")[0].t()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    for splits in ([T], [1] * T, [2, 1, 5, 1, 1, 13], [3, 20]):
        state, p, outs = torch.zeros(3, Kc - 1, Cd, dtype=dtype), 0, []
        for n in splits:
            outs.append(K.causal_conv1d(x[p:p + n], w, b, torch.tensor([0, n]), conv_state=state,
                                        state_slots=torch.tensor([1])))
            p += n
        assert_bitwise_equal(torch.cat(outs), out, f"conv splits {splits}")
        assert_bitwise_equal(state[1], x[-(Kc - 1):], "conv state = last K-1 inputs")
    # two sequences packed: each as alone
    both = K.causal_conv1d(torch.cat([x[:7], x[7:]]), w, b, torch.tensor([0, 7, T]))
    assert_bitwise_equal(both[7:], K.causal_conv1d(x[7:], w, b, torch.tensor([0, T - 7])), "packed conv")


def test_gated_rms_norm_parity_and_batch_invariance():
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    I = H * P
    g = torch.Generator().manual_seed(6)
    y, z, w = torch.randn(40, I, generator=g), torch.randn(40, I, generator=g), torch.randn(I, generator=g)
    m = Zamba2RMSNormGated(I, I // G, 1e-5)
    m.weight.data.copy_(w)
    torch.testing.assert_close(K.gated_rms_norm(y, z, w, I // G, 1e-5), m(y, z), rtol=1e-5, atol=1e-5)
    assert_batch_invariant(lambda a, b: K.gated_rms_norm(a, b, w, I // G, 1e-5), (y, z), max_batch=64, cases=6)


def test_gradients_match_hf_autograd():
    x, dt, B, C = _inputs(21, seed=8)
    A, D, db = _params()
    leaves = [t.clone().requires_grad_(True) for t in (x, dt, B, C, A, D, db)]
    y = K.mamba_chunk_scan(leaves[0], leaves[1], leaves[4], leaves[2], leaves[3], Q, torch.tensor([0, 21]),
                           D=leaves[5], dt_bias=leaves[6], dt_min=DT_MIN)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    refs = [t.clone().requires_grad_(True) for t in (x, dt, B, C, A, D, db)]
    r = _hf_scan(refs[0], refs[1], refs[2], refs[3], refs[4], refs[5], refs[6])[0]
    (r * gy).sum().backward()
    for name, a, b in zip("x dt B C A D dt_bias".split(), leaves, refs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad {name}: {m}")
    # conv and gated norm gradients flow
    xc = torch.randn(9, 6, requires_grad=True)
    wc = torch.randn(6, 4, requires_grad=True)
    K.causal_conv1d(xc, wc, None, torch.tensor([0, 4, 9])).sum().backward()
    assert xc.grad is not None and wc.grad is not None and wc.grad.abs().sum() > 0


def test_packed_gradients_match_each_sequence_through_hf():
    """The backward over packed sequences (every chunk of every sequence at once, lengths below,
    at and across Q, an empty one): each sequence's gradients equal HF's autograd on it alone."""
    lens = [5, Q, 0, 3 * Q + 2, 1, 2 * Q]
    x, dt, B, C = _inputs(sum(lens), seed=9)
    A, D, db = _params()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    leaves = [t.clone().requires_grad_(True) for t in (x, dt, B, C, A, D, db)]
    y = K.mamba_chunk_scan(leaves[0], leaves[1], leaves[4], leaves[2], leaves[3], Q, cu,
                           D=leaves[5], dt_bias=leaves[6], dt_min=DT_MIN)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    shared = [torch.zeros_like(t) for t in (A, D, db)]  # A, D, dt_bias: the sum over sequences
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if s == e:
            continue
        refs = [t[s:e].clone().requires_grad_(True) for t in (x, dt, B, C)]
        prm = [t.clone().requires_grad_(True) for t in (A, D, db)]
        r = _hf_scan(refs[0], refs[1], refs[2], refs[3], *prm)[0]
        (r * gy[s:e]).sum().backward()
        for name, a, b in zip("x dt B C".split(), leaves[:4], refs):
            torch.testing.assert_close(a.grad[s:e], b.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad {name}: {m}")
        for acc, t in zip(shared, prm):
            acc += t.grad
    for name, a, b in zip("A D dt_bias".split(), leaves[4:], shared):
        torch.testing.assert_close(a.grad, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad {name}: {m}")


def test_conv_packed_gradients_match_each_sequence_alone():
    """The conv's backward over packed sequences (all tokens at once, taps masked at each
    sequence's start; empty and length-1 sequences included) equals float64 autograd of a
    per-sequence depthwise conv1d."""
    import torch.nn.functional as F
    lens = [5, 0, 1, 9, 3]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    g = torch.Generator().manual_seed(31)
    x, w, b = torch.randn(sum(lens), 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    gy = torch.randn(sum(lens), 6, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    (K.causal_conv1d(*leaves, cu) * gy).sum().backward()
    ref = [t.double().requires_grad_(True) for t in (x, w, b)]
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            o = F.conv1d(ref[0][s:e].t()[None], ref[1][:, None], ref[2], padding=3, groups=6)[0, :, :e - s].t()
            outs.append(F.silu(o))
    (torch.cat(outs) * gy.double()).sum().backward()
    for name, a, r in zip("x weight bias".split(), leaves, ref):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


def _backward_ops(impl, per_seq_chunks):
    lens = [per_seq_chunks * Q + 3, per_seq_chunks * Q - 1]
    x, dt, B, C = _inputs(sum(lens), seed=4)
    A, D, _ = _params()
    dt = dt.abs() * 0.1  # dt after softplus: positive
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    leaves = [t.float().clone().requires_grad_(True) for t in (x, dt, A, B, C, D)]

    def step():
        if impl == "plain":
            y = scan_plain(*leaves, Q, cu)
            torch.autograd.grad(y.sum(), leaves)
        else:
            scan_reference(*[t.detach() for t in leaves], Q, cu, None, None, None)
    return dispatched_ops(step)


def test_backward_ops_do_not_grow_with_chunks():
    # the training backward (scan_plain forward + autograd) launches the same ops for 2 or 12
    # chunks per sequence: the chunk states come from one decay-weighted sum, no step per chunk
    assert _backward_ops("plain", 2) == _backward_ops("plain", 12)


def test_control_op_count_sees_a_loop_per_chunk():
    # the counter's control: the reference scan walks chunk by chunk, and its count grows
    assert _backward_ops("reference", 12) > _backward_ops("reference", 2)


def test_input_errors_are_named():
    x, dt, B, C = _inputs(10)
    A, D, db = _params()
    cu = torch.tensor([0, 10])
    with pytest.raises(ValueError, match="needs its cache"):
        K.mamba_chunk_scan(x, dt, A, B, C, Q, cu, seq_start=torch.tensor([3]))
    with pytest.raises(ValueError, match="multiple of n_groups"):
        K.mamba_chunk_scan(x, dt, A, B[:, :1].expand(10, 3, N).contiguous(), C[:, :1].expand(10, 3, N).contiguous(),
                           Q, cu)
    with pytest.raises(ValueError, match="state_slots"):
        K.mamba_chunk_scan(x, dt, A, B, C, Q, cu, seq_start=torch.tensor([0]), cache=_cache())
    with pytest.raises(ValueError, match="ssm_state must be"):
        bad = _cache()
        K.mamba_chunk_scan(x, dt, A, B, C, Q, cu, seq_start=torch.tensor([0]), cache=(bad[0].half(),) + bad[1:],
                           state_slots=torch.tensor([0]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        K.causal_conv1d(torch.randn(5, 3), torch.randn(3, 4), None, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="group_size"):
        K.gated_rms_norm(torch.randn(2, 6), torch.randn(2, 6), torch.randn(6), 4, 1e-5)


@pytest.mark.interpreter
def test_triton_scan_interpreter_schedule_invariance_and_parity():
    """The Triton scan under TRITON_INTERPRET=1 (shapes >= 16 for tl.dot): parity with the reference,
    and its own bits equal across full prefill, token-by-token decode and chunked splits (buffer and
    boundary state in the cache), two sequences packed vs alone."""
    h, p, g, n, q = 2, 16, 1, 16, 16
    gen = torch.Generator().manual_seed(11)
    T = 21
    x, dt = torch.randn(T, h, p, generator=gen), torch.randn(T, h, generator=gen)
    B, C = torch.randn(T, g, n, generator=gen), torch.randn(T, g, n, generator=gen)
    A, D, db = -torch.rand(h, generator=gen) - 0.1, torch.randn(h, generator=gen), torch.randn(h, generator=gen)

    def call(sl, start=None, cache=None, slot=1):
        kw = {} if cache is None else dict(seq_start=torch.tensor([start]), cache=cache,
                                           state_slots=torch.tensor([slot]))
        return K.mamba_chunk_scan(x[sl], dt[sl], A, B[sl], C[sl], q, torch.tensor([0, sl.stop - sl.start]), D=D,
                                  dt_bias=db, dt_min=DT_MIN, **kw)

    ref = call(slice(0, T))
    with K.use_backend("triton"):
        full = call(slice(0, T))
        torch.testing.assert_close(full, ref, rtol=1e-5, atol=5e-5)
        for splits in ([1] * T, [5, 13, 3], [16, 5]):
            cache = (torch.zeros(2, h, p, n), torch.zeros(2, q, h, p), torch.zeros(2, q, g, n), torch.zeros(2, q, h))
            at, outs = 0, []
            for k in splits:
                outs.append(call(slice(at, at + k), at, cache))
                at += k
            assert_bitwise_equal(torch.cat(outs), full, f"triton splits {splits}")
        both = K.mamba_chunk_scan(torch.cat([x[:4], x]), torch.cat([dt[:4], dt]), A, torch.cat([B[:4], B]),
                                  torch.cat([C[:4], C]), q, torch.tensor([0, 4, 4 + T]), D=D, dt_bias=db, dt_min=DT_MIN)
        assert_bitwise_equal(both[4:], full, "triton packed")


@pytest.mark.interpreter
def test_triton_conv1d_and_gated_norm_interpreter():
    """Triton conv1d (state rows before the call) and gated norm under TRITON_INTERPRET=1: parity with
    the reference, conv splits/decode bit for bit with the state, gated norm rows alone == in a batch."""
    gen = torch.Generator().manual_seed(12)
    T, Cd, Kc = 13, 40, 4
    x = torch.randn(T, Cd, generator=gen).to(torch.bfloat16)
    w, b = torch.randn(Cd, Kc, generator=gen).to(torch.bfloat16), torch.randn(Cd, generator=gen).to(torch.bfloat16)
    ref = K.causal_conv1d(x, w, b, torch.tensor([0, T]))
    with K.use_backend("triton"):
        full = K.causal_conv1d(x, w, b, torch.tensor([0, T]))
        torch.testing.assert_close(full.float(), ref.float(), rtol=2e-2, atol=2e-2)  # one bf16 ulp
        for splits in ([1] * T, [2, 1, 7, 3]):
            state, at, outs = torch.zeros(3, Kc - 1, Cd, dtype=torch.bfloat16), 0, []
            for k in splits:
                outs.append(K.causal_conv1d(x[at:at + k], w, b, torch.tensor([0, k]), conv_state=state,
                                            state_slots=torch.tensor([2])))
                at += k
            assert_bitwise_equal(torch.cat(outs), full, f"triton conv splits {splits}")
            assert_bitwise_equal(state[2], x[-(Kc - 1):], "triton conv state")
        packed = K.causal_conv1d(torch.cat([x[:5], x]), w, b, torch.tensor([0, 5, 5 + T]))
        assert_bitwise_equal(packed[5:], full, "triton conv packed")
        y, z, wn = torch.randn(9, 64, generator=gen), torch.randn(9, 64, generator=gen), torch.randn(64, generator=gen)
        got = K.gated_rms_norm(y, z, wn, 32, 1e-5)
        assert_batch_invariant(lambda a, c: K.gated_rms_norm(a, c, wn, 32, 1e-5), (y, z), max_batch=16, cases=3)
    torch.testing.assert_close(got, K.gated_rms_norm(y, z, wn, 32, 1e-5), rtol=1e-5, atol=1e-5)
