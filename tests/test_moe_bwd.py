"""moe_experts backward: the Triton grouped-GEMM backward (kernels/triton/moe_bwd.py, under Triton's
CPU interpreter) and the CPU reference backward against float64 autograd of the plain math.

Cases: swiglu (with and without DeepSeek-V4's swiglu_limit) and relu2; 4, 8 and 16 experts;
top-k 1, 2 and 4; experts that receive no token (their gradients must be exact zeros); routing
ties; T * k, H and I that are not multiples of the tiles. Gradients need not be invariant, only
correct: fp32 within rtol 1e-4 / atol 1e-5 of float64 (the CPU gradient tests' tolerance), bf16
within 0.02 of the largest entry (0.03 in the interpreter, which truncates fp32 -> bf16). Controls
show that the check fails when the routing-weight factor is dropped or the clamp's gradient mask is
ignored.
"""
import pytest
import torch

import bitmatch.kernels as K
from bitmatch.kernels import moe as M

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

F32, BF = torch.float32, torch.bfloat16
H, I = 40, 24                                           # neither a multiple of the 16-wide tiles
CFG = ((16, 16, 16, 4, 3), (16, 16, 16, 4, 3))          # small tiles: many tiles, masked tails
FWD_CFG = (16, 16, 16, 16, 4, 3)                        # the forward's (BM, BN_in, BN_out, BK, warps, stages)
NAMES = ("dx", "d_weights", "d_w_in", "d_w_out")


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _case(activation, E, k, T=13, dtype=F32, seed=0, logits=None):
    n_in = 2 * I if activation == "swiglu" else I
    x = torch.randn(T, H, generator=_g(seed)).to(dtype)
    w_in = (torch.randn(E, n_in, H, generator=_g(seed + 1)) * 0.2).to(dtype)
    w_out = (torch.randn(E, H, I, generator=_g(seed + 2)) * 0.2).to(dtype)
    z = torch.randn(T, E, generator=_g(seed + 3)) if logits is None else logits
    w, ids = K.moe_route(z, k, renormalize=True)
    g = torch.randn(T, H, generator=_g(seed + 4)).to(dtype)
    return x, ids, w, w_in, w_out, g


def _plain64(x, w, w_in, w_out, ids, activation, limit):
    """The layer's math in float64, dense over (token, rank): no sorting, no kernels."""
    h = torch.einsum("th,tknh->tkn", x, w_in[ids])
    if activation == "relu2":
        a = torch.relu(h) ** 2
    else:
        gate, up = h.chunk(2, -1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        a = torch.nn.functional.silu(gate) * up
    return (w.unsqueeze(-1) * torch.einsum("tki,tkhi->tkh", a, w_out[ids])).sum(1)


def _grads64(x, ids, w, w_in, w_out, g, activation, limit):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, w_in, w_out)]
    (_plain64(leaves[0], leaves[1], leaves[2], leaves[3], ids, activation, limit) * g.double()).sum().backward()
    return [t.grad for t in leaves]


def _assert_close(got, want, dtype, bf16_tol=0.02):
    for name, a, b in zip(NAMES, got, want):
        assert a is not None and a.shape == b.shape, name
        assert a.dtype == (F32 if name == "d_weights" else dtype), name
        err = (a.double() - b).abs()
        if dtype == F32:
            ok = bool((err <= 1e-5 + 1e-4 * b.abs()).all())
        else:
            ok = float(err.max()) <= bf16_tol * float(b.abs().max())
        assert ok, f"{name}: max |diff| {float(err.max()):.3g} at {divmod(int(err.argmax()), b.shape[-1])}"


def _triton_bwd(x, ids, w, w_in, w_out, g, activation, limit, config=CFG, kept=None):
    from bitmatch.kernels.triton.moe_bwd import moe_experts_backward
    return moe_experts_backward(g, x, ids, w, w_in, w_out, activation, limit, config=config, kept=kept)


def _saved_h(x, ids, w, w_in, w_out, activation, limit):
    """(out, Kept) of the Triton forward asked to keep the pre-activations, and its plain out."""
    from bitmatch.kernels.triton.moe import moe_experts
    kept = moe_experts(x, ids, w, w_in, w_out, activation, limit, config=FWD_CFG, keep_h=True)
    plain = moe_experts(x, ids, w, w_in, w_out, activation, limit, config=FWD_CFG)
    return kept, plain


CASES = [("swiglu", None, 4, 1), ("swiglu", None, 8, 2), ("swiglu", 0.3, 16, 4), ("swiglu", 0.3, 4, 2),
         ("relu2", None, 8, 4), ("relu2", None, 16, 1)]


@pytest.mark.parametrize("activation,limit,E,k", CASES)
def test_triton_backward_matches_float64(activation, limit, E, k):
    case = _case(activation, E, k, seed=E + k)
    _assert_close(_triton_bwd(*case, activation, limit), _grads64(*case, activation, limit), F32)


