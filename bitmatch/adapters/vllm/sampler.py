"""vLLM's V1 sampler, drawing from bitmatch's top-k / top-p mask and reporting bitmatch's logprobs.

Tokens are drawn by vLLM's own sampler (same generators, same draws) from the logits with
``kernels.apply_top_k_top_p`` applied first (-inf outside the canonical mask, at the request's
temperature), so vLLM's own top-k / top-p code never runs and the distribution sampled from is
the one the trainer scores with ``bitmatch.token_logprobs(..., top_k=, top_p=)``. The logprobs
it would compute (torch's vectorized ``log_softmax``, whose reduction order depends on the
vocabulary width and the CPU's vector unit) are replaced: the whole row comes from
``kernels.full_logprobs`` (so ranks and top-n are consistent) and the sampled token's entry is
``kernels.token_logprobs``, the function the trainer side calls.

- ``processed_logprobs``: the masked, renormalized ``log_softmax(logits / T)`` (T = 1.0 for
  greedy rows, which are never masked, as vLLM defines them): ``token_logprobs(model, ids,
  mask, T, top_k=, top_p=)`` on the trainer, bit for bit.
- ``raw_logprobs``: the full-vocabulary ``log_softmax(logits)`` before temperature and mask.

Options that reshape the processed distribution in ways bitmatch does not reproduce (min-p,
penalties, bias, bad words, ...) are refused at request admission (``checks.py``); those
visible in the sampling metadata are checked again here.

Invariance: each row's mask, draw distribution and logprobs depend only on that row's fp32
logits, temperature, top-k and top-p.
"""
from __future__ import annotations

import dataclasses

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.sampler import _SAMPLING_EPS, Sampler

import bitmatch.kernels as K

from .checks import BitmatchUnsupportedError


def _refuse_processed_options(md) -> None:
    bad = []
    if not md.no_penalties:
        bad.append("penalties")
    if md.allowed_token_ids_mask is not None:
        bad.append("allowed_token_ids")
    if md.bad_words_token_ids:
        bad.append("bad_words")
    if bad:
        raise BitmatchUnsupportedError(f"bitmatch sampler: {', '.join(bad)} would change the processed logprobs")


class BitmatchSampler(Sampler):
    @staticmethod
    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        # prompt logprobs (and any raw_logprobs caller): the trainer's function at T = 1, on the
        # logits in the dtype the model gave them (see forward)
        return K.full_logprobs(logits, 1.0)

    @staticmethod
    def _sampling_temperature(md, n: int, device) -> torch.Tensor:
        """What vLLM divides by: the request's T, 1.0 for greedy rows (vLLM's rule)."""
        ones = torch.ones(n, dtype=torch.float32, device=device)
        if md.temperature is None:
            return ones
        t = md.temperature.to(torch.float32)
        return torch.where(t < _SAMPLING_EPS, ones, t)

    @staticmethod
    def _mask(logits: torch.Tensor, md, temp: torch.Tensor) -> torch.Tensor:
        """The logits with bitmatch's canonical top-k / top-p mask applied (greedy rows untouched)."""
        if md.top_k is None and md.top_p is None:
            return logits
        greedy = md.temperature < _SAMPLING_EPS if md.temperature is not None else None
        top_k, top_p = md.top_k, md.top_p
        if greedy is not None:  # vLLM stores top_k = 0 / top_p = 1 for greedy requests; make sure
            top_k = None if top_k is None else torch.where(greedy, torch.zeros_like(top_k), top_k)
            top_p = None if top_p is None else torch.where(greedy, torch.ones_like(top_p), top_p)
        return K.apply_top_k_top_p(logits, temp, top_k, top_p)

    def forward(self, logits, sampling_metadata, predict_bonus_token: bool = False,
                logprobs_mode_override=None) -> SamplerOutput:
        md = sampling_metadata
        mode = logprobs_mode_override or self.logprobs_mode
        num_logprobs = md.max_num_logprobs
        wants_logprobs = num_logprobs is not None or bool(md.logprob_token_ids)
        masked = md.top_k is not None or md.top_p is not None
        if not wants_logprobs and not masked:
            return super().forward(logits, md, predict_bonus_token, logprobs_mode_override)
        if predict_bonus_token:
            raise BitmatchUnsupportedError("bitmatch sampler: speculative decoding (bonus tokens)")
        if wants_logprobs:
            if mode == "processed_logprobs":
                _refuse_processed_options(md)
            elif mode != "raw_logprobs":
                raise BitmatchUnsupportedError(f"bitmatch sampler: logprobs_mode={mode!r}")
        # the logits stay in the model's dtype, as the trainer hands them to the same kernels: on the
        # GPU the logprob kernels' row sums follow their load width, so an fp32 copy of bf16 logits
        # gives other last bits (vLLM's own sampler below draws from an fp32 copy)
        temp = self._sampling_temperature(md, logits.shape[0], logits.device)
        drawn_from = self._mask(logits, md, temp)
        # vLLM draws (and divides by T in place) on a copy; its own top-k / top-p are off
        quiet = dataclasses.replace(md, max_num_logprobs=None, logprob_token_ids=None, top_k=None, top_p=None)
        # vLLM's first step is logits.to(float32), a copy unless they are fp32 already: only then may its
        # in-place temperature reach drawn_from
        mine = drawn_from.clone() if drawn_from.dtype == torch.float32 else drawn_from
        out = super().forward(mine, quiet, predict_bonus_token, logprobs_mode_override)
        if not wants_logprobs:
            return out
        if mode == "raw_logprobs":
            drawn_from, temp = logits, torch.ones_like(temp)
        logprobs = K.full_logprobs(drawn_from, temp)
        sampled = out.sampled_token_ids.view(-1).long()
        exact = K.token_logprobs(drawn_from, sampled, temp)
        logprobs.scatter_(1, sampled.unsqueeze(1), exact.unsqueeze(1))
        if md.logprob_token_ids:
            tensors = self.gather_specific_token_logprobs(logprobs, md.logprob_token_ids, sampled)
        elif num_logprobs == -1:
            tensors = LogprobsTensors(torch.empty(0), logprobs, torch.empty(0))
        else:
            tensors = self.gather_logprobs(logprobs, num_logprobs, token_ids=sampled)
        return SamplerOutput(sampled_token_ids=out.sampled_token_ids, logprobs_tensors=tensors)
