"""Gather-only tensor parallelism: TP = N gives TP = 1's bits. The mechanisms; each family declares
its own layout (``Family.shard``: which module splits how) next to its forward, on a ``Sharder``.

Stock TP (Megatron, vLLM) is not TP-invariant: a row-parallel layer (o_proj, down_proj) splits
K over the ranks and an all-reduce adds their partials in the collective's order. Here no rank
ever adds another rank's numbers, so no kernel's canonical order changes. Two files:

- the pieces (``sharder.py``): column-parallel slices with the full K reduction, row-parallel layers
  by gather (all-gather the input in rank order, i.e. in K order, then the output columns), the MoE
  experts over the same ranks, the vocab-parallel head; each output element computed on one rank by
  the same kernel as TP = 1;
- this module: the sharded model (``shard_model``, ``enable_tensor_parallel``; ``enable_expert_parallel``
  for data-parallel attention), its forward, logits and logprobs on every rank, and the gradients'
  sums over the ranks in rank order.

The all-gathers move raw bytes (``bitmatch.parallel.collectives``); norms and the residual stream
run replicated on full rows. ``allreduce_row_parallel_linear`` is the stock layer, kept as the
control that differs. Backward: correct gradients, not invariant ones (ordinary all-reduces where a
replicated tensor enters the column shards and under row-parallel inputs, Megatron's f and g).
"""
from __future__ import annotations

import functools

import torch

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.logprobs import check_temperature, pack_rows
from bitmatch.models import CacheGroup, compute_dtype_of, family_of, unwrap_causal_lm
from bitmatch.models.registry import forget_spec, tp_shard
from bitmatch.models.state import create_state, drop_state

from .collectives import TPGroup, all_gather_cat
from .expert_parallel import keep_only_rows
from .sharder import (
    AllreduceRowShard as AllreduceRowShard,
    ColumnShard as ColumnShard,
    ExpertShard as ExpertShard,
    GatherRowShard as GatherRowShard,
    Sharder,
    VocabShard as VocabShard,
    allreduce_row_parallel_linear as allreduce_row_parallel_linear,
    gathered_row_parallel_linear as gathered_row_parallel_linear,
    shard_linear as shard_linear,
)


def shard_model(model, tp: TPGroup, compute_dtype: torch.dtype | None = None, row_parallel: str = "gather",
                data_parallel_experts: TPGroup | None = None, who: str = "shard_model"):
    """This rank's shard of ``model`` in its family's layout (``Family.shard``, built on a ``Sharder``),
    not yet set on the model (``enable_tensor_parallel`` sets it). Invariance: its ``forward_hidden`` /
    ``compute_logits`` / ``token_logprobs`` give every rank TP = 1's bits (``row_parallel="allreduce"``:
    the stock layout, which does not). ``data_parallel_experts`` (with ``tp`` of one rank): each rank
    runs its own tokens, the routed experts spread over that group's ranks (``enable_expert_parallel``)."""
    lm = unwrap_causal_lm(model)
    if tp_shard(lm) is not None:
        raise ValueError(f"{who}: the model runs tensor parallel already; "
                         "disable_tensor_parallel(model) before sharding it again")
    fam = family_of(lm)
    dt = compute_dtype if compute_dtype is not None else compute_dtype_of(lm)
    shard = fam.shard(lm, Sharder(tp, dt, row_parallel, data_parallel_experts, who))
    if shard is None:
        raise ValueError(f"{who}: family {fam.name!r} declares no tensor-parallel layout (Family.shard)")
    return shard


def shard_dense_model(model, tp: TPGroup, compute_dtype: torch.dtype | None = None, row_parallel: str = "gather",
                      data_parallel_experts: TPGroup | None = None):
    """``shard_model`` under its former name (the dense family and Qwen3-MoE were its first layouts)."""
    return shard_model(model, tp, compute_dtype, row_parallel, data_parallel_experts, who="shard_dense_model")


def forward_hidden(shard, input_ids: torch.Tensor, ctx: ForwardContext, recorder=None) -> torch.Tensor:
    """Packed tokens [T] -> final-norm hidden states [T, hidden], the same on every rank, through the
    family's own forward on the rank's share. Invariance: bit for bit ``bitmatch.models.forward_hidden``
    of the unsharded model, at any TP degree."""
    return shard.forward_hidden(input_ids, ctx, recorder)


