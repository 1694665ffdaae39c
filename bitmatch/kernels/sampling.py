"""Sampling ops: the top-k / top-p mask, the categorical draw and counter-based noise.

One definition of each, shared by the trainer (``bitmatch.token_logprobs(..., top_k=, top_p=)``),
the embedded engine's sampler and the vLLM plugin's sampler, so the distribution a token is drawn
from and the logprob the trainer computes for it are the same function of the same bits.

Canonical order (``top_k_top_p_mask``), for each row of fp32 ``z = logits.float() / T`` (the
division exactly as ``token_logprobs``):

1. **Sort**: descending by value, ties by lower token index first (a stable sort of a fixed
   key: the permutation is unique, so no sort implementation can change it).
2. **top-k** (k <= 0 or k >= V: off): keep every token with ``z >= z_(k)``, the k-th largest
   value; tokens tied with it are all kept (vLLM's and HF's rule).
3. **top-p** (p >= 1: off), over the tokens top-k kept: integer weights
   ``w = round(exp64(z - max z) * 2**b)`` (``b = 62 - ceil(log2 V)``, so the row's sum stays
   below 2**62; ``exp64`` is ``_exact``'s, elementwise IEEE ops only), their exclusive prefix
   sums ``C_r`` in sorted order in int64 (integer sums are exact, so any scan order gives the
   same bits), and a token is kept iff ``float64(C_r) < float64(fp32(p)) * float64(W)``, W the
   sum: the smallest set of highest-probability tokens whose probability reaches p; the top
   token is always kept. p is rounded to fp32 first, as vLLM stores it.

Every step is exact or elementwise, so a row's mask depends only on that row's logits, T, k
and p: never on the batch, the row's position, the backend or the thread count. The same
integer weights give the categorical draw (``categorical_sample``: inverse CDF in vocabulary
order, exact int64 prefix sums; on CUDA one fused Triton kernel, ``kernels/triton/sampling.py``,
with the same bits), and ``uniform_noise`` is SplitMix64 written in torch int64
ops: both run the same on CPU and CUDA and inside a CUDA graph (no host sync, no generator
state).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, triton_impl
from .logprobs import check_logprob_args as _check_scalar_temperature, scaled_logits

F64 = torch.float64
_SUM_BITS = 62                      # a row's weight sum stays below 2**62 < 2**63 (int64)
_GAMMA = 0x9E3779B97F4A7C15         # SplitMix64's increment and finalizer multipliers
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

__all__ = ["top_k_top_p_mask", "apply_top_k_top_p", "categorical_sample", "categorical_sample_reference",
           "uniform_noise", "to_int64_seed"]


def _weight_bits(vocab: int) -> int:
    return _SUM_BITS - max(1, (vocab - 1).bit_length())


def _int_weights(z: torch.Tensor, zmax: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 ``round(exp64(z - zmax) * 2**bits)``: elementwise, so the same value gives the same
    weight wherever it sits (the top token weighs exactly 2**bits)."""
    e = _exact.exp64(z.to(F64) - zmax.to(F64))
    return torch.round(e * float(2 ** bits)).to(torch.int64)


def _weights_on_backend(z: torch.Tensor, zmax: torch.Tensor, bits: int) -> torch.Tensor:
    """``_int_weights`` on z's backend: the torch ops on CPU, one elementwise Triton kernel on CUDA
    (same formula op for op, no FMA: the same bits; benchmarks/ops/sampler.py checks them)."""
    if backend_for(z) == "reference":
        return _int_weights(z, zmax, bits)
    return triton_impl("sampling", "int_weights")(z, zmax, bits)


def _check_temperature(op: str, logits: torch.Tensor, temperature) -> torch.Tensor:
    """fp32 [N] temperatures. A tensor is taken as given (the caller validated its values: a
    check here would cost a host sync per step); a scalar is checked like token_logprobs'."""
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be [N, V], got shape {tuple(logits.shape)}")
    if not isinstance(temperature, torch.Tensor):
        return _check_scalar_temperature(op, logits, temperature)
    n = logits.shape[0]
    temp = temperature.to(device=logits.device, dtype=torch.float32).reshape(-1)
    if temp.numel() == 1:
        temp = temp.expand(n)
    if temp.shape != (n,):
        raise ValueError(f"{op}: temperature must be a float or an [N={n}] tensor, got shape "
                         f"{tuple(temperature.shape)}")
    return temp


