"""bitmatch: rollout logprobs equal, bit for bit, to the trainer's (Diff = 0, KL = 0).

    import bitmatch
    bitmatch.patch(model)                       # HF model onto bitmatch.kernels
    engine = bitmatch.Engine(model)             # embedded rollout engine, shares the weights
    outs = engine.generate(prompts, bitmatch.SamplingParams(temperature=0.9, max_tokens=64))
    lp = bitmatch.token_logprobs(model, input_ids, attention_mask, temperature=0.9)

Names are imported lazily so ``import bitmatch`` stays light.
"""
from __future__ import annotations

import importlib

from bitmatch.wrappers import register_wrapper

__version__ = "0.1.0"

_EXPORTS = {
    "patch": "bitmatch.patching", "unpatch": "bitmatch.patching", "is_patched": "bitmatch.patching",
    "token_logprobs": "bitmatch.logprobs",
    "load_model": "bitmatch.models",
    "Engine": "bitmatch.engine", "LLM": "bitmatch.engine", "SamplingParams": "bitmatch.engine",
    "RequestOutput": "bitmatch.engine", "CompletionOutput": "bitmatch.engine",
    "compute_cast": "bitmatch.precision",
}
_SUBMODULES = ("kernels", "verify", "sync", "testing", "models", "engine", "adapters", "context")

__all__ = sorted(list(_EXPORTS) + list(_SUBMODULES))

# The wrappers token_logprobs runs inside, declared here, at the top, so that the core never names the
# parallel layer above it: each handler loads with the first model once its torch module is imported
# (a model cannot hold an FSDP unit or a DTensor before), so `import bitmatch.logprobs` stays off
# torch.distributed.fsdp. DDP first, as token_logprobs has always tried it.
register_wrapper("bitmatch.parallel.ddp:ddp_runner", "torch.nn.parallel")
register_wrapper("bitmatch.parallel.fsdp:fsdp_runner", "torch.distributed.fsdp", "torch.distributed.tensor")


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"bitmatch.{name}")
    raise AttributeError(f"module 'bitmatch' has no attribute {name!r}")