def compute_logits(shard, hidden: torch.Tensor) -> torch.Tensor:
    """Full logits [N, vocab] on every rank (each rank's vocab slice, all-gathered in rank order).
    Invariance: bit for bit the unsharded model's ``bitmatch.models.compute_logits``."""
    return shard.compute_logits(hidden)


def token_logprobs(shard, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0) -> torch.Tensor:
    """fp32 [B, L-1]: ``bitmatch.token_logprobs``'s result (full vocabulary; no top-k / top-p)
    through a rank's shard of any family (its ``forward_hidden`` / ``compute_logits``), on every rank.
    Invariance: bit for bit TP = 1's."""
    temperature = check_temperature("tensor_parallel.token_logprobs", temperature)
    if attention_mask is not None:
        attention_mask = attention_mask.detach().to("cpu")
    B, L = input_ids.shape
    out = torch.zeros((B, max(L - 1, 0)), dtype=torch.float32, device=input_ids.device)
    p, longest = pack_rows(input_ids, attention_mask)
    if p.input_ids.numel() == 0:
        return out
    ctx = ForwardContext(positions=p.positions, cu_seqlens=p.cu_seqlens, max_query_len=longest,
                         max_seq_len=longest, cu_seqlens_host=p.cu_host)
    hidden = shard.forward_hidden(p.input_ids, ctx)
    src = torch.nonzero(~p.seq_end)[:, 0]
    if src.numel() == 0:
        return out
    tgt = src + 1
    lp = K.token_logprobs(shard.compute_logits(hidden[src]), p.input_ids[tgt], temperature)
    return out.index_put((p.rows[tgt], p.cols[tgt] - 1), lp.to(torch.float32))


def enable_tensor_parallel(model, tp: TPGroup, compute_dtype: torch.dtype | None = None, **layout):
    """Run ``model`` as rank ``tp.rank`` of a gather-only TP layout everywhere bitmatch runs it
    (``bitmatch.models.forward_hidden`` / ``compute_logits`` / ``cache_groups``, hence the embedded
    ``bitmatch.Engine``, one process per rank, each sampling the same token from the same gathered
    logits). No CUDA graphs. ``layout``: the layout's options (``row_parallel="allreduce"``: the stock
    layout, a control; ``data_parallel_experts``). Invariance: every rank gets TP = 1's bits."""
    lm = unwrap_causal_lm(model)
    if tp_shard(lm) is not None:
        raise ValueError("enable_tensor_parallel: the model runs tensor parallel already; "
                         "disable_tensor_parallel(model) before sharding it again")
    shard = shard_model(lm, tp, compute_dtype, who="enable_tensor_parallel", **layout)
    st = create_state(lm)
    st.tp = shard
    group = data_parallel_group(lm)  # the engine steps the ranks together through the model's state
    st.tp_step = None if group is None else functools.partial(step_data_parallel, group=group)
    forget_spec(lm)  # the rank's spec names its own heads (its caches)
    return shard


def enable_expert_parallel(model, ep: TPGroup, compute_dtype: torch.dtype | None = None, **layout):
    """Data-parallel attention, expert-parallel MoE (how DeepSeek models are served): every rank runs
    its own tokens through the whole model except the routed experts, which are spread over ``ep``'s
    ranks (rank r holds experts [r E/N, (r + 1) E/N)); a MoE layer gathers the ranks' tokens, computes
    each (token, slot) row on its expert's rank and combines each token's rows on its own rank
    (``data_parallel_experts``). Every rank must run every MoE layer the same number of times (the
    trainer: the same number of ``token_logprobs`` calls; the engine: the same number of steps).
    Invariance: each rank's tokens get the one-process bits, whatever the other ranks run.
    ``layout``: the builder's options (Qwen3-MoE's ``row_parallel="allreduce"``: stock EP, a control)."""
    return enable_tensor_parallel(model, TPGroup(0, 1), compute_dtype, data_parallel_experts=ep, **layout)


