"""Gather-only tensor + expert parallelism for DeepSeek-V4 (V4-Flash, V4-Pro): TP = N gives TP = 1's bits.

The dense layout's rule (``tensor_parallel``): no rank ever adds a number another rank computed.
Per decoder layer (``bitmatch.models.deepseek_v4``), rank r of N runs:

- replicated on full rows: the mHC mixes (hc_pre / hc_post / hc_head: per token, over the hc_mult
  streams), every RMSNorm, the low-rank q down-projection and its norm (q_a_proj + q_a_norm: the
  norm reduces over the whole q_lora_rank row), the single K = V head (kv_proj + kv_norm), the
  compressors (CSA / HCA) and the Lightning Indexer (its score sums over the indexer heads, so every
  rank computes the whole of it and selects the same entries), the MoE router (learned and hash),
  the embedding and the residual streams. Hence the engine's paged caches ("swa", "csa", "hca": K = V
  rows, raw compressor projections, entries, indexer state) are replicated: every rank caches the
  same per-token rows, at TP = 1's shapes.
- split by query heads (whole output groups): q_b_proj's rows of the rank's heads (``ColumnShard``;
  the unweighted per-head q norm and the rotary are per head), the rank's attention sinks, sink
  attention on the rank's heads (a head's row depends only on its q, its sink and the shared keys),
  the inverse rotary, and o_a_proj's rows of the rank's groups (a group reads only its own heads:
  o_groups % N == 0 puts whole groups on one rank, over exactly the rank's heads).
- row-parallel by gather: o_b_proj (K = o_groups * o_lora_rank, the rank's groups in rank order =
  K order) and the shared expert's down_proj (``GatherRowShard``); the shared expert's gate/up by
  intermediate columns (the clamps and silu_and_mul are elementwise).
- expert-parallel, EP = TP: rank r holds routed experts [r E/N, (r + 1) E/N), through
  ``expert_parallel_experts`` (the one-rank slot-order combine over every slot's row).
- vocab-parallel LM head, the full logits all-gathered (``tensor_parallel.vocab_parallel_logits``).

Refused by name (``ValueError`` at sharding): num_attention_heads, o_groups, n_routed_experts,
hidden_size, vocab_size or the shared expert's intermediate size not divisible by N; PEFT/LoRA
layers. The family's own op functions run the layer (``deepseek_v4.forward_hidden`` with the
rank's ``QueryHeads`` / ``MoeParts``); no kernel changes. No CUDA graphs while a shard is set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bitmatch.models import compute_dtype_of, deepseek_v4 as V4, family_of, lora, unwrap_causal_lm
from bitmatch.models.deepseek_v4_attention import QueryHeads
from bitmatch.models.registry import tp_shard
from bitmatch.precision import cast_param

from .collectives import TPGroup, copy_to_ranks
from .expert_parallel import ExpertRows, data_parallel_experts, expert_parallel_experts
from .tensor_parallel import ColumnShard, GatherRowShard, vocab_parallel_logits

F32 = torch.float32


def _even(n: int, world: int, field: str) -> int:
    if n % world:
        raise ValueError(f"shard_deepseek_v4: {field} = {n} is not divisible by the TP degree {world}; "
                         f"use a degree that divides it")
    return n // world


@dataclass
class AttentionShard:
    """A rank's query heads [head_lo, head_hi) of one attention block: whole output groups."""
    module: torch.nn.Module  # the layer's self_attn
    head_lo: int
    head_hi: int
    o_a_lo: int              # o_a_proj rows of the rank's groups
    o_a_hi: int
    groups: int              # the rank's output groups
    group_width: int         # heads_per_group * head_dim (o_a_proj's K)
    q_b: ColumnShard
    o_b: GatherRowShard      # any callable [T, groups * o_lora_rank] -> [T, hidden] (the test's control swaps it)
    dtype: torch.dtype
    tp: TPGroup

    def heads(self) -> QueryHeads:
        """This step's QueryHeads, the slices cast at use (an in-place weight update is seen)."""
        a, tp = self.module, self.tp
        return QueryHeads(q_b=self.q_b, sinks=cast_param(a.sinks[self.head_lo:self.head_hi], F32),
                          o_a=cast_param(a.o_a_proj.weight[self.o_a_lo:self.o_a_hi], self.dtype).view(
                              self.groups, -1, self.group_width),
                          o_b=self.o_b, enter=lambda t: copy_to_ranks(t, tp))


