"""The Triton backward of the Mamba2 ops (kernels/triton/mamba_bwd.py) under Triton's CPU
interpreter, through the public ops' autograd, against float64 autograd of the plain math
(kernels.mamba.scan_plain, a per-sequence depthwise conv1d, the gated norm written out).

Gradients need not be invariant, only correct: fp32 inputs within 1e-5 of the largest gradient,
bf16 within 0.03 (bf16 dot operands, as mamba_ssm's backward; the interpreter's fp32 -> bf16 cast
truncates). Packed sequences cover empty, one-token, below / at / across chunk sizes, several row
tiles per chunk. Controls: the same comparison fails when the chunks are cut apart (no gradient
through the state between chunks), and a step's host ops do not grow with the chunk count.
The GPU rows (gradients vs fp32 torch and mamba_ssm's, timings) are benchmarks/ops/mamba_layer.py's.
"""
import pytest
import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.kernels._backend import use_backend
from bitmatch.kernels.mamba import scan_plain
from host_reads import dispatched_ops

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

BF, F32 = torch.bfloat16, torch.float32
H, P, G, N = 4, 32, 2, 16
DT_MIN = 1e-3
TOL = {F32: 1e-5, BF: 0.03}


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _scan_inputs(lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    A, D, db = -torch.rand(H, generator=g) * 2 - 0.1, torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5
    gy = torch.randn(T, H, P, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return [t.to(dtype) for t in (x, dt, B, C)] + [A, D, db], gy, cu


def _triton_grads(ins, gy, cu, Q, with_D=True, with_bias=True, needs=None):
    needs = needs or [True] * 7
    leaves = [t.clone().requires_grad_(n) for t, n in zip(ins, needs)]
    x, dt, B, C, A, D, db = leaves
    with use_backend("triton"):
        y = K.mamba_chunk_scan(x, dt, A, B, C, Q, cu, D=D if with_D else None, dt_bias=db if with_bias else None,
                               dt_min=DT_MIN, cu_seqlens_host=cu.tolist())
        (y * gy).sum().backward()
    return [t.grad for t in leaves]


def _float64_grads(ins, gy, cu, Q, with_D=True, with_bias=True):
    leaves = [t.detach().double().requires_grad_(True) for t in ins]
    x, dt, B, C, A, D, db = leaves
    dtv = F.softplus(dt + db if with_bias else dt).clamp(min=DT_MIN)
    y = scan_plain(x, dtv, A, B, C, D if with_D else None, Q, cu)
    (y * gy.double()).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("Q", [16, 64])  # 64: two row tiles per chunk
def test_scan_backward_matches_float64(dtype, Q):
    lens = [5, Q, 0, 2 * Q + 3, 1, Q + 1]
    ins, gy, cu = _scan_inputs(lens, dtype, seed=Q)
    got = _triton_grads(ins, gy, cu, Q)
    want = _float64_grads(ins, gy, cu, Q)
    for name, a, b, t in zip("x dt B C A D dt_bias".split(), got, want, ins):
        assert a is not None and a.dtype == t.dtype and a.shape == t.shape, name
        assert _rel(a, b) < TOL[dtype], f"grad {name}: {_rel(a, b):.3g}"


def test_scan_backward_without_D_or_dt_bias_and_only_x():
    Q = 16
    ins, gy, cu = _scan_inputs([Q + 7, 3], F32, seed=3)
    got = _triton_grads(ins, gy, cu, Q, with_D=False, with_bias=False)
    want = _float64_grads(ins, gy, cu, Q, with_D=False, with_bias=False)
    for name, a, b in zip("x dt B C A".split(), got, want):
        assert _rel(a, b) < TOL[F32], f"grad {name}: {_rel(a, b):.3g}"
    assert got[5] is None and got[6] is None  # D and dt_bias did not take part
    only_x = _triton_grads(ins, gy, cu, Q, needs=[True] + [False] * 6)
    assert torch.equal(only_x[0], _triton_grads(ins, gy, cu, Q)[0])


def test_scan_backward_state_rows_split_over_programs(monkeypatch):
    # the state kernel's P rows split over programs (a launch knob): each row's arithmetic is its own
    from bitmatch.kernels.triton import mamba_bwd
    Q = 16
    ins, gy, cu = _scan_inputs([3 * Q + 2, Q], F32, seed=5)
    whole = _triton_grads(ins, gy, cu, Q)
    monkeypatch.setitem(mamba_bwd.SCAN_BWD, "states_BP", 16)
    split = _triton_grads(ins, gy, cu, Q)
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


def test_control_chunks_cut_apart_fail_the_comparison(monkeypatch):
    # the comparison sees the gradient that flows through the state between chunks: a backward that
    # treats every chunk as its own sequence is far off
    from bitmatch.kernels.triton import mamba_bwd
    Q = 16
    ins, gy, cu = _scan_inputs([3 * Q + 5], F32, seed=7)
    want = _float64_grads(ins, gy, cu, Q)
    real = mamba_bwd.scan_backward

    def cut(g, x, dt, A, B, C, D, db, Q_, seqs, dt_min):
        pieces = [(c, min(c + Q_, e)) for s, e in seqs for c in range(s, e, Q_)]
        return real(g, x, dt, A, B, C, D, db, Q_, pieces, dt_min)
    monkeypatch.setattr(mamba_bwd, "scan_backward", cut)
    got = _triton_grads(ins, gy, cu, Q)
    assert _rel(got[0], want[0]) > 100 * TOL[F32]


def test_backward_host_ops_do_not_grow_with_chunks_and_undercut_the_torch_backward():
    Q = 16

    def step(chunks, backend):
        ins, gy, cu = _scan_inputs([chunks * Q + 3, chunks * Q - 1], F32, seed=4)
        leaves = [t.clone().requires_grad_(True) for t in ins]
        x, dt, B, C, A, D, db = leaves

        def run():
            with use_backend(backend):
                y = K.mamba_chunk_scan(x, dt, A, B, C, Q, cu, D=D, dt_bias=db, dt_min=DT_MIN,
                                       cu_seqlens_host=cu.tolist())
                torch.autograd.grad((y * gy).sum(), leaves)
        run()  # the chunk table is built once per layout
        return dispatched_ops(run)
    assert step(2, "triton") == step(6, "triton")
    # control: the torch backward (reference backend) dispatches several times as many ops
    assert step(2, "reference") > 4 * step(2, "triton")


@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
def test_conv_backward_matches_float64(dtype, bias, activation):
    lens = [5, 0, 1, 40, 3]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    g = torch.Generator().manual_seed(31)
    T, Cd = sum(lens), 200  # channels across two column blocks, rows across tiles
    x, w, b = torch.randn(T, Cd, generator=g), torch.randn(Cd, 4, generator=g), torch.randn(Cd, generator=g)
    gy = torch.randn(T, Cd, generator=g)
    ins = [x.to(dtype), w.to(dtype), b.to(dtype) if bias else None]
    leaves = [t.clone().requires_grad_() if t is not None else None for t in ins]
    with use_backend("triton"):
        out = K.causal_conv1d(*leaves, cu, activation=activation, cu_seqlens_host=cu.tolist())
        (out.float() * gy).sum().backward()
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in ins]
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            o = F.conv1d(ref[0][s:e].t()[None], ref[1][:, None], ref[2], padding=3, groups=Cd)[0, :, :e - s].t()
            outs.append(F.silu(o) if activation else o)
    (torch.cat(outs) * gy.double()).sum().backward()
    for name, a, r in zip("x weight bias".split(), leaves, ref):
        if r is None:
            continue
        assert a.grad.dtype == dtype and _rel(a.grad, r.grad) < TOL[dtype], f"grad {name}: {_rel(a.grad, r.grad):.3g}"


@pytest.mark.parametrize("dtype", [F32, BF])
def test_gated_norm_backward_matches_float64(dtype):
    g = torch.Generator().manual_seed(8)
    T, I, gs = 37, 96, 32  # a partial row tile, three groups
    ins = [torch.randn(T, I, generator=g).to(dtype), torch.randn(T, I, generator=g).to(dtype),
           torch.randn(I, generator=g).to(dtype)]
    gy = torch.randn(T, I, generator=g)
    leaves = [t.clone().requires_grad_() for t in ins]
    with use_backend("triton"):
        (K.gated_rms_norm(*leaves, gs, 1e-5) * gy).sum().backward()
    y, z, w = [t.detach().double().requires_grad_() for t in ins]
    h = (y * F.silu(z)).view(T, -1, gs)
    out = (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).view(T, I))
    (out * gy.double()).sum().backward()
    for name, a, r in zip("y z weight".split(), leaves, (y, z, w)):
        assert a.grad.dtype == dtype and _rel(a.grad, r.grad) < TOL[dtype], f"grad {name}: {_rel(a.grad, r.grad):.3g}"


