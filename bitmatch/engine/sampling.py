"""Sampling parameters and the sampler (vLLM's names and semantics).

Logprob semantics (docs/design.md section 6): the logprob the engine reports for a sampled token
is ``bitmatch.kernels.token_logprobs(logits, token, T)``: the full-vocabulary
``log_softmax(logits.float() / T)`` at the token, with the division by T in fp32 (as vLLM),
and T = 1.0 for greedy rows. That is exactly what the trainer computes with
``bitmatch.token_logprobs``. With top-k / top-p the token is drawn from the masked,
renormalized distribution; the engine still REPORTS the full-vocabulary logprob (what the
trainer computes) and ALSO stores the masked distribution's logprob in
``CompletionOutput.sampled_logprobs``, so the difference between the sampling distribution
and the trainer's distribution stays visible, never hidden.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import bitmatch.kernels as K


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling options (a subset of ``vllm.SamplingParams``, same names).

    temperature 0 means greedy (argmax, lowest index on ties); top_k -1 (or 0) and
    top_p 1.0 disable those masks; ``seed`` fixes the request's own torch.Generator, so its
    tokens do not depend on the batch it runs in; with seed None the engine derives one from
    its own seed and the request's index. ``stop_token_ids`` (and the EOS token unless
    ``ignore_eos``) end the request; the stop token is kept in ``token_ids`` with its logprob.
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"SamplingParams: temperature must be a float >= 0, got {self.temperature!r}")
        self.temperature = float(self.temperature)
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"SamplingParams: top_k must be an int, -1 or 0 to disable, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"SamplingParams: seed must be an int or None, got {self.seed!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams: stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def masked(self) -> bool:
        """True when top-k or top-p changes the sampling distribution (not for greedy)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask one row of fp32 temperature-scaled logits to -inf outside top-k / top-p (vLLM's rule:
    keep the smallest set of highest logits whose probability reaches top_p; at least one)."""
    logits = logits.clone()
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=False)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cum <= 1.0 - top_p
        remove[-1] = False
        logits[idx[remove]] = float("-inf")
    return logits


class Sampler:
    """Draws one token per row and returns (tokens, logprobs, sampled_logprobs).

    Each row is sampled on its own with its request's generator (exponential-race sampling,
    one draw of vocab-size exponentials per token), so a row's token depends only on its
    logits and its generator's state: never on the batch.
    """

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> tuple[list[int], list[float], list[float]]:
        tokens = []
        masked_lp: list[float | None] = []
        for i, sp in enumerate(params):
            if sp.greedy:
                tokens.append(int(torch.argmax(logits[i].float())))
                masked_lp.append(None)
                continue
            scaled = logits[i].float() / sp.temperature  # fp32 division, as vLLM
            if sp.masked:
                scaled = apply_top_k_top_p(scaled, sp.top_k, sp.top_p)
            probs = torch.softmax(scaled, dim=-1)
            q = torch.empty_like(probs).exponential_(generator=generators[i])
            tok = int(torch.argmax(probs / q))
            tokens.append(tok)
            masked_lp.append(float(torch.log_softmax(scaled, dim=-1)[tok]) if sp.masked else None)
        token_t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        temps = torch.tensor([1.0 if sp.greedy else sp.temperature for sp in params],
                             dtype=torch.float32, device=logits.device)
        # The reported logprob: the one function the trainer also calls.
        lps = K.token_logprobs(logits, token_t, temps).tolist()
        sampled = [lp if m is None else m for lp, m in zip(lps, masked_lp)]
        return tokens, lps, sampled
