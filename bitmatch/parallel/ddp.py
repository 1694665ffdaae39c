"""DistributedDataParallel models on bitmatch's forward: gradients synchronized as DDP's own forward has them.

DDP all-reduces gradients only for a backward its own ``forward`` prepared (its reducer's
``prepare_for_forward`` / ``prepare_for_backward``); ``bitmatch.token_logprobs`` computes from the
module inside the wrapper, so without this each rank would keep its own gradients and the replicas
would drift apart (tests/test_ddp.py). ``ddp_forward`` (through ``ddp_runner``, the
``bitmatch.wrappers`` handler) runs the computation as the wrapped module's forward, inside the
wrapper's call: the same bits as the plain module, DDP's gradient sync on.
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from bitmatch.models import unwrap_causal_lm
from bitmatch.models.registry import tp_shard


def ddp_wrapper(model) -> DistributedDataParallel | None:
    """``model`` itself when it is a DDP wrapper (accelerate's and torchrun's data parallel), else None."""
    return model if isinstance(model, DistributedDataParallel) else None


def ddp_runner(model):
    """``bitmatch.wrappers``' handler for DDP (registered by ``bitmatch``'s ``__init__``): None for a
    model that is not a DDP wrapper, else ``run(fn, *args)``, ``fn(model.module, *args)`` inside
    ``ddp_forward``."""
    ddp = ddp_wrapper(model)
    if ddp is None:
        return None
    return lambda fn, *args: ddp_forward(ddp, fn, ddp.module, *args)


def ddp_forward(ddp: DistributedDataParallel, fn, *args):
    """``fn(*args)`` run as ``ddp.module``'s forward inside ``ddp()``: DDP's pre- and post-forward
    (buffer broadcast, reducer preparation for the backward) wrap it."""
    mod = ddp.module
    shard = tp_shard(unwrap_causal_lm(mod))
    trimmed = any(m.experts_trimmed() for m in getattr(shard, "moe_shards", list)())
    if trimmed and not getattr(shard, "trimmed_for_ddp", False):
        raise ValueError("DistributedDataParallel: the model holds only this rank's experts and DDP averages the other "
                         "gradients; call keep_local_experts(model, ddp=True) so the experts' gradients match")
    had = "forward" in mod.__dict__
    saved = mod.__dict__.get("forward")
    mod.forward = lambda: fn(*args)
    try:
        return ddp()
    finally:
        if had:
            mod.forward = saved
        else:
            del mod.forward
