"""Nemotron-H's tensor (and expert) parallel layout, declared next to the family's forward:
``NemotronHFamily.shard`` builds it, ``nemotron_h.block`` runs it. TP = N gives TP = 1's bits.

The rule of ``bitmatch.parallel.tensor_parallel``: no rank ever adds a number another rank computed,
so no kernel's canonical order changes. Column-parallel pieces compute each output element on one
rank with the full-K kernel; row-parallel layers run by gather; embeddings, every RMSNorm and the
residual stream run replicated on full rows; the LM head is vocab-parallel, gathered. Per block kind:

- Mamba2: in_proj's output is [z | x | B | C | dt] (HF's NemotronHMamba2Mixer). Rank r computes
  its heads' z, x and dt rows and its groups' B and C rows (five row slices of in_proj, each with
  the full K). The conv is depthwise (per channel), the scan per head (head h reads group
  h // (heads / n_groups), so whole groups per rank keep every head's B and C local), A_log, D and
  dt_bias per head, and the gated RMSNorm normalizes per group of intermediate / n_groups channels:
  a rank must hold whole groups, so ``n_groups % N == 0`` is required (B and C are not replicated
  for an indivisible n_groups: the norm's groups would then straddle ranks, a sum across them).
  out_proj by gather. The engine's per-sequence state (conv state, SSM state, open-chunk x / B /
  dt) holds the rank's channels, heads and groups: the rank's spec names them.
- attention (no rotary): q/k/v by heads, KV heads sharded when num_key_value_heads % N == 0, else
  replicated (each rank keeps its query group's KV head); o_proj by gather.
- MLP: up_proj by intermediate columns, relu2 (elementwise), down_proj by gather.
- MoE: the fp32 router and the optional latent projections (fc1 / fc2) replicated; the routed
  experts spread over the ranks (EP = TP: the one-rank slot-order combine); the shared expert as the MLP.

An indivisible size is refused at shard time, every one at once, by its config field. The pieces come
from the ``sharder`` ``bitmatch.parallel`` passes in (``sharder.row_parallel == "allreduce"``: the stock
layout, not TP-invariant, the control and the speed baseline); this module imports nothing from it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from bitmatch.models.dense_tp import kv_heads_of_rank
from bitmatch.models.tp_share import AttentionShare, ModelShare

MAMBA, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"  # nemotron_h's block kinds


@dataclass
class MambaShare:
    """A Mamba2 mixer on rank r's heads and groups: five in_proj row slices, the per-channel and
    per-head parameters at ``channels`` / ``heads`` / ``inner``, out_proj row-parallel."""
    enter: Callable
    z: Callable
    x: Callable
    B: Callable
    C: Callable
    dt: Callable
    out: Callable
    channels: torch.Tensor  # the rank's conv channels: its heads' x, its groups' B and C
    heads: slice
    inner: slice  # the rank's heads' channels of z / y (whole norm groups)


@dataclass
class MlpShare:
    """down(relu2(up(x))): up_proj by intermediate columns, down_proj row-parallel."""
    enter: Callable
    up: Callable
    down: Callable


@dataclass
class MoeShare:
    """A MoE block's rank share: its routed experts (the sharder's dispatch, after the replicated
    router and fc1) and the shared expert's MLP share."""
    experts: Callable
    shared: MlpShare


