import os

os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/bitmatch-vllm-cache")
