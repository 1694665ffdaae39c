"""Expert parallelism with EP = 1's bits: experts spread over ranks, no cross-rank sum.

``kernels.moe_experts``' canonical order: each (token t, slot r) row goes through its expert's
invariant linear (y[t, r] in x's dtype, its bits independent of the other rows), then
``out_t = round(sum over r = 0..k-1 in slot order of fp32(w[t, r]) * fp32(y[t, r]))``. Stock
expert parallelism combines each rank's experts' share on that rank and adds the ranks' partial
sums (an all-reduce or an all-to-all followed by a sum): another order. Here each rank computes
y[t, r] for the slots its experts own, the rows travel as bytes (an all-gather in this
simulation; the all-to-all of a real deployment moves bytes too), and the combine runs over the
full [T, k, H] in slot order through ``kernels.moe_combine``: the very combine the one-rank
``moe_experts`` ends with, on either backend (the CPU reference, or the Triton kernel on CUDA).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bitmatch.kernels as K

from .collectives import TPGroup, all_gather_cat


def _check(ids, num_experts: int, ep: TPGroup, w_in_local) -> int:
    if num_experts % ep.world:
        raise ValueError(f"expert_parallel: num_experts = {num_experts} is not divisible by the EP degree "
                         f"{ep.world}; use a degree that divides it")
    local = num_experts // ep.world
    if w_in_local.shape[0] != local:
        raise ValueError(f"expert_parallel: w_in_local holds {w_in_local.shape[0]} experts, rank {ep.rank} of "
                         f"{ep.world} owns {local} (experts [{ep.rank * local}, {(ep.rank + 1) * local}))")
    return local


def expert_outputs(x, ids, w_in_local, w_out_local, num_experts: int, ep: TPGroup, *, activation="swiglu",
                   swiglu_limit=None) -> torch.Tensor:
    """y [T, k, H]: every (token, slot) row's expert output, each computed on its expert's rank.
    Invariance: bit for bit the y[t, r] of ``kernels.moe_experts`` at EP = 1.

    Each rank runs its own (token, slot) rows in one launch (weight 1.0, one slot each:
    round(fp32(1) * fp32(y)) is y itself, and a row's bits do not depend on which rows share the
    launch) and sends only those rows: every rank knows every row's owner from the replicated
    routing, so the rows travel compact (padded to the largest rank's count, (EP - 1) / EP x T x k
    x H values received per rank, as a stock all-to-all moves) and land by a selection, no
    arithmetic. The counts are read on the host (one sync per call, as the rows' ``nonzero`` was).
    """
    local = _check(ids, num_experts, ep, w_in_local)
    lo = ep.rank * local
    T, k = ids.shape
    H = x.shape[1]
    owner = (ids // local).reshape(-1).long()              # [T k]: the rank computing each row
    counts = torch.bincount(owner, minlength=ep.world).tolist()
    most = max(counts) if counts else 0
    rows = (owner == ep.rank).nonzero()[:, 0]              # this rank's rows, ascending
    y_mine = x.new_zeros(most, H)
    if rows.numel():
        ones = torch.ones(rows.numel(), 1, dtype=torch.float32, device=x.device)
        tok, slot_ids = rows // k, ids.reshape(-1)[rows, None] - lo
        y_mine = torch.cat([K.moe_experts(x[tok], slot_ids, ones, w_in_local, w_out_local, activation=activation,
                                          swiglu_limit=swiglu_limit),
                            y_mine[rows.numel():]])
    everyone = all_gather_cat(y_mine[None], ep, dim=0).reshape(ep.world * most, H)  # rank order
    # row p comes from rank owner[p], at its place among that rank's rows (ascending p, as sent)
    place = (F.one_hot(owner, ep.world).cumsum(0) - 1).gather(1, owner[:, None])[:, 0]
    return everyone[owner * most + place].reshape(T, k, H)


def expert_parallel_experts(x, ids, weights, w_in_local, w_out_local, num_experts: int, ep: TPGroup, *,
                            activation="swiglu", swiglu_limit=None) -> torch.Tensor:
    """``kernels.moe_experts(x, ids, weights, w_in, w_out)`` with rank ``ep.rank`` holding experts
    [rank * E/N, (rank + 1) * E/N) (``w_in_local``, ``w_out_local``). Invariance: bit for bit
    EP = 1's output on every rank, for any EP degree dividing the expert count."""
    y = expert_outputs(x, ids, w_in_local, w_out_local, num_experts, ep, activation=activation,
                       swiglu_limit=swiglu_limit)
    return K.moe_combine(y, weights.float())


def allreduce_expert_parallel(x, ids, weights, w_in_local, w_out_local, num_experts: int, ep: TPGroup) -> torch.Tensor:
    """Stock expert parallelism: each rank combines its own experts' slots (the others weigh 0) and
    the ranks' partial outputs are summed by an all-reduce. Not EP-invariant: the control."""
    local = _check(ids, num_experts, ep, w_in_local)
    lo = ep.rank * local
    mine = (ids >= lo) & (ids < lo + local)
    part = K.moe_experts(x, torch.where(mine, ids - lo, 0), torch.where(mine, weights.float(), 0.0),
                         w_in_local, w_out_local)
    if ep.world > 1:
        dist.all_reduce(part, group=ep.group)
    return part