@pytest.mark.parametrize("activation,limit,E,k", CASES)
def test_triton_backward_from_saved_h_matches_float64(activation, limit, E, k):
    """The backward reading what the forward kept (what autograd does): the pre-activations h
    instead of recomputing x W_in, and the forward's sort: the same gradients within the same
    tolerance; keeping them does not change the forward's output bits (one kernel, a runtime
    flag), h is the rounded x W_in and the sort is a fresh one's."""
    x, ids, w, w_in, w_out, g = _case(activation, E, k, seed=E + k)
    (out, kept), plain = _saved_h(x, ids, w, w_in, w_out, activation, limit)
    assert torch.equal(out, plain)
    order = torch.sort(ids.reshape(-1), stable=True).indices
    assert torch.equal(kept.order, order) and torch.equal(kept.tok, order // k)
    assert torch.equal(kept.counts, torch.bincount(ids.reshape(-1), minlength=E))
    tok, eid = order // k, ids.reshape(-1)[order]
    h64 = torch.einsum("sh,snh->sn", x[tok].double(), w_in[eid].double())
    torch.testing.assert_close(kept.h.double(), h64, rtol=1e-5, atol=1e-5)
    want = _grads64(x, ids, w, w_in, w_out, g, activation, limit)
    _assert_close(_triton_bwd(x, ids, w, w_in, w_out, g, activation, limit, kept=kept), want, F32)


def test_control_a_wrong_saved_h_fails():
    """The backward reads h: a perturbed h moves the gradients past the tolerance."""
    x, ids, w, w_in, w_out, g = _case("relu2", 8, 2, seed=10)
    (_, kept), _ = _saved_h(x, ids, w, w_in, w_out, "relu2", None)
    with pytest.raises(AssertionError):
        _assert_close(_triton_bwd(x, ids, w, w_in, w_out, g, "relu2", None, kept=kept._replace(h=kept.h * 1.01)),
                      _grads64(x, ids, w, w_in, w_out, g, "relu2", None), F32)


@pytest.mark.parametrize("activation,limit,E,k", CASES[1:3] + CASES[4:5])
def test_reference_backward_matches_float64(activation, limit, E, k):
    """The CPU backward, through moe_experts' autograd on the reference backend."""
    x, ids, w, w_in, w_out, g = _case(activation, E, k, seed=E + k)
    leaves = [t.clone().requires_grad_() for t in (x, w, w_in, w_out)]
    out = K.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], activation=activation, swiglu_limit=limit)
    (out * g).sum().backward()
    _assert_close([t.grad for t in leaves], _grads64(x, ids, w, w_in, w_out, g, activation, limit), F32)


@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu", 0.3), ("relu2", None)])
def test_bf16_backward_close_to_float64(activation, limit):
    case = _case(activation, 8, 2, T=21, dtype=BF, seed=5)
    want = _grads64(*case, activation, limit)
    _assert_close(M.experts_backward_reference(case[-1], *case[:-1], activation, limit), want, BF)
    if limit is None:
        # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): 0.03 as the forward's
        # interpreter tests; with a clamp, truncation moves h across the limit and flips the
        # clamp's gradient mask (a CPU emulation of the truncation gives the same 0.13 error)
        _assert_close(_triton_bwd(*case, activation, limit), want, BF, bf16_tol=0.03)


def test_zero_token_experts_and_ties():
    """16 experts, 3 tokens: most experts get nothing and must get exact-zero gradients. Tied
    logits route to the lowest indices (rows 0 and 1: experts 0 and 1; row 2: a duplicated column)."""
    z = torch.randn(3, 16, generator=_g(9))
    z[:2] = 0.25
    z[2, 11] = z[2, 7] = z[2].max() + 1
    case = _case("swiglu", 16, 2, T=3, seed=9, logits=z)
    ids = case[1]
    assert ids[:2].tolist() == [[0, 1], [0, 1]] and ids[2].tolist() == [7, 11]
    want = _grads64(*case, "swiglu", 0.3)
    idle = torch.ones(16, dtype=torch.bool)
    idle[ids.reshape(-1)] = False
    for got in (_triton_bwd(*case, "swiglu", 0.3), M.experts_backward_reference(case[-1], *case[:-1], "swiglu", 0.3)):
        _assert_close(got, want, F32)
        assert not got[2][idle].any() and not got[3][idle].any()
        assert got[2][~idle].abs().sum(dim=(1, 2)).min() > 0


def test_autograd_runs_the_triton_backward():
    """moe_experts on the Triton backend: autograd calls moe_bwd (same bits as calling it), returns
    None for inputs that need no gradient, and repeats bit for bit (no atomics)."""
    x, ids, w, w_in, w_out, g = _case("relu2", 4, 2, T=9, seed=11)
    xl, wl = x.clone().requires_grad_(), w_in.clone().requires_grad_()
    with K.use_backend("triton"):
        out = K.moe_experts(xl, ids, w, wl, w_out, activation="relu2")
    (out * g).sum().backward()
    direct = _triton_bwd(x, ids, w, w_in, w_out, g, "relu2", None, config=None)
    assert torch.equal(xl.grad, direct[0]) and torch.equal(wl.grad, direct[2])
    again = _triton_bwd(x, ids, w, w_in, w_out, g, "relu2", None, config=None)
    assert all(torch.equal(a, b) for a, b in zip(direct, again))


def test_no_tokens():
    x, ids, w, w_in, w_out, g = _case("swiglu", 4, 2, T=0)
    got = _triton_bwd(x, ids, w, w_in, w_out, g, "swiglu", None)
    assert [t.shape for t in got] == [x.shape, w.shape, w_in.shape, w_out.shape]
    assert not any(t.any() for t in got)


def test_controls_the_check_can_fail():
    """Dropping the routing-weight factor, or ignoring the clamp's gradient mask, fails the check."""
    case = _case("swiglu", 8, 2, seed=3)
    x, ids, w, w_in, w_out, g = case
    with pytest.raises(AssertionError, match="dx"):
        _assert_close(_triton_bwd(x, ids, torch.ones_like(w), w_in, w_out, g, "swiglu", None),
                      _grads64(*case, "swiglu", None), F32)
    with pytest.raises(AssertionError):                 # the clamp's forward kept, its mask lost
        _assert_close(_triton_bwd(*case, "swiglu", None), _grads64(*case, "swiglu", 0.3), F32)
