"""FSDP2 (``torch.distributed.fsdp.fully_shard``) models on bitmatch's forward.

FSDP2 keeps each parameter as a DTensor shard and gathers the full parameter in a pre-forward hook
on the module's ``__call__``. bitmatch's forward reads ``module.weight`` and calls its kernels
directly (``bitmatch.models.dense``), so those hooks never run and the kernels meet DTensor shards
(torch: "aten.embedding.default got mixed torch.Tensor and DTensor"). ``fsdp_unsharded`` gathers
them for a block instead. The gather moves parameter bytes (no arithmetic), and every rank then
computes full tokens with the whole weights: TP = 1's bits, whatever the number of shards.
"""
from __future__ import annotations

import contextlib

from torch.distributed.fsdp import FSDPModule


@contextlib.contextmanager
def fsdp_unsharded(model):
    """Every ``fully_shard``-ed module of ``model`` unsharded inside the block (resharded on exit,
    exception or not), for ``bitmatch.token_logprobs`` / ``forward_hidden`` / ``Engine`` on it.
    Forward only: gradients through the unsharded parameters do not reach FSDP2's reduce-scatter.
    Invariance: every rank's results equal the unsharded model's bit for bit."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("fsdp_unsharded: the model has no fully_shard-ed module (torch.distributed.fsdp."
                         "fully_shard); call bitmatch on the plain model instead")
    done = []
    try:
        for m in mods:
            m.unshard()
            done.append(m)
        yield model
    finally:
        for m in reversed(done):
            m.reshard()