def _per_row(op: str, name: str, value, n: int, dtype, device) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        t = value.to(device=device).reshape(-1)
        if t.numel() == 1:
            t = t.expand(n)
        if t.shape != (n,):
            raise ValueError(f"{op}: {name} must be a scalar or an [N={n}] tensor, got shape {tuple(value.shape)}")
        return t.to(dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{op}: {name} must be a number, a tensor or None, got {type(value).__name__}")
    return torch.full((n,), value, dtype=dtype, device=device)


def _check_k_p(op: str, top_k, top_p) -> None:
    # Python scalars are checked here; tensors come from validated request parameters (a check
    # on a device tensor would cost a host sync per step)
    if top_k is not None and not isinstance(top_k, torch.Tensor) and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ValueError(f"{op}: top_k must be an int >= 1, or -1 / 0 / None for no top-k; got {top_k!r}")
    if top_p is not None and not isinstance(top_p, torch.Tensor) and (
            isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"{op}: top_p must be a float in (0, 1], or 1.0 / None for no top-p; got {top_p!r}")


def top_k_top_p_mask(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    """bool [N, V]: the tokens kept by top-k then top-p at temperature T (module docstring).

    ``top_k`` / ``top_p``: None, a scalar for every row, or an [N] tensor (per row; k <= 0 or
    k >= V and p >= 1 switch a row's mask off). Invariance: a row's mask depends only on that
    row's logits, T, k and p (canonical sort, exact integer prefix sums).
    """
    op = "top_k_top_p_mask"
    check_float("logits", logits, op)
    temp = _check_temperature(op, logits, temperature)
    _check_k_p(op, top_k, top_p)
    n, vocab = logits.shape
    dev = logits.device
    if (top_k is None and top_p is None) or n == 0:
        return torch.ones((n, vocab), dtype=torch.bool, device=dev)
    z = scaled_logits(logits, temp)
    vals, idx = torch.sort(z, dim=-1, descending=True, stable=True)
    k = _per_row(op, "top_k", top_k, n, torch.int64, dev)
    if k is not None:
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        keep = vals >= vals.gather(1, (k - 1).unsqueeze(1))
    else:
        keep = torch.ones_like(vals, dtype=torch.bool)
    p = _per_row(op, "top_p", top_p, n, torch.float32, dev)
    if p is not None:
        p = p.to(F64).unsqueeze(1)
        w = torch.where(keep, _weights_on_backend(vals, vals[:, :1], _weight_bits(vocab)), 0)
        total = w.sum(-1, keepdim=True)
        before = torch.cumsum(w, -1) - w  # exclusive prefix sums, exact in int64
        keep_p = (before.to(F64) < p * total.to(F64)) | (p >= 1.0)
        keep_p[:, 0] = True  # at least one token
        keep = keep & keep_p
    return torch.empty_like(keep).scatter_(1, idx, keep)


def apply_top_k_top_p(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    """``logits`` (same dtype) with -inf outside ``top_k_top_p_mask``: what ``token_logprobs`` /
    ``full_logprobs`` turn into the renormalized, masked distribution's logprobs. Gradients flow
    to the kept logits only. Invariance: as ``top_k_top_p_mask`` (rows that no mask touches are
    returned bit for bit)."""
    if top_k is None and top_p is None:
        return logits
    keep = top_k_top_p_mask(logits, temperature, top_k, top_p)
    return logits.masked_fill(~keep, float("-inf"))


def categorical_sample_reference(logits: torch.Tensor, temp: torch.Tensor, uniforms: torch.Tensor,
                                 greedy: torch.Tensor | None = None) -> torch.Tensor:
    """``categorical_sample`` in torch ops on any device (the readable definition; the CPU
    backend, and the torch-on-CUDA side of benchmarks/ops/sampler.py). Inputs as validated there."""
    n, vocab = logits.shape
    z = scaled_logits(logits, temp)
    w = _int_weights(z, z.amax(-1, keepdim=True), _weight_bits(vocab))
    cdf = torch.cumsum(w, -1)
    total = cdf[:, -1:]
    r = torch.floor(uniforms.to(device=logits.device, dtype=F64).unsqueeze(1) * total.to(F64)).to(torch.int64)
    r = torch.minimum(r.clamp_min(0), total - 1)  # u * W may round up to W when W > 2**53
    # the contract's guard: a row outside it (NaN or +inf in logits / T: garbage weights) may
    # search past the last entry; its token is clamped into the vocabulary (as the kernel's), and
    # its logprob, NaN, is what the engine refuses
    tokens = torch.searchsorted(cdf, r, right=True).squeeze(1).clamp_max(vocab - 1)
    if greedy is not None:
        tokens = torch.where(greedy.to(device=logits.device, dtype=torch.bool), logits.float().argmax(-1), tokens)
    return tokens


def categorical_sample(logits: torch.Tensor, temperature, uniforms: torch.Tensor,
                       greedy: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [N]: one token per row drawn from ``softmax(logits.float() / T)`` by inverse CDF.

    Each row's distribution is its integer weights (module docstring; -inf logits weigh 0, so a
    masked token is never drawn); ``r = floor(u * W)`` with ``u = uniforms[i]`` in [0, 1), and
    the token is the first whose inclusive int64 prefix sum exceeds r. The weights approximate
    the softmax to 2**-b of the top probability (b = 62 - ceil(log2 V), 44 for V = 151,936).
    ``greedy`` (bool [N] or None): rows where it is set take ``logits.float().argmax(-1)``
    (lowest index on ties) instead, whatever their T and u. CPU tensors run the torch reference
    (``categorical_sample_reference``), CUDA tensors one fused Triton kernel with the same bits.
    Contract: every token is in [0, V), whatever the inputs; a row whose logits / T hold NaN or
    +inf (outside the contract: the engine refuses its NaN logprobs) gets an unspecified one.
    Invariance: a row's token depends only on its logits, T and u (exact integer sums).
    """
    op = "categorical_sample"
    check_float("logits", logits, op)
    temp = _check_temperature(op, logits, temperature)
    n, vocab = logits.shape
    if not isinstance(uniforms, torch.Tensor) or uniforms.shape != (n,):
        raise ValueError(f"{op}: uniforms must be an [N={n}] tensor, got "
                         f"{tuple(uniforms.shape) if isinstance(uniforms, torch.Tensor) else type(uniforms).__name__}")
    if greedy is not None and (not isinstance(greedy, torch.Tensor) or greedy.shape != (n,)):
        raise ValueError(f"{op}: greedy must be None or a bool [N={n}] tensor")
    if backend_for(logits) == "reference":
        return categorical_sample_reference(logits, temp, uniforms, greedy)
    return triton_impl("sampling", "categorical_sample")(logits, temp, uniforms, greedy, _weight_bits(vocab))


def _signed(c: int) -> int:
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >> 63 else c


def to_int64_seed(seed: int) -> int:
    """Any Python int as the int64 whose bits are its low 64 bits (the seed ``uniform_noise`` takes)."""
    return _signed(int(seed))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # logical shift: torch's >> on int64 is arithmetic


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)  # int64 products wrap modulo 2**64, as uint64 would
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float64 [N] in [0, 1): output ``index`` of a SplitMix64 stream keyed by ``seeds`` (int64).

    ``u = (mix(key + (index + 1) * gamma) >> 11) * 2**-53`` with ``key = mix(seed + gamma)``: a
    pure function of (seed, index), in int64 torch ops (wrapping products, masked shifts), so
    the same bits on every device, in any batch, inside a CUDA graph.
    """
    if seeds.dtype != torch.int64 or index.dtype != torch.int64:
        raise ValueError("uniform_noise: seeds and index must be int64 tensors (see to_int64_seed)")
    g = _signed(_GAMMA)
    key = _mix64(seeds + g)
    h = _mix64(key + (index + 1) * g)
    return _shr(h, 11).to(F64) * 2.0 ** -53