@dataclass
class NemotronHShard(ModelShare):
    """One rank's share of a Nemotron-H model (``spec``: the rank's heads and groups), per layer its share
    of the mixer."""

    def moe_shards(self) -> list:
        return [s.experts for s in self.layers if isinstance(s, MoeShare)]

    def partial_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient on this rank is a part of the whole (``reduce_tp_gradients``
        sums them): every sliced linear (KV heads replicated over ranks: each rank's queries' share),
        the Mamba conv, A_log, D, dt_bias and gated-norm weight (per channel / head), this rank's
        experts and the LM head. The rest (embeddings, block norms, norm_f, router, latent
        projections) run replicated on full rows and get the whole gradient on every rank."""
        mods = [self.lm_head.module]
        out = []
        for layer, s in zip(self.model.model.layers, self.layers):
            if isinstance(s, MambaShare):
                m = layer.mixer
                mods += [s.z.module, s.out.module, m.conv1d]
                out += [m.A_log, m.D, m.dt_bias, m.norm.weight]
            elif isinstance(s, AttentionShare):
                mods += [s.q.module, s.k.module, s.v.module, s.o.module]
            else:
                mlp = s.shared if isinstance(s, MoeShare) else s
                mods += [mlp.up.module, mlp.down.module]
                if isinstance(s, MoeShare):
                    out += s.experts.partial_expert_tensors()
        out += [p for mod in mods for p in (mod.weight, getattr(mod, "bias", None)) if p is not None]
        return list({id(p): p for p in out}.values())


def divisibility_problems(config, n: int) -> list[str]:
    """Every config field a TP degree ``n`` does not divide, with why it must (empty: shardable)."""
    g = lambda k: getattr(config, k)  # noqa: E731
    types = set(config.layers_block_type)
    need = [("hidden_size", "row-parallel outputs by gather"), ("vocab_size", "vocab-parallel head")]
    if MAMBA in types:
        need += [("mamba_num_heads", "Mamba heads"),
                 ("n_groups", "the gated RMSNorm normalizes per group: a rank holds whole groups")]
    if ATTN in types:
        need += [("num_attention_heads", "attention heads")]
    if MLP in types:
        need += [("intermediate_size", "MLP columns")]
    if MOE in types:
        need += [("n_routed_experts", "experts spread over the ranks"),
                 ("moe_shared_expert_intermediate_size", "shared expert columns")]
    out = [f"{k} = {g(k)} is not divisible by the TP degree {n} ({why})" for k, why in need if g(k) % n]
    if ATTN in types and g("num_key_value_heads") % n and n % g("num_key_value_heads"):
        out.append(f"num_key_value_heads = {g('num_key_value_heads')} and the TP degree {n} must divide one another")
    return out


def _mamba(mod, spec, rank_spec, sharder, hidden: int, p: str) -> MambaShare:
    r, Pm, Ns = sharder.rank, spec.mamba_head_dim, spec.ssm_state
    inter, gn_all = spec.mamba_heads * Pm, spec.n_groups * Ns
    hl = rank_spec.mamba_heads
    il, gn = hl * Pm, rank_spec.n_groups * Ns
    # in_proj rows: [z: inter | x: inter | B: G N | C: G N | dt: heads]; conv channels: [x | B | C]
    rows = {"z": (r * il, il), "x": (inter + r * il, il), "B": (2 * inter + r * gn, gn),
            "C": (2 * inter + gn_all + r * gn, gn), "dt": (2 * inter + 2 * gn_all + r * hl, hl)}
    rows = {k: sharder.column(mod.in_proj, s, s + w, f"{p}.in_proj") for k, (s, w) in rows.items()}
    dev = mod.conv1d.weight.device
    channels = torch.cat([torch.arange(r * il, (r + 1) * il, device=dev),
                          torch.arange(inter + r * gn, inter + (r + 1) * gn, device=dev),
                          torch.arange(inter + gn_all + r * gn, inter + gn_all + (r + 1) * gn, device=dev)])
    return MambaShare(enter=sharder.enter, **rows, out=sharder.row(mod.out_proj, hidden, il, f"{p}.out_proj"),
                      channels=channels, heads=slice(r * hl, (r + 1) * hl), inner=slice(r * il, (r + 1) * il))


def _mlp(mod, sharder, hidden: int, p: str) -> MlpShare:
    inter, r = mod.up_proj.weight.shape[0] // sharder.world, sharder.rank
    return MlpShare(enter=sharder.enter, up=sharder.column(mod.up_proj, r * inter, (r + 1) * inter, f"{p}.up_proj"),
                    down=sharder.row(mod.down_proj, hidden, inter, f"{p}.down_proj"))


def shard(family, lm, spec, sharder) -> NemotronHShard:
    """Rank ``sharder.rank``'s ``NemotronHShard`` of a Nemotron-H causal LM (layout: module docstring).
    Refuses, naming every config field at once, a TP degree that does not divide hidden_size,
    vocab_size, mamba_num_heads, n_groups, num_attention_heads, intermediate_size, n_routed_experts or
    moe_shared_expert_intermediate_size, or that num_key_value_heads and it do not divide one another.
    Invariance: its forward / logits and the engine on it give every rank TP = 1's bits."""
    n, r, who = sharder.world, sharder.rank, sharder.who
    if sharder.data_parallel_experts is not None and sharder.row_parallel != "gather":
        raise ValueError(f"{who}: row_parallel='allreduce' with data_parallel_experts: the stock expert combine is "
                         "built for qwen3_moe only")
    bad = divisibility_problems(lm.config, n)
    if bad:
        raise ValueError(f"{who}: cannot shard at TP = {n}: " + "; ".join(bad) + ". Use a TP degree that divides them")
    hq = spec.num_heads // n
    hkv, kv_lo = kv_heads_of_rank(spec.num_heads, spec.num_kv_heads, n, r, who)
    rank_spec = replace(spec, num_heads=hq, num_kv_heads=hkv, mamba_heads=spec.mamba_heads // n,
                        n_groups=spec.n_groups // n)
    hidden, d = spec.hidden_size // n, spec.head_dim
    layers = []
    for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
        m, kind, p = layer.mixer, spec.block_types[i], f"layers.{i}.mixer"
        if kind == MAMBA:
            share = _mamba(m, spec, rank_spec, sharder, hidden, p)
        elif kind == ATTN:
            share = AttentionShare(enter=sharder.enter,
                                   q=sharder.column(m.q_proj, r * hq * d, (r + 1) * hq * d, f"{p}.q_proj"),
                                   k=sharder.column(m.k_proj, kv_lo * d, (kv_lo + hkv) * d, f"{p}.k_proj"),
                                   v=sharder.column(m.v_proj, kv_lo * d, (kv_lo + hkv) * d, f"{p}.v_proj"),
                                   o=sharder.row(m.o_proj, hidden, hq * d, f"{p}.o_proj"))
        elif kind == MOE:
            share = MoeShare(experts=sharder.experts(m, m.experts.up_proj.shape[0], "n_routed_experts",
                                                     tensors=("up_proj", "down_proj"), activation="relu2"),
                             shared=_mlp(m.shared_experts, sharder, hidden, f"{p}.shared_experts"))
        else:
            share = _mlp(m, sharder, hidden, p)
        layers.append(share)
    return NemotronHShard(family=family, tp=sharder.tp, spec=rank_spec, dtype=sharder.dtype, model=lm,
                          layers=layers, lm_head=sharder.vocab(lm.lm_head))
