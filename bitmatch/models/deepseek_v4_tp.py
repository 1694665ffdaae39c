"""DeepSeek-V4's tensor + expert parallel layout (V4-Flash, V4-Pro), declared next to the family's
forward: ``DeepseekV4Family.shard`` builds it, ``deepseek_v4.forward_hidden`` runs it with each
layer's share. TP = N gives TP = 1's bits.

The rule of ``bitmatch.parallel.tensor_parallel``: no rank ever adds a number another rank computed.
Per decoder layer, rank r of N runs:

- replicated on full rows: the mHC mixes (hc_pre / hc_post / hc_head: per token, over the hc_mult
  streams), every RMSNorm, the low-rank q down-projection and its norm (q_a_proj + q_a_norm: the
  norm reduces over the whole q_lora_rank row), the single K = V head (kv_proj + kv_norm), the
  compressors (CSA / HCA) and the Lightning Indexer (its score sums over the indexer heads, so every
  rank computes the whole of it and selects the same entries), the MoE router (learned and hash),
  the embedding and the residual streams. Hence the engine's paged caches ("swa", "csa", "hca": K = V
  rows, raw compressor projections, entries, indexer state) are replicated: every rank caches the
  same per-token rows, at TP = 1's shapes.
- split by query heads (whole output groups): q_b_proj's rows of the rank's heads (the unweighted
  per-head q norm and the rotary are per head), the rank's attention sinks, sink attention on the
  rank's heads (a head's row depends only on its q, its sink and the shared keys), the inverse
  rotary, and o_a_proj's rows of the rank's groups (a group reads only its own heads: o_groups % N
  == 0 puts whole groups on one rank, over exactly the rank's heads).
- row-parallel by gather: o_b_proj (K = o_groups * o_lora_rank, the rank's groups in rank order =
  K order) and the shared expert's down_proj; the shared expert's gate/up by intermediate columns
  (the clamps and silu_and_mul are elementwise).
- expert-parallel, EP = TP: rank r holds routed experts [r E/N, (r + 1) E/N) (the one-rank
  slot-order combine over every slot's row).
- vocab-parallel LM head, the full logits all-gathered.

Refused by name (``ValueError`` at sharding): num_attention_heads, o_groups, n_routed_experts,
hidden_size, vocab_size or the shared expert's intermediate size not divisible by N; PEFT/LoRA
layers; the stock all-reduce layout (none is built: the tests' control swaps o_b_proj). The pieces
come from the ``sharder`` ``bitmatch.parallel`` passes in; this module imports nothing from it. No
CUDA graphs while a shard is set.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bitmatch.models import lora
from bitmatch.models.deepseek_v4_attention import QueryHeads
from bitmatch.models.tp_share import ModelShare
from bitmatch.precision import cast_param


@dataclass
class AttentionShare:
    """A rank's query heads [head_lo, head_hi) of one attention block: whole output groups."""
    module: torch.nn.Module  # the layer's self_attn
    head_lo: int
    head_hi: int
    o_a_lo: int              # o_a_proj rows of the rank's groups
    o_a_hi: int
    groups: int              # the rank's output groups
    group_width: int         # heads_per_group * head_dim (o_a_proj's K)
    q_b: Callable
    o_b: Callable            # [T, groups * o_lora_rank] -> [T, hidden] (the tests' control swaps it)
    dtype: torch.dtype
    enter: Callable

    def heads(self) -> QueryHeads:
        """This step's QueryHeads, the slices cast at use (an in-place weight update is seen)."""
        a = self.module
        return QueryHeads(q_b=self.q_b, sinks=cast_param(a.sinks[self.head_lo:self.head_hi], torch.float32),
                          o_a=cast_param(a.o_a_proj.weight[self.o_a_lo:self.o_a_hi], self.dtype).view(
                              self.groups, -1, self.group_width),
                          o_b=self.o_b, enter=self.enter)


@dataclass
class MoeShare:
    """A rank's routed experts (the sharder's dispatch, after the replicated router) and its shared
    expert's intermediate columns (gate / up column-parallel, down row-parallel)."""
    experts: Callable  # (x, ids, w) -> [T, hidden]
    gate: Callable
    up: Callable
    down: Callable
    enter: Callable


