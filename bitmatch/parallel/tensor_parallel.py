"""Gather-only tensor parallelism: TP = N gives TP = 1's bits. The mechanisms; each family declares
its own layout (``Family.shard``: which module splits how) next to its forward, on a ``Sharder``.

Stock TP (Megatron, vLLM) is not TP-invariant: a row-parallel layer (o_proj, down_proj) splits
K over the ranks and an all-reduce adds their partials in the collective's order. Here no rank
ever adds another rank's numbers, so no kernel's canonical order changes:

- column-parallel (``Sharder.column``: q/k/v by heads, gate/up by intermediate columns): each output
  element is computed on one rank by the same kernel with the full K reduction (``shard_linear``;
  ``kernels.linear``'s contract: a column's bits depend only on its row of x, its weight row and
  bias). Attention, q/k norms, RoPE and silu_and_mul work per head / per element, so they run on
  the rank's heads / columns.
- row-parallel by gather (``Sharder.row``, ``gathered_row_parallel_linear``): all-gather the layer's
  input (each rank's heads' outputs or MLP intermediate columns) in rank order, i.e. in K order;
  each rank computes its hidden/N output columns with the full K; all-gather the columns.
- MoE layers (``Sharder.experts``): the experts spread over the same ranks (``expert_parallel``),
  after the family's own router, replicated.
- vocab-parallel head (``Sharder.vocab``): each rank's vocab slice of the logits, all-gathered to
  full rows, then the same ``kernels.token_logprobs`` / sampler as TP = 1.

The all-gathers move raw bytes (``bitmatch.parallel.collectives``); norms and the residual stream
run replicated on full rows. ``allreduce_row_parallel_linear`` is the stock layer, kept as the
control that differs. Backward: correct gradients, not invariant ones (ordinary all-reduces where a
replicated tensor enters the column shards and under row-parallel inputs, Megatron's f and g).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.kernels.linear import LinearFunction
from bitmatch.logprobs import check_temperature, pack_rows
from bitmatch.models import CacheGroup, compute_dtype_of, family_of, lora, unwrap_causal_lm
from bitmatch.models.registry import forget_spec, tp_shard
from bitmatch.models.state import create_state, drop_state
from bitmatch.precision import cast_param

from .collectives import TPGroup, all_gather_cat, copy_to_ranks
from .expert_parallel import (
    ExpertRows,
    allreduce_data_parallel_experts,
    data_parallel_experts,
    expert_parallel_experts,
    keep_only_rows,
)

# ----------------------------------------------------------------------------- linear layers

class CanonicalSplitLinear(LinearFunction):
    """``kernels.linear``'s Function on the Triton backend with an explicit K split (its backward)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, split):
        from bitmatch.kernels.triton import linear as triton_linear  # optional: triton

        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return triton_linear.linear(x2d, weight, bias, split=split)


def shard_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, full_n: int) -> torch.Tensor:
    """``kernels.linear(x, weight, bias)`` where ``weight`` is a row slice of a weight of ``full_n``
    rows. Invariance: bit for bit those columns of the full layer's ``kernels.linear``.

    The reference backend is exact (any column split, same bits). On Triton the canonical K split is
    a function of the weight's (N, K) (``linear_split_table``: Qwen3-8B's o_proj 4096 x 4096 runs 2 K
    chunks, a 2048 x 4096 slice would run 1), so the slice runs the full weight's split.
    """
    if K.backend_for(x) == "reference":
        return K.linear(x, weight, bias)
    from bitmatch.kernels.triton import linear as triton_linear  # optional: triton

    k = weight.shape[1]
    split = triton_linear.split_for(full_n, k)
    if split == triton_linear.split_for(weight.shape[0], k):
        return K.linear(x, weight, bias)
    lead = x.shape[:-1]
    out = CanonicalSplitLinear.apply(x.reshape(-1, k).contiguous(), weight.contiguous(), bias, split)
    return out.reshape(*lead, weight.shape[0])


def gathered_row_parallel_linear(x_shard, weight_rows, bias_rows, full_n: int, tp: TPGroup) -> torch.Tensor:
    """A row-parallel layer with no cross-rank sum: ``x_shard`` [T, K/N] is this rank's K columns
    (rank order = K order), ``weight_rows`` [full_n/N, K] this rank's output rows with the full K.
    Invariance: bit for bit ``kernels.linear(x, W, b)`` at TP = 1, for any N."""
    x = all_gather_cat(x_shard, tp, dim=-1, reduce_grad=True)
    return all_gather_cat(shard_linear(x, weight_rows, bias_rows, full_n), tp, dim=-1)


