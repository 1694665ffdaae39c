"""The dense family's tensor-parallel layout (Qwen3-MoE's too: it shares the attention), declared next
to the family's forward: ``DenseFamily.shard`` builds it, ``dense.decoder_layer`` runs it.

Rank r of N holds, per decoder layer:
- q_proj's rows of its query heads; k_proj / v_proj's rows of its KV heads, sharded when
  num_key_value_heads % N == 0, else its query group's head replicated (N % num_key_value_heads == 0,
  as vLLM does), so a rank's queries find their KV head locally; q/k norms, RoPE and attention run
  per head on those heads; o_proj row-parallel (by gather: no cross-rank sum);
- the gated MLP's gate/up rows of its intermediate columns (silu_and_mul is elementwise), down_proj
  row-parallel; Qwen3-MoE's sparse layers: the router replicated, the routed experts spread over the
  ranks (``Family.shard_mlp``);
- replicated on full rows: the embedding, every other norm, the residual stream; the LM head by
  vocab rows, the logits gathered.

The pieces (column slices, row-parallel layers, the vocab-parallel head, the expert dispatch, the
entry of a replicated tensor into the column shards) come from the ``sharder`` that
``bitmatch.parallel`` passes in, so this module imports nothing from it. The forward is the family's
own (``DenseFamily.run`` with each layer's ``LayerShare``): the same op order, recorder names and
paged-attention paths as one process. Refused at sharding (ValueError naming the config field):
num_attention_heads, hidden_size, vocab_size, intermediate_size or the expert count not divisible by
N, num_key_value_heads and N not dividing one another, PEFT adapter layers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from bitmatch.models.tp_share import AttentionShare, ModelShare


@dataclass
class MlpShare:
    """A rank's share of a gated MLP: its intermediate columns of gate/up, down_proj row-parallel."""
    enter: Callable
    gate: Callable
    up: Callable
    down: Callable


@dataclass
class LayerShare:
    attn: AttentionShare
    mlp: object  # MlpShare, or (a sparse layer) the sharder's expert dispatch: experts(x, ids, w)


@dataclass
class DenseShard(ModelShare):
    """One rank's share of a dense-family causal LM (``layers``: a ``LayerShare`` each)."""
    kv_heads: int  # this rank's KV heads (sharded, or one replicated head when N > num_kv_heads)

    def cache_groups(self):
        """The paged KV caches of this rank's KV heads."""
        return self.family.cache_groups(replace(self.spec, num_kv_heads=self.kv_heads), self.dtype)

    def moe_shards(self) -> list:
        return [L.mlp for L in self.layers if not isinstance(L.mlp, MlpShare)]

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

        for layer, L in zip(self.model.model.layers, self.layers):
            a = L.attn
            add(a.q.module, a.k.module, a.v.module, a.o.module)
            if self.spec.qk_norm:
                add(layer.self_attn.q_norm, layer.self_attn.k_norm)
            if isinstance(L.mlp, MlpShare):
                add(L.mlp.gate.module, L.mlp.up.module, L.mlp.down.module)
            else:
                for p in L.mlp.partial_expert_tensors():
                    seen.add(id(p))
                    out.append(p)
        add(self.lm_head.module)
        return out


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, n: int, r: int, who: str) -> tuple[int, int]:
    """(rank r's KV heads, its first one) of N: sharded, or its query group's head replicated."""
    if num_kv_heads % n == 0:
        return num_kv_heads // n, r * (num_kv_heads // n)
    if n % num_kv_heads == 0:  # a query group spans several ranks: each keeps its group's KV head
        return 1, (r * (num_heads // n)) // (num_heads // num_kv_heads)
    raise ValueError(f"{who}: num_key_value_heads = {num_kv_heads} and the TP degree {n} must divide one another")


def gated_mlp_share(mlp_mod, sharder, hidden: int, prefix: str) -> MlpShare:
    """gate/up by intermediate columns, down_proj row-parallel."""
    r = sharder.rank
    inter = sharder.even(mlp_mod.gate_proj.weight.shape[0], "intermediate_size")
    return MlpShare(enter=sharder.enter,
                    gate=sharder.column(mlp_mod.gate_proj, r * inter, (r + 1) * inter, f"{prefix}.gate_proj"),
                    up=sharder.column(mlp_mod.up_proj, r * inter, (r + 1) * inter, f"{prefix}.up_proj"),
                    down=sharder.row(mlp_mod.down_proj, hidden, inter, f"{prefix}.down_proj"))


def shard(family, lm, spec, sharder) -> DenseShard:
    """Rank ``sharder.rank``'s ``DenseShard`` of ``lm`` (the layout in the module docstring).
    Invariance: its forward and logits give every rank TP = 1's bits (``sharder.row_parallel ==
    "allreduce"``: the stock layout, which does not)."""
    n, r = sharder.world, sharder.rank
    hq = sharder.even(spec.num_heads, "num_attention_heads")
    hkv, kv_lo = kv_heads_of_rank(spec.num_heads, spec.num_kv_heads, n, r, sharder.who)
    hidden = sharder.even(spec.hidden_size, "hidden_size")
    d = spec.head_dim
    layers = []
    for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
        a, p = layer.self_attn, f"layers.{i}"
        attn = AttentionShare(enter=sharder.enter,
                              q=sharder.column(a.q_proj, r * hq * d, (r + 1) * hq * d, f"{p}.q_proj"),
                              k=sharder.column(a.k_proj, kv_lo * d, (kv_lo + hkv) * d, f"{p}.k_proj"),
                              v=sharder.column(a.v_proj, kv_lo * d, (kv_lo + hkv) * d, f"{p}.v_proj"),
                              o=sharder.row(a.o_proj, hidden, hq * d, f"{p}.o_proj"))
        layers.append(LayerShare(attn, family.shard_mlp(layer.mlp, sharder, hidden, f"{p}.mlp")))
    return DenseShard(family=family, tp=sharder.tp, spec=spec, dtype=sharder.dtype, model=lm, layers=layers,
                      lm_head=sharder.vocab(lm.lm_head), kv_heads=hkv)
