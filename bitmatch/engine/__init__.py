"""The embedded rollout engine (nano-vllm's shape, vLLM's names).

``Engine(model).generate(prompts, SamplingParams(...)) -> list[RequestOutput]``; every reported
logprob equals ``bitmatch.token_logprobs`` for the same token, bit for bit.
"""
from bitmatch.engine.config import EngineConfig
from bitmatch.engine.llm_engine import Engine
from bitmatch.engine.sampling import SamplingParams
from bitmatch.engine.sequence import CompletionOutput, RequestOutput

LLM = Engine  # vLLM's name, for users who write LLM(...)

__all__ = ["Engine", "EngineConfig", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