def allreduce_row_parallel_linear(x_shard, weight_kcols, bias, tp: TPGroup) -> torch.Tensor:
    """The stock row-parallel layer (Megatron, vLLM): this rank's partial ``x_shard @ W[:, K/N]^T``
    in x's dtype, all-reduced (summed in the collective's order), then + bias. Not TP-invariant:
    the control of tests/test_tensor_parallel.py."""
    y = K.linear(x_shard, weight_kcols)
    if tp.world > 1:
        dist.all_reduce(y, group=tp.group)
    return y if bias is None else y + bias


@dataclass
class ColumnShard:
    """This rank's rows [lo, hi) of ``module``'s linear (column-parallel), sliced from the model's
    parameters and cast at use as the one-process forward does: autograd reaches the parameters and
    an in-place weight update is seen."""
    module: torch.nn.Module
    lo: int
    hi: int
    dtype: torch.dtype

    @property
    def full_n(self) -> int:
        return self.module.weight.shape[0]

    def params(self):
        b = getattr(self.module, "bias", None)
        return (cast_param(self.module.weight[self.lo:self.hi], self.dtype),
                None if b is None else cast_param(b[self.lo:self.hi], self.dtype))

    def __call__(self, x):
        return shard_linear(x, *self.params(), self.full_n)


@dataclass
class GatherRowShard(ColumnShard):
    """A row-parallel layer run by gather: this rank's output rows, full K."""
    tp: TPGroup = None

    def __call__(self, x_shard):
        return gathered_row_parallel_linear(x_shard, *self.params(), self.full_n, self.tp)


@dataclass
class AllreduceRowShard:
    """The stock row-parallel layer (``allreduce_row_parallel_linear``): this rank's K columns
    [lo, hi) of the weight, the partials all-reduced. Not TP-invariant: the whole-model control and
    the speed baseline (``shard_dense_model(..., row_parallel="allreduce")``)."""
    module: torch.nn.Module
    lo: int
    hi: int
    dtype: torch.dtype
    tp: TPGroup = None

    def __call__(self, x_shard):
        b = getattr(self.module, "bias", None)
        return allreduce_row_parallel_linear(x_shard, cast_param(self.module.weight[:, self.lo:self.hi], self.dtype),
                                             None if b is None else cast_param(b, self.dtype), self.tp)


@dataclass
class VocabShard(ColumnShard):
    """A vocab-parallel head: this rank's vocab rows of ``module``'s linear, the logits all-gathered to
    full rows in rank order. Invariance: bit for bit the unsharded head's logits."""
    tp: TPGroup = None

    def __call__(self, hidden):
        return all_gather_cat(shard_linear(copy_to_ranks(hidden, self.tp), *self.params(), self.full_n), self.tp,
                              dim=-1)


@dataclass
class ExpertShard(ExpertRows):
    """A MoE layer's routed experts [lo, hi) on this rank of ``tp``, called after the family's own
    router as ``experts(x, ids, w)`` -> [T, hidden]: through ``expert_parallel_experts`` (every rank
    holds every token: EP = TP) or, with ``data_parallel``, ``data_parallel_experts`` (each rank its
    own tokens); both end in the one-rank slot-order combine. ``stock`` (with ``data_parallel``): the
    all-reduce combine, the control."""
    module: torch.nn.Module  # the layer's MoE block (``module.experts`` holds the stacked expert tensors)
    lo: int
    hi: int
    dtype: torch.dtype
    tp: TPGroup
    data_parallel: bool = False
    stock: bool = False
    num_experts: int = 0  # the layer's routed experts (its expert tensors may hold this rank's only)
    tensors: tuple = ("gate_up_proj", "down_proj")  # module.experts' stacked [in, out] tensors
    activation: str = "swiglu"
    limit: float | None = None  # the SwiGLU clamp (DeepSeek-V4's swiglu_limit)

    @property
    def EXPERT_TENSORS(self) -> tuple:  # noqa: N802 (ExpertRows' name)
        return self.tensors

    @property
    def ACTIVATION(self) -> str:  # noqa: N802 (ExpertRows' name)
        return self.activation

    def __call__(self, x, ids, w):
        w_in, w_out = self.expert_weights()
        if self.data_parallel and self.stock:
            return allreduce_data_parallel_experts(x, ids, w, w_in, w_out, self.num_experts, self.tp)
        if self.data_parallel:
            return data_parallel_experts(x, ids, w, w_in, w_out, self.num_experts, self.tp, activation=self.activation,
                                         swiglu_limit=self.limit)
        return expert_parallel_experts(copy_to_ranks(x, self.tp), ids, w, w_in, w_out, self.num_experts, self.tp,
                                       activation=self.activation, swiglu_limit=self.limit)


