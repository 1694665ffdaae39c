"""moe_route, moe_experts and moe_combine: a mixture-of-experts layer whose per-token bits never
depend on the batch (dropless, no capacity factor, no atomics). moe_combine is moe_experts' last
step on its own (expert parallelism computes the rows on the experts' ranks and combines here).

Canonical order (what fixes the bits):
- moe_route: fp32 scores per row (softmax | sigmoid | sqrtsoftplus); experts ranked by
  (selection score desc, expert index asc), so ties go to the LOWEST expert index; weights are
  the unbiased scores of the chosen experts; with ``renormalize`` divided by
  (their fp32 sum taken in rank order + 1e-20, as DeepSeek-V4 / Nemotron-H do; the 1e-20 is a
  no-op for softmax scores), then times ``scaling``.
- moe_experts: for each (token t, rank r), e = ids[t, r]: h = linear(x_t, w_in[e]) (one row of
  ``kernels.linear``: its K order, rounded to x.dtype), a = act(h) (HF's rounding points),
  y = linear(a, w_out[e]) in x.dtype; out_t = round(sum over r = 0..k-1 IN RANK ORDER of
  fp32(w[t, r]) * fp32(y[t, r])), each product rounded to fp32, then added, from 0.0.
Reference (CPU): ``linear_reference`` on each expert's gathered rows (row-invariant, so a row's
bits do not depend on how many rows its expert got), exact exp/log from ``_exact`` for the
scores, an elementwise fp32 loop over ranks for the combine.
Triton (CUDA): kernels/triton/moe.py: one routing program per token, a grouped GEMM over
tokens sorted by expert with the same K order as kernels/triton/linear.py, a rank-order combine.
Backward (gradients are held to float64 within tolerance, not to bits): Triton grouped GEMMs over
the same sorted rows (kernels/triton/moe_bwd.py); on CPU, experts_backward_reference (fp32 torch,
one matmul per routed expert into its slice of each gradient).
"""
from __future__ import annotations

import torch

from . import _exact, stock
from ._backend import (
    backend_for,
    check_float,
    check_in_range,
    check_int,
    check_same_device,
    host_readable,
    needs_autograd,
    recompute_grads,
    triton_impl,
)
from .activation import silu_and_mul_reference
from .linear import linear_reference

F64 = torch.float64
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
ACTIVATIONS = ("swiglu", "relu2")
RENORM_EPS = 1e-20
_SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus returns x above it (HF calls it)


# ---------------------------------------------------------------- routing
def scores_reference(logits, scoring):
    """fp32 [T, E] scores, each row from that row alone (exact exp/log, fixed-tree sums)."""
    z = logits.to(F64)
    if scoring == "softmax":
        e = _exact.exp64(z - z.amax(-1, keepdim=True))
        return (e / _exact.tree_sum(e, -1).unsqueeze(-1)).float()
    if scoring == "sigmoid":
        return (1.0 / (1.0 + _exact.exp64(-z))).float()
    # sqrtsoftplus (DeepSeek-V4): sqrt(softplus(x)), softplus rounded to fp32 first as HF does
    sp = torch.where(z > _SOFTPLUS_THRESHOLD, z, _exact.log1p64(_exact.exp64(z.clamp(max=_SOFTPLUS_THRESHOLD))))
    return sp.float().sqrt()


# the differentiable fp32 scores the backward recomputes: the stock router's (one definition)
_scores_plain = stock.moe_scores


def _finish_weights(w, renormalize, scaling):
    """Rank-order fp32 sum, divide, scale: the same steps on every backend and in backward."""
    if renormalize:
        s = w[:, 0]
        for r in range(1, w.shape[1]):
            s = s + w[:, r]
        w = w / (s + RENORM_EPS).unsqueeze(1)
    return w * scaling


def route_reference(logits, bias, top_k, scoring, renormalize, scaling):
    scores = scores_reference(logits, scoring)
    sel = scores if bias is None else scores + bias
    # a stable descending sort keeps equal scores in index order: lowest index wins a tie
    ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()
    return _finish_weights(scores.gather(1, ids), renormalize, scaling), ids


class RouteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, scoring, renormalize, scaling):
        if backend_for(logits) == "reference":
            w, ids = route_reference(logits, bias, top_k, scoring, renormalize, scaling)
        else:
            w, ids = triton_impl("moe", "moe_route")(logits, bias, top_k, scoring, renormalize, scaling)
        ctx.save_for_backward(logits, ids)
        ctx.cfg = (scoring, renormalize, scaling)
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, gw, _gids):
        logits, ids = ctx.saved_tensors
        scoring, renormalize, scaling = ctx.cfg

        def plain(z):  # the selection is piecewise constant: gradients flow through the weights
            w = _scores_plain(z, scoring).gather(1, ids)
            if renormalize:  # one sum, not the forward's rank-order fold: a gradient, not bits
                w = w / (w.sum(1, keepdim=True) + RENORM_EPS)
            return w * scaling
        (gl,) = recompute_grads(plain, (logits,), ctx.needs_input_grad[:1], (gw,))
        return gl, None, None, None, None, None


def moe_route(router_logits, top_k, *, scoring="softmax", renormalize=False, correction_bias=None,
              scaling=1.0):
    """router_logits fp32 [T, E] (bf16 is upcast exactly) -> (weights fp32 [T, k], ids int64
    [T, k]), ids in rank order: selection score desc, then expert index asc (ties: lowest index).

    ``correction_bias`` [E] is added to the scores for the selection only (DeepSeek-V3/V4,
    Nemotron-H); weights are the unbiased scores, renormalized over the k chosen (``renormalize``,
    HF's norm_topk_prob) and times ``scaling`` (routed_scaling_factor). Autograd: weights -> logits.

    Invariance: each token's ids and weights depend only on its own logits row and the bias.
    """
    op = "moe_route"
    check_float("router_logits", router_logits, op)
    if router_logits.dim() != 2:
        raise ValueError(f"{op}: router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    n_exp = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_exp:
        raise ValueError(f"{op}: top_k must be an int in [1, E={n_exp}], got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"{op}: scoring must be one of {SCORINGS}, got {scoring!r}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise ValueError(f"{op}: scaling must be a float (routed_scaling_factor), got {scaling!r}")
    bias = None
    if correction_bias is not None:
        check_float("correction_bias", correction_bias, op)
        if correction_bias.shape != (n_exp,):
            raise ValueError(f"{op}: correction_bias must have shape ({n_exp},), got {tuple(correction_bias.shape)}")
        check_same_device(op, router_logits=router_logits, correction_bias=correction_bias)
        bias = correction_bias.detach().float().contiguous()
    return RouteFunction.apply(router_logits.float().contiguous(), bias, top_k, scoring,
                               bool(renormalize), float(scaling))


class _ElementwiseScores(torch.autograd.Function):
    """sigmoid / sqrtsoftplus scores of every expert on CUDA: elementwise fp32 torch ops (one value
    per element, whatever the launch), the gradient through the same formula."""

    @staticmethod
    def forward(ctx, logits, scoring):
        ctx.save_for_backward(logits)
        ctx.scoring = scoring
        return _scores_plain(logits, scoring)

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved_tensors
        return recompute_grads(lambda z: _scores_plain(z, ctx.scoring), (logits,), (True,), (g,))[0], None


def moe_scores(router_logits, scoring="softmax"):
    """router_logits [T, E] -> every expert's fp32 score [T, E], in expert order (hash routing,
    which picks experts by token id, needs them all). The bits of ``moe_route``'s weights: on the
    reference backend and for softmax, ``moe_route`` with k = E, scattered back to expert order (exact
    copies); on Triton, sigmoid and sqrtsoftplus are elementwise fp32 torch ops (one value per
    element whatever the launch; ``moe_route`` with k = E would unroll E selection steps).
    Autograd: scores -> logits. Invariance: each row from its own logits row."""
    op = "moe_scores"
    check_float("router_logits", router_logits, op)
    if router_logits.dim() != 2:
        raise ValueError(f"{op}: router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    if scoring not in SCORINGS:
        raise ValueError(f"{op}: scoring must be one of {SCORINGS}, got {scoring!r}")
    logits = router_logits.float().contiguous()
    if backend_for(logits) == "reference" or scoring == "softmax":
        s, order = moe_route(logits, logits.shape[1], scoring=scoring)
        return torch.zeros_like(s).scatter(1, order, s)
    return _ElementwiseScores.apply(logits, scoring)


# ---------------------------------------------------------------- experts
def _clamp_swiglu(gate, up, limit):
    # DeepSeek-V4 (HF DeepseekV4Experts._apply_gate): the same torch clamps on x.dtype values
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def activation_reference(h, activation, limit):
    """a = act(h) on x.dtype rows with HF's rounding points (elementwise, exact in float64)."""
    if activation == "relu2":
        r = torch.relu(h).to(F64)
        return (r * r).to(h.dtype)  # HF: torch.square(relu(h)) in h.dtype, one rounding
    if limit is not None:
        i = h.shape[-1] // 2
        h = torch.cat(_clamp_swiglu(h[:, :i], h[:, i:], limit), dim=-1)
    return silu_and_mul_reference(h)


def combine_reference(y, weights):
    """y [T, k, H] in x.dtype -> round(sum_r fp32(w[t, r]) * fp32(y[t, r])), rank order."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32)
    for r in range(y.shape[1]):
        acc = acc + weights[:, r:r + 1] * y[:, r].float()  # two IEEE ops: no fused multiply-add
    return acc.to(y.dtype)


def experts_reference(x, ids, weights, w_in, w_out, activation, limit):
    T, H = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1)
    y = x.new_zeros(T * k, H)
    for e in torch.unique(flat).tolist():
        pos = (flat == e).nonzero().squeeze(1)
        # row-invariant linear: these rows' bits do not depend on how many rows expert e got
        a = activation_reference(linear_reference(x[pos // k], w_in[e], None), activation, limit)
        y[pos] = linear_reference(a, w_out[e], None)
    return combine_reference(y.view(T, k, H), weights)


def activation_backward(h, da, activation, limit, dtype):
    """(a, dL/dh) in fp32 from fp32 h and dL/da, with the forward's rounding points to ``dtype``
    (the same steps as kernels/triton/moe_bwd.py _act_bwd_kernel)."""
    def rnd(t):
        return t.to(dtype).float()
    if activation == "relu2":
        r = torch.relu(rnd(h))
        return rnd(r * r), 2.0 * da * r
    gate, up = rnd(h).chunk(2, dim=-1)
    if limit is not None:  # torch.clamp's gradient passes on the closed range
        g_in, u_in = gate <= limit, (up >= -limit) & (up <= limit)
        gate, up = (rnd(t) for t in _clamp_swiglu(gate, up, limit))
    sg = torch.sigmoid(gate)
    sl = rnd(gate * sg)
    dg, du = da * up * sg * (1.0 + gate * (1.0 - sg)), da * sl
    if limit is not None:
        dg, du = torch.where(g_in, dg, 0.0), torch.where(u_in, du, 0.0)
    return rnd(sl * up), torch.cat([dg, du], dim=-1)


def experts_backward_reference(g, x, ids, weights, w_in, w_out, activation, limit):
    """Gradients (dx, d weights, d w_in, d w_out) of moe_experts in fp32 torch (the CPU backward):
    rows sorted by expert, one matmul per routed expert into its slice of each gradient. With
    G = g_t W_out[e]: d weights[t, r] = <G, a> (= <g_t, y[t, r]>), dA = w[t, r] G,
    dW_out[e] = g^T (w a), dW_in[e] = dH^T x, dx = the sum over ranks of dH W_in[e].

    Invariance: none promised (gradients are held to float64 within tolerance, not to bits).
    """
    T, H = x.shape
    k = ids.shape[1]
    dt = x.dtype
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    tok = order // k
    xs, gs = x[tok].float(), g[tok].float()
    ws = weights.reshape(-1)[order].float().unsqueeze(1)
    d_in, d_out = torch.zeros_like(w_in), torch.zeros_like(w_out)  # experts with no rows: zero
    dxs = torch.empty(flat.numel(), H, dtype=torch.float32, device=x.device)
    dws = torch.empty(flat.numel(), dtype=torch.float32, device=x.device)
    bounds = torch.cumsum(torch.bincount(flat, minlength=w_in.shape[0]), 0).tolist()
    for e, (lo, hi) in enumerate(zip([0] + bounds[:-1], bounds)):
        if lo == hi:
            continue
        win, wout = w_in[e].float(), w_out[e].float()
        G = gs[lo:hi] @ wout
        a, dh = activation_backward(xs[lo:hi] @ win.t(), G * ws[lo:hi], activation, limit, dt)
        dws[lo:hi] = (G * a).sum(1)
        d_out[e] = gs[lo:hi].t() @ (a * ws[lo:hi])
        d_in[e] = dh.t() @ xs[lo:hi]
        dxs[lo:hi] = dh @ win
    dx = torch.empty_like(dxs).index_copy_(0, order, dxs).view(T, k, H).sum(1).to(dt)
    return dx, torch.empty_like(dws).index_copy_(0, order, dws).view(T, k), d_in, d_out


class ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, w_in, w_out, ids, activation, limit):
        ctx.save_for_backward(x, weights, w_in, w_out, ids)
        ctx.cfg = (activation, limit)
        # the backward thread does not see use_backend: keep the forward's choice
        ctx.backend = backend_for(x)
        if ctx.backend == "reference":
            ctx.kept = None
            return experts_reference(x, ids, weights, w_in, w_out, activation, limit)
        # with a backward to come, the pre-activations too (same forward bits, one kernel binary):
        # the backward then skips recomputing x W_in
        keep = any(ctx.needs_input_grad[:4])
        res = triton_impl("moe", "moe_experts")(x, ids, weights, w_in, w_out, activation, limit, keep_h=keep)
        out, ctx.kept = res if keep else (res, None)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weights, w_in, w_out, ids = ctx.saved_tensors
        activation, limit = ctx.cfg
        needs = tuple(ctx.needs_input_grad[:4])
        if ctx.backend == "reference":
            grads = experts_backward_reference(g.to(x.dtype), x, ids, weights, w_in, w_out, activation, limit)
        else:
            grads = triton_impl("moe_bwd", "moe_experts_backward")(
                g.to(x.dtype).contiguous(), x, ids, weights, w_in, w_out, activation, limit, needs, kept=ctx.kept)
            ctx.kept = None
        return (*(gr if n else None for gr, n in zip(grads, needs)), None, None, None)


def _check_experts(op, x, ids, weights, w_in, w_out, activation, swiglu_limit):
    check_float("x", x, op)
    check_float("weights", weights, op)
    check_float("w_in", w_in, op)
    check_float("w_out", w_out, op)
    check_int("ids", ids, op)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if ids.dim() != 2 or ids.shape[0] != T:
        raise ValueError(f"{op}: ids must be [T={T}, k], got shape {tuple(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"{op}: weights must have ids' shape {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if w_in.dim() != 3 or w_in.shape[2] != H:
        raise ValueError(f"{op}: w_in must be [E, N_in, H={H}], got shape {tuple(w_in.shape)}")
    E, n_in = w_in.shape[:2]
    inter = n_in // 2 if activation == "swiglu" else n_in
    if activation == "swiglu" and n_in % 2:
        raise ValueError(f"{op}: swiglu needs w_in = [E, 2I, H] (gate rows, then up rows); N_in={n_in} is odd")
    if w_out.shape != (E, H, inter):
        raise ValueError(f"{op}: w_out must be [E={E}, H={H}, I={inter}] for {activation}, got {tuple(w_out.shape)}")
    if w_in.dtype != x.dtype or w_out.dtype != x.dtype:
        raise ValueError(f"{op}: w_in ({w_in.dtype}) and w_out ({w_out.dtype}) must have x's dtype "
                         f"{x.dtype}; cast the expert weights to the compute dtype")
    if swiglu_limit is not None and (activation != "swiglu" or not float(swiglu_limit) > 0):
        raise ValueError(f"{op}: swiglu_limit must be a positive float with activation='swiglu', got {swiglu_limit!r}")
    check_same_device(op, x=x, ids=ids, weights=weights, w_in=w_in, w_out=w_out)
    if not ids.numel():
        return
    if host_readable(ids):
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= E:
            raise ValueError(f"{op}: ids out of range [0, E={E}): found {lo if lo < 0 else hi}")
    else:  # checked on the device: a host round trip per layer would stall every launch behind it
        check_in_range(ids, 0, E, f"{op}: ids out of range [0, E={E})")


def moe_experts(x, ids, weights, w_in, w_out, *, activation="swiglu", swiglu_limit=None):
    """x [T, H] (bf16|fp32), ids int64 [T, k], weights fp32 [T, k] (bf16 upcast exactly),
    w_in [E, N_in, H], w_out [E, H, I] -> [T, H] in x.dtype.

    activation "swiglu": w_in = gate rows then up rows (HF gate_up_proj, N_in = 2I),
    a = silu(gate) * up as ``silu_and_mul`` rounds it (with DeepSeek-V4's clamps when
    ``swiglu_limit`` is given); "relu2": w_in = up_proj (N_in = I), a = relu(h)^2 (Nemotron-H).
    Output: the rank-order fp32 sum of weights * expert outputs, rounded once. Dropless.

    Invariance: each token's output bits depend only on its own x row, ids, weights and the
    expert weights: never on T, the other tokens, their order, or how many tokens each expert
    received (experts with zero tokens included).
    """
    op = "moe_experts"
    _check_experts(op, x, ids, weights, w_in, w_out, activation, swiglu_limit)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    return ExpertsFunction.apply(x.contiguous(), weights.float().contiguous(), w_in.contiguous(),
                                 w_out.contiguous(), ids.long().contiguous(), activation, limit)


class CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights):
        ctx.save_for_backward(y, weights)
        return _combine_forward(y, weights)

    @staticmethod
    def backward(ctx, g):
        y, weights = ctx.saved_tensors
        return tuple(recompute_grads(lambda a, b: (b.unsqueeze(-1) * a.float()).sum(1).to(a.dtype), (y, weights),
                                     ctx.needs_input_grad, (g,)))


def moe_combine(y, weights):
    """y [T, k, H] (bf16|fp32: each (token, rank) row's expert output, as moe_experts computes it),
    weights fp32 [T, k] -> [T, H] in y's dtype: moe_experts' combine on its own (for expert
    parallelism: the (token, rank) rows come from the experts' ranks, the combine runs on the
    token's rank). out_t = round(sum over r = 0..k-1 in rank order of fp32(w[t, r]) * fp32(y[t, r])),
    each product rounded to fp32, then added, from 0.0.

    Invariance: each token's bits depend only on its own rows of y and weights.
    """
    op = "moe_combine"
    check_float("y", y, op)
    if y.dim() != 3:
        raise ValueError(f"{op}: y must be [T, k, H], got shape {tuple(y.shape)}")
    if weights.shape != y.shape[:2]:
        raise ValueError(f"{op}: weights must be [T, k] = {tuple(y.shape[:2])}, got {tuple(weights.shape)}")
    check_same_device(op, y=y, weights=weights)
    y, weights = y.contiguous(), weights.float().contiguous()
    if needs_autograd(y, weights):
        return CombineFunction.apply(y, weights)
    return _combine_forward(y, weights)


def _combine_forward(y, weights):
    if backend_for(y) == "reference":
        return combine_reference(y, weights)
    return triton_impl("moe", "moe_combine")(y, weights)
