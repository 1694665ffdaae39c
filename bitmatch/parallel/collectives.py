"""Fixed-order collectives for gather-only tensor parallelism, over torch.distributed.

The only collective the bitmatched TP layout uses is an all-gather, and it moves bits, never
adds them: every tensor crosses the wire as raw bytes (a ``uint8`` view) and is laid back out in
rank order, so the gathered tensor is bit for bit the concatenation of the ranks' tensors, on
any backend (gloo, NCCL) and any algorithm it picks (ring, tree, direct). An all-reduce would
add partials in the library's order (ring position, chunking, protocol): that is what makes
stock row-parallel layers TP-variant (``bitmatch.parallel.tensor_parallel.allreduce_row_parallel_linear``
is kept as the control).

``comm_bytes_per_layer`` counts what the gather-only layout moves against a ring all-reduce
(docs/scaling.md quotes its numbers).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: this process's ``rank`` in it, its size ``world`` and the
    torch.distributed process group (None: the default group). ``world == 1`` needs no
    torch.distributed at all (the TP = 1 layout runs the same code with no collective)."""
    rank: int
    world: int
    group: object = None

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"TPGroup: need 0 <= rank < world, got rank={self.rank}, world={self.world}")
        if self.world > 1:
            if not dist.is_initialized():
                raise ValueError(f"TPGroup: world={self.world} needs torch.distributed initialized "
                                 "(dist.init_process_group('gloo' or 'nccl', ...)) before the group is built")
            got = dist.get_world_size(self.group)
            if got != self.world or dist.get_rank(self.group) != self.rank:
                raise ValueError(f"TPGroup: rank={self.rank}, world={self.world} disagree with the process "
                                 f"group (rank {dist.get_rank(self.group)} of {got}); pass "
                                 "TPGroup.current(group) instead")

    @classmethod
    def current(cls, group=None) -> "TPGroup":
        """This process's place in ``group`` (default: the default group; TP = 1 when
        torch.distributed is not initialized)."""
        if not dist.is_initialized():
            return cls(0, 1, None)
        return cls(dist.get_rank(group), dist.get_world_size(group), group)


def _gather_bytes(t: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(tp.world)]
    dist.all_gather(parts, raw, group=tp.group)
    return torch.cat([p.view(t.dtype).reshape(t.shape) for p in parts], dim=dim)


# Backward passes need correct gradients, not invariant ones: they use ordinary all-reduces.
class _AllGatherCat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, tp, dim, reduce_grad):
        ctx.tp, ctx.dim, ctx.n, ctx.reduce_grad = tp, dim, t.shape[dim], reduce_grad
        return _gather_bytes(t, tp, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:  # each rank used the gathered tensor for its own share: sum the shares
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.tp.group)
        return g.narrow(ctx.dim, ctx.tp.rank * ctx.n, ctx.n), None, None, None


class _CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.tp.group)
        return g, None


def all_gather_cat(t: torch.Tensor, tp: TPGroup, dim: int = -1, *, reduce_grad: bool = False) -> torch.Tensor:
    """The ranks' ``t`` (same shape and dtype on every rank) concatenated along ``dim`` in rank order.

    Autograd: the gradient of this rank's part is its slice of the gathered tensor's gradient, where
    every rank uses the gathered tensor the same way (replicated consumers); ``reduce_grad``: where
    each rank uses it for its own share only (a row-parallel layer's input), the slice of the sum of
    the ranks' gradients. Invariance: the result is bit for bit ``torch.cat([t_0, ..., t_{world-1}],
    dim)``: the tensors travel as raw bytes and no element is ever added, so neither the backend nor
    its algorithm can change a bit.
    """
    if tp.world == 1:
        return t
    dim = dim % t.dim()
    if torch.is_grad_enabled() and t.requires_grad:
        return _AllGatherCat.apply(t, tp, dim, reduce_grad)
    return _gather_bytes(t, tp, dim)


def copy_to_ranks(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``x`` (the same on every rank) where it enters the ranks' column shards: identity forward,
    the gradient summed over the ranks in backward (Megatron's f). Invariance: returns ``x`` itself."""
    if tp.world == 1 or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _CopyToRanks.apply(x, tp)


def comm_bytes_per_layer(tokens: int, hidden: int, attn_out: int, intermediate: int, tp: int,
                         elem_bytes: int = 2) -> dict:
    """Bytes each rank sends per decoder layer at tensor parallel ``tp``, for ``tokens`` tokens.

    ``attn_out``: the attention output width (heads * head_dim, o_proj's K); ``intermediate``: the
    MLP's (down_proj's K). A ring all-gather of a tensor of S bytes in total sends (tp-1)/tp * S
    per rank; a ring all-reduce sends twice that (reduce-scatter + all-gather).
    - ``allreduce``: stock row-parallel o_proj and down_proj, one all-reduce of [tokens, hidden]
      each (the partials in ``elem_bytes``, as vLLM and Megatron reduce them).
    - ``gather``: the bitmatched layout, per row-parallel layer an all-gather of its input
      [tokens, K] and one of its output [tokens, hidden].
    - ``partials``: the other exact option (all-gather each rank's fp32 partial [tokens, hidden]
      and add them locally in rank order): (tp-1) * tokens * hidden * 4 per rank.
    """
    if tp < 2:
        return {"allreduce": 0, "gather": 0, "partials": 0, "ratio": 1.0}
    f = (tp - 1) / tp
    allreduce = 2 * f * tokens * hidden * elem_bytes * 2            # o_proj + down_proj
    gather = f * tokens * elem_bytes * ((attn_out + hidden) + (intermediate + hidden))
    partials = (tp - 1) * tokens * hidden * 4 * 2
    return {"allreduce": int(allreduce), "gather": int(gather), "partials": int(partials),
            "ratio": gather / allreduce}
