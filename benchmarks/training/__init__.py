"""Trainer benchmarks: bitmatch.token_logprobs forward + backward against the stock HF model."""