@dataclass
class MoeShard(ExpertRows):
    """A rank's routed experts [lo, hi) (EP = TP) and its shared-expert intermediate columns."""
    module: torch.nn.Module  # the layer's mlp
    lo: int
    hi: int
    gate: ColumnShard
    up: ColumnShard
    down: GatherRowShard
    limit: float | None
    dtype: torch.dtype
    tp: TPGroup
    ep: TPGroup | None = None  # data-parallel tokens, experts over ep's ranks (enable_expert_parallel)
    num_experts: int = 0  # the layer's routed experts (its expert tensors may hold this rank's only)

    def parts(self) -> V4.MoeParts:
        tp = self.tp

        def experts(x, ids, w):
            args = (ids, w, *self.expert_weights(), self.num_experts)
            if self.ep is not None:
                return data_parallel_experts(x, *args, self.ep, activation="swiglu", swiglu_limit=self.limit)
            return expert_parallel_experts(copy_to_ranks(x, tp), *args, tp, activation="swiglu",
                                           swiglu_limit=self.limit)

        def shared(x):
            return V4.clamped_swiglu(self.gate, self.up, self.down, copy_to_ranks(x, tp), self.limit)
        return V4.MoeParts(experts=experts, shared=shared)


@dataclass
class DeepseekV4Shard:
    """One rank's share of a DeepSeek-V4 causal LM (``shard_deepseek_v4``); the whole model stays on
    every rank (the simulation), the shards read their slices from it at use."""
    tp: TPGroup
    spec: V4.DeepseekV4Spec
    dtype: torch.dtype
    model: torch.nn.Module  # the unwrapped causal LM
    layers: list            # [(AttentionShard, MoeShard)]
    lm_head: ColumnShard

    def forward_hidden(self, input_ids, ctx, recorder=None):
        """Packed tokens [T] -> final-norm hidden states [T, hidden], the same on every rank.
        Invariance: bit for bit the unsharded model's ``bitmatch.models.forward_hidden``."""
        if recorder is not None:
            raise ValueError("tensor parallel forward: no per-op recorder (bitmatch.verify.locate runs at TP = 1); "
                             "disable_tensor_parallel(model) first")
        shares = [(a.heads(), m.parts()) for a, m in self.layers]
        return V4.forward_hidden(self.model, self.spec, input_ids, ctx, self.dtype, None, shares)

    def compute_logits(self, hidden):
        """Full logits on every rank (vocab slices all-gathered). Invariance: TP = 1's bits."""
        return vocab_parallel_logits(self, hidden)

    def moe_shards(self) -> list:
        return [m for _, m in self.layers]

    def partial_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient on this rank is a part (``reduce_tp_gradients`` sums them):
        q_b_proj, the sinks, o_a_proj and o_b_proj (the rank's heads, groups and output columns), the
        routed experts, the shared expert and the LM head. The rest (q_a, the K = V head, compressors,
        indexer, mHC, norms, routers, embedding) runs replicated on full rows: whole on every rank."""
        out = []
        for a, m in self.layers:
            att, mlp = a.module, m.module
            mods = (att.q_b_proj, att.o_a_proj, att.o_b_proj, mlp.shared_experts.gate_proj,
                    mlp.shared_experts.up_proj, mlp.shared_experts.down_proj)
            out += [p for mod in mods for p in (mod.weight, getattr(mod, "bias", None)) if p is not None]
            out += [att.sinks] + m.partial_expert_tensors()
        return out + [self.lm_head.module.weight]


def shard_deepseek_v4(model, tp: TPGroup, compute_dtype: torch.dtype | None = None,
                      data_parallel_experts: TPGroup | None = None) -> DeepseekV4Shard:
    """This rank's ``DeepseekV4Shard`` of a DeepSeek-V4 HF causal LM (heads by whole output groups,
    experts EP = TP, the rest replicated; see the module docstring). Invariance: ``forward_hidden`` /
    ``compute_logits`` / ``parallel.token_logprobs`` give every rank TP = 1's bits.
    ``data_parallel_experts`` (``tp`` of one rank): each rank its own tokens, the routed experts over
    that group's ranks (``enable_expert_parallel``)."""
    lm = unwrap_causal_lm(model)
    if tp_shard(lm) is not None:
        raise ValueError("shard_deepseek_v4: the model runs tensor parallel already; "
                         "disable_tensor_parallel(model) before sharding it again")
    fam = family_of(lm)
    if not isinstance(fam, V4.DeepseekV4Family):
        raise ValueError(f"shard_deepseek_v4: family {fam.name!r} is not deepseek_v4")
    if any(lora.is_lora_layer(m) or hasattr(m, "lora_A") for m in lm.modules()):
        raise ValueError("shard_deepseek_v4: the model has PEFT adapter layers; merge the adapters "
                         "(peft merge_and_unload) before sharding")
    spec = fam.build_spec(lm)
    dt = compute_dtype if compute_dtype is not None else compute_dtype_of(lm)
    n, r = tp.world, tp.rank
    hq = _even(spec.num_heads, n, "num_attention_heads")
    # whole output groups per rank, so o_a never sums across ranks; with the heads split evenly too, the
    # rank's groups read exactly its heads' columns of the attention output (o_groups % N, heads % N)
    g = _even(spec.o_groups, n, "o_groups")
    ep = data_parallel_experts
    if ep is not None and n != 1:
        raise ValueError("shard_deepseek_v4: data_parallel_experts needs tp of one rank (data-parallel "
                         "attention); tensor parallel attention with experts over another group is not built")
    if ep is not None and spec.num_experts % ep.world:
        raise ValueError(f"enable_expert_parallel: n_routed_experts = {spec.num_experts} is not divisible by the "
                         f"EP degree {ep.world}; use a degree that divides it")
    if ep is None:
        e_rank, e = r, _even(spec.num_experts, n, "n_routed_experts")
    else:
        e_rank, e = ep.rank, spec.num_experts // ep.world
    hidden = _even(spec.hidden_size, n, "hidden_size")
    vocab = _even(spec.vocab_size, n, "vocab_size")
    d = spec.head_dim
    layers = []
    for layer in lm.model.layers[: spec.num_layers]:
        a, m = layer.self_attn, layer.mlp
        rank_a = a.o_a_proj.weight.shape[0] // spec.o_groups  # o_lora_rank
        inter = _even(m.shared_experts.gate_proj.weight.shape[0], n, "moe_intermediate_size * n_shared_experts")
        layers.append((
            AttentionShard(a, r * hq, (r + 1) * hq, r * g * rank_a, (r + 1) * g * rank_a, g,
                           spec.num_heads * d // spec.o_groups,
                           q_b=ColumnShard(a.q_b_proj, r * hq * d, (r + 1) * hq * d, dt),
                           o_b=GatherRowShard(a.o_b_proj, r * hidden, (r + 1) * hidden, dt, tp=tp), dtype=dt, tp=tp),
            MoeShard(m, e_rank * e, (e_rank + 1) * e,
                     gate=ColumnShard(m.shared_experts.gate_proj, r * inter, (r + 1) * inter, dt),
                     up=ColumnShard(m.shared_experts.up_proj, r * inter, (r + 1) * inter, dt),
                     down=GatherRowShard(m.shared_experts.down_proj, r * hidden, (r + 1) * hidden, dt, tp=tp),
                     limit=spec.swiglu_limit, dtype=dt, tp=tp, ep=ep, num_experts=spec.num_experts)))
    return DeepseekV4Shard(tp=tp, spec=spec, dtype=dt, model=lm, layers=layers,
                           lm_head=ColumnShard(lm.lm_head, r * vocab, (r + 1) * vocab, dt))
