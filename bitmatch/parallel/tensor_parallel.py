"""Gather-only tensor parallelism for the dense family and Qwen3-MoE: TP = N gives TP = 1's bits.

Stock TP (Megatron, vLLM) is not TP-invariant: a row-parallel layer (o_proj, down_proj) splits
K over the ranks and an all-reduce adds their partials in the collective's order. Here no rank
ever adds another rank's numbers, so no kernel's canonical order changes:

- column-parallel (q/k/v by heads, KV heads sharded or replicated; gate/up by intermediate
  columns; the LM head by vocab rows): each output element is computed on one rank by the same
  kernel with the full K reduction (``shard_linear``; ``kernels.linear``'s contract: a column's
  bits depend only on its row of x, its weight row and bias). Attention, q/k norms, RoPE and
  silu_and_mul work per head / per element, so they run on the rank's heads / columns.
- row-parallel by gather (``gathered_row_parallel_linear``): all-gather the layer's input (each
  rank's heads' outputs or MLP intermediate columns) in rank order, i.e. in K order; each rank
  computes its hidden/N output columns with the full K; all-gather the columns.
- Qwen3-MoE's sparse layers: the experts spread over the same ranks (``expert_parallel``), the
  router replicated.
- vocab-parallel head: each rank's vocab slice of the logits, all-gathered to full rows, then the
  same ``kernels.token_logprobs`` / sampler as TP = 1.

The all-gathers move raw bytes (``bitmatch.parallel.collectives``); norms and the residual stream
run replicated on full rows. ``allreduce_row_parallel_linear`` is the stock layer, kept as the
control that differs. Backward: correct gradients, not invariant ones (ordinary all-reduces where a
replicated tensor enters the column shards and under row-parallel inputs, Megatron's f and g).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.kernels.linear import LinearFunction
from bitmatch.logprobs import check_temperature, pack_rows
from bitmatch.models import CacheGroup, compute_dtype_of, dense, family_of, lora, qwen3_moe, unwrap_causal_lm
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
class Norm:
    """An RMSNorm run replicated (full rows on every rank): the model's own module, cast at use."""
    module: torch.nn.Module
    dtype: torch.dtype

    def __call__(self, x, residual=None):
        if residual is None:
            return dense.rms_norm(self.module, x, self.dtype)
        return dense.fused_add_rms_norm(self.module, x, residual, self.dtype)


# ----------------------------------------------------------------------------- the sharded model

@dataclass
class LayerShard:
    input_norm: Norm
    post_norm: Norm
    q: ColumnShard
    k: ColumnShard
    v: ColumnShard
    q_norm: Norm | None
    k_norm: Norm | None
    o: "GatherRowShard | AllreduceRowShard"
    mlp: "GatedMlpShard | MoeShard"


@dataclass
class GatedMlpShard:
    """gate/up column-parallel, down_proj by gather, in dense.gated_mlp's unfused order
    (silu_and_mul is elementwise, so the rank's intermediate columns suffice)."""
    gate: ColumnShard
    up: ColumnShard
    down: "GatherRowShard | AllreduceRowShard"

    def __call__(self, x):
        x = copy_to_ranks(x, self.down.tp)
        return self.down(K.silu_and_mul(torch.cat([self.gate(x), self.up(x)], dim=-1)))