@dataclass
class Sharder:
    """The mechanisms a family's ``Family.shard`` hook builds one rank's layout from: the family
    declares which module splits how (by heads, columns, vocab rows, experts), this object makes
    the pieces (column slices, row-parallel layers by gather, the vocab-parallel head, the expert
    dispatch, the entry of a replicated tensor into the column shards), so a family module never
    imports ``bitmatch.parallel``. ``row_parallel="allreduce"``: the stock row-parallel layers (and,
    under ``data_parallel_experts``, the stock expert combine), the control and the speed baseline."""
    tp: TPGroup
    dtype: torch.dtype
    row_parallel: str = "gather"
    data_parallel_experts: TPGroup | None = None  # each rank its own tokens, experts over this group
    who: str = "enable_tensor_parallel"

    def __post_init__(self):
        if self.data_parallel_experts is not None and self.tp.world != 1:
            raise ValueError(f"{self.who}: data_parallel_experts needs tp of one rank (data-parallel attention); "
                             "tensor parallel attention with experts over another group is not built")
        if self.row_parallel not in ("gather", "allreduce"):
            raise ValueError(f"{self.who}: row_parallel must be 'gather' or 'allreduce', got {self.row_parallel!r}")

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def world(self) -> int:
        return self.tp.world

    def even(self, n: int, field: str) -> int:
        """``n`` / TP degree, or a ValueError naming ``field`` when the degree does not divide it."""
        if n % self.world:
            raise ValueError(f"{self.who}: {field} = {n} is not divisible by the TP degree {self.world}; "
                             "use a degree that divides it")
        return n // self.world

    def _plain(self, mod, what: str):
        if lora.is_lora_layer(mod) or hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
            raise ValueError(f"{self.who}: {what} is a PEFT adapter layer; merge the adapters "
                             "(peft merge_and_unload) before sharding")
        return mod

    def column(self, mod, lo: int, hi: int, what: str) -> ColumnShard:
        """Rows [lo, hi) of ``mod``'s linear, each output column with the full K."""
        return ColumnShard(self._plain(mod, what), lo, hi, self.dtype)

    def row(self, mod, rows: int, kcols: int, what: str):
        """A row-parallel layer: by gather (this rank's ``rows`` output rows, full K) or the stock
        all-reduce layer (this rank's ``kcols`` input columns)."""
        r = self.rank
        if self.row_parallel == "gather":
            return GatherRowShard(self._plain(mod, what), r * rows, (r + 1) * rows, self.dtype, tp=self.tp)
        return AllreduceRowShard(self._plain(mod, what), r * kcols, (r + 1) * kcols, self.dtype, tp=self.tp)

    def vocab(self, head, what: str = "lm_head") -> VocabShard:
        """The LM head by vocab rows, its logits gathered to full rows."""
        n = self.even(head.weight.shape[0], "vocab_size")
        return VocabShard(self._plain(head, what), self.rank * n, (self.rank + 1) * n, self.dtype, tp=self.tp)

    def enter(self, x):
        """A replicated tensor entering the rank's column shards (identity forward; its gradient
        summed over the ranks in backward)."""
        return copy_to_ranks(x, self.tp)

    def experts(self, module, num_experts: int, field: str = "num_experts", **kind) -> ExpertShard:
        """``module``'s routed experts spread over the ranks: EP = TP, or over ``data_parallel_experts``.
        ``kind``: the expert tensors' names, activation and clamp (``ExpertShard.tensors`` / ``activation`` /
        ``limit``)."""
        ep = self.data_parallel_experts
        if ep is None:
            e = self.even(num_experts, field)
            return ExpertShard(module, self.rank * e, (self.rank + 1) * e, self.dtype, self.tp, num_experts=num_experts,
                               **kind)
        if num_experts % ep.world:
            raise ValueError(f"enable_expert_parallel: {field} = {num_experts} is not divisible by the EP "
                             f"degree {ep.world}; use a degree that divides it")
        e = num_experts // ep.world
        return ExpertShard(module, ep.rank * e, (ep.rank + 1) * e, self.dtype, ep, data_parallel=True,
                           stock=self.row_parallel == "allreduce", num_experts=num_experts, **kind)


# ----------------------------------------------------------------------------- the sharded model

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
