"""bitmatch.parallel: parallel layouts whose bits equal one process's.

``tensor_parallel``: gather-only tensor parallelism for the dense family and Qwen3-MoE (no
cross-rank sums, so TP = N gives TP = 1's bits with every kernel's canonical order unchanged);
``expert_parallel``: experts spread over ranks, combined in the one-rank slot order;
``collectives``: the fixed-order, bytes-only all-gather they run on; ``fsdp``: FSDP2-sharded models
on bitmatch's forward. docs/scaling.md has the design and its costs.
"""
from bitmatch.parallel.collectives import TPGroup, all_gather_cat, comm_bytes_per_layer
from bitmatch.parallel.expert_parallel import allreduce_expert_parallel, expert_parallel_experts
from bitmatch.parallel.fsdp import fsdp_unsharded
from bitmatch.parallel.tensor_parallel import (
    DenseShard, allreduce_row_parallel_linear, cache_groups, compute_logits, disable_tensor_parallel,
    enable_tensor_parallel, forward_hidden, gathered_row_parallel_linear, shard_dense_model, shard_linear,
    token_logprobs,
)

__all__ = [
    "TPGroup", "all_gather_cat", "comm_bytes_per_layer", "DenseShard", "shard_dense_model", "shard_linear",
    "gathered_row_parallel_linear", "allreduce_row_parallel_linear", "forward_hidden", "compute_logits",
    "token_logprobs", "cache_groups", "enable_tensor_parallel", "disable_tensor_parallel",
    "fsdp_unsharded", "expert_parallel_experts", "allreduce_expert_parallel",
]