def idle_step(model) -> None:
    """Under ``enable_expert_parallel``, a rank with nothing to run while the others run a forward
    (a trainer out of batches): the forward's MoE collectives with no tokens of its own, so the
    others' step completes. ``step_data_parallel`` does this for the engine."""
    moe = [m for m in getattr(tp_shard(unwrap_causal_lm(model)), "moe_shards", list)()
           if m.data_parallel_group() is not None]
    if not moe:
        raise ValueError("idle_step: the model does not run data-parallel experts; enable_expert_parallel(model, ep) "
                         "first")
    with torch.no_grad():
        for m in moe:  # in layer order, as a forward reaches them
            m.idle()


def data_parallel_group(model) -> TPGroup | None:
    """The group whose ranks must step together (``enable_expert_parallel``), or None."""
    for m in getattr(tp_shard(unwrap_causal_lm(model)), "moe_shards", list)():
        group = m.data_parallel_group()
        if group is not None:
            return group
    return None


def step_data_parallel(engine, group: TPGroup):
    """One ``engine.step()`` of every rank of ``group`` under ``enable_expert_parallel``: the ranks
    agree first who runs a forward; a rank with no request left (or whose scheduler ran nothing)
    joins the others' MoE collectives with no tokens. Returns this rank's finished requests, or None
    once no rank has a request left. Every rank calls it the same number of times (loop until None)."""
    mine = engine.has_unfinished_requests()
    dev = next(unwrap_causal_lm(engine.model).parameters()).device  # NCCL gathers device tensors
    busy = all_gather_cat(torch.tensor([int(mine)], device=dev), group, dim=0)
    if not bool(busy.any()):
        return None
    runner = engine.model_runner
    before = runner.num_steps
    out = engine.step() if mine else []
    if runner.num_steps == before:  # no forward ran here: the busy ranks' forward still needs this one
        idle_step(engine.model)
    return out


def reduce_tp_gradients(model) -> None:
    """After a backward on a tensor-parallel rank: every partial gradient (the shard's
    ``partial_parameters``) replaced by the sum of the ranks' parts, gathered as bytes and added in
    rank order on every rank, so each rank holds the whole-model gradient (TP = 1's within fp32
    rounding: backward needs correct, not invariant, gradients) with the same bits on every rank;
    an optimizer stepping each rank's copy then keeps the copies equal, and the next forward gives
    TP = 1's bits for the updated weights. Tied embeddings are refused: the embedding's gradient is
    whole on every rank and the head's is a part, in one tensor."""
    lm = unwrap_causal_lm(model)
    shard = tp_shard(lm)
    if shard is None:
        raise ValueError("reduce_tp_gradients: the model does not run tensor parallel; "
                         "enable_tensor_parallel(model, tp) first")
    parts = getattr(shard, "partial_parameters", None)
    if parts is None:
        raise ValueError(f"reduce_tp_gradients: the {family_of(lm).name} layout does not list its partial "
                         "gradients (no partial_parameters)")
    emb = lm.get_input_embeddings()
    if emb is not None and emb.weight is lm.lm_head.weight:
        raise ValueError("reduce_tp_gradients: tie_word_embeddings=True (the shared tensor's gradient is whole "
                         "from the embedding and partial from the vocab-parallel head); train an untied model")
    _sum_over_ranks(parts(), shard.tp)


def _sum_over_ranks(params, group: TPGroup) -> None:
    """Each parameter's gradient replaced by the ranks' gradients gathered as bytes and added in rank
    order: the same bits on every rank."""
    if group.world == 1:
        return
    for p in params:
        if p.grad is None:
            continue
        whole = all_gather_cat(p.grad.detach().unsqueeze(0), group, dim=0)
        acc = whole[0].clone()
        for r in range(1, group.world):
            acc += whole[r]
        p.grad.copy_(acc)


