"""Adapter benchmarks: bitmatch inside vLLM and TRL against stock vLLM and TRL.

Not named ``vllm/``: benchmarks/ is on sys.path, so that folder would shadow the vllm package."""
