"""Gather-only tensor (and expert) parallelism for Nemotron-H: TP = N gives TP = 1's bits.

The rule of ``tensor_parallel`` (the dense family's layout): no rank ever adds a number another rank
computed, so no kernel's canonical order changes. Column-parallel pieces compute each output
element on one rank with the full-K kernel (``ColumnShard``); row-parallel layers run by gather
(``GatherRowShard``); embeddings, every RMSNorm and the residual stream run replicated on full
rows; the LM head is vocab-parallel, gathered. Per block kind (``bitmatch.models.nemotron_h``):

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
  experts spread over the ranks (EP = TP, ``expert_parallel_experts``: the one-rank slot-order
  combine); the shared expert as the MLP.

An indivisible size is refused at shard time, every one at once, by its config field.
``row_parallel="allreduce"`` builds the stock layout instead (out_proj / o_proj / down_proj split
over K, partials all-reduced): not TP-invariant, the control and the speed baseline.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bitmatch.models import compute_dtype_of, family_of, lora, nemotron_h as NH, unwrap_causal_lm
from bitmatch.models.registry import tp_shard

from .collectives import TPGroup, copy_to_ranks
from .expert_parallel import ExpertRows, data_parallel_experts, expert_parallel_experts
from .tensor_parallel import AllreduceRowShard, ColumnShard, GatherRowShard, vocab_parallel_logits


@dataclass
class MambaShard:
    """A Mamba2 mixer on rank r's heads and groups: five in_proj row slices, the per-channel and
    per-head parameters at ``channels`` / ``heads`` / ``inner``, out_proj by gather."""
    module: torch.nn.Module
    z: ColumnShard
    x: ColumnShard
    B: ColumnShard
    C: ColumnShard
    dt: ColumnShard
    out: GatherRowShard | AllreduceRowShard
    channels: torch.Tensor  # the rank's conv channels: its heads' x, its groups' B and C
    heads: slice
    inner: slice  # the rank's heads' channels of z / y (whole norm groups)
    spec: NH.NemotronHSpec  # the rank's
    dtype: torch.dtype

    def __call__(self, h, ctx, i):
        h = copy_to_ranks(h, self.out.tp)
        xbc = torch.cat([self.x(h), self.B(h), self.C(h)], dim=-1)
        w = NH.mamba_weights(self.module, self.dtype, self.channels, self.heads, self.inner)
        return self.out(NH.mamba_mixer(self.z(h), xbc, self.dt(h), ctx, self.spec, i, self.dtype, **w))


@dataclass
class AttentionShard:
    """Attention on rank r's query heads (and its KV heads), o_proj by gather."""
    q: ColumnShard
    k: ColumnShard
    v: ColumnShard
    o: GatherRowShard | AllreduceRowShard
    spec: NH.NemotronHSpec

    def __call__(self, x, ctx, i):
        x = copy_to_ranks(x, self.o.tp)
        T, D = x.shape[0], self.spec.head_dim
        q, k, v = self.q(x).view(T, -1, D), self.k(x).view(T, -1, D), self.v(x).view(T, -1, D)
        return self.o(NH.attend(q, k, v, ctx, self.spec, i).reshape(T, -1))


@dataclass
class MlpShard:
    """down(relu2(up(x))): up_proj by intermediate columns, down_proj by gather."""
    up: ColumnShard
    down: GatherRowShard | AllreduceRowShard

    def __call__(self, x, ctx=None, i=None):
        return self.down(NH.relu2(self.up(copy_to_ranks(x, self.down.tp))))


@dataclass
class MoeShard(ExpertRows):
    """A Nemotron-H MoE block with experts [lo, hi) on this rank: routing and latent projections
    replicated (every rank picks the same experts), the experts through ``expert_parallel_experts``."""
    module: torch.nn.Module
    lo: int
    hi: int
    dtype: torch.dtype
    tp: TPGroup
    shared: MlpShard
    data_parallel: bool = False  # each rank its own tokens (enable_expert_parallel): data_parallel_experts
    num_experts: int = 0  # the layer's routed experts (its expert tensors may hold this rank's only)
    EXPERT_TENSORS = ("up_proj", "down_proj")
    ACTIVATION = "relu2"


    def __call__(self, x, ctx=None, i=None):
        m, dt = self.module, self.dtype
        w, ids = NH.route(m, x)
        h = NH.latent(m.fc1_latent_proj, x, dt)
        args = (ids, w, *self.expert_weights(), self.num_experts, self.tp)
        if self.data_parallel:
            y = data_parallel_experts(h, *args, activation="relu2")
        else:
            y = expert_parallel_experts(copy_to_ranks(h, self.tp), *args, activation="relu2")
        return NH.latent(m.fc2_latent_proj, y, dt) + self.shared(x)


