"""One request's state inside the engine (nano-vllm's Sequence, vLLM's names)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from bitmatch.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """Prompt + generated tokens, the KV blocks holding them and the sampling state.

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache. On preemption
    (recompute) the blocks are freed and ``num_computed_tokens`` reset to 0: the next
    prefill runs over prompt + generated tokens as the new prompt, while the sampled
    tokens, their logprobs and the request's seed are kept (noise is a function of seed and index).
    """

    def __init__(self, seq_id: int, token_ids: list[int], params: SamplingParams,
                 seed: int | None, block_size: int, prompt: str | None = None):
        self.seq_id = seq_id
        self.request_id = str(seq_id)
        self.prompt = prompt
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.seed = seed                    # keys the sampling noise with the token index
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens found in the prefix cache
        self.block_table: list[int] = []
        self.state_slot = -1                # per_seq cache slot while running (BlockManager)
        self.logprobs: list[float] = []
        self.sampled_logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.weight_version: int | None = None      # set by the engine at the request's first step
        self.weight_fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def append_token(self, token_id: int, logprob: float, sampled_logprob: float) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.sampled_logprobs.append(sampled_logprob)


@dataclass(slots=True)
class CompletionOutput:
    """One completion (vLLM's CompletionOutput). ``logprobs[i]`` is the fp32 full-vocabulary
    ``log_softmax(logits / T)`` of ``token_ids[i]`` (T = 1 for greedy): what the trainer
    computes. ``sampled_logprobs[i]`` is the logprob under the distribution actually sampled
    from (after top-k / top-p masking and renormalization); equal to ``logprobs[i]`` when no
    mask is applied."""
    index: int
    text: str | None
    token_ids: list[int]
    logprobs: list[float]
    sampled_logprobs: list[float]
    cumulative_logprob: float
    finish_reason: str | None
    stop_reason: int | None = None


@dataclass(slots=True)
class RequestOutput:
    """The result of one request (vLLM's RequestOutput). ``weight_version`` / ``weight_fingerprint``:
    the verified version (and its manifest digest, ``bitmatch.sync.Manifest.digest``) every token was
    sampled with, when a ``bitmatch.sync`` receiver manages the engine's model; None otherwise.
    The trainer checks them with ``bitmatch.sync.check_weight_version``."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    weight_version: int | None = None
    weight_fingerprint: str | None = None

    @classmethod
    def from_seq(cls, seq: Sequence, tokenizer=None) -> "RequestOutput":
        ids = seq.completion_token_ids
        text = tokenizer.decode(ids) if tokenizer is not None else None
        out = CompletionOutput(index=0, text=text, token_ids=ids, logprobs=list(seq.logprobs),
                               sampled_logprobs=list(seq.sampled_logprobs),
                               cumulative_logprob=float(sum(seq.logprobs)),
                               finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        return cls(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
                   outputs=[out], finished=seq.is_finished, num_preemptions=seq.num_preemptions,
                   num_cached_tokens=seq.num_cached_tokens, weight_version=seq.weight_version,
                   weight_fingerprint=seq.weight_fingerprint)
