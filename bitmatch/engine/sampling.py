"""Sampling parameters and the batched sampler (vLLM's names and semantics).

Logprob semantics (docs/design.md section 6), per sampled token:

- ``CompletionOutput.logprobs``: the full-vocabulary ``log_softmax(logits.float() / T)`` at the
  token (``kernels.token_logprobs``; T = 1.0 for greedy rows): what
  ``bitmatch.token_logprobs(model, ids, mask, T)`` computes, bit for bit.
- ``CompletionOutput.sampled_logprobs``: the logprob under the distribution the token was
  actually drawn from, after the top-k / top-p mask (``kernels.top_k_top_p_mask``) and
  renormalization: what ``bitmatch.token_logprobs(model, ids, mask, T, top_k=, top_p=)``
  computes, bit for bit (vLLM's ``processed_logprobs``; what an RL loss should use when
  rollouts are truncated). Equal to ``logprobs`` when no mask applies.

Sampling noise is ``kernels.uniform_noise(seed, completion index)``: a request's tokens depend
only on its own logits, its seed and the token's index, never on the batch, the row's position,
preemption or the device's generator state.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np
import torch

import bitmatch.kernels as K
from bitmatch.engine.host import upload
from bitmatch.logprobs import check_temperature

# top_k as packed into int64: any k >= the vocabulary keeps every token, so clamping a larger k
# (2**63 would overflow) to a bound above every vocabulary changes no mask
_TOP_K_MAX = 2 ** 62


def _int_in(name: str, value, lo: int, hi: int | None, why: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or value < lo or (hi is not None and value >= hi):
        raise ValueError(f"SamplingParams: {name} must be {why}, got {value!r} ({type(value).__name__})")
    return int(value)


def _top_p(value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not 0.0 < value <= 1.0:
        raise ValueError(f"SamplingParams: top_p must be a float in (0, 1] (1.0: no top-p), got {value!r} "
                         f"({type(value).__name__})")
    return float(value)


def _stop_token_ids(value) -> list[int]:
    ids = [] if value is None else value
    if isinstance(ids, (str, bytes)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))
                                                and t >= 0 for t in ids):
        raise ValueError(f"SamplingParams: stop_token_ids must be a list of ints >= 0, got {value!r}")
    return [int(t) for t in ids]


def _bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"SamplingParams: {name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


# every field's check, run on each assignment: a field changed after construction is checked as the
# constructor's arguments are (a temperature of -1 or a seed beyond 64 bits never reaches the sampler)
_CHECKS = {
    "temperature": lambda v: check_temperature("SamplingParams", v, greedy_ok=True),
    "top_p": _top_p,
    "top_k": lambda v: _int_in("top_k", v, -1, None, "an int >= 1, or -1 / 0 to disable"),
    "seed": lambda v: None if v is None else _int_in(
        "seed", v, 0, 2 ** 64, "None or an int in [0, 2**64) (the noise is keyed by 64 bits: a larger or negative "
        "seed would alias another)"),
    "max_tokens": lambda v: _int_in("max_tokens", v, 1, None, "an int >= 1"),
    "stop_token_ids": _stop_token_ids,
    "ignore_eos": lambda v: _bool("ignore_eos", v),
}


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling options (a subset of ``vllm.SamplingParams``, same names).

    temperature 0 means greedy (argmax, lowest index on ties), otherwise a float32-normal T in
    [2**-126, 3.4e38] (``bitmatch.logprobs.check_temperature``: 1 / T finite in float32); top_k -1 (or 0) and
    top_p 1.0 disable those masks (``kernels.top_k_top_p_mask``: vLLM's rules, canonical order), and
    so does a top_k at or above the vocabulary size (any int: every token is kept);
    ``seed`` (an int in [0, 2**64)) keys the request's noise, so its tokens depend on nothing but its
    logits, seed and token index; with seed None the engine derives one from its own seed and the request's index.
    ``stop_token_ids`` (and the EOS token unless ``ignore_eos``) end the request; the stop token
    is kept in ``token_ids`` with its logprob. Every field is checked when it is set, at
    construction or later (ValueError naming the field and its valid values).
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __setattr__(self, name, value):
        check = _CHECKS.get(name)
        object.__setattr__(self, name, value if check is None else check(value))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def masked(self) -> bool:
        """True when top-k or top-p changes the sampling distribution (not for greedy)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


_TOKEN_LOGPROBS = K.OPS["token_logprobs"]


def reported_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """The logprobs the engine reports for sampled ``tokens``: ``kernels.token_logprobs``, so the
    trainer's ``token_logprobs`` of the same rows gives the same bits; an op override of
    ``token_logprobs`` (``kernels.override``: a fault, the stock baseline) reaches it here."""
    # the sampler's rows are validated: skip token_logprobs' argument checks (no check kernels per
    # step), unless an op override (a fault, the stock baseline) swapped the op: then it runs
    if K.token_logprobs is not _TOKEN_LOGPROBS.canonical:
        return K.token_logprobs(logits, tokens, temps)
    return K.logprobs.TokenLogprobsFunction.apply(logits.contiguous(), tokens, temps)


