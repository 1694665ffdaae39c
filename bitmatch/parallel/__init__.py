"""bitmatch.parallel: parallel layouts whose bits equal one process's.

``tensor_parallel``: gather-only tensor parallelism (no cross-rank sums, so TP = N gives TP = 1's
bits with every kernel's canonical order unchanged): the ``Sharder`` a family's ``Family.shard``
declares its layout on, ``enable_tensor_parallel`` and the TP trainer's ``reduce_tp_gradients``;
each family's layout lives next to its forward (``Family.shard``); ``expert_parallel``:
experts spread over ranks, combined in the one-rank slot order; ``collectives``: the fixed-order,
bytes-only all-gather they run on; ``fsdp``: FSDP2-sharded models on bitmatch's forward and
backward; ``ddp``: DistributedDataParallel models run inside DDP's forward. docs/scaling.md has the
design and its costs.

Names are imported lazily (as in ``bitmatch``): ``tensor_parallel`` must not pull ``fsdp``
(``torch.distributed.fsdp``, ~0.7 s) with it. The engine imports nothing here: it reads what
``enable_tensor_parallel`` sets on the model (``registry.tp_shard`` / ``tp_step``). ``fsdp`` and
``ddp`` reach the core only through ``bitmatch.wrappers``, where ``bitmatch``'s ``__init__``
registers their handlers.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "TPGroup": "collectives", "all_gather_cat": "collectives", "comm_bytes_per_layer": "collectives",
    "expert_parallel_experts": "expert_parallel", "allreduce_expert_parallel": "expert_parallel",
    "data_parallel_experts": "expert_parallel", "data_parallel_idle": "expert_parallel",
    "allreduce_data_parallel_experts": "expert_parallel",
    "fsdp_unsharded": "fsdp", "fsdp_forward": "fsdp", "fsdp_units": "fsdp",
    **{name: "tensor_parallel" for name in (
        "Sharder", "allreduce_row_parallel_linear", "cache_groups", "compute_logits", "data_parallel_group",
        "disable_tensor_parallel", "enable_expert_parallel", "enable_tensor_parallel", "forward_hidden",
        "gathered_row_parallel_linear", "idle_step", "keep_local_experts", "reduce_data_parallel_gradients",
        "reduce_tp_gradients", "shard_dense_model", "shard_linear", "shard_model", "step_data_parallel",
        "token_logprobs")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"bitmatch.parallel.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'bitmatch.parallel' has no attribute {name!r}")
