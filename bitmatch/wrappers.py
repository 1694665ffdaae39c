"""Distributed wrappers the trainer's forward runs inside (FSDP2 units, DDP), known to the core by registration.

``bitmatch.token_logprobs`` computes from the module inside a wrapper, so a wrapper whose hooks
gather parameters (FSDP2) or synchronize gradients (DDP) must be entered around that computation.
The core names no wrapper: the package's ``__init__`` registers each handler
(``bitmatch.parallel.fsdp:fsdp_runner``, ``bitmatch.parallel.ddp:ddp_runner``) with the torch
modules that define its wrappers' classes. A model can hold such a wrapper only once one of those modules has been
imported, so ``runner_for`` loads a handler exactly when it may apply: no wrapper is missed, and
``import bitmatch.logprobs`` does not pay for ``torch.distributed.fsdp`` (~0.7 s).
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# "module:function" of a handler -> the torch modules defining its wrappers' classes, in the order tried
_HANDLERS: dict[str, tuple[str, ...]] = {}
_LOADED: dict[str, Callable] = {}


def register_wrapper(handler: str, *torch_modules: str) -> None:
    """Declare ``handler`` ("module:function") for the wrappers whose classes ``torch_modules``
    define. The function takes a model and returns None when no wrapper of its kind applies, else
    a ``run(fn, *args)`` that calls ``fn(inner_model, *args)`` inside the wrapper's forward; it
    may raise ValueError for a wrapping whose bits or gradients it cannot keep. The handler's
    module is imported on the first model seen after one of ``torch_modules`` is, not before."""
    if ":" not in handler or not torch_modules:
        raise ValueError(f"register_wrapper: give 'module:function' and the torch modules defining its wrappers, "
                         f"got {handler!r}, {torch_modules!r}")
    _HANDLERS[handler] = torch_modules


def runner_for(model) -> Callable | None:
    """The first registered handler's ``run`` for ``model``, or None: no wrapper to enter (also
    when none of a handler's torch modules has been imported, so none of its wrappers can be on
    the model). Invariance: ``run(fn, *args)`` gives ``fn``'s bits on the unwrapped model."""
    for handler, torch_modules in _HANDLERS.items():
        if not any(m in sys.modules for m in torch_modules):
            continue
        fn = _LOADED.get(handler)
        if fn is None:
            module, _, name = handler.partition(":")
            fn = _LOADED[handler] = getattr(importlib.import_module(module), name)
        run = fn(model)
        if run is not None:
            return run
    return None
