"""Family benchmarks: Qwen3-MoE, Nemotron-H and DeepSeek-V4 on bitmatch against HF's own implementation."""
