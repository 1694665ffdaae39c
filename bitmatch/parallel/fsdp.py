"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models on bitmatch's forward, gradients included.

FSDP2 keeps each parameter as a DTensor shard. A unit's pre-forward hook (on its ``__call__``)
all-gathers its full parameters; its post-forward hook frees them again and hooks the outputs, so
that backward all-gathers them once more and reduce-scatters the gradients into the shards' ``.grad``.
bitmatch's forward reads ``module.weight`` and calls its kernels directly, so it enters those hooks
itself (``fsdp_forward``, which ``bitmatch.token_logprobs`` runs on a sharded model through
``fsdp_runner``, the ``bitmatch.wrappers`` handler):

- a ``fully_shard``-ed decoder layer runs through its own ``__call__`` once ``bitmatch.patch`` has
  rebound its forward (``registry.call_layer``): gathered and freed one layer at a time, as in
  HF's own forward;
- every other unit (the root, which holds the embedding, the final norm and the head, or those as
  units of their own, verl's wrapping) is entered around the whole computation through
  ``register_fsdp_forward_method``: its parameters are whole from the embedding gather to the last
  logits chunk, and whole again in backward, where ``token_logprobs`` recomputes its checkpointed
  logits chunks.

The gathers move parameter bytes (no arithmetic) and every rank computes full tokens with the
whole weights, so every rank's logprobs are the unsharded model's bits whatever the number of
shards; the gradients are FSDP2's own (its reduce-scatter, averaged over the ranks by default).
``fsdp_unsharded`` gathers every unit for a forward-only block instead.
"""
from __future__ import annotations

import contextlib
import types
import warnings

import torch
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from bitmatch.models import unwrap_causal_lm
from bitmatch.models.registry import bound_forward

_FORWARD_METHOD = "bitmatch_fsdp_forward"


def fsdp_units(model) -> list:
    """The FSDP2 units of ``model`` that ``fsdp_forward`` enters around the whole computation, root
    first; [] for a model with no sharded parameter (no FSDP2, or inside ``fsdp_unsharded``).
    Raises ValueError, naming the fix, for what cannot keep the bits or the gradients: FSDP1,
    DTensor parameters outside ``fully_shard``, a sharded decoder layer that ``bitmatch.patch`` has
    not rebound, a unit inside a decoder layer."""
    if not isinstance(model, torch.nn.Module):
        return []
    # FSDP1, FSDP2 and DTensor parameters all need an initialized process group: without one there
    # is nothing to find, and the walk over every module (~1 ms at 8B) stays off the training step
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return []
    mods = list(model.named_modules())
    fsdp1 = [n or "the model" for n, m in mods if isinstance(m, FullyShardedDataParallel)]
    if fsdp1:
        raise ValueError(f"bitmatch: FSDP1 (FullyShardedDataParallel wrapping {fsdp1[0]}) is not supported: its flat "
                         "parameters are whole only inside summon_full_params, where gradients miss its "
                         "reduce-scatter; shard with FSDP2 (torch.distributed.fsdp.fully_shard), e.g. accelerate's "
                         "fsdp_version: 2")
    units = [(n, m) for n, m in mods if isinstance(m, FSDPModule)]
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return []
    if not units:
        raise ValueError("bitmatch: the model has DTensor parameters but no fully_shard-ed module (torch tensor "
                         "parallelism?); bitmatch runs FSDP2 (fully_shard) models, and its own tensor-parallel "
                         "layout (bitmatch.parallel.shard_dense_model)")
    lm = unwrap_causal_lm(model)
    layers = {id(layer) for layer in lm.model.layers}
    inside = {id(m) for layer in lm.model.layers for m in layer.modules() if m is not layer}
    root_name, root = units[0]
    below = {id(m) for m in root.modules()}
    stray = [n for n, m in units if id(m) not in below]
    if id(root) in layers or stray:
        raise ValueError(f"bitmatch: {stray[0] if stray else root_name or type(root).__name__!r} is fully_shard-ed "
                         "but no fully_shard-ed module "
                         "holds every other one; fully_shard the model itself too (FSDP2's root unit, which holds "
                         "the embedding, the final norm and the head)")
    outer = []
    for name, m in units:
        if id(m) in inside:
            raise ValueError(f"bitmatch: {name!r} is fully_shard-ed inside a decoder layer; bitmatch reads a layer's "
                             "weights inside the layer's own call, so shard whole decoder layers (and the root)")
        if id(m) in layers:
            if bound_forward(m) is None:
                raise ValueError(f"bitmatch: decoder layer {name!r} is fully_shard-ed but runs outside its __call__, "
                                 "where FSDP2 gathers its parameters; call bitmatch.patch(model) (before or after "
                                 "fully_shard) so bitmatch runs each layer through it")
            continue
        outer.append(m)
    return outer


def _enter(unit) -> types.MethodType:
    """``unit``'s forward method for bitmatch: ``fn()`` between FSDP2's pre- and post-forward hooks
    (registered once per module)."""
    if _FORWARD_METHOD not in unit.__dict__:
        setattr(unit, _FORWARD_METHOD, types.MethodType(lambda self, fn: fn(), unit))
        register_fsdp_forward_method(unit, _FORWARD_METHOD)
    return getattr(unit, _FORWARD_METHOD)


def fsdp_forward(units, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` inside the FSDP2 forward of every unit in ``units`` (``fsdp_units``'
    list, root outermost): their parameters whole during ``fn`` and, through the hooks FSDP2 puts
    on the returned tensors, during their backward, whose gradients FSDP2 reduce-scatters into
    the shards. Invariance: the result's bits are ``fn``'s on the unsharded model."""
    def run():
        with warnings.catch_warnings():
            # bitmatch's layers return reshape views (kernels.fused_add_rms_norm); nothing writes
            # them in place, so the pre-backward hook FSDP2 warns about stays attached
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            return fn(*args, **kwargs)

    def nest(i):
        return run() if i == len(units) else _enter(units[i])(lambda: nest(i + 1))
    return nest(0)



def fsdp_runner(model):
    """``bitmatch.wrappers``' handler for FSDP2 (registered by ``bitmatch``'s ``__init__``): None
    for a model with no unit to enter, else ``run(fn, *args)``, ``fn(model, *args)`` inside
    ``fsdp_forward``. Raises ``fsdp_units``' ValueErrors."""
    units = fsdp_units(model)
    if not units:
        return None
    return lambda fn, *args: fsdp_forward(units, fn, model, *args)

@contextlib.contextmanager
def fsdp_unsharded(model):
    """Every ``fully_shard``-ed module of ``model`` unsharded inside the block (resharded on exit,
    exception or not), for ``bitmatch.token_logprobs`` / ``forward_hidden`` / ``Engine`` on it.
    Forward only: the block runs under ``torch.no_grad()``, since gradients of the unsharded
    parameters would never reach FSDP2's reduce-scatter; to train, call ``bitmatch.token_logprobs``
    on the sharded model itself. Invariance: every rank's results equal the unsharded model's bit
    for bit."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("fsdp_unsharded: the model has no fully_shard-ed module (torch.distributed.fsdp."
                         "fully_shard); call bitmatch on the plain model instead")
    done = []
    try:
        for m in mods:
            m.unshard()
            done.append(m)
        with torch.no_grad():
            yield model
    finally:
        for m in reversed(done):
            m.reshard()
