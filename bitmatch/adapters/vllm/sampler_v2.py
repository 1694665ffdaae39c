"""vLLM's V2 model runner sampler (``vllm/v1/worker/gpu/sample``, the GPU default in vLLM 0.2x), with
bitmatch's top-k / top-p mask and logprobs: the same rule as ``sampler.py`` for the V1 runner.

The V2 sampler divides by the temperature in place with a Triton kernel (``apply_temperature``,
an approximate fp32 ``/``) and scores the sampled token with its own log-softmax kernel on an fp32
copy: neither gives ``bitmatch.token_logprobs``'s bits. Here the row is masked by
``kernels.apply_top_k_top_p`` (at the request's temperature, as the trainer masks it), vLLM's
Gumbel kernel draws from the masked row (its seeds and positions, so draws stay reproducible), and
the logprobs are ``kernels.full_logprobs`` with the sampled column from ``kernels.token_logprobs``,
handed to vLLM's own top-n / rank code as scores (its ``logits_mode``, a gather).

Penalties, logit bias, bad words, min-p, min_tokens and grammars are refused when the request is
admitted (``checks.py``; vLLM's warm-up runs this sampler on dummy states, so they are not re-read
here); speculative decoding is checked again here.

Invariance: each row's mask, draw distribution and logprobs depend only on that row's logits,
temperature, top-k and top-p.
"""
from __future__ import annotations

import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.sampler import Sampler
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

import bitmatch.kernels as K

from .checks import BitmatchUnsupportedError

_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


class BitmatchSamplerV2(Sampler):
    def __call__(self, logits: torch.Tensor, input_batch) -> SamplerOutput:
        states = self.sampling_states
        exp, idx_np = input_batch.expanded_idx_mapping, input_batch.idx_mapping_np
        wants_logprobs = self.returns_logprobs(idx_np)
        top_k, top_p = states.get_top_k_top_p(exp, idx_np)
        if not wants_logprobs and top_k is None and top_p is None:
            return super().__call__(logits, input_batch)
        if logits.shape[0] != idx_np.shape[0]:
            raise BitmatchUnsupportedError("bitmatch sampler (V2 runner): several logits per request "
                                           "(speculative decoding)")
        if wants_logprobs and self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise BitmatchUnsupportedError(f"bitmatch sampler (V2 runner): logprobs_mode={self.logprobs_mode!r}")

        t = states.temperature.gpu[exp]
        greedy = t < _SAMPLING_EPS
        temp = torch.where(greedy, torch.ones_like(t), t)  # vLLM's rule: greedy rows are scored at T = 1
        drawn_from = logits
        if top_k is not None or top_p is not None:
            # greedy rows are never masked (vLLM's rule)
            top_k = None if top_k is None else torch.where(greedy, torch.zeros_like(top_k), top_k)
            top_p = None if top_p is None else torch.where(greedy, torch.ones_like(top_p), top_p)
            drawn_from = K.apply_top_k_top_p(logits, temp, top_k, top_p)
        pos = input_batch.positions[input_batch.logits_indices]
        # vLLM's draw (Gumbel-max at the request's temperature, its per-request seeds) on an fp32 copy:
        # the logits the logprobs read stay in the model's dtype, as the trainer hands them over
        sampled = gumbel_sample(drawn_from.to(torch.float32, copy=True), exp, states.temperature.gpu, states.seeds.gpu,
                                pos, apply_temperature=True, use_fp64=self.use_fp64_gumbel)

        tensors = None
        if wants_logprobs:
            src, tt = (logits, torch.ones_like(temp)) if self.logprobs_mode == "raw_logprobs" else (drawn_from, temp)
            scores = K.full_logprobs(src, tt)
            exact = K.token_logprobs(src, sampled.long(), tt)
            scores.scatter_(1, sampled.long().unsqueeze(1), exact.unsqueeze(1))
            n = states.max_num_logprobs(idx_np)
            tensors = compute_topk_scores(
                scores, n if n != NO_LOGPROBS else 0, sampled, None,
                logprob_token_ids_state=self.logprob_token_ids_state, expanded_idx_mapping=exp,
                max_per_req_token_ids=self.logprob_token_ids_state.max_num_token_ids(idx_np),
                logits_mode=True)  # the scores are bitmatch's logprobs already: gathered, not renormalized
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            input_batch.seq_lens.new_ones(input_batch.num_reqs), input_batch.seq_lens, input_batch.cu_num_logits,
            input_batch.idx_mapping, self.req_states.prefill_len.gpu)
        return SamplerOutput(sampled_token_ids=sampled.view(-1, 1), logprobs_tensors=tensors, num_nans=None,
                             num_sampled=num_sampled, num_rejected=num_rejected)


def install() -> None:
    """Make the V2 model runner build ``BitmatchSamplerV2`` and score prompt logprobs with
    ``kernels.full_logprobs`` (vLLM's chunked prompt-logprob path, handed bitmatch's logprobs as
    logits to gather). Idempotent."""
    import vllm.v1.worker.gpu.model_runner as runner
    from vllm.v1.worker.gpu.sample import prompt_logprob

    runner.Sampler = BitmatchSamplerV2  # read when a model runner is built, after plugins load
    orig = prompt_logprob.compute_prompt_logprobs_with_chunking
    if getattr(orig, "_bitmatch", False):
        return

    def compute_prompt_logprobs_with_chunking(prompt_token_ids, prompt_hidden_states, logits_fn, num_prompt_logprobs,
                                              logprobs_mode="raw_logprobs"):
        # prompt logprobs are the full-vocabulary log-softmax at T = 1 in both supported modes
        return orig(prompt_token_ids, prompt_hidden_states, lambda h: K.full_logprobs(logits_fn(h), 1.0),
                    num_prompt_logprobs, logprobs_mode="raw_logits")

    compute_prompt_logprobs_with_chunking._bitmatch = True
    compute_prompt_logprobs_with_chunking.__wrapped__ = orig
    prompt_logprob.compute_prompt_logprobs_with_chunking = compute_prompt_logprobs_with_chunking
