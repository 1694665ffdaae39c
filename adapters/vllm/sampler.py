"""vLLM's V1 sampler, reporting ``bitmatch.kernels.token_logprobs`` as each token's logprob.

Tokens are still drawn by vLLM's own sampler (same generators, same draws). The logprobs it
would compute (torch's vectorized ``log_softmax``, whose reduction order depends on the
vocabulary width and the CPU's vector unit) are replaced: the whole row comes from
``kernels.full_logprobs`` (so ranks and top-n are consistent) and the sampled token's entry is
``kernels.token_logprobs(logits, token, T)``, the function the trainer side calls.

T is what vLLM divides by: the request's temperature in ``processed_logprobs`` mode (1.0 for
greedy rows, as vLLM uses), 1.0 in ``raw_logprobs`` mode. Options that reshape the processed
distribution (top-k/top-p/min-p, penalties, bias, bad words, ...) are refused at request
admission (``checks.py``); those visible in the sampling metadata are checked again here.

Invariance: each row's logprobs depend only on that row's fp32 logits and temperature.
"""
from __future__ import annotations

import dataclasses

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.sampler import _SAMPLING_EPS, Sampler

from .checks import BitmatchUnsupportedError


def _refuse_processed_options(md) -> None:
    bad = []
    if md.top_k is not None:
        bad.append("top_k")
    if md.top_p is not None:
        bad.append("top_p")
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
        # prompt logprobs (and any raw_logprobs caller): the trainer's function at T = 1
        import bitmatch.kernels as K

        return K.full_logprobs(logits.to(torch.float32), 1.0)

    def _temperature(self, md, mode: str, n: int, device) -> torch.Tensor:
        ones = torch.ones(n, dtype=torch.float32, device=device)
        if mode == "raw_logprobs" or md.temperature is None:
            return ones
        t = md.temperature.to(torch.float32)
        return torch.where(t < _SAMPLING_EPS, ones, t)  # vLLM's rule for greedy rows

    def forward(self, logits, sampling_metadata, predict_bonus_token: bool = False,
                logprobs_mode_override=None) -> SamplerOutput:
        import bitmatch.kernels as K

        md = sampling_metadata
        mode = logprobs_mode_override or self.logprobs_mode
        num_logprobs = md.max_num_logprobs
        if num_logprobs is None and not md.logprob_token_ids:
            return super().forward(logits, md, predict_bonus_token, logprobs_mode_override)
        if predict_bonus_token:
            raise BitmatchUnsupportedError("bitmatch sampler: speculative decoding (bonus tokens)")
        if mode == "processed_logprobs":
            _refuse_processed_options(md)
        elif mode != "raw_logprobs":
            raise BitmatchUnsupportedError(f"bitmatch sampler: logprobs_mode={mode!r}")
        logits = logits.to(torch.float32)
        temp = self._temperature(md, mode, logits.shape[0], logits.device)
        # before sampling: vLLM divides the logits by T in place
        logprobs = K.full_logprobs(logits, temp)
        quiet = dataclasses.replace(md, max_num_logprobs=None, logprob_token_ids=None)
        out = super().forward(logits.clone(), quiet, predict_bonus_token, logprobs_mode_override)
        sampled = out.sampled_token_ids.view(-1).long()
        exact = K.token_logprobs(logits, sampled, temp)
        logprobs.scatter_(1, sampled.unsqueeze(1), exact.unsqueeze(1))
        if md.logprob_token_ids:
            tensors = self.gather_specific_token_logprobs(logprobs, md.logprob_token_ids, sampled)
        elif num_logprobs == -1:
            tensors = LogprobsTensors(torch.empty(0), logprobs, torch.empty(0))
        else:
            tensors = self.gather_logprobs(logprobs, num_logprobs, token_ids=sampled)
        return SamplerOutput(sampled_token_ids=out.sampled_token_ids, logprobs_tensors=tensors)