@dataclass
class MoeShard(ExpertRows):
    """A Qwen3-MoE block with the experts spread over the ranks of ``tp``: the router runs on the
    rank's rows (the same bits wherever a row is, so a row's experts do not depend on the layout),
    the experts through ``expert_parallel_experts`` (every rank holds every token: EP = TP) or, with
    ``data_parallel``, ``data_parallel_experts`` (each rank its own tokens); both end in the
    one-rank slot-order combine."""
    module: torch.nn.Module
    lo: int
    hi: int
    dtype: torch.dtype
    tp: TPGroup
    data_parallel: bool = False
    stock: bool = False  # with data_parallel: allreduce_data_parallel_experts (the control)
    num_experts: int = 0  # the layer's routed experts (its expert tensors may hold this rank's only)

    def __call__(self, x):
        m = self.module
        # qwen3_moe._moe_block's routing: fp32 router logits, softmax top-k
        logits = K.linear(x.float(), cast_param(m.gate.weight, torch.float32))
        w, ids = K.moe_route(logits, int(m.gate.top_k), scoring="softmax", renormalize=bool(m.gate.norm_topk_prob))
        w_in, w_out = self.expert_weights()
        if self.data_parallel:
            combine = allreduce_data_parallel_experts if self.stock else data_parallel_experts
            return combine(x, ids, w, w_in, w_out, self.num_experts, self.tp)
        return expert_parallel_experts(copy_to_ranks(x, self.tp), ids, w, w_in, w_out, self.num_experts, self.tp)