@dataclass
class DeepseekV4Shard(ModelShare):
    """One rank's share of a DeepSeek-V4 causal LM (``layers``: [(AttentionShare, MoeShare)], this
    file's shares)."""

    def moe_shards(self) -> list:
        return [m.experts for _, m in self.layers]

    def partial_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient on this rank is a part (``reduce_tp_gradients`` sums them):
        q_b_proj, the sinks, o_a_proj and o_b_proj (the rank's heads, groups and output columns), the
        routed experts, the shared expert and the LM head. The rest (q_a, the K = V head, compressors,
        indexer, mHC, norms, routers, embedding) runs replicated on full rows: whole on every rank."""
        out = []
        for a, m in self.layers:
            att, mlp = a.module, m.experts.module
            mods = (att.q_b_proj, att.o_a_proj, att.o_b_proj, mlp.shared_experts.gate_proj,
                    mlp.shared_experts.up_proj, mlp.shared_experts.down_proj)
            out += [p for mod in mods for p in (mod.weight, getattr(mod, "bias", None)) if p is not None]
            out += [att.sinks] + m.experts.partial_expert_tensors()
        return out + [self.lm_head.module.weight]


def shard(family, lm, spec, sharder) -> DeepseekV4Shard:
    """Rank ``sharder.rank``'s ``DeepseekV4Shard`` of a DeepSeek-V4 HF causal LM (heads by whole output
    groups, experts EP = TP or over ``sharder.data_parallel_experts``, the rest replicated; see the
    module docstring). Invariance: its forward and logits give every rank TP = 1's bits."""
    r, who = sharder.rank, sharder.who
    if sharder.row_parallel != "gather":
        raise ValueError(f"{who}: row_parallel={sharder.row_parallel!r}: DeepSeek-V4 has no stock all-reduce layout "
                         "built (its control swaps o_b_proj for the stock row-parallel layer)")
    if any(lora.is_lora_layer(m) or hasattr(m, "lora_A") for m in lm.modules()):
        raise ValueError(f"{who}: the model has PEFT adapter layers; merge the adapters (peft merge_and_unload) "
                         "before sharding")
    hq = sharder.even(spec.num_heads, "num_attention_heads")
    # whole output groups per rank, so o_a never sums across ranks; with the heads split evenly too, the
    # rank's groups read exactly its heads' columns of the attention output (o_groups % N, heads % N)
    g = sharder.even(spec.o_groups, "o_groups")
    if sharder.data_parallel_experts is None:
        sharder.even(spec.num_experts, "n_routed_experts")  # refused with the other fields, before the layers
    hidden = sharder.even(spec.hidden_size, "hidden_size")
    d = spec.head_dim
    layers = []
    for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
        a, m, p = layer.self_attn, layer.mlp, f"layers.{i}"
        rank_a = a.o_a_proj.weight.shape[0] // spec.o_groups  # o_lora_rank
        inter = sharder.even(m.shared_experts.gate_proj.weight.shape[0], "moe_intermediate_size * n_shared_experts")
        sh = m.shared_experts
        layers.append((
            AttentionShare(a, r * hq, (r + 1) * hq, r * g * rank_a, (r + 1) * g * rank_a, g,
                           spec.num_heads * d // spec.o_groups,
                           q_b=sharder.column(a.q_b_proj, r * hq * d, (r + 1) * hq * d, f"{p}.self_attn.q_b_proj"),
                           o_b=sharder.row(a.o_b_proj, hidden, g * rank_a, f"{p}.self_attn.o_b_proj"),
                           dtype=sharder.dtype, enter=sharder.enter),
            MoeShare(experts=sharder.experts(m, spec.num_experts, "n_routed_experts", limit=spec.swiglu_limit),
                     gate=sharder.column(sh.gate_proj, r * inter, (r + 1) * inter, f"{p}.mlp.shared_experts.gate_proj"),
                     up=sharder.column(sh.up_proj, r * inter, (r + 1) * inter, f"{p}.mlp.shared_experts.up_proj"),
                     down=sharder.row(sh.down_proj, hidden, inter, f"{p}.mlp.shared_experts.down_proj"),
                     enter=sharder.enter)))
    return DeepseekV4Shard(family=family, tp=sharder.tp, spec=spec, dtype=sharder.dtype, model=lm, layers=layers,
                           lm_head=sharder.vocab(lm.lm_head))