def keep_local_experts(model, *, ddp: bool = False) -> int:
    """Free the routed experts this rank does not run: each MoE layer's expert tensors replaced by
    this rank's rows (EP = TP, or ``enable_expert_parallel``), which is what makes a model whose
    experts do not fit one GPU (DeepSeek-V4-Flash: 277 B of its 284 B parameters) fit N. Load the
    model where it fits (CPU memory), enable the layout, call this, then move it to the GPU. The
    model then runs only in this layout: ``disable_tensor_parallel`` refuses it, and a weight sync
    must send this rank's rows. The trimmed tensors are named to DDP as parameters to ignore
    (``model`` and the causal LM inside): each rank's differ, so DDP must neither broadcast nor
    average them. ``ddp=True`` when a DistributedDataParallel wrapper (accelerate, TRL, torchrun
    data parallel) averages the other gradients: the trimmed tensors' gradients (whole on their rank:
    every rank's tokens' share) are divided by the world size to match; ``ddp=False`` for
    ``reduce_data_parallel_gradients`` (sums) or inference, and a DDP forward then refuses the model.
    Returns the number of expert parameters this rank keeps. Bits unchanged: the shard reads the
    same rows."""
    lm = unwrap_causal_lm(model)
    shard = tp_shard(lm)
    if shard is None or not hasattr(shard, "moe_shards"):
        raise ValueError("keep_local_experts: the model runs no expert-parallel layout; enable_tensor_parallel or "
                         "enable_expert_parallel first")
    kept = 0
    for m in shard.moe_shards():
        ex = m.module.experts
        keep_only_rows(ex, m.EXPERT_TENSORS, m.lo, m.hi, m.num_experts)
        kept += sum(getattr(ex, n).numel() for n in m.EXPERT_TENSORS)
    trimmed = {id(getattr(m.module.experts, n)) for m in shard.moe_shards() if m.experts_trimmed()
               for n in m.EXPERT_TENSORS}
    for root in {id(model): model, id(lm): lm}.values():
        names = [n for n, p in root.named_parameters() if id(p) in trimmed]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(root, names)
    if ddp and not getattr(shard, "trimmed_for_ddp", False):
        world = shard.moe_shards()[0].data_parallel_group() or shard.tp
        for p in lm.parameters():
            if id(p) in trimmed:
                p.register_hook(lambda g, n=world.world: g / n)
    shard.trimmed_for_ddp = bool(ddp) or getattr(shard, "trimmed_for_ddp", False)
    return kept


def reduce_data_parallel_gradients(model) -> None:
    """After a backward under ``enable_expert_parallel`` (each rank its own batch): every gradient
    replaced by the sum over the ranks, gathered as bytes and added in rank order on every rank, so
    each rank holds the gradient one process computes for the summed loss of all the ranks' batches
    (within fp32 rounding) with the same bits everywhere, and an optimizer keeps the copies equal.
    A rank's gradient of a shared weight is its batch's part; of a whole expert tensor, the rows of
    its own experts (every rank's tokens' share, gathered in the MoE layers) and zeros elsewhere; a
    tensor ``keep_local_experts`` trimmed holds only the rank's experts and is left as it is. Sum,
    not mean: scale the loss for a mean."""
    lm = unwrap_causal_lm(model)
    shard = tp_shard(lm)
    moe = getattr(shard, "moe_shards", list)()
    if shard is None or not moe or shard.tp.world != 1:
        raise ValueError("reduce_data_parallel_gradients: the model does not run data-parallel experts; "
                         "enable_expert_parallel(model, ep) first (tensor parallel: reduce_tp_gradients)")
    ep = getattr(moe[0], "ep", None) or moe[0].tp  # DeepSeek-V4's shard names its EP group ep
    if getattr(shard, "trimmed_for_ddp", False):
        raise ValueError("reduce_data_parallel_gradients: keep_local_experts(ddp=True) set the model up for a "
                         "DistributedDataParallel wrapper, which reduces the gradients itself")
    if ep.world == 1:
        return
    local = {id(getattr(m.module.experts, n)) for m in moe if m.experts_trimmed() for n in m.EXPERT_TENSORS}
    _sum_over_ranks([p for p in lm.parameters() if id(p) not in local], ep)


def disable_tensor_parallel(model) -> None:
    """Back to the one-process forward (refused once ``keep_local_experts`` dropped other ranks' experts)."""
    lm = unwrap_causal_lm(model)
    shard = tp_shard(lm)
    for m in getattr(shard, "moe_shards", list)():
        if m.experts_trimmed():
            raise ValueError("disable_tensor_parallel: the model holds only this rank's experts (keep_local_experts); "
                             "load it again to run it as one process")
    drop_state(lm, "tp", "tp_step")
    forget_spec(lm)


def cache_groups(shard) -> list[CacheGroup]:
    """The engine caches of this rank's share (its KV heads; ``bitmatch.models.allocate_caches`` builds them)."""
    return shard.cache_groups()