@dataclass
class DenseShard:
    """One rank's share of a dense-family model (``shard_dense_model``): replicated embedding and
    norms, and its row slices of every linear, all read from the model's own modules at use (the
    simulation keeps the whole model on every rank; a real deployment would load only the slices)."""
    tp: TPGroup
    spec: dense.DenseSpec
    dtype: torch.dtype
    model: torch.nn.Module  # the unwrapped causal LM
    layers: list
    norm: Norm
    lm_head: ColumnShard
    kv_heads: int  # this rank's KV heads (sharded, or one replicated head when N > num_kv_heads)

    # the duck-typed interface a family calls through bitmatch.models.registry.tp_shard
    def forward_hidden(self, input_ids, ctx, recorder=None):
        if recorder is not None:
            raise ValueError("tensor parallel forward: no per-op recorder (bitmatch.verify.locate runs at TP = 1); "
                             "disable_tensor_parallel(model) first")
        return forward_hidden(self, input_ids, ctx)

    def compute_logits(self, hidden):
        return compute_logits(self, hidden)

    def moe_shards(self) -> list:
        return [L.mlp for L in self.layers if isinstance(L.mlp, MoeShard)]

    def partial_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient on this rank is a part of the whole (``reduce_tp_gradients``
        sums them): every sliced linear (its rows; KV heads replicated over ranks: each rank's
        queries' share), the q/k norms (replicated weights applied to this rank's heads only), this
        rank's experts and the LM head's vocab rows. The rest (embedding, the other norms, the
        router) run replicated on full rows and get the whole gradient on every rank."""
        out, seen = [], set()

        def add(*mods):
            for mod in mods:
                for p in (mod.weight, getattr(mod, "bias", None)):
                    if p is not None and id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)

        for L in self.layers:
            add(L.q.module, L.k.module, L.v.module, L.o.module)
            if L.q_norm is not None:
                add(L.q_norm.module, L.k_norm.module)
            if isinstance(L.mlp, MoeShard):
                for p in L.mlp.partial_expert_tensors():
                    seen.add(id(p))
                    out.append(p)
            else:
                add(L.mlp.gate.module, L.mlp.up.module, L.mlp.down.module)
        add(self.lm_head.module)
        return out


def _rows(mod, lo: int, hi: int, dtype, what: str, cls=ColumnShard, **kw):
    if lora.is_lora_layer(mod) or hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
        raise ValueError(f"shard_dense_model: {what} is a PEFT adapter layer; merge the adapters "
                         "(peft merge_and_unload) before sharding")
    return cls(mod, lo, hi, dtype, **kw)


def _even(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"shard_dense_model: {what} = {n} is not divisible by the TP degree {world}; "
                         f"use a degree that divides it")
    return n // world


def _row_shard(mod, tp: TPGroup, rows: int, kcols: int, dt, what: str, row_parallel: str):
    """o_proj / down_proj on this rank: by gather (its ``rows`` output rows, full K) or, for the
    control, the stock all-reduce layer (its ``kcols`` input columns)."""
    r = tp.rank
    if row_parallel == "gather":
        return _rows(mod, r * rows, (r + 1) * rows, dt, what, GatherRowShard, tp=tp)
    return _rows(mod, r * kcols, (r + 1) * kcols, dt, what, AllreduceRowShard, tp=tp)


def _mlp_shard(m, tp: TPGroup, hidden: int, dt, p: str, row_parallel: str = "gather", dp_ep: TPGroup | None = None):
    n, r = tp.world, tp.rank
    if hasattr(m, "experts"):
        total = m.experts.gate_up_proj.shape[0]
        if dp_ep is not None:  # data-parallel tokens, experts over dp_ep's ranks
            if total % dp_ep.world:
                raise ValueError(f"enable_expert_parallel: num_experts = {total} is not divisible by the EP "
                                 f"degree {dp_ep.world}; use a degree that divides it")
            e = total // dp_ep.world
            return MoeShard(m, dp_ep.rank * e, (dp_ep.rank + 1) * e, dt, dp_ep, data_parallel=True,
                            stock=row_parallel == "allreduce", num_experts=total)
        e = _even(total, n, "num_experts")
        return MoeShard(m, r * e, (r + 1) * e, dt, tp, num_experts=total)
    inter = _even(m.gate_proj.weight.shape[0], n, "intermediate_size")
    return GatedMlpShard(gate=_rows(m.gate_proj, r * inter, (r + 1) * inter, dt, f"{p}.gate_proj"),
                         up=_rows(m.up_proj, r * inter, (r + 1) * inter, dt, f"{p}.up_proj"),
                         down=_row_shard(m.down_proj, tp, hidden, inter, dt, f"{p}.down_proj", row_parallel))


def shard_dense_model(model, tp: TPGroup, compute_dtype: torch.dtype | None = None,
                      row_parallel: str = "gather", data_parallel_experts: TPGroup | None = None) -> DenseShard:
    """This rank's ``DenseShard`` of a dense-family HF causal LM (qwen2, qwen3, llama, mistral) or a
    Qwen3-MoE one (num_experts % N == 0: rank r holds experts [r E/N, (r + 1) E/N)).

    Heads are split evenly (num_heads % N == 0); KV heads are sharded when num_kv_heads % N == 0,
    else replicated (N % num_kv_heads == 0, as vLLM does), so a rank's queries find their KV head
    locally. Invariance: ``forward_hidden`` / ``compute_logits`` / ``token_logprobs`` on the shard
    give every rank TP = 1's bits. ``row_parallel="allreduce"`` builds the stock layout instead
    (o_proj / down_proj split over K, partials all-reduced): not invariant, the control and the
    speed baseline of benchmarks/tp_layout.py. ``data_parallel_experts`` (with ``tp`` of one
    rank): each rank runs its own tokens and the Qwen3-MoE experts spread over that group's ranks
    (``enable_expert_parallel``); with ``row_parallel="allreduce"`` their stock combine (each rank's
    partial all-reduced: the control).
    """
    if data_parallel_experts is not None and tp.world != 1:
        raise ValueError("shard_dense_model: data_parallel_experts needs tp of one rank (data-parallel "
                         "attention); tensor parallel attention with experts over another group is not built")
    if row_parallel not in ("gather", "allreduce"):
        raise ValueError(f"shard_dense_model: row_parallel must be 'gather' or 'allreduce', got {row_parallel!r}")
    lm = unwrap_causal_lm(model)
    if tp_shard(lm) is not None:
        raise ValueError("shard_dense_model: the model runs tensor parallel already; "
                         "disable_tensor_parallel(model) before sharding it again")
    fam = family_of(lm)
    if type(fam) not in (dense.DenseFamily, qwen3_moe.Qwen3MoeFamily):
        raise ValueError(f"shard_dense_model: family {fam.name!r} has no tensor-parallel layout; supported: the "
                         "dense family (qwen2, qwen3, llama, mistral) and qwen3_moe (experts spread over the ranks)")
    spec = fam.build_spec(lm)
    dt = compute_dtype if compute_dtype is not None else compute_dtype_of(lm)
    n, r = tp.world, tp.rank
    hq = _even(spec.num_heads, n, "num_attention_heads")
    if spec.num_kv_heads % n == 0:
        hkv, kv_lo = spec.num_kv_heads // n, r * (spec.num_kv_heads // n)
    elif n % spec.num_kv_heads == 0:  # a query group spans several ranks: each keeps its group's KV head
        hkv, kv_lo = 1, (r * hq) // (spec.num_heads // spec.num_kv_heads)
    else:
        raise ValueError(f"shard_dense_model: num_key_value_heads = {spec.num_kv_heads} and the TP degree {n} "
                         "must divide one another")
    hidden = _even(spec.hidden_size, n, "hidden_size")
    vocab = _even(spec.vocab_size, n, "vocab_size")
    d = spec.head_dim
    layers = []
    for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
        a, m = layer.self_attn, layer.mlp
        p = f"layers.{i}"
        layers.append(LayerShard(
            input_norm=Norm(layer.input_layernorm, dt), post_norm=Norm(layer.post_attention_layernorm, dt),
            q=_rows(a.q_proj, r * hq * d, (r + 1) * hq * d, dt, f"{p}.q_proj"),
            k=_rows(a.k_proj, kv_lo * d, (kv_lo + hkv) * d, dt, f"{p}.k_proj"),
            v=_rows(a.v_proj, kv_lo * d, (kv_lo + hkv) * d, dt, f"{p}.v_proj"),
            q_norm=Norm(a.q_norm, dt) if spec.qk_norm else None,
            k_norm=Norm(a.k_norm, dt) if spec.qk_norm else None,
            o=_row_shard(a.o_proj, tp, hidden, hq * d, dt, f"{p}.o_proj", row_parallel),
            mlp=_mlp_shard(m, tp, hidden, dt, p, row_parallel, data_parallel_experts),
        ))
    return DenseShard(tp=tp, spec=spec, dtype=dt, model=lm,
                      layers=layers, norm=Norm(lm.model.norm, dt),
                      lm_head=_rows(lm.lm_head, r * vocab, (r + 1) * vocab, dt, "lm_head"), kv_heads=hkv)


# ----------------------------------------------------------------------------- forward

def _attention(shard: DenseShard, L: LayerShard, i: int, x, cos, sin, ctx: ForwardContext):
    spec, t, d = shard.spec, x.shape[0], shard.spec.head_dim
    q, k, v = L.q(x).reshape(t, -1, d), L.k(x).reshape(t, -1, d), L.v(x).reshape(t, -1, d)
    if L.q_norm is not None:
        q, k = L.q_norm(q), L.k_norm(k)
    q, k = K.apply_rotary(q, k, cos, sin)
    sw = spec.sliding_windows[i]
    if ctx.paged:
        k_cache, v_cache = ctx.cache("kv", i)
        K.write_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping)
        host = {} if ctx.max_seq_len is None or ctx.max_query_len is None else dict(
            max_query_len=ctx.max_query_len, max_seq_len=ctx.max_seq_len)
        o = K.attention_paged(q, k_cache, v_cache, ctx.block_table, ctx.query_start_loc, ctx.seq_lens,
                              spec.scale, sliding_window=sw, **host)
    else:
        if ctx.cu_seqlens is None:
            raise ValueError("tensor_parallel.forward_hidden: ForwardContext needs cu_seqlens (packed prefill) "
                             "or slot_mapping (paged)")
        o = K.attention_prefill(q, k, v, ctx.cu_seqlens, spec.scale, causal=True, sliding_window=sw,
                                max_seqlen=ctx.max_query_len)
    return L.o(o.reshape(t, -1))


def forward_hidden(shard: DenseShard, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """Packed tokens [T] -> final-norm hidden states [T, hidden], the same on every rank, in the dense
    family's op order (``bitmatch.models.dense``). Invariance: bit for bit
    ``bitmatch.models.forward_hidden`` of the unsharded model, at any TP degree."""
    spec, dt, tp = shard.spec, shard.dtype, shard.tp
    h = dense.embed(shard.model, input_ids, dt)
    cos, sin = dense.rope_cos_sin(ctx, spec.head_dim, spec.rope_base, spec.rope_scaling,
                                  spec.max_position_embeddings)
    residual = None
    for i, L in enumerate(shard.layers):
        if residual is None:
            x, residual = L.input_norm(h), h
        else:
            x, residual = L.input_norm(h, residual)
        a = _attention(shard, L, i, copy_to_ranks(x, tp), cos, sin, ctx)
        x, residual = L.post_norm(a, residual)
        h = L.mlp(x)
    out = shard.norm(h) if residual is None else shard.norm(h, residual)[0]
    return out


def compute_logits(shard: DenseShard, hidden: torch.Tensor) -> torch.Tensor:
    """Full logits [N, vocab] on every rank: each rank's vocab slice, all-gathered in rank order.
    Invariance: bit for bit the unsharded model's ``bitmatch.models.compute_logits``."""
    return all_gather_cat(shard.lm_head(copy_to_ranks(hidden, shard.tp)), shard.tp, dim=-1)


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


