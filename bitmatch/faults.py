"""Planted faults for ``bitmatch locate --inject`` (demos and tests): a perturbed weight, a stock
(non-invariant) torch version of one kernel, the other temperature formula. Each is applied to one
side of a pair only and undone afterwards."""
from __future__ import annotations

import contextlib

import torch


def _stock_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _stock_rotary(q, k, cos, sin):
    c, s = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]

    def rot(x):
        h = x.shape[-1] // 2
        return x * c.to(x.dtype) + torch.cat([-x[..., h:], x[..., :h]], -1) * s.to(x.dtype)
    return rot(q), rot(k)


def _stock_moe_route(logits, top_k, *, scoring="softmax", renormalize=False, correction_bias=None, scaling=1.0):
    from bitmatch.kernels.moe import _scores_plain
    p = _scores_plain(logits, scoring)
    _, ids = torch.topk(p if correction_bias is None else p + correction_bias, top_k, dim=-1)
    w = p.gather(1, ids)
    return (w / w.sum(-1, keepdim=True) if renormalize else w) * scaling, ids


def _stock_moe_experts(x, ids, weights, w_in, w_out, *, activation="swiglu", swiglu_limit=None):
    """HF's loop: each hit expert's rows, ``index_add_`` in expert order (in x.dtype)."""
    import torch.nn.functional as F
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, r = torch.where(ids == e)
        h = F.linear(x[tok], w_in[e])
        if activation == "swiglu":
            g, u = h.chunk(2, -1)
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
            a = F.silu(g) * u
        else:
            a = torch.relu(h).square()
        out.index_add_(0, tok, (F.linear(a, w_out[e]) * weights[tok, r, None].to(x.dtype)).to(x.dtype))
    return out


def stock_kernels() -> dict:
    """{op: a stock torch version with the same signature}: what ``--inject kernel:OP`` swaps in
    (HF's formulas, torch's reduction orders; they agree with bitmatch's ops to rounding)."""
    import torch.nn.functional as F

    from bitmatch import testing as T

    def temp_col(t):
        return t.reshape(-1, 1) if isinstance(t, torch.Tensor) else t
    return {
        "linear": lambda x, w, b=None: F.linear(x, w, b),
        "rms_norm": _stock_rms_norm,
        "fused_add_rms_norm": lambda x, r, w, eps: (_stock_rms_norm(x + r, w, eps), x + r),
        "silu_and_mul": lambda x: F.silu(x[..., :x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:],
        "apply_rotary": _stock_rotary,
        "attention_prefill": lambda q, k, v, cu, scale, causal=True, sliding_window=None:
            T.stock_sdpa_prefill(q, k, v, cu, scale, sliding_window),
        "attention_paged": lambda q, kc, vc, bt, qsl, lens, scale, sliding_window=None:
            T.stock_sdpa_paged(q, kc, vc, bt, qsl, lens, scale, sliding_window),
        "token_logprobs": lambda x, tok, temperature=1.0: torch.log_softmax(
            x.float() / temp_col(temperature), -1).gather(1, tok.long()[:, None])[:, 0],
        "moe_route": _stock_moe_route,
        "moe_experts": _stock_moe_experts,
    }


def parse_inject(spec: str | None):
    """``weight:LAYER.PARAM`` | ``kernel:OP`` | ``temperature`` -> (kind, arg); ValueError otherwise."""
    if spec is None:
        return None
    kind, _, arg = spec.partition(":")
    if kind == "temperature" and not arg:
        return ("temperature", None)
    if kind == "kernel" and arg in stock_kernels():
        return ("kernel", arg)
    if kind == "weight" and arg:
        return ("weight", arg)
    raise ValueError(f"locate: --inject must be weight:LAYER.PARAM (e.g. weight:1.mlp.down_proj), kernel:OP "
                     f"(OP one of {', '.join(stock_kernels())}) or temperature; got {spec!r}")


def perturb_weight(model, target: str):
    """A deep copy of ``model`` whose parameter ``target`` ("1.mlp.down_proj" = layer 1's
    module or parameter; "lm_head", "model.norm" outside the layers) is scaled by 1 + 2^-5
    (every nonzero element changes its bits in bf16 and fp32)."""
    import copy

    from bitmatch.models import unwrap_causal_lm

    m = copy.deepcopy(model)
    lm = unwrap_causal_lm(m)
    head, _, rest = target.partition(".")
    paths = [f"model.layers.{head}.{rest}"] if head.isdigit() else [target, f"model.{target}"]
    for path in paths:
        for cand in (path, path + ".weight"):
            try:
                p = lm.get_parameter(cand)
            except AttributeError:
                continue
            with torch.no_grad():
                p.mul_(1 + 2 ** -5)
            return m
    raise ValueError(f"locate: --inject weight:{target}: no parameter {' or '.join(paths)}[.weight] in "
                     f"{type(lm).__name__}")


@contextlib.contextmanager
def kernel_fault(op: str | None):
    """Inside the block ``bitmatch.kernels.<op>`` is the stock torch version (``stock_kernels``)."""
    import bitmatch.kernels as K
    if op is None:
        yield
        return
    orig = getattr(K, op)
    setattr(K, op, stock_kernels()[op])
    try:
        yield
    finally:
        setattr(K, op, orig)


@contextlib.contextmanager
def _engine_temperature_fault(on: bool):
    """The engine's reported logprobs from logits * (1/T) instead of logits / T."""
    import bitmatch.engine.sampling as S
    if not on:
        yield
        return
    orig = S._token_logprobs
    S._token_logprobs = lambda logits, tokens, temps: orig(logits.float() * (1.0 / temps)[:, None], tokens,
                                                           torch.ones_like(temps))
    try:
        yield
    finally:
        S._token_logprobs = orig
