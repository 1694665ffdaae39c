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
import importlib.abc
import importlib.util
import sys

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
_SUBMODULES = {m: f"bitmatch.{m}" for m in
               ("kernels", "diagnostics", "sync", "testing", "models", "engine", "adapters", "context")}
_SUBMODULES["verify"] = "bitmatch.diagnostics.verify"   # the README's path before 0.2

__all__ = sorted(list(_EXPORTS) + list(_SUBMODULES))

# Module paths published before 0.2 (the README's `from bitmatch.verify import compare`, user loops on
# bitmatch.stepcheck) moved into packages (issue 49). Importing an old path hands back the new module
# object itself, so isinstance checks and monkeypatches see one module, and no shim file sits here.
_MOVED = {f"bitmatch.{m}": f"bitmatch.diagnostics.{m}"
          for m in ("verify", "tracing", "replay", "stepcheck", "family_check", "controls", "faults")}
_MOVED.update({"bitmatch.testing_models": "bitmatch.testing.models", "bitmatch.testing_trl": "bitmatch.testing.trl",
               "bitmatch.hub": "bitmatch.models.hub"})


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import bitmatch.verify`` -> the module ``bitmatch.diagnostics.verify``, the same object."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__   # the import system sets __spec__ to the alias's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


# first on the path, so a stale bitmatch/verify.py (an old install's, a build/lib copy) never shadows the alias
if not any(type(f).__name__ == _MovedModuleFinder.__name__ for f in sys.meta_path):  # once, even on reload
    sys.meta_path.insert(0, _MovedModuleFinder())

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
        return importlib.import_module(_SUBMODULES[name])
    raise AttributeError(f"module 'bitmatch' has no attribute {name!r}")