@dataclass
class NemotronHShard:
    """One rank's share of a Nemotron-H model (``shard_nemotron_h``), read from the model's own
    modules at use (the simulation keeps the whole model on every rank)."""
    tp: TPGroup
    spec: NH.NemotronHSpec  # the rank's heads and groups: the family's spec (and caches) while set
    dtype: torch.dtype
    model: torch.nn.Module  # the unwrapped causal LM
    layers: list  # (pre-norm module, mixer shard)
    lm_head: ColumnShard

    def forward_hidden(self, input_ids, ctx, recorder=None):
        """Packed tokens -> final-norm hidden states, the same on every rank. Invariance: bit for
        bit the unsharded model's ``bitmatch.models.forward_hidden``."""
        if recorder is not None:
            raise ValueError("tensor parallel forward: no per-op recorder (bitmatch.verify.locate runs at TP = 1); "
                             "disable_tensor_parallel(model) first")
        NH.check_packed_starts(self.spec, ctx)
        dt = self.dtype
        h = NH.embed(self.model, input_ids, dt)
        for i, (norm, mixer) in enumerate(self.layers):
            h = h + mixer(NH.rms_norm(norm, h, dt), ctx, i)
        return NH.rms_norm(self.model.model.norm_f, h, dt)

    def compute_logits(self, hidden):
        """Full logits on every rank (vocab slices gathered). Invariance: TP = 1's bits."""
        return vocab_parallel_logits(self, hidden)

    def moe_shards(self) -> list:
        return [mixer for _, mixer in self.layers if isinstance(mixer, MoeShard)]

    def partial_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradient on this rank is a part of the whole (``reduce_tp_gradients``
        sums them): every sliced linear (KV heads replicated over ranks: each rank's queries' share),
        the Mamba conv, A_log, D, dt_bias and gated-norm weight (per channel / head), this rank's
        experts and the LM head. The rest (embeddings, block norms, norm_f, router, latent
        projections) run replicated on full rows and get the whole gradient on every rank."""
        mods = [self.lm_head.module]
        out = []
        for _, m in self.layers:
            if isinstance(m, MambaShard):
                mods += [m.z.module, m.out.module, m.module.conv1d]
                out += [m.module.A_log, m.module.D, m.module.dt_bias, m.module.norm.weight]
            elif isinstance(m, AttentionShard):
                mods += [m.q.module, m.k.module, m.v.module, m.o.module]
            else:
                mlp = m.shared if isinstance(m, MoeShard) else m
                mods += [mlp.up.module, mlp.down.module]
                if isinstance(m, MoeShard):
                    out += m.partial_expert_tensors()
        out += [p for mod in mods for p in (mod.weight, getattr(mod, "bias", None)) if p is not None]
        return list({id(p): p for p in out}.values())


def _column(mod, lo: int, hi: int, dt, what: str, cls=ColumnShard, **kw):
    if lora.is_lora_layer(mod) or hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
        raise ValueError(f"shard_nemotron_h: {what} is a PEFT adapter layer; merge the adapters "
                         "(peft merge_and_unload) before sharding")
    return cls(mod, lo, hi, dt, **kw)


def _row(mod, tp: TPGroup, rows: int, kcols: int, dt, what: str, row_parallel: str):
    """A row-parallel layer on this rank: by gather (its ``rows`` output rows, full K) or the stock
    all-reduce layer (its ``kcols`` input columns)."""
    r = tp.rank
    if row_parallel == "gather":
        return _column(mod, r * rows, (r + 1) * rows, dt, what, GatherRowShard, tp=tp)
    return _column(mod, r * kcols, (r + 1) * kcols, dt, what, AllreduceRowShard, tp=tp)


def divisibility_problems(config, n: int) -> list[str]:
    """Every config field a TP degree ``n`` does not divide, with why it must (empty: shardable)."""
    g = lambda k: getattr(config, k)  # noqa: E731
    types = set(config.layers_block_type)
    need = [("hidden_size", "row-parallel outputs by gather"), ("vocab_size", "vocab-parallel head")]
    if NH.MAMBA in types:
        need += [("mamba_num_heads", "Mamba heads"),
                 ("n_groups", "the gated RMSNorm normalizes per group: a rank holds whole groups")]
    if NH.ATTN in types:
        need += [("num_attention_heads", "attention heads")]
    if NH.MLP in types:
        need += [("intermediate_size", "MLP columns")]
    if NH.MOE in types:
        need += [("n_routed_experts", "experts spread over the ranks"),
                 ("moe_shared_expert_intermediate_size", "shared expert columns")]
    out = [f"{k} = {g(k)} is not divisible by the TP degree {n} ({why})" for k, why in need if g(k) % n]
    if NH.ATTN in types and g("num_key_value_heads") % n and n % g("num_key_value_heads"):
        out.append(f"num_key_value_heads = {g('num_key_value_heads')} and the TP degree {n} must divide one another")
    return out


def _kv_heads(spec: NH.NemotronHSpec, n: int, r: int) -> tuple[int, int]:
    """(this rank's KV heads, its first one): sharded, or its query group's head replicated."""
    if spec.num_kv_heads % n == 0:
        return spec.num_kv_heads // n, r * (spec.num_kv_heads // n)
    return 1, (r * (spec.num_heads // n)) // (spec.num_heads // spec.num_kv_heads)


def _mamba(mod, spec: NH.NemotronHSpec, rank_spec: NH.NemotronHSpec, tp: TPGroup, dt, hidden: int, p: str,
           row_parallel: str):
    r, Pm, Ns = tp.rank, spec.mamba_head_dim, spec.ssm_state
    inter, gn_all = spec.mamba_heads * Pm, spec.n_groups * Ns
    hl = rank_spec.mamba_heads
    il, gn = hl * Pm, rank_spec.n_groups * Ns
    # in_proj rows: [z: inter | x: inter | B: G N | C: G N | dt: heads]; conv channels: [x | B | C]
    rows = {"z": (r * il, il), "x": (inter + r * il, il), "B": (2 * inter + r * gn, gn),
            "C": (2 * inter + gn_all + r * gn, gn), "dt": (2 * inter + 2 * gn_all + r * hl, hl)}
    rows = {k: _column(mod.in_proj, s, s + w, dt, f"{p}.in_proj") for k, (s, w) in rows.items()}
    dev = mod.conv1d.weight.device
    channels = torch.cat([torch.arange(r * il, (r + 1) * il, device=dev),
                          torch.arange(inter + r * gn, inter + (r + 1) * gn, device=dev),
                          torch.arange(inter + gn_all + r * gn, inter + gn_all + (r + 1) * gn, device=dev)])
    out = _row(mod.out_proj, tp, hidden, il, dt, f"{p}.out_proj", row_parallel)
    return MambaShard(mod, **rows, out=out, channels=channels, heads=slice(r * hl, (r + 1) * hl),
                      inner=slice(r * il, (r + 1) * il), spec=rank_spec, dtype=dt)


def _mlp(mod, tp: TPGroup, dt, hidden: int, p: str, row_parallel: str) -> MlpShard:
    inter = mod.up_proj.weight.shape[0] // tp.world
    r = tp.rank
    return MlpShard(up=_column(mod.up_proj, r * inter, (r + 1) * inter, dt, f"{p}.up_proj"),
                    down=_row(mod.down_proj, tp, hidden, inter, dt, f"{p}.down_proj", row_parallel))


def shard_nemotron_h(model, tp: TPGroup, compute_dtype: torch.dtype | None = None,
                     row_parallel: str = "gather", data_parallel_experts: TPGroup | None = None) -> NemotronHShard:
    """This rank's ``NemotronHShard`` of a Nemotron-H causal LM (layout: module docstring). Refuses,
    naming every config field at once, a TP degree that does not divide hidden_size, vocab_size,
    mamba_num_heads, n_groups, num_attention_heads, intermediate_size, n_routed_experts or
    moe_shared_expert_intermediate_size, or that num_key_value_heads and it do not divide one another.
    Invariance: ``forward_hidden`` / ``compute_logits`` / ``token_logprobs`` and the engine on the
    shard give every rank TP = 1's bits (``row_parallel="allreduce"``: the stock layout, which does not).
    ``data_parallel_experts`` (``tp`` of one rank): each rank its own tokens, the routed experts over
    that group's ranks (``enable_expert_parallel``)."""
    lm = unwrap_causal_lm(model)
    if tp_shard(lm) is not None:
        raise ValueError("shard_nemotron_h: the model runs tensor parallel already; "
                         "disable_tensor_parallel(model) before sharding it again")
    if row_parallel not in ("gather", "allreduce"):
        raise ValueError(f"shard_nemotron_h: row_parallel must be 'gather' or 'allreduce', got {row_parallel!r}")
    fam = family_of(lm)
    if fam.name != "nemotron_h":
        raise ValueError(f"shard_nemotron_h: family {fam.name!r} is not nemotron_h")
    n, r = tp.world, tp.rank
    dp_ep = data_parallel_experts
    if dp_ep is not None:
        if row_parallel != "gather":
            raise ValueError("shard_nemotron_h: row_parallel='allreduce' with data_parallel_experts: the stock "
                             "expert combine is built for qwen3_moe only")
        if n != 1:
            raise ValueError("shard_nemotron_h: data_parallel_experts needs tp of one rank (data-parallel "
                             "attention); tensor parallel attention with experts over another group is not built")
        total = lm.config.n_routed_experts
        if total % dp_ep.world:
            raise ValueError(f"enable_expert_parallel: n_routed_experts = {total} is not divisible by the EP "
                             f"degree {dp_ep.world}; use a degree that divides it")
    bad = divisibility_problems(lm.config, n)
    if bad:
        raise ValueError(f"shard_nemotron_h: cannot shard at TP = {n}: " + "; ".join(bad)
                         + ". Use a TP degree that divides them")
    spec = fam.build_spec(lm)
    dt = compute_dtype if compute_dtype is not None else compute_dtype_of(lm)
    hq = spec.num_heads // n
    hkv, kv_lo = _kv_heads(spec, n, r)
    rank_spec = replace(spec, num_heads=hq, num_kv_heads=hkv, mamba_heads=spec.mamba_heads // n,
                        n_groups=spec.n_groups // n)
    hidden, vocab, d = spec.hidden_size // n, spec.vocab_size // n, spec.head_dim
    layers = []
    for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
        m, kind, p = layer.mixer, spec.block_types[i], f"layers.{i}.mixer"
        if kind == NH.MAMBA:
            mixer = _mamba(m, spec, rank_spec, tp, dt, hidden, p, row_parallel)
        elif kind == NH.ATTN:
            mixer = AttentionShard(
                q=_column(m.q_proj, r * hq * d, (r + 1) * hq * d, dt, f"{p}.q_proj"),
                k=_column(m.k_proj, kv_lo * d, (kv_lo + hkv) * d, dt, f"{p}.k_proj"),
                v=_column(m.v_proj, kv_lo * d, (kv_lo + hkv) * d, dt, f"{p}.v_proj"),
                o=_row(m.o_proj, tp, hidden, hq * d, dt, f"{p}.o_proj", row_parallel),
                spec=rank_spec)
        elif kind == NH.MOE:
            shared = _mlp(m.shared_experts, tp, dt, hidden, f"{p}.shared_experts", row_parallel)
            total = m.experts.up_proj.shape[0]
            if dp_ep is None:
                e = total // n
                mixer = MoeShard(m, r * e, (r + 1) * e, dt, tp, shared, num_experts=total)
            else:
                e = total // dp_ep.world
                mixer = MoeShard(m, dp_ep.rank * e, (dp_ep.rank + 1) * e, dt, dp_ep, shared, data_parallel=True,
                                 num_experts=total)
        else:
            mixer = _mlp(m, tp, dt, hidden, p, row_parallel)
        layers.append((layer.norm, mixer))
    return NemotronHShard(tp=tp, spec=rank_spec, dtype=dt, model=lm, layers=layers,
                          lm_head=_column(lm.lm_head, r * vocab, (r + 1) * vocab, dt, "lm_head"))