def test_nemotron_h_gradients_match_hf_autograd():
    # the whole hybrid (Mamba, attention, MLP, MoE blocks) in fp32: every parameter's gradient of
    # token_logprobs on the Triton backend against HF's own forward + backward
    import copy

    import bitmatch
    from bitmatch.models import nemotron_h as NH
    torch.manual_seed(0)
    hf = NH.FAMILY.tiny_model(dtype=F32, chunk_size=16)
    ours = bitmatch.patch(copy.deepcopy(hf))
    ids = torch.randint(3, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, 39, generator=torch.Generator().manual_seed(2))

    def grads(model, logps):
        model.zero_grad(set_to_none=True)
        model.train()
        (logps(model) * w).sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    def hf_logps(m):
        lp = torch.log_softmax(m(ids).logits[:, :-1].float(), -1)
        return lp.gather(-1, ids[:, 1:, None])[..., 0]
    want = grads(hf, hf_logps)
    with use_backend("triton"):
        got = grads(ours, lambda m: bitmatch.token_logprobs(m, ids, None, temperature=1.0))
    assert set(got) == set(want) and any(".mixer.A_log" in n for n in got)
    bad = {n: _rel(got[n], want[n]) for n in want if _rel(got[n], want[n]) > 1e-4}
    assert not bad, bad


@pytest.mark.parametrize("bad", [[0, 4, 9, 12], [0, 4, 8], [1, 4, 9], [0, 6, 4, 9]])
def test_a_wrong_host_copy_of_the_boundaries_is_named(bad):
    # the host copy replaces the device check, so it is checked itself: length, 0 first, T last, order
    # (its inner values are trusted to be cu_seqlens' own: comparing them would read the device back)
    x, w = torch.randn(9, 6), torch.randn(6, 4)
    cu = torch.tensor([0, 4, 9])
    with pytest.raises(ValueError, match="cu_seqlens_host"):
        K.causal_conv1d(x, w, None, cu, cu_seqlens_host=bad)
    ins, _, cu2 = _scan_inputs([4, 5], F32)
    with pytest.raises(ValueError, match="cu_seqlens_host"):
        K.mamba_chunk_scan(ins[0], ins[1], ins[4], ins[2], ins[3], 16, cu2, cu_seqlens_host=bad)