# family name -> "module:function" of this package building one rank's shard of that family's causal
# LM: (lm, tp, compute_dtype) -> a shard with forward_hidden(input_ids, ctx, recorder),
# compute_logits(hidden) and whatever the family's spec / cache_groups read from it. Named, not
# imported: a family's layout module imports this one.
SHARD_BUILDERS: dict[str, str] = {
    "dense": "tensor_parallel:shard_dense_model",
    "qwen3_moe": "tensor_parallel:shard_dense_model",
    "nemotron_h": "nemotron_h:shard_nemotron_h",
    "deepseek_v4": "deepseek_v4:shard_deepseek_v4",
}


def enable_tensor_parallel(model, tp: TPGroup, compute_dtype: torch.dtype | None = None, **layout):
    """Run ``model`` as rank ``tp.rank`` of a gather-only TP layout everywhere bitmatch runs it
    (``bitmatch.models.forward_hidden`` / ``compute_logits`` / ``cache_groups``, hence the embedded
    ``bitmatch.Engine``, one process per rank, each sampling the same token from the same gathered
    logits). No CUDA graphs. ``layout``: the family builder's options (the dense family's
    ``row_parallel="allreduce"``: the stock layout, a control). Invariance: every rank gets TP = 1's
    bits."""
    lm = unwrap_causal_lm(model)
    if tp_shard(lm) is not None:
        raise ValueError("enable_tensor_parallel: the model runs tensor parallel already; "
                         "disable_tensor_parallel(model) before sharding it again")
    fam = family_of(lm)
    build = SHARD_BUILDERS.get(fam.name)
    if build is None:
        raise ValueError(f"enable_tensor_parallel: family {fam.name!r} has no tensor-parallel layout; "
                         f"supported: {', '.join(sorted(SHARD_BUILDERS))}")
    mod, fn = build.split(":")
    shard = getattr(importlib.import_module(f"bitmatch.parallel.{mod}"), fn)(lm, tp, compute_dtype, **layout)
    create_state(lm).tp = shard
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
    drop_state(lm, "tp")
    forget_spec(lm)


def cache_groups(shard: DenseShard) -> list[CacheGroup]:
    """The paged KV caches of this rank's KV heads (``bitmatch.models.allocate_caches`` builds them)."""
    s = shard.spec
    return [CacheGroup("kv", "paged_kv", tuple(range(s.num_layers)), shard.kv_heads, s.head_dim, shard.dtype)]
