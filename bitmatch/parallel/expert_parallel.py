"""Expert parallelism with EP = 1's bits: experts spread over ranks, no cross-rank sum.

Two layouts: ``expert_parallel_experts`` (every rank holds every token: EP = TP under tensor
parallelism) and ``data_parallel_experts`` (each rank its own tokens: data-parallel attention).

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
from bitmatch.precision import cast_param

from .collectives import TPGroup, all_gather_cat


def local_rows(param, lo: int, hi: int, num_experts: int):
    """A layer's expert tensor rows [lo, hi) of this rank: a slice of the whole [num_experts, ...]
    tensor, or the tensor itself once ``keep_local_experts`` left only those rows in the model."""
    return param[lo:hi] if param.shape[0] == num_experts else param


class ExpertRows:
    """What a MoE layer's shard (a dataclass with ``module``, ``lo``, ``hi``, ``dtype`` and
    ``num_experts``) reads of ``module.experts``: its rows [lo, hi) of the tensors named in
    ``EXPERT_TENSORS``, cast at use, whether the tensors are whole or ``keep_local_experts`` trimmed
    them; and, under data-parallel experts, its part of a forward it has no tokens for (``idle``)."""
    EXPERT_TENSORS = ("gate_up_proj", "down_proj")
    ACTIVATION = "swiglu"

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"{type(self).__name__}: num_experts (the layer's routed experts) is required")

    def expert_weights(self) -> tuple:
        ex = self.module.experts
        return tuple(cast_param(local_rows(getattr(ex, n), self.lo, self.hi, self.num_experts), self.dtype)
                     for n in self.EXPERT_TENSORS)

    def experts_trimmed(self) -> bool:
        return getattr(self.module.experts, self.EXPERT_TENSORS[0]).shape[0] != self.num_experts

    def data_parallel_group(self):
        """The EP group when each rank runs its own tokens (``enable_expert_parallel``), else None."""
        ep = getattr(self, "ep", None)  # DeepSeek-V4's shard keeps its EP group apart from its TP group
        if ep is not None:
            return ep
        return self.tp if getattr(self, "data_parallel", False) else None

    def idle(self) -> None:
        """This layer's collectives with no tokens of this rank's own (``data_parallel_idle``)."""
        data_parallel_idle(int(self.module.gate.top_k), *self.expert_weights(), self.num_experts,
                           self.data_parallel_group(), self.dtype, activation=self.ACTIVATION,
                           swiglu_limit=getattr(self, "limit", None))

    def partial_expert_tensors(self) -> list:
        """The expert tensors whose gradient on this rank covers its rows only (whole tensors; a
        trimmed tensor's gradient is whole)."""
        return [] if self.experts_trimmed() else [getattr(self.module.experts, n) for n in self.EXPERT_TENSORS]


def keep_only_rows(module, names, lo: int, hi: int, num_experts: int) -> None:
    """Replace ``module``'s expert tensors ``names`` by their rows [lo, hi) (new parameters; the whole
    tensors are freed once nothing else holds them)."""
    for name in names:
        p = getattr(module, name)
        if p.shape[0] == num_experts and hi - lo != num_experts:
            setattr(module, name, torch.nn.Parameter(p.data[lo:hi].clone(), requires_grad=p.requires_grad))


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
                   swiglu_limit=None, each_rank_its_own: bool = False) -> torch.Tensor:
    """y [T, k, H]: every (token, slot) row's expert output, each computed on its expert's rank.
    Invariance: bit for bit the y[t, r] of ``kernels.moe_experts`` at EP = 1.

    Each rank runs its own (token, slot) rows in one launch (weight 1.0, one slot each:
    round(fp32(1) * fp32(y)) is y itself, and a row's bits do not depend on which rows share the
    launch) and sends only those rows: every rank knows every row's owner from the replicated
    routing, so the rows travel compact (padded to the largest rank's count, (EP - 1) / EP x T x k
    x H values received per rank, as a stock all-to-all moves) and land by a selection, no
    arithmetic. The counts are read on the host (one sync per call, as the rows' ``nonzero`` was).
    ``each_rank_its_own``: every rank will use only its own tokens' rows (data-parallel tokens), so
    a row's gradient is summed over the ranks before it returns to the rank that computed it.
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
    everyone = all_gather_cat(y_mine[None], ep, dim=0, reduce_grad=each_rank_its_own).reshape(ep.world * most, H)
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


def _gather_tokens(x, ids, ep: TPGroup, *rest):
    """The ranks' token rows (x [T_rank, H], ids and ``rest`` [T_rank, k]) gathered in rank order as
    bytes, padded to the largest rank's count then the padding dropped: (sizes, x_all, ids_all,
    *rest_all). x's gather sums a row's gradient over the ranks (each rank uses the rows for its
    experts' share only)."""
    sizes = all_gather_cat(torch.tensor([x.shape[0]], device=x.device), ep, dim=0).tolist()
    most, t = max(sizes), x.shape[0]
    real = torch.cat([torch.arange(r * most, r * most + n, device=x.device) for r, n in enumerate(sizes)])

    def gather(v, **kw):
        v = torch.cat([v, v.new_zeros(most - t, *v.shape[1:])])[None]
        return all_gather_cat(v, ep, dim=0, **kw).reshape(-1, *v.shape[2:])[real]
    return (sizes, gather(x, reduce_grad=True), gather(ids), *(gather(v) for v in rest))


def data_parallel_experts(x, ids, weights, w_in_local, w_out_local, num_experts: int, ep: TPGroup, *,
                          activation="swiglu", swiglu_limit=None) -> torch.Tensor:
    """Expert parallelism under data-parallel attention (DeepSeek's serving layout: each rank its own
    tokens, the experts spread over the ranks). ``x`` [T_rank, H], ``ids`` / ``weights`` [T_rank, k]
    are this rank's tokens (any count, 0 included, every rank calling once per MoE layer); the
    ranks' tokens are gathered in rank order as bytes, every (token, slot) row is computed on its
    expert's rank (``expert_outputs``), and each rank combines its own tokens' rows in slot order.
    Invariance: bit for bit ``kernels.moe_experts`` of this rank's tokens in one process, whatever
    the other ranks' tokens and the EP degree. The token counts are read on the host (one sync)."""
    ids = ids.long()  # the ranks' id rows travel as bytes: one dtype everywhere (data_parallel_idle's)
    sizes, xs, idss = _gather_tokens(x, ids, ep)
    y = expert_outputs(xs, idss, w_in_local, w_out_local, num_experts, ep, activation=activation,
                       swiglu_limit=swiglu_limit, each_rank_its_own=True)
    start = sum(sizes[: ep.rank])
    return K.moe_combine(y[start:start + x.shape[0]], weights.float())


def allreduce_data_parallel_experts(x, ids, weights, w_in_local, w_out_local, num_experts: int,
                                    ep: TPGroup) -> torch.Tensor:
    """Stock expert parallelism under data-parallel attention: the ranks' tokens gathered, each rank
    combines its own experts' share of every token, the partial outputs all-reduced, each rank takes
    its rows. Not invariant: the control and the speed baseline (forward only)."""
    sizes, xs, idss, ws = _gather_tokens(x, ids.long(), ep, weights.float())
    y = allreduce_expert_parallel(xs, idss, ws, w_in_local, w_out_local, num_experts, ep)
    start = sum(sizes[: ep.rank])
    return y[start:start + x.shape[0]]


def data_parallel_idle(top_k: int, w_in_local, w_out_local, num_experts: int, ep: TPGroup, dtype, *,
                       activation="swiglu", swiglu_limit=None) -> None:
    """A rank with no tokens in a MoE layer the other ranks run (an engine with no request left, a
    trainer out of batches): ``data_parallel_experts`` on zero tokens, so it joins the layer's
    collectives and computes its experts' rows for the others' tokens. ``dtype``: the layer input's
    (the ranks' rows travel as bytes)."""
    dev = w_in_local.device
    data_parallel_experts(torch.empty(0, w_in_local.shape[-1], dtype=dtype, device=dev),
                          torch.empty(0, top_k, dtype=torch.long, device=dev),
                          torch.empty(0, top_k, dtype=torch.float32, device=dev), w_in_local, w_out_local,
                          num_experts, ep, activation=activation, swiglu_limit=swiglu_limit)


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
