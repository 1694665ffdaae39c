"""token_logprobs / full_logprobs: log_softmax(logits.float() / T) over the full vocabulary.

The temperature divides fp32 logits (as vLLM's sampler does; multiplying by 1/T gives other
bits). Reference: max (exact), exp64, tree_sum over the vocabulary and log64, so a row's
bits depend on that row alone. On the GPU (Triton) the bits also depend on the logits' storage
dtype: the row's sum of exponentials is combined in the layout of the kernel's loads, whose width
follows the element size, so bf16 logits and an fp32 copy of them may differ in the last bit of
the log-sum-exp. Callers hand the logits over in the compute dtype the head produced them in
(trainer, engine and vLLM plugin alike).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, check_int, check_on_device, host_readable, recompute_grads, triton_impl

F64 = torch.float64
_ROW_CHUNK = 16


def scaled_logits(logits2d, temp):
    """fp32 logits / T, T per row: the one temperature formula of every logprob path (a division,
    never logits * (1/T), whose bits differ)."""
    return logits2d.float() / temp.unsqueeze(1)


def _row_stats(z):
    z64 = z.to(F64)
    m = z64.amax(-1, keepdim=True)
    lse = _exact.log64(_exact.tree_sum(_exact.exp64(z64 - m), -1)).unsqueeze(-1)
    return z64, m, lse


def token_logprobs_reference(logits2d, token_ids, temp):
    out = []
    for s in range(0, logits2d.shape[0], _ROW_CHUNK):
        z64, m, lse = _row_stats(scaled_logits(logits2d[s:s + _ROW_CHUNK], temp[s:s + _ROW_CHUNK]))
        tok = z64.gather(1, token_ids[s:s + _ROW_CHUNK].long().unsqueeze(1))
        out.append(((tok - m) - lse).squeeze(1).float())
    return torch.cat(out) if out else logits2d.new_empty(0, dtype=torch.float32)


def full_logprobs_reference(logits2d, temp):
    out = []
    for s in range(0, logits2d.shape[0], _ROW_CHUNK):
        z64, m, lse = _row_stats(scaled_logits(logits2d[s:s + _ROW_CHUNK], temp[s:s + _ROW_CHUNK]))
        out.append(((z64 - m) - lse).float())
    return torch.cat(out) if out else logits2d.new_empty(0, logits2d.shape[1], dtype=torch.float32)


class TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, token_ids, temp):
        ctx.backend = backend_for(logits2d)
        if ctx.backend == "reference":
            ctx.save_for_backward(logits2d, token_ids, temp)
            return token_logprobs_reference(logits2d, token_ids, temp)
        out, lse = triton_impl("logprobs", "token_logprobs")(logits2d, token_ids, temp, return_lse=True)
        ctx.save_for_backward(logits2d, token_ids, temp, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if ctx.backend == "triton":  # one pass over the logits from the forward's lse
            logits2d, token_ids, temp, lse = ctx.saved_tensors
            return triton_impl("logprobs", "token_logprobs_backward")(logits2d, token_ids, temp,
                                                                      lse, g), None, None
        logits2d, token_ids, temp = ctx.saved_tensors

        def plain(x):
            lp = torch.log_softmax(scaled_logits(x, temp), -1)
            return lp.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
        (gl,) = recompute_grads(plain, (logits2d,), ctx.needs_input_grad[:1], (g,))
        return gl, None, None


def check_logprob_args(op, logits, temperature, token_ids=None):
    """The fp32 [N] temperatures, after the range checks of temperature and token_ids: in one
    host read where the values are on the host (``host_readable``), on the device otherwise
    (no host sync: the trainer runs this once per logits chunk, forward and recompute)."""
    check_float("logits", logits, op)
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be [N, V], got shape {tuple(logits.shape)}")
    n, V = logits.shape
    bad_temp = f"{op}: temperature must be > 0 (greedy decoding reports logprobs at T=1.0)"
    bad_ids = f"{op}: token_ids out of range [0, {V})"
    host = host_readable(logits)
    stats = []
    if isinstance(temperature, torch.Tensor):
        temp = temperature.to(device=logits.device, dtype=torch.float32).reshape(-1)
        if temp.numel() == 1:
            temp = temp.expand(n).contiguous()
        if temp.shape != (n,):
            raise ValueError(f"{op}: temperature must be a float or [N={n}] tensor")
        if n and host:
            stats.append(temp.min().double())
        elif n:
            check_on_device(temp.min() > 0, bad_temp)
    else:
        if not float(temperature) > 0:
            raise ValueError(bad_temp)
        temp = torch.full((n,), float(temperature), dtype=torch.float32, device=logits.device)
    if token_ids is not None and token_ids.numel():
        lo, hi = torch.aminmax(token_ids.to(logits.device))
        if host:
            stats += [lo.double(), hi.double()]
        else:
            check_on_device((lo >= 0) & (hi < V), bad_ids)
    got = torch.stack(stats).tolist() if stats else []
    if isinstance(temperature, torch.Tensor) and n and host and not got.pop(0) > 0:
        raise ValueError(bad_temp)
    if got and (got[0] < 0 or got[1] >= V):
        raise ValueError(bad_ids)
    return temp


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 [N]: log_softmax(logits.float() / temperature)[i, token_ids[i]] over the full vocab.

    Invariance: each row's value depends only on that row's logits, token and temperature.
    """
    op = "token_logprobs"
    check_int("token_ids", token_ids, op)
    if token_ids.shape != (logits.shape[0],):
        raise ValueError(f"{op}: token_ids must be [N={logits.shape[0]}], got {tuple(token_ids.shape)}")
    temp = check_logprob_args(op, logits, temperature, token_ids)
    return TokenLogprobsFunction.apply(logits.contiguous(), token_ids.to(logits.device), temp)


def full_logprobs(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """fp32 [N, V]: the whole log_softmax(logits.float() / temperature) row (no autograd).

    Invariance: each row depends only on that row's logits and temperature.
    """
    temp = check_logprob_args("full_logprobs", logits, temperature)
    if backend_for(logits) == "reference":
        return full_logprobs_reference(logits.contiguous(), temp)
    return triton_impl("logprobs", "full_logprobs")(logits.contiguous(), temp)