class Sampler:
    """Draws one token per row for a whole batch: greedy (argmax, lowest index on ties),
    temperature, top-k and top-p rows mixed, with no per-row device op and one host sync (the
    results' transfer).

    Three stages, so the engine can capture the middle one in its decode CUDA graph:
    ``pack`` (host: per-row parameters as two arrays, uploaded), ``device_step`` (tensors in,
    one float64 [3, N] tensor out: no host sync, no branching on device values, capturable) and
    ``finish`` (the one ``.tolist()``). ``__call__`` runs the three.

    Sampled rows: ``kernels.categorical_sample`` over the masked logits with the uniform
    ``kernels.uniform_noise(seed, index)``. Invariance: a row's token and logprobs depend only on
    its logits, its parameters, its seed and its index (every op is row-wise and exact).
    """

    @staticmethod
    def flags(params: list[SamplingParams]) -> tuple[bool, bool, bool]:
        """(any_masked, all_greedy, any_greedy): the only host facts ``device_step`` branches on."""
        greedy = [sp.greedy for sp in params]
        return any(sp.masked for sp in params), all(greedy), any(greedy)

    @staticmethod
    def pack_host(params: list[SamplingParams], seeds: list[int],
                  indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Host arrays float32 [2, N] (temperature, 1.0 for greedy rows; top_p, 1.0 for unmasked
        rows) and int64 [4, N] (seed as int64, completion index, top_k, -1 for unmasked rows;
        greedy 0/1)."""
        if not len(params) == len(seeds) == len(indices):
            raise ValueError(f"Sampler: {len(params)} params, {len(seeds)} seeds, {len(indices)} indices")
        masked = [sp.masked for sp in params]
        f32 = np.array([[1.0 if sp.greedy else sp.temperature for sp in params],
                        [sp.top_p if m else 1.0 for sp, m in zip(params, masked)]], np.float32).reshape(2, -1)
        i64 = np.array([[K.sampling.to_int64_seed(s) for s in seeds], list(indices),
                        [min(sp.top_k, _TOP_K_MAX) if m else -1 for sp, m in zip(params, masked)],
                        [sp.greedy for sp in params]], np.int64).reshape(4, -1)
        return f32, i64

    @staticmethod
    def pack(params: list[SamplingParams], seeds: list[int], indices: list[int],
             device) -> tuple[torch.Tensor, torch.Tensor]:
        """``pack_host``'s arrays on ``device``: two pinned non-blocking uploads (no device sync)."""
        f32, i64 = Sampler.pack_host(params, seeds, indices)
        n = f32.shape[1]
        dev = torch.device(device)
        return upload(f32.reshape(-1), dev).view(2, n), upload(i64.reshape(-1), dev).view(4, n)

    def device_step(self, logits: torch.Tensor, f32: torch.Tensor, i64: torch.Tensor, any_masked: bool,
                    all_greedy: bool, any_greedy: bool) -> torch.Tensor:
        """float64 [3, N]: tokens, ``logprobs``, ``sampled_logprobs`` (module docstring) for
        ``pack``'s rows. No host sync; branches only on the three flags (``flags``), so one
        CUDA graph per (N, flags) replays it. Invariance: as the class."""
        temps = f32[0]
        masked = K.apply_top_k_top_p(logits, temps, i64[2], f32[1]) if any_masked else logits
        if all_greedy:
            tokens = logits.float().argmax(-1)
        else:
            u = K.uniform_noise(i64[0], i64[1])
            # greedy rows are never masked (pack), so their argmax over ``masked`` is over logits
            tokens = K.categorical_sample(masked, temps, u, i64[3].bool() if any_greedy else None)
        # the reported logprobs: the trainer's function on the same logits (its autograd Function
        # directly: the inputs are valid by construction, and the public entry's value checks
        # would cost three host syncs per call)
        lps = reported_logprobs(logits, tokens, temps)
        sampled = reported_logprobs(masked, tokens, temps) if any_masked else lps
        # float64 holds the token ids and the fp32 values exactly: one tensor, one transfer
        return torch.stack([tokens.to(torch.float64), lps.to(torch.float64), sampled.to(torch.float64)])

    @staticmethod
    def finish(out: torch.Tensor) -> tuple[list[int], list[float], list[float]]:
        """``device_step``'s tensor as host lists (tokens, logprobs, sampled_logprobs): the one sync."""
        rows = out.tolist()
        return [int(t) for t in rows[0]], rows[1], rows[2]

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 indices: list[int]) -> tuple[list[int], list[float], list[float]]:
        f32, i64 = self.pack(params, seeds, indices, logits.device)
        return self.finish(self.device_step(logits, f32, i64, *self.flags(params)))
